"""Fuzzing both transports with malformed messages (hypothesis), against a real server.

Every message breaks one thing: random bytes, wrong types, inconsistent shapes, out-of-range
ids and positions.  The server must answer each with the right code naming the field, never
die, and a healthy session stepping before and after the campaign must get exactly the drafts
an in-process engine gives it alone.  At least MIN_MESSAGES messages per run, both transports.
"""

from __future__ import annotations

import queue
import random

import grpc
import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from coordinator.transport import GrpcDrafterClient
from drafter.wire import schema
from drafter.wire.errors import FIELD_METADATA_KEY, Code
from tests.integration.conftest import K, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import scenario
from tests.support import fuzz
from tests.support.servers import layout_for

MIN_MESSAGES = 10_000
# (examples, messages per example) per test; all tests of this module together send > MIN_MESSAGES
GRPC_EXAMPLES, ZMQ_EXAMPLES, PER_EXAMPLE = 700, 700, (6, 10)
# No shrinking: every failure message names the mutation and its seed, which reproduces it exactly,
# and shrinking through a live server takes minutes.
FUZZ = dict(deadline=None, derandomize=True, database=None, print_blob=True, phases=(Phase.explicit, Phase.generate),
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SENT = {"grpc": 0, "zmq": 0}

HEALTHY_PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, 4, 1), (1, 4, 0)], [(0, 4, 0), (1, 4, 2)], [(1, 4, 3), (0, 4, 0)]]


@pytest.fixture(scope="module")
def campaign(eagle3_server, tiny_root):
    """A healthy session (its first two steps before the fuzzing, the rest after) and a fuzz target."""
    healthy = GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30)
    info = healthy.info()
    healthy.attach(layout_for(info, SESSION_BLOCKS, client_name="healthy"))
    solo = reference_engine(tiny_root)
    remote, local = scenario(solo, 11), scenario(solo, 11)

    def step(i):
        got = healthy.propose(**remote.call(HEALTHY_PLANS[i]).kwargs).draft_token_ids
        want = solo.propose(**local.call(HEALTHY_PLANS[i]).kwargs).draft_token_ids
        assert torch.equal(got, want), f"healthy session, step {i}"

    step(0)
    step(1)
    victim = GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30)
    victim.attach(layout_for(info, SESSION_BLOCKS, client_name="fuzz"))
    ctx = fuzz.Ctx(epoch=victim.session.epoch, session_id=victim.session.session_id, vocab=info.limits.vocab_size,
                   max_model_len=info.limits.max_model_len, session_blocks=SESSION_BLOCKS,
                   block_size=info.limits.kv_groups[0].block_size, k=K, max_num_seqs=info.limits.max_num_seqs,
                   max_tokens=info.limits.max_num_batched_tokens, hidden_width=info.limits.hidden_width)
    base = fuzz.template(scenario(solo, 12).call([(0, 5, 0), (1, 4, 0)]).kwargs, ctx)
    yield ctx, base, step
    step(2)
    step(3)
    for c in (healthy, victim):
        c.detach()
        c.close()
    assert eagle3_server.proc.poll() is None, "the server died"


def _grpc_error(exc: grpc.RpcError) -> tuple[str, str]:
    field = dict(exc.trailing_metadata() or ()).get(FIELD_METADATA_KEY, "")
    return exc.code().name, field


def _oracle_for_grpc_bytes(raw: bytes, ctx) -> tuple[str, str] | None:
    """What random bytes must get; None when they happen to be a well-formed request."""
    from drafter._proto.drafter.v1 import drafter_pb2 as pb
    from drafter.wire.errors import DrafterError
    from drafter.wire.tensors import request_from_proto
    try:
        req = pb.ProposeRequest.FromString(raw)
    except Exception:  # noqa: BLE001
        return "INVALID_ARGUMENT", "request"
    try:
        request_from_proto(req)
    except DrafterError as e:
        return e.code.name, e.field
    if req.epoch != ctx.epoch:
        return "FAILED_PRECONDITION", "epoch"
    return None


def test_grpc_fuzz(eagle3_server, campaign):
    ctx, base, _ = campaign
    channel = grpc.insecure_channel(eagle3_server.grpc_target)
    ident = lambda b: b  # noqa: E731 - raw bytes both ways: we send what no client library would
    unary = channel.unary_unary("/drafter.v1.Drafter/Propose", ident, ident)
    requests: queue.Queue = queue.Queue()
    responses = channel.stream_stream("/drafter.v1.Drafter/ProposeStream", ident, ident)(iter(requests.get, None))
    from drafter._proto.drafter.v1 import drafter_pb2 as pb

    def send(raw: bytes, use_stream: bool) -> tuple[str, str]:
        if use_stream:
            requests.put(raw)
            resp = pb.ProposeResponse.FromString(next(responses))
            assert resp.HasField("error"), "a malformed message got drafts"
            return Code(resp.error.code).name, resp.error.field
        try:
            unary(raw, timeout=30)
        except grpc.RpcError as exc:
            return _grpc_error(exc)
        raise AssertionError("a malformed message got drafts")

    @settings(max_examples=GRPC_EXAMPLES, **FUZZ)
    @given(st.lists(st.one_of(
        st.tuples(st.just("mutation"), st.integers(0, len(fuzz.MUTATIONS) - 1), st.integers(0, 2**32)),
        st.tuples(st.just("bytes"), st.binary(max_size=300), st.just(0))), min_size=PER_EXAMPLE[0],
        max_size=PER_EXAMPLE[1]), st.randoms(use_true_random=False))
    def run(items, rnd):
        for kind, a, b in items:
            if kind == "mutation":
                msg, code, field = fuzz.mutate(base, a, b, ctx)
                raw = msg.to_proto()
            else:
                raw = a
                expected = _oracle_for_grpc_bytes(raw, ctx)
                if expected is None:
                    continue
                code, field = expected
            got = send(raw, use_stream=rnd.random() < 0.8)
            SENT["grpc"] += 1
            assert got == (code, field), f"{kind} {a if kind == 'mutation' else raw!r}: got {got}"

    run()
    requests.put(None)
    channel.close()


def test_zmq_fuzz(eagle3_server, campaign):
    ctx, base, _ = campaign
    zctx = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(eagle3_server.zmq_endpoint)
    header, frames = base.to_zmq_header()
    envelope = msgspec.msgpack.Decoder(schema.Envelope)

    def send(parts: list) -> tuple[str, str]:
        sock.send_multipart(parts)
        assert sock.poll(30_000), "no reply: the server must answer every message"
        reply = sock.recv_multipart()
        env = envelope.decode(reply[1] if reply[0] == b"" else reply[0])
        assert env.error is not None, "a malformed message got drafts"
        return Code(env.error.code).name, env.error.field

    def envelope_fault(rnd) -> tuple[list, str | None]:
        env = fuzz.zmq_envelope()
        body = fuzz.encode_header(header)
        how = rnd.randrange(5)
        if how == 0:
            return [b"", fuzz.zmq_envelope(method=rnd.choice(["", "propose", "Proposee", "ProposeStream", "x" * 50])),
                    body, *frames], "method"
        if how == 1:
            return [b"", env], "body"
        if how == 2:
            return [b"", env, body, *frames[:-1]], "slot_mappings[0]"  # the last tensor's frame is missing
        if how == 3:
            return [b"", fuzz.zmq_envelope(method="Info"), b"", b"junk"], "frames"
        return [b"", msgspec.msgpack.encode({"call_id": "x", "method": "Propose"}), body, *frames], "call_id"

    @settings(max_examples=ZMQ_EXAMPLES, **FUZZ)
    @given(st.lists(st.one_of(
        st.tuples(st.just("mutation"), st.integers(0, len(fuzz.MUTATIONS) - 1), st.integers(0, 2**32)),
        st.tuples(st.just("types"), st.integers(0, 2**32), st.just(0)),
        st.tuples(st.just("envelope"), st.integers(0, 2**32), st.just(0)),
        st.tuples(st.just("frames"), st.lists(st.binary(max_size=64), min_size=1, max_size=6), st.just(0))),
        min_size=PER_EXAMPLE[0], max_size=PER_EXAMPLE[1]))
    def run(items):
        for kind, a, b in items:
            if kind == "mutation":
                msg, code, field = fuzz.mutate(base, a, b, ctx)
                h, f = msg.to_zmq_header()
                got = send([b"", fuzz.zmq_envelope(), fuzz.encode_header(h), *f])
                assert got == (code, field), f"mutation {fuzz.MUTATIONS[a % len(fuzz.MUTATIONS)].__name__} " \
                                             f"seed {b}: got {got}"
            elif kind == "types":
                h, field = fuzz.confuse_header(header, random.Random(a))
                got = send([b"", fuzz.zmq_envelope(), fuzz.encode_header(h), *frames])
                assert got == ("INVALID_ARGUMENT", field), f"type confusion seed {a}: got {got}"
            elif kind == "envelope":
                parts, field = envelope_fault(random.Random(a))
                got = send(parts)
                assert got == ("INVALID_ARGUMENT", field), f"envelope fault seed {a}: got {got}"
            else:  # random frames after the delimiter
                got = send([b"", *a])
                assert got[0] == "INVALID_ARGUMENT" and got[1], f"random frames {a!r}: got {got}"
            SENT["zmq"] += 1

    run()
    sock.close()
    zctx.term()


def test_campaign_size_and_health(eagle3_server, campaign):
    """Runs after both campaigns (module order): enough messages, and the server still serves."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    assert SENT["grpc"] > 0 and SENT["zmq"] > 0, "run the whole module: both transports are fuzzed"
    assert SENT["grpc"] + SENT["zmq"] >= MIN_MESSAGES, SENT
    with grpc.insecure_channel(eagle3_server.health_target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    print(f"\n[fuzz] malformed messages answered: grpc {SENT['grpc']}, zmq {SENT['zmq']}")
