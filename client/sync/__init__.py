"""NgramClient and the background sync behind it, one concept a module.

- `config`: `ClientConfig`, the client's settings.
- `state`: what the sync tasks share (the failover channel, counters, how a task is retried).
- `static_sync`: the namespace's newest static generation, fetched once per node and attached.
- `mirror`: the dynamic table kept a copy of the service's draft view (or of every count).
- `pusher`: accepted n-gram deltas, buffered (bounded) and pushed exactly once.
- `attempt`: whether a batch given up may have been stored (shared by the pusher and the history publisher).
- `history`: the fleet history's publisher: accepted records buffered, grouped, pushed exactly once; live groups.
- `history_mirror`: the fleet history pulled (live groups first, then the namespace's tail) into the drafter.
- `history_sources`: the source id of each mirrored run, and which offsets of a remote sequence are held.
- `health`: failover from a replica that hangs or says NOT_SERVING.
- `client`: `NgramClient`, the synchronous facade that owns the background thread.

The channel, credentials and the wire error mapping are `ngramcache.client.wire.transport`'s; the retry loop
and `Backoff` are `ngramcache.client.kernel.retry`'s.
"""

from ngramcache.client.kernel.retry import Backoff
from ngramcache.client.sync.client import NgramClient
from ngramcache.client.sync.config import ClientConfig, HasTokenizer
from ngramcache.client.sync.pusher import aggregate_rows
from ngramcache.client.wire.transport import channel_credentials, error_from_rpc

__all__ = ["Backoff", "ClientConfig", "HasTokenizer", "NgramClient", "aggregate_rows", "channel_credentials",
           "error_from_rpc"]
