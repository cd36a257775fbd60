"""Bound sessions over the host ring (drafter.service.bound_sessions, coordinator.transport.bound_client).

A drafter (ServiceCore + ZmqServer, in this process, its own event loop thread) serves an engine
with graphs (emulated on CPU, the Triton kernels under the interpreter); a target's persistent
buffers are views into the client's slab; each step ships the slab's prefix and gets drafts.
They must equal what an in-process engine drafts from the same calls, over tcp and ipc, for
EAGLE-1, EAGLE-3 and MTP; corrupt steps must be refused naming the field without touching any KV;
a drafter restart must be bound again by the client itself.
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

from coordinator.transport.bound_client import HostRingClient  # noqa: E402
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
SESSION_BLOCKS = 16  # two sessions of 16 blocks in a pool of 40: the second starts at block 16


def _engine(root, method, *, reference=False):
    kw = dict(k=K, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS,
              num_blocks=40)
    if reference:
        return build_engine(root, method, **kw)
    engine = build_engine(root, method, attention_backend="triton", device="cpu", **kw)
    # the sizes these steps use only (an emulated capture runs every graph once: seconds each
    # under the interpreter), captured before the drafter serves, as a server does at load
    engine.graphs = GraphRunner(engine, emulate=True, combined=False, max_tokens=16)
    engine.graphs.capture()
    return engine


class Drafter:
    """A drafter service in a thread of this process (its own event loop), on 127.0.0.1."""

    def __init__(self, engine, port: int = 0, ipc_path: str | None = None):
        self.engine, self.port, self.ipc_path = engine, port, ipc_path
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self):
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        core = ServiceCore(metrics=Metrics(), max_sessions=4, batch_window_s=0.0, max_message_bytes=1 << 24)
        core.set_engine(self.engine)
        self.core = core
        self.server = ZmqServer(core, host="127.0.0.1", port=self.port, max_message_bytes=1 << 24,
                                ipc_path=self.ipc_path)
        self.port = self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.close()
        await core.close()

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


PLANS = [[(0, 6, 0), (1, 7, 0)], [(0, K + 1, 1), (1, K + 1, 0), (2, 5, 0)]]  # 13 tokens each: graphs


_CLIENTS: list[HostRingClient] = []


@pytest.fixture(autouse=True)
def _close_clients():
    """Every client closed by the test that made it (a ZMQ context left to the garbage collector
    can block in term() inside whatever code the collector interrupts)."""
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


class Target:
    """One target: a bound client and an in-process reference engine fed the same calls."""

    def __init__(self, root, method, drafter: Drafter, seed: int, transport: str = "tcp", plane: str = wb.HOST_RING):
        self.ref = _engine(root, method, reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)
        endpoint = drafter.endpoint
        self.client = HostRingClient(endpoint, self._layout(drafter), _buffers(drafter.engine),
                                     max_batch=MAX_BATCH, transport=transport, plane=plane, timeout_s=60)
        _CLIENTS.append(self.client)

    @staticmethod
    def _layout(drafter):
        info = drafter.core.info()
        return layout_for(info, SESSION_BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)

    def reset(self, root, method, seed: int) -> None:
        """A fresh reference engine and history (a restarted drafter's KV is empty: the target prefills again)."""
        self.ref = _engine(root, method, reference=True)
        self.s_ref, self.s_remote = _scenario(self.ref, seed), _scenario(self.ref, seed)

    def step(self, plan, remote_call: dict | None = None) -> None:
        """One step through the bound client against the reference; remote_call: the target's
        call for this plan when the test took it from the scenario already."""
        expected = self.ref.propose(**self.s_ref.call(plan).kwargs).draft_token_ids
        n, b = _fill(self.client.views, remote_call or self.s_remote.call(plan).kwargs)
        got = self.client.step(n, b)
        assert torch.equal(got, expected), plan


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("transport,plane", [("tcp", wb.HOST_RING), ("ipc", wb.HOST_RING),
                                             ("tcp", wb.GLOO_CHANNEL)])
def test_bound_remote_drafts_equal_in_process(tiny_root, tmp_path, method, transport, plane):
    """Two sessions of one drafter, each step checked against an in-process engine."""
    ipc = f"ipc://{tmp_path}/drafter.sock" if transport == "ipc" else None
    with Drafter(_engine(tiny_root, method), ipc_path=ipc) as drafter:
        a = Target(tiny_root, method, drafter, seed=1, transport=transport, plane=plane)
        b = Target(tiny_root, method, drafter, seed=2, transport=transport, plane=plane)
        for plan in PLANS:
            a.step(plan)
            b.step(plan)  # the second session's blocks start past the first's: moved in place in the ring
        assert a.client.binds == b.client.binds == 1
        assert drafter.engine.graphs.replays == 4, "every step replayed the bound graphs"
        endpoint = a.client.session and drafter.server._bound_plane.sessions[a.client.session.session_id].endpoint
        assert endpoint.startswith(f"{transport}://")
        assert (a.client.channel is not None) == (plane == wb.GLOO_CHANNEL)


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


def test_corrupt_steps_are_refused_naming_the_field_and_touch_no_kv(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        a = Target(tiny_root, "eagle3", drafter, seed=1)
        b = Target(tiny_root, "eagle3", drafter, seed=2)
        a.step(PLANS[0])
        b.step(PLANS[0])
        kv = [t.clone() for t in drafter.engine.kv_snapshot()]
        replays = drafter.engine.graphs.replays
        call = b.s_remote.call(PLANS[1]).kwargs
        for field in ("block_tables[0]", "slot_mappings[0]", "target_hidden_states", "target_positions"):
            n, nb = _fill(b.client.views, call)
            _corrupt(b.client.views, field, n, nb, drafter.engine)
            with pytest.raises(DrafterError) as err:
                b.client.step(n, nb)
            assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)
            assert all(torch.equal(x, y) for x, y in zip(kv, drafter.engine.kv_snapshot())), f"{field} wrote KV"
        assert drafter.engine.graphs.replays == replays, "a refused step reached the engine"
        a.step(PLANS[1])  # the neighbour goes on as if nothing happened
        b.step(PLANS[1], call)  # and so does the session that sent the bad steps, with the step made whole
        assert b.client.binds == 1


def test_a_drafter_restart_is_bound_again_by_the_client(tiny_root):
    with Drafter(_engine(tiny_root, "eagle3")) as drafter:
        port = drafter.port
        a = Target(tiny_root, "eagle3", drafter, seed=1)
        a.step(PLANS[0])
    with Drafter(_engine(tiny_root, "eagle3"), port=port) as restarted:
        a.reset(tiny_root, "eagle3", seed=3)  # the target prefills again
        n, b = _fill(a.client.views, a.s_remote.call(PLANS[0]).kwargs)
        with pytest.raises(DrafterError) as err:  # the step that finds the restart binds again, and drafts nothing
            a.client.step(n, b)
        if err.value.code != Code.FAILED_PRECONDITION:  # lost on its way out (a race with the restart): fail closed
            assert err.value.code in (Code.DEADLINE_EXCEEDED, Code.UNAVAILABLE), str(err.value)
            with pytest.raises(DrafterError) as err:
                a.client.step(n, b)
        assert err.value.code == Code.FAILED_PRECONDITION and err.value.field == "session", str(err.value)
        assert a.client.binds == 2, "the client bound the restarted drafter by itself"
        assert a.client.session.epoch == restarted.core.epoch
        a.reset(tiny_root, "eagle3", seed=4)
        a.step(PLANS[0])
        a.step(PLANS[1])
