"""Rank 0 of `drafter serve --tensor-parallel-size N`: spawns the workers and stands in for the engine.

load_tp_engine() (run in the service's engine thread, where the engine always loads) starts N-1
worker processes (drafter.service.tp.worker), hosts the process group's TCPStore on loopback,
loads rank 0's shard and waits until every worker has loaded its own; on GPUs all ranks then
capture their CUDA graphs together (collectives inside).  It returns a TPEngine:
what the service calls `engine` (same config, spec, limits and device as a DraftEngine).  Its
draft() validates the call here (a refused call never reaches a worker), chooses the padded
sizes, sends the step to every worker, then runs the same step itself: the drafts are rank 0's.
A released session's block wipe is sent the same way, so every rank's KV pool holds the same
blocks for the same sessions (the block ids are the leader's decisions, carried in each step).

A worker that exits for any reason is seen at once by a watch thread waiting on the workers'
process sentinels; it calls on_failure (the server turns health NOT_SERVING and refuses calls).
A step in progress when a rank dies ends with an error on the leader (gloo: the peer's socket
closes; NCCL: the collective timeout), so clients fail closed instead of waiting.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading
from dataclasses import replace

import torch

from drafter.engine.config import EngineConfig
from drafter.engine.engine import drop_rejected_tokens
from drafter.engine.inputs import as_group_list
from drafter.engine.inputs import validate as check_inputs
from drafter.service.logs import event
from drafter.service.tp.channel import DRAFT, ZERO_BLOCKS, LeaderChannel
from drafter.service.tp.steps import BlockWipe, DraftOptions, draft_tensors
from drafter.service.tp.worker import (RankPlan, init_group, load_rank_engine, loopback_collectives,
                                       loopback_store, main as worker_main)
from drafter.wire.records import DraftOutput, ProposeInputs

log = logging.getLogger("drafter.service.tp")


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th GPU from the given one (cuda:i -> cuda:i+r), or the host."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


class TPEngine:
    """The leader's engine: a DraftEngine for rank 0 whose every state-changing call is first sent
    to the workers.  Only what the service uses is offered; the bound (persistent-buffer) path is a
    single-process feature.  `graphs` is rank 0's GraphRunner (GPU ranks: every rank replays the
    same padded graph each step, its collectives inside), captured by load_tp_engine."""

    def __init__(self, engine, channel: LeaderChannel, procs: list, world: int):
        self.engine = engine
        self.channel = channel
        self.procs = procs
        self.world = world
        self.config, self.spec, self.head = engine.config, engine.spec, engine.head
        self.device, self.limits = engine.device, engine.limits
        self.kv = _SharedKV(engine.kv, channel)
        self.store = None
        self.graphs = engine.graphs
        self.failed: str | None = None
        self.rendezvous = None  # (TCPStore, its listening socket) of the process group
        self._watch: threading.Thread | None = None

    # ------------------------------------------------------------------ steps
    def draft(self, inp: ProposeInputs, *, return_probs: bool = False, return_logits: bool = False,
              batch_padded: int | None = None, tokens_padded: int | None = None, validate: bool = True
              ) -> DraftOutput:
        """DraftEngine.draft on every rank; the drafts are rank 0's."""
        if self.failed is not None:
            raise RuntimeError(f"tensor-parallel rank lost: {self.failed}")
        groups = len(self.config.kv_groups)
        if validate:
            as_group_list("block_tables", inp.block_tables, groups)
            as_group_list("slot_mappings", inp.slot_mappings, groups)
            check_inputs(inp, self.limits)
        if inp.num_rejected_tokens is not None and not self.config.padded_drafter_batch:
            inp = drop_rejected_tokens(inp)  # first, as DraftEngine.draft does: the padding counts what is left
        b_pad, t_pad = self.engine.padded_sizes(inp.batch_size, inp.num_tokens, batch_padded, tokens_padded)
        opts = DraftOptions(groups, return_probs, return_logits, b_pad, t_pad)
        self.channel.send(DRAFT, opts, draft_tensors(inp))
        return self.engine.draft(inp, return_probs=return_probs, return_logits=return_logits, batch_padded=b_pad,
                                 tokens_padded=t_pad, validate=False)

    def propose(self, *, block_tables, slot_mappings, return_probs: bool = False, return_logits: bool = False,
                batch_padded: int | None = None, tokens_padded: int | None = None, validate: bool = True,
                **tensors) -> DraftOutput:
        """DraftEngine.propose's keyword front door, over draft()."""
        groups = len(self.config.kv_groups)
        inp = ProposeInputs(block_tables=as_group_list("block_tables", block_tables, groups),
                            slot_mappings=as_group_list("slot_mappings", slot_mappings, groups), **tensors)
        return self.draft(inp, return_probs=return_probs, return_logits=return_logits, batch_padded=batch_padded,
                          tokens_padded=tokens_padded, validate=validate)

    @property
    def graph_replays(self) -> int:
        return self.engine.graph_replays

    def padded_sizes(self, *args, **kwargs):
        return self.engine.padded_sizes(*args, **kwargs)

    def bind(self, **_):
        from drafter.wire.errors import InvalidInput

        raise InvalidInput("tensor_parallel_size", "bound sessions need a single-process drafter "
                                                   "(--tensor-parallel-size 1)")

    def kv_snapshot(self) -> list[torch.Tensor]:
        return self.engine.kv_snapshot()

    # ------------------------------------------------------------------ ranks
    def watch(self, on_failure) -> None:
        """Call on_failure(why) once, from a watch thread, when any worker process exits."""
        def wait() -> None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, start=1)}
            ended = multiprocessing.connection.wait(list(sentinels))
            rank = sentinels[ended[0]]
            self.procs[rank - 1].join(0)
            self.failed = f"rank {rank} exited with code {self.procs[rank - 1].exitcode}"
            log.error("tensor-parallel rank exited", extra={"event": "rank_failed", "rank": rank,
                                                            "exitcode": self.procs[rank - 1].exitcode})
            on_failure(self.failed)
        self._watch = threading.Thread(target=wait, name="tp-watch", daemon=True)
        self._watch.start()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        """Ask the workers to exit (they also exit on their own when this process ends)."""
        self.channel.stop()


class _SharedKV:
    """The leader's KV pool: a block wipe runs on every rank."""

    def __init__(self, kv, channel: LeaderChannel):
        self.kv = kv
        self.channel = channel

    def zero_blocks(self, group: int, block_ids: torch.Tensor) -> None:  # [n] int
        ids = block_ids.to(torch.int64)
        self.channel.send(ZERO_BLOCKS, BlockWipe(group), [ids])
        self.kv.zero_blocks(group, ids)

    def __getattr__(self, name):
        return getattr(self.kv, name)


def _plans(world: int, device: str, engine_cfg: EngineConfig, model: str, target: str | None, port: int,
           timeout_s: float, torch_threads: int) -> list[RankPlan]:
    backend = "nccl" if device.startswith("cuda") else "gloo"
    return [RankPlan(rank, world, "127.0.0.1", port, backend, timeout_s, model, target,
                     replace(engine_cfg, device=rank_device(device, rank)), torch_threads)
            for rank in range(world)]


def _await_workers(pipes: list, procs: list, timeout_s: float) -> None:
    """Every worker's ready message; a worker that failed or died first is the load's error."""
    waiting = {p.sentinel: rank for rank, p in enumerate(procs, start=1)}
    waiting.update({pipe: rank for rank, pipe in enumerate(pipes, start=1)})
    ready: set[int] = set()
    while len(ready) < len(procs):
        hits = multiprocessing.connection.wait(list(waiting), timeout_s)
        if not hits:
            raise RuntimeError(f"tensor-parallel workers not ready within {timeout_s} s")
        for hit in hits:
            rank = waiting[hit]
            if hit is pipes[rank - 1]:
                try:
                    message = hit.recv()
                except EOFError:
                    message = ("failed", f"rank {rank} exited while loading")
                if message[0] != "ready":
                    raise RuntimeError(f"tensor-parallel {message[1]}")
                ready.add(rank)
                del waiting[hit]
            elif rank not in ready:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while loading (code {procs[rank - 1].exitcode})")


def load_tp_engine(world: int, model: str, target: str | None, engine_cfg: EngineConfig, *,
                   timeout_s: float = 120.0, torch_threads: int = 0) -> TPEngine:
    """Spawn ranks 1 .. world-1, load rank 0 here, wait for all; the leader's TPEngine."""
    loopback_collectives()
    store, listening = loopback_store(world, timeout_s)  # the workers connect while the leader loads
    plans = _plans(world, engine_cfg.device, engine_cfg, model, target, store.port, timeout_s, torch_threads)
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for plan in plans[1:]:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(plan, theirs), name=f"drafter-tp-{plan.rank}", daemon=True)
        proc.start()
        theirs.close()
        pipes.append(mine)
        procs.append(proc)
    try:
        init_group(plans[0], store)
        engine = load_rank_engine(plans[0])
        _await_workers(pipes, procs, timeout_s)
        if engine.graphs is not None:  # the workers capture theirs now too (drafter.service.tp.worker)
            engine.graphs.capture()
    except BaseException:
        for p in procs:
            p.kill()
        raise
    event("ranks", world=world, backend=plans[0].backend, worker_pids=[p.pid for p in procs])
    tp = TPEngine(engine, LeaderChannel(pipes, engine.device), procs, world)
    tp.rendezvous = (store, listening)  # served while the group lives
    return tp
