"""Pre-drafting on a GPU: what the drafter's work costs, and the target tokens/s it implies.

    python -m drafter.tools.bench.predraft --out DIR [--batches 1,4,16 --ks 3,4,5,6 --outcomes 4]
    python -m drafter.tools.bench.predraft --out DIR --tiny --device cpu      # a smoke run anywhere

Measured (EAGLE-3 / Llama-3.1-8B shapes, random bf16 weights, Triton + CUDA graphs, 1k context):
  draft_us      an in-process decode-step call, engine.propose(..., validate=False) on GPU inputs,
                drafts copied to the host (D)
  predraft_us   engine.predraft right after it, B outcomes per request, k' = k, to host tensors (P)
Then a model of one target step turns those into target tokens/s per configuration, for each
verify time V (--verify-ms), batch b and k, with the assumptions written beside the table:
  in-process       step = V + D(b, k)
  exact remote     step = V + D(b, k) + O               (O: --remote-overhead-us, the measured ZMQ
                                                          round trip minus engine time)
  remote pre-draft the drafter answers call t (D) and pre-drafts (P) while the target verifies;
                   pushes are in time when D + P + O_push <= V, else every step misses;
                   step = V + (1 - h) (D + O); tokens per step h f tau + (1 - h) tau
with tau(k) = 1 + sum_j prod_{i <= j} alpha_i from the acceptance per position --acceptance
(conditional; the last value repeats for deeper positions), h the hit rate from --hit-by-a and
--hit-all over the accepted-length distribution those alphas imply, and f (--predraft-factor) the
tokens per step of pre-drafts over exact drafts on the same steps.  Defaults are the CPU
measurements of docs/predraft.md (trained pair, k = 3, B = 4).  Writes predraft.json and
predraft.md.  A measured target (a simulated verify on its own stream or process, outcomes drawn
live) is the next step; this run measures the drafter's costs and states the rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.tools.bench.grid import BLOCK_SIZE, SPECS, decode_call, on_device, random_head, random_kv
from drafter.models.layers import LayerShape
from drafter.models.spec import ModelSpec

TINY = ModelSpec(method="eagle3", hidden_size=128, num_layers=1, vocab_size=1000,
                 layer_shapes=(LayerShape(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                                          intermediate_size=256, rms_norm_eps=1e-5, rope_theta=10000.0),),
                 draft_vocab_size=500, aux_layer_ids=(1, 2, 3), norm_before_residual=True, target_hidden_size=128)


@dataclass(frozen=True)
class Model:
    """The assumptions that turn the drafter's measured costs into target tokens/s."""

    acceptance: tuple[float, ...] = (0.85, 0.81, 0.76)  # conditional, per draft position
    hit_by_a: tuple[float, ...] = (0.5, 0.57, 0.8)  # hit rate when a < k accepted (last value repeats)
    hit_all: float = 0.94  # hit rate when all k accepted
    predraft_factor: float = 0.935  # tokens per step, pre-drafts / exact drafts on the same steps
    remote_overhead_us: float = 2200.0  # exact remote: round trip minus engine time
    push_overhead_us: float = 1100.0  # a push's way from the drafter to the target

    def alpha(self, i: int) -> float:  # i = 1 .. k
        return self.acceptance[min(i, len(self.acceptance)) - 1]

    def tau(self, k: int) -> float:
        total, alive = 1.0, 1.0
        for i in range(1, k + 1):
            alive *= self.alpha(i)
            total += alive
        return total

    def hit_rate(self, k: int) -> float:
        h, alive = 0.0, 1.0
        for a in range(k):
            h += alive * (1 - self.alpha(a + 1)) * self.hit_by_a[min(a, len(self.hit_by_a) - 1)]
            alive *= self.alpha(a + 1)
        return h + alive * self.hit_all

    def rates(self, batch: int, k: int, v_us: float, d_us: float, p_us: float) -> dict:
        tau = self.tau(k)
        fits = d_us + p_us + self.push_overhead_us <= v_us
        h = self.hit_rate(k) if fits else 0.0
        pre_step = v_us + (1 - h) * (d_us + self.remote_overhead_us)
        pre_tau = h * self.predraft_factor * tau + (1 - h) * tau
        per_s = 1e6 * batch
        return {"tau": tau, "hit_rate": h, "fits": fits,
                "in_process": per_s * tau / (v_us + d_us),
                "exact_remote": per_s * tau / (v_us + d_us + self.remote_overhead_us),
                "predraft_remote": per_s * pre_tau / pre_step}


def _engine(head, spec, k: int, batch: int, ctx: int, outcomes: int, device: str, tiny: bool):
    from drafter.engine.engine import DraftEngine

    per_req = -(-(ctx + k + 1) // BLOCK_SIZE)
    gpu = device.startswith("cuda")
    if gpu:  # Triton launches on the current device: make --device current (cuda:1 otherwise fails)
        torch.cuda.set_device(torch.device(device))
    cfg = EngineConfig(
        method=spec.method, num_speculative_tokens=k, max_model_len=ctx + 64, max_num_seqs=batch,
        max_num_batched_tokens=batch * (k + 1), kv_groups=(KVGroupSpec(BLOCK_SIZE, batch * per_req + 1),),
        capture_sizes=(batch,), token_capture_sizes=(batch * (k + 1),), device=device,
        dtype="float32" if tiny else "bfloat16", attention_backend="triton" if gpu else "reference",
        use_cuda_graphs=gpu, predraft_outcomes=outcomes)
    engine = DraftEngine(head, spec, cfg)
    random_kv(engine)
    if engine.graphs is not None:
        with torch.inference_mode():
            engine.graphs.capture()
    return engine


def served_engine(model_dir: str, server_argv: list[str]):
    """The engine `drafter serve server_argv` would build (random weights for model_dir's head,
    random KV, graphs captured), in this process: an in-process drafter equal to a served one."""
    from drafter.service.config import add_arguments, from_args
    from drafter.service.server import engine_config
    from drafter.tools.bench.remote import _build

    p = argparse.ArgumentParser()
    add_arguments(p)
    engine = _build(engine_config(from_args(p.parse_args(server_argv))), model_dir)
    random_kv(engine)
    if engine.graphs is not None:  # as the server does before it is ready
        with torch.inference_mode():
            engine.graphs.capture()
    return engine


def _time(fn, iters: int, warmup: int = 3) -> float:
    """Median wall microseconds of fn, which returns host tensors (so it has waited for the device)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def _to_host(v):
    if isinstance(v, list):
        return [t.cpu() for t in v]
    return v.cpu() if isinstance(v, torch.Tensor) else v


def _in_thread(fn, device: str):
    """fn() in a new thread (as the server's engine thread runs it), its GPU made current there."""
    import threading

    out = {}

    def body():
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        out["v"] = fn()
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out["v"]


def _replay_cost(engine, batch: int, iters: int) -> dict:
    """Whether the pre-drafts ran as graph replays (calls answered by one), and one replay's GPU
    microseconds alone (CUDA events around `iters` replays of the batch's graph; None without one)."""
    graphs = getattr(engine, "_predraft_graphs", None)
    out = {"predraft_replays": getattr(graphs, "count", 0), "predraft_replay_gpu_us": None}
    fits = [s for s in getattr(graphs, "replays", {}) if s >= batch]
    if not fits or not torch.cuda.is_available() or engine.device.type != "cuda":
        return out
    replay = graphs.replays[min(fits)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(iters):
        replay()
    end.record()
    end.synchronize()
    out["predraft_replay_gpu_us"] = round(start.elapsed_time(end) * 1e3 / iters, 1)
    return out


def measure(spec, batches, ks, outcomes: int, ctx: int, iters: int, device: str, tiny: bool, log) -> list[dict]:
    """draft_us and predraft_us per (batch, k)."""
    from drafter.wire.records import ProposeInputs

    dtype = torch.float32 if tiny else torch.bfloat16
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    head = random_head(spec, torch.device(device), dtype)
    rows = []
    for k in ks:
        for b in batches:
            engine = _engine(head, spec, k, b, ctx, outcomes, device, tiny)
            cfg = engine.config
            call = on_device(decode_call(b, k, ctx, cfg.kv_groups[0].num_blocks, spec.vocab_size,
                                         spec.hidden_input_width, dtype, seed=b), device)
            inputs = ProposeInputs(**{n: call.get(n) for n in ProposeInputs.__dataclass_fields__})

            def draft():
                return engine.propose(**call, validate=False).draft_token_ids.cpu()

            d_us = _time(draft, iters)
            # the call's context KV is in the pool now and pre-drafting writes only scratch: the same
            # pre-draft can be timed again and again
            drafts = draft().to(device)
            p_us = _time(lambda: engine.predraft(inputs, drafts, step=0), iters)
            # as a server calls it: the call's tensors on the host, from the engine's own thread
            host = ProposeInputs(**{n: _to_host(call.get(n)) for n in ProposeInputs.__dataclass_fields__})
            host_drafts = drafts.cpu()
            p_host_us = _time(lambda: engine.predraft(host, host_drafts, step=0), iters)
            p_thread_us = _in_thread(lambda: _time(lambda: engine.predraft(host, host_drafts, step=0), iters), device)
            row = {"batch": b, "k": k, "outcomes": outcomes, "ctx": ctx, "draft_us": d_us, "predraft_us": p_us,
                   "predraft_host_inputs_us": p_host_us, "predraft_host_inputs_thread_us": p_thread_us,
                   **_replay_cost(engine, b, iters)}
            log(f"  b={b:3d} k={k}  draft {d_us:9.1f} us  predraft ({outcomes} outcomes) {row['predraft_us']:9.1f} us"
                f"  (calls by graph replay {row['predraft_replays']}, one replay's GPU time "
                f"{row['predraft_replay_gpu_us']} us; host inputs {p_host_us:.1f} us, from a thread {p_thread_us:.1f} us)")
            rows.append(row)
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], model: Model, verify_ms) -> tuple[list[dict], list[str]]:
    """Per (V, batch): the best in-process k, exact remote, pre-drafting at k = 3 and at its best k."""
    out, lines = [], []
    lines.append("| V ms | batch | in-process best (k) | exact remote best (k) | pre-draft k=3 (hit) | "
                 "pre-draft best (k, hit) | pre k=3 / in-proc | pre best / in-proc |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for v in verify_ms:
        for b in sorted({r["batch"] for r in rows}):
            mine = {r["k"]: model.rates(b, r["k"], v * 1e3, r["draft_us"], r["predraft_us"])
                    for r in rows if r["batch"] == b}
            best_in = max(mine, key=lambda k: mine[k]["in_process"])
            best_ex = max(mine, key=lambda k: mine[k]["exact_remote"])
            best_pre = max(mine, key=lambda k: mine[k]["predraft_remote"])
            at3 = mine.get(3)
            base = mine[best_in]["in_process"]
            rec = {"verify_ms": v, "batch": b, "per_k": mine, "best_in_process_k": best_in,
                   "best_exact_remote_k": best_ex, "best_predraft_k": best_pre,
                   "predraft_k3_over_in_process": at3["predraft_remote"] / base if at3 else None,
                   "predraft_best_over_in_process": mine[best_pre]["predraft_remote"] / base}
            out.append(rec)
            k3 = f"{at3['predraft_remote']:.0f} ({at3['hit_rate']:.2f})" if at3 else "-"
            r3 = f"{rec['predraft_k3_over_in_process']:.3f}" if at3 else "-"
            lines.append(f"| {v:g} | {b} | {base:.0f} ({best_in}) | {mine[best_ex]['exact_remote']:.0f} ({best_ex}) | "
                         f"{k3} | {mine[best_pre]['predraft_remote']:.0f} ({best_pre}, "
                         f"{mine[best_pre]['hit_rate']:.2f}) | {r3} | {rec['predraft_best_over_in_process']:.3f} |")
    return out, lines


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


# --------------------------------------------------------------------------- the served drafter, staged
STAGES_ENV = "DRAFTER_STAGES_OUT"  # where `serve` appends one JSON line per call


def record_stages(path: str) -> None:
    """In this (server) process: every propose call's stage marks (drafter.wire.probes: read,
    decoded, validated, engine, reply sent) plus the pre-draft's (predraft_start, predraft_engine_start,
    predraft_engine, predraft, push) appended to `path` as one JSON line per call, written by the
    engine thread after the call's push (off the call's critical path, on the next pre-draft's);
    and each bound step's pre-draft (drafter.service.predraft.BOUND_MARKS: after_reply, fields,
    decided, queued, finished, pushed, and its GPU time) as a line keyed by "bound_step".
    perf_counter_ns is CLOCK_MONOTONIC: the target's marks on this host line up with these."""
    import threading

    from drafter.engine.engine import DraftEngine
    from drafter.engine.predraft import PreDraftGraphs
    from drafter.service.predraft import PreDraftService
    from drafter.wire import probes

    probes.enable()
    out = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server process
    local = threading.local()
    plain_after, plain_one, plain_engine = PreDraftService.after_batch, PreDraftService._predraft, DraftEngine.predraft
    plain_run = PreDraftGraphs.run

    def mark(probe, stage: str) -> None:
        if probe is not None:
            probe.mark(stage)

    def engine_predraft(self, *a, **kw):
        probe = getattr(local, "probe", None)
        mark(probe, "predraft_engine_start")
        try:
            return plain_engine(self, *a, **kw)
        finally:
            mark(probe, "predraft_engine")

    def replay(self, *a, **kw):
        """The graph replay alone: launched, then waited for here (the .cpu() after it would wait anyway)."""
        probe = getattr(local, "probe", None)
        mark(probe, "replay_start")
        out = plain_run(self, *a, **kw)
        if out is not None and self.engine.device.type == "cuda":
            torch.cuda.current_stream(self.engine.device).synchronize()
        mark(probe, "replay_done" if out is not None else "replay_refused")
        return out

    def one(self, it, result, budget):
        local.probe = it.call.probe
        mark(local.probe, "predraft_start")
        try:
            return plain_one(self, it, result, budget)
        finally:
            mark(local.probe, "predraft")
            local.probe = None

    def pushing(push, probe):
        def send(pre):
            push(pre)
            mark(probe, "push")
        return send

    def after_batch(self, items, results):
        for it in items:
            if getattr(it, "push", None) is not None:
                it.push = pushing(it.push, it.call.probe)
        try:
            plain_after(self, items, results)
        finally:
            graphs = getattr(self.engine, "_predraft_graphs", None)
            for it in items:
                probe = it.call.probe
                if probe is not None:
                    out.write(json.dumps({"session": it.session.id, "request_id": it.call.request_id,
                                          "marks": probe.marks, "budget": getattr(self.budgets.get(it.session.id),
                                                                                  "outcomes", None),
                                          "replays": getattr(graphs, "count", None)}) + "\n")

    DraftEngine.predraft, PreDraftService._predraft, PreDraftService.after_batch = engine_predraft, one, after_batch
    PreDraftGraphs.run = replay

    import drafter.service.predraft as service_predraft

    def bound_marks(session: str, step: int, marks: list, gpu_us: float | None) -> None:
        """A bound step's pre-draft (BoundPreDrafts.after_reply): one line keyed by the binding's step."""
        out.write(json.dumps({"session": session, "bound_step": step, "marks": marks, "gpu_us": gpu_us}) + "\n")
    service_predraft.BOUND_MARKS = bound_marks

    from drafter.service.zmq_server import _ProposeReply
    plain_done = _ProposeReply.done

    def done(self, result):  # the event loop's bookkeeping after a reply: it runs beside the pre-draft
        start = probes.now_ns()
        try:
            return plain_done(self, result)
        finally:
            out.write(json.dumps({"request_id": self.call.request_id,
                                  "marks": [["loop_done_start", start], ["loop_done", probes.now_ns()]]}) + "\n")
    _ProposeReply.done = done


def serve_main(argv: list[str]) -> int:
    """`drafter serve` with random weights (drafter.tools.bench.remote serve), every call's stages
    recorded into $DRAFTER_STAGES_OUT when it is set (record_stages)."""
    from drafter.tools.bench.remote import serve_main as serve

    path = os.environ.get(STAGES_ENV)
    if path:
        record_stages(path)
    return serve(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the pre-draft target bench's servers
        return serve_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--ks", default="3,4,5,6")
    p.add_argument("--outcomes", type=int, default=4)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--verify-ms", default="10,25")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tiny", action="store_true", help="a tiny head (a smoke run on any device)")
    d = Model()
    p.add_argument("--acceptance", default=",".join(map(str, d.acceptance)))
    p.add_argument("--hit-by-a", default=",".join(map(str, d.hit_by_a)))
    p.add_argument("--hit-all", type=float, default=d.hit_all)
    p.add_argument("--predraft-factor", type=float, default=d.predraft_factor)
    p.add_argument("--remote-overhead-us", type=float, default=d.remote_overhead_us)
    p.add_argument("--push-overhead-us", type=float, default=d.push_overhead_us)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Model(_floats(args.acceptance), _floats(args.hit_by_a), args.hit_all, args.predraft_factor,
                  args.remote_overhead_us, args.push_overhead_us)
    spec = TINY if args.tiny else SPECS["eagle3-8b"]
    batches = [int(x) for x in args.batches.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
    print(f"pre-drafting bench on {device_name}: {'tiny' if args.tiny else 'eagle3-8b'} head, batches {batches}, "
          f"k {ks}, {args.outcomes} outcomes, ctx {args.ctx}", flush=True)
    rows = measure(spec, batches, ks, args.outcomes, args.ctx, args.iters, args.device, args.tiny,
                   lambda s: print(s, flush=True))
    verify = _floats(args.verify_ms)
    results, lines = table(rows, model, verify)
    assumptions = (f"Assumptions: acceptance per position {model.acceptance} (conditional, last repeats), hit rate "
                   f"{model.hit_by_a} when a < k and {model.hit_all} when all accepted, pre-drafts accept "
                   f"{model.predraft_factor}x the exact drafts' tokens per step, exact remote adds "
                   f"{model.remote_overhead_us:.0f} us per step, a push takes {model.push_overhead_us:.0f} us; "
                   f"pre-drafts for step t+1 are computed during step t's verify V and miss when "
                   f"draft + pre-draft + push exceed V.  Measured: draft_us and predraft_us above.")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name, "torch": torch.__version__, "command": " ".join(sys.argv),
            "model": model.__dict__, "assumptions": assumptions}
    (out / "predraft.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": results}, indent=1))
    text = "\n".join([f"# Pre-drafting ({device_name}, {meta['date']})", "", "| batch | k | draft us | predraft us | "
                      "calls by graph replay | one replay's GPU us |", "|---|---|---|---|---|---|"]
                     + [f"| {r['batch']} | {r['k']} | {r['draft_us']:.1f} | {r['predraft_us']:.1f} | "
                        f"{r['predraft_replays']} | {r['predraft_replay_gpu_us']} |" for r in rows]
                     + ["", "Target tokens/s (model):", ""] + lines + ["", assumptions, ""])
    (out / "predraft.md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
