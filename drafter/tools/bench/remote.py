"""The drafter's half of the remote-vs-in-process bench: the in-process timings and the served drafter.

    python -m coordinator.bench.remote --out DIR [--batch 16 --k 3 --ctx 1024 --iters 200]

The CLI and its clients (the target's side) are coordinator.bench.remote: the drafter package never
imports coordinator.  Here: the head's EAGLE-3 / Llama-3.1-8B config (random weights: only its
config.json is written; each process builds the weights on its GPU), the in-process timings
(`in_process`: the trusted call a target makes in its own process, `propose(..., validate=False)`
on GPU-resident inputs with the drafts copied to the host, the validated call on GPU inputs and on
CPU tensors, as a server is fed), and `python -m drafter.tools.bench.remote serve ...`: `drafter
serve` with the checkpoint loader replaced by random weights (the remote, bound and pre-drafting
benches start it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from drafter.tools.bench.grid import BLOCK_SIZE, random_head

HEAD_CONFIG = {  # EAGLE-3 for Llama-3.1-8B (SafeAILab-style config.json keys)
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "intermediate_size": 14336, "vocab_size": 128256, "draft_vocab_size": 32000, "num_hidden_layers": 1,
    "eagle_aux_hidden_state_layer_ids": [2, 16, 29], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "norm_before_residual": True, "target_hidden_size": 4096, "max_position_embeddings": 8192,
}


TINY = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 256, "vocab_size": 1000, "draft_vocab_size": 500, "target_hidden_size": 128}


def wait_ready(proc: subprocess.Popen, timeout_s: float = 240) -> dict:
    """The served drafter's "ready" event from its stdout (JSON lines); RuntimeError if it fails,
    exits or is not ready within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"drafter serve exited with {proc.wait()}")
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "failed":
            raise RuntimeError(f"drafter serve failed: {ev}")
        if ev.get("event") == "ready":
            return ev
    raise RuntimeError("drafter serve was not ready in time")


def server_args(model_dir: str, batch: int, k: int, ctx: int, kv_blocks: int, device: str = "cuda:0") -> list[str]:
    gpu = device.startswith("cuda")
    return ["--method", "eagle3", "--model", model_dir, "--device", device, "--dtype", "bfloat16",
            "--num-speculative-tokens", str(k), "--max-model-len", str(ctx + 64), "--max-num-seqs", str(batch),
            "--max-num-batched-tokens", str(batch * (k + 1)), "--kv-blocks", str(kv_blocks),
            "--block-sizes", str(BLOCK_SIZE), "--capture-sizes", str(batch),
            "--token-capture-sizes", str(batch * (k + 1)), "--attention-backend", "triton" if gpu else "reference",
            "--use-cuda-graphs", "true", "--batch-window-us", "0", "--grpc-port", "0", "--zmq-port", "0",
            "--health-port", "0", "--metrics-port", "0", "--max-sessions", "4", "--log-format", "text",
            "--log-level", "warning", "--allow-cuda-ipc", "true"]


def _build(engine_cfg, model_dir: str):
    """A DraftEngine with random weights for the head that model_dir/config.json describes."""
    from drafter.engine.engine import DraftEngine
    from drafter.models.spec import parse_head, read_config

    spec = parse_head(read_config(model_dir), "eagle3")
    if torch.device(engine_cfg.device).type == "cuda":  # Triton launches on the current device (see load_engine)
        torch.cuda.set_device(torch.device(engine_cfg.device))
    head = random_head(spec, torch.device(engine_cfg.device), engine_cfg.torch_dtype)
    return DraftEngine(head, spec, engine_cfg)


def serve_main(argv: list[str]) -> int:
    """The server process: `drafter serve` with the checkpoint loader replaced by random weights."""
    from drafter.service import server as srv
    from drafter.service.config import add_arguments, from_args
    from drafter.service.logs import setup_logging

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(argv))
    srv.load_engine = lambda cfg, engine_cfg, hold=None: _build(engine_cfg, cfg.model)
    setup_logging(cfg.log_format, cfg.log_level)
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a bench that saw a hang asks for every stack
    code = asyncio.run(srv.serve(cfg))
    out = os.environ.get("DRAFTER_PROBES_OUT")
    if out:  # the stage probes of every call, for the bench's breakdown
        from drafter.wire import probes

        if probes.RECORDER is not None:
            Path(out).write_text(json.dumps(probes.RECORDER.summary(skip=int(os.environ.get("DRAFTER_PROBES_SKIP",
                                                                                            "0")))))
    return code


def _percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": statistics.median(xs), "p90_us": xs[int(0.9 * (len(xs) - 1))], "min_us": xs[0]}


def _stages(summary: dict) -> dict:
    return {name: summary["stages"][name] for name in summary.get("order", [])}


def _time(fn, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def in_process(model_dir: str, args, call: dict) -> dict:
    from drafter.service.config import add_arguments, from_args
    from drafter.service.server import engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(server_args(model_dir, args.batch, args.k, args.ctx, args.kv_blocks, args.device)))
    engine = _build(engine_config(cfg), model_dir)
    dev = engine.device
    gpu = {k: ([t.to(dev) for t in v] if isinstance(v, list) else v.to(dev)) for k, v in call.items()}

    def trusted_call():  # what a target engine calling the drafter in its own process does
        engine.propose(**gpu, validate=False).draft_token_ids.cpu()

    def gpu_call():
        engine.propose(**gpu).draft_token_ids.cpu()

    def cpu_call():
        engine.propose(**call).draft_token_ids.cpu()

    return {"trusted_gpu_inputs": _percentiles(_time(trusted_call, args.iters, 20)),
            "gpu_inputs": _percentiles(_time(gpu_call, args.iters, 20)),
            "cpu_inputs": _percentiles(_time(cpu_call, args.iters, 20))}


WARMUP = 30


def main(argv: list[str] | None = None) -> int:
    """`serve ...` runs the served drafter; the bench's CLI is coordinator.bench.remote (it drives clients)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve_main(argv[1:])
    print("the remote bench runs as: python -m coordinator.bench.remote --out DIR ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
