"""Run the reference target as TP x DP processes (torch.distributed, gloo on 127.0.0.1).

    result = run_fleet(FleetConfig(target=TargetConfig(...), tp=2, dp=2, endpoints=(...)),
                       requests_by_dp=[[...], [...]], out_dir=tmp)

Global rank r is DP rank r // tp, TP rank r % tp.  TP groups are the ranks of one DP rank; DP
groups are the ranks with the same TP rank across DP ranks (vLLM's layout).  The tiny target is
replicated on every TP rank rather than sharded: its hidden states are then identical on all TP
ranks, exactly what they are after a real TP layer's all-reduce, and the coordination (one
sender, broadcast of drafts, mirrored frontiers, DP agreement) is what this fleet exercises.

TP rank 0 of every DP rank holds a RemoteProposer whose session key is "<name>/dp<rank>"; the
key's endpoint comes from rendezvous hashing over the static list or DNS (routing.py).  Every
rank writes its records to out_dir/rank<r>.pt; run_fleet gathers them into a FleetResult.
Workers start from a forkserver that has torch imported already, so a fleet starts in about a
second instead of paying torch's import on every rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from coordinator.client_auth import ClientAuth
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import DnsEndpoints, Endpoint, Router, StaticEndpoints, session_key
from coordinator.target.engine import CallRecord, EngineStats, StepRecord, TargetConfig, TargetEngine
from coordinator.target.request import RequestSpec


class FleetError(RuntimeError):
    pass


@dataclass(frozen=True)
class FleetConfig:
    target: TargetConfig
    tp: int = 2
    dp: int = 2
    name: str = "target"  # session keys are "<name>/dp<rank>"
    endpoints: tuple[str, ...] = ()  # "grpc://127.0.0.1:50051", "zmq://...", "inprocess://local:0"
    dns: tuple[str, int, str] | None = None  # (name, port, scheme): a headless Service instead of a list
    head_dir: str | None = None  # what an "inprocess" endpoint loads
    proposer: ProposerConfig = ProposerConfig()
    auth: ClientAuth = ClientAuth()  # the drafters' auth: CURVE keys for zmq endpoints, TLS files for grpc ones
    threads: int = 1  # torch threads per rank: tiny matmuls, and several ranks share few cores
    timeout_s: float = 300.0
    gate_steps: tuple[int, ...] = ()  # steps before which every rank waits for the harness (tests)

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1:
            raise ValueError("tp and dp must be >= 1")
        if self.target.num_speculative_tokens and not (self.endpoints or self.dns):
            raise ValueError("speculation needs drafter endpoints (a list, or DNS)")


@dataclass
class RankResult:
    rank: int
    dp: int
    tp: int
    outputs: dict[int, list[int]]
    steps: list[StepRecord]
    stats: EngineStats
    calls: list[CallRecord] = field(default_factory=list)
    events: list = field(default_factory=list)  # RemoteProposer events (TP rank 0)
    proposer_stats: object = None
    endpoint: str | None = None  # where the session ended up
    generation: int | None = None


@dataclass
class FleetResult:
    ranks: list[RankResult]

    def rank(self, dp: int, tp: int = 0) -> RankResult:
        return next(r for r in self.ranks if r.dp == dp and r.tp == tp)

    @property
    def outputs(self) -> dict[int, list[int]]:
        out = {}
        for r in self.ranks:
            if r.tp == 0:
                out.update(r.outputs)
        return dict(sorted(out.items()))

    def check_tp_consistency(self) -> None:
        """Every TP rank of a DP rank must have generated the same tokens."""
        for r in self.ranks:
            lead = self.rank(r.dp, 0)
            if r.outputs != lead.outputs:
                raise FleetError(f"dp{r.dp}: tp rank {r.tp} generated other tokens than tp rank 0")

    @property
    def leaders(self) -> list[RankResult]:
        return sorted((r for r in self.ranks if r.tp == 0), key=lambda r: r.dp)


# --------------------------------------------------------------------------- worker side
def make_connect(head_dir: str | None, target: TargetConfig,
                 auth: ClientAuth = ClientAuth()) -> Callable[[Endpoint], object]:
    """Endpoint -> transport.  'inprocess' endpoints get an engine in this process; zmq and grpc
    ones a ServiceTransport with auth's setting for that scheme."""
    cache = {}

    def connect(ep: Endpoint):
        if ep.scheme == "inprocess":
            if ep not in cache:
                from coordinator.inprocess import InProcessTransport

                if head_dir is None:
                    raise FleetError("an inprocess endpoint needs FleetConfig.head_dir")
                cache[ep] = InProcessTransport(head_dir, target.target_dir, target.method)
            return cache[ep]
        if ep.scheme in ("grpc", "zmq"):
            from coordinator.clients import ServiceTransport

            return ServiceTransport(ep, **auth.for_scheme(ep.scheme))
        raise FleetError(f"no transport for {ep}")

    return connect


def _endpoint_source(cfg: FleetConfig):
    if cfg.dns is not None:
        name, port, scheme = cfg.dns
        return DnsEndpoints(name, port, scheme)
    return StaticEndpoints(cfg.endpoints)


def _worker(rank: int, cfg: FleetConfig, requests_by_dp, out_dir: str, init: str, gates) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo's own sockets on loopback
    torch.set_num_threads(cfg.threads)
    path = Path(out_dir)
    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=cfg.tp * cfg.dp,
                                             timeout=datetime.timedelta(seconds=cfg.timeout_s))
        dp_rank, tp_rank = divmod(rank, cfg.tp)
        # every rank creates every group, in the same order (torch.distributed requires it)
        tp_groups = [torch.distributed.new_group([d * cfg.tp + t for t in range(cfg.tp)]) for d in range(cfg.dp)]
        dp_groups = [torch.distributed.new_group([d * cfg.tp + t for d in range(cfg.dp)]) for t in range(cfg.tp)]
        from coordinator.dp_agreement import DPAgreement
        from coordinator.tp import TPFanout

        t = cfg.target
        agreement = DPAgreement(t.capture_sizes, t.token_capture_sizes,
                                group=dp_groups[tp_rank] if cfg.dp > 1 else None)
        fanout = TPFanout(max(1, t.num_speculative_tokens), group=tp_groups[dp_rank] if cfg.tp > 1 else None,
                          src=dp_rank * cfg.tp, is_src=tp_rank == 0)
        engine = TargetEngine(t, agreement=agreement, fanout=fanout)
        proposer = None
        if tp_rank == 0 and t.num_speculative_tokens:
            key = session_key(cfg.name, dp_rank)
            proposer = RemoteProposer(engine.session_spec(client=key), router=Router(_endpoint_source(cfg)), key=key,
                                      connect=make_connect(cfg.head_dir, t, cfg.auth), config=cfg.proposer)
            proposer.start()
            engine.proposer = proposer
        for spec in requests_by_dp[dp_rank]:
            engine.add(spec)
        while True:
            if engine.agreement.step in cfg.gate_steps:
                reached, go = gates[engine.agreement.step]
                if rank == 0:
                    reached.set()
                go.wait()
            if not engine.step().padding.any_work:
                break
        result = RankResult(rank, dp_rank, tp_rank, {rid: r.output for rid, r in sorted(engine.finished.items())},
                            engine.steps, engine.stats, engine.calls)
        if proposer is not None:
            result.events, result.proposer_stats = list(proposer.events), proposer.stats
            result.endpoint, result.generation = str(proposer.endpoint), proposer.generation
            proposer.close()
        torch.save(result, path / f"rank{rank}.pt")
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        (path / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


# --------------------------------------------------------------------------- parent side
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    ctx = mp.get_context("forkserver")
    # imported once in the fork server, inherited by every worker
    ctx.set_forkserver_preload(["torch", "coordinator.target.engine", "coordinator.remote_proposer"])
    return ctx


def make_gates(cfg: FleetConfig) -> dict[int, tuple]:
    """One (reached, go) event pair per gate step; the harness waits on reached, sets go."""
    ctx = _context()
    return {s: (ctx.Event(), ctx.Event()) for s in cfg.gate_steps}


def start_fleet(cfg: FleetConfig, requests_by_dp: list[list[RequestSpec]], out_dir: str | Path, gates=None):
    if len(requests_by_dp) != cfg.dp:
        raise ValueError(f"requests_by_dp has {len(requests_by_dp)} lists for dp={cfg.dp}")
    if cfg.gate_steps and gates is None:
        raise ValueError("gate_steps need gates (make_gates)")
    ctx = _context()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_worker, args=(r, cfg, requests_by_dp, str(out_dir), init, gates),
                         name=f"target-rank{r}", daemon=True)
             for r in range(cfg.tp * cfg.dp)]
    for p in procs:
        p.start()
    return procs


def join_fleet(procs, out_dir: str | Path, timeout_s: float) -> FleetResult:
    out = Path(out_dir)
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    # a rank that dies leaves its peers blocked in a collective: stop them all at once
    while pending and time.monotonic() < deadline:
        mp.connection.wait([p.sentinel for p in pending], timeout=max(0.0, deadline - time.monotonic()))
        pending = [p for p in pending if p.exitcode is None]
        if any(p.exitcode for p in procs):
            break
    timed_out = bool(pending) and not any(p.exitcode for p in procs if p not in pending)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    errors = sorted(out.glob("rank*.err"))
    if errors or any(p.exitcode for p in procs):
        detail = "\n".join(e.read_text() for e in errors)
        why = f"timed out after {timeout_s} s" if timed_out else "a rank failed"
        raise FleetError(f"fleet failed ({why}; exit codes {[p.exitcode for p in procs]})\n{detail}")
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(len(procs))]
    result = FleetResult(ranks)
    result.check_tp_consistency()
    return result


def run_fleet(cfg: FleetConfig, requests_by_dp: list[list[RequestSpec]], out_dir: str | Path) -> FleetResult:
    return join_fleet(start_fleet(cfg, requests_by_dp, out_dir), out_dir, cfg.timeout_s)
