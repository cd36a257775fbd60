"""Per-client quotas, the re-attach that replaces a dead session, and the owner check on Propose
(issue 19, items 3 and 4), each on a real `drafter serve` on loopback.

* Without auth a client is its connection: a second session on the same ZMQ connection past
  --max-sessions-per-client, or blocks past --max-kv-blocks-per-client, are RESOURCE_EXHAUSTED
  naming the flag; another connection still gets its own.
* With mTLS and CURVE, a session belongs to the peer that attached it: another peer's Propose on it,
  over either transport, is NOT_FOUND (as for an unknown id).  The same peer attaching again under
  the same client_name (a target restarted after dying without Detach) replaces its old session at
  once: the pool would not hold both.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire import bound as wb
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import plans, scenario
from tests.support.auth_material import AuthMaterial, write_auth
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer, layout_for


def _refused(fn, code: Code, field: str) -> DrafterError:
    with pytest.raises(DrafterError) as e:
        fn()
    assert (e.value.code, e.value.field) == (code, field), e.value
    return e.value


@pytest.fixture(scope="module")
def eagle3(tiny_root):
    return tiny_dirs(tiny_root, "eagle3")[1]


def test_session_and_block_quotas_per_connection(eagle3, tmp_path, one_torch_thread):
    with DrafterServer(eagle3, "eagle3", log_path=tmp_path / "server.log", kv_blocks=256, block_sizes=16,
                       max_sessions_per_client=1, max_kv_blocks_per_client=48, **SERVER_SETTINGS) as server, \
            ZmqDrafterClient(server.zmq_endpoint, timeout_s=10) as first, \
            ZmqDrafterClient(server.zmq_endpoint, timeout_s=10) as second:
        info = first.info()
        first.attach(layout_for(info, 32, client_name="w0"))
        err = _refused(lambda: first.attach(layout_for(info, 8, client_name="w1")), Code.RESOURCE_EXHAUSTED,
                       "session")
        assert "--max-sessions-per-client 1" in err.message
        err = _refused(lambda: second.attach(layout_for(info, 49, client_name="w1")), Code.RESOURCE_EXHAUSTED,
                       "kv_groups[0].num_blocks")
        assert "--max-kv-blocks-per-client 48" in err.message
        second.attach(layout_for(info, 48, client_name="w1"))  # exactly its quota, on its own connection
        assert first.info().num_sessions == 2


@pytest.fixture(scope="module")
def authed(eagle3, tmp_path_factory, one_torch_thread):
    """mTLS and CURVE; a pool that holds one scenario session and not two; a re-attach replaces a session
    however recently it was used (--replace-idle-s 0: the test need not wait for it to go quiet)."""
    d = tmp_path_factory.mktemp("pki-quotas")
    auth = write_auth(d)
    with DrafterServer(eagle3, "eagle3", log_path=d / "server.log", kv_blocks=SESSION_BLOCKS + 16, block_sizes=16,
                       **auth.serve(), replace_idle_s=0, **SERVER_SETTINGS) as server:
        yield server, auth


def _grpc_as(server, auth: AuthMaterial, name: str) -> GrpcDrafterClient:
    return GrpcDrafterClient(server.grpc_target, tls=auth.mtls.client(name), timeout_s=10)


def _zmq_curve(server, auth: AuthMaterial) -> ZmqDrafterClient:
    return ZmqDrafterClient(server.zmq_endpoint, timeout_s=10, curve=auth.curve.config())


def test_propose_on_another_peers_session_is_not_found(authed, tiny_root):
    server, auth = authed
    ref = reference_engine(tiny_root)
    steps = list(plans())
    with _grpc_as(server, auth, "owner") as owner, _grpc_as(server, auth, "thief") as thief, \
            _zmq_curve(server, auth) as zmq_thief:
        owner.attach(layout_for(owner.info(), SESSION_BLOCKS, client_name="dp0"))
        s = scenario(ref, 5)
        want = ref.propose(**s.call(steps[0]).kwargs).draft_token_ids
        kw = scenario(ref, 5).call(steps[0]).kwargs
        for other in (thief, zmq_thief):  # another certificate; an authorised CURVE key on the other transport
            other.session.session_id, other.session.epoch = owner.session.session_id, owner.session.epoch
            _refused(lambda: other.propose(**kw), Code.NOT_FOUND, "session_id")
        assert torch.equal(owner.propose(**kw).draft_token_ids, want), "the owner's session is untouched"
        owner.detach()


def test_the_same_peer_reattaching_replaces_its_dead_session(authed, tiny_root):
    server, auth = authed
    ref = reference_engine(tiny_root)
    kw = scenario(ref, 6).call(next(plans())).kwargs
    want = ref.propose(**kw).draft_token_ids
    dead = _grpc_as(server, auth, "target-a")  # dies without Detach
    dead.attach(layout_for(dead.info(), SESSION_BLOCKS, client_name="dp0"))
    old_id = dead.session.session_id
    with _grpc_as(server, auth, "target-b") as other, _grpc_as(server, auth, "target-a") as restarted:
        layout = layout_for(other.info(), SESSION_BLOCKS, client_name="dp0")
        _refused(lambda: other.attach(layout), Code.RESOURCE_EXHAUSTED, "kv_groups[0].num_blocks")
        restarted.attach(layout)  # the same peer and client_name: the old session goes, its blocks with it
        assert restarted.session.session_id != old_id
        assert torch.equal(restarted.propose(**kw).draft_token_ids, want), "a fresh session, wiped blocks"
        _refused(lambda: dead.propose(**kw), Code.NOT_FOUND, "session_id")
        assert restarted.info().num_sessions == 1
        restarted.detach()
    dead.close()


def _bind_reply(client: ZmqDrafterClient, session_id: str, epoch: int, info) -> schema.Envelope:
    """A well-formed Bind (host ring, a full buffer layout) for session_id sent on client's connection;
    the reply's envelope."""
    n, b, width = 16, 2, info.limits.hidden_width
    buffers = [wb.BufferSpec("target_token_ids", "int64", [n]), wb.BufferSpec("target_positions", "int64", [n]),
               wb.BufferSpec(wb.HIDDEN, "float32", [n, width]), wb.BufferSpec("next_token_ids", "int64", [b]),
               wb.BufferSpec("query_start_loc", "int64", [b + 1]), wb.BufferSpec("seq_lens", "int64", [b])]
    for g, group in enumerate(info.limits.kv_groups):
        buffers += [wb.BufferSpec(f"block_tables[{g}]", "int64", [b, -(-info.limits.max_model_len // group.block_size)]),
                    wb.BufferSpec(f"slot_mappings[{g}]", "int64", [n])]
    body = wb.BindRequest(session_id=session_id, epoch=epoch, buffers=buffers, max_batch=b)
    env = schema.Envelope(call_id=1, method=wb.BIND_METHOD)
    reply = client.send_raw([b"", wb.encode(env), wb.encode(body)])
    return msgspec.msgpack.decode(reply[1], type=schema.Envelope)


def test_bind_on_another_peers_session_is_not_found(authed):
    """Bind (issue 18) looks the session up with its owner as Propose does: another peer binding a
    session it did not attach gets NOT_FOUND, as for an unknown id; its own session is found."""
    server, auth = authed
    with _grpc_as(server, auth, "owner") as owner, _zmq_curve(server, auth) as zmq_thief:
        info = owner.info()
        owner.attach(layout_for(info, SESSION_BLOCKS, client_name="dp0"))
        env = _bind_reply(zmq_thief, owner.session.session_id, int(owner.session.epoch), info)
        assert env.error is not None and (env.error.code, env.error.field) == (Code.NOT_FOUND, "session_id"), env
        zmq_thief.attach(layout_for(info, 8, client_name="own"))
        env = _bind_reply(zmq_thief, zmq_thief.session.session_id, int(zmq_thief.session.epoch), info)
        assert env.error is None or env.error.code != Code.NOT_FOUND, env  # its own session exists for it
        zmq_thief.detach()
        owner.detach()
