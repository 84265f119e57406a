"""The client's kernel: what every other part stands on, with no network in it (no grpc import).

- `errors`: the error classes (`NgramCacheError` and its subclasses), one per way a call fails.
- `rows`: the count-delta row layout shared by the client, the wire and the store.
- `files`: atomic writes and checked reads of files on disk.
- `tokenizer`: tokenizer specs, fingerprints and loading.
- `corpus`, `token_files`, `sglang_corpus`: the inputs of a static build (text, token files, SGLang corpora).
- `build`: `build_static_from_tokens`, a static cache file from token streams.
- `static_files`: opening and checking static cache files.
- `history_buffer`, `history_sources`: the fleet history's records, groups and source ids.
- `retry`: the one backoff and retry loop every caller uses.
- `progress`, `tasks`: progress lines for long work; cancelling asyncio tasks.

Rule (tests/unit/test_layers.py): the kernel imports only itself and the compiled core (`_core`).
"""
