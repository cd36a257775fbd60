"""A child started through die_with_parent ends when the process that started it is SIGKILLed."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from coordinator.child_process import die_with_parent
from tests.support.servers import REPO

# the parent: starts a child that waits for a signal forever, prints its pid, then waits itself
PARENT = """
import signal, subprocess, sys
from coordinator.child_process import die_with_parent
child = subprocess.Popen(die_with_parent([sys.executable, "-c", "import signal; signal.pause()"]))
print(child.pid, flush=True)
signal.pause()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_ends_when_its_parent_is_killed():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=env)
    child = None
    try:
        child_pid = int(parent.stdout.readline())
        child = os.pidfd_open(child_pid)
        parent.kill()  # SIGKILL: no finally, no atexit in the parent
        parent.wait()
        gone, _, _ = select.select([child], [], [], 60)  # readable once the child has exited
        if not gone:
            os.kill(child_pid, signal.SIGKILL)
        assert gone, "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child is not None:
            os.close(child)


def test_the_command_is_kept_whole_after_the_parents_pid():
    argv = [sys.executable, "-m", "drafter", "serve", "--port", "0"]
    wrapped = die_with_parent(argv)
    if sys.platform.startswith("linux"):
        assert wrapped[:2] == [sys.executable, "-c"] and wrapped[3] == str(os.getpid()) and wrapped[4:] == argv
    else:
        assert wrapped == argv
