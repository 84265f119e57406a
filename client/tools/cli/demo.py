"""`ngramcache demo`'s local part: build a cache from CPython's standard library and replay held-out files (the service adds its steps in ngramcache.cache_service.demo)."""

from __future__ import annotations

import argparse
import shutil
import signal
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ngramcache.client._core import UNTAGGED, CountTable, StaticCache, replay
from ngramcache.client.kernel.build import build_static_from_tokens
from ngramcache.client.kernel.errors import InvalidArgumentError


def _byte_tokens(path: Path) -> np.ndarray:
    """A file's bytes as tokens (vocabulary 256): the demo needs no tokenizer download."""
    return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)


def demo_inputs(test_files: int, n_ctx: int) -> tuple[Path, list[Path], list[Path]]:
    """CPython's standard library as the demo's corpus: (its folder, `test_files` held-out files, the corpus files).

    Raises:
        InvalidArgumentError: no standard library found, or the held-out files are not longer than `n_ctx`.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    files = sorted(p for p in lib.rglob("*.py") if not skip.intersection(p.relative_to(lib).parts) and p.stat().st_size > 2000)
    if len(files) < 50:
        raise InvalidArgumentError(f"found only {len(files)} Python files under {lib}; the demo needs a standard library")
    held_out, corpus_files = files[::20][:test_files], [f for i, f in enumerate(files) if i % 20]
    n_test = sum(p.stat().st_size for p in held_out)
    if n_test <= n_ctx:
        raise InvalidArgumentError(f"the {len(held_out)} held-out files hold {n_test:,} tokens, not more than "
                                   f"--n-ctx {n_ctx}: pass a smaller --n-ctx or a larger --test-files")
    return lib, held_out, corpus_files


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ctrl-C is ignored inside (for cleaning up after a first one: a second must not leave half of it undone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def demo_workdir(workdir: str | None) -> Iterator[Path]:
    """The demo's work folder: `workdir` (created if missing, kept), or a new temporary folder removed on the
    way out, also on Ctrl-C or an error."""
    if workdir is not None:
        if Path(workdir).exists() and not Path(workdir).is_dir():
            raise InvalidArgumentError(f"--workdir {workdir} is not a folder")
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    folder = Path(tempfile.mkdtemp(prefix="ngramcache-demo-"))
    try:
        yield folder
    finally:
        with sigint_ignored():
            shutil.rmtree(folder, ignore_errors=True)


def run_local_demo(args: argparse.Namespace, workdir: Path, inputs: tuple[Path, list[Path], list[Path]]) -> Path:
    """The demo's first step: builds `workdir`/stdlib.ngc (generation 1) from the corpus of `inputs`
    (`demo_inputs`) and replays its held-out files through the local drafter, printing what it does.
    Returns the cache."""
    lib, held_out, corpus_files = inputs
    out = workdir / "stdlib.ngc"
    args.guard.expect(str(out))
    print(f"corpus: {len(corpus_files)} files of CPython's standard library ({lib}), byte tokens (vocabulary 256)")
    t0 = time.perf_counter()
    streams = [_byte_tokens(p) for p in corpus_files]
    build_static_from_tokens(streams, str(out), vocab_size=256, ngram_size=2, fingerprint=UNTAGGED, generation=1)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = StaticCache.open(str(out))
    t_open = (time.perf_counter() - t0) * 1e3
    n_tokens = sum(len(s) for s in streams)
    print(f"built {out}: {cache.n_keys:,} keys, {cache.n_followers:,} followers from {n_tokens:,} tokens "
          f"in {t_build:.2f} s; {cache.file_size / 1e6:.2f} MB; opened in {t_open:.3f} ms")

    test = np.concatenate([_byte_tokens(p) for p in held_out])
    print(f"replaying {len(test):,} held-out tokens ({len(held_out)} files) as llama-lookup-stats does "
          f"(n_ctx={args.n_ctx}, n_draft={args.n_draft}):")
    print(f"  {'tables':<26}{'drafted':>10}{'accepted':>10}{'accept %':>10}{'us/drafted':>12}")
    for label, static in (("context + dynamic", None), ("context + dynamic + static", cache)):
        r = replay(test, args.n_ctx, args.n_draft, 1, 4, static, CountTable())
        pct = 100.0 * r["n_accept"] / max(r["n_drafted"], 1)
        us = r["t_draft_ns"] / 1e3 / max(r["n_drafted"], 1)
        print(f"  {label:<26}{r['n_drafted']:>10,}{r['n_accept']:>10,}{pct:>10.1f}{us:>12.3f}")
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    inputs = demo_inputs(args.test_files, args.n_ctx)
    with demo_workdir(args.workdir) as workdir:
        out = run_local_demo(args, workdir, inputs)
        if args.workdir is not None:
            print(f"the cache stays at {out}; try: ngramcache inspect {out}")
    if args.workdir is None:
        print(f"removed {workdir} (--workdir DIR keeps the cache)")
    return 0

