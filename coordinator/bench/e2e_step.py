"""One target decoding step end to end: the reference target at Llama-3.1-8B shapes, three ways.

    python -m coordinator.bench.e2e_step --out DIR [--batch 16 --ctx 1000 --k 3 --iters 200 --warmup 30
        --device cuda:0 --drafter-device cuda:0 --ways plain,free_drafts,inprocess,inprocess_trusted,remote,unbound]
    python -m coordinator.bench.e2e_step --tiny --device cpu --out DIR     # the same code on CPU, tiny shapes

The reference target engine (coordinator.target.engine.TargetEngine) runs a Llama with
Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 / 8 heads, intermediate 14336, vocab 128256,
llama3 rope) and random bf16 weights built in memory on --device (no checkpoint), its paged KV
on the same GPU under the Triton attention backend; the drafter is an EAGLE-3 head of the 8B
shapes with random weights (drafter.tools.bench.remote.HEAD_CONFIG, as the bound and remote
benches build it).  --batch requests with prompts of --ctx random tokens are prefilled, the
drafter catches up on their context (calls of at most 2 prompts' rows), and after --warmup more
steps --iters decoding steps are timed, each one `engine.step()` between two
torch.cuda.synchronize(): the target forward over the step's query rows, greedy verification,
the drafter call built, the next drafts obtained and handed out.  The ways:

  plain              k = 0: a plain decode step, one query row per request (no drafter);
  free_drafts        k = 3 with drafts that cost nothing (zeros from a stand-in proposer): the
                     target's step with verification of k + 1 rows and the call built, no drafter;
  inprocess          k = 3, the drafter in this process on the target's GPU as the vLLM plugin's
                     `inprocess` transport runs it: coordinator.inprocess.InProcessTransport
                     (a DraftEngine per session, CUDA graphs) under the RemoteProposer, each call
                     validated on the host (engine.draft's default);
  inprocess_trusted  the same DraftEngine called as a trusted caller would, propose(validate=False);
  remote             k = 3, `drafter serve` in a subprocess on --drafter-device (default: the
                     target's GPU), the client the vLLM plugin uses (RemoteProposer over
                     ServiceTransport, BoundConfig plane --plane: cuda_ipc on a GPU, so each step
                     is the call's tensors copied into the shared slab and a header);
  unbound            the same server, BoundConfig(mode="off"): every step the unbound ZMQ Propose.

The engine builds each drafter call on the host (CPU tensors, hidden states in float32: it is a
reference engine, not vLLM); every drafting way gets the call on the target's GPU, the hidden
states in the session's dtype (one host-to-device copy per tensor, OnDevice below), the same for
all of them, so the differences between the drafting ways are the drafter's and the transport's.
Random weights accept almost no drafts: tokens per step are reported, but the figure is time per
step.  Written to --out: e2e_step.json (every number) and e2e_step.md (the table; device, date and
command in its header).  --tiny: tiny target and head on the CPU, the remote way over loopback
(a CPU drafter has no graphs, so it refuses the Bind and the steps go unbound), for the test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from coordinator.child_process import stop_child
from coordinator.dp_agreement import capture_sizes_up_to
from coordinator.target.engine import TargetConfig, TargetEngine
from coordinator.target.request import random_requests
from coordinator.target.runner import ModelRunner, RunnerConfig
from drafter.models.llama import LlamaForCausalLM
from drafter.models.spec import ModelSpec, parse_head, parse_target
from drafter.tools.bench.remote import HEAD_CONFIG, TINY, server_args, wait_ready

WAYS = ("plain", "free_drafts", "inprocess", "inprocess_trusted", "remote", "unbound", "plain_eager")
DRAFTING = ("inprocess", "inprocess_trusted", "remote", "unbound")  # ways that call a drafter
BLOCK_SIZE = 16

# Llama-3.1-8B's config.json keys (the shapes the target runs with random weights)
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}}
TINY_TARGET = {**LLAMA_8B, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 1000}
TINY_HEAD = {**HEAD_CONFIG, **TINY, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}


@dataclass(frozen=True)
class Setup:
    """The run's sizes, derived once from the arguments."""

    batch: int
    ctx: int  # prompt length of every request
    k: int
    warmup: int
    iters: int
    max_new_tokens: int
    max_model_len: int
    max_tokens: int  # the session's max_num_batched_tokens: two prompts' rows (the catch-up) + a decode step
    num_blocks: int
    dtype: str

    @classmethod
    def of(cls, args) -> "Setup":
        # a step emits >= 1 token per request: room for every step, the catch-up's and the timed ones
        new = 2 * (args.batch + args.warmup + args.iters) + 8
        mml = args.ctx + new + args.k + 1
        per_req = -(-mml // BLOCK_SIZE)
        return cls(batch=args.batch, ctx=args.ctx, k=args.k, warmup=args.warmup, iters=args.iters,
                   max_new_tokens=new, max_model_len=mml,
                   max_tokens=2 * (args.ctx + args.k + 1) + args.batch * (args.k + 1),
                   num_blocks=args.batch * per_req + 1, dtype=args.dtype)


# ---------------------------------------------------------------------------------------------- models
def random_target(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0) -> LlamaForCausalLM:
    """The target Llama with random weights allocated straight on the device (normal, std
    1/sqrt(fan-in); norms 1)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(spec)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
    return model.eval()


class GraphedRunner(ModelRunner):
    """The runner with its steady decode forwards replayed from CUDA graphs, as vLLM runs a decode
    step: a forward of exactly `batch` requests and one of the `shapes` token counts is captured
    the first time it comes (its inputs copied into static buffers, one warm-up run, the capture,
    the replay) and replayed after that; any other forward (the prefill) runs eagerly.  The
    outputs are the graph's static buffers, valid until the next forward (the engine reads them
    within the step).  The Triton backend's launches depend on shapes only, so a replay is right
    for any values the buffers hold."""

    def __init__(self, cfg: RunnerConfig, *, model, backend, batch: int, shapes: tuple[int, ...]):
        super().__init__(cfg, model=model, backend=backend)
        self.batch, self.shapes = batch, shapes
        self.graphs: dict[tuple, tuple] = {}  # (num_tokens, table columns) -> (graph, static inputs, output)
        self.replays = 0

    def forward(self, *inputs):  # ModelRunner.forward's tensors: ids, positions, qsl, seq_lens, table, slots
        num_tokens, batch = inputs[0].shape[0], inputs[3].shape[0]
        if batch != self.batch or num_tokens not in self.shapes:
            return super().forward(*inputs)
        key = (num_tokens, inputs[4].shape[1])
        if key not in self.graphs:
            self.graphs[key] = self._capture(inputs)
        graph, static, out = self.graphs[key]
        for dst, src in zip(static, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, inputs) -> tuple:
        static = [t.to(self.device).clone() for t in inputs]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # compiles and picks kernels outside the capture
            super().forward(*static)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = super().forward(*static)
        return graph, static, out


def build_runner(args, setup: Setup, head_cfg: dict) -> ModelRunner:
    """The reference target's runner over the random target, its KV cache on args.device (on a
    GPU with --target-graphs: its steady decode forwards replayed from CUDA graphs)."""
    device = torch.device(args.device)
    spec = parse_target(TINY_TARGET if args.tiny else LLAMA_8B, "llama-3.1-8b shapes (random weights)")
    model = random_target(spec, device, getattr(torch, setup.dtype))
    backend = None
    if device.type == "cuda":
        from drafter.attention.triton_backend import TritonBackend

        backend = TritonBackend()
    cfg = RunnerConfig("", BLOCK_SIZE, setup.num_blocks, tuple(head_cfg["eagle_aux_hidden_state_layer_ids"]),
                       setup.dtype)
    if device.type == "cuda" and args.target_graphs:
        return GraphedRunner(cfg, model=model, backend=backend, batch=setup.batch,
                             shapes=(setup.batch, setup.batch * (setup.k + 1)))
    return ModelRunner(cfg, model=model, backend=backend)


@contextlib.contextmanager
def random_heads(dtype: torch.dtype):
    """InProcessTransport builds its head with random weights from the head's config.json (as the
    served drafter's `drafter.tools.bench.remote serve` does), not from a checkpoint."""
    import coordinator.inprocess as inproc
    from drafter.models.spec import read_config
    from drafter.tools.bench.grid import random_head

    def load(head_dir, method, target_dir, device="cpu"):
        return random_head(parse_head(read_config(head_dir), method), torch.device(device), dtype)

    saved = inproc.load_head
    inproc.load_head = load
    try:
        yield
    finally:
        inproc.load_head = saved


# ---------------------------------------------------------------------------------------------- proposers
def _to(value, device: torch.device, hidden_dtype: torch.dtype | None = None):
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, torch.Tensor):
        return value.to(device, hidden_dtype or value.dtype)
    return value


class OnDevice:
    """The proposer the target engine calls: the engine's host-built call moved to the target's
    device (hidden states in the session's dtype), as a GPU-resident target would hold it, then
    handed to `inner` (a RemoteProposer or TrustedProposer)."""

    def __init__(self, inner, device: torch.device, hidden_dtype: torch.dtype, head=None):
        self.inner, self.device, self.hidden_dtype = inner, device, hidden_dtype
        self.head = head  # an in-process drafter's head (its GEMM plan goes into the report)

    @property
    def generation(self):
        return self.inner.generation

    @property
    def last_batch_padded(self):
        return getattr(self.inner, "last_batch_padded", None)

    def propose(self, *, accepted_counts=None, **call):
        moved = {name: _to(v, self.device, self.hidden_dtype if name == "target_hidden_states" else None)
                 for name, v in call.items()}
        # accepted_counts stay on the host: the bound header carries them as a list
        return self.inner.propose(accepted_counts=accepted_counts, **moved)


class FreeDrafts:
    """Not a drafter: drafts of token 0 at no cost, so the target verifies k rows per request."""

    generation = 1
    last_batch_padded = None

    def __init__(self, k: int, device: torch.device):
        self.k, self.device = k, device

    def propose(self, *, next_token_ids, **_):  # next_token_ids: [batch]
        return torch.zeros(next_token_ids.shape[0], self.k, dtype=torch.int64, device=self.device)


class TrustedProposer:
    """A DraftEngine called in process as a trusted caller does: propose(validate=False)."""

    generation = 1
    last_batch_padded = None

    def __init__(self, engine):
        self.engine = engine

    def propose(self, *, accepted_counts=None, **call):
        return self.engine.propose(**call, validate=False).draft_token_ids


# ---------------------------------------------------------------------------------------------- the drafters
def serve_argv(args, setup: Setup, model_dir: str, run_dir: str) -> list[str]:
    """`drafter serve` (random weights) sized for the session this bench attaches: the target's
    capture sizes, a KV pool of twice the session's blocks (a re-attach fits)."""
    argv = server_args(model_dir, setup.batch, setup.k, setup.ctx, 2 * setup.num_blocks, args.drafter_device)
    flags = {"--dtype": setup.dtype, "--max-model-len": str(setup.max_model_len),
             "--max-num-batched-tokens": str(setup.max_tokens),
             "--capture-sizes": ",".join(map(str, capture_sizes_up_to(setup.batch))),
             "--token-capture-sizes": ",".join(map(str, capture_sizes_up_to(setup.max_tokens)))}
    for flag, value in flags.items():
        argv[argv.index(flag) + 1] = value
    threads = ["--torch-threads", "1"] if args.tiny else []  # see main: a tiny CPU run on a busy host
    return argv + threads + ["--zmq-ipc", f"{run_dir}/drafter.sock"]


def start_server(args, setup: Setup, model_dir: str) -> subprocess.Popen:
    """The served drafter's process, started (its readiness is waited for by wait_server)."""
    run_dir = tempfile.mkdtemp(prefix="drafter-e2e-")
    cmd = [sys.executable, "-m", "drafter.tools.bench.remote", "serve", *serve_argv(args, setup, model_dir, run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ))


def remote_proposer(spec, port: int, args, bound: bool):
    """The vLLM plugin's client (drafter_vllm.sources.make_source): RemoteProposer over ServiceTransport."""
    from coordinator.clients import ServiceTransport
    from coordinator.remote_proposer import ProposerConfig, RemoteProposer
    from coordinator.routing import Endpoint, Router, StaticEndpoints
    from coordinator.transport.bound_transport import BoundConfig

    gpu = args.device.startswith("cuda")
    cfg = BoundConfig(mode="auto", plane=args.plane, device=args.device if gpu else "",
                      armed=args.armed) if bound else BoundConfig(mode="off")
    return RemoteProposer(spec, router=Router(StaticEndpoints([Endpoint("zmq", "127.0.0.1", port)])), key=spec.client,
                          connect=lambda ep: ServiceTransport(ep, timeout_s=args.deadline_s),
                          config=ProposerConfig(deadline_s=args.deadline_s, bound=cfg))


def inprocess_proposer(spec, model_dir: str, args):
    """The plugin's `inprocess` transport under the RemoteProposer, attached."""
    from coordinator.inprocess import InProcessTransport
    from coordinator.remote_proposer import ProposerConfig, RemoteProposer
    from coordinator.routing import Endpoint, Router, StaticEndpoints

    with random_heads(getattr(torch, spec.dtype)):
        transport = InProcessTransport(model_dir, "", "eagle3", device=args.device)
    proposer = RemoteProposer(spec, router=Router(StaticEndpoints([Endpoint("inprocess", "e2e", 0)])),
                              key=spec.client, connect=lambda ep: transport,
                              config=ProposerConfig(deadline_s=args.deadline_s))
    if not proposer.start():
        raise RuntimeError(f"in-process attach failed: {list(proposer.events)}")
    return proposer, transport


# ---------------------------------------------------------------------------------------------- one way
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": xs[len(xs) // 2], "p99_us": xs[min(len(xs) - 1, int(0.99 * len(xs)))],
            "mean_us": sum(xs) / len(xs), "n": len(xs)}


def steady(rec, setup: Setup, k: int) -> bool:
    """Every request decodes with k drafts verified and (k > 0) drafted for in the call."""
    if rec.scheduled_tokens != setup.batch * (k + 1):
        return False
    return k == 0 or (rec.batch == setup.batch and rec.tokens == setup.batch * (k + 1))


@dataclass
class Lane:
    """One way's target engine (its own KV cache, its own drafter session) and what its timed steps gave."""

    name: str
    engine: TargetEngine
    k: int
    prefill_s: float = 0.0
    catchup: int = 0
    before: dict | None = None  # rid -> tokens generated when the timed steps began
    replays: int = 0  # the runner's graph replays when the timed steps began
    times: list = field(default_factory=list)  # us per timed step
    waits: list = field(default_factory=list)  # us per timed step in the engine's propose call
    records: list = field(default_factory=list)
    drafts: list = field(default_factory=list)  # per timed step: every request's drafts, by rid
    gc_ms: list = field(default_factory=list)  # Python collections during its timed steps: (generation, ms)
    stages: list = field(default_factory=list)  # per timed bound cuda_ipc step: its host stages in us (ipc_stages)
    error: str = ""

    @property
    def runner(self):
        return self.engine.runner


def prepare(name: str, runner: ModelRunner, proposer, setup: Setup) -> Lane:
    """A target engine for one way, its requests prefilled and the drafter caught up on their prompts."""
    k = 0 if name.startswith("plain") else setup.k
    cfg = TargetConfig(target_dir="", method="eagle3", aux_layer_ids=runner.cfg.aux_layer_ids,
                       num_speculative_tokens=k, max_model_len=setup.max_model_len, max_num_seqs=setup.batch,
                       max_num_batched_tokens=setup.max_tokens, block_size=BLOCK_SIZE, num_blocks=setup.num_blocks,
                       dtype=setup.dtype)
    lane = Lane(name, TargetEngine(cfg, proposer=proposer, runner=runner), k)
    for spec in random_requests(setup.batch, vocab_size=runner.vocab_size, max_new_tokens=setup.max_new_tokens,
                                seed=3, prompt_lens=(setup.ctx, setup.ctx)):
        lane.engine.add(spec)
    t0 = time.perf_counter()
    lane.engine.step()  # the prefill
    lane.prefill_s = time.perf_counter() - t0
    while True:  # the drafter catches up on every prompt (two per call), then every step is a full one
        rec = lane.engine.step()
        lane.catchup += 1
        if steady(rec, setup, k):
            return lane
        if lane.catchup > 4 * setup.batch + 8:
            raise RuntimeError(f"{name}: no steady step after {lane.catchup} steps (last {rec})")


def interleave(lanes: list[Lane], setup: Setup, device: torch.device) -> None:
    """Warm-up steps, then the timed steps, round robin over the lanes (the first lane of each
    round rotates), so a drift of the machine (clocks, a neighbour's load) touches every way alike.
    A lane whose step raises keeps its error and leaves the rotation."""
    for _ in range(setup.warmup):
        for lane in lanes:
            lane.engine.step()
    for lane in lanes:
        lane.before = {r.rid: len(r.output) for r in lane.engine.running}
        lane.replays = getattr(lane.runner, "replays", 0)
    current: list[Lane] = []

    def collected(phase, info, started=[0.0]):  # noqa: B006 - the start of the collection in progress
        if phase == "start":
            started[0] = time.perf_counter()
        elif current:
            current[0].gc_ms.append((info["generation"], (time.perf_counter() - started[0]) * 1e3))

    gc.collect()
    gc.callbacks.append(collected)
    try:
        for i in range(setup.iters):
            live = [lane for lane in lanes if not lane.error]
            shift = i % max(1, len(live))
            for lane in live[shift:] + live[:shift]:
                current[:] = [lane]
                try:
                    timed_step(lane, device)
                except Exception as exc:  # noqa: BLE001 - the other ways go on
                    lane.error = f"{type(exc).__name__} at timed step {i}: {exc}"
                current.clear()
    finally:
        gc.callbacks.remove(collected)


def timed_step(lane: Lane, device: torch.device) -> None:
    """One engine.step() between two device synchronisations."""
    _sync(device)
    t0 = time.perf_counter()
    rec = lane.engine.step()
    _sync(device)
    lane.times.append((time.perf_counter() - t0) * 1e6)
    lane.waits.append(rec.wait_s * 1e6)
    lane.records.append(rec)
    stages = ipc_stages(lane.engine.proposer)
    if stages:
        lane.stages.append(stages)
    lane.drafts.append([list(r.drafts) for r in sorted(lane.engine.running, key=lambda r: r.rid)])


IPC_STAGES = ("fill", "to_send", "header_trip", "drafter_to_queued", "drafter_queued_to_reply", "reply_trip",
              "drafts_wait", "clone", "error_word", "bound_call")


def ipc_stages(proposer) -> dict | None:
    """The last step's host stages (us) where it went bound over cuda_ipc: the transport's marks
    (coordinator.transport.bound_transport.BoundTransport.ipc_marks) and its link's stamps
    (drafter.wire.bound.STAMPS: the drafter's side, one host clock); None for any other step."""
    inner = getattr(proposer, "inner", proposer)
    transports = getattr(inner, "transports", None)
    transport = transports.get(inner.endpoint) if transports else None
    marks, link = getattr(transport, "ipc_marks", ()), getattr(transport, "link", None)
    stamps = getattr(link, "stamps", None)
    if not getattr(transport, "last_bound", False) or len(marks) != 5 or not stamps or "received" not in stamps:
        return None
    transport.ipc_marks = ()  # read once: an unbound step next leaves nothing behind
    t0, t1, t2, t3, t4 = marks
    us = lambda a, b: round((b - a) / 1e3, 1)  # noqa: E731
    return dict(zip(IPC_STAGES, (us(t0, t1), us(t1, stamps["sent"]), us(stamps["sent"], stamps["received"]),
                                 us(stamps["received"], stamps["queued"]), us(stamps["queued"], stamps["replied"]),
                                 us(stamps["replied"], stamps["answered"]), us(stamps["answered"], t2),
                                 us(t2, t3), us(t3, t4), us(t0, t4))))


def lane_result(lane: Lane, setup: Setup) -> dict:
    """A lane's figures: step and exchange statistics, the slowest steps, tokens, drafts, outputs."""
    if lane.error:
        return {"error": lane.error}
    engine, n = lane.engine, len(lane.times)
    emitted = sum(len(r.output) - lane.before[r.rid] for r in engine.running if r.rid in lane.before)
    slowest = sorted(range(n), key=lambda i: -lane.times[i])[:3]
    out = {"step": stats(lane.times), "tokens_per_step": emitted / n,
           "tokens_per_request_step": emitted / (n * setup.batch),
           "query_rows_per_step": setup.batch * (lane.k + 1), "full_steps": sum(steady(r, setup, lane.k)
                                                                               for r in lane.records),
           "target_graph_replays": getattr(lane.runner, "replays", 0) - lane.replays,
           "drafted_steps": sum(bool(r.drafts_ok) for r in lane.records), "catchup_steps": lane.catchup,
           "prefill_s": lane.prefill_s, "step_us": [round(t, 1) for t in lane.times],
           "slowest_steps": [{"index": i, "us": round(lane.times[i], 1)} for i in slowest],
           "gc": {"collections": len(lane.gc_ms), "gen2": sum(g == 2 for g, _ in lane.gc_ms),
                  "ms": round(sum(ms for _, ms in lane.gc_ms), 2),
                  "max_ms": round(max((ms for _, ms in lane.gc_ms), default=0.0), 2)},
           "drafts": lane.drafts,
           "distinct_draft_tokens": len({t for step in lane.drafts for row in step for t in row}),
           "outputs": {r.rid: r.output for r in sorted(engine.running, key=lambda r: r.rid)}}
    if lane.k:
        out["exchange"] = stats(lane.waits)
    if lane.stages:
        out["ipc_stages"] = {name: stats([st[name] for st in lane.stages]) for name in IPC_STAGES}
        out["ipc_stages"]["steps"] = len(lane.stages)
    return out


def forward_gpu_us(runner, iters: int = 50) -> dict:
    """The GPU time of each captured target forward alone (CUDA events, mean of back-to-back replays
    of the last step's inputs: the same KV rows rewritten with the same values)."""
    out = {}
    for (num_tokens, _), (graph, _, _) in getattr(runner, "graphs", {}).items():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        out[str(num_tokens)] = start.elapsed_time(end) * 1e3 / iters
    return out


def make_proposer(way: str, spec, model_dir: str, port, args, device: torch.device, closers: list):
    """The proposer the target engine of `way` calls (None: no drafter); what must be closed after
    the run goes into closers.  Every drafting way has a session of its own."""
    hidden_dtype = getattr(torch, spec.dtype)
    if way.startswith("plain"):
        return None
    if way == "free_drafts":
        return FreeDrafts(spec.num_speculative_tokens, device)
    if way in ("inprocess", "inprocess_trusted"):
        proposer, transport = inprocess_proposer(spec, model_dir, args)
        closers.append(proposer.close)
        if way == "inprocess":
            return OnDevice(proposer, device, hidden_dtype, transport.head)
        engine = transport.sessions[proposer.session.session_id]
        return OnDevice(TrustedProposer(engine), device, hidden_dtype, transport.head)
    proposer = remote_proposer(spec, port, args, bound=way == "remote")
    closers.append(lambda: proposer.close(timeout=5.0))
    if not proposer.start():
        raise RuntimeError(f"attach failed: {list(proposer.events)[-3:]}")
    return OnDevice(proposer, device, hidden_dtype)


def lane_runner_for(way: str, base: ModelRunner) -> ModelRunner:
    """A runner of its own over base's model for another lane: its own KV cache (every engine hands
    out the same block ids) and its own graphs; plain_eager's never graphed."""
    if way != "plain_eager" and isinstance(base, GraphedRunner):
        return GraphedRunner(base.cfg, model=base.model, backend=base.backend, batch=base.batch, shapes=base.shapes)
    return ModelRunner(base.cfg, model=base.model, backend=base.backend)


def gemm_plan(head) -> dict:
    """Which kernel each fused GEMM of a drafter's head runs per row bucket: plan_gemm's choice,
    timed at start-up by each engine (a bucket absent: cuBLAS).  Two engines that chose differently
    sum in another order, so their bfloat16 drafts may part on a near-tie."""
    from drafter.kernels.weight_gemm import WeightGemm

    out = {}
    for path, module in head.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, WeightGemm):
                out[f"{path}.{name}".lstrip(".")] = {
                    "configs": {str(b): repr(c) for b, c in sorted(value.configs.items())},
                    "scaled_configs": {str(b): repr(c) for b, c in sorted(value.scaled_configs.items())}}
    return out


def proposer_report(proposer) -> dict:
    """What a RemoteProposer says of the run: no-draft steps by reason; for a bound transport the
    plane and the bound / unbound step counts."""
    report = {"no_drafts": dict(proposer.stats.no_drafts), "calls": proposer.stats.calls}
    transport = proposer.transports.get(proposer.endpoint)
    link = getattr(transport, "link", None)
    if hasattr(transport, "steps"):
        report["plane"] = getattr(link, "plane", None) if getattr(link, "alive", False) else None
        report["steps"] = dict(transport.steps)
    return report


# ---------------------------------------------------------------------------------------------- report
def derive(ways: dict) -> dict:
    """The figures the issue asks for, from the step p50s (absent ways give absent figures)."""
    p50 = {n: w["step"]["p50_us"] for n, w in ways.items() if "step" in w}
    out = {}
    if "plain" in p50:
        for n in ("free_drafts", *DRAFTING):
            if n in p50:
                out[f"{n}_minus_plain_us"] = p50[n] - p50["plain"]
    if "free_drafts" in p50:
        for n in DRAFTING:
            if n in p50:
                out[f"{n}_minus_free_drafts_us"] = p50[n] - p50["free_drafts"]
    if "inprocess" in p50:
        for n in ("remote", "unbound"):
            if n in p50:
                out[f"{n}_over_inprocess_share"] = (p50[n] - p50["inprocess"]) / p50["inprocess"]
    if "inprocess_trusted" in p50 and "remote" in p50:
        out["remote_over_inprocess_trusted_share"] = (p50["remote"] - p50["inprocess_trusted"]) / \
            p50["inprocess_trusted"]
    return out


def compare_drafts(ways: dict) -> dict:
    """Step by step, whether each drafting way drafted what the in-process one did (same target,
    same steps), and whether every way generated the same tokens as the plain decode."""
    out = {}
    ref = ways.get("inprocess", {}).get("drafts")
    for n in ("inprocess_trusted", "remote", "unbound"):
        other = ways.get(n, {}).get("drafts")
        if ref is None or other is None:
            continue
        same = [a == b for a, b in zip(ref, other)]
        out[f"inprocess_vs_{n}"] = {"equal": all(same) and len(ref) == len(other), "steps": len(same),
                                    "equal_steps": sum(same),
                                    "first_difference": same.index(False) if not all(same) else None}
        plans = [ways.get(w, {}).get("gemm_plan") for w in ("inprocess", n)]
        if None not in plans:
            out[f"inprocess_vs_{n}"]["same_gemm_plan"] = plans[0] == plans[1]
    # against free drafts too: the same k + 1 query rows per request, so the same GEMM shapes
    for base in ("plain", "free_drafts"):
        ref_out = ways.get(base, {}).get("outputs")
        for n, w in ways.items():
            if n == base or ref_out is None or "outputs" not in w or (base == "free_drafts" and
                                                                      n.startswith("plain")):
                continue
            agree = [w["outputs"][rid][:len(toks)] == toks[:len(w["outputs"][rid])] for rid, toks in ref_out.items()]
            out[f"outputs_{n}_vs_{base}"] = {"requests_agreeing": sum(agree), "requests": len(agree)}
    return out


LABELS = {"plain": "(a) no drafting, k = 0", "free_drafts": "(a') k = 3, free drafts (no drafter)",
          "inprocess": "(b) in-process drafter", "inprocess_trusted": "(b') in-process, trusted call",
          "remote": "(c) remote drafter", "unbound": "(d) remote, unbound ZMQ",
          "plain_eager": "(a, eager target) no drafting, the target's forward not graphed"}


def table(result: dict) -> str:
    meta, ways, d = result["meta"], result["ways"], result["derived"]
    lines = [f"# One target decoding step end to end ({meta['device']}, {meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"Reference target (coordinator.target) at {meta['target_shapes']}, random {meta['dtype']} weights, on "
             f"{meta['target_device']}; EAGLE-3 head ({meta['head_shapes']}, random weights); drafter of (c)/(d) "
             f"on {meta['drafter_device']}. Batch {meta['batch']}, context {meta['ctx']}, greedy, k = {meta['k']}; "
             f"{meta['iters']} steps timed per way after {meta['warmup']} warm-up steps, each engine.step() between "
             "two device synchronisations; every way has its own engine, KV cache and drafter session, and the "
             "ways step in turn (round robin, the first of each round rotating), so a drift of the machine touches "
             "them alike. Step and exchange in us; the exchange is the engine's propose call (the call moved to "
             "the device, drafted, drafts handed back): an in-process call returns before its GPU work is done "
             "(the rest is waited for when the engine reads the drafts, inside the step), a bound remote step "
             "returns after it, so compare the steps, not the exchanges. The target's decode forward "
             + ("is replayed from a CUDA graph (GraphedRunner, as vLLM runs a decode step); the rest of the step "
                "(verification, the call built from per-request state) is the reference engine's host Python."
                if meta["target_graphs"] else "runs eagerly (the reference engine as it is)."), "",
             "| way | step p50 | step p99 | exchange p50 | exchange p99 | tokens / step | notes |",
             "|---|---|---|---|---|---|---|"]
    for n in WAYS:
        if n not in ways:
            continue
        w = ways[n]
        if "error" in w:
            lines.append(f"| {LABELS[n]} | failed: {w['error'][:100]} | | | | | |")
            continue
        ex = w.get("exchange")
        ex_text = f"{ex['p50_us']:.0f} | {ex['p99_us']:.0f}" if ex else " | "
        lines.append(f"| {LABELS[n]} | {w['step']['p50_us']:.0f} | {w['step']['p99_us']:.0f} | {ex_text} | "
                     f"{w['tokens_per_step']:.2f} | {_notes(w)} |")
    lines += ["", "Derived (step p50s):", ""]
    names = {"inprocess_minus_plain_us": "draft part in process, (b) - (a)",
             "remote_minus_plain_us": "draft part remote, (c) - (a)",
             "inprocess_minus_free_drafts_us": "in-process drafter alone (the call's copy to the device included), "
                                               "(b) - (a')",
             "remote_minus_free_drafts_us": "remote drafter alone (the same copy included), (c) - (a')",
             "remote_over_inprocess_share": "overhead of remote over in-process, share of the step: ((c) - (b)) / (b)",
             "remote_over_inprocess_trusted_share": "the same against the trusted call: ((c) - (b')) / (b')",
             "unbound_over_inprocess_share": "unbound remote over in-process: ((d) - (b)) / (b)"}
    for key, label in names.items():
        if key in d:
            value = f"{100 * d[key]:+.1f} %" if key.endswith("share") else f"{d[key]:.0f} us"
            lines.append(f"* {label}: **{value}**")
    st = result["ways"].get("remote", {}).get("ipc_stages")
    if st:
        lines += ["", f"The remote way's bound cuda_ipc steps, host stages in us (p50 / p99 over {st['steps']} steps; "
                  "perf_counter_ns on both sides, one host clock): fill = the request's copies into the slab; "
                  "to_send = the link's part before the header (the inputs event or the armed start); "
                  "drafts_wait = the StepDone read to the drafts' event waited for (host_wait: on the host); "
                  "error_word = its read (a stream sync); bound_call = all of it.", "",
                  "| stage | p50 | p99 |", "|---|---|---|"]
        lines += [f"| {name} | {st[name]['p50_us']:.0f} | {st[name]['p99_us']:.0f} |" for name in IPC_STAGES]
    lines += ["", "Drafts compared step by step with (b), and the tokens each way generated compared with (a) and "
              "(a'). Speculation is lossless up to the target's numerics: a forward over k + 1 rows per request "
              "runs other GEMM shapes than one over 1 row, and in bfloat16 with random weights (near-ties between "
              "the top logits) one flipped argmax sends a request down another path for good; the ways of k + 1 "
              "rows must agree with (a') (the same shapes; a row's result does not depend on the other rows), and "
              "in float32 (--dtype float32) every way with (a).", ""]
    for key, c in result["compare"].items():
        if key.startswith("inprocess_vs_"):
            plan = {True: " (the two engines' GEMM plans equal)", False: " (the two engines timed different GEMM "
                    "kernels at start-up: another summation order)"}.get(c.get("same_gemm_plan"), "")
            lines.append(f"* {key}: {c['equal_steps']} of {c['steps']} steps equal{plan}")
        else:
            lines.append(f"* {key}: {c['requests_agreeing']} of {c['requests']} requests generated the same tokens")
    fwd = meta.get("target_forward_gpu_us")
    if fwd:
        lines += ["", "The target's graphed forward alone on the GPU (CUDA events): " + ", ".join(
            f"{rows} query rows {us:.0f} us" for rows, us in sorted(fwd.items(), key=lambda x: int(x[0])))]
    lines += ["", "(b) validates every call on the host (engine.draft's checks: a device sync and small copies); "
              "(b') skips them (a trusted caller); (c) validates on the GPU inside the drafter's bound graphs "
              "(the step guard), so (c) can come out at or under (b)."]
    lines += ["", "Random weights: the drafts are almost never accepted (tokens / step is about the batch), so "
              "acceptance says nothing here; the figure is time per step."]
    return "\n".join(lines) + "\n"


def _notes(w: dict) -> str:
    notes = []
    if w["full_steps"] != w["step"]["n"]:
        notes.append(f"{w['full_steps']} of {w['step']['n']} steps full")
    if w["target_graph_replays"]:
        notes.append(f"target forward replayed from a CUDA graph in {w['target_graph_replays']} steps")
    if "proposer" in w:
        p = w["proposer"]
        if "plane" in p:
            notes.append(f"plane {p['plane'] or 'none (unbound)'}, steps {p['steps']}")
        if p["no_drafts"]:
            notes.append(f"no drafts: {p['no_drafts']}")
    return "; ".join(notes)


# ---------------------------------------------------------------------------------------------- main
def parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="python -m coordinator.bench.e2e_step", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results/latest")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=1000, help="prompt length of every request")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cuda:0", help="the target's GPU (and the in-process drafter's)")
    p.add_argument("--drafter-device", default="", help="the served drafter's device [--device]")
    p.add_argument("--plane", default="cuda_ipc", help="the remote way's BoundConfig.plane [cuda_ipc]")
    p.add_argument("--armed", action=argparse.BooleanOptionalAction, default=True,
                   help="the remote way's cuda_ipc binding asks for armed steps (BoundConfig.armed) [on]")
    p.add_argument("--ways", default=",".join(WAYS), help=f"of {WAYS}")
    p.add_argument("--deadline-s", type=float, default=30.0, help="the proposers' per-step deadline")
    p.add_argument("--target-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU: the target's steady decode forwards as CUDA graphs (GraphedRunner) [on]")
    p.add_argument("--dtype", default="", choices=("", "bfloat16", "float32"),
                   help="the target's and the drafters' dtype [bfloat16; float32 with --tiny]")
    p.add_argument("--tiny", action="store_true", help="tiny target and head (the CPU test)")
    args = p.parse_args(argv)
    args.ways = [w for w in args.ways.split(",") if w]
    unknown = set(args.ways) - set(WAYS)
    if unknown:
        raise SystemExit(f"--ways: unknown {sorted(unknown)}; choose from {WAYS}")
    args.drafter_device = args.drafter_device or args.device
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    threads = torch.get_num_threads()
    if args.tiny:  # tiny matrices on a shared CPU: one thread is tens of times faster than several waiting
        torch.set_num_threads(1)
    try:
        return run(args, argv)
    finally:
        torch.set_num_threads(threads)


def run(args, argv: list[str]) -> int:
    setup = Setup.of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    head_cfg = TINY_HEAD if args.tiny else HEAD_CONFIG
    model_dir = tempfile.mkdtemp(prefix="e2e-eagle3-config-")
    Path(model_dir, "config.json").write_text(json.dumps(head_cfg))
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # Triton launches on the current device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    target_cfg = TINY_TARGET if args.tiny else LLAMA_8B
    result = {"meta": {
        "device": name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m coordinator.bench.e2e_step " + " ".join(argv), "torch": torch.__version__,
        "target_device": args.device, "drafter_device": args.drafter_device, "batch": setup.batch, "ctx": setup.ctx,
        "k": setup.k, "warmup": setup.warmup, "iters": setup.iters, "dtype": setup.dtype,
        "target_shapes": (f"{target_cfg['num_hidden_layers']} layers, hidden {target_cfg['hidden_size']}, "
                          f"{target_cfg['num_attention_heads']}/{target_cfg['num_key_value_heads']} heads, "
                          f"intermediate {target_cfg['intermediate_size']}, vocab {target_cfg['vocab_size']}"),
        "head_shapes": f"hidden {head_cfg['hidden_size']}, draft vocab {head_cfg['draft_vocab_size']}",
        "max_num_batched_tokens": setup.max_tokens, "max_model_len": setup.max_model_len,
        "target_graphs": device.type == "cuda" and args.target_graphs},
        "ways": {}, "derived": {}, "compare": {}}

    def save():
        result["derived"] = derive(result["ways"])
        result["compare"] = compare_drafts(result["ways"])
        slim = {**result, "ways": {n: {k: v for k, v in w.items() if k not in ("drafts", "outputs")}
                                   for n, w in result["ways"].items()}}
        (out / "e2e_step.json").write_text(json.dumps(slim, indent=1))
        (out / "e2e_step.md").write_text(table(result))

    served = [w for w in args.ways if w in ("remote", "unbound")]
    server = start_server(args, setup, model_dir) if served else None  # it loads while the target is built
    try:
        runner = build_runner(args, setup, head_cfg)
        spec = TargetEngine(TargetConfig("", aux_layer_ids=runner.cfg.aux_layer_ids, num_speculative_tokens=setup.k,
                                         max_model_len=setup.max_model_len, max_num_seqs=setup.batch,
                                         max_num_batched_tokens=setup.max_tokens, block_size=BLOCK_SIZE,
                                         num_blocks=setup.num_blocks, dtype=setup.dtype),
                            runner=runner).session_spec("e2e-step")
        port = None
        if server is not None:
            ready = wait_ready(server)
            port = int(ready["zmq_port"])
        lanes, closers = [], []
        fresh = [runner]  # the first lane runs on the runner built above; every other one on its own
        for way in args.ways:
            try:
                if way == "plain_eager" and not isinstance(runner, GraphedRunner):
                    continue  # the target is eager in every way already
                proposer = make_proposer(way, spec, model_dir, port, args, device, closers)
                lane_runner = fresh.pop() if fresh and way != "plain_eager" else lane_runner_for(way, runner)
                lanes.append(prepare(way, lane_runner, proposer, setup))
            except Exception as exc:  # noqa: BLE001 - one way failing keeps the others' figures
                result["ways"][way] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{way}: FAILED {type(exc).__name__}: {exc}", flush=True)
        interleave(lanes, setup, device)
        for lane in lanes:
            r = result["ways"][lane.name] = lane_result(lane, setup)
            inner = getattr(lane.engine.proposer, "inner", None)
            if "error" not in r and hasattr(inner, "stats"):
                r["proposer"] = proposer_report(inner)
            head = getattr(lane.engine.proposer, "head", None)
            if "error" not in r and head is not None:
                r["gemm_plan"] = gemm_plan(head)
            print(f"{lane.name}: " + (r["error"] if "error" in r else
                                      f"step p50 {r['step']['p50_us']:.0f} us p99 {r['step']['p99_us']:.0f} us, "
                                      f"{r['tokens_per_step']:.2f} tokens/step {r.get('proposer', '')}"), flush=True)
        if device.type == "cuda":
            result["meta"]["target_forward_gpu_us"] = {k: v for lane in lanes for k, v in
                                                       forward_gpu_us(lane.runner).items()}
        for close in closers:
            close()
    finally:
        if server is not None:
            stop_child(server)
        save()
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
