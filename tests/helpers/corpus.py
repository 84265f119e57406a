"""Synthetic token streams and the tokenizer identity the service tests share: random motifs repeated, so n-grams recur as in real text."""

from __future__ import annotations

import numpy as np

__all__ = ["FAST", "FP", "VOCAB", "motif_corpus"]

VOCAB = 64
"""The vocabulary of the synthetic streams."""

FP = bytes(range(32))
"""The tokenizer fingerprint of the synthetic streams' namespaces."""

FAST = {"pull_interval": 0.1, "push_interval": 0.05, "ready_timeout": 20.0, "close_timeout": 10.0}
"""NgramClient settings that make a test's sync quick (the defaults are for production)."""


def motif_corpus(seed: int, n: int = 4000, *, vocab: int = VOCAB, motifs: int = 12, longest: int = 8, per: int = 6,
                 noise: bool = False) -> np.ndarray:
    """About ``n`` int32 tokens: ``n // per`` draws among ``motifs`` random motifs of 3..``longest`` tokens.

    With ``noise``, each motif is followed by one random token, so some keys are seen once or
    twice only (outside a draft view's minimums). The same arguments give the same tokens.
    """
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, vocab, rng.integers(3, longest + 1)) for _ in range(motifs)]
    if noise:
        extra = rng.integers(0, vocab, n // per)
        parts = [np.append(pool[i], extra[j]) for j, i in enumerate(rng.integers(0, len(pool), n // per))]
        return np.concatenate(parts).astype(np.int32)
    return np.concatenate([pool[i] for i in rng.integers(0, len(pool), n // per)]).astype(np.int32)
