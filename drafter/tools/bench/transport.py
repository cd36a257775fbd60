"""The remote path's own cost on a CPU host: round trip minus engine time, per transport, per stage.

    python -m drafter.tools.bench.transport [--iters 300] [--batch 16] [--k 3] [--out FILE.json] [--profile DIR]

A real server (ServiceCore + the ZMQ and gRPC transports, exactly as `drafter serve` wires them)
runs in a subprocess on loopback with a NullEngine: the real EngineConfig, limits and input
validation of DraftEngine.propose for EAGLE-3 / Llama-3.1-8B shapes, but no model (drafts are
zeros).  Its engine call is timed inside the server and subtracted from the same call's round
trip, so what is left is what the remote path adds to an in-process propose.  Requests are
decode steps (batch 16, k + 1 = 4 tokens each, 3 x 4096 bf16 hidden states: 1.58 MB), sent by
the real clients (coordinator.transport) over ZMQ tcp://, ZMQ ipc://, gRPC stream and gRPC unary.

Reported per transport: p50/p90 of (round trip - engine), and a per-stage breakdown from
drafter.wire.probes (client encode / send / wait / decode; server task start, header
decode, tensor decode, validation, hand-off to the engine thread, preparation, engine,
hand-off back, reply encode, send).  The floor: a bare pyzmq DEALER/ROUTER echo of the same
frames (blocking sockets, and asyncio sockets as the server uses them) in another process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from drafter.tools.bench import grid

# EAGLE-3 for Llama-3.1-8B (as drafter.tools.bench.remote.HEAD_CONFIG)
HEAD = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "vocab_size": 128256, "draft_vocab_size": 32000, "num_hidden_layers": 1,
        "eagle_aux_hidden_state_layer_ids": [2, 16, 29], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "norm_before_residual": True, "target_hidden_size": 4096, "max_position_embeddings": 8192}
BLOCK_SIZE = 16
TRANSPORTS = ("zmq-tcp", "zmq-ipc", "grpc-stream", "grpc-unary")


# ---------------------------------------------------------------------------------------- engine
class NullEngine:
    """DraftEngine's service-facing surface without a model: config, spec, limits, propose().

    propose() validates its inputs exactly as DraftEngine.propose does (drafter.engine.inputs.validate)
    and returns zero drafts, so the server's engine time is validation and nothing else."""

    graph_replays = None
    kv = None
    store = None

    def __init__(self, cfg, spec):
        from drafter.engine.inputs import Limits

        self.config, self.spec = cfg, spec
        self.device = torch.device(cfg.device)
        span = cfg.num_tree_nodes or cfg.num_speculative_tokens - 1
        self.limits = Limits(
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, vocab_size=spec.vocab_size,
            hidden_width=spec.hidden_input_width, num_blocks=tuple(g.num_blocks for g in cfg.kv_groups),
            block_sizes=tuple(g.block_size for g in cfg.kv_groups), draft_span=span)

    def propose(self, *, target_token_ids, target_positions, target_hidden_states, next_token_ids, query_start_loc,
                seq_lens, block_tables, slot_mappings, token_indices_to_sample=None, num_rejected_tokens=None,
                temperatures=None, return_probs=False, return_logits=False, batch_padded=None, tokens_padded=None):
        from drafter.engine.inputs import as_group_list
        from drafter.wire.records import ProposeInputs

        groups = len(self.config.kv_groups)
        inp = ProposeInputs(target_token_ids, target_positions, target_hidden_states, next_token_ids,
                            query_start_loc, seq_lens, as_group_list("block_tables", block_tables, groups),
                            as_group_list("slot_mappings", slot_mappings, groups), token_indices_to_sample,
                            num_rejected_tokens, temperatures)
        return self.draft(inp, return_probs=return_probs, batch_padded=batch_padded, tokens_padded=tokens_padded)

    def draft(self, inp, *, return_probs=False, return_logits=False, batch_padded=None, tokens_padded=None,
              validate=True):
        """DraftEngine.draft's contract: the inputs checked, zeros for drafts."""
        from drafter.engine.inputs import validate as check
        from drafter.wire.records import DraftOutput

        if validate:
            check(inp, self.limits)
        b = inp.batch_size
        drafts = torch.zeros(b, self.config.num_speculative_tokens, dtype=torch.int64)
        return DraftOutput(drafts, None, batch_padded or b, tokens_padded or inp.num_tokens)


def null_engine(batch: int, k: int, ctx: int, kv_blocks: int):
    from drafter.engine.config import EngineConfig, KVGroupSpec
    from drafter.models.spec import parse_head

    spec = parse_head(HEAD, "eagle3")
    cfg = EngineConfig(method="eagle3", num_speculative_tokens=k, max_model_len=ctx + 64, max_num_seqs=batch,
                       max_num_batched_tokens=batch * (k + 1), kv_groups=(KVGroupSpec(BLOCK_SIZE, kv_blocks),),
                       capture_sizes=(batch,), token_capture_sizes=(batch * (k + 1),), device="cpu",
                       dtype="bfloat16")
    return NullEngine(cfg, spec)


def decode_call(batch: int, k: int, ctx: int, num_blocks: int, vocab: int, width: int, seed: int = 7) -> dict:
    """grid.decode_call's decode step with bfloat16 hidden states (what the transports carry)."""
    return grid.decode_call(batch, k, ctx, num_blocks, vocab, width, torch.bfloat16, seed)


def payload_bytes(call: dict) -> int:
    return sum(t.numel() * t.element_size() for v in call.values() for t in (v if isinstance(v, list) else [v]))


# ---------------------------------------------------------------------------------------- server
def serve_main(argv: list[str]) -> int:
    """The server subprocess. stdin commands: `stats SKIP` (print and reset the stage probes), `quit`."""
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=8192)
    p.add_argument("--zmq-ipc", default="")
    p.add_argument("--profile", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from drafter.wire import probes

    probes.enable()
    return asyncio.run(_serve(args))


async def _serve(args) -> int:
    from drafter.wire import probes
    from drafter.service.core import ServiceCore
    from drafter.service.grpc_server import DrafterGrpcService, HealthState, build_main_server
    from drafter.service.metrics import Metrics
    from drafter.service.zmq_server import ZmqServer

    max_bytes = 256 * 1024 * 1024
    core = ServiceCore(metrics=Metrics(method="eagle3"), max_sessions=8, batch_window_s=0.0,
                       max_message_bytes=max_bytes)
    core.set_engine(null_engine(args.batch, args.k, args.ctx, args.kv_blocks))
    zkw = {"ipc_path": args.zmq_ipc} if args.zmq_ipc else {}
    zmq_server = ZmqServer(core, host="127.0.0.1", port=0, max_message_bytes=max_bytes, **zkw)
    zmq_port = zmq_server.start()
    grpc_server, grpc_port = None, 0
    if not os.environ.get("BENCH_NO_GRPC"):
        health = HealthState()
        await health.set_serving(True)
        grpc_server, grpc_port = build_main_server(DrafterGrpcService(core, asyncio.Event()), health,
                                                   host="127.0.0.1", port=0, max_message_bytes=max_bytes,
                                                   keepalive_time_s=30, keepalive_timeout_s=10)
        await grpc_server.start()
    if os.environ.get("BENCH_GC_FREEZE"):
        import gc
        gc.collect()
        gc.freeze()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    print(json.dumps({"event": "ready", "zmq_port": zmq_port, "grpc_port": grpc_port,
                      "zmq_ipc": getattr(zmq_server, "ipc_endpoint", None)}), flush=True)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def read_stdin():  # a thread: stdin commands without blocking the event loop
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line.split())
        loop.call_soon_threadsafe(lines.put_nowait, ["quit"])
    threading.Thread(target=read_stdin, daemon=True).start()
    while True:
        cmd = await lines.get()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "marks":
            from drafter.service import zmq_server as _z
            print(json.dumps({**probes.RECORDER.marks(), "trace": getattr(_z, "_TRACE", [])}), flush=True)
        elif cmd[0] == "stats":
            print(json.dumps(probes.RECORDER.summary(reset=True, skip=int(cmd[1]) if len(cmd) > 1 else 0)),
                  flush=True)
        elif cmd[0] == "profile-start" and profiler is not None:
            profiler.enable()
            print(json.dumps({"event": "ok"}), flush=True)
        elif cmd[0] == "profile-stop" and profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.path.join(args.profile, f"server-{cmd[1]}.prof"))
            profiler = type(profiler)()
            print(json.dumps({"event": "ok"}), flush=True)
    if grpc_server is not None:
        await grpc_server.stop(1)
    await zmq_server.close(timeout=1)
    await core.close()
    return 0


class ServerProc:
    def __init__(self, args, ipc_path: str):
        cmd = [sys.executable, "-m", "drafter.tools.bench.transport", "serve", "--batch", str(args.batch), "--k",
               str(args.k), "--ctx", str(args.ctx), "--kv-blocks", str(args.kv_blocks)]
        if ipc_path:
            cmd += ["--zmq-ipc", ipc_path]
        if args.profile:
            cmd += ["--profile", args.profile]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._line()

    def _line(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the bench server exited with {self.proc.wait()}")
            try:
                return json.loads(line)
            except ValueError:
                continue

    def command(self, text: str) -> dict:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._line()

    def stop(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=20)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------- echo floor
def echo_main(argv: list[str]) -> int:
    """A bare ROUTER echo: replies [identity, b"", small, small, reply bytes] to every message."""
    import zmq

    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", action="append", required=True)
    p.add_argument("--reply-bytes", type=int, default=384)
    p.add_argument("--asyncio", action="store_true")
    args = p.parse_args(argv)
    reply = [b"e" * 16, b"b" * 48, b"\0" * args.reply_bytes]
    if args.asyncio:
        import zmq.asyncio

        async def run():
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.ROUTER)
            print(json.dumps({"event": "ready", "port": _bind(sock, args.endpoint)}), flush=True)
            while True:
                frames = await sock.recv_multipart(copy=False)
                await sock.send_multipart([frames[0], b"", *reply], copy=False)
        asyncio.run(run())
        return 0
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    print(json.dumps({"event": "ready", "port": _bind(sock, args.endpoint)}), flush=True)
    while True:
        frames = sock.recv_multipart(copy=False)
        sock.send_multipart([frames[0], b"", *reply], copy=False)


def _bind(sock, endpoints: list[str]) -> int:
    """Bind every endpoint; the tcp one's port."""
    import zmq

    port = 0
    for ep in endpoints:
        sock.bind(ep)
        last = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if last.startswith("tcp"):
            port = int(last.rsplit(":", 1)[1])
    return port


class EchoLane:
    """Round trips of the same frames to a bare ROUTER echo (another process): the floor."""

    def __init__(self, name: str, endpoint: str, frames: list):
        import zmq

        self.name = name
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.msg = [b"", b"e" * 24, b"h" * 700, *frames]
        self.rtt: list[int] = []

    def step(self, rid: int, record: bool) -> None:
        t0 = time.perf_counter_ns()
        self.sock.send_multipart(self.msg, copy=False)
        self.sock.recv_multipart(copy=False)
        if record:
            self.rtt.append(time.perf_counter_ns() - t0)

    def close(self) -> None:
        self.sock.close()

    def result(self, server_stats: dict, client_stats: dict) -> dict:
        return {"round_trip": _pct(self.rtt)}


class EchoProc:
    def __init__(self, ipc: str, use_asyncio: bool):
        cmd = [sys.executable, "-m", "drafter.tools.bench.transport", "echo", "--endpoint", "tcp://127.0.0.1:0",
               "--endpoint", ipc] + (["--asyncio"] if use_asyncio else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.port = json.loads(self.proc.stdout.readline())["port"]
        self.ipc = ipc

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------------------------------- client
def _pct(ns: list[int]) -> dict:
    xs = sorted(ns)
    if not xs:
        return {}
    return {"p50_us": statistics.median(xs) / 1e3, "p90_us": xs[int(0.9 * (len(xs) - 1))] / 1e3,
            "min_us": xs[0] / 1e3, "n": len(xs)}


def _layout(info, name: str, blocks: int):
    from drafter.wire import schema

    return schema.AttachRequest(
        protocol_version=info.protocol_version, method=info.method, num_speculative_tokens=info.num_speculative_tokens,
        hidden_dtype="bfloat16", hidden_size=info.hidden_size, num_aux_layers=info.num_aux_layers,
        max_model_len=info.limits.max_model_len, max_num_seqs=info.limits.max_num_seqs,
        max_num_batched_tokens=info.limits.max_num_batched_tokens,
        kv_groups=[schema.KVGroup(block_size=g.block_size, num_blocks=blocks) for g in info.limits.kv_groups],
        client_name=f"bench-{name}")


class DrafterLane:
    """One real client (one session) of the bench server on one transport."""

    def __init__(self, name: str, server: ServerProc, args, base_id: int):
        from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient

        self.name, self.base_id, self.args = name, base_id, args
        r = server.ready
        if name == "zmq-tcp":
            self.client = ZmqDrafterClient(f"tcp://127.0.0.1:{r['zmq_port']}", timeout_s=30)
        elif name == "zmq-ipc":
            self.client = ZmqDrafterClient(r["zmq_ipc"], timeout_s=30)
        else:
            self.client = GrpcDrafterClient(f"127.0.0.1:{r['grpc_port']}", timeout_s=30)
        per_session = args.kv_blocks // 4
        self.client.attach(_layout(self.client.info(), name, per_session))
        self.caller = self.client.stream() if name == "grpc-stream" else self.client
        self.call = decode_call(args.batch, args.k, args.ctx, per_session, HEAD["vocab_size"], 3 * HEAD["hidden_size"])
        self.rtt: dict[int, int] = {}
        self.n = 0

    def step(self, rid: int, record: bool) -> None:
        rid = self.base_id + self.n
        self.n += 1
        t0 = time.perf_counter_ns()
        out = self.caller.propose(request_id=rid, **self.call)
        dt = time.perf_counter_ns() - t0
        assert out.draft_token_ids.shape == (self.args.batch, self.args.k)
        if record:
            self.rtt[rid] = dt

    def close(self) -> None:
        if self.caller is not self.client:
            self.caller.close()
        self.client.detach()
        self.client.close()

    def result(self, server_stats: dict, client_stats: dict) -> dict:
        srv = server_stats.get(self.name, {})
        engine = {int(k): v for k, v in srv.get("engine_ns", {}).items()}
        cli = client_stats.get(f"client-{self.name}") or client_stats.get(f"client-{self.name.split('-')[0]}", {})
        paired = [r for r in self.rtt if r in engine]
        return {"round_trip": _pct(list(self.rtt.values())), "engine": _pct([engine[r] for r in paired]),
                "overhead": _pct([self.rtt[r] - engine[r] for r in paired]),
                "server_stages": _stages(srv), "client_stages": _stages(cli)}


def _stages(summary: dict) -> dict:
    return {name: summary["stages"][name] for name in summary.get("order", [])}


def _print_result(name: str, r: dict) -> None:
    t = r["round_trip"]
    if "overhead" not in r:
        print(f"{name:18s} round trip p50 {t['p50_us']:7.0f} us, p90 {t['p90_us']:7.0f} us")
        return
    o, e = r["overhead"], r["engine"]
    print(f"{name:18s} round trip p50 {t['p50_us']:7.0f} us | engine p50 {e['p50_us']:5.0f} us | "
          f"round trip - engine p50 {o['p50_us']:6.0f} us, p90 {o['p90_us']:6.0f} us")
    for side in ("client_stages", "server_stages"):
        parts = ", ".join(f"{k} {v['p50_us']:.0f}" for k, v in r[side].items())
        print(f"    {side.split('_')[0]:6s} p50 us: {parts}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["echo"]:
        return echo_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m drafter.tools.bench.transport", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=8192)
    p.add_argument("--iters", type=int, default=300, help="measured calls per transport (over all rounds)")
    p.add_argument("--rounds", type=int, default=10,
                   help="interleave the transports in this many rounds (a noisy host then shifts all alike)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--no-echo", action="store_true", help="skip the bare pyzmq floor")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--profile", default="", help="directory for cProfile dumps of the server's event loop")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from drafter.wire import probes

    probes.enable()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    ipc_dir = tempfile.mkdtemp(prefix="drafter-bench-")
    os.chmod(ipc_dir, 0o700)
    call = decode_call(args.batch, args.k, args.ctx, args.kv_blocks // 4, HEAD["vocab_size"], 3 * HEAD["hidden_size"])
    nbytes = payload_bytes(call)
    print(f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}, torch {torch.__version__}; "
          f"EAGLE-3 8B shapes, batch {args.batch}, k={args.k}, request payload {nbytes / 1e6:.2f} MB; "
          f"{args.iters} calls per transport in {args.rounds} interleaved rounds")
    result = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "host": platform.node(), "cpus": os.cpu_count(), "batch": args.batch, "k": args.k,
                       "payload_bytes": nbytes, "iters": args.iters, "rounds": args.rounds,
                       "command": "python -m drafter.tools.bench.transport " + " ".join(argv)}}
    procs, lanes = [], []
    transports = [t for t in args.transports.split(",") if t]
    server = ServerProc(args, f"{ipc_dir}/drafter.sock" if "zmq-ipc" in transports else "")
    procs.append(server)
    try:
        if not args.no_echo:
            from drafter.wire.records import ProposeRequest
            from drafter.wire.tensors import request_to_frames

            _, frames = request_to_frames(ProposeRequest.from_keywords(**call))
            frames = [bytes(f) for f in frames]
            for use_asyncio in (False, True):
                key = "echo_asyncio" if use_asyncio else "echo"
                echo = EchoProc(f"ipc://{ipc_dir}/{key}.sock", use_asyncio)
                procs.append(echo)
                lanes.append(EchoLane(f"{key}-tcp", f"tcp://127.0.0.1:{echo.port}", frames))
                lanes.append(EchoLane(f"{key}-ipc", echo.ipc, frames))
        for i, name in enumerate(transports):
            if name == "zmq-ipc" and not server.ready.get("zmq_ipc"):
                print("zmq-ipc: the server has no ipc endpoint; skipped")
                continue
            lanes.append(DrafterLane(name, server, args, base_id=(i + 1) * 1_000_000))
        for lane in lanes:
            for _ in range(args.warmup):
                lane.step(0, False)
        server.command("stats")  # drops the warm-up calls' probes
        probes.RECORDER.summary(reset=True)
        if args.profile:
            server.command("profile-start")
        per_round = max(1, args.iters // args.rounds)
        for _ in range(args.rounds):
            for lane in lanes:
                for _ in range(per_round):
                    lane.step(0, True)
        if args.profile:
            server.command("profile-stop all")
        server_stats = server.command("stats")
        client_stats = probes.RECORDER.summary(reset=True)
        for lane in lanes:
            r = lane.result(server_stats, client_stats)
            result.setdefault("echo" if isinstance(lane, EchoLane) else "transports", {})[lane.name] = r
            _print_result(lane.name, r)
        for lane in lanes:
            lane.close()
    finally:
        for proc in procs:
            proc.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
