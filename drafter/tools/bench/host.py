"""Host (Python) time of a graph-replayed propose call, piece by piece, on the CPU alone.

    python -m drafter.tools.bench.host [--batch 16 --k 3 --ctx 1024 --json OUT]

On a GPU host `drafter bench` reports host_us (the whole call) and host_breakdown; this one
needs no GPU: a tiny EAGLE-3 engine on the CPU with the graph runner's replays replaced by
no-ops, so what is timed is exactly the Python a call runs around its replays (the replays'
own launch cost is the GPU host's business).  Every number is microseconds per call, the
best of several repeats of many calls (host time is noisy; the minimum is the cost itself).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from drafter.tools.bench.grid import bind_call, decode_call
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.wire.records import DraftOutput
from drafter.engine.inputs import as_group_list
from drafter.wire.records import ProposeInputs


def per_call_us(fn, calls: int = 20000, repeats: int = 7) -> float:
    """Best-of-`repeats` mean host microseconds of fn()."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def stub_engine(batch: int, k: int, root: Path) -> DraftEngine:
    """A tiny EAGLE-3 engine on the CPU whose graph runner replays no-ops for this batch's sizes
    (the chain decode call: batch requests of k + 1 tokens, one combined graph)."""
    from drafter.engine.graphs import GraphRunner
    from drafter.models.tiny import write_tiny

    write_tiny("eagle3", root)
    tokens = batch * (k + 1)
    cfg = EngineConfig(method="eagle3", num_speculative_tokens=k, max_model_len=2048, max_num_seqs=batch,
                       max_num_batched_tokens=tokens, kv_groups=(KVGroupSpec(16, 4096),), capture_sizes=(batch,),
                       token_capture_sizes=(tokens,), attention_backend="triton", skinny_gemm="on")
    engine = DraftEngine.from_dirs(root / "head", root / "target", cfg)
    runner = GraphRunner(engine, emulate=True)
    runner.first_graphs = {tokens: lambda: None}
    runner.loop_graphs = {batch: lambda: None}
    runner.combined_graphs = {(tokens, batch): lambda: None}
    engine.graphs = runner
    return engine


def measure(batch: int = 16, k: int = 3, ctx: int = 1024) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        engine = stub_engine(batch, k, Path(tmp))
    spec, runner = engine.spec, engine.graphs
    call = decode_call(batch, k, ctx, 4096, spec.vocab_size, spec.hidden_input_width, torch.float32, seed=3)
    inp = ProposeInputs(call["target_token_ids"], call["target_positions"], call["target_hidden_states"],
                        call["next_token_ids"], call["query_start_loc"], call["seq_lens"], call["block_tables"],
                        call["slot_mappings"], None, call["num_rejected_tokens"])
    b_pad, t_pad = engine._padded_sizes(inp, None, None)
    out = runner.new_output(batch)
    from drafter.engine.graphs import on_device

    header = runner.header
    us = {
        "propose_inputs_us": per_call_us(lambda: ProposeInputs(
            inp.target_token_ids, inp.target_positions, inp.target_hidden_states, inp.next_token_ids,
            inp.query_start_loc, inp.seq_lens, as_group_list("block_tables", call["block_tables"], 1),
            as_group_list("slot_mappings", call["slot_mappings"], 1), None, inp.num_rejected_tokens, None)),
        "padded_sizes_us": per_call_us(lambda: engine._padded_sizes(inp, None, None)),
        "handles_us": per_call_us(lambda: runner.handles(inp, b_pad, t_pad, False, False)),
        "on_device_us": per_call_us(lambda: on_device(inp, runner.device)),
        "output_alloc_us": per_call_us(lambda: runner.new_output(batch)),
        "header_write_with_copy_us": per_call_us(lambda: header.write(inp, out)),
    }
    emulated, header.device = header.device, header.host  # as on a GPU: the device reads the host words
    us["header_write_us"] = per_call_us(lambda: header.write(inp, out))
    us["draft_output_us"] = per_call_us(lambda: DraftOutput(out, None, b_pad, t_pad))
    us["run_us"] = per_call_us(lambda: runner.run(inp, t_pad, b_pad))
    us["propose_trusted_us"] = per_call_us(lambda: engine.propose(**call, validate=False), calls=5000)
    bound, n = bind_call(engine, call), call["target_token_ids"].shape[0]
    us["propose_bound_us"] = per_call_us(lambda: bound.propose(n, batch), calls=5000)
    us["propose_validated_us"] = per_call_us(lambda: engine.propose(**call), calls=1000)
    header.device = emulated
    return us


def call_shape_args(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments every host-time bench takes: the decode call's shape and where to write."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--json", help="also write the numbers here")
    return p


def report(us: dict[str, float], args: argparse.Namespace) -> None:
    """Print microseconds per part, and write them as JSON where --json says."""
    for key, value in us.items():
        print(f"{key:28} {value:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": args.batch, "k": args.k, "ctx": args.ctx, **us}, indent=1))


def main(argv=None) -> int:
    args = call_shape_args("python -m drafter.tools.bench.host", __doc__.split("\n")[0]).parse_args(argv)
    torch.set_num_threads(1)  # host overhead, not OpenMP: one thread keeps the numbers steady
    report(measure(args.batch, args.k, args.ctx), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
