"""The drafter's side of CUDA IPC without a GPU: a fake CUDA backend (CPU storages) behind the real
opener, engine runner and service core.  Opened once per session and reference, bounded, released
on detach; the driver's extent checked; non-finite states refused before any KV write; drafts equal
to sending the bytes."""

from __future__ import annotations

import gc

import msgspec
import pytest
import torch

from drafter.service import core as core_mod
from drafter.service import cuda_ipc, cuda_support
from drafter.wire import schema
from drafter.service.batching.queue import Pending
from drafter.service.batching.runner import EngineRunner
from drafter.service.core import describe_engine
from drafter.service.cuda_ipc import CudaIpcOpener
from drafter.wire.cuda_ref import FIELD
from drafter.wire.errors import Code, DrafterError
from drafter.service.sessions import SessionTable
from tests.support.core import run_with_core
from tests.support.cuda_refs import UUID, FakeCudaIpc, ref
from tests.support.engines import build_engine
from tests.support.requests import request
from tests.support.scenario import Scenario

SUPPORT = schema.CudaIpcSupport(enabled=True, host_id="host", device_uuids=[UUID])
MML, BLOCKS = 96, 24


def _opener(backend, per_session=8):
    return CudaIpcOpener("cpu", SUPPORT, per_session=per_session, backend=backend)


def _refused(fn) -> DrafterError:
    with pytest.raises(DrafterError) as err:
        fn()
    assert err.value.code == Code.INVALID_ARGUMENT
    return err.value


# ---------------------------------------------------------------------- the opener's cache
def test_opened_once_then_viewed_in_place():
    content = torch.arange(60, dtype=torch.float32)
    backend = FakeCudaIpc(content)
    opener = _opener(backend)
    r = ref(4, 8, row_stride=12, storage_offset=3)
    t = opener.tensor("a", r)
    assert torch.equal(t, content.as_strided((4, 8), (12, 1), 3))
    t[0, 0] = -1.0  # the same memory, not a copy
    again = opener.tensor("a", r)
    assert again[0, 0] == -1.0
    assert again is t, "the same geometry reuses the view"
    fewer = ref(3, 8, row_stride=12, storage_offset=15, storage_size_bytes=r.storage_size_bytes)  # a smaller step, same storage
    assert fewer.storage_key == r.storage_key
    assert torch.equal(opener.tensor("a", fewer), content.as_strided((3, 8), (12, 1), 15))
    assert torch.equal(opener.tensor("a", r), t), "back to the first geometry"
    assert backend.opens == [r.storage_key] and opener.opened == 1
    assert len(backend.event_opens) == 1 and len(backend.waits) == 4, "the step event is waited for every call"


def test_each_session_keeps_at_most_per_session_storages_least_recent_out():
    backend = FakeCudaIpc()
    opener = _opener(backend, per_session=3)
    refs = [ref(2, 4, seed=s) for s in range(4)]
    for i in (0, 1, 2, 0, 3):  # 0 is used again before 3 arrives: 1 is the least recently used
        opener.tensor("a", refs[i])
    gc.collect()
    assert [backend.released(r.storage_key) for r in refs] == [False, True, False, False]
    opener.tensor("a", refs[1])
    assert backend.opens.count(refs[1].storage_key) == 2, "an evicted reference is opened again"
    assert len(opener.sessions["a"].storages) == 3


def test_forget_releases_one_session_only():
    backend = FakeCudaIpc()
    opener = _opener(backend)
    ra, rb = ref(2, 4, seed=1), ref(2, 4, seed=2)
    opener.tensor("a", ra)
    opener.tensor("b", rb)
    opener.forget("a")
    gc.collect()
    assert backend.released(ra.storage_key) and not backend.released(rb.storage_key)
    opener.tensor("b", rb)
    assert backend.opens.count(rb.storage_key) == 1


def test_a_gpu_it_cannot_read_is_refused_before_opening():
    backend = FakeCudaIpc()
    err = _refused(lambda: _opener(backend).tensor("a", ref(2, 4, device_uuid="GPU-elsewhere")))
    assert err.field == f"{FIELD}.device_uuid" and backend.opens == []


def test_a_handle_that_fails_to_open_is_refused_and_not_cached():
    backend = FakeCudaIpc()
    opener = _opener(backend)
    backend.fail_open = True
    err = _refused(lambda: opener.tensor("a", ref(2, 4)))
    assert err.field == f"{FIELD}.handle" and "invalid argument" in err.message
    backend.fail_open = False
    opener.tensor("a", ref(2, 4))
    assert opener.opened == 1


@pytest.mark.parametrize("mapped, field", [(None, "handle"), (31, "storage_size_bytes")])
def test_the_driver_mapping_must_hold_the_tensor(mapped, field):
    backend = FakeCudaIpc(mapped=mapped)
    r = ref(2, 4)  # 32 bytes
    err = _refused(lambda: _opener(backend).tensor("a", r))
    assert err.field == f"{FIELD}.{field}"
    gc.collect()
    assert backend.released(r.storage_key), "a storage that failed the check is released at once"


def test_step_events_are_opened_once_bounded_and_their_failure_named():
    backend = FakeCudaIpc()
    opener = _opener(backend)
    for seed in range(6):
        opener.tensor("a", ref(2, 4, step_event_handle=bytes([seed]) * 64))
    assert len(opener.sessions["a"].events) == cuda_ipc.EVENTS_PER_SESSION
    opener.tensor("a", ref(2, 4, step_event_handle=b""))  # none: nothing to wait for
    assert len(backend.waits) == 6
    backend.fail_event = True
    err = _refused(lambda: opener.tensor("a", ref(2, 4, step_event_handle=bytes([9]) * 64)))
    assert err.field == f"{FIELD}.step_event_handle"


# ---------------------------------------------------------------------- the engine thread
@pytest.fixture(scope="module")
def engines(tiny_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield [build_engine(tiny_root, "eagle3", k=3, max_model_len=MML, num_blocks=2 * BLOCKS) for _ in range(2)]
    torch.set_num_threads(threads)


def _scenario(engine, seed=3):
    return Scenario(block_sizes=(16,), num_blocks=(BLOCKS,), vocab_size=engine.spec.vocab_size,
                    hidden_width=engine.spec.hidden_input_width, k=3, max_model_len=MML, seed=seed)


def _layout(engine, capable: bool = True):
    d = describe_engine(engine, 1 << 26)
    return schema.AttachRequest(protocol_version=1, method="eagle3", num_speculative_tokens=3, hidden_dtype="float32",
                                hidden_size=d.hidden_size, num_aux_layers=d.num_aux_layers, max_model_len=MML,
                                max_num_seqs=4, max_num_batched_tokens=128,
                                kv_groups=[schema.KVGroup(block_size=16, num_blocks=BLOCKS)], cuda_ipc_capable=capable)


def _shared(kwargs: dict, seed: int = 0):
    """kwargs without their hidden states, the reference that replaces them, and its fake backend."""
    kw = dict(kwargs)
    hidden = kw.pop("target_hidden_states")
    return kw, ref(*hidden.shape, seed=seed), FakeCudaIpc(hidden)


def test_drafts_from_a_reference_equal_drafts_from_bytes_and_nan_is_refused_before_kv(engines):
    shared_engine, bytes_engine = engines
    table = SessionTable(describe_engine(shared_engine, 1 << 26), max_sessions=4)
    session = table.attach(_layout(shared_engine))
    plans = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0)]]
    ipc_scn, bytes_scn = _scenario(shared_engine), _scenario(shared_engine)
    for step, plan in enumerate(plans):
        kw, r, backend = _shared(ipc_scn.call(plan).kwargs, seed=step)
        runner = EngineRunner(shared_engine, cuda_ipc=_opener(backend))
        got = runner.run_batch([Pending(session, request(kw, session.id, 0, step, hidden_ipc=r), None)])[0]
        want = bytes_engine.propose(**bytes_scn.call(plan).kwargs).draft_token_ids
        assert not isinstance(got, Exception), got
        assert torch.equal(got.draft_token_ids, want), f"step {step}"
    kw, r, backend = _shared(ipc_scn.call([(0, 4, 0)]).kwargs, seed=9)
    backend.content[2, 5] = float("nan")
    before = [t.clone() for t in shared_engine.kv_snapshot()]
    err = EngineRunner(shared_engine, cuda_ipc=_opener(backend)).run_batch(
        [Pending(session, request(kw, session.id, 0, 9, hidden_ipc=r), None)])[0]
    assert isinstance(err, DrafterError) and (err.code, err.field, err.message) == \
        (Code.INVALID_ARGUMENT, FIELD, "must be finite")
    assert err.__traceback__ is None, "the error must not keep the request's tensors alive"
    assert all(torch.equal(a, b) for a, b in zip(before, shared_engine.kv_snapshot())), "no KV written"


def test_a_runner_without_an_opener_refuses_references(engines):
    table = SessionTable(describe_engine(engines[0], 1 << 26), max_sessions=4)
    session = table.attach(_layout(engines[0]))
    kw, r, _ = _shared(_scenario(engines[0]).call([(0, 4, 0)]).kwargs)
    err = EngineRunner(engines[0]).run_batch([Pending(session, request(kw, session.id, 0, 1, hidden_ipc=r), None)])[0]
    assert (err.code, err.field) == (Code.INVALID_ARGUMENT, FIELD)


# ---------------------------------------------------------------------- the service core
def _with_core(engine, body, allow=(True, "")):
    return run_with_core(engine, body, allow_cuda_ipc=allow)


@pytest.mark.parametrize("allow, reason", [((True, ""), "runs on cpu"), ((False, "disabled (x)"), "disabled (x)")])
def test_a_cpu_drafter_advertises_no_support_and_refuses_references_clearly(engines, allow, reason):
    async def body(core):
        a = await core.attach(_layout(engines[0]))
        assert not a.cuda_ipc.enabled and reason in a.cuda_ipc.reason
        assert core.info(schema.InfoRequest(cuda_ipc_capable=True)).cuda_ipc == a.cuda_ipc
        kw, r, _ = _shared(_scenario(engines[0]).call([(0, 4, 0)]).kwargs)
        with pytest.raises(DrafterError) as err:
            await core.serve_propose(request(kw, a.session_id, core.epoch, 1, hidden_ipc=r))
        assert (err.value.code, err.value.field) == (Code.INVALID_ARGUMENT, FIELD)
        assert "does not open CUDA IPC" in err.value.message
    _with_core(engines[0], body, allow)


def test_the_core_opens_references_and_detach_releases_them(engines, monkeypatch):
    backends = []

    def fake_backend():
        backends.append(FakeCudaIpc())
        return backends[-1]
    monkeypatch.setattr(core_mod.cuda_support, "advertise", lambda device, allow, why: SUPPORT)
    monkeypatch.setattr(cuda_ipc, "TorchCudaIpc", fake_backend)

    async def body(core):
        a = await core.attach(_layout(engines[0]))
        assert a.cuda_ipc == SUPPORT
        kw, r, content = _shared(_scenario(engines[0]).call([(0, 9, 0)]).kwargs)
        backends[0].content = content.content
        with pytest.raises(DrafterError) as err:  # shape checked against the call before anything opens
            await core.serve_propose(request(kw, a.session_id, core.epoch, 1, hidden_ipc=ref(8, r.shape[1])))
        assert err.value.field == f"{FIELD}.shape" and backends[0].opens == []
        out = await core.serve_propose(request(kw, a.session_id, core.epoch, 2, hidden_ipc=r))
        assert out.draft_token_ids.shape == (1, 3)
        await core.detach(schema.DetachRequest(session_id=a.session_id, epoch=core.epoch))
        gc.collect()
        return backends[0].released(r.storage_key)
    assert _with_core(engines[0], body), "detach must release what the session opened"


def test_clients_that_do_not_ask_see_no_new_field(engines, monkeypatch):
    """An older ZMQ client refuses a response with a field it does not know: only askers get cuda_ipc."""
    monkeypatch.setattr(core_mod.cuda_support, "advertise", lambda device, allow, why: SUPPORT)
    monkeypatch.setattr(cuda_ipc, "TorchCudaIpc", FakeCudaIpc)

    async def body(core):
        a = await core.attach(_layout(engines[0], capable=False))
        for resp in (a, core.info(), core.info(schema.InfoRequest())):
            assert resp.cuda_ipc is None and b"cuda_ipc" not in msgspec.msgpack.encode(resp)
        assert (await core.attach(_layout(engines[0]))).cuda_ipc == SUPPORT
    _with_core(engines[0], body)


def test_policy_auto_means_loopback_only():
    assert cuda_support.allowed("auto", "127.0.0.1") == (True, "")
    assert cuda_support.allowed("auto", "::1")[0] and cuda_support.allowed("auto", "localhost")[0]
    assert not cuda_support.allowed("auto", "0.0.0.0")[0] and not cuda_support.allowed("auto", "10.1.2.3")[0]
    assert cuda_support.allowed("true", "0.0.0.0") == (True, "")
    assert not cuda_support.allowed("false", "127.0.0.1")[0]
    assert cuda_support.advertise("cpu", False, "why").reason == "why"
