"""Remote vs in-process drafting on one GPU host: `drafter serve` against DraftEngine.propose.

    python -m coordinator.bench.remote --out DIR [--batch 16 --k 3 --ctx 1024 --iters 200]

The head has EAGLE-3 / Llama-3.1-8B shapes with random weights: only its config.json is written
(the server process builds the weights on the GPU itself, as `drafter bench` does).  First the
in-process engine is timed in this process; then it is freed, a `drafter serve` process starts on
the same GPU (ZMQ on tcp:// and on ipc:// in a private directory), and one client per transport
(ZMQ tcp, ZMQ ipc, gRPC unary, gRPC stream; on a GPU also ZMQ tcp and gRPC stream with the hidden
states left on the GPU in one static buffer and sent as CUDA IPC references: zmq_cuda_ipc,
grpc_stream_cuda_ipc) attaches a session and sends the same decode-step calls (--clients picks them).
Reported per transport: round-trip p50/p90 and the ratio of the p50 to the in-process p50: the
trusted call a target makes in its own process (`propose(..., validate=False)` on GPU-resident
inputs, drafts copied to the host, which is what the client gets), and also to the validated call
on GPU inputs and on CPU tensors (as a server is fed); and, from the stage probes
(drafter.wire.probes, on in both processes), round trip minus the server's engine time per call
and the p50/p90 of every client and server stage ("stages" in remote.json).  The clients and the CLI
are here (the target's side); the in-process timings and the served drafter are
drafter.tools.bench.remote.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from coordinator.child_process import stop_child
from drafter.tools.bench.grid import decode_call
from drafter.tools.bench.remote import (HEAD_CONFIG, TINY, WARMUP, _percentiles, _stages, in_process, server_args,
                                        wait_ready)

CLIENTS = ("zmq", "zmq_ipc", "grpc_unary", "grpc_stream", "zmq_cuda_ipc", "grpc_stream_cuda_ipc")
CUDA_IPC_CLIENTS = ("zmq_cuda_ipc", "grpc_stream_cuda_ipc")


def remote(model_dir: str, args, call: dict, log) -> dict:
    from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
    from drafter.wire import probes, schema

    run_dir = tempfile.mkdtemp(prefix="drafter-ipc-")  # 0700: only this user may reach the socket
    probes_out = Path(run_dir) / "server-probes.json"
    cmd = [sys.executable, "-m", "drafter.tools.bench.remote", "serve",
           *server_args(model_dir, args.batch, args.k, args.ctx, args.kv_blocks, args.device),
           "--zmq-ipc", f"{run_dir}/drafter.sock"]
    env = {**os.environ, "DRAFTER_PROBES": "1", "DRAFTER_PROBES_OUT": str(probes_out),
           "DRAFTER_PROBES_SKIP": str(WARMUP)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    probes.enable()
    results = {}
    rtts: dict = {}
    try:
        ready = wait_ready(proc)
        log(f"server ready: grpc {ready['grpc_port']}, zmq {ready['zmq_port']}")
        per_session = args.kv_blocks // 4

        class Stream:
            def __init__(self, target, share_cuda=False):
                self.client = GrpcDrafterClient(target, timeout_s=30, share_cuda=share_cuda)
                self.stream = None

            def info(self):
                return self.client.info()

            def attach(self, layout):
                self.client.attach(layout)
                self.stream = self.client.stream()

            def propose(self, **kw):
                return self.stream.propose(**kw)

            @property
            def cuda(self):
                return self.client.cuda

            def detach(self):
                self.stream.close()
                return self.client.detach()

        zmq_tcp, grpc_target = f"tcp://127.0.0.1:{ready['zmq_port']}", f"127.0.0.1:{ready['grpc_port']}"
        make = {"zmq": lambda: ZmqDrafterClient(zmq_tcp, timeout_s=30),
                "zmq_ipc": lambda: ZmqDrafterClient(ready["zmq_ipc"], timeout_s=30),
                "grpc_unary": lambda: GrpcDrafterClient(grpc_target, timeout_s=30),
                "grpc_stream": lambda: Stream(grpc_target),
                "zmq_cuda_ipc": lambda: ZmqDrafterClient(zmq_tcp, timeout_s=30, share_cuda=True),
                "grpc_stream_cuda_ipc": lambda: Stream(grpc_target, share_cuda=True)}
        clients = {name: make[name]() for name in args.clients}
        for t, (name, client) in enumerate(clients.items()):
            info = client.info()
            groups = info.limits.kv_groups
            client.attach(schema.AttachRequest(
                protocol_version=info.protocol_version, method=info.method,
                num_speculative_tokens=info.num_speculative_tokens, speculative_token_tree=info.speculative_token_tree,
                hidden_dtype="bfloat16", hidden_size=info.hidden_size, num_aux_layers=info.num_aux_layers,
                max_model_len=info.limits.max_model_len, max_num_seqs=info.limits.max_num_seqs,
                max_num_batched_tokens=info.limits.max_num_batched_tokens,
                kv_groups=[schema.KVGroup(block_size=g.block_size, num_blocks=per_session) for g in groups],
                client_name=f"bench-{name}"))
            session_call = decode_call(args.batch, args.k, args.ctx, per_session, args.head["vocab_size"],
                                       3 * args.head["hidden_size"], torch.bfloat16, seed=7)
            if name in CUDA_IPC_CLIENTS:  # the target's hidden states stay in one static GPU buffer
                session_call["target_hidden_states"] = session_call["target_hidden_states"].to(args.device)
            ids = iter(range((t + 1) * 10**6, (t + 2) * 10**6))
            per_call = rtts[name] = {}

            def step(record: bool):
                rid = next(ids)
                t0 = time.perf_counter()
                client.propose(request_id=rid, **session_call).draft_token_ids
                if record:
                    per_call[rid] = (time.perf_counter() - t0) * 1e6
            for _ in range(WARMUP):
                step(False)
            for _ in range(args.iters):
                step(True)
            results[name] = _percentiles(list(per_call.values()))
            log(f"  {name}: p50 {results[name]['p50_us']:.0f} us, p90 {results[name]['p90_us']:.0f} us")
            if name in CUDA_IPC_CLIENTS:
                results[name]["cuda_ipc_used"] = client.cuda.enabled
                if not client.cuda.enabled:
                    log(f"  {name}: FELL BACK TO BYTES: {client.cuda.reason}")
            client.detach()  # its KV blocks (and shared buffers) go back before the next client attaches
    finally:
        stop_child(proc)
    # per-stage breakdown: server probes (written at exit) and this process's client probes
    server = json.loads(probes_out.read_text()) if probes_out.exists() else {}
    client = probes.RECORDER.summary(skip=WARMUP)
    labels = {"zmq": "zmq-tcp", "zmq_ipc": "zmq-ipc", "grpc_unary": "grpc-unary", "grpc_stream": "grpc-stream",
              "zmq_cuda_ipc": "zmq-tcp-cuda", "grpc_stream_cuda_ipc": "grpc-stream-cuda"}
    for name, label in labels.items():
        if name not in results:
            continue
        srv = server.get(label, {})
        engine = {int(k): v / 1e3 for k, v in srv.get("engine_ns", {}).items()}
        over = [rtts[name][r] - engine[r] for r in rtts[name] if r in engine]
        results[name]["minus_engine"] = _percentiles(over) if over else {}
        results[name]["stages"] = {"client": _stages(client.get(f"client-{label}", {})), "server": _stages(srv)}
        if over:
            log(f"  {name}: round trip - engine p50 {results[name]['minus_engine']['p50_us']:.0f} us; server "
                + ", ".join(f"{k} {v['p50_us']:.0f}" for k, v in results[name]["stages"]["server"].items()))
    return results


def _clients(text: str, device: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = set(names) - set(CLIENTS)
    if unknown:
        raise SystemExit(f"--clients: unknown {sorted(unknown)}; choose from {CLIENTS}")
    if not device.startswith("cuda"):  # CUDA IPC needs hidden states on a GPU
        names = [n for n in names if n not in CUDA_IPC_CLIENTS]
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.remote", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--kv-blocks", type=int, default=8192)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tiny", action="store_true", help="a tiny head (a smoke test of this script on a CPU)")
    p.add_argument("--clients", default=",".join(CLIENTS),
                   help=f"comma-separated, of {','.join(CLIENTS)} (the *_cuda_ipc ones need a CUDA --device)")
    args = p.parse_args(argv)
    args.clients = _clients(args.clients, args.device)
    args.head = {**HEAD_CONFIG, **(TINY if args.tiny else {})}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    model_dir = tempfile.mkdtemp(prefix="eagle3-8b-config-")
    Path(model_dir, "config.json").write_text(json.dumps(args.head))  # the config alone: no weights on disk
    call = decode_call(args.batch, args.k, args.ctx, args.kv_blocks, args.head["vocab_size"],
                       3 * args.head["hidden_size"], torch.bfloat16, seed=7)
    payload = sum(t.numel() * t.element_size() for v in call.values() for t in (v if isinstance(v, list) else [v]))
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    log(f"{device_name}: EAGLE-3 {'tiny' if args.tiny else '8B'} shapes, batch {args.batch}, k={args.k}, "
        f"ctx {args.ctx}, request payload {payload / 1e6:.2f} MB")
    local = in_process(model_dir, args, call)
    gc.collect()  # the in-process engine (and its graphs) leave the GPU to the server
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"in-process p50: trusted call on GPU inputs (validate=False) {local['trusted_gpu_inputs']['p50_us']:.0f} us, "
        f"validated GPU inputs {local['gpu_inputs']['p50_us']:.0f} us, validated CPU inputs "
        f"{local['cpu_inputs']['p50_us']:.0f} us")
    rem = remote(model_dir, args, call, log)
    ratios = {name: {"rtt_over_inprocess": r["p50_us"] / local["trusted_gpu_inputs"]["p50_us"],
                     "rtt_over_inprocess_validated": r["p50_us"] / local["gpu_inputs"]["p50_us"],
                     "rtt_over_inprocess_cpu_inputs": r["p50_us"] / local["cpu_inputs"]["p50_us"]}
              for name, r in rem.items()}
    for name, r in ratios.items():
        log(f"  {name}: round trip / in-process = {r['rtt_over_inprocess']:.2f} (vs the validated in-process "
            f"call: {r['rtt_over_inprocess_validated']:.2f}, fed CPU tensors: {r['rtt_over_inprocess_cpu_inputs']:.2f})")
    result = {"meta": {"device": device_name, "date": datetime.datetime.now(
                  datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "batch": args.batch, "k": args.k,
                  "ctx": args.ctx, "payload_bytes": payload, "batch_window_us": 0,
                  "command": "python -m coordinator.bench.remote " + " ".join(argv)},
              "in_process": local, "remote": rem, "ratios": ratios}
    (out / "remote.json").write_text(json.dumps(result, indent=1))
    (out / "remote.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
