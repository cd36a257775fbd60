"""`drafter serve --gil-switch-interval-us` reaches the serving process (issue 19): its listening event reports
the interval the interpreter holds after start, read back from sys.getswitchinterval() there.  Loading is held
(test hook), so no engine is built."""

from __future__ import annotations

from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer


def test_serve_applies_the_switch_interval(tiny_root, tmp_path):
    _, model = tiny_dirs(tiny_root, "eagle3")
    server = DrafterServer(model, "eagle3", log_path=tmp_path / "server.log", device="cpu", test_hold_loading=1,
                           gil_switch_interval_us=350)
    try:
        listening = server.start(until="listening").ready
        assert listening["gil_switch_interval_us"] == 350, listening
    finally:
        server.stop()
