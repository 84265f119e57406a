"""tests/bench/bench_fleet_history_service.py's ServiceFleet: the replay through a real service and real clients
carries one replica's output to another's drafts, and times it. A few seconds of real-time replay."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers.service import ServiceThread

from bench.bench_fleet_history_service import ServiceFleet
from bench.lib import fleet_sim as fs
from bench.lib.fleet_setups import MatchLocal
from ngramcache import UNTAGGED, AdminClient

pytestmark = [pytest.mark.integration, pytest.mark.slow]

VOCAB = 1000


def replay(tmp_path: Path, namespaces: list[str]) -> tuple[fs.Result, fs.Result]:
    """Every request writes the same random output after a prompt of its own; they arrive one a
    second, alternating between two real clients on `namespaces` (one each, or one shared), so a
    request can only draft its output from what earlier requests left where its client reads.
    Returns the real replay and a local-only simulation of it."""
    out = np.random.default_rng(3).integers(0, 800, 60).astype(np.int32)
    reqs = [fs.Request(g, np.array([900 + g, 950 + g], dtype=np.int32), out) for g in range(3)]
    sched = fs.Schedule(interval_ms=1000, step_ms=5, routing="round-robin")
    with ServiceThread(tmp_path / "data") as service:
        address = f"127.0.0.1:{service.port}"
        with AdminClient(address, timeout=30) as admin:
            for ns in sorted(set(namespaces)):
                admin.create_namespace(ns, (UNTAGGED, VOCAB))
        fleet = ServiceFleet(2, address, namespaces, VOCAB, tmp_path / "cache", sched.step_ms,
                             {r.prompt.tobytes(): r.group for r in reqs})
        try:
            real = fs.simulate(reqs, fleet, sched)
        finally:
            fleet.close()
    return real, fs.simulate(reqs, MatchLocal(2, VOCAB), sched)


def test_a_replicas_output_reaches_the_other_replicas_drafts_through_the_service(tmp_path: Path) -> None:
    real, local = replay(tmp_path, ["bench", "bench"])
    steps = [s for _, s, _, _ in real.per_request]
    # The second request is the first on replica 1: locally it has nothing to draft from.
    assert local.per_request[1][1] > 30
    assert steps[1] < 20, steps
    extra = real.extra
    assert 0 < extra["mirror_lag_p50"] < 1000
    assert extra["pulled_tokens_per_client"] >= 60
    assert extra["history_dropped"] == 0


def test_siloed_clients_draft_nothing_from_each_other(tmp_path: Path) -> None:
    # The real siloed baseline (--siloed): each client on a namespace of its own, so replica 1's
    # first request has nothing to draft its output from, as a local drafter.
    real, _ = replay(tmp_path, ["silo0", "silo1"])
    steps = [s for _, s, _, _ in real.per_request]
    assert steps[1] > 30, steps  # no sharing: it decodes its output token by token, or nearly
    assert steps[2] < 20, steps  # replica 0's own earlier output still drafts its next request
    assert real.extra["pulled_tokens_per_client"] == 0
