"""A bounded soak (issue 19): valid clients on both transports run their scenarios while attackers send
every kind of abuse the issue lists, at once, against one `drafter serve` on loopback.

Three kinds of process, so that the figures measure the server: the server in its own; the valid
clients (one gRPC, two ZMQ) as threads of this test process; the attackers in a third
(tests/support/attacks.py, with the Propose flooder of tests/support/flood.py a child of it), started at a
lower CPU priority (os.nice) to model attackers on other machines -- on a 2-core box they would
otherwise take the cores from the server and the valid clients, and the latencies would mix the
server's cost of refusing with the attackers' own CPU.

Run twice: serving as by default, and with `--front-processes` (the listeners, their decoding and
refusals in processes of their own, drafter.service.front: the mode docs/security.md recommends where
untrusted clients reach the ports).  Asserted: each valid client's drafts equal its solo engine's,
every attack gets its refusal, the server's RSS (the fronts' included) stays within a generous bound,
and the refusal log stays throttled.  Printed, not asserted (no timing asserts): the valid clients' p99
step latency per transport, unloaded and under attack, and the server's CPU seconds in each phase.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_abuse_grpc_memory import rss_mib
from tests.integration.test_service_parity import plans, scenario
from tests.support import attacks
from tests.support.attacks import ATTACKS
from tests.support.engines import tiny_dirs
from tests.support.servers import REPO, DrafterServer, layout_for

MiB = 1024 * 1024
MAX_MESSAGE = 16 * MiB
UNLOADED_S, ATTACKED_S = 5.0, 10.0  # how long the valid clients draft in each phase (whole sessions), each mode
ATTACKER_NICE = 10  # the attacker process's os.nice increment


@pytest.fixture(scope="module", params=["plain", "fronts"])
def server(request, tiny_root, tmp_path_factory, one_torch_thread):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / f"soak-server-{request.param}.log"
    fronts = {"front_processes": "true"} if request.param == "fronts" else {}
    with DrafterServer(model, "eagle3", log_path=log, kv_blocks=8 * SESSION_BLOCKS, block_sizes=16,
                       batch_window_us=500, max_message_bytes=MAX_MESSAGE, **SERVER_SETTINGS, **fronts) as s:
        yield s


def _pids(server) -> list[int]:
    """The serving process and its front processes (none without --front-processes)."""
    return [server.proc.pid, *(server.ready.get("front_pids") or {}).values()]


def _expected(tiny_root, seed: int) -> list:
    """The solo engine's drafts for one session of `seed` through every plan."""
    solo = reference_engine(tiny_root)
    s = scenario(solo, seed)
    return [solo.propose(**s.call(p).kwargs).draft_token_ids for p in plans()]


def _valid_client(make, tiny_root, seed: int, expected: list, until: float, latencies: list) -> None:
    """Sessions one after the other (at least one), each through every plan, until the monotonic time
    `until`; every session's drafts compared with the solo run's."""
    ref = reference_engine(tiny_root)
    rounds = 0
    while rounds == 0 or time.monotonic() < until:
        c = make()
        try:
            c.attach(layout_for(c.info(), SESSION_BLOCKS, client_name=f"valid-{seed}"))
            s = scenario(ref, seed)
            for i, plan in enumerate(plans()):
                t0 = time.perf_counter()
                got = c.propose(**s.call(plan).kwargs).draft_token_ids
                latencies.append(time.perf_counter() - t0)
                assert torch.equal(got, expected[i]), f"client {seed} round {rounds} step {i}"
            c.detach()
        finally:
            c.close()
        rounds += 1


def _run_valid(server, tiny_root, expected, seconds: float) -> dict[str, list]:
    """The valid clients, side by side for about `seconds`: their step latencies (s) by transport."""
    until = time.monotonic() + seconds
    latencies: dict[str, list] = {"grpc": [], "zmq": []}
    makers = [("grpc", lambda: GrpcDrafterClient(server.grpc_target, timeout_s=60)),
              ("zmq", lambda: ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)),
              ("zmq", lambda: ZmqDrafterClient(server.zmq_endpoint, timeout_s=60))]
    errors: list = []

    def run(i, transport, make):
        try:
            _valid_client(make, tiny_root, 11 + i, expected[i], until, latencies[transport])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(i, *m)) for i, m in enumerate(makers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return latencies


class _Attacker:
    """tests/support/attacks.py in its own process at a lower CPU priority: every attack until __exit__."""

    def __init__(self, server, tiny_root):
        self.argv, self.env = attacks.command(server.grpc_target, server.zmq_endpoint, tiny_root, MAX_MESSAGE,
                                              nice=ATTACKER_NICE)
        self.proc: subprocess.Popen | None = None
        self.report: dict = {}

    def __enter__(self):
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=REPO, env=self.env)
        line = self.proc.stdout.readline()  # blocks until every attack runs (or the process died)
        assert json.loads(line or "{}").get("event") == "attacking", self.proc.stderr.read()[-2000:]
        return self

    def __exit__(self, *exc):
        out, err = self.proc.communicate("stop\n", timeout=300)
        assert self.proc.returncode == 0, err[-2000:]
        self.report = json.loads(out.strip().splitlines()[-1])


def _p99(xs) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, 99))


def _phase(server, tiny_root, expected, seconds: float) -> tuple[dict, float, float]:
    """The valid clients' step latencies by transport, the phase's seconds and the server's CPU seconds."""
    cpu = lambda: sum(attacks.process_cpu_s(pid) for pid in _pids(server))  # noqa: E731
    cpu0, t0 = cpu(), time.monotonic()
    latencies = _run_valid(server, tiny_root, expected, seconds)
    return latencies, time.monotonic() - t0, cpu() - cpu0


def test_soak_valid_clients_under_every_attack(server, tiny_root):
    expected = [_expected(tiny_root, 11 + i) for i in range(3)]
    pids = _pids(server)
    unloaded, idle_s, idle_cpu = _phase(server, tiny_root, expected, UNLOADED_S)
    rss_before = sum(rss_mib(pid) for pid in pids)
    with _Attacker(server, tiny_root) as attacker:
        loaded, busy_s, busy_cpu = _phase(server, tiny_root, expected, ATTACKED_S)
    rss_after = sum(rss_mib(pid) for pid in pids)
    report = attacker.report
    refused_lines = sum(1 for ln in server.log_path.read_text().splitlines()
                        if '"event": "refused"' in ln)
    print(f"\nsoak ({len(pids) - 1} front processes) {busy_s:.1f} s under attack; attacks sent: {dict(sorted(report['counts'].items()))}")
    unloaded["all"], loaded["all"] = unloaded["grpc"] + unloaded["zmq"], loaded["grpc"] + loaded["zmq"]
    for transport in ("grpc", "zmq", "all"):
        u, a = _p99(unloaded[transport]), _p99(loaded[transport])
        print(f"valid {transport} clients' p99 step: unloaded {u:.1f} ms, under attack {a:.1f} ms ({a / u:.2f}x; "
              f"{len(unloaded[transport])} / {len(loaded[transport])} steps)")
    print(f"server CPU: {idle_cpu:.1f} s in {idle_s:.1f} s unloaded, {busy_cpu:.1f} s in {busy_s:.1f} s under "
          f"attack; the attackers' (nice {ATTACKER_NICE}) while it ran: {report['cpu_s']:.1f} s")
    print(f"server RSS {rss_before:.0f} -> {rss_after:.0f} MiB; 'call refused' log lines: {refused_lines}")
    assert not report["errors"], report["errors"]
    assert all(report["counts"].get(name) for name in ATTACKS), report["counts"]
    assert rss_after - rss_before < 400, "the attacks must not grow the server's memory"
    assert refused_lines <= 2 * 3 * 16, "the refusal log is throttled per (transport, rpc, code)"
