"""The remote path's own cost on a CPU host: round trip minus engine time, per transport, per stage.

    python -m coordinator.bench.transport [--iters 300] [--batch 16] [--k 3] [--out FILE.json] [--profile DIR]

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
frames (blocking sockets, and asyncio sockets as the server uses them) in another process.  The
clients and the CLI are here (the target's side); the server, the echo floor and the helpers are
drafter.tools.bench.transport.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from drafter.tools.bench.transport import (HEAD, TRANSPORTS, EchoLane, EchoProc, ServerProc, _pct, _stages, decode_call,
                                           payload_bytes)


# ---------------------------------------------------------------------------------------- client
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
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.transport", description=__doc__.split("\n")[0])
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
                       "command": "python -m coordinator.bench.transport " + " ".join(argv)}}
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
