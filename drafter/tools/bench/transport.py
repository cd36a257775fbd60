"""The drafter's half of the transport bench (a CPU host: the remote path's own cost).

    python -m coordinator.bench.transport [--iters 300] [--batch 16] [--k 3] [--out FILE.json] [--profile DIR]

The CLI and its clients (coordinator.transport's real clients, one lane per transport) are
coordinator.bench.transport: the drafter package never imports coordinator.  Here: the bench
server (`python -m drafter.tools.bench.transport serve`: ServiceCore and the ZMQ and gRPC
transports exactly as `drafter serve` wires them, with a NullEngine: the real EngineConfig, limits
and input validation of DraftEngine.propose for EAGLE-3 / Llama-3.1-8B shapes, but no model; its
engine call timed inside the server), ServerProc that runs it, the bare pyzmq echo floor
(`... echo`, EchoProc, EchoLane), the decode-step call and the percentile helpers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

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


def _stages(summary: dict) -> dict:
    return {name: summary["stages"][name] for name in summary.get("order", [])}


def main(argv: list[str] | None = None) -> int:
    """`serve ...` and `echo ...` run the bench's server processes; the CLI is coordinator.bench.transport."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    if argv[:1] == ["echo"]:
        return echo_main(argv[1:])
    print("the transport bench runs as: python -m coordinator.bench.transport ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
