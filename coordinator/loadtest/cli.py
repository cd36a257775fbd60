"""`drafter loadtest` (alias `drafter-loadtest`): the RPC load generator.

    drafter loadtest --tiny eagle3 --spawn-server --duration 5                  # a fresh machine
    drafter loadtest --transport grpc --endpoint 10.0.0.7:50051 --rate 500 --dp 4
    drafter loadtest --shape llama3-8b-eagle3 --spawn-server --device cuda:0 \\
        --transport zmq,grpc --mode open,closed --rate 100,400 --duration 25 --out bench/results/x
    drafter loadtest --predraft --tiny eagle3 --spawn-server --verify-ms 200   # pushed pre-drafts vs none

Several transports / modes / rates make several runs (one report each) against one drafter.
Without --rate, the open loop doubles its rate from a start that fits the drafter's device
(CPU 8 calls/s, GPU 100) until a rate loses more than 1% of its calls, and says where the knee is;
when the start itself loses more (a slower or busier machine), it halves the rate instead, down to
1 call/s, until one is served.
Workload defaults fit the device too (CPU: 8 request slots, short prompts); the flags' help gives
both.  Exit status: 0; 2 bad arguments; 1 the run could not start or was cut short; 3 some
transport got no answer at all (the line before says why); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from coordinator import client_auth
from coordinator.loadtest.clients import TRANSPORTS
from coordinator.loadtest.schedule import ARRIVALS, ClosedLoop, OpenLoop
from coordinator.loadtest.workload import Dist, SessionShape, WorkloadConfig, blocks_per_slot

DEFAULT_PORTS = {"zmq": 5555, "grpc": 50051, "grpc-unary": 50051}
NOTHING_ANSWERED = 3  # exit status: some transport got no successful call in any run
MIN_SWEEP_RATE = 1.0  # calls/s: the default ladder descends from its start down to this, no further

# Defaults that fit the drafter's device: a CPU drafter serves a tiny head in tens of ms a call.
PROFILES = {
    "cpu": dict(rates=(8.0, 16.0, 32.0, 64.0, 128.0, 256.0), max_num_seqs=8, max_num_batched_tokens=256,
                prompt_len="lognormal:64:0.8", output_len="lognormal:48:0.7", prefill_chunk=64, max_model_len=512),
    "gpu": dict(rates=(100.0, 200.0, 400.0, 800.0, 1600.0, 3200.0), max_num_seqs=64, max_num_batched_tokens=2048,
                prompt_len="lognormal:256:0.8", output_len="lognormal:192:0.7", prefill_chunk=512,
                max_model_len=2048),
}


def _default(key: str) -> str:
    cpu, gpu = PROFILES["cpu"][key], PROFILES["gpu"][key]
    show = lambda v: ",".join(f"{x:g}" for x in v) if isinstance(v, tuple) else v  # noqa: E731
    return f"[CPU drafter {show(cpu)}; GPU {show(gpu)}]"


def _list(kind):
    def parse(text: str):
        return [kind(x) for x in str(text).split(",") if x.strip()]
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafter to load")
    g.add_argument("--transport", type=_list(str), default=["zmq"],
                   help=f"one or a comma list of {', '.join(TRANSPORTS)} (grpc = the bidi stream, the per-step "
                        "path; grpc-unary = one Propose RPC per step) [default zmq]")
    g.add_argument("--endpoint", default="", help="HOST:PORT of the drafter (one transport; default 127.0.0.1 "
                                                  "and port 5555 for zmq, 50051 for grpc)")
    g.add_argument("--spawn-server", action="store_true",
                   help="start a local `drafter serve` on loopback (free ports, read from its ready line) and "
                        "stop it at the end")
    g.add_argument("--tiny", metavar="VARIANT", help="spawn on a tiny random checkpoint (make-tiny), e.g. eagle3")
    g.add_argument("--shape", metavar="PRESET",
                   help="spawn on a random-weight head of real shape: llama3-8b-eagle3, llama3-70b-eagle3, "
                        "mini-eagle3 (written once under --shape-dir)")
    g.add_argument("--shape-dir", default="", help="where --shape writes its checkpoint [default $TMPDIR/"
                                                    "drafter-shapes/PRESET]")
    g.add_argument("--model", help="spawn on this head checkpoint directory")
    g.add_argument("--target-model", help="the target checkpoint directory the head needs")
    g.add_argument("--method", help="head method of --model: eagle | eagle3 | mtp | extract_hidden_states")
    g.add_argument("--device", default="auto", help="spawned drafter's device: cpu | cuda:N | auto (without "
                                                    "--spawn-server: a label for the report)")
    g.add_argument("--k", type=int, default=3, help="spawned drafter's num_speculative_tokens [3]")
    g.add_argument("--max-model-len", type=int, default=None,
                   help=f"spawned drafter's max_model_len {_default('max_model_len')}")
    g.add_argument("--block-size", type=int, default=16, help="spawned drafter's KV block size [16]")
    g.add_argument("--server-arg", action="append", default=[], metavar="--FLAG=VALUE",
                   help="extra `drafter serve` flag for the spawned drafter (repeat), e.g. "
                        "--server-arg=--batch-window-us=200 (on a CPU it runs --torch-threads 1 unless given)")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the spawned "
                                                                      "drafter's ready line [600]")

    g = p.add_argument_group("client auth (a drafter serving with CURVE or mTLS; docs/security.md)")
    client_auth.add_arguments(g)

    g = p.add_argument_group("simulated target")
    g.add_argument("--dp", type=int, default=1, help="sessions = DP ranks of the target, each attached once [1]")
    g.add_argument("--tp", type=int, default=1,
                   help="TP ranks per DP rank; recorded only: TP rank 0 sends for its group (hidden states are "
                        "replicated) and the drafts reach the others through the target's own group, so TP does "
                        "not multiply drafter traffic [1]")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="request slots per session (capped by the drafter's limit and by its free KV blocks) "
                        + _default("max_num_seqs"))
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step " + _default("max_num_batched_tokens"))
    g.add_argument("--batch", default="", help="batch size per step: fixed:N | uniform:LO:HI | normal:MEAN:STD | "
                                               "lognormal:MEDIAN:SIGMA [uniform:1:max-num-seqs]")
    g.add_argument("--prompt-len", default=None, help="prompt tokens per request " + _default("prompt_len"))
    g.add_argument("--output-len", default=None, help="output tokens per request " + _default("output_len"))
    g.add_argument("--prefill-chunk", type=int, default=None,
                   help="most prompt tokens per request and step " + _default("prefill_chunk"))
    g.add_argument("--max-request-len", type=int, default=0,
                   help="cap on a request's length; sizes each session's KV pool [max_model_len]")
    g.add_argument("--acceptance", type=float, default=0.7, help="per-draft acceptance probability, sets the "
                                                                 "rejected counts [0.7]")
    g.add_argument("--seed", type=int, default=0, help="seeds the schedule, the workload and a tiny checkpoint [0]")

    g = p.add_argument_group("schedule and bounds")
    g.add_argument("--mode", type=_list(str), default=["open"], help="open | closed, or both: open,closed [open]")
    g.add_argument("--rate", type=_list(float), default=None,
                   help="open loop: calls/s over all sessions; a comma list makes one run per rate [doubling from "
                        "8 (CPU drafter) or 100 (GPU) until a rate loses > 1%% of its calls, at most 6 runs]")
    g.add_argument("--arrival", choices=ARRIVALS, default="poisson", help="open-loop arrivals [poisson]")
    g.add_argument("--max-inflight", type=int, default=8, help="open loop: senders (connections) per session [8]")
    g.add_argument("--concurrency", type=int, default=1, help="closed loop: calls in flight per session [1]")
    g.add_argument("--duration", type=float, default=10.0, help="seconds per run, warm-up included [10]")
    g.add_argument("--warmup", type=float, default=2.0, help="first seconds left out of the statistics [2]")
    g.add_argument("--max-requests", type=int, default=0, help="most calls per run, warm-up included (0: no "
                                                               "bound but the duration) [0]")
    g.add_argument("--timeout", type=float, default=1.0, help="per-call deadline in seconds (open loop: from the "
                                                              "scheduled send time) [1.0]")

    g = p.add_argument_group("pre-drafting (docs/predraft.md)")
    g.add_argument("--predraft", action="store_true",
                   help="instead of the runs above: sessions of a simulated target that verifies for --verify-ms "
                        "per step, without and then with pushed pre-drafts (zmq only); reports hit rate and the "
                        "draft latency a step waits (coordinator/loadtest/predraft.py)")
    g.add_argument("--predraft-outcomes", type=int, default=4,
                   help="spawned drafter's --predraft-outcomes (the budget's most) [4]")
    g.add_argument("--predraft-batch", type=int, default=4, help="requests per step of each session [4]")
    g.add_argument("--verify-ms", type=float, default=None,
                   help="the simulated target's verify time per step [CPU drafter 200; GPU 10]")

    g = p.add_argument_group("output")
    g.add_argument("--out", default="", help="directory for the reports [./loadtest-DATE-TIME]")
    g.add_argument("--no-plot", action="store_true", help="no PNG (no matplotlib needed)")
    g.add_argument("--quiet", action="store_true", help="no progress bar (also when stderr is no terminal)")
    g.add_argument("--fail-on-errors", action="store_true", help="exit 1 when any measured call failed (a run "
                                                                  "with no answer at all exits 3 regardless)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "loadtest", help="RPC load generator: simulated DP x TP target sessions against a drafter",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="drafter-loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


# ------------------------------------------------------------------ checks and plans
def _profile_name(ns) -> str:
    """cpu or gpu: the device of the drafter under load (spawned: where it runs; --endpoint: --device
    when given, else this machine's)."""
    if ns.device != "auto":
        return "cpu" if ns.device == "cpu" else "gpu"
    import torch
    return "gpu" if torch.cuda.is_available() else "cpu"


def apply_profile(ns) -> str:
    """Fill every workload flag left unset from the device's profile; returns its name."""
    name = _profile_name(ns)
    for key, value in PROFILES[name].items():
        if key != "rates" and getattr(ns, key) is None:
            setattr(ns, key, value)
    return name


def _check(ns) -> str | None:
    bad = [t for t in ns.transport if t not in TRANSPORTS]
    if bad or not ns.transport:
        return f"--transport: {bad or 'none'}; choose from {TRANSPORTS}"
    if any(m not in ("open", "closed") for m in ns.mode) or not ns.mode:
        return "--mode: open, closed or open,closed"
    if ns.endpoint and (len(ns.transport) > 1 or ns.spawn_server):
        return "--endpoint names one drafter port: use it with one transport and without --spawn-server"
    sources = [x for x in (ns.tiny, ns.shape, ns.model) if x]
    if ns.spawn_server and len(sources) != 1:
        return "--spawn-server needs one of --tiny, --shape or --model"
    if not ns.spawn_server and sources:
        return "--tiny / --shape / --model choose what a spawned drafter serves: add --spawn-server"
    if ns.model and not ns.method:
        return "--model needs --method"
    if ns.warmup < 0 or ns.duration <= ns.warmup:
        return f"--duration ({ns.duration}) must exceed --warmup ({ns.warmup})"
    if ns.dp < 1 or ns.tp < 1 or ns.max_inflight < 1 or ns.concurrency < 1:
        return "--dp, --tp, --max-inflight and --concurrency must be >= 1"
    if "open" in ns.mode and ns.rate is not None and (not ns.rate or any(r <= 0 for r in ns.rate)):
        return "--rate must be positive"
    if not 0.0 <= ns.acceptance <= 1.0:
        return "--acceptance must lie in [0, 1]"
    if ns.predraft and (ns.transport != ["zmq"] or ns.predraft_outcomes < 1 or ns.predraft_batch < 1):
        return "--predraft: pushes travel on zmq only (--transport zmq), with --predraft-outcomes and " \
               "--predraft-batch >= 1"
    try:
        _workload(ns)
        ns.auth = client_auth.ClientAuth.from_args(ns, {"zmq" if t == "zmq" else "grpc" for t in ns.transport})
    except ValueError as exc:
        return str(exc)
    return None


def _workload(ns) -> WorkloadConfig:
    return WorkloadConfig(
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        batch=Dist(ns.batch or f"uniform:1:{ns.max_num_seqs}"), prompt_len=Dist(ns.prompt_len),
        output_len=Dist(ns.output_len), prefill_chunk=ns.prefill_chunk, acceptance=ns.acceptance,
        max_request_len=ns.max_request_len)


def _plan(ns, profile: str):
    """(transport, [(schedule, name)], sweep) per transport and mode, in order; sweep: the rates are
    the profile's doubling ladder, climbed only while each rate is served."""
    out = []
    for transport in ns.transport:
        for mode in ns.mode:
            if mode == "open":
                rates = ns.rate or list(PROFILES[profile]["rates"])
                runs = [(OpenLoop(r, ns.arrival, ns.max_inflight), f"{transport}-open-{r:g}") for r in rates]
                out.append((transport, runs, ns.rate is None))
            else:
                out.append((transport, [(ClosedLoop(ns.concurrency), f"{transport}-closed-c{ns.concurrency}")],
                            False))
    return out


def _checkpoint(ns, tmp: Path) -> tuple[str, Path, Path | None]:
    """(method, head dir, target dir) of what the spawned drafter serves."""
    if ns.tiny:
        from drafter.models.tiny import write_tiny

        method = write_tiny(ns.tiny, tmp / "tiny", seed=ns.seed)
        return method, tmp / "tiny" / "head", tmp / "tiny" / "target"
    if ns.shape:
        from coordinator.loadtest.shapes import write_shaped

        where = Path(ns.shape_dir) if ns.shape_dir else Path(tempfile.gettempdir()) / "drafter-shapes" / ns.shape
        t0 = time.monotonic()
        method, model, target = write_shaped(ns.shape, where, seed=ns.seed)
        print(f"shape {ns.shape}: checkpoint in {where} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
        return method, Path(model), Path(target) if target else None
    return ns.method, Path(ns.model), Path(ns.target_model) if ns.target_model else None


def _server(ns, out: Path, tmp: Path):
    """The drafter to spawn, not started yet (the caller holds it before it can fail to start)."""
    from coordinator.loadtest.spawn import SpawnedServer

    method, model, target = _checkpoint(ns, tmp)
    # The pool: every session gets one block range per request slot (workload.blocks_per_slot).
    probe = SessionShape(hidden_width=1, hidden_dtype="float32", vocab_size=2, max_model_len=ns.max_model_len,
                         block_sizes=(ns.block_size,), num_speculative_tokens=ns.k, draft_span=ns.k - 1,
                         num_drafts=ns.k)
    per_session = ns.max_num_seqs * blocks_per_slot(probe, _workload(ns))[0]
    settings = dict(num_speculative_tokens=ns.k, max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                    max_num_batched_tokens=ns.max_num_batched_tokens, block_sizes=ns.block_size,
                    kv_blocks=ns.dp * per_session, max_sessions=max(ns.dp, 1) + 1)
    if ns.predraft:  # every session: a batch of rows as long as the drafter's max_model_len, and scratch
        per_req = -(-ns.max_model_len // ns.block_size)
        settings.update(predraft_outcomes=ns.predraft_outcomes, max_num_seqs=max(ns.max_num_seqs, ns.predraft_batch),
                        kv_blocks=ns.dp * ns.predraft_batch * per_req + 8)
    if _device(ns.device) == "cpu" and not any(a.startswith("--torch-threads") for a in ns.server_arg):
        # OpenMP threads gain a small head nothing and, on a busy few-core host, make every call wait
        # for a thread the OS parked: one thread (--server-arg=--torch-threads=N to change)
        settings["torch_threads"] = 1
    server = SpawnedServer(method=method, model=str(model), target_model=str(target) if target else None,
                           device=ns.device, settings=settings, log_path=out / "server.log",
                           extra_args=ns.server_arg)
    desc = {"spawned": True, "method": method, "model": str(model), "target_model": str(target or ""),
            "tiny": ns.tiny, "shape": ns.shape, "device": _device(ns.device), "args": server.args[3:]}
    return server, desc


def _start(ns, server, desc: dict) -> None:
    t0 = time.monotonic()
    server.start(ns.ready_timeout)
    desc.update(ready_s=round(time.monotonic() - t0, 1), ready=server.ready)
    print(f"drafter serve ready in {desc['ready_s']} s on {desc['device']} (grpc {server.ready['grpc_port']}, "
          f"zmq {server.ready['zmq_port']})", file=sys.stderr)


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def _endpoint(ns, transport: str, server) -> str:
    if server is not None:
        return server.endpoint(transport)
    return ns.endpoint or f"127.0.0.1:{DEFAULT_PORTS[transport]}"


def _config(ns, transport, sched, endpoint, wl: WorkloadConfig) -> dict:
    return {"transport": transport, "endpoint": endpoint, "schedule": sched.describe(), "dp": ns.dp, "tp": ns.tp,
            "duration_s": ns.duration, "warmup_s": ns.warmup, "max_requests": ns.max_requests,
            "timeout_s": ns.timeout, "seed": ns.seed,
            "workload": {**{k: (repr(v) if isinstance(v, Dist) else v) for k, v in vars(wl).items()}}}


def _line(name: str, summ: dict) -> str:
    lat = summ["latency_us"]
    f = lambda v: "-" if v is None else f"{v / 1e3:8.3f}"  # noqa: E731
    return (f"{name:<24} {summ['throughput']['calls_per_s']:9.1f} {f(lat['p50'])} {f(lat['p90'])} {f(lat['p99'])} "
            f"{f(lat['p99_9'])} {summ['request_bytes']['mean'] or 0:11.0f} {summ['errors']:6d} "
            f"{json.dumps(summ['errors_by_code']) if summ['errors'] else ''}")


# ------------------------------------------------------------------ run
class _Session:
    """One invocation's runs against one drafter: the reports, the index, the knees, the verdict."""

    def __init__(self, ns, out: Path, server, server_desc: dict, command: list[str]):
        self.ns, self.out, self.server, self.server_desc, self.command = ns, out, server, server_desc, command
        self.index: list[dict] = []
        self.open_runs: dict[str, list] = {}  # transport -> [(rate, summary)]
        self.answered: dict[str, bool] = {}  # transport -> any successful call in any run
        self.failures: list[str] = []  # why a run got no answer at all
        self.failed = False  # some measured call failed
        self.interrupted = False

    def one(self, transport: str, sched, name: str) -> dict:
        from coordinator.loadtest.progress import progress_bar
        from coordinator.loadtest.report import build_report, plot, write_json
        from coordinator.loadtest.runner import RunConfig, Runner
        from coordinator.loadtest.verdict import answered, why_all_failed

        ns = self.ns
        endpoint = _endpoint(ns, transport, self.server)
        wl = _workload(ns)
        runner = Runner(RunConfig(transport=transport, endpoint=endpoint, schedule=sched, workload=wl, dp=ns.dp,
                                  tp=ns.tp, duration_s=ns.duration, warmup_s=ns.warmup,
                                  max_requests=ns.max_requests, timeout_s=ns.timeout, seed=ns.seed, auth=ns.auth))
        with progress_bar(name, ns.duration, ns.quiet) as bar:
            result = runner.run(bar)
        wl_used = replace(wl, max_num_seqs=result.layout.max_num_seqs,
                          max_num_batched_tokens=result.layout.max_num_batched_tokens)
        report = build_report(result, config=_config(ns, transport, sched, endpoint, wl_used),
                              server=self.server_desc, command=self.command)
        write_json(report, self.out / f"{name}.json")
        if not ns.no_plot:
            plot(report, self.out / f"{name}.png")
        summ = report["summary"]
        self.failed |= summ["errors"] > 0
        if not self.index:  # the table's header, once there is a row to show
            print(f"{'run':<24} {'calls/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'p99.9':>8} "
                  f"{'req bytes':>11} {'errors':>6}")
        print(_line(name, summ), flush=True)
        for note in result.notes:
            print(f"  note: {note}", file=sys.stderr)
        got = answered(summ)
        self.answered[transport] = self.answered.get(transport, False) or got
        if not got and not runner.stop.is_set():
            self.failures.append(f"{name}: {why_all_failed(report)}")
        if isinstance(sched, OpenLoop):
            self.open_runs.setdefault(transport, []).append((sched.rate, summ))
        self.index.append({"name": name, "report": f"{name}.json", "png": None if ns.no_plot else f"{name}.png",
                           "transport": transport, "schedule": sched.describe(), "notes": result.notes,
                           "summary": {k: summ[k] for k in ("calls", "ok", "errors", "errors_by_code",
                                                            "latency_us", "service_us", "throughput",
                                                            "request_bytes", "response_bytes")}})
        self.interrupted = runner.stop.is_set()
        return summ

    def all(self, plan) -> None:
        from coordinator.loadtest.verdict import served

        for transport, runs, sweep in plan:
            for i, (sched, name) in enumerate(runs):
                summ = self.one(transport, sched, name)
                if self.interrupted:
                    return
                if sweep and not served(summ):
                    if i == 0:  # the ladder's start is already above what this drafter serves now
                        self._descend(transport, sched)
                    break  # the knee is found: higher rates would only fail more

    def _descend(self, transport: str, first: OpenLoop) -> None:
        """The default ladder's lowest rate was not served (a slower or busier machine than the
        profile assumes): halve the rate, down to MIN_SWEEP_RATE, until one is served, so the
        report finds the knee below the start instead of ending with no answer."""
        from coordinator.loadtest.verdict import served

        rate = first.rate / 2
        while rate >= MIN_SWEEP_RATE:
            _say(f"{transport}: {rate * 2:g} calls/s lost more than 1% of its calls; trying {rate:g}")
            summ = self.one(transport, replace(first, rate=rate), f"{transport}-open-{rate:g}")
            if self.interrupted or served(summ):
                return
            rate /= 2

    def knees(self) -> list:
        from coordinator.loadtest.verdict import find_knee

        return [k for k in (find_knee(t, runs) for t, runs in self.open_runs.items()) if k is not None]

    def write_index(self) -> None:
        if not self.index:
            return
        server = {k: v for k, v in self.server_desc.items() if k != "ready"}
        (self.out / "index.json").write_text(json.dumps(
            {"server": server, "runs": self.index, "knees": [k.to_json() for k in self.knees()],
             "no_answer": self.failures}, indent=1) + "\n")


def run(ns) -> int:
    profile = apply_profile(ns)
    problem = _check(ns)
    if problem:
        print(f"drafter loadtest: {problem}", file=sys.stderr)
        return 2
    made = not (ns.out and Path(ns.out).exists())
    out = Path(ns.out or time.strftime("loadtest-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    command = ["drafter", "loadtest", *sys.argv[2:]] if sys.argv[1:2] == ["loadtest"] else sys.argv[:]
    # a drafter we did not start: --device, when given, only labels the report
    server_desc = {"spawned": False, "device": None if ns.device == "auto" else ns.device, "profile": profile}
    server = None
    session = None
    # SIGTERM (e.g. `timeout`) ends the run like Ctrl-C: the current run keeps what it measured, the
    # spawned drafter is stopped, the index is written.
    restore = None
    if threading.current_thread() is threading.main_thread():
        restore = signal.signal(signal.SIGTERM, _interrupt)
    rc = 0
    with tempfile.TemporaryDirectory(prefix="drafter-loadtest-") as tmp:
        try:
            if ns.spawn_server:
                server, server_desc = _server(ns, out, Path(tmp))
                server_desc["profile"] = profile
                _start(ns, server, server_desc)  # `server` is held first: every exit below stops it
            if ns.predraft:
                return _predraft(ns, out, server, profile)
            session = _Session(ns, out, server, server_desc, command)
            session.all(_plan(ns, profile))
            if session.interrupted:
                _say("drafter loadtest: interrupted")
                rc = 130
        except KeyboardInterrupt:
            _say("drafter loadtest: interrupted")
            rc = 130
        except BrokenPipeError:  # our output was closed (`| head`): stop, quietly
            _mute()
            rc = 1
        except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
            _say(f"drafter loadtest: {exc}")
            rc = 1
        finally:
            if restore is not None:
                signal.signal(signal.SIGTERM, restore)
            if server is not None:
                server_desc["exit_code"] = server.stop()
            if session is not None:
                session.write_index()
    return _finish(ns, out, made, session, rc)


def _predraft(ns, out: Path, server, profile: str) -> int:
    """--predraft: without and with pre-drafting (coordinator/loadtest/predraft.py); 1 when a session failed."""
    from coordinator.loadtest import predraft
    from coordinator.loadtest.clients import zmq_endpoint

    verify_ms = ns.verify_ms if ns.verify_ms is not None else (200.0 if profile == "cpu" else 10.0)
    runs = predraft.run(zmq_endpoint(_endpoint(ns, "zmq", server)), out, dp=ns.dp, batch=ns.predraft_batch, verify_ms=verify_ms,
                        acceptance=ns.acceptance, duration_s=ns.duration, warmup_s=ns.warmup, seed=ns.seed,
                        timeout_s=max(ns.timeout, 10.0), curve=ns.auth.curve)
    _say(f"report in {out / 'predraft.json'}")
    return 1 if any(r["errors"] for r in runs) else 0


def _finish(ns, out: Path, made: bool, session, rc: int) -> int:
    """The knee and the verdict (stderr), where the reports are; the exit status."""
    if session is None or not session.index:
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # nothing was measured: leave no empty folder behind
        elif (out / "server.log").exists():
            _say(f"the spawned drafter's log: {out / 'server.log'}")
        return rc or 1
    for knee in session.knees():
        _say(f"knee: {knee.describe()}")
    for why in session.failures:
        _say(f"drafter loadtest: no answer in {why}")
    _say(f"reports in {out}{os.sep}")
    if rc:
        return rc
    if not all(session.answered.values()):
        return NOTHING_ANSWERED
    return 1 if (session.failed and ns.fail_on_errors) else 0


def _say(line: str) -> None:
    """One line on stderr; nothing when stderr is closed."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):
        _mute()


def _mute() -> None:
    """Our stdout or stderr pipe is gone: send what is left to /dev/null (no traceback at exit)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):
            pass
    os.close(devnull)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
