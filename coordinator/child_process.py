"""Child processes that end with the process that started them.

A `drafter serve` started by the demo, the load test or a test's fixture holds ports, a KV pool and
hundreds of MB.  Every caller stops it on its own ways out (finally blocks, context managers), but a
caller killed outright (SIGKILL, the OOM killer) runs none of them.  On Linux the kernel can tell the
child instead: the child first asks for SIGTERM on its parent's death (PR_SET_PDEATHSIG), checks that
the parent it was started by is still there (it may have died before the request), then becomes the
real command with execv, which keeps the request.  Done in the child's own Python rather than a
preexec_fn, which can deadlock a child forked from a threaded process.

The kernel sends the signal when the *thread* that forked the child ends, not only the process: start
such children from a thread that lives as long as they should (every caller here starts them from its
main thread).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# argv after "-c": the parent's pid, then the command to become
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
                    "os.getppid() == int(sys.argv[1]) or sys.exit(143); os.execv(sys.argv[2], sys.argv[2:])")


def die_with_parent(argv: list[str]) -> list[str]:
    """The command line that runs `argv` (argv[0] a path to an executable) and ends it with SIGTERM should
    this process die first; `argv` itself where the platform cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


def stop_child(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """Stop a child the polite way (SIGTERM: a drafter drains and exits 0), killing it after `timeout_s`;
    its exit code (the one it already had when it had ended)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()
