"""What the tests share: real servers to start (redis, gRPC, the service), corpora and tokenizers, reference implementations.

Modules, one concept each:

- `corpus`: the vocabulary and fingerprint of the raw-token tests, the fast client options, seeded corpora.
- `counts`: count rows and batches for the counts-store tests, and the backends its contract runs on.
- `service`: the service in a thread (`ServiceThread`), `ngramcache serve` processes, bare gRPC servers, `wait_until`.
- `redis_servers`: real redis-server processes and a real Redis Cluster, free loopback ports.
- `tls`: a throwaway PKI for the TLS tests.
- `auth`: the bearer tokens of the auth tests and their tokens file.
- `fleet`: replicas and worker processes of the fleet fault and overload tests.
- `model`: the real model (SmolLM2-135M-Instruct) of the engine tests and its prompts.
- `reference`: reference implementations (llama.cpp's drafting and counting, in Python) the core is checked against.
- `isa_check`: the x86-64 instruction-set check of the portability tests.
- `isolation`: the pytest hooks that run `engine` tests in a child process.
- `cli`: the `ngramcache` command run as the CLI tests run it, and the inputs they share.
- `static_store`: static files to publish and the StaticStore calls of its unit tests.
- `rebuild`: namespaces, pushes, publishes and rebuilds of the rebuild tests, and the counts they compare.
- `rpc_calls`: stubs of the service's gRPC services and one complete call of each RPC (the auth and TLS tests).
- `deploy`: deploy/ read as the deployment tests read it (manifests, compose file, Dockerfile).

The fixtures built on them are in tests/conftest.py. A few modules here also define fixtures that several
test modules of one topic share (`cli`, `static_store`): a test module imports such a fixture by its name
(``from helpers.cli import files as files``), never under a name a conftest.py gives a fixture.
pyproject.toml puts tests/ on the path (``pythonpath``), so tests import ``helpers.<module>``.
"""
