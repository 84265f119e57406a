"""Drafter stand-ins for adapter tests: the `DrafterLike` protocol without odds."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


class NoOddsDrafter:
    """Drafts nothing and has no ``draft_scored``: what cost-aware drafting must refuse."""

    def draft(self, seq: int, tokens: NDArray[np.int32], n_draft: int = 8) -> NDArray[np.int32]:
        return np.empty(0, dtype=np.int32)

    def accept(self, seq: int, tokens: NDArray[np.int32]) -> None:
        pass

    def reset(self, seq: int) -> bool:
        return True
