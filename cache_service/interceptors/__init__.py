"""gRPC server interceptors: one cross-cutting concern each (errors, auth, logging, metrics)."""
