"""The generated gRPC code of the wire contract ngramcache.v1 (in v1/, from proto/ by `python proto/generate.py`) and its codec."""
