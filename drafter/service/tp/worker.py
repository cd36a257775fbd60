"""A tensor-parallel worker rank (1 .. N-1) of `drafter serve --tensor-parallel-size N`.

Spawned by the leader (drafter.service.tp.leader).  It joins the process group, loads its shard
of the head into its own DraftEngine (its own GPU, or the host), tells the leader it is ready,
captures its CUDA graphs (a GPU rank; the leader captures its own at the same time: the graphs
hold collectives), then runs whatever steps the leader sends, in order, until told to stop.  It never talks to a
client.  Anything unexpected (a failed step, the leader gone) ends the process: the leader sees
the exit and takes the server out of service, since ranks that disagree must not keep drafting.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import traceback
from dataclasses import dataclass

import torch

from drafter.engine.config import EngineConfig
from drafter.service.tp.channel import DRAFT, STOP, ZERO_BLOCKS, WorkerChannel
from drafter.service.tp.steps import draft_inputs


@dataclass(frozen=True)
class RankPlan:
    """Everything a rank needs to start (picklable: it crosses the spawn)."""

    rank: int
    world: int
    store_host: str
    store_port: int
    backend: str  # nccl | gloo
    timeout_s: float  # collective timeout: bounds a step that a dead or stuck rank never finishes
    model: str
    target_model: str | None
    engine: EngineConfig  # this rank's (its own device)
    torch_threads: int


def loopback_store(world: int, timeout_s: float):
    """(the process group's TCPStore served on 127.0.0.1 only, its listening socket: keep it open).
    TCPStore binds every interface when it opens its own socket; this one is bound first and handed over."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    store = torch.distributed.TCPStore("127.0.0.1", sock.getsockname()[1], world, True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    return store, sock


def loopback_collectives() -> None:
    """gloo's and NCCL's own sockets on the loopback interface (one host; a setting already made wins)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def join_group(rank: int, world: int, host: str, port: int, backend: str, timeout_s: float, device: str,
               store=None) -> None:
    """Join the process group through the TCPStore at host:port (the leader's, on loopback); the
    leader passes its own store.  On CUDA the rank's device becomes the current one first (NCCL)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = torch.distributed.TCPStore(host, port, world, False, timeout=timeout)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def init_group(plan: RankPlan, store=None) -> None:
    join_group(plan.rank, plan.world, plan.store_host, plan.store_port, plan.backend, plan.timeout_s,
               plan.engine.device, store)


def load_rank_engine(plan: RankPlan):
    from drafter.engine.engine import DraftEngine
    from drafter.models.sharding import Shard

    return DraftEngine.from_dirs(plan.model, plan.target_model, plan.engine, shard=Shard(plan.rank, plan.world))


def run_step(engine, header, tensors) -> None:
    """One step the leader sent: a draft (drafts are the leader's; this rank's are dropped) or a block wipe."""
    if header.op == DRAFT:
        opts = header.options
        inp = draft_inputs(opts, tensors)
        engine.draft(inp, return_probs=opts.return_probs, return_logits=opts.return_logits,
                     batch_padded=opts.batch_padded, tokens_padded=opts.tokens_padded, validate=False)
    elif header.op == ZERO_BLOCKS:
        engine.kv.zero_blocks(header.options.group, tensors[0])
    else:
        raise ValueError(f"unknown tensor-parallel step {header.op!r}")


def main(plan: RankPlan, pipe) -> None:
    """The worker process: join, load, report, serve steps.  Exit code 0 only on an orderly STOP."""
    loopback_collectives()
    # the leader alone reacts to Ctrl-C (it drains, then its exit closes this rank's pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if plan.torch_threads > 0:
        torch.set_num_threads(plan.torch_threads)
    try:
        init_group(plan)
        engine = load_rank_engine(plan)
    except BaseException as exc:  # noqa: BLE001 - reported to the leader, which names it in its failure
        _report(pipe, ("failed", f"rank {plan.rank}: {type(exc).__name__}: {exc}"))
        sys.exit(1)
    pipe.send(("ready", plan.rank))
    channel = WorkerChannel(pipe, engine.device)
    try:
        with torch.inference_mode():
            if engine.graphs is not None:  # with the leader's, once all ranks loaded (collectives inside)
                engine.graphs.capture()
            while True:
                header, tensors = channel.receive()
                if header.op == STOP:
                    break
                run_step(engine, header, tensors)
    except EOFError:
        sys.exit(3)  # the leader is gone
    except BaseException:  # noqa: BLE001 - out of step with the others: this rank must not go on
        traceback.print_exc()
        sys.exit(4)
    leave_group(engine.device)


def leave_group(device: torch.device, code: int = 0) -> None:
    """End a rank after its last collective, with exit code `code` on a GPU.  On the host (gloo):
    destroy the process group and return.  On a GPU the process exits here, at once (os._exit),
    without destroy_process_group: with CUDA graphs alive that captured NCCL collectives it never
    returned (2 H100s, torch 2.11: every rank stuck in it, after all its work was done); the OS
    frees an exited process's communicator, GPU memory and sockets.  Whatever the rank owes anyone
    (pipe messages, files) must be sent or written before: nothing after this runs."""
    if device.type != "cuda":
        torch.distributed.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(pipe, message) -> None:
    try:
        pipe.send(message)
    except (OSError, ValueError):
        pass
