"""asyncio helpers the client's sync loop and the service share."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["cancel_until_done"]

log = logging.getLogger("ngramcache")


async def cancel_until_done(tasks: Sequence[asyncio.Task[Any]], again_after: float = 2.0) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again those still running after
    ``again_after`` seconds.

    Once is not always enough: Python 3.11's ``asyncio.wait_for`` returns its inner call's result
    when that call ends just as the cancellation arrives, and the cancelled task runs on (a loop
    such as `SyncState.forever` then never ends). Seen under load: a client's fleet history mirror
    read a page at that moment, and `NgramClient.close` waited its whole timeout. ``again_after``
    leaves a task's own cleanup its time first.
    """
    for task in tasks:
        task.cancel()
    while pending := [t for t in tasks if not t.done()]:
        await asyncio.wait(pending, timeout=again_after)
        for task in pending:
            if not task.done():
                log.debug("%s ran on after its cancellation; cancelled again", task.get_name())
                task.cancel()
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: a task that ended with an error is not reported again at exit
