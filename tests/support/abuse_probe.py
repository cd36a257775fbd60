"""Which attack costs the server most (issue 19): one `drafter serve`, the soak's valid clients, and each
attack of tests/support/attacks.py alone in turn; per attack the server's CPU seconds per second and the
valid clients' p99 step, printed as one JSON line each (and, with --py-spy DIR, a py-spy profile of the
server per attack, DIR/<attack>.txt, when py-spy is installed).  A probe, not a test:

    python -m tests.support.abuse_probe [--seconds 8] [--only NAME]... [--together] [--py-spy DIR]
        [--set SETTING=VALUE]... [--front-processes | --compare-fronts]

--set passes a `drafter serve` setting to the server (e.g. gil_switch_interval_us=5000 for Python's own
hand-off interval); every JSON line names the settings so given.  --front-processes serves with
`--front-processes` (the listeners in processes of their own; each line adds the fronts' CPU seconds per
second, fronts_cpu_per_s); --compare-fronts runs everything twice, plain then with front processes, and
ends with the two side by side.
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
from tests.support import attacks
from tests.support.attacks import ATTACKS
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer


def _fronts_cpu_s(server) -> float:
    """The front processes' CPU seconds so far (0 without --front-processes)."""
    pids = (server.ready.get("front_pids") or {}).values()
    return sum(attacks.process_cpu_s(pid) for pid in pids)


def _measure(server, tiny_root, expected, seconds: float) -> dict:
    fronts0 = _fronts_cpu_s(server)
    lat, wall, cpu = soak._phase(server, tiny_root, expected, seconds)
    every = lat["grpc"] + lat["zmq"]
    fronts = {"fronts_cpu_per_s": round((_fronts_cpu_s(server) - fronts0) / wall, 3)} \
        if server.ready.get("front_pids") else {}
    return {"cpu_per_s": round(cpu / wall, 3), **fronts, "p99_grpc_ms": round(soak._p99(lat["grpc"]), 1),
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
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--front-processes", action="store_true", help="serve with --front-processes")
    mode.add_argument("--compare-fronts", action="store_true",
                      help="run plain, then with --front-processes, and print the two side by side")
    args = p.parse_args(argv)
    spy = args.py_spy if args.py_spy is not None and shutil.which("py-spy") else None
    if spy is not None:
        spy.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="abuse-probe-"))
    _, model = tiny_dirs(root, "eagle3")
    expected = [soak._expected(root, 11 + i) for i in range(3)]
    modes = [False, True] if args.compare_fronts else [args.front_processes]
    runs = [_run(args, root, model, expected, spy, {**dict(args.set), **({"front_processes": "true"} if f else {})})
            for f in modes]
    if len(runs) == 2:
        _side_by_side(*runs)
    return 0


def _run(args, root: Path, model: Path, expected: list, spy: Path | None, settings: dict) -> list[dict]:
    """One server with `settings`: the unloaded line, then one per attack (or group); each printed."""
    lines = []
    with DrafterServer(model, "eagle3", log_path=root / "server.log", kv_blocks=8 * SESSION_BLOCKS,
                       block_sizes=16, batch_window_us=500, max_message_bytes=soak.MAX_MESSAGE,
                       **{**SERVER_SETTINGS, **settings}) as server:
        _measure(server, root, expected, 2.0)  # warm-up
        lines.append({"attack": "none", "settings": settings, **_measure(server, root, expected, args.seconds)})
        print(json.dumps(lines[-1]), flush=True)
        names = list(args.only or ATTACKS)
        for group in ([names] if args.together else [[n] for n in names]):
            lines.append({"settings": settings, **_attacked(server, root, expected, args.seconds, group, spy)})
            print(json.dumps(lines[-1]), flush=True)
    return lines


def _side_by_side(plain: list[dict], fronts: list[dict]) -> None:
    """Per attack: the valid clients' p99 (gRPC / ZMQ, ms) and its ratio to the same mode's unloaded p99."""
    print(f"{'attack':<24} {'plain p99 grpc/zmq ms':>22} {'x unloaded':>11}   {'fronts p99 grpc/zmq ms':>23} "
          f"{'x unloaded':>11}")
    base = {id(plain): plain[0], id(fronts): fronts[0]}
    for a, b in zip(plain, fronts):
        cells = []
        for runs, line in ((plain, a), (fronts, b)):
            u = base[id(runs)]
            cells.append(f"{line['p99_grpc_ms']:>10.1f} / {line['p99_zmq_ms']:<9.1f}")
            cells.append(f"{line['p99_grpc_ms'] / u['p99_grpc_ms']:>5.2f}/{line['p99_zmq_ms'] / u['p99_zmq_ms']:<5.2f}")
        print(f"{a['attack']:<24} {cells[0]:>22} {cells[1]:>11}   {cells[2]:>23} {cells[3]:>11}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
