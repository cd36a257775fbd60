"""CUDA IPC negotiation against a real CPU drafter: it advertises no support (saying why), clients
that opted in send bytes and get the drafts an in-process engine gives, and a reference sent anyway
gets the same clear INVALID_ARGUMENT on every transport while the server keeps serving.
(tests/gpu/test_cuda_ipc.py covers a drafter on a GPU.)"""

from __future__ import annotations

import pytest
import torch

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire.cuda_ref import FIELD
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import scenario
from tests.support.cuda_refs import ref
from tests.support.servers import layout_for

PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0)]]


def _client(server, transport: str):
    if transport == "zmq":
        return ZmqDrafterClient(server.zmq_endpoint, timeout_s=30, share_cuda=True)
    return GrpcDrafterClient(server.grpc_target, timeout_s=30, share_cuda=True)


def _propose(client, transport: str):
    """The client's per-step call for `transport`, and what closes it."""
    if transport != "grpc-stream":
        return client.propose, lambda: None
    stream = client.stream()
    return stream.propose, stream.close


@pytest.mark.parametrize("transport", ["zmq", "grpc-unary", "grpc-stream"])
def test_opted_in_clients_of_a_cpu_drafter_send_bytes_and_get_the_same_drafts(eagle3_server, tiny_root, transport):
    client = _client(eagle3_server, transport)
    info = client.info()
    assert not info.cuda_ipc.enabled and "cpu" in info.cuda_ipc.reason
    client.attach(layout_for(info, SESSION_BLOCKS, client_name=f"cuda-ipc-{transport}"))
    assert not client.session.cuda_ipc.enabled
    propose, close = _propose(client, transport)
    engine = reference_engine(tiny_root)
    remote, local = scenario(engine, 21), scenario(engine, 21)
    for plan in PLANS:
        got = propose(**remote.call(plan).kwargs).draft_token_ids
        assert torch.equal(got, engine.propose(**local.call(plan).kwargs).draft_token_ids)
    assert client.cuda.enabled, "nothing was refused: the client just had no reason to share"
    close()
    client.detach()
    client.close()


@pytest.mark.parametrize("transport", ["zmq", "grpc-unary", "grpc-stream"])
def test_a_reference_sent_to_a_cpu_drafter_is_refused_clearly(eagle3_server, tiny_root, transport):
    client = _client(eagle3_server, transport)
    client.attach(layout_for(client.info(), SESSION_BLOCKS, client_name="cuda-ipc-refused"))
    # a client that shares regardless of what the drafter said (a bug, or an old drafter's answer)
    client.cuda.usable = lambda t, support: client.cuda.enabled
    client.cuda.reference = lambda t: ref(*t.shape)
    propose, close = _propose(client, transport)
    kwargs = scenario(reference_engine(tiny_root), 22).call(PLANS[0]).kwargs
    with pytest.raises(DrafterError) as err:
        propose(**kwargs)
    assert (err.value.code, err.value.field) == (Code.INVALID_ARGUMENT, FIELD)
    assert "does not open CUDA IPC references" in err.value.message and "cpu" in err.value.message
    client.cuda.enabled = False  # the same session carries on with bytes
    assert propose(**kwargs).draft_token_ids.shape == (2, 3)
    close()
    client.detach()
    client.close()
    assert eagle3_server.proc.poll() is None


@pytest.mark.parametrize("transport", ["zmq", "grpc-unary"])
def test_clients_that_do_not_share_see_no_new_field(eagle3_server, transport):
    """What an older client sees: no cuda_ipc in Attach or Info (an older ZMQ client would refuse it)."""
    client = (ZmqDrafterClient(eagle3_server.zmq_endpoint, timeout_s=30) if transport == "zmq"
              else GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30))
    info = client.info()
    assert info.cuda_ipc is None
    assert client.attach(layout_for(info, SESSION_BLOCKS, client_name="no-share")).cuda_ipc is None
    client.detach()
    client.close()
