"""Unit tests of counts.store: the rules both backends share (dedup window, epoch clock, resync checks) and its imports."""

from __future__ import annotations

import ast
import inspect

import pytest

from ngramcache.cache_service.counts import dedup, export, group, leases, store, values, versions
from ngramcache.cache_service.counts.dedup import DedupWindow
from ngramcache.cache_service.counts.values import validate_client_id, validate_seq
from ngramcache.cache_service.counts.versions import EpochClock, check_version
from ngramcache.client.kernel.errors import BatchTooOldError, InvalidArgumentError, NgramCacheError, ResyncRequiredError


def test_dedup_window_refuses_seqs_it_can_no_longer_judge() -> None:
    dedup = DedupWindow(8)
    for seq in (5, 3, 9, 4):
        assert not dedup.seen(seq)
        dedup.record(seq)
    assert dedup.seen(3) and dedup.hwm == 9
    assert not dedup.seen(2)  # 2 > 9 - 8
    with pytest.raises(BatchTooOldError, match="dedup window \\(8\\) behind seq 9") as caught:
        dedup.seen(1)
    assert not caught.value.retriable
    for seq in range(20, 29):
        dedup.record(seq)
    assert dedup.seqs == set(range(21, 29))  # trimmed once over the window: only seqs within it are kept
    assert DedupWindow(8, [3, 7]).hwm == 7


def test_epoch_clock_advances_at_most_once_per_epoch_and_keeps_bounded_history() -> None:
    clock = EpochClock(1000)
    assert (clock.cur, clock.floor) == (1000, 1000)
    assert not clock.tick(1000, 0, 3)  # at most once a millisecond
    assert not clock.tick(1500, 1000, 3)  # the epoch is not over
    assert clock.tick(2000, 1000, 3) and clock.cur == 2000
    assert clock.tick(2001, 0, 3) and clock.tick(2002, 0, 3) and clock.tick(2003, 0, 3)
    assert list(clock.epochs) == [2003, 2002, 2001, 2000] and clock.floor == 2000
    clock = EpochClock(5000)
    assert clock.tick(4000 + 2000, 0, 3)  # versions are bumped by at least one even if time went back
    clock.opened_ms = 0
    assert clock.tick(10, 0, 3) and clock.cur == 6001


def test_check_version_asks_for_resync_outside_the_history() -> None:
    check_version("ns", 5, 5, 9)
    check_version("ns", 9, 5, 9)
    for since in (4, 10):
        with pytest.raises(ResyncRequiredError, match="resync"):
            check_version("ns", since, 5, 9)


def test_client_ids_and_seqs() -> None:
    assert validate_client_id("worker-7f3a:1@host/x") == "worker-7f3a:1@host/x"
    assert validate_seq(2**53 - 1) == 2**53 - 1
    for client_id in ("", "has space", "x" * 129, 5):
        with pytest.raises(InvalidArgumentError):
            validate_client_id(client_id)  # type: ignore[arg-type]
    for seq in (-1, 2**53, 1.5, True):
        with pytest.raises(InvalidArgumentError):
            validate_seq(seq)  # type: ignore[arg-type]


def test_every_error_says_whether_a_retry_can_help() -> None:
    from ngramcache.client.kernel import errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, NgramCacheError)]
    assert {c.__name__ for c in classes} >= {"NamespaceNotFoundError", "BatchTooOldError",
                                             "StoreAuthenticationError", "SnapshotFormatError"}
    retriable = {c.__name__ for c in classes if c.retriable}
    assert retriable == {"BackendUnavailableError", "OverloadedError", "LeaseHeldError", "LeaseLostError",
                         "ServiceUnreachableError", "ConnectTimeoutError"}  # later: a rebuild, a shed push, a service up


@pytest.mark.parametrize("module", [store, group, values, dedup, versions, leases, export], ids=lambda m: m.__name__)
def test_the_interface_module_never_imports_a_backend(module: object) -> None:
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if "embedded" in m or "redis" in m or "factory" in m}


def test_the_values_callers_take_with_the_store_import_from_it() -> None:
    for name in ("ApplyResult", "ChangeSet", "CountsStore", "GroupItem", "ItemOutcome", "Lease", "CommittedGeneration",
                 "validate_client_id", "validate_seq"):
        assert name in store.__all__ and getattr(store, name) is not None, name
