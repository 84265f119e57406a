"""An event-driven replay of recorded requests over K simulated replicas, each drafting with what it would hold.

Why a replay is exact: speculative sampling with a deterministic draft accepts a drafted token
d with probability p(d) (the target model's), and where it rejects it samples from the
residual distribution, so each emitted token is distributed as plain sampling would emit it,
whatever was drafted. Replaying a recorded sample, accepting the longest draft prefix equal to
it and adding the one token the model emits in the same pass is therefore a draw of what
speculative sampling would have done; only the number of passes (steps) depends on the drafts.

Time runs in ticks of `step_ms` (one forward pass of every active request on a replica; the
engine batches its requests, so a step costs the same for one or many). Requests arrive over
time (`Schedule`); a request's first step is at the first tick at or after its arrival. In a
tick every active request first drafts (from what its replica holds at the tick's start), then
every one is verified and accepted, so requests of one tick never see each other's tokens of
that tick. What a drafter keeps, and what reaches it from other replicas and when, is the
setup's business (`Setup`); the loop only counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("rollout", "repeated", "control")


@dataclass(frozen=True)
class Request:
    """One recorded sample: its group (the prompt's index: siblings share it), prompt and output."""

    group: int
    prompt: np.ndarray
    output: np.ndarray


def load_recording(path: Path) -> tuple[dict[str, list[Request]], dict[str, Any]]:
    """The requests of each workload of a record_workloads.py file, and its metadata."""
    import json

    with np.load(path) as d:
        po, oo = d["prompt_offsets"], d["output_offsets"]
        prompts = [d["prompt_tokens"][po[i]:po[i + 1]] for i in range(len(po) - 1)]
        out: dict[str, list[Request]] = {w: [] for w in WORKLOADS}
        for i, (p, w) in enumerate(zip(d["sample_prompt"].tolist(), d["sample_workload"].tolist())):
            out[WORKLOADS[w]].append(Request(p, prompts[p], d["output_tokens"][oo[i]:oo[i + 1]]))
        meta = json.loads(str(d["meta"]))
    return out, meta


class Setup:
    """A drafting setup over K replicas. The loop calls start / draft / observe / finish per
    request and tick() at the start of each tick; a setup that shares across replicas moves
    what one replica accepted to the others there, after its lag."""

    name = "setup"

    def __init__(self, k: int) -> None:
        self.k = k

    def start(self, replica: int, rid: int, prompt: np.ndarray, now: float) -> None:
        """Request `rid` (global, unique) starts on `replica` with `prompt`."""

    def draft(self, replica: int, rid: int, tokens: np.ndarray) -> Sequence[int]:
        """A linear draft to follow `tokens` (prompt + output so far)."""
        return ()

    def observe(self, replica: int, rid: int, tokens: np.ndarray, n_new: int, now: float) -> None:
        """`tokens` (prompt + output so far) grew by its last `n_new` tokens at tick `now`."""

    def finish(self, replica: int, rid: int, now: float) -> None:
        """Request `rid` ended."""

    def tick(self, now: float) -> None:
        """A tick starts at `now` (ms): deliver what has become visible."""

    def hold(self, replica: int) -> None:
        """`replica` is out of the fleet (no requests, nothing delivered) until join()."""

    def join(self, replica: int, now: float, window: bool) -> None:
        """`replica` joins the fleet at `now` (cold start); with `window`, handed the history so far."""

    def extra(self) -> dict[str, float]:
        """Setup-specific figures (bytes pulled...)."""
        return {}


@dataclass
class Schedule:
    """When requests arrive and where they go.

    Groups arrive every `interval_ms` in an order shuffled by `seed`; with `concurrent` a
    group's samples all arrive with it (RL rollouts: siblings generated at the same time),
    otherwise sample j + 1 arrives when sample j finishes (siblings one after another).
    `routing` is "round-robin" (each request to the next replica) or "group" (a group's samples
    all to one replica, groups in turn). With `join_after` = n, the last replica takes no
    request before the n-th group has arrived (a replica joining late)."""

    interval_ms: float = 500.0
    step_ms: float = 20.0
    concurrent: bool = True
    routing: str = "round-robin"
    seed: int = 0
    join_after: int | None = None
    join_window: bool = False


@dataclass
class Result:
    """Totals of one replay, and per request (in arrival order) its replica, steps and tokens."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    per_request: list[tuple[int, int, int, float]] = field(default_factory=list)  # replica, steps, tokens, start ms
    extra: dict[str, float] = field(default_factory=dict)
    sim_ms: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def accept_pct(self) -> float:
        return 100.0 * self.accepted / self.drafted if self.drafted else 0.0

    @property
    def drafted_per_step(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0


def accepted_prefix(draft: Sequence[int], target: np.ndarray) -> int:
    """How many leading draft tokens equal the recorded next tokens."""
    n = 0
    for tok, want in zip(draft, target.tolist()):
        if int(tok) != want:
            break
        n += 1
    return n


@dataclass
class _Active:
    rid: int
    replica: int
    req: Request
    tokens: np.ndarray  # prompt + the whole output: the sequence at any time is a prefix
    length: int  # tokens of `tokens` present now (prompt included)
    index: int = 0  # its row of Result.per_request
    steps: int = 0


def simulate(requests: Sequence[Request], setup: Setup, schedule: Schedule, n_draft: int = 8) -> Result:
    """Replays `requests` through `setup` on `setup.k` replicas under `schedule`."""
    k, step = setup.k, schedule.step_ms
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.group, []).append(i)
    order = list(groups)
    np.random.default_rng(schedule.seed).shuffle(order)
    # (arrival ms, tie-break, group position, sample index within group)
    pending: list[tuple[float, int, int, int]] = []
    tie = 0
    for pos, g in enumerate(order):
        samples = groups[g] if schedule.concurrent else groups[g][:1]
        for j in range(len(samples)):
            heapq.heappush(pending, (pos * schedule.interval_ms, tie, pos, j))
            tie += 1
    joined = schedule.join_after is None or k == 1
    if not joined:
        setup.hold(k - 1)
    rr = 0
    active: list[_Active] = []
    result = Result()
    now = 0.0
    next_rid = 0
    while pending or active:
        if not active and pending[0][0] > now:
            now = step * np.ceil(pending[0][0] / step)
        while pending and pending[0][0] <= now:
            _, _, pos, j = heapq.heappop(pending)
            if not joined and schedule.join_after is not None and pos >= schedule.join_after:
                joined = True
                setup.join(k - 1, now, schedule.join_window)
            n_replicas = k if joined else k - 1
            if schedule.routing == "group":
                replica = pos % n_replicas
            else:
                replica, rr = rr % n_replicas, rr + 1
            req = requests[groups[order[pos]][j]]
            a = _Active(next_rid, replica, req, np.concatenate([req.prompt, req.output]).astype(np.int32),
                        len(req.prompt), index=len(result.per_request))
            next_rid += 1
            setup.start(replica, a.rid, req.prompt, now)
            active.append(a)
            result.per_request.append((replica, 0, len(req.output), now))
        setup.tick(now)
        drafts = [setup.draft(a.replica, a.rid, a.tokens[: a.length]) for a in active]
        still: list[_Active] = []
        for a, d in zip(active, drafts):
            d = list(d)[:n_draft]
            n_acc = accepted_prefix(d, a.tokens[a.length: a.length + len(d)])
            result.steps += 1
            result.drafted += len(d)
            result.accepted += n_acc
            a.steps += 1
            new_length = min(a.length + n_acc + 1, len(a.tokens))
            n_new = new_length - a.length
            a.length = new_length
            setup.observe(a.replica, a.rid, a.tokens[: a.length], n_new, now)
            if a.length < len(a.tokens):
                still.append(a)
                continue
            setup.finish(a.replica, a.rid, now)
            result.tokens += len(a.req.output)
            replica, _, n_tok, t0 = result.per_request[a.index]
            result.per_request[a.index] = (replica, a.steps, n_tok, t0)
            if not schedule.concurrent:  # the next sibling arrives as this one ends
                _, _, pos, j = _sibling_of(a, groups, order, requests)
                if j < len(groups[order[pos]]):
                    heapq.heappush(pending, (now + step, tie, pos, j))
                    tie += 1
        active = still
        now += step
    result.extra = setup.extra()
    result.sim_ms = now
    return result


def _sibling_of(a: _Active, groups: dict[int, list[int]], order: list[int],
                requests: Sequence[Request]) -> tuple[float, int, int, int]:
    """The (_, _, group position, next sample index) after `a` in its group."""
    members = groups[a.req.group]
    j = next(i for i, m in enumerate(members) if requests[m] is a.req)
    return 0.0, 0, order.index(a.req.group), j + 1
