"""A small, obviously-correct pure-Python reference of the count tables and the drafter.

It follows llama.cpp's common_ngram_cache_update / common_ngram_cache_draft line by line,
with one deliberate change the core shares: ties go to the lowest token id.
"""

from __future__ import annotations

from collections import defaultdict

LAX_SAMPLES = (2, 2, 1, 1)
LAX_PERCENT = (66, 50, 50, 50)
STRICT_SAMPLES = (4, 3, 2, 2)
STRICT_PERCENT = (75, 66, 66, 66)

Table = dict  # tuple(ngram) -> {token: count}


def new_table() -> Table:
    return defaultdict(lambda: defaultdict(int))


def update(table: Table, tokens, n_new: int, ngram_min: int = 1, ngram_max: int = 4) -> None:
    tokens = [int(t) for t in tokens]
    for n in range(ngram_min, ngram_max + 1):
        for i in range(max(len(tokens) - n_new, n), len(tokens)):
            table[tuple(tokens[i - n : i])][tokens[i]] += 1


def rows_to_table(rows) -> Table:
    table = new_table()
    for n, t0, t1, t2, t3, follower, count in rows.tolist():
        table[tuple([t0, t1, t2, t3][:n])][follower] += count
    return table


def _try_primary(table, ngrams, part_static, samples, percent):
    for ngram in reversed(ngrams):  # longest first
        part = table.get(ngram)
        if not part:
            continue
        best_token, best_score, best_count, total = -1, 0, 0, 0
        for token in sorted(part):
            count = part[token]
            weight = 100 * part_static[token] if token in part_static else 1
            if count * weight > best_score:
                best_token, best_score, best_count = token, count * weight, count
            total += count
        n = len(ngram)
        if total < samples[n - 1] or 100 * best_count < percent[n - 1] * total:
            continue
        return best_token
    return -1


def _try_static(part_static):
    if not part_static:
        return -1
    best_token, best_count, total = -1, 0, 0
    for token in sorted(part_static):
        if part_static[token] > best_count:
            best_token, best_count = token, part_static[token]
        total += part_static[token]
    if total < LAX_SAMPLES[1] or 100 * best_count < LAX_PERCENT[1] * total:
        return -1
    return best_token


def draft(seq, n_draft, context=None, dynamic=None, static=None, static_n=2, ngram_min=1, ngram_max=4):
    """Returns the drafted tokens (a list) for sequence `seq`."""
    seq = [int(t) for t in seq]
    if len(seq) < 2:
        return []
    out: list[int] = []
    while len(out) < n_draft:
        full = seq + out
        part_static = {}
        if static is not None and len(full) >= static_n:
            part_static = static.get(tuple(full[-static_n:]), {})
        ngrams = [tuple(full[-n:]) for n in range(ngram_min, ngram_max + 1) if n <= len(full)]
        token = -1
        if context is not None:
            token = _try_primary(context, ngrams, part_static, LAX_SAMPLES, LAX_PERCENT)
        if token < 0 and dynamic is not None:
            token = _try_primary(dynamic, ngrams, part_static, STRICT_SAMPLES, STRICT_PERCENT)
        if token < 0:
            token = _try_static(part_static)
        if token < 0:
            break
        out.append(token)
    return out


def count_static(streams, k: int = 2) -> Table:
    """The (k-gram, follower) counts of each stream, n-grams never spanning two streams."""
    table = new_table()
    for s in streams:
        s = [int(t) for t in s]
        for i in range(k, len(s)):
            table[tuple(s[i - k : i])][s[i]] += 1
    return table


def replay(tokens, n_ctx, n_draft, static=None, static_n=2, dynamic=None, ngram_min=1, ngram_max=4):
    """llama-lookup-stats' replay. Returns (n_drafted, n_accept, drafts per call, dynamic)."""
    tokens = [int(t) for t in tokens]
    dynamic = dynamic if dynamic is not None else new_table()
    n_drafted = n_accept = 0
    calls = []
    for start in range(0, len(tokens) - n_ctx, n_ctx):  # strict, as llama-lookup-stats' loop
        chunk = tokens[start : start + n_ctx]
        context = new_table()
        out = [chunk[0]]
        while len(out) < n_ctx:
            d = draft(out, n_draft, context, dynamic, static, static_n, ngram_min, ngram_max)
            calls.append(d)
            n_drafted += len(d)
            for t in d:
                if len(out) >= n_ctx or chunk[len(out)] != t:
                    break
                n_accept += 1
                out.append(t)
                update(context, out, 1, ngram_min, ngram_max)
            if len(out) < n_ctx:
                out.append(chunk[len(out)])
                update(context, out, 1, ngram_min, ngram_max)
        for key, followers in context.items():
            for t, c in followers.items():
                dynamic[key][t] += c
    return n_drafted, n_accept, calls, dynamic
