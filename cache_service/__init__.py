"""ngramcache's service side: the gRPC server (`server.create_server`), its servicers and interceptors, the counts store (`counts/`), static generations, rebuilds and the service's commands."""
