"""The engine's lock, which also drains an armed binding's step queued ahead.

The engine thread holds it while a job or a batch runs; a bound session's data or doorbell thread
takes it to run its step itself (drafter.service.bound_ipc.on_engine).  An armed cuda_ipc binding
(drafter.wire.bound.ARM_WORDS) leaves, between its steps, its next step queued on its own stream
behind a GPU wait for the target's go word.  Whoever takes the lock next for anything else first
drains that binding (its `drain()`: the step queued ahead released so that it does nothing, the
stream waited for), so no other work ever runs beside or behind it.  `switches` counts the times
the lock passed from one owner to another: a binding queues ahead only while it alone takes the
lock (a second busy user would drain it every step, a whole replay of GPU time each).
"""

from __future__ import annotations

import threading


class EngineLock:
    def __init__(self):
        self._lock = threading.Lock()
        self.armed = None  # the binding whose step is queued ahead (its drain() runs before any other owner's work)
        self.owner = None  # who took the lock last (None: the engine thread, a job or a batch)
        self.switches = 0  # how often the lock passed to another owner than the last

    def acquire(self, blocking: bool = True, owner=None) -> bool:
        """Take the lock (as `owner`); an armed binding other than `owner` is drained first."""
        if not self._lock.acquire(blocking):
            return False
        try:
            if owner is not self.owner:
                self.switches += 1
                self.owner = owner
            armed = self.armed
            if armed is not None and armed is not owner:
                self.armed = None
                armed.drain()
        except BaseException:
            self._lock.release()
            raise
        return True

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "EngineLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
