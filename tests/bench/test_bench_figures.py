"""The benchmarks' figures compare like with like: the same unit for a measurement and its baselines, and each
ratio against the baseline doing the same work (tests/bench/bench_counts_store.py, tests/bench/bench_service.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", ROOT / "tests" / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def counts_bench() -> ModuleType:
    return bench_module("bench_counts_store")


@pytest.fixture(scope="module")
def service_bench() -> ModuleType:
    return bench_module("bench_service")


def test_apply_group_and_its_baselines_are_rated_in_raw_delta_rows(counts_bench: ModuleType) -> None:
    """The baselines send entries that encode_batch summed from repeated rows: each counts the rows it stands for."""
    from ngramcache.cache_service.counts.layout import encode_batch
    from ngramcache.cache_service.counts.namespace import NamespaceRecord
    from ngramcache.client.kernel.rows import COUNT

    rows = counts_bench.make_deltas(np.random.default_rng(1), 20_000)
    info = NamespaceRecord("ns", counts_bench.FP.hex(), counts_bench.VOCAB, 1024, 1, "i")
    enc = encode_batch(rows, info)
    assert len(enc.counts) < len(rows)  # Zipf tokens repeat: fewer entries than rows
    as_rows = counts_bench.raw_deltas_per_second(rows[:, COUNT], 2.0)
    as_entries = counts_bench.raw_deltas_per_second(enc.counts, 2.0)
    assert as_rows == as_entries == len(rows) / 2.0


def test_the_ingest_headline_is_against_pipelined_hincrby(counts_bench: ModuleType) -> None:
    lines = counts_bench.ingest_lines(grouped=400_000, plain=125_000, naive=8_000, n_deltas=1 << 20, rows_per_entry=1.09)
    text = "\n".join(lines)
    assert "every row rated in raw delta rows/s" in lines[0] and "1.090 raw rows an entry" in lines[0]
    assert re.search(r"baseline: plain HINCRBY pipelined .* 125,000 deltas/s +apply_group 3\.20x", text), text
    assert re.search(r"context only: one HINCRBY round trip per entry .* 8,000 deltas/s +apply_group 50\.0x", text), text


def test_the_aggregation_target_is_against_apply_group(service_bench: ModuleType) -> None:
    med = {"direct": 400_000.0, "direct_group": 500_000.0, "one": 480_000.0, "many": 550_000.0}
    lines = service_bench.push_lines(med, 8)
    one = next(line for line in lines if line.startswith("service, 1 client"))
    many = next(line for line in lines if line.startswith("service, 8 clients"))
    assert "1.20x direct single (target >= 0.8x)" in one
    assert re.search(r"1\.10x direct apply_group \(target > 1x", many), many
    assert "1.38x direct single)" in many  # the one-batch-a-call figure stays, as context
