"""Which attack costs the server most (issue 19): one `drafter serve`, the soak's valid clients, and each
attack of tests/support/attacks.py alone in turn; per attack the server's CPU seconds per second and the
valid clients' p99 step, printed as one JSON line each (and, with --py-spy DIR, a py-spy profile of the
server per attack, DIR/<attack>.txt, when py-spy is installed).  A probe, not a test:

    python -m tests.support.abuse_probe [--seconds 8] [--only NAME]... [--together] [--py-spy DIR]
        [--set SETTING=VALUE]...

--set passes a `drafter serve` setting to the server (e.g. gil_switch_interval_us=5000 for Python's own
hand-off interval); every JSON line names the settings so given.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS
from tests.integration import test_abuse_soak as soak
from tests.support.attacks import ATTACKS
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer


def _measure(server, tiny_root, expected, seconds: float) -> dict:
    lat, wall, cpu = soak._phase(server, tiny_root, expected, seconds)
    every = lat["grpc"] + lat["zmq"]
    return {"cpu_per_s": round(cpu / wall, 3), "p99_grpc_ms": round(soak._p99(lat["grpc"]), 1),
            "p99_zmq_ms": round(soak._p99(lat["zmq"]), 1), "p99_all_ms": round(soak._p99(every), 1),
            "steps": len(every)}


def _attacked(server, tiny_root, expected, seconds: float, names: list[str], spy: Path | None) -> dict:
    """The attacks `names` (at once) while the valid clients run; the server profiled meanwhile if asked
    (--gil: the samples are of the thread that holds the interpreter lock)."""
    attacker = soak._Attacker(server, tiny_root)
    name = "+".join(names) if len(names) < len(ATTACKS) else "all"
    attacker.argv = [*attacker.argv, *[a for n in names for a in ("--only", n)]]
    prof = None
    with attacker:
        if spy is not None:
            prof = subprocess.Popen(["py-spy", "record", "--pid", str(server.proc.pid), "--duration",
                                     str(int(seconds)), "--format", "raw", "--threads", "--gil",
                                     "-o", str(spy / f"{name}.txt")], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        out = _measure(server, tiny_root, expected, seconds)
    if prof is not None:
        prof.wait(60)
    return {"attack": name, **out, "sent": attacker.report["counts"], "errors": attacker.report["errors"]}


def _setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: SETTING=VALUE, e.g. gil_switch_interval_us=5000")
    return key.replace("-", "_"), value


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--only", action="append", choices=ATTACKS)
    p.add_argument("--together", action="store_true", help="the chosen attacks (default: all) at once, not in turn")
    p.add_argument("--py-spy", type=Path, default=None)
    p.add_argument("--set", type=_setting, action="append", default=[], metavar="SETTING=VALUE",
                   help="a drafter serve setting for the server (repeatable)")
    args = p.parse_args(argv)
    settings = dict(args.set)
    spy = args.py_spy if args.py_spy is not None and shutil.which("py-spy") else None
    if spy is not None:
        spy.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="abuse-probe-"))
    _, model = tiny_dirs(root, "eagle3")
    expected = [soak._expected(root, 11 + i) for i in range(3)]
    with DrafterServer(model, "eagle3", log_path=root / "server.log", kv_blocks=8 * SESSION_BLOCKS,
                       block_sizes=16, batch_window_us=500, max_message_bytes=soak.MAX_MESSAGE,
                       **{**SERVER_SETTINGS, **settings}) as server:
        _measure(server, root, expected, 2.0)  # warm-up
        print(json.dumps({"attack": "none", "settings": settings, **_measure(server, root, expected, args.seconds)}),
              flush=True)
        names = list(args.only or ATTACKS)
        for group in ([names] if args.together else [[n] for n in names]):
            print(json.dumps({"settings": settings, **_attacked(server, root, expected, args.seconds, group, spy)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
