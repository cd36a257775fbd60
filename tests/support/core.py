"""A ServiceCore around an engine, in its own event loop, for tests that drive the core directly."""

from __future__ import annotations

import asyncio

from drafter.service.core import ServiceCore
from drafter.service.metrics import Metrics


def run_with_core(engine, body, **core_settings):
    """Await body(core) with a fresh ServiceCore serving `engine`; the core is closed after."""
    async def main():
        core = ServiceCore(metrics=Metrics(), max_sessions=4, batch_window_s=0.0, max_message_bytes=1 << 26,
                           **core_settings)
        core.set_engine(engine)
        try:
            return await body(core)
        finally:
            await core.close()
    return asyncio.run(main())
