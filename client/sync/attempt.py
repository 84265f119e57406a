"""The attempts of one pushed batch: whether one may have been stored although no answer said so.

A batch is sent under one (client id, seq) and retried under the same seq, so the store counts
it at most once. When the sender gives it up (an error that is not retriable, retries running
out, or close cancelling it), what it counts depends on whether any attempt may have reached
the store: an attempt that ended in a deadline, a cancelled call or an unknown status may have
been applied; one refused with a definite status was not. The pusher (count deltas) and the
history publisher keep this the same way, through `Attempts`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

__all__ = ["UNCERTAIN_CODES", "Attempts"]

T = TypeVar("T")

UNCERTAIN_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN})
"""Status codes after which the request may have been applied by the service."""


class Attempts:
    """What the attempts of one batch tell about its fate; used by one task at a time (the batch's sender).

    Attributes:
        in_rpc: a call is on the wire now (cancelling the sender then leaves its outcome unknown).
        uncertain: an earlier attempt ended without an answer that rules out it was applied.
    """

    def __init__(self) -> None:
        self.in_rpc = False
        self.uncertain = False

    async def call(self, rpc: Callable[[], Awaitable[T]]) -> T:
        """Await ``rpc()``, noting an ending that leaves the batch's fate unknown; exceptions propagate unchanged."""
        self.in_rpc = True
        try:
            return await rpc()
        except grpc.RpcError as e:
            if e.code() in UNCERTAIN_CODES:
                self.uncertain = True
            raise
        except BaseException:  # cancelled (a channel switch, or close) after the request may have gone out
            self.uncertain = True
            raise
        finally:
            self.in_rpc = False

    def given_up(self, cancelled: bool = False) -> bool:
        """Whether a batch given up now is unconfirmed (may have been applied) rather than dropped.

        Args:
            cancelled: the sender itself is being cancelled (close ran out of time): a call in
                flight at that moment may have been applied too.
        """
        return self.uncertain or (cancelled and self.in_rpc)

    def outcome(self, applied: str) -> str:
        """The word for a batch given up, for a log line: "unconfirmed (the service may have <applied> it)" or "dropped"."""
        return f"unconfirmed (the service may have {applied} it)" if self.uncertain else "dropped"
