"""Results from the engine thread back to the event loop(s) that wait for them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drafter.service.batching.queue import Pending

log = logging.getLogger("drafter.service.batching")


def _deliver(items: list[Pending], results: list) -> None:
    """In the event loop: every result of one engine batch, replies first."""
    for it, r in zip(items, results):
        if it.on_done is not None:
            try:
                it.on_done(r)
            except Exception:  # noqa: BLE001 - one transport's bug must not cost the others their answers
                log.exception("propose completion failed")
        elif not it.future.done():
            if isinstance(r, BaseException):
                it.future.set_exception(r)
            else:
                it.future.set_result(r)


def deliver_from_thread(items: list[Pending], results: list) -> None:
    """Engine thread -> event loop(s): one wake-up per loop for the whole batch."""
    by_loop: dict = {}
    for it, r in zip(items, results):
        if it.loop is None:  # a concurrent.futures future: settle it right here
            if not it.future.done():
                if isinstance(r, BaseException):
                    it.future.set_exception(r)
                else:
                    it.future.set_result(r)
            continue
        its, rs = by_loop.setdefault(it.loop, ([], []))
        its.append(it)
        rs.append(r)
    for loop, (its, rs) in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, its, rs)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
