"""Bound sessions (drafter.service.bound_sessions; the clients coordinator.transport.bound_client
and the RemoteProposer's coordinator.transport.bound_transport).

A drafter (ServiceCore + ZmqServer, in this process, its own event loop thread, on a real port)
serves an engine with graphs (emulated on CPU, the Triton kernels under the interpreter); a
target's persistent buffers are views into the client's slab; each step ships the slab's prefix
and gets drafts.  They must equal what an in-process engine drafts from the same calls over every
CPU plane (host ring over tcp and ipc, gloo channel) and through the RemoteProposer, for EAGLE-1,
EAGLE-3 and MTP; corrupt steps must be refused naming the field without touching any KV; a
drafter restart must be bound again by the clients themselves.

Cost: an emulated replay takes seconds under the interpreter, whatever its size, so one drafter
per method serves the whole module (graphs captured once, at the one size pair every step is
padded to), and the four sessions of a method (three planes, one RemoteProposer) are made and
prefilled once (Sessions) and shared by the tests, the restart test last.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from coordinator.clients import ServiceTransport  # noqa: E402
from coordinator.remote_proposer import ProposerConfig, RemoteProposer  # noqa: E402
from coordinator.routing import Endpoint, Router, StaticEndpoints  # noqa: E402
from coordinator.session import SessionSpec  # noqa: E402
from coordinator.transport.bound_client import HostRingClient  # noqa: E402
from coordinator.transport.bound_transport import BoundConfig  # noqa: E402
from drafter.engine.config import KVGroupSpec  # noqa: E402
from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.service.core import ServiceCore  # noqa: E402
from drafter.service.metrics import Metrics  # noqa: E402
from drafter.service.zmq_server import ZmqServer  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402
from drafter.wire.tensors import DTYPE_NAMES  # noqa: E402
from tests.support.engines import build_engine  # noqa: E402
from tests.support.scenario import Scenario  # noqa: E402
from tests.support.servers import layout_for  # noqa: E402

K, MAX_MODEL_LEN, MAX_TOKENS, MAX_BATCH = 3, 48, 32, 4
TOKENS_PADDED = 16  # every step is padded to (16 tokens, batch 4): the only graphs captured
SESSION_BLOCKS = 16  # five sessions of 16 blocks in a pool of 80: the second starts at block 16
SESSIONS = 5
_GRAPH_ENGINES: dict = {}  # method -> the drafter's engine, its graphs captured once per module


def _engine(root, method, *, reference=False):
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS,
              num_blocks=SESSIONS * SESSION_BLOCKS)
    if reference:
        return build_engine(root, method, **kw)
    if method not in _GRAPH_ENGINES:
        # torch's GEMMs: the skinny kernel under the Triton interpreter cost most of this file's time on CPU,
        # and tests/unit/test_step_kernels.py checks it on its own
        engine = build_engine(root, method, attention_backend="triton", device="cpu", skinny_gemm="off", **kw)
        # the sizes these steps use only (an emulated capture runs every graph once: seconds each
        # under the interpreter), captured before the drafter serves, as a server does at load
        engine.graphs = GraphRunner(engine, emulate=True, combined=False)
        engine.graphs.token_sizes, engine.graphs.batch_sizes = [TOKENS_PADDED], [MAX_BATCH]  # what steps agree on
        engine.graphs.capture()
        _GRAPH_ENGINES[method] = engine
    return _GRAPH_ENGINES[method]


class Drafter:
    """A drafter service in a thread of this process (its own event loop), on 127.0.0.1."""

    def __init__(self, engine, port: int = 0, ipc_path: str | None = None):
        self.engine, self.port, self.ipc_path = engine, port, ipc_path
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        core = ServiceCore(metrics=Metrics(), max_sessions=SESSIONS, batch_window_s=0.0, max_message_bytes=1 << 24)
        core.set_engine(self.engine)
        self.core = core
        self.server = self._server(core)
        self.port = self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.close()
        await core.close()

    def _server(self, core) -> ZmqServer:
        """The ZMQ server the drafter serves (a subclass may add auth)."""
        return ZmqServer(core, host="127.0.0.1", port=self.port, max_message_bytes=1 << 24, ipc_path=self.ipc_path)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(60), "the drafter did not start"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


def _buffers(engine) -> list[wb.BufferSpec]:
    """What a target keeps persistent: full-size buffers (int64 tokens, int32 tables)."""
    width, blocks = engine.spec.hidden_input_width, engine.config.max_blocks_per_req
    hidden = DTYPE_NAMES[torch.float32]
    specs = [wb.BufferSpec("target_token_ids", "int64", [MAX_TOKENS]),
             wb.BufferSpec("target_positions", "int64", [MAX_TOKENS]),
             wb.BufferSpec("target_hidden_states", hidden, [MAX_TOKENS, width]),
             wb.BufferSpec("next_token_ids", "int64", [MAX_BATCH]),
             wb.BufferSpec("query_start_loc", "int32", [MAX_BATCH + 1]),
             wb.BufferSpec("seq_lens", "int32", [MAX_BATCH]),
             wb.BufferSpec("num_rejected_tokens", "int32", [MAX_BATCH]),
             wb.BufferSpec("token_indices_to_sample", "int32", [MAX_BATCH])]
    for g, n in enumerate(blocks):
        specs += [wb.BufferSpec(f"block_tables[{g}]", "int32", [MAX_BATCH, n]),
                  wb.BufferSpec(f"slot_mappings[{g}]", "int64", [MAX_TOKENS])]
    return specs


def _fill(views: dict, call: dict) -> tuple[int, int]:
    """The target's step: a call's rows written into its persistent buffers; (num_tokens, batch)."""
    call = dict(call)
    b = call["next_token_ids"].shape[0]
    call.setdefault("num_rejected_tokens", torch.zeros(b, dtype=torch.int32))
    call.setdefault("token_indices_to_sample", call["query_start_loc"][1:] - 1 - call["num_rejected_tokens"])
    for name, value in call.items():
        pairs = ([(views[f"{name}[{g}]"], v) for g, v in enumerate(value)] if isinstance(value, list)
                 else [(views[name], value)])
        for dst, src in pairs:
            rows = tuple(slice(0, min(a, c)) for a, c in zip(src.shape, dst.shape))
            dst[rows].copy_(src[rows])
    return call["target_token_ids"].shape[0], b


def _scenario(engine, seed):
    return Scenario(block_sizes=engine.limits.block_sizes, num_blocks=[SESSION_BLOCKS] * len(engine.limits.block_sizes),
                    vocab_size=engine.spec.vocab_size, hidden_width=engine.spec.hidden_input_width, k=K,
                    max_model_len=MAX_MODEL_LEN, seed=seed, draft_span=engine.limits.draft_span)


PLANS = [[(0, 6, 0), (1, 7, 0)], [(0, K + 1, 1), (1, K + 1, 0), (2, 5, 0)]]  # 13 tokens each
PADDING = dict(batch_padded=MAX_BATCH, tokens_padded=TOKENS_PADDED)
# a ProposerTarget's step budget: the steps here must be served (a step past it comes back None and fails the
# test), and speed is no subject: a session's first bound step takes seconds on an idle 2-core box, and
# test_bound_auth's first proposer step once missed 20 s under load
DEADLINE_S = 120.0



class Target:
    """A target with its own bound session (HostRingClient) and an in-process reference engine fed the same calls."""

    def __init__(self, root, method, drafter: Drafter, seed: int, transport: str = "tcp", plane: str = wb.HOST_RING):
        self.root, self.method = root, method
        self.client = HostRingClient(drafter.endpoint, self._layout(drafter), _buffers(drafter.engine),
                                     max_batch=MAX_BATCH, transport=transport, plane=plane, timeout_s=60)
        self.reset(seed)

    @staticmethod
    def _layout(drafter):
        info = drafter.core.info()
        return layout_for(info, SESSION_BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)

    def reset(self, seed: int) -> None:
        """A fresh reference engine and history (a restarted drafter's KV is empty: the target prefills again)."""
        self.ref = _engine(self.root, self.method, reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)

    def step(self, plan, remote_call: dict | None = None) -> None:
        """One step through the bound client against the reference; remote_call: the target's
        call for this plan when the test took it from the scenario already."""
        expected = self.ref.propose(**self.s_ref.call(plan).kwargs).draft_token_ids
        n, b = _fill(self.client.views, remote_call or self.s_remote.call(plan).kwargs)
        got = self.client.step(n, b, **PADDING)
        assert torch.equal(got, expected), plan

    def close(self) -> None:
        try:  # the drafter's pool holds five sessions: give the blocks back
            self.client.detach()
        except DrafterError:
            pass  # the drafter restarted under it: the session is gone already
        self.client.close()


def _proposer(drafter: Drafter, deadline_s: float, **bound) -> RemoteProposer:
    """The coordinator's client as a target uses it over ZMQ: bound wherever the drafter can."""
    info = drafter.core.info()
    spec = SessionSpec(method=info.method, num_speculative_tokens=K, hidden_size=info.hidden_size,
                       num_aux_layers=info.num_aux_layers, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH,
                       max_num_batched_tokens=MAX_TOKENS,
                       kv_groups=tuple(KVGroupSpec(g.block_size, SESSION_BLOCKS) for g in info.limits.kv_groups))
    return RemoteProposer(spec, router=Router(StaticEndpoints([Endpoint("zmq", "127.0.0.1", drafter.port)])),
                          key="target/dp0", connect=lambda ep: ServiceTransport(ep, timeout_s=deadline_s),
                          config=ProposerConfig(deadline_s=deadline_s, bound=BoundConfig(**bound)))


class ProposerTarget:
    """A target driving a RemoteProposer, checked step by step against an in-process engine."""

    def __init__(self, root, method, drafter: Drafter, seed: int, deadline_s: float = DEADLINE_S, **bound):
        self.root, self.method = root, method
        self.proposer = _proposer(drafter, deadline_s, **bound)
        self.reset(seed)

    def reset(self, seed: int) -> None:
        """A fresh reference and history: what a target does when its drafter session changed."""
        self.ref = _engine(self.root, self.method, reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)

    def step(self, plan, **options):
        """The proposer's drafts for the plan (None: no drafts this step), never other than the reference's."""
        expected = self.ref.propose(**self.s_ref.call(plan, **options).kwargs).draft_token_ids
        got = self.proposer.propose(**self.s_remote.call(plan, **options).kwargs, **PADDING)
        assert got is None or torch.equal(got, expected), (plan, got, expected)
        return got

    @property
    def transport(self):
        return self.proposer.transports[self.proposer.endpoint]

    def close(self) -> None:
        self.proposer.close(timeout=5.0)


class Sessions:
    """One method's drafter and four sessions on it, each having drafted PLANS[0]: a, b, c the
    HostRingClient over the host ring on tcp, on ipc, and over the gloo channel; p the RemoteProposer
    (bound at attach, over ipc: the drafter is on loopback and listens on ipc)."""

    def __init__(self, root, method: str, drafter: Drafter):
        self.drafter = drafter
        self.a = Target(root, method, drafter, seed=1, transport="tcp")
        self.b = Target(root, method, drafter, seed=2, transport="ipc")
        self.c = Target(root, method, drafter, seed=3, transport="tcp", plane=wb.GLOO_CHANNEL)
        self.p = ProposerTarget(root, method, drafter, seed=4)
        assert self.p.proposer.start(), "attached"
        replays = drafter.engine.graphs.replays
        for t in (self.a, self.b, self.c):  # later sessions' blocks lie past the first's: moved in the ring
            t.step(PLANS[0])
        assert self.p.step(PLANS[0]) is not None
        assert drafter.engine.graphs.replays == replays + 4, "every step replayed the bound graphs"

    def close(self) -> None:
        for t in (self.a, self.b, self.c, self.p):
            t.close()


class Drafters:
    """One drafter per method for the whole module, each also listening on ipc, and its Sessions.
    restart() stops one and starts a new one (new epoch, no sessions) on the same port and ipc path,
    around the same engine."""

    def __init__(self, root, ipc_dir):
        self.root, self.ipc_dir = root, ipc_dir
        self.running: dict[str, Drafter] = {}
        self._sessions: dict[str, Sessions] = {}

    def get(self, method: str) -> Drafter:
        if method not in self.running:
            self.running[method] = Drafter(_engine(self.root, method), ipc_path=self._ipc(method)).__enter__()
        return self.running[method]

    def sessions(self, method: str) -> Sessions:
        if method not in self._sessions:
            self._sessions[method] = Sessions(self.root, method, self.get(method))
        return self._sessions[method]

    def restart(self, method: str) -> Drafter:
        """Kill the method's drafter and start a new one on its port; its Sessions are the caller's now."""
        old = self.running.pop(method)
        self._sessions.pop(method, None)
        old.__exit__(None, None, None)
        self.running[method] = Drafter(old.engine, port=old.port, ipc_path=self._ipc(method)).__enter__()
        return self.running[method]

    def _ipc(self, method: str) -> str:
        return f"ipc://{self.ipc_dir}/{method}.sock"

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()
        for d in self.running.values():
            d.__exit__(None, None, None)


@pytest.fixture(scope="module")
def drafters(tiny_root, tmp_path_factory):
    d = Drafters(tiny_root, tmp_path_factory.mktemp("bound-ipc"))
    yield d
    d.close()


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_bound_remote_drafts_equal_in_process(drafters, method, capsys):
    """Every CPU plane and the RemoteProposer's binding drafted PLANS[0] as the in-process engine
    did (Sessions checks each step); the RemoteProposer goes on to a decode step with rejected
    tokens, bound, on the KV its bound prefill wrote."""
    s = drafters.sessions(method)
    bound = s.drafter.server._bound_plane.sessions
    clients = [s.a.client, s.b.client, s.c.client]
    assert [c.binds for c in clients] == [1, 1, 1]
    assert [bound[c.session.session_id].endpoint.split("://")[0] for c in clients] == ["tcp", "ipc", "tcp"]
    assert [c.channel is not None for c in clients] == [False, False, True]
    transport = s.p.transport
    assert transport.link.resp.endpoint.startswith("ipc://"), "a drafter on loopback with an ipc socket: ipc"
    assert s.p.step(PLANS[1]) is not None
    assert transport.steps == {"bound": 2, "unbound": 0}
    assert s.p.proposer.stats.latencies.keys() == {"zmq-bound"}
    with capsys.disabled():
        print(f"\n[bound {method}] the RemoteProposer's copies into the ring per step (host, CPU, one copy "
              f"per tensor): " + ", ".join(f"{t * 1e6:.0f} us" for t in transport.fill_s))


def test_a_step_the_ring_cannot_hold_exactly_goes_unbound_on_the_bound_session(drafters):
    """Sampling (temperatures) is not a bound step's: it goes by the unbound Propose on the same
    session and KV, and the drafts are still the in-process engine's."""
    p = drafters.sessions("eagle3").p
    before = dict(p.transport.steps)
    assert p.step(PLANS[1], temperatures=[0.0, 0.0, 0.0]) is not None
    assert p.transport.steps == {"bound": before["bound"], "unbound": before["unbound"] + 1}
    assert p.transport.link.alive, "the binding stays for the next step"


def test_the_remote_proposer_over_the_gloo_channel(tiny_root, drafters):
    """BoundConfig(plane="gloo_channel"): the RemoteProposer joins the binding's gloo group at bind
    and ships the ring by a point-to-point send; its drafts are the in-process engine's."""
    g = ProposerTarget(tiny_root, "eagle3", drafters.sessions("eagle3").drafter, seed=8, plane=wb.GLOO_CHANNEL)
    try:
        assert g.proposer.start()
        assert g.transport.link.channel is not None
        assert g.step(PLANS[0]) is not None
        assert g.transport.steps == {"bound": 1, "unbound": 0}
    finally:
        g.close()


def _corrupt(views, field: str, n: int, b: int, engine) -> None:
    """One field of the step written out of the session's range."""
    if field == "block_tables[0]":
        views[field][b - 1, 0] = SESSION_BLOCKS  # the next session's first block
    elif field == "slot_mappings[0]":
        views[field][n - 1] = SESSION_BLOCKS * engine.limits.block_sizes[0]  # a slot of another session
    elif field == "target_hidden_states":
        views[field][n // 2, 1] = float("nan")
    elif field == "target_positions":
        views[field][n - 1] = MAX_MODEL_LEN
    else:
        raise AssertionError(field)


FIELDS = ("block_tables[0]", "slot_mappings[0]", "target_hidden_states", "target_positions")


def test_corrupt_steps_are_refused_naming_the_field_and_touch_no_kv(drafters):
    s = drafters.sessions("eagle3")
    engine = s.drafter.engine
    kv = [t.clone() for t in engine.kv_snapshot()]
    replays = engine.graphs.replays
    call = s.b.s_remote.call(PLANS[1]).kwargs
    for field in FIELDS:
        n, nb = _fill(s.b.client.views, call)
        _corrupt(s.b.client.views, field, n, nb, engine)
        with pytest.raises(DrafterError) as err:
            s.b.client.step(n, nb, **PADDING)
        assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)
        assert all(torch.equal(x, y) for x, y in zip(kv, engine.kv_snapshot())), f"{field} wrote KV"
    # the RemoteProposer's bound step: refused there, no drafts, its breaker untouched
    p, bound = s.p, s.p.transport.steps["bound"]
    s.p.s_ref.call(PLANS[1])  # the reference's history moves on as the target's does
    bad = p.s_remote.call(PLANS[1]).kwargs
    bad["block_tables"][0][-1, 0] = SESSION_BLOCKS
    assert p.proposer.propose(**bad, **PADDING) is None
    assert p.proposer.stats.no_drafts.get("invalid_argument") == 1
    assert p.transport.steps["bound"] == bound + 1, "the corrupt step went bound and was refused there"
    assert all(torch.equal(x, y) for x, y in zip(kv, engine.kv_snapshot())), "a refused step wrote KV"
    assert engine.graphs.replays == replays, "a refused step reached the engine"
    s.a.step(PLANS[1])  # a neighbour goes on as if nothing happened
    s.b.step(PLANS[1], call)  # and so does the session that sent the bad steps, with the step made whole
    assert s.b.client.binds == 1


def test_a_drafter_restart_is_bound_again_by_the_clients(drafters):
    """Kill the drafter mid-run and start a new one on the same port: the HostRingClient and the
    RemoteProposer bind again by themselves; no step returns drafts other than the in-process ones."""
    s = drafters.sessions("eagle3")
    a, p = s.a, s.p
    restarted = drafters.restart("eagle3")
    try:
        # HostRingClient: the step that finds the restart binds again, and drafts nothing
        a.reset(seed=5)  # the target prefills again
        n, b = _fill(a.client.views, a.s_remote.call(PLANS[0]).kwargs)
        with pytest.raises(DrafterError) as err:
            a.client.step(n, b, **PADDING)
        if err.value.code != Code.FAILED_PRECONDITION:  # lost on its way out (a race with the restart): fail closed
            assert err.value.code in (Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE), str(err.value)
            with pytest.raises(DrafterError) as err:
                a.client.step(n, b, **PADDING)
        assert err.value.code == Code.FAILED_PRECONDITION and err.value.field == "session", str(err.value)
        assert a.client.binds == 2, "the client bound the restarted drafter by itself"
        assert a.client.session.epoch == restarted.core.epoch
        a.reset(seed=6)
        a.step(PLANS[0])
        # RemoteProposer: no drafts until its session changed, then the target resends the context
        generation, misses = p.proposer.generation, 0
        while p.proposer.generation == generation:
            assert p.step(PLANS[1]) is None, "a step on the dead binding returned drafts"
            misses += 1
            assert misses <= 3, list(p.proposer.events)
        p.reset(seed=7)
        bound = p.transport.steps["bound"]
        assert p.step(PLANS[0]) is not None
        assert p.transport.steps["bound"] == bound + 1, "bound again after the restart"
        assert str(restarted.core.epoch) == p.proposer.session.epoch
    finally:
        for t in (s.a, s.b, s.c, s.p):
            t.close()
