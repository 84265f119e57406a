"""The client's wire: what talks gRPC, and nothing that keeps state between calls.

- `transport`: channels, credentials, the failover channel (its retries are `kernel.retry`'s).
- `rpc_errors`: gRPC status codes to and from the kernel's error classes.
- `codec`: tokens and count deltas to and from the bytes the protos carry.
- `address`: checking `host:port` addresses; `diagnose`: one-line reasons for a server that does not answer.

Rule (tests/unit/test_layers.py): the wire imports only the kernel, itself, the generated protos (`_proto`)
and the compiled core.
"""
