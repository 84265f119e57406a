"""The served steps of `ngramcache demo`: start the service, publish, share counts between two workers, measure, draft remotely."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import logging
import signal
import socket
import statistics
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ngramcache.client.kernel.errors import InvalidArgumentError, NgramCacheError
from ngramcache.client.tools import cli as client_cli

from ..config import ServiceConfig
from ..service_thread import ServiceThread
from .worker import PROBE_TIMEOUT, VOCAB, WorkerProcess

FLEET, SOLO = "fleet", "solo"  # A and B share FLEET; B's baseline drafts from SOLO, where A never pushes
# The same two in the match mode, where the fleet history is on: A's generated sequences reach B's drafter.
MATCH, MATCH_SOLO = "fleet-match", "solo-match"
SERVICE_DIR, NODE_DIR = "service", "node-cache"  # under the work folder
# Times A accepts a probe's n-gram. The drafter's strict thresholds want a 4-gram seen twice; the
# service's draft view raises its key minimum while the fleet pushes faster than its rate budget
# (x2 after A's replay here), so a probe that counts as a frequent n-gram stays visible whatever it is.
MARK_REPEATS = 32


@contextlib.contextmanager
def _interrupted_once() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt once; later ones are ignored, so cleaning up is not cut short
    (a terminal's Ctrl-C or `timeout` signal the process and its group: the same signal may arrive twice)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def interrupt(sig: int, frame: object) -> None:
        if not fired:
            fired.append(sig)
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _prepare(port: int, cache: Path) -> None:
    """Creates both namespaces (byte tokens) and publishes ``cache`` as generation 1 of each, as an operator would
    (`ngramcache.AdminClient`, what `ngramcache namespace create` and `ngramcache publish` use)."""
    from ngramcache import UNTAGGED, AdminClient

    with AdminClient(f"127.0.0.1:{port}", timeout=30) as admin:
        for namespace in (FLEET, SOLO, MATCH, MATCH_SOLO):
            admin.create_namespace(namespace, (UNTAGGED, VOCAB))
            admin.publish(namespace, cache)


async def _remote_session(port: int, text: np.ndarray, n_draft: int) -> tuple[int, int, int, int, float]:
    """Drafts `text` over one Session as a model consuming it would (each step sends what the model accepted of
    the draft plus its own next token). Returns (generation, tokens generated, steps, accepted, p50 step s)."""
    from grpc import aio

    from ngramcache import UNTAGGED
    from ngramcache.client._proto.v1 import drafting_pb2, drafting_pb2_grpc
    from ngramcache.client.wire.codec import bytes_to_tokens, tokens_to_bytes

    async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        requests: asyncio.Queue[drafting_pb2.SessionRequest | None] = asyncio.Queue()

        async def stream() -> AsyncIterator[drafting_pb2.SessionRequest]:
            while (item := await requests.get()) is not None:
                yield item

        call = drafting_pb2_grpc.DraftingStub(ch).Session(stream())
        await requests.put(drafting_pb2.SessionRequest(open=drafting_pb2.SessionOpen(
            namespace=FLEET, tokenizer_fingerprint=UNTAGGED, vocab_size=VOCAB, n_draft=n_draft)))
        opened = (await call.read()).opened
        n, steps, accepted, latencies = 64, 0, 0, []
        step_tokens = text[:n]
        while n < len(text):
            t0 = time.perf_counter()
            await requests.put(drafting_pb2.SessionRequest(step=drafting_pb2.SessionStep(tokens=tokens_to_bytes(step_tokens))))
            draft = bytes_to_tokens((await call.read()).draft.tokens)
            latencies.append(time.perf_counter() - t0)
            ok = 0
            while ok < len(draft) and n + ok < len(text) and draft[ok] == text[n + ok]:
                ok += 1
            accepted += ok
            step_tokens = text[n:n + ok + 1]
            n += ok + 1
            steps += 1
        await requests.put(None)
        return opened.generation, len(text) - 64, steps, accepted, float(np.percentile(latencies, 50))


def _check_port(host: str, port: int) -> None:
    """Raises the service's own one-line OSError when `port` has a listener already (before gRPC, which would
    also log a line of its own)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: a TIME_WAIT port is free
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(errno.EADDRINUSE, f"cannot listen on {host}:{port}: {(e.strerror or str(e)).lower()} "
                          "(another server on that port? --port 0 picks a free one)") from None


def _split(held_out: list[Path]) -> tuple[list[Path], list[Path]]:
    """A's files and B's: B's overlap A's by a third of the held-out files (all of them below 3 files)."""
    k = len(held_out) // 3
    return held_out[:len(held_out) - k], held_out[k:]


def _figures(files: list[list[int]], which: list[int] | None = None) -> tuple[int, int, int, int]:
    """(drafted, accepted, steps, generated) summed over the files (indices `which`, default all)."""
    rows = [files[i] for i in (range(len(files)) if which is None else which)]
    return tuple(sum(r[j] for r in rows) for j in range(4))  # type: ignore[return-value]


def _per_step(files: list[list[int]], which: list[int] | None = None) -> float:
    """Tokens generated per model step (one draft verified, the accepted prefix plus the model's own token)."""
    _, _, steps, generated = _figures(files, which)
    return generated / max(steps, 1)


def _pct(accepted: int, drafted: int) -> float:
    return 100.0 * accepted / max(drafted, 1)


def _say(text: str, indent: str = "") -> None:
    """Prints `text` wrapped at 110 columns, continuation lines indented two more spaces."""
    print(textwrap.fill(text, 110, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False,
                        break_long_words=False), flush=True)


def _n(k: int, noun: str) -> str:
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _serve_and_share(args: argparse.Namespace, workdir: Path, cache: Path, held_out: list[Path]) -> None:
    """The served steps, printing as they go; everything started is stopped on the way out."""
    logging.getLogger("ngramcache").setLevel(logging.WARNING)
    workers: list[WorkerProcess] = []
    service: ServiceThread | None = None
    try:
        # The workers import numpy, grpc and the core while the service starts.
        for name in ("A", "B"):
            workers.append(WorkerProcess(name, workdir / f"worker-{name}.log"))
        a, b = workers
        config = ServiceConfig(port=args.port, data_dir=str(workdir / SERVICE_DIR))
        service = ServiceThread(config).start()
        port = service.port
        _prepare(port, cache)
        _say(f"serving it: ngramcache.v1 on 127.0.0.1:{port} (embedded counts store in {config.data_dir}); "
             f"published {cache.name} as generation 1 of namespaces {FLEET}, {SOLO}, {MATCH} and {MATCH_SOLO}")
        _share(args, workdir, port, a, b, held_out, config.mirror_interval)
        _share_history(args, workdir, port, a, b, held_out)
        for w in workers:
            w.close()

        text = np.frombuffer(_split(held_out)[1][0].read_bytes(), dtype=np.uint8).astype(np.int32)[:4000]
        if len(text) > 64:
            gen, generated, steps, _, p50 = service.run(_remote_session(port, text, args.n_draft), 120)
            _say(f"a thin client drafting over gRPC instead (a Session on {FLEET}, generation {gen}, no tables of its "
                 f"own): {generated:,} tokens in {steps:,} steps = {generated / steps:.2f} tokens per step; step "
                 f"latency p50 {p50 * 1e6:.0f} us over loopback")
    finally:
        with client_cli.sigint_ignored():
            for w in workers:
                w.stop()
            if service is not None:
                service.stop(grace=0.5)


def _share(args: argparse.Namespace, workdir: Path, port: int, a: WorkerProcess, b: WorkerProcess,
           held_out: list[Path], mirror_s: float) -> None:
    address, node = f"127.0.0.1:{port}", str(workdir / NODE_DIR)
    files_a, files_b = _split(held_out)
    shared = [i for i, f in enumerate(files_b) if f in files_a]
    others = [i for i, f in enumerate(files_b) if f not in files_a]

    # Both workers start at once on one node: one downloads generation 1, the other waits on the node's lock.
    for w in (a, b):
        w.send("connect", address=address, namespace=FLEET, cache_dir=node)
    conn = {w.name: w.reply(120) for w in (a, b)}
    push_s, pull_s = conn["A"]["push_interval"], conn["A"]["pull_interval"]
    _say(f"two worker processes, A (pid {a.pid}) and B (pid {b.pid}), draft locally with NgramClient on one node "
         f"(generation files in {node}; push every {push_s:g} s, pull every {pull_s:g} s; the service refreshes its "
         f"mirror every {mirror_s:g} s):")
    downloads = sum(c["downloads"] for c in conn.values())
    for name, c in conn.items():
        other = "B" if name == "A" else "A"
        how = (f"downloaded it ({_mb(c['downloaded_bytes'])}, verified, installed)" if c["downloads"]
               else f"found it installed by {other}")
        mapped = ", ".join(Path(m).relative_to(node).as_posix() if m.startswith(node) else m for m in c["mapped"])
        _say(f"{name}: generation {c['generation']} of {FLEET} ready in {c['seconds']:.2f} s: {how}; maps "
             f"{mapped or '-'}", "  ")
    _say(f"{_n(downloads, 'download')} of generation 1 of {FLEET} for the node", "  ")

    n_tokens = {f: f.stat().st_size for f in held_out}
    _say(f"A replays {len(files_a)} held-out files ({sum(n_tokens[f] for f in files_a):,} tokens), then B "
         f"{len(files_b)} ({sum(n_tokens[f] for f in files_b):,} tokens; {len(shared)} of these files A replayed too), "
         f"as llama-lookup-stats simulates a model: requests of up to {args.n_ctx} tokens, n_draft "
         f"{args.n_draft}; us/drafted is the time in draft() calls from Python:", "  ")
    ra = a.request("replay", namespace=FLEET, files=[str(f) for f in files_a], n_ctx=args.n_ctx, n_draft=args.n_draft)
    last = _random_ngram(np.random.default_rng(7))  # A's last accept: B's shared run starts once it drafts it
    a.request("mark", namespace=FLEET, tokens=last["tokens"])
    flushed = a.request("flush", namespace=FLEET)
    solo = b.request("connect", address=address, namespace=SOLO, cache_dir=node, timeout=120)
    rb_solo = b.request("replay", namespace=SOLO, files=[str(f) for f in files_b], n_ctx=args.n_ctx,
                        n_draft=args.n_draft)
    rb_fleet = b.request("replay", namespace=FLEET, files=[str(f) for f in files_b], n_ctx=args.n_ctx,
                         n_draft=args.n_draft, after={"probe": last["probe"], "follower": last["follower"]})

    print(f"  {'worker':<8}{'dynamic counts from':<30}{'drafted':>9}{'accepted':>10}{'accept %':>10}"
          f"{'tokens/step':>13}{'us/drafted':>12}")
    rows = [("A", f"its own ({FLEET})", ra), ("B", f"its own ({SOLO}): no sharing", rb_solo),
            ("B", f"its own + A's ({FLEET}): sharing", rb_fleet)]
    for name, label, r in rows:
        drafted, accepted, steps, generated = _figures(r["files"])
        print(f"  {name:<8}{label:<30}{drafted:>9,}{accepted:>10,}{_pct(accepted, drafted):>10.1f}"
              f"{generated / max(steps, 1):>13.2f}{r['t_draft'] * 1e6 / max(drafted, 1):>12.3f}")
    drafted_solo, accepted_solo = _figures(rb_solo["files"])[:2]
    drafted_fleet, accepted_fleet = _figures(rb_fleet["files"])[:2]
    parts = [f"{_per_step(rb_solo['files'], which):.2f} -> {_per_step(rb_fleet['files'], which):.2f} on {what}"
             for what, which in ((f"{_n(len(shared), 'file')} A replayed too", shared), (_n(len(others), "other file"), others))
             if which]
    more = drafted_fleet - drafted_solo
    why = (f" Accept % falls: with A's counts B drafts {more:,} more tokens, {_pct(accepted_fleet - accepted_solo, more):.0f}% "
           "of them accepted." if more > 0 and _pct(accepted_fleet, drafted_fleet) < _pct(accepted_solo, drafted_solo) else "")
    _say(f"sharing: on the same text B accepts {100 * (accepted_fleet / max(accepted_solo, 1) - 1):+.1f}% drafted tokens "
         f"({accepted_solo:,} -> {accepted_fleet:,}), {_per_step(rb_solo['files']):.2f} -> "
         f"{_per_step(rb_fleet['files']):.2f} tokens per model step ({', '.join(parts)}). B's two runs differ only "
         f"in A's {flushed['acked_count']:,} counts, pushed to {FLEET} and never to {SOLO} (the same generation 1, "
         f"which B's second client downloaded: {solo['downloads']} download).{why}", "  ")

    delays = _push_to_visible(a, b, args.probes)
    if delays:
        _say(f"push to visible: A accepts a new n-gram ({MARK_REPEATS} times in one request), B drafts it "
             f"{statistics.median(delays):.2f} s later (p50 of {_n(len(delays), 'probe')}, "
             f"min {min(delays):.2f} s, max {max(delays):.2f} s)", "  ")


def _share_history(args: argparse.Namespace, workdir: Path, port: int, a: WorkerProcess, b: WorkerProcess,
                   held_out: list[Path]) -> None:
    """The match mode, where every client publishes the sequences it generates and mirrors the others' (the fleet
    history): B drafts long copies from what A generated, not only from counts."""
    address, node = f"127.0.0.1:{port}", str(workdir / NODE_DIR)
    files_a, files_b = _split(held_out)
    shared = [i for i, f in enumerate(files_b) if f in files_a]
    for w, namespace in ((a, MATCH), (b, MATCH), (b, MATCH_SOLO)):
        w.request("connect", address=address, namespace=namespace, cache_dir=node, mode="match", timeout=120)
    _say(f"the match mode (longest matches over the sequence, earlier sequences and the corpus index), with the "
         f"fleet history: each client publishes the sequences it generates as it accepts them and mirrors the "
         f"others'; A replays its files on {MATCH}, then B replays its own on {MATCH_SOLO} (A never published there) "
         f"and on {MATCH}:", "  ")
    ra = a.request("replay", namespace=MATCH, files=[str(f) for f in files_a], n_ctx=args.n_ctx, n_draft=args.n_draft)
    published = a.request("flush_history", namespace=MATCH)
    pulled = b.request("wait_history", namespace=MATCH, tokens=published["tokens"], timeout=60)
    rb_solo = b.request("replay", namespace=MATCH_SOLO, files=[str(f) for f in files_b], n_ctx=args.n_ctx,
                        n_draft=args.n_draft)
    rb_fleet = b.request("replay", namespace=MATCH, files=[str(f) for f in files_b], n_ctx=args.n_ctx,
                         n_draft=args.n_draft)
    print(f"  {'worker':<8}{'history from':<38}{'drafted':>9}{'accepted':>10}{'accept %':>10}"
          f"{'tokens/step':>13}{'us/drafted':>12}")
    rows = [("A", f"its own ({MATCH})", ra), ("B", f"its own ({MATCH_SOLO}): no sharing", rb_solo),
            ("B", f"its own + A's ({MATCH}): sharing", rb_fleet)]
    for name, label, r in rows:
        drafted, accepted, steps, generated = _figures(r["files"])
        print(f"  {name:<8}{label:<38}{drafted:>9,}{accepted:>10,}{_pct(accepted, drafted):>10.1f}"
              f"{generated / max(steps, 1):>13.2f}{r['t_draft'] * 1e6 / max(drafted, 1):>12.3f}")
    solo, fleet = _per_step(rb_solo["files"]), _per_step(rb_fleet["files"])
    on_shared = (f" ({_per_step(rb_solo['files'], shared):.2f} -> {_per_step(rb_fleet['files'], shared):.2f} on the "
                 f"{_n(len(shared), 'file')} A generated too)" if shared else "")
    lag = (f"; a record reached B {pulled['lag_ms_p50']:.0f} ms after the store took it (p50; p99 "
           f"{pulled['lag_ms_p99']:.0f} ms)" if pulled["lag_ms_p50"] is not None else "")
    _say(f"fleet history: B's tokens per model step {solo:.2f} -> {fleet:.2f} ({fleet / max(solo, 1e-9):.2f}x){on_shared}. "
         f"A published {published['tokens']:,} tokens in {published['records']:,} records; B pulled "
         f"{pulled['pulled_tokens']:,} tokens ({_mb(pulled['pulled_bytes'])}){lag}.", "  ")


def _random_ngram(rng: np.random.Generator) -> dict[str, Any]:
    """A random 4-gram and follower: `tokens` holds it MARK_REPEATS times, `probe` ends with the 4-gram (after 4
    random tokens)."""
    gram = [int(t) for t in rng.integers(1, VOCAB, 4)]
    follower = int(rng.integers(1, VOCAB))
    return {"tokens": [*gram, follower] * MARK_REPEATS, "probe": [int(t) for t in rng.integers(1, VOCAB, 4)] + gram,
            "follower": follower}


def _push_to_visible(a: WorkerProcess, b: WorkerProcess, probes: int) -> list[float]:
    """Seconds from A's accept of a new n-gram to B's first draft of it, per probe."""
    rng = np.random.default_rng(20240601)
    delays = []
    for _ in range(probes):
        for _attempt in range(10):  # a random n-gram B already drafts is not new: take another
            ngram = _random_ngram(rng)
            if "watching" in b.request("watch", timeout=30, namespace=FLEET, probe=ngram["probe"],
                                       follower=ngram["follower"]):
                break
        else:
            raise NgramCacheError("found no n-gram new to B in 10 tries")
        t0 = a.request("mark", timeout=30, namespace=FLEET, tokens=ngram["tokens"])["t"]
        seen = b.reply(PROBE_TIMEOUT + 30)["t"]
        if seen is None:
            raise NgramCacheError(f"B never drafted the n-gram A accepted within {PROBE_TIMEOUT:g} s")
        delays.append(seen - t0)
    return delays


# The demo's last line: where a user goes from here.
NEXT_STEPS = ("next: README.md's quickstarts (a cache of your own files, a fleet with Redis, each engine); your "
              "model's tokenizer and a fleet namespace: docs/engines.md, \"Your model + the fleet\"")


def run_demo(args: argparse.Namespace) -> int:
    """`ngramcache demo`: the client's local build and replay, then (unless --no-serve) the served steps.

    Raises:
        InvalidArgumentError: bad flags, or --workdir holds an earlier demo's service or node folder.
        OSError: the service cannot listen (e.g. --port in use).
        NgramCacheError: a worker or the service failed.
    """
    inputs = client_cli.demo_inputs(args.test_files, args.n_ctx)
    if args.workdir is not None and not args.no_serve:
        for sub in (SERVICE_DIR, NODE_DIR):
            if (Path(args.workdir) / sub).exists():
                raise InvalidArgumentError(f"--workdir {args.workdir} holds {sub}/ from an earlier demo (its counts "
                                           "would mix into this one's): remove it or give another folder")
    if args.port and not args.no_serve:
        _check_port(ServiceConfig.host, args.port)
    t0 = time.perf_counter()
    with _interrupted_once(), client_cli.demo_workdir(args.workdir) as workdir:
        cache = client_cli.run_local_demo(args, workdir, inputs)
        if not args.no_serve:
            _serve_and_share(args, workdir, cache, inputs[1])
    took = time.perf_counter() - t0
    if args.workdir is None and args.no_serve:
        print(f"removed {workdir} (--workdir DIR keeps the cache)")
    elif args.workdir is None:
        _say(f"stopped the service and the workers, removed {workdir} ({took:.1f} s in all; --workdir DIR keeps "
             "the cache, the service's data and the workers' logs)")
    elif args.no_serve:
        print(f"the cache stays at {workdir / 'stdlib.ngc'}; try: ngramcache inspect {workdir / 'stdlib.ngc'}")
    else:
        _say(f"stopped the service and the workers ({took:.1f} s in all); try it yourself: "
             f"ngramcache serve --data-dir {workdir / SERVICE_DIR}")
    _say(NEXT_STEPS)
    return 0
