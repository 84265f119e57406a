"""GENERATED modules of package ngramcache.v1 (`python proto/generate.py`); the .proto files in proto/ngramcache/v1/ are the source."""
