"""Thin gRPC servicers: each translates proto messages to domain calls and back."""
