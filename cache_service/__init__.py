"""ngramcache's service side: the dynamic counts store and (later) the gRPC server."""
