"""`drafter loadtest`: a smoke run per transport against a real CPU drafter on loopback, and the
pieces it stands on (percentile math, warm-up exclusion, open-loop schedules, valid calls).

The smoke run spawns `drafter serve` on a tiny EAGLE-3 head through the CLI itself (--spawn-server,
ports read from its ready line) and runs each transport for a few seconds at a rate this loaded
2-core machine sustains; the per-call deadline (30 s) is generous because the assertion is "zero errors", not
a speed: a starved box's backlog of an open loop's calls must still be answered within it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from drafter.engine.inputs import Limits, validate
from coordinator.loadtest import cli
from coordinator.loadtest.schedule import OpenLoop, open_loop_times
from coordinator.loadtest.stats import Samples, percentiles, summarize
from coordinator.loadtest.workload import Dist, SessionShape, SessionWorkload, WorkloadConfig, session_blocks

TRANSPORTS = ("zmq", "grpc", "grpc-unary")
WARMUP = 0.5


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, one_torch_thread):
    out = tmp_path_factory.mktemp("loadtest")
    rc = cli.main([
        "--tiny", "eagle3", "--spawn-server", "--device", "cpu", "--transport", ",".join(TRANSPORTS),
        "--rate", "12", "--duration", "3", "--warmup", str(WARMUP), "--max-requests", "200", "--timeout", "30",
        "--dp", "2", "--tp", "2", "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--batch", "uniform:1:6",
        "--prompt-len", "uniform:8:40", "--output-len", "uniform:4:24", "--prefill-chunk", "16",
        "--max-model-len", "128", "--server-arg=--torch-threads=1", "--out", str(out), "--quiet"])
    assert rc == 0, f"loadtest exited {rc}; server log: {(out / 'server.log').read_text()[-3000:]}"
    return out


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_smoke_run_reports_zero_errors(smoke, transport):
    name = f"{transport}-open-12"
    report = json.loads((smoke / f"{name}.json").read_text())
    summ = report["summary"]
    assert summ["calls"] > 10, summ  # ~12/s over 2.5 measured seconds
    assert summ["errors"] == 0 and summ["errors_by_code"] == {}, summ["errors_by_code"]
    assert summ["warmup_errors_by_code"] == {} and summ["never_sent"] == 0
    assert summ["latency_us"]["count"] == summ["ok"] == summ["calls"]
    assert summ["throughput"]["calls_per_s"] > 0 and summ["throughput"]["drafted_tokens_per_s"] > 0
    # real payloads: EAGLE-3 hidden states are 3 x 64 float32 per token, so > 768 bytes a token
    assert summ["request_bytes"]["min"] > 768 and summ["response_bytes"]["min"] > 0
    assert report["config"]["transport"] == transport and report["layout"]["dp"] == 2
    assert len(report["layout"]["sessions"]) == 2
    per_session = np.bincount(report["samples"]["session"], minlength=2)
    assert per_session.min() > 5, per_session  # both DP ranks sent their share
    assert report["server"]["spawned"] and report["server"]["device"] == "cpu"
    assert report["host"]["cpus"] and report["started_at"].endswith("+00:00")
    png = (smoke / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    index = json.loads((smoke / "index.json").read_text())
    assert [r["name"] for r in index["runs"]] == [f"{t}-open-12" for t in TRANSPORTS]
    assert index["server"]["exit_code"] == 0  # drained and stopped cleanly


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_report_percentiles_come_from_its_samples(smoke, transport):
    """Recompute with numpy alone from the report's raw samples: the same numbers, exactly."""
    report = json.loads((smoke / f"{transport}-open-12.json").read_text())
    s = report["samples"]
    assert report["percentiles"] == {"method": "linear", "values": [50.0, 90.0, 99.0, 99.9]}
    measured = [i for i, t in enumerate(s["scheduled_s"]) if t >= report["config"]["warmup_s"]]
    ok = [i for i in measured if s["code"][i] == "OK"]
    assert len(measured) < len(s["code"])  # some samples fell in the warm-up and were left out
    for column, key in (("latency_us", "latency_us"), ("service_us", "service_us"),
                        ("request_bytes", "request_bytes"), ("response_bytes", "response_bytes")):
        values = np.array([s[column][i] for i in ok], dtype=np.float64)
        want = np.percentile(values, [50, 90, 99, 99.9], method="linear")
        got = report["summary"][key]
        assert [got["p50"], got["p90"], got["p99"], got["p99_9"]] == want.tolist(), column
        assert got["count"] == len(ok) and got["max"] == values.max() and got["min"] == values.min()
    window = report["end_s"] - report["config"]["warmup_s"]
    assert report["summary"]["throughput"]["calls_per_s"] == pytest.approx(len(ok) / window)
    # latency counts from the scheduled send time: never less than the RPC alone
    assert all(s["latency_us"][i] >= s["service_us"][i] for i in ok)


# ------------------------------------------------------------------ stats
def _samples(latencies_us, scheduled_s, codes=None) -> Samples:
    s = Samples()
    for i, (lat, t) in enumerate(zip(latencies_us, scheduled_s)):
        s.add(session=0, scheduled=t, sent=t, done=t + lat / 1e6, batch=2, tokens=8, prefills=0, drafted=6,
              request_bytes=1000 + i, response_bytes=100, code=(codes or {}).get(i, "OK"))
    return s


def test_percentiles_on_known_samples():
    p = percentiles(np.arange(1, 101))  # 1..100
    assert (p["p50"], p["p90"], p["p99"], p["p99_9"]) == pytest.approx((50.5, 90.1, 99.01, 99.901))
    assert (p["count"], p["min"], p["max"], p["mean"]) == (100, 1, 100, 50.5)
    assert percentiles([])["p99"] is None and percentiles([])["count"] == 0
    assert percentiles([7.0])["p99_9"] == 7.0


def test_warmup_is_excluded():
    # 10 warm-up calls, slow and partly failed; then latencies 1..100 us, one every 10 ms
    warm = _samples([1e6] * 10, [i * 0.01 for i in range(10)], codes={3: "UNAVAILABLE"})
    steady = _samples(range(1, 101), [1.0 + i * 0.01 for i in range(100)], codes={99: "DEADLINE_EXCEEDED"})
    warm.extend(steady)
    summ = summarize(warm, warmup_s=1.0, end_s=2.0)
    assert summ["calls"] == 100 and summ["ok"] == 99 and summ["warmup_calls"] == 10
    assert summ["errors_by_code"] == {"DEADLINE_EXCEEDED": 1}
    assert summ["warmup_errors_by_code"] == {"UNAVAILABLE": 1}
    lat = summ["latency_us"]
    assert lat["max"] == pytest.approx(99, abs=0.11) and lat["count"] == 99  # no warm-up second, no failure
    assert lat["p50"] == pytest.approx(np.percentile(np.arange(1, 100), 50), abs=0.11)
    assert summ["throughput"]["calls_per_s"] == pytest.approx(99.0)
    assert summ["throughput"]["drafted_tokens_per_s"] == pytest.approx(99 * 6)


def test_samples_roundtrip_through_json_with_never_sent_calls():
    s = _samples([10.0, 20.0], [1.0, 1.1])
    s.add(session=1, scheduled=1.2, sent=float("nan"), done=2.3, batch=1, tokens=4, prefills=0, drafted=3,
          request_bytes=0, response_bytes=0, code="DEADLINE_EXCEEDED")
    cols = json.loads(json.dumps(s.to_columns(), allow_nan=False))
    back = Samples.from_columns(cols)
    a, b = summarize(s, warmup_s=0, end_s=2), summarize(back, warmup_s=0, end_s=2)
    assert a == b and a["never_sent"] == 1 and a["errors_by_code"] == {"DEADLINE_EXCEEDED": 1}


# ------------------------------------------------------------------ schedule
def test_poisson_schedule_has_the_asked_rate():
    times = open_loop_times(500.0, 40.0, arrival="poisson", seed=3)
    gaps = np.diff(times)
    assert len(times) == pytest.approx(20_000, rel=0.03)
    assert gaps.mean() == pytest.approx(1 / 500, rel=0.02)
    assert gaps.std() == pytest.approx(1 / 500, rel=0.05)  # exponential: std == mean
    assert np.all(gaps >= 0) and times[-1] < 40.0 and times[0] >= 0
    assert np.array_equal(times, open_loop_times(500.0, 40.0, arrival="poisson", seed=3))  # seeded
    assert not np.array_equal(times[:100], open_loop_times(500.0, 40.0, seed=4)[:100])


def test_constant_schedule_and_bounds():
    times = open_loop_times(100.0, 2.0, arrival="constant")
    assert len(times) == 200 and np.allclose(np.diff(times), 0.01)
    assert len(open_loop_times(100.0, 2.0, arrival="poisson", seed=1, max_calls=50)) == 50
    streams = OpenLoop(300.0).session_times(3, 20.0, seed=0, max_calls=0)
    assert len(streams) == 3 and sum(map(len, streams)) == pytest.approx(6000, rel=0.05)
    assert sum(map(len, OpenLoop(300.0).session_times(3, 20.0, seed=0, max_calls=90))) <= 90
    with pytest.raises(ValueError):
        open_loop_times(0.0, 1.0)


# ------------------------------------------------------------------ workload
@pytest.mark.parametrize("block_sizes", [(16,), (8, 32)])
def test_workload_calls_are_always_valid(block_sizes):
    """Hundreds of steps through the engine's own validation: block tables inside the session's
    pool, slot mappings that agree with them, positions and seq_lens consistent, budgets kept."""
    shape = SessionShape(hidden_width=96, hidden_dtype="bfloat16", vocab_size=300, max_model_len=160,
                         block_sizes=block_sizes, num_speculative_tokens=3, draft_span=2, num_drafts=3)
    cfg = WorkloadConfig(max_num_seqs=6, max_num_batched_tokens=64, batch=Dist("uniform:1:6"),
                         prompt_len=Dist("lognormal:40:0.8"), output_len=Dist("uniform:5:60"), prefill_chunk=24)
    limits = Limits(max_model_len=160, max_num_seqs=6, max_num_batched_tokens=64, vocab_size=300, hidden_width=96,
                    num_blocks=session_blocks(shape, cfg), block_sizes=block_sizes, draft_span=2)
    w = SessionWorkload(shape, cfg, seed=5)
    steps = [w.step() for _ in range(400)]
    for st in steps:
        validate(_inputs(st.kwargs), limits)
        assert st.kwargs["target_hidden_states"].dtype == torch.bfloat16
        assert st.num_tokens <= 64 and 1 <= st.batch <= 6 and st.drafted == 3 * st.batch
    assert w.requests_started > 6 * 3  # requests finished and new ones reused their slots' blocks
    assert 0 < sum(s.prefills for s in steps) < sum(s.batch for s in steps) / 2  # occasional prefill
    assert any("num_rejected_tokens" in s.kwargs for s in steps)
    # a slot's blocks stay in its own range: slot i owns [i*W, (i+1)*W)
    for g, blocks in enumerate(w.blocks):
        width = blocks.shape[1]
        assert np.array_equal(np.sort(blocks, axis=1), np.arange(6)[:, None] * width + np.arange(width))


def _inputs(kw):
    from drafter.wire.records import ProposeInputs

    return ProposeInputs(kw["target_token_ids"], kw["target_positions"], kw["target_hidden_states"],
                         kw["next_token_ids"], kw["query_start_loc"], kw["seq_lens"], kw["block_tables"],
                         kw["slot_mappings"], kw.get("token_indices_to_sample"), kw.get("num_rejected_tokens"), None)


def test_distribution_specs():
    rng = np.random.default_rng(0)
    assert Dist("fixed:7").draw(rng, 1, 64) == 7
    assert Dist("fixed:700").draw(rng, 1, 64) == 64  # clipped to the bounds
    xs = Dist("uniform:2:5").draw(rng, 1, 64, size=1000)
    assert xs.min() == 2 and xs.max() == 5
    for bad in ("uniform:5", "gauss:1:2", "uniform:9:1", "fixed:x"):
        with pytest.raises(ValueError):
            Dist(bad)


@pytest.mark.parametrize("argv", [
    ["--transport", "zmq,grpc", "--endpoint", "127.0.0.1:1"],  # one endpoint, two transports
    ["--transport", "http"],
    ["--spawn-server"],  # nothing to serve
    ["--tiny", "eagle3"],  # a model without --spawn-server
    ["--duration", "1", "--warmup", "2"],
    ["--batch", "uniform:1"],
])
def test_cli_refuses_bad_arguments(argv, capsys):
    assert cli.main(argv) == 2
    assert "drafter loadtest:" in capsys.readouterr().err


# ------------------------------------------------------------------ a user's first runs (issue 20)
def test_cpu_defaults_fit_the_machine_and_the_knee_is_reported(tmp_path, capsys, one_torch_thread):
    """The docs' fresh-machine command, shortened: with no rate or workload flag the CPU profile's ladder
    starts at 8 calls/s and the report says where the knee is.  Whether 8 calls/s is served within the
    1 s default deadline is the machine's speed, not this test's subject (a starved CI box lost more than
    1% of them): a start that is served climbs the ladder, one that is not descends it (the halving is
    tests/unit/test_loadtest_verdict.py's), and either way the knee reported is the one the runs show."""
    from coordinator.loadtest.verdict import served

    out = tmp_path / "out"
    rc = cli.main(["--tiny", "eagle3", "--spawn-server", "--device", "cpu", "--duration", "2", "--warmup", "0.5",
                   "--server-arg=--torch-threads=1", "--out", str(out), "--quiet", "--no-plot"])
    err = capsys.readouterr().err
    assert rc == 0, err
    index = json.loads((out / "index.json").read_text())
    assert index["server"]["profile"] == "cpu" and index["runs"][0]["name"] == "zmq-open-8", index["runs"]
    rates = [float(r["name"].rsplit("-", 1)[1]) for r in index["runs"]]
    ok = [served(r["summary"]) for r in index["runs"]]
    knee = index["knees"]
    assert len(knee) == 1 and ("knee" in err or "no knee up to" in err), err
    if ok[0]:  # served at the start: climbed while each rate was served
        assert rates == [8.0 * 2 ** i for i in range(len(rates))] and all(ok[:-1]), (rates, ok)
        assert knee[0]["served_rate"] == max(r for r, s in zip(rates, ok) if s) >= 8
    else:  # a slower or busier machine than the profile assumes: halved until one rate was served
        assert rates == [8.0 / 2 ** i for i in range(len(rates))] and not any(ok[:-1]), (rates, ok)
        assert knee[0]["served_rate"] == (rates[-1] if ok[-1] else None) and knee[0]["failed_rate"] == (
            rates[-2] if ok[-1] else rates[-1]), (knee, rates, ok)


def test_a_run_whose_every_call_failed_exits_non_zero_and_says_why(eagle3_server, tmp_path, capsys):
    rc = cli.main(["--endpoint", eagle3_server.zmq_endpoint, "--device", "cpu", "--rate", "4", "--timeout", "0.0005",
                   "--duration", "1.5", "--warmup", "0.25", "--out", str(tmp_path / "out"), "--quiet", "--no-plot"])
    err = capsys.readouterr().err
    assert rc == cli.NOTHING_ANSWERED, err
    why = [ln for ln in err.splitlines() if ln.startswith("drafter loadtest: no answer in zmq-open-4")]
    assert len(why) == 1 and "--timeout 0.0005 s" in why[0] and "below the drafter's service time" in why[0], err


def test_sessions_fit_a_drafter_with_a_smaller_pool(tmp_path, capsys, one_torch_thread):
    """`serve`'s pool (here 64 blocks) smaller than the sessions the load test wants (2 x 8 slots of 6
    blocks): fewer slots, and the report says so. The subject is the layout, not the speed: a per-call deadline
    of 30 s keeps the run's calls answered on a starved box (CI once missed the 1 s default on every call while
    the vLLM lane held both cores), so the exit status says only whether the layout was served."""
    out = tmp_path / "out"
    rc = cli.main(["--tiny", "eagle3", "--spawn-server", "--device", "cpu", "--dp", "2", "--max-num-seqs", "8",
                   "--max-model-len", "96", "--rate", "4", "--duration", "1.5", "--warmup", "0.25", "--timeout", "30",
                   "--server-arg=--kv-blocks=64", "--server-arg=--torch-threads=1", "--out", str(out), "--quiet",
                   "--no-plot"])
    err = capsys.readouterr().err
    assert rc == 0, err
    run = json.loads((out / "index.json").read_text())["runs"][0]
    assert any("--max-num-seqs lowered 8 -> 5" in n for n in run["notes"]), run["notes"]
    report = json.loads((out / "zmq-open-4.json").read_text())
    assert report["layout"]["attach_request"]["max_num_seqs"] == 5  # 64 blocks / 2 sessions / 6 a slot


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_drafter_listening_is_one_line_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "never"
    rc = cli.main(["--endpoint", f"127.0.0.1:{_closed_port()}", "--device", "cpu", "--rate", "4", "--duration", "1",
                   "--warmup", "0.2", "--out", str(out), "--quiet"])
    cap = capsys.readouterr()
    assert rc == 1 and cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "no drafter at 127.0.0.1:" in lines[0] and "drafter serve" in lines[0], cap.err
    assert not out.exists()  # no "reports in" an empty folder


def _holding(path) -> list[int]:
    """Processes whose stderr is `path` (the spawned drafter writes its log there)."""
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/fd/2") == str(path):
                pids.append(int(pid))
        except OSError:
            continue
    return pids


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads /proc")
def test_the_spawned_drafter_stops_when_the_output_pipe_closes(tmp_path):
    """`drafter loadtest ... | head`-like: our stdout and stderr are gone before the drafter is ready.
    The write that fails must not leave the drafter running (it held ports and ~300 MB)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support.servers import REPO

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "drafter", "loadtest", "--tiny", "eagle3", "--spawn-server",
                             "--device", "cpu", "--rate", "4", "--duration", "1", "--warmup", "0.2", "--out", str(out),
                             "--server-arg=--torch-threads=1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    proc.stderr.close()
    try:
        rc = proc.wait(timeout=180)
        left = _holding(out / "server.log")
        assert left == [], "the spawned drafter outlived the load generator"
        assert rc != 0
    finally:
        for pid in _holding(out / "server.log"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(__import__("os"), "pidfd_open"), reason="needs pidfd (Linux)")
def test_the_spawned_drafter_stops_when_the_load_generator_is_killed(tmp_path):
    """SIGKILL runs no finally: the drafter learns of its parent's death from the kernel (PDEATHSIG)."""
    import os
    import select
    import signal
    import subprocess
    import sys

    from tests.support.servers import REPO

    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.Popen([sys.executable, "-m", "drafter", "loadtest", "--tiny", "eagle3", "--spawn-server",
                             "--device", "cpu", "--rate", "2", "--duration", "120", "--warmup", "1", "--out", str(out),
                             "--quiet", "--no-plot", "--server-arg=--torch-threads=1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    pids = []
    try:
        for line in proc.stderr:  # the line it prints once its drafter is ready
            if line.startswith("drafter serve ready"):
                break
        pids = _holding(out / "server.log")
        assert len(pids) == 1, pids
        server = os.pidfd_open(pids[0])
        proc.kill()
        proc.wait()
        gone, _, _ = select.select([server], [], [], 60)  # readable once the drafter has exited
        os.close(server)
        assert gone, "the spawned drafter outlived a killed load generator"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _holding(out / "server.log"):
            os.kill(pid, signal.SIGKILL)
