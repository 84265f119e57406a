"""`ngramcache demo`, served: a service, a published generation, and two worker processes sharing counts through it.

- `steps`: `run_demo` and the served steps.
- `worker`: the worker process, and `WorkerProcess`, the demo's handle on it.

The service runs in this process (`ngramcache.cache_service.service_thread.ServiceThread`).
The steps after the client's local build and replay (`ngramcache.client.tools.cli.run_local_demo`):
start the service in this process (its own asyncio loop on a thread, a free loopback port,
the embedded counts store), publish the cache as generation 1 of two namespaces, start two
worker processes that draft locally with `NgramClient`, replay overlapping held-out files
through them with and without each other's counts, measure how long an accepted n-gram
takes to reach the other worker's drafts, and draft one file over a remote Session.

Everything started here is stopped here, also on Ctrl-C: the workers run in sessions of
their own (the terminal's Ctrl-C reaches only this process, which terminates them) and
exit by themselves when this process dies (their stdin closes).
"""

from .steps import run_demo
from .worker import worker_main

__all__ = ["run_demo", "worker_main"]
