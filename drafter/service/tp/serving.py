"""What the server does when a tensor-parallel rank is lost: out of service at once, never a hang.

Health (the serving and the liveness service) turns NOT_SERVING, new calls are refused with
UNAVAILABLE, and a call whose step was running fails (its collective errors out); the process
stays up, NOT_SERVING, until it is stopped (a liveness probe restarts it) or SIGTERM drains it.
"""

from __future__ import annotations

import asyncio
import logging

from drafter.service.logs import event

log = logging.getLogger("drafter.service.tp")


def on_rank_failure(loop: asyncio.AbstractEventLoop, core, health_state):
    """A callback for TPEngine.watch (called from its watch thread) that takes the server down."""
    async def take_down(why: str) -> None:
        core.start_draining()
        await health_state.set_serving(False)
        await health_state.set_live(False)
        event("rank_failed", reason=why)
        log.error("tensor-parallel rank lost: out of service", extra={"event": "rank_failed", "reason": why})

    def callback(why: str) -> None:
        asyncio.run_coroutine_threadsafe(take_down(why), loop)
    return callback
