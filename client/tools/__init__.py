"""Operator programs built on the library: the `ngramcache` command line and the processes it runs.

- `cli`: the command line (its subcommands, arguments and printing).
- `llama_follow`, `http_proxy`: llama-follow, a llama-server kept on a namespace's newest generation behind a proxy.
- `sglang_sync`, `sglang_http`: sglang-sync, SGLang servers' external corpora kept on the newest generation.

Rule (tests/unit/test_layers.py): tools may import every other part of the client; nothing in the
library imports tools (in cache_service only its command line, admin commands and demo may).
"""
