"""Bound sessions under auth (issue 19, item 3: every listening transport requires auth, or is refused).

A drafter service in this process (tests.integration.test_bound_remote.Drafter's loop, here with CURVE
and a client allow list generated in tmp_path) serves HostRingClients.  With CURVE on:
* a host-ring binding's data socket is a CURVE server: the allowed client's steps draft what an
  in-process engine drafts; a plaintext client, or one whose key is not on the allow list, that
  sends a step with the right bind id to that socket gets no reply at all;
* a Bind for the ring stream over tcp (not authenticated) is refused naming "stream", and the client
  binds again without it and drafts on the data socket; over ipc (a same-host abstract UNIX name) the
  stream is served;
* a Bind for a channel plane (a TCPStore and gloo/NCCL over plain tcp) is refused naming "plane";
* with --insecure-bound-planes (BoundAuth.insecure_planes) the ring stream over tcp is served;
* a binding's data socket completes the handshake only for the key that made the Bind: another
  client whose key is on the allow list, holding the endpoint and bind id, gets no reply and runs nothing.
"""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import torch

from tests.integration.test_bound_remote import (DEADLINE_S, MAX_BATCH, PADDING, PLANS, Drafter,
                                                 ProposerTarget, Target, _buffers, _engine)

from coordinator.transport.bound_client import _ATTACH, HostRingClient  # noqa: E402
from coordinator.transport.zmq_client import CurveConfig  # noqa: E402
from drafter.service.bound_sessions import BoundAuth  # noqa: E402
from drafter.service.zmq_server import ZmqServer  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.errors import Code, DrafterError  # noqa: E402
from tests.support.auth_material import Curve, write_curve, zmq_exchange  # noqa: E402

NOTHING_S = 1.0  # how long a client the data socket must not serve waits for a reply
# DEADLINE_S (test_bound_remote's, 120 s): how long a call that must be served may take.  Speed is no subject
# here (auth is): a fresh `drafter serve`'s first Bind also imports the graph runner and Triton (~2 s).


class CurveDrafter(Drafter):
    """Drafter with CURVE on its ZMQ (curve's allow list) and the given BoundAuth."""

    def __init__(self, engine, curve: Curve, auth: BoundAuth | None = None, ipc_path: str | None = None):
        super().__init__(engine, ipc_path=ipc_path)
        self.curve, self.auth = curve, auth

    def _server(self, core) -> ZmqServer:
        server = ZmqServer(core, host="127.0.0.1", port=0, max_message_bytes=1 << 24, ipc_path=self.ipc_path,
                           **self.curve.serve())
        if self.auth is not None:
            server.bound_auth = self.auth
        return server


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Curve:
    """Only "client" is allowed; "intruder" has a key, not on the list."""
    return write_curve(tmp_path_factory.mktemp("curve"))


class CurveTarget(Target):
    """A Target whose HostRingClient speaks CURVE with the allowed client's keys."""

    def __init__(self, root, drafter: CurveDrafter, seed: int, transport: str = "tcp", plane: str = wb.HOST_RING):
        self.root, self.method = root, "eagle3"
        curve = drafter.curve.config()
        self.client = HostRingClient(drafter.endpoint if transport == "tcp" else drafter.server.ipc_endpoint,
                                     self._layout(drafter), _buffers(drafter.engine), max_batch=MAX_BATCH,
                                     transport=transport, plane=plane, timeout_s=DEADLINE_S, curve=curve)
        self.reset(seed)


def _step_message(client: HostRingClient) -> list[bytes]:
    """A step for the client's binding (its bind id) that the drafter answers at once, before the
    engine runs: batch 0 (refused naming "batch_size", after the bind id was accepted)."""
    head = wb.StepHeader(step=1, num_tokens=1, batch=0, nbytes=client.ring.step_bytes(1),
                         bind_id=client.link.resp.bind_id)
    return [wb.encode(head), bytes(client.ring.bytes[:head.nbytes])]


def _answer(endpoint: str, message: list[bytes], curve: CurveConfig | None, wait_s: float) -> wb.StepDone | None:
    """What a DEALER connecting to endpoint (with curve, or plaintext) gets back for message within
    wait_s: the StepDone, or None (the message stays queued where the handshake fails)."""
    reply = zmq_exchange(endpoint, message, curve, wait_s)
    return None if reply is None else wb.DONE_DECODER.decode(reply[0])


def test_the_data_socket_serves_only_the_allowed_curve_key(tiny_root, keys):
    """The stream refused over tcp, the client drafts on the CURVE data socket what in-process drafts;
    a plaintext or unlisted-key client with the right bind id gets no reply; the allowed key does."""
    with CurveDrafter(_engine(tiny_root, "eagle3"), keys) as drafter:
        t = CurveTarget(tiny_root, drafter, seed=1)
        try:
            t.step(PLANS[0])
            link = t.client.link
            assert link.resp.stream == "" and link.conn is None and not t.client.stream, \
                "the ring stream over tcp was refused: the steps go on the data socket"
            t.step(PLANS[1])
            message, endpoint = _step_message(t.client), link.resp.endpoint
            t0 = time.monotonic()
            done = _answer(endpoint, message, keys.config(), wait_s=DEADLINE_S)
            took = time.monotonic() - t0
            assert done is not None and (done.code, done.field) == (Code.INVALID_ARGUMENT, "batch_size"), done
            wait = max(NOTHING_S, 10 * took)  # far longer than the allowed key's answer took
            assert _answer(endpoint, message, None, wait) is None, "a plaintext client was answered on the data socket"
            assert _answer(endpoint, message, keys.config("intruder"), wait) is None, \
                "a key not on the allow list was answered"
        finally:
            t.close()


def test_a_bind_for_the_tcp_ring_stream_or_a_channel_is_refused_by_name(tiny_root, keys):
    with CurveDrafter(_engine(tiny_root, "eagle3"), keys) as drafter:
        t = CurveTarget(tiny_root, drafter, seed=1)
        c = t.client
        try:
            deadline = time.monotonic() + DEADLINE_S
            c.session = c._call("Attach", c.layout, _ATTACH, deadline)
            req = wb.BindRequest(session_id=c.session.session_id, epoch=c.session.epoch, transport="tcp",
                                 plane=wb.HOST_RING, buffers=c.ring.buffers, max_batch=MAX_BATCH, stream=True)
            with pytest.raises(DrafterError) as err:
                c._call(wb.BIND_METHOD, req, wb.BIND_RESPONSE_DECODER, deadline)
            assert (err.value.code, err.value.field) == (Code.FAILED_PRECONDITION, "stream"), err.value
            assert "--insecure-bound-planes" in err.value.message
            for plane in wb.CHANNELS:
                with pytest.raises(DrafterError) as err:
                    c._call(wb.BIND_METHOD, msgspec.structs.replace(req, plane=plane, stream=False),
                            wb.BIND_RESPONSE_DECODER, deadline)
                assert (err.value.code, err.value.field) == (Code.FAILED_PRECONDITION, "plane"), (plane, err.value)
            assert not drafter.server._bound_plane.sessions, "nothing was bound"
        finally:
            t.close()


def test_the_ring_stream_on_a_same_host_name_is_served_under_curve(tiny_root, keys, tmp_path):
    with CurveDrafter(_engine(tiny_root, "eagle3"), keys, ipc_path=str(tmp_path / "zmq.sock")) as drafter:
        t = CurveTarget(tiny_root, drafter, seed=2, transport="ipc")
        try:
            t.step(PLANS[0])
            link = t.client.link
            assert link.resp.stream and not link.resp.stream.startswith("tcp://") and link.conn is not None, \
                link.stream_reason
            link.sock.close(linger=0)  # only the stream can carry the next step
            t.step(PLANS[1])
        finally:
            t.close()


def test_insecure_bound_planes_serves_the_tcp_ring_stream(tiny_root, keys):
    auth = BoundAuth(required=True, insecure_planes=True)
    with CurveDrafter(_engine(tiny_root, "eagle3"), keys, auth=auth) as drafter:
        t = CurveTarget(tiny_root, drafter, seed=3)
        try:
            t.step(PLANS[0])
            link = t.client.link
            assert link.resp.stream.startswith("tcp://") and link.conn is not None, link.stream_reason
            link.sock.close(linger=0)
            t.step(PLANS[1])
        finally:
            t.close()



def test_the_remote_proposer_binds_over_curve_and_drafts_what_in_process_drafts(tiny_root, keys):
    """BoundTransport under ServiceTransport(curve=...): its control and data sockets speak CURVE with
    the ZMQ client's keys, the tcp ring stream is refused and it binds again without; both steps go bound."""
    from coordinator.clients import ServiceTransport

    curve = keys.config()
    with CurveDrafter(_engine(tiny_root, "eagle3"), keys) as drafter:
        p = ProposerTarget(tiny_root, "eagle3", drafter, seed=4, deadline_s=DEADLINE_S, transport="tcp")
        p.proposer.connect = lambda ep: ServiceTransport(ep, timeout_s=DEADLINE_S, curve=curve)
        try:
            assert p.proposer.start(), "attached"
            assert p.step(PLANS[0]) is not None and p.step(PLANS[1]) is not None, list(p.proposer.events)
            t = p.transport
            assert t.steps == {"bound": 2, "unbound": 0}, t.steps
            assert t.link.resp.stream == "" and t.link.conn is None, "the tcp ring stream was refused"
            assert t.link.resp.endpoint.startswith("tcp://")
        finally:
            p.close()


# ---------------------------------------------------------------- `drafter serve`: the flag, end to end
def _bind_refusal(endpoint: str, curve: CurveConfig | None, plane: str = wb.HOST_RING) -> DrafterError:
    """Attach, then Bind with the ring stream over tcp on a `drafter serve` (its Info's sizes): the
    refusal (a CPU `drafter serve` has no graphs, so a Bind past the auth checks is refused "engine")."""
    from coordinator.transport import ZmqDrafterClient
    from tests.support.servers import layout_for

    with ZmqDrafterClient(endpoint, curve=curve, timeout_s=DEADLINE_S) as c:
        info = c.info()
    lim = info.limits
    buffers = [wb.BufferSpec("target_token_ids", "int64", [8]), wb.BufferSpec("target_positions", "int64", [8]),
               wb.BufferSpec(wb.HIDDEN, "float32", [8, lim.hidden_width]),
               wb.BufferSpec("next_token_ids", "int64", [2]), wb.BufferSpec("query_start_loc", "int32", [3]),
               wb.BufferSpec("seq_lens", "int32", [2])]
    for g in range(len(lim.kv_groups)):
        buffers += [wb.BufferSpec(f"block_tables[{g}]", "int32", [2, 4]),
                    wb.BufferSpec(f"slot_mappings[{g}]", "int64", [8])]
    client = HostRingClient(endpoint, layout_for(info, 8, max_num_seqs=2, max_num_batched_tokens=8), buffers,
                            max_batch=2, timeout_s=DEADLINE_S, curve=curve)
    try:
        deadline = time.monotonic() + DEADLINE_S
        s = client._call("Attach", client.layout, _ATTACH, deadline)
        req = wb.BindRequest(session_id=s.session_id, epoch=s.epoch, transport="tcp", plane=plane, buffers=buffers,
                             max_batch=2, stream=plane == wb.HOST_RING)
        with pytest.raises(DrafterError) as err:
            client._call(wb.BIND_METHOD, req, wb.BIND_RESPONSE_DECODER, deadline)
        return err.value
    finally:
        client.close()


def test_serve_refuses_the_tcp_stream_under_mtls_and_serves_it_with_the_flag(tiny_root, keys, tmp_path,
                                                                             one_torch_thread):
    """mTLS alone (ZMQ opted out with --insecure-zmq) still requires the bound planes' auth: the stream
    over tcp and the channels are refused by name; with CURVE and --insecure-bound-planes a Bind for the
    stream passes the auth checks (refused only for this CPU server's engine), and the flag is logged."""
    from tests.integration.conftest import SERVER_SETTINGS
    from tests.support.auth_material import write_mtls
    from tests.support.engines import tiny_dirs
    from tests.support.servers import DrafterServer

    _, model = tiny_dirs(tiny_root, "eagle3")
    mtls = write_mtls(tmp_path)
    with DrafterServer(model, "eagle3", log_path=tmp_path / "a.log", kv_blocks=64, block_sizes=16, **mtls.serve(),
                       insecure_zmq="true", **SERVER_SETTINGS) as server:
        err = _bind_refusal(server.zmq_endpoint, None)
        assert (err.code, err.field) == (Code.FAILED_PRECONDITION, "stream"), err
        err = _bind_refusal(server.zmq_endpoint, None, plane=wb.GLOO_CHANNEL)
        assert (err.code, err.field) == (Code.FAILED_PRECONDITION, "plane"), err
    log = tmp_path / "b.log"
    with DrafterServer(model, "eagle3", log_path=log, kv_blocks=64, block_sizes=16, transports="zmq",
                       **keys.serve(), insecure_bound_planes="true", **SERVER_SETTINGS) as server:
        assert _bind_refusal(server.zmq_endpoint, keys.config()).field == "engine"
    warnings = [json.loads(ln) for ln in log.read_text().splitlines() if "insecure_transport" in ln]
    assert [w["transport"] for w in warnings] == ["bound_planes"] and warnings[0]["level"] == "warning"


def test_an_armed_cuda_ipc_binding_drafts_over_curve(tiny_root, two_clients, monkeypatch):
    """CudaIpcBoundClient(curve=...): its control and data sockets CURVE clients with the allowed key;
    the cuda_ipc plane (LocalSlabs on CPU; same-host by construction) binds armed and drafts what an
    in-process engine drafts.  Its data socket (headers only) admits only the binder's key: A's key is
    answered there, B's (on the allow list too) gets nothing, and A drafts on."""
    from tests.integration.test_bound_ipc import IpcTarget

    from coordinator.transport.bound_ipc import CudaIpcBoundClient
    from drafter.service import bound_ipc
    from drafter.wire.cuda_slab import LocalSlabs

    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())
    with CurveDrafter(_engine(tiny_root, "eagle3"), two_clients) as drafter:
        t = IpcTarget(tiny_root, "eagle3", drafter, seed=4)
        plain = t.client
        curve = two_clients.config()
        t.client = CudaIpcBoundClient(drafter.endpoint, plain.layout, plain.buffers, max_batch=plain.max_batch,
                                      device="cpu", timeout_s=DEADLINE_S, allow_fallback=False, slabs=LocalSlabs(),
                                      curve=curve)
        plain.close()
        try:
            t.step(PLANS[0])
            assert t.client.plane == wb.CUDA_IPC and t.client.link.armed
            resp = t.client.link.resp
            header = [wb.encode(wb.StepHeader(step=1, num_tokens=1, batch=0, nbytes=0, bind_id=resp.bind_id))]
            t0 = time.monotonic()
            assert _answer(resp.endpoint, header, curve, wait_s=DEADLINE_S) is not None, \
                "the binder's key was not answered"
            wait = max(NOTHING_S, 10 * (time.monotonic() - t0))
            b = two_clients.config("intruder")
            assert _answer(resp.endpoint, header, b, wait) is None, "another allowed key was answered"
            for plan in (PLANS[0], PLANS[0]):
                t.step(plan)
        finally:
            t.client.close()


# ---------------------------------------------------------------- a binding belongs to the key that bound it
@pytest.fixture(scope="module")
def two_clients(tmp_path_factory) -> Curve:
    """Keys and an allow list holding two clients' keys: "client" (A) and "intruder" (B, allowed here)."""
    return write_curve(tmp_path_factory.mktemp("curve2"), allowed=("client", "intruder"))


def _corrupting_step(client: HostRingClient, num_tokens: int, batch: int) -> list[bytes]:
    """A step for the client's binding that, if run, writes KV from other hidden states into the rows of
    the client's last step (its ring's token ids, positions and slots; noise for the hidden states)."""
    from coordinator.transport.bound_client import BoundRing

    ring = BoundRing(client.ring.buffers)
    ring.slab.copy_(client.ring.slab)
    ring.views[wb.HIDDEN].normal_(generator=torch.Generator().manual_seed(7))
    head = wb.StepHeader(step=99, num_tokens=num_tokens, batch=batch, nbytes=ring.step_bytes(num_tokens),
                         bind_id=client.link.resp.bind_id, **PADDING)
    return [wb.encode(head), bytes(ring.bytes[:head.nbytes])]


def test_another_allowed_key_cannot_drive_a_binding(tiny_root, two_clients):
    """Client B, whose key is on the allow list (the control socket answers it), holding A's binding's
    endpoint and bind id: its steps on A's data socket get no answer at all and run nothing (A's session
    counts no call, A's next step drafts what in-process drafts); A's own key is answered there."""
    from coordinator.transport import ZmqDrafterClient

    with CurveDrafter(_engine(tiny_root, "eagle3"), two_clients) as drafter:
        a = CurveTarget(tiny_root, drafter, seed=2)
        try:
            a.step(PLANS[0])
            endpoint, message = a.client.link.resp.endpoint, _step_message(a.client)
            b = two_clients.config("intruder")
            with ZmqDrafterClient(drafter.endpoint, curve=b, timeout_s=DEADLINE_S) as control:
                assert control.info().method, "B's key is allowed on the control socket"
            mine = two_clients.config()
            t0 = time.monotonic()
            done = _answer(endpoint, message, mine, wait_s=DEADLINE_S)
            took = time.monotonic() - t0
            assert done is not None and (done.code, done.field) == (Code.INVALID_ARGUMENT, "batch_size"), done
            session = drafter.core.sessions.get(a.client.session.session_id)
            calls = session.calls
            wait = max(NOTHING_S, 10 * took)
            assert _answer(endpoint, message, b, wait) is None, "another allowed key was answered on A's data socket"
            n = sum(q for _, q, _ in PLANS[0])
            assert _answer(endpoint, _corrupting_step(a.client, n, len(PLANS[0])), b, wait) is None
            assert session.calls == calls, "a step of B's ran on A's binding"
            a.step(PLANS[1])  # A's KV as A wrote it: drafts what in-process drafts
        finally:
            a.close()

