"""coordinator.transport.bound_transport without a drafter: which steps may go bound (exactly what
they mean unbound), the copies into the ring, the ring's size per session, and when a transport is
bound at all.  The bound steps against a real drafter: tests/integration/test_bound_remote.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from coordinator.remote_proposer import ProposerConfig
from coordinator.session import SessionSpec
from coordinator.transport.bound_client import BoundRing
from coordinator.transport.bound_transport import (BoundConfig, BoundTransport, bindable, fill, fill_through, fits,
                                                   private, session_buffers)
from drafter.engine.config import KVGroupSpec
from drafter.wire import bound as wb
from drafter.wire.records import ProposeRequest
from tests.support.scenario import Scenario

K, MML, BATCH, TOKENS, BLOCK, WIDTH = 3, 48, 4, 32, 16, 24
SPEC = SessionSpec(method="eagle", num_speculative_tokens=K, hidden_size=WIDTH, num_aux_layers=0, max_model_len=MML,
                   max_num_seqs=BATCH, max_num_batched_tokens=TOKENS, kv_groups=(KVGroupSpec(BLOCK, 16),))
INFO = SimpleNamespace(session_id="s", epoch="7", max_num_seqs=BATCH, max_num_batched_tokens=TOKENS)


def _ring(max_tokens: int = TOKENS) -> BoundRing:
    return BoundRing(session_buffers(SPEC, INFO, max_tokens, 0, 0))


def _request(rejected: bool, **options) -> ProposeRequest:
    sc = Scenario(block_sizes=[BLOCK], num_blocks=[16], vocab_size=100, hidden_width=WIDTH, k=K, max_model_len=MML,
                  seed=3)
    sc.call([(0, 6, 0), (1, 5, 0)])
    plan = [(0, K + 1, 1 if rejected else 0), (1, K + 1, 0)]
    return ProposeRequest.from_keywords(**sc.call(plan).kwargs, **options)


@pytest.mark.parametrize("rejected", [False, True])
def test_fill_copies_every_tensor_and_samples_where_the_engine_would(rejected):
    ring, req = _ring(), _request(rejected)
    assert fits(ring, req, groups=1)
    n, b = fill(ring.views, req.inputs)
    inp, v = req.inputs, ring.views
    assert (n, b) == (inp.num_tokens, inp.batch_size)
    for name in ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids", "seq_lens"):
        assert torch.equal(v[name][:getattr(inp, name).shape[0]], getattr(inp, name).to(v[name].dtype)), name
    assert torch.equal(v["query_start_loc"][:b + 1], inp.query_start_loc.long())
    cols = v["block_tables[0]"].shape[1]
    assert cols == -(-MML // BLOCK) and inp.block_tables[0].shape[1] > cols, "the scenario's tables are wider"
    assert torch.equal(v["block_tables[0]"][:b], inp.block_tables[0][:, :cols].long())
    assert torch.equal(v["slot_mappings[0]"][:n], inp.slot_mappings[0])
    # the engine's sampled rows (drafter.engine.buffers): given, or each query's last row less its rejected
    want = inp.token_indices_to_sample if inp.token_indices_to_sample is not None else \
        inp.query_start_loc[1:] - 1 - (inp.num_rejected_tokens if inp.num_rejected_tokens is not None else 0)
    assert torch.equal(v["token_indices_to_sample"][:b], want.long())
    rejected_rows = inp.num_rejected_tokens if inp.num_rejected_tokens is not None else torch.zeros(b)
    assert torch.equal(v["num_rejected_tokens"][:b], rejected_rows.long())


@pytest.mark.parametrize("rejected", [False, True])
def test_a_gpu_target_fills_a_mirror_and_ships_the_same_bytes(rejected):
    """fill_through (the GPU path; here a host mirror) leaves the ring's shipped prefix byte for byte
    as fill() into the ring does."""
    req = _request(rejected)
    direct, through, mirror = _ring(), _ring(), BoundRing(_ring().buffers, device="cpu")
    n, b = fill(direct.views, req.inputs)
    assert fill_through(mirror, through, req.inputs) == (n, b)
    nbytes = direct.step_bytes(n)
    assert mirror.bytes is None, "a mirror is not shipped itself"
    assert torch.equal(through.slab[:nbytes], direct.slab[:nbytes])


def _with(req: ProposeRequest, **changes) -> ProposeRequest:
    inputs = SimpleNamespace(**vars(req.inputs))
    for k, value in changes.items():
        setattr(inputs, k, value)
    return ProposeRequest(inputs)


@pytest.mark.parametrize("change,why", [
    (lambda r: ProposeRequest(r.inputs, return_probs=True), "draft probabilities"),
    (lambda r: _with(r, temperatures=torch.zeros(2)), "sampling"),
    (lambda r: _with(r, target_hidden_states=r.inputs.target_hidden_states.double()), "another hidden dtype"),
    (lambda r: _with(r, target_token_ids=r.inputs.target_token_ids.float()), "float token ids"),
    (lambda r: _with(r, block_tables=[r.inputs.block_tables[0][:, :2]]), "a narrower block table"),
    (lambda r: _with(r, slot_mappings=[]), "a KV group missing"),
    (lambda r: _with(r, seq_lens=r.inputs.seq_lens[:1]), "rows that do not match the batch"),
])
def test_what_a_ring_cannot_hold_exactly_goes_unbound(change, why):
    ring, req = _ring(), _request(True)
    assert fits(ring, req, groups=1)
    assert not fits(ring, change(req), groups=1), why


def test_more_tokens_than_the_ring_holds_go_unbound():
    req = _request(False)
    assert not fits(_ring(max_tokens=req.num_tokens - 1), req, groups=1)
    assert fits(_ring(max_tokens=req.num_tokens), req, groups=1)


def test_the_ring_per_session():
    specs = {b.name: b for b in session_buffers(SPEC, INFO, 0, 0, 0)}
    assert specs["target_token_ids"].shape == [BATCH * (K + 1)], "a decode step of every sequence by default"
    assert all(b.dtype == "int64" for n, b in specs.items() if n != wb.HIDDEN), "int copies are exact"
    assert specs[wb.HIDDEN].shape == [BATCH * (K + 1), WIDTH] and specs[wb.HIDDEN].dtype == "float32"
    assert specs["block_tables[0]"].shape == [BATCH, MML // BLOCK]
    assert {b.name: b for b in session_buffers(SPEC, INFO, 0, 5, 0)}["block_tables[0]"].shape == [BATCH, 4]
    assert {b.name: b for b in session_buffers(SPEC, INFO, 1000, 0, 0)}["target_token_ids"].shape == [TOKENS]
    limit = (1 << 20) + 6 * WIDTH * 4  # room for six hidden rows under the drafter's message limit
    assert {b.name: b for b in session_buffers(SPEC, INFO, 0, 0, limit)}["target_token_ids"].shape == [6]
    assert session_buffers(SPEC, INFO, 0, 0, (1 << 20) + WIDTH * 4) is None, "not one row per sequence"


def test_private_copies_share_no_memory_with_the_caller():
    req = _request(True, accepted_counts=torch.ones(2, dtype=torch.int32))
    own = private(req)
    for name in ("target_token_ids", "target_hidden_states", "num_rejected_tokens"):
        assert torch.equal(getattr(own.inputs, name), getattr(req.inputs, name))
        assert getattr(own.inputs, name).data_ptr() != getattr(req.inputs, name).data_ptr()
    assert own.inputs.block_tables[0].data_ptr() != req.inputs.block_tables[0].data_ptr()
    assert own.accepted_counts.data_ptr() != req.accepted_counts.data_ptr()


class _Plain:
    def __init__(self, name):
        self.name = name
        self.client = SimpleNamespace(endpoint="tcp://127.0.0.1:5555")


def test_only_zmq_transports_are_bound_and_mode_off_binds_nothing():
    assert ProposerConfig().bound.mode == "auto"
    zmq, grpc = _Plain("zmq"), _Plain("grpc")
    assert isinstance(bindable(zmq, SPEC, BoundConfig()), BoundTransport)
    assert bindable(zmq, SPEC, BoundConfig(mode="off")) is zmq
    assert bindable(grpc, SPEC, BoundConfig()) is grpc


@pytest.mark.parametrize("kw", [dict(mode="always"), dict(transport="udp"), dict(plane="nccl"), dict(max_tokens=-1),
                                dict(device="warp9")])
def test_bound_config_refuses_what_it_cannot_do(kw):
    with pytest.raises(ValueError):
        BoundConfig(**kw)


def test_a_data_socket_never_reconnects_to_whatever_listens_on_its_port_next():
    """A restarted drafter may give the old binding's tcp port to another session's binding: once
    its drafter is gone, the data socket takes no step, even with a new listener on the port that
    an ordinary socket reaches (its message arrives there)."""
    import zmq

    from coordinator.transport.bound_client import connect_socket

    ctx, drafter = zmq.Context(), zmq.Context()  # the drafter's own: term() returns once its port is free
    socks = []
    try:
        server = drafter.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://127.0.0.1:{server.bind_to_random_port('tcp://127.0.0.1')}"
        data = connect_socket(ctx, endpoint, data=True)
        socks.append(data)
        assert data.getsockopt(zmq.RECONNECT_IVL) == -1 and data.getsockopt(zmq.IMMEDIATE) == 1
        assert data.poll(10000, zmq.POLLOUT)
        server.close(linger=0)
        drafter.term()
        again = ctx.socket(zmq.ROUTER)
        socks.append(again)
        again.setsockopt(zmq.LINGER, 0)
        again.bind(endpoint)
        other = connect_socket(ctx, endpoint, data=False)
        socks.append(other)
        other.send(b"hello")
        assert again.poll(10000) and again.recv_multipart()[1] == b"hello", "the new listener is reachable"
        assert not data.poll(0, zmq.POLLOUT), "the data socket connected to a new listener"
        with pytest.raises(zmq.Again):
            data.send(b"step", zmq.NOBLOCK)
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("address,via,want", [
    ("tcp://0.0.0.0:4100", "tcp://drafter.ns.svc:5555", "tcp://drafter.ns.svc:4100"),
    ("tcp://[::]:4100", "tcp://[fd00::7]:5555", "tcp://[fd00::7]:4100"),
    ("tcp://10.0.0.7:4100", "tcp://drafter:5555", "tcp://10.0.0.7:4100"),
    ("0.0.0.0:29500", "tcp://10.0.0.7:5555", "10.0.0.7:29500"),
    ("ipc:///run/drafter.sock.bound-ab", "tcp://10.0.0.7:5555", "ipc:///run/drafter.sock.bound-ab"),
    ("tcp://0.0.0.0:4100", "ipc:///run/drafter.sock", "tcp://0.0.0.0:4100"),
])
def test_a_drafter_listening_everywhere_is_reached_where_the_bind_went(address, via, want):
    """A drafter on --host 0.0.0.0 answers Bind with a wildcard data endpoint (and gloo store):
    from another host that is the control endpoint's host."""
    from coordinator.transport.bound_client import _host, reachable

    assert reachable(address, _host(via)) == want


def test_the_plane_follows_where_the_tensors_live_and_what_the_drafter_serves(monkeypatch):
    """auto: the host ring until a step says where the tensors live; cuda_ipc only for a GPU of this
    host that the drafter advertised (CudaIpcSupport), else nccl_channel for tensors on a GPU until
    the drafter refused it, then the host ring; a plane the config names, always."""
    from coordinator.transport import bound_transport
    from drafter.wire import cuda_ref
    from drafter.wire.cuda_slab import LocalSlabs
    from drafter.wire.schema import CudaIpcSupport

    t = BoundTransport(_Plain("zmq"), SPEC, BoundConfig())
    assert t._plane() == wb.HOST_RING, "nothing known yet"
    t._device = torch.device("cpu")
    assert t._plane() == wb.HOST_RING, "not on a GPU"
    gpu = torch.device("cuda", 0)
    for support in (None, CudaIpcSupport(enabled=False, reason="off"),
                    CudaIpcSupport(enabled=True, host_id="another host", device_uuids=["GPU-x"])):
        t._device, t._support, t._planes = gpu, support, {}
        assert t._plane() == wb.NCCL_CHANNEL, support
    monkeypatch.setattr(cuda_ref, "device_uuid", lambda device: "GPU-x")
    t._support, t._planes = CudaIpcSupport(enabled=True, host_id=cuda_ref.host_id(), device_uuids=["GPU-x"]), {}
    assert t._plane() == wb.CUDA_IPC, "this host, a GPU the drafter reads"
    t._ipc_refused = "the drafter refused slab.handle"
    assert t._plane() == wb.NCCL_CHANNEL, "cuda_ipc refused once: the NCCL channel from then on"
    t._nccl_refused = "the drafter refused plane"
    assert t._plane() == wb.HOST_RING, "both refused: the host ring from then on"
    monkeypatch.setattr(bound_transport, "SLABS", LocalSlabs())
    local = BoundTransport(_Plain("zmq"), SPEC, BoundConfig(device="cpu"))
    assert local._plane() == wb.CUDA_IPC, "the in-process stand-in serves any device"
    assert BoundTransport(_Plain("zmq"), SPEC, BoundConfig(plane="host_ring", device="cpu"))._plane() == wb.HOST_RING
    assert BoundTransport(_Plain("zmq"), SPEC, BoundConfig(plane="nccl_channel"))._plane() == wb.NCCL_CHANNEL


def test_the_target_keeps_one_stream_object_per_current_stream(monkeypatch):
    """coordinator.transport.bound_ipc.current_stream: the current stream's own Stream object, built
    once per stream (a new one when the caller switched streams)."""
    import torch

    from coordinator.transport import bound_ipc

    current = {"id": (3, 0, 1)}
    built = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: current["id"], raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: built.append(current["id"]) or object())
    monkeypatch.setattr(bound_ipc, "_STREAMS", {})
    device = torch.device("cuda", 0)
    first = bound_ipc.current_stream(device)
    assert bound_ipc.current_stream(device) is first and len(built) == 1
    current["id"] = (7, 0, 1)  # the caller's stream changed
    second = bound_ipc.current_stream(device)
    assert second is not first and built == [(3, 0, 1), (7, 0, 1)]
    current["id"] = (3, 0, 1)
    assert bound_ipc.current_stream(device) is first


def test_the_host_waits_for_the_drafts_where_the_drafter_shares_the_targets_gpu(monkeypatch):
    """bound_ipc.same_gpu: the drafter's CudaIpcSupport names its own GPU first; only that GPU being
    the target's (two contexts time-slicing one GPU) makes the host, not the stream, wait."""
    from types import SimpleNamespace

    import torch

    from coordinator.transport import bound_ipc
    from drafter.wire import schema

    monkeypatch.setattr(bound_ipc.cuda_ref, "device_uuid", lambda device: f"GPU-{device.index}")
    own_first = schema.CudaIpcSupport(enabled=True, host_id="h", device_uuids=["GPU-0", "GPU-1"])
    assert bound_ipc.same_gpu(own_first, torch.device("cuda", 0))
    assert not bound_ipc.same_gpu(own_first, torch.device("cuda", 1)), "a peer GPU: the stream waits"
    assert not bound_ipc.same_gpu(schema.CudaIpcSupport(enabled=False, device_uuids=["GPU-0"]), torch.device("cuda", 0))
    assert not bound_ipc.same_gpu(None, torch.device("cuda", 0))
    assert not bound_ipc.same_gpu(own_first, torch.device("cpu"))

    calls = []
    slabs = SimpleNamespace(synchronize=lambda event: calls.append(("host", event)),
                            wait=lambda event, device: calls.append(("stream", event)))
    link = SimpleNamespace(host_wait=True, slabs=slabs, _events=("ev",), last_step=1, _waited_ns=5, _torch=False,
                           device=torch.device("cpu"))
    bound_ipc.IpcLink._arrive(link)
    assert calls == [("host", "ev")] and link._waited_ns > 5, "the host's wait counts as waiting, not host work"
    link.host_wait = False
    bound_ipc.IpcLink._arrive(link)
    assert calls[-1] == ("stream", "ev")
