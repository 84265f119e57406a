"""tests/bench/lib/llama_server.py and build_llama_server.py: the timings of a /completion response, the build's cache key
and flags, and a server that dies at start. No llama-server build needed."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.engines import build_llama_server as bls
from bench.lib import llama_server as ls

ROOT = Path(__file__).resolve().parents[2]


# A response of this llama-server with drafting (the fields its server_slot_stats::to_json writes).
DRAFTED = {"content": "x", "timings": {"cache_n": 12, "prompt_n": 300, "prompt_ms": 150.5, "prompt_per_token_ms": 0.5,
                                       "prompt_per_second": 1993.4, "predicted_n": 128, "predicted_ms": 700.0,
                                       "predicted_per_token_ms": 5.5, "predicted_per_second": 181.4, "draft_n": 90,
                                       "draft_n_accepted": 60}}


def test_timings_with_drafts() -> None:
    t = ls.parse_timings(DRAFTED)
    assert (t.prompt_n, t.predicted_n, t.draft_n, t.draft_n_accepted) == (300, 128, 90, 60)
    assert t.steps == 128 - 1 - 60
    assert t.ms_per_step == pytest.approx(700.0 / 67)


def test_timings_without_drafts_count_none() -> None:
    plain = {"timings": {k: v for k, v in DRAFTED["timings"].items() if not k.startswith("draft_")}}
    t = ls.parse_timings(plain)
    assert (t.draft_n, t.draft_n_accepted, t.steps) == (0, 0, 127)


def test_timings_of_a_single_token_have_no_step() -> None:
    t = ls.parse_timings({"timings": {**DRAFTED["timings"], "predicted_n": 1, "draft_n": 0, "draft_n_accepted": 0}})
    assert t.steps == 0 and t.ms_per_step == 0.0


@pytest.mark.parametrize("response, message", [
    ({"content": "x"}, "no timings"),
    ({"timings": [1, 2]}, "no timings"),
    ({"timings": {**DRAFTED["timings"], "predicted_ms": "7"}}, "timings.predicted_ms is '7'"),
    ({"timings": {**DRAFTED["timings"], "draft_n": True}}, "timings.draft_n is True"),
    ({"timings": {k: v for k, v in DRAFTED["timings"].items() if k != "predicted_n"}}, "timings.predicted_n is None"),
])
def test_bad_timings_are_a_server_error(response: dict, message: str) -> None:
    with pytest.raises(ls.ServerError, match=message):
        ls.parse_timings(response)


def test_cache_key_changes_with_what_changes_the_binary() -> None:
    args = bls.SERVER_CMAKE_ARGS
    key = bls.cache_key(args, "gcc 12", "linux-x86_64")
    assert key == bls.cache_key("  " + args.replace(" ", "   "), "gcc 12", "linux-x86_64")  # spacing does not count
    assert key != bls.cache_key(args + " -DGGML_AVX512=ON", "gcc 12", "linux-x86_64")
    assert key != bls.cache_key(args, "gcc 13", "linux-x86_64")
    assert key != bls.cache_key(args, "gcc 12", "linux-aarch64")


def test_server_flags_are_portable_and_self_contained() -> None:
    flags = bls.SERVER_CMAKE_ARGS.split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=OFF" in flags and "-DGGML_AMX_INT8=OFF" in flags
    assert "-DGGML_AVX2=ON" in flags and "-DBUILD_SHARED_LIBS=OFF" in flags and "-DLLAMA_CURL=OFF" in flags
    assert not any("march=native" in f or f.startswith("-DLLAVA_BUILD") for f in flags)


def test_a_server_that_exits_at_start_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ls.ServerError, match="exited with 1 before it was ready"):
        ls.LlamaServer(Path("/bin/false"), tmp_path / "model.gguf", [], tmp_path / "server.log", timeout=10)
