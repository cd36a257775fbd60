"""The lean remote path: zero-copy decoding keeps every byte, the fast checks agree with the slow
ones, the engine thread keeps jobs and batches in order, and ipc:// paths follow their rules.

Fuzzed with hypothesis like the wire tests: random dtypes, shapes, byte offsets and bit patterns
(NaN/inf included), random protobuf field orders, duplicates, unknown fields and truncations.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import stat
import threading

import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from drafter._proto.drafter.v1 import drafter_pb2 as pb
from drafter.wire import schema
from drafter.service.batching.checks import all_finite
from drafter.service.batching.queue import Batcher, EngineThread, Pending
from drafter.service.batching.runner import EngineRunner
from drafter.service.batching.stage import HostStager
from drafter.wire.errors import Code, DrafterError
from drafter.wire.ipc import (SUN_PATH_MAX, IpcPathError, bind_ipc, check_client_path, check_server_path,
                                 unlink_ipc)
from drafter.service.sessions import Session, offset_inputs
from drafter.wire.pbwire import _split, request_from_raw
from drafter.wire.records import INPUT_FIELDS, ProposeInputs, ProposeRequest
from drafter.wire.tensors import (DTYPES, FLOAT, INT, LIST_FIELDS, TENSOR_FIELDS, decode_tensor, request_from_frames,
                                  request_from_proto, tensor_bytes)
from tests.support.requests import present, request, to_frames, to_proto, to_raw

FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
INT_NAMES = ("int32", "int64")
FLOAT_NAMES = ("float32", "float16", "bfloat16")


# ------------------------------------------------------------------ strategies
@st.composite
def tensors(draw, kind=None, ndim=None, max_side=6):
    name = draw(st.sampled_from(INT_NAMES if kind == INT else FLOAT_NAMES if kind == FLOAT else sorted(DTYPES)))
    nd = ndim if ndim is not None else draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, max_side), min_size=nd, max_size=nd))
    n = int(np.prod(shape)) * DTYPES[name].itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(DTYPES[name]).view(shape) if n else \
        torch.empty(shape, dtype=DTYPES[name])


@st.composite
def propose_kwargs(draw):
    kw = {}
    for name, (ndim, kind) in TENSOR_FIELDS.items():
        if name == "accepted_counts":
            continue
        if draw(st.booleans()) or name in ("target_token_ids", "target_hidden_states", "next_token_ids"):
            kw[name] = draw(tensors(kind, ndim))
    for name, (ndim, kind) in LIST_FIELDS.items():
        kw[name] = draw(st.lists(tensors(kind, ndim), min_size=0, max_size=3))
    return kw


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bytes(tensor_bytes(a)) == bytes(tensor_bytes(b))


def _same_call(a: ProposeRequest, b: ProposeRequest) -> None:
    assert (a.session_id, a.epoch, a.request_id, a.return_probs, a.batch_padded, a.tokens_padded) == \
        (b.session_id, b.epoch, b.request_id, b.return_probs, b.batch_padded, b.tokens_padded)
    fa, fb = present(a.inputs), present(b.inputs)
    assert set(fa) == set(fb)
    for k, x in fa.items():
        y = fb[k]
        if isinstance(x, list):
            assert len(x) == len(y) and all(_same_tensor(u, v) for u, v in zip(x, y)), k
        else:
            assert _same_tensor(x, y), k
    assert (a.accepted_counts is None) == (b.accepted_counts is None)
    if a.accepted_counts is not None:
        assert _same_tensor(a.accepted_counts, b.accepted_counts)


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except DrafterError as e:
        return None, (e.code, e.field)


def _inside(t: torch.Tensor, buf: bytes) -> bool:
    base = np.frombuffer(buf, dtype=np.uint8).ctypes.data
    return base <= t.data_ptr() < base + len(buf)


def _viewable(t: torch.Tensor, buf: bytes) -> bool:
    """Whether t's bytes lie in buf at an address aligned for its dtype (else decoding copies them)."""
    at = bytes(buf).find(bytes(tensor_bytes(t)))
    return at >= 0 and (np.frombuffer(buf, dtype=np.uint8).ctypes.data + at) % t.element_size() == 0


# ------------------------------------------------------------------ zero-copy tensor decoding
@settings(max_examples=300, **FUZZ)
@given(t=tensors(), offset=st.integers(0, 7))
def test_decode_keeps_every_byte_at_any_alignment(t, offset):
    """numpy views the buffer wherever it lies; an unaligned one is copied, never misread."""
    data = bytes(tensor_bytes(t))
    buf = memoryview(b"\xAB" * offset + data)[offset:]
    kind = FLOAT if t.is_floating_point() else INT
    out = decode_tensor("x", {v: k for k, v in DTYPES.items()}[t.dtype], list(t.shape), buf, t.dim(), kind)
    assert _same_tensor(out, t)
    if t.numel() and offset % t.element_size() == 0 and out.data_ptr() % t.element_size() == 0:
        assert _inside(out, buf.obj), "an aligned buffer is viewed, not copied"


@settings(max_examples=150, **FUZZ)
@given(kw=propose_kwargs(), rid=st.integers(0, 2**64 - 1))
def test_frames_round_trip_is_exact_and_zero_copy(kw, rid):
    if not kw["block_tables"] or not kw["slot_mappings"]:
        kw["block_tables"] = kw["block_tables"] or [torch.zeros(1, 1, dtype=torch.int32)]
        kw["slot_mappings"] = kw["slot_mappings"] or [torch.zeros(1, dtype=torch.int64)]
    header, frames = to_frames("s", 3, rid, kw)
    frames = [bytes(f) for f in frames]
    call, err = _outcome(request_from_frames, header, frames)
    ref, ref_err = _outcome(request_from_proto, to_proto(pb.ProposeRequest, "s", 3, rid, kw))
    assert err == ref_err
    if call is None:
        return
    _same_call(call, ref)
    hidden = call.inputs.target_hidden_states
    source = frames[header.target_hidden_states.frame]
    if hidden.numel() and _viewable(hidden, source):
        assert _inside(hidden, source)


# ------------------------------------------------------------------ gRPC payloads without protobuf copies
@settings(max_examples=200, **FUZZ)
@given(kw=propose_kwargs(), rid=st.integers(0, 2**64 - 1), epoch=st.integers(0, 2**64 - 1),
       probs=st.booleans(), bp=st.integers(0, 2**32 - 1), accepted=st.none() | tensors(INT, 1))
def test_encoded_request_is_what_protobuf_would_send(kw, rid, epoch, probs, bp, accepted):
    ours = pb.ProposeRequest.FromString(to_raw(
        "sess", epoch, rid, kw, return_probs=probs, batch_padded=bp, accepted_counts=accepted).SerializeToString())
    assert ours == to_proto(pb.ProposeRequest, "sess", epoch, rid, kw, return_probs=probs, batch_padded=bp,
                                 accepted_counts=accepted)


@settings(max_examples=200, **FUZZ)
@given(kw=propose_kwargs(), rid=st.integers(0, 2**64 - 1))
def test_raw_decode_equals_protobuf_and_views_the_received_bytes(kw, rid):
    raw = to_raw("sess", 7, rid, kw).SerializeToString()
    fast, fast_err = _outcome(request_from_raw, raw)
    slow, slow_err = _outcome(lambda r: request_from_proto(pb.ProposeRequest.FromString(r)), raw)
    assert fast_err == slow_err
    if fast is not None:
        _same_call(fast, slow)
        hidden = fast.inputs.target_hidden_states
        if hidden.numel() and _viewable(hidden, raw):
            assert _inside(hidden, raw), "the payload must be a view of the received bytes"


def _field(num: int, wire: int, payload: bytes) -> bytes:
    from drafter.wire.pbwire import _varint_bytes
    key = _varint_bytes(num << 3 | wire)
    return key + (_varint_bytes(len(payload)) + payload if wire == 2 else payload)


@settings(max_examples=400, **FUZZ)
@given(kw=propose_kwargs(), data=st.data())
def test_malformed_and_unusual_bytes_get_the_answer_protobuf_gives(kw, data):
    """Duplicated Tensors (protobuf merges them), unknown fields, wrong wire types, truncation and
    flipped bytes: the fast path either handles them exactly like protobuf or hands them over."""
    raw = bytearray(to_raw("sess", 7, 1, kw).SerializeToString())
    how = data.draw(st.sampled_from(["duplicate", "unknown", "wire", "truncate", "flip", "tensor-unknown",
                                     "garbage"]))
    if how == "duplicate":  # a second target_hidden_states: protobuf merges the two submessages
        extra = pb.ProposeRequest()
        extra.target_hidden_states.shape[:] = [1, 2]
        raw += extra.SerializeToString()
    elif how == "unknown":
        raw += _field(data.draw(st.integers(19, 2000)), 2, data.draw(st.binary(max_size=20)))
    elif how == "wire":
        raw += _field(data.draw(st.sampled_from([4, 6, 10])), 0, b"\x01")
    elif how == "truncate" and raw:
        del raw[data.draw(st.integers(0, len(raw) - 1)):]
    elif how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "tensor-unknown":
        t = pb.Tensor(dtype="int32")
        raw += _field(4, 2, t.SerializeToString() + _field(9, 0, b"\x05"))
    else:
        raw = bytearray(data.draw(st.binary(max_size=64)))
    raw = bytes(raw)

    def slow(r):
        try:
            req = pb.ProposeRequest.FromString(r)
        except Exception:  # noqa: BLE001
            raise DrafterError(Code.INVALID_ARGUMENT, "request", "undecodable") from None
        return request_from_proto(req)
    fast, fast_err = _outcome(request_from_raw, raw)
    ref, ref_err = _outcome(slow, raw)
    assert fast_err == ref_err, how
    if fast is not None:
        _same_call(fast, ref)


def test_the_fast_path_is_taken_for_what_clients_send():
    kw = dict(target_token_ids=torch.arange(4), target_hidden_states=torch.randn(4, 8).to(torch.bfloat16),
              block_tables=[torch.zeros(1, 2, dtype=torch.int32)], slot_mappings=[torch.arange(4)])
    raw = to_raw("s", 1, 2, kw).SerializeToString()
    skeleton, payloads = _split(raw)  # raises when the walk would fall back
    assert len(skeleton) < len(raw) - 4 * 8 * 2 and len(payloads) == 4


# ------------------------------------------------------------------ vectorised checks
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@settings(max_examples=400, **FUZZ)
@given(dtype=st.sampled_from(list(BITS)), n=st.integers(1, 300), data=st.data())
def test_finite_check_agrees_with_torch_on_any_bit_pattern(dtype, n, data):
    itype = BITS[dtype]
    info = torch.iinfo(itype)
    bits = torch.tensor(data.draw(st.lists(st.integers(info.min, info.max), min_size=n, max_size=n)), dtype=itype)
    if data.draw(st.booleans()):  # make most values ordinary numbers, a few special
        bits = torch.randn(n).to(dtype).view(itype)
        for _ in range(data.draw(st.integers(0, 3))):
            bits.view(dtype)[data.draw(st.integers(0, n - 1))] = data.draw(
                st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40]))
    x = bits.view(dtype)
    want = bool(torch.isfinite(x.float()).all())
    assert all_finite(x) == want
    assert all_finite(x.view(2, -1) if n % 2 == 0 else x) == want
    assert all_finite(x[::2]) == bool(torch.isfinite(x[::2].float()).all()), "strided views too"


FINITE = {torch.bfloat16: (3.3e38, 1e-40), torch.float16: (65504.0, 6e-8), torch.float32: (3.4e38, 1e-45)}


@pytest.mark.parametrize("dtype", list(FINITE))
def test_finite_check_refuses_nan_and_inf_anywhere_and_accepts_every_finite_value(dtype):
    """NaN, +inf and -inf at the first, a middle and the last element (and across the hidden
    states' rows) are refused; the largest finite values, -0.0 and subnormals are accepted."""
    largest, subnormal = FINITE[dtype]
    x = torch.randn(64, 300).to(dtype)
    x[0, :4] = torch.tensor([largest, -largest, -0.0, subnormal], dtype=dtype)
    x[-1, -1] = -subnormal
    assert all_finite(x) and all_finite(x[:, 1:]) and all_finite(x.t())
    for flat in (0, x.numel() // 2 - 1, x.numel() // 2, 300 * 17, x.numel() - 1):
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y.view(-1)[flat] = bad
            assert not all_finite(y), (dtype, flat, bad)
            assert not all_finite(y.t()), "any strides"


def test_a_call_alone_is_staged_once_and_its_staged_copy_checked():
    """A call alone in its engine call is staged in _prepare (_run_group's stage then passes the staged
    inputs on), the finite check then refuses a NaN in the staged copy exactly as in the message, by field."""
    engine = _RecordingEngine()
    runner = EngineRunner(engine)
    runner.stager = HostStager(1 << 20, pin=False)
    s = Session("x", "c", (5,), (64,), (16,), 96, 8, 64, torch.bfloat16)
    kw = {"target_token_ids": torch.zeros(4, dtype=torch.int64), "target_hidden_states": torch.randn(4, 32).to(
          torch.bfloat16), "next_token_ids": torch.zeros(1, dtype=torch.int64), "query_start_loc": torch.tensor([0, 4]),
          "block_tables": [torch.arange(3, dtype=torch.int32).view(1, 3)], "slot_mappings": [torch.tensor([0, 1, -1, 3])]}
    staged = runner._prepare(Pending(s, request(kw, "x", 0, 1), None), alone=True)
    assert runner.stager.stage(staged) is staged
    base, end = runner.stager.buf.data_ptr(), runner.stager.buf.data_ptr() + runner.stager.buf.numel()
    assert base <= staged.target_hidden_states.data_ptr() < end
    assert torch.equal(staged.block_tables[0], kw["block_tables"][0] + 5), "shifted, then staged"
    assert staged.slot_mappings[0].tolist() == [80, 81, -1, 83]
    kw["target_hidden_states"][2, 7] = float("nan")
    results = runner.run_batch([Pending(s, request(kw, "x", 0, 1), concurrent.futures.Future())])
    assert (results[0].code, results[0].field, results[0].message) == (
        Code.INVALID_ARGUMENT, "target_hidden_states", "must be finite")
    assert len(engine.seen) == 0


def _inputs(**tensors) -> ProposeInputs:
    """A ProposeInputs with only these tensors set (the others None)."""
    return ProposeInputs(**{name: tensors.get(name) for name in INPUT_FIELDS})


def _reference_offsets(s: Session, kwargs: dict) -> dict:
    out = dict(kwargs)
    out["block_tables"] = [t.to(torch.int64) + base for t, base in zip(kwargs["block_tables"], s.bases)]
    out["slot_mappings"] = [torch.where(t.to(torch.int64) >= 0, t.to(torch.int64) + base * bs, t.to(torch.int64))
                            for t, base, bs in zip(kwargs["slot_mappings"], s.bases, s.block_sizes)]
    return out


@settings(max_examples=200, **FUZZ)
@given(bases=st.lists(st.integers(0, 5000), min_size=1, max_size=3), dtype=st.sampled_from([torch.int32, torch.int64]),
       data=st.data())
def test_block_offsets_equal_the_torch_reference(bases, dtype, data):
    sizes = tuple(data.draw(st.sampled_from([8, 16])) for _ in bases)
    s = Session("x", "c", tuple(bases), (64,) * len(bases), sizes, 96, 8, 64, torch.float32)
    kw = {"block_tables": [torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=6, max_size=6)),
                                        dtype=dtype).view(2, 3) for _ in bases],
          "slot_mappings": [torch.tensor(data.draw(st.lists(st.integers(-1, 1023), min_size=5, max_size=5)),
                                         dtype=dtype) for _ in bases]}
    got, want = offset_inputs(s, _inputs(**kw)), _reference_offsets(s, kw)
    for name in ("block_tables", "slot_mappings"):
        for g, w in zip(getattr(got, name), want[name]):
            assert torch.equal(g.to(torch.int64), w), name


# ------------------------------------------------------------------ pinned staging
def test_host_stager_copies_exactly_and_reuses_one_buffer():
    stager = HostStager(max_bytes=1 << 20, pin=False)  # pin=True needs a GPU; the logic is the same
    ptrs = set()
    for rows in (4, 2, 8, 8, 3, 16):
        t = torch.randn(rows, 64).to(torch.bfloat16)
        out = stager.stage(_inputs(target_hidden_states=t)).target_hidden_states
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
        ptrs.add(stager.buf.data_ptr())
    assert stager.allocations == len(ptrs) <= 3, "grown geometrically, never allocated per call"
    strided = torch.randn(8, 128).to(torch.bfloat16)[:, ::2]
    assert torch.equal(stager.stage(_inputs(target_hidden_states=strided)).target_hidden_states, strided)
    huge = torch.zeros(1 << 19, dtype=torch.float32)  # 2 MiB: more than any call the engine accepts
    assert stager.stage(_inputs(target_hidden_states=huge)).target_hidden_states is huge
    assert stager.buf.numel() <= 1 << 20


def test_host_stager_stages_a_whole_call_in_one_buffer():
    """Every CPU tensor of a call (lists included) lands in the one buffer, 64-byte aligned, equal
    to the original; unset fields stay unset; a call too large stays as it was."""
    stager = HostStager(max_bytes=1 << 16, pin=False)
    kw = {"target_token_ids": torch.arange(7), "target_hidden_states": torch.randn(7, 16).to(torch.bfloat16),
          "query_start_loc": torch.tensor([0, 3, 7], dtype=torch.int32), "block_tables": [torch.ones(2, 3).int()] * 2,
          "slot_mappings": [torch.arange(7), torch.arange(7) + 1]}
    out = stager.stage(_inputs(**kw))
    assert out.temperatures is None and out.seq_lens is None
    base, end = stager.buf.data_ptr(), stager.buf.data_ptr() + stager.buf.numel()
    flat = [(a, b) for k in kw for a, b in (zip(kw[k], getattr(out, k)) if isinstance(kw[k], list)
                                            else [(kw[k], getattr(out, k))])]
    for orig, staged in flat:
        assert torch.equal(orig, staged) and staged.dtype == orig.dtype
        assert base <= staged.data_ptr() < end and (staged.data_ptr() - base) % 64 == 0
    starts = sorted(t.data_ptr() for _, t in flat if isinstance(t, torch.Tensor))
    assert len(set(starts)) == len(starts), "no two tensors share bytes"
    big = _inputs(target_hidden_states=torch.zeros(1 << 15, dtype=torch.float32))  # 128 KiB > 64 KiB
    assert stager.stage(big) is big


# ------------------------------------------------------------------ the engine thread
class _FakeRunner:
    """EngineRunner's surface for the Batcher: records each batch (request ids) and answers them."""

    max_batch, max_tokens = 8, 64

    def __init__(self, log):
        self.log = log
        self.defer_records = False

    def run_batch(self, items):
        self.log.append(("batch", [it.call.request_id for it in items]))
        return [it.call.request_id * 10 for it in items]

    def flush_records(self):
        pass


def _call(rid, batch=1):
    kw = {"next_token_ids": torch.zeros(batch, dtype=torch.int64), "target_token_ids": torch.zeros(batch)}
    return request(kw, "s", 0, rid)


def test_engine_thread_keeps_jobs_and_batches_in_arrival_order():
    log = []
    engine = EngineThread("test-engine")
    runner = _FakeRunner(log)

    async def main():
        batcher = Batcher(runner, engine, window_s=0.0)
        batcher.start()
        gate = threading.Event()
        loop = asyncio.get_running_loop()
        blocked = loop.run_in_executor(engine, gate.wait)  # holds the engine thread
        futs = [asyncio.ensure_future(batcher.submit(None, _call(1))),
                asyncio.ensure_future(batcher.submit(None, _call(2)))]
        await asyncio.sleep(0.05)
        job = loop.run_in_executor(engine, lambda: log.append(("job", None)))
        futs.append(asyncio.ensure_future(batcher.submit(None, _call(3))))
        await asyncio.sleep(0.05)
        gate.set()
        await blocked
        results = await asyncio.gather(*futs)
        await job
        await batcher.stop()
        return results

    results = asyncio.run(main())
    engine.shutdown()
    assert results == [10, 20, 30]
    assert log == [("batch", [1, 2]), ("job", None), ("batch", [3])], "a job waits for the batch before it"


def test_engine_thread_replies_before_delivering_and_refuses_after_stop():
    order = []
    engine = EngineThread("test-engine")

    async def main():
        batcher = Batcher(_FakeRunner([]), engine, window_s=0.0)
        batcher.start()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        main_thread = threading.get_ident()

        def reply(r):
            order.append(("reply", r, threading.get_ident() != main_thread))

        def on_done(r):
            order.append(("done", r, threading.get_ident() == main_thread))
            done.set_result(None)
        batcher.submit_nowait(None, _call(4), on_done, reply)
        await done
        await batcher.stop()
        with pytest.raises(DrafterError) as e:
            await batcher.submit(None, _call(5))
        return e.value.code

    code = asyncio.run(main())
    engine.shutdown()
    assert order == [("reply", 40, True), ("done", 40, True)], "reply in the engine thread, then the loop"
    assert code == Code.UNAVAILABLE


def test_window_collects_what_arrives_and_a_plain_executor_still_works():
    """The window is far longer than any stall of a loaded box; a batch of two fills the runner,
    which ends the wait (so the test does not wait the window out): the second call must join the
    first's batch whatever the timing."""
    log = []
    runner = _FakeRunner(log)
    runner.max_batch = 2
    executor = concurrent.futures.ThreadPoolExecutor(1)

    async def main():
        batcher = Batcher(runner, executor, window_s=600.0)
        batcher.start()
        first = asyncio.ensure_future(batcher.submit(None, _call(1)))
        await asyncio.sleep(0.02)  # spacing only (the second usually arrives inside the window); not awaited on
        second = asyncio.ensure_future(batcher.submit(None, _call(2)))
        out = await asyncio.gather(first, second)
        await batcher.stop()
        return out

    assert asyncio.run(main()) == [10, 20]
    executor.shutdown()
    assert log == [("batch", [1, 2])]


def test_shutdown_answers_queued_requests():
    engine = EngineThread("test-engine")
    gate = threading.Event()
    engine.submit(gate.wait)
    fut = concurrent.futures.Future()
    engine.post(Pending(None, _call(9), fut))
    engine.shutdown(wait=False, cancel_futures=True)
    gate.set()
    with pytest.raises(DrafterError) as e:
        fut.result(timeout=5)
    assert e.value.code == Code.UNAVAILABLE


# ------------------------------------------------------------------ ipc:// paths
@pytest.fixture
def private_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def test_ipc_bind_creates_a_private_socket_and_unlinks_it(private_dir):
    ctx = zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        endpoint = bind_ipc(server, str(private_dir / "d.sock"))
        assert endpoint == f"ipc://{private_dir}/d.sock"
        st_ = os.stat(private_dir / "d.sock")
        assert stat.S_ISSOCK(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o600
        assert check_client_path(endpoint) == str(private_dir / "d.sock")
        client.connect(endpoint)
        client.send_multipart([b"", b"hello"])
        assert server.poll(5000) and server.recv_multipart()[2] == b"hello"
    finally:
        server.close(0)
        client.close(0)
        ctx.term()
    unlink_ipc(endpoint)
    assert not (private_dir / "d.sock").exists()


def test_ipc_group_mode_and_stale_sockets(private_dir):
    ctx = zmq.Context()
    a = ctx.socket(zmq.ROUTER)
    bind_ipc(a, f"ipc://{private_dir}/g.sock", 0o660)
    assert stat.S_IMODE(os.stat(private_dir / "g.sock").st_mode) == 0o660
    a.close(0)  # a dead run may leave its socket file behind: the next one replaces it
    (private_dir / "g.sock").exists() or pytest.skip("libzmq removed the socket file itself")
    b = ctx.socket(zmq.ROUTER)
    bind_ipc(b, f"ipc://{private_dir}/g.sock")
    b.close(0)
    ctx.term()


@pytest.mark.parametrize("case", ["relative", "abstract", "too-long", "no-directory", "world-writable",
                                  "regular-file", "mode-for-others"])
def test_ipc_refuses_bad_paths(private_dir, case):
    path, mode = str(private_dir / "d.sock"), 0o600
    if case == "relative":
        path = "run/d.sock"
    elif case == "abstract":
        path = "@drafter"
    elif case == "too-long":
        path = str(private_dir / ("x" * (SUN_PATH_MAX + 1)))
    elif case == "no-directory":
        path = str(private_dir / "missing" / "d.sock")
    elif case == "world-writable":
        open_dir = private_dir / "open"
        open_dir.mkdir()
        os.chmod(open_dir, 0o777)
        path = str(open_dir / "d.sock")
    elif case == "regular-file":
        (private_dir / "d.sock").write_text("not a socket")
    elif case == "mode-for-others":
        mode = 0o666
    with pytest.raises(IpcPathError):
        check_server_path(path, mode)
    if case == "regular-file":
        assert (private_dir / "d.sock").read_text() == "not a socket", "never clobbered"
    if case in ("relative", "abstract", "too-long", "world-writable", "regular-file"):
        with pytest.raises(IpcPathError):
            check_client_path(f"ipc://{path}")


def test_sticky_world_writable_directories_are_allowed(tmp_path):
    d = tmp_path / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)  # as /tmp: others cannot remove or rename our socket
    assert check_server_path(str(d / "d.sock")) == str(d / "d.sock")


def test_the_zmq_client_checks_ipc_paths(tmp_path):
    from coordinator.transport import ZmqDrafterClient

    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(IpcPathError):
        ZmqDrafterClient(f"ipc://{open_dir}/d.sock")
    with pytest.raises(IpcPathError):
        ZmqDrafterClient("ipc://@abstract")


def test_runner_metrics_wait_for_the_replies_when_deferred():
    calls = []
    runner = EngineRunner.__new__(EngineRunner)
    runner.on_engine_call, runner.defer_records, runner.deferred = calls.append, True, ["record"]
    runner.flush_records()
    assert calls == ["record"] and runner.deferred == []


def test_schema_has_no_new_fields():
    """The ZMQ schema and the proto stay equal (the ipc transport changes neither)."""
    assert "frame" in schema.Tensor.__struct_fields__ and len(pb.Tensor.DESCRIPTOR.fields) == 3


class _RecordingEngine:
    """The engine surface EngineRunner needs; records what reached propose()."""

    class config:  # noqa: N801 - mimics EngineConfig's attributes
        max_num_seqs, max_num_batched_tokens, torch_dtype, kv_groups = 8, 64, torch.bfloat16, (None,)

    device = torch.device("cpu")
    limits = None

    def __init__(self):
        self.seen = []

    def draft(self, inp, **options):
        from drafter.wire.records import DraftOutput
        self.seen.append(inp.target_hidden_states)
        b = inp.next_token_ids.shape[0]
        return DraftOutput(torch.arange(b * 3).view(b, 3), None, b, inp.target_token_ids.shape[0])


def test_the_runner_stages_hidden_states_and_copies_drafts_to_the_host():
    """What a GPU engine gets (pin=False here: the logic without a GPU): the staged copy, equal to
    the request's hidden states, in the one reused buffer."""
    engine = _RecordingEngine()
    runner = EngineRunner(engine)
    runner.stager = HostStager(1 << 20, pin=False)
    s = Session("x", "c", (0,), (64,), (16,), 96, 8, 64, torch.bfloat16)
    for rows in (4, 2):
        hidden = torch.randn(rows, 32).to(torch.bfloat16)
        kw = {"target_token_ids": torch.zeros(rows, dtype=torch.int64), "target_hidden_states": hidden,
              "next_token_ids": torch.zeros(1, dtype=torch.int64), "query_start_loc": torch.tensor([0, rows]),
              "block_tables": [torch.zeros(1, 1, dtype=torch.int32)],
              "slot_mappings": [torch.zeros(rows, dtype=torch.int64)]}
        out = runner.run_batch([Pending(s, request(kw, "x", 0, rows), concurrent.futures.Future())])[0]
        staged = engine.seen[-1]
        base, size = runner.stager.buf.data_ptr(), runner.stager.buf.numel()
        assert torch.equal(staged, hidden) and base <= staged.data_ptr() < base + size
        assert out.draft_token_ids.device.type == "cpu" and out.request_id == rows
    assert runner.stager.allocations == 1
