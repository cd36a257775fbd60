"""What operators touch: /metrics, the standard health check and reflection, env-only settings."""

from __future__ import annotations

import signal
import threading
import urllib.request

import grpc
import pytest
import torch
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import K, MML, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import scenario
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer, layout_for


def scrape(server) -> dict:
    """{(sample name, frozenset(labels)): value} from /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_metrics_during_a_run(eagle3_server, tiny_root):
    g = GrpcDrafterClient(eagle3_server.grpc_target, timeout_s=30)
    z = ZmqDrafterClient(eagle3_server.zmq_endpoint, timeout_s=30)
    info = g.info()
    for c in (g, z):
        c.attach(layout_for(info, SESSION_BLOCKS))
    before = scrape(eagle3_server)
    engine = reference_engine(tiny_root)
    sg, sz = scenario(engine, 21), scenario(engine, 22)
    plans = [[(0, 8, 0), (1, 8, 0)], [(0, K + 1, 1), (1, K + 1, 0)], [(0, K + 1, 3), (1, K + 1, 2)]]
    done = threading.Event()
    scraped = []

    def scrape_while_running():  # a Prometheus server scraping in the middle of the traffic
        while not done.is_set():
            scraped.append(scrape(eagle3_server))
            done.wait(0.01)
    t = threading.Thread(target=scrape_while_running)
    t.start()
    for plan in plans:
        g.propose(**sg.call(plan).kwargs)
        # explicit reports on ZMQ: the previous step's drafts, 3 and 1 of them accepted
        z.propose(**sz.call(plan).kwargs, accepted_counts=torch.tensor([3, 1]))
    with pytest.raises(DrafterError):
        g.propose(**{**sg.call(plans[0]).kwargs, "seq_lens": torch.tensor([0, 0], dtype=torch.int32)})
    done.set()
    t.join()
    after = scrape(eagle3_server)
    assert scraped, "scraped while the run was going on"
    for transport in ("grpc", "zmq"):
        n = value(after, "drafter_propose_latency_seconds_count", transport=transport, method="Propose") - \
            value(before, "drafter_propose_latency_seconds_count", transport=transport, method="Propose")
        assert n == len(plans), transport
        assert value(after, "drafter_propose_latency_seconds_bucket", transport=transport, method="Propose",
                     le="+Inf") >= n
    assert value(after, "drafter_errors_total", code="INVALID_ARGUMENT", transport="grpc") - \
        value(before, "drafter_errors_total", code="INVALID_ARGUMENT", transport="grpc") == 1
    # acceptance per draft position: gRPC inferred from num_rejected_tokens of decode rows (steps 2, 3:
    # accepted 2, 3, 0, 1), ZMQ reported explicitly (3 and 1, three times)
    verified = {p: value(after, "drafter_draft_tokens_verified_total", position=str(p)) -
                value(before, "drafter_draft_tokens_verified_total", position=str(p)) for p in range(1, K + 1)}
    accepted = {p: value(after, "drafter_accepted_tokens_total", position=str(p)) -
                value(before, "drafter_accepted_tokens_total", position=str(p)) for p in range(1, K + 1)}
    assert verified == {1: 10, 2: 10, 3: 10}
    assert accepted == {1: 3 + 3 * 2, 2: 2 + 3 * 1, 3: 1 + 3 * 1}
    for p in range(1, K + 1):
        ratio = value(after, "drafter_draft_position_acceptance", position=str(p))
        assert 0 <= ratio <= 1
    for name in ("drafter_batch_size_count", "drafter_padded_batch_size_count", "drafter_engine_step_seconds_count"):
        assert value(after, name) > value(before, name), name
    assert value(after, "drafter_sessions") >= 2
    for c in (g, z):
        c.detach()
        c.close()


def test_standard_health_check_and_reflection(eagle3_server):
    for target in (eagle3_server.grpc_target, eagle3_server.health_target):
        with grpc.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", "drafter.v1.Drafter", "liveness"):
                assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING, (target, service)
            with pytest.raises(grpc.RpcError) as e:
                stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(eagle3_server.grpc_target) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"drafter.v1.Drafter", "grpc.health.v1.Health"} <= services
        # call Info knowing nothing but what reflection says, as grpcurl would
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("drafter.v1.Drafter").FindMethodByName("Info")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        call = ch.unary_unary("/drafter.v1.Drafter/Info", request_cls.SerializeToString, response_cls.FromString)
        info = call(request_cls(), timeout=10)
        assert info.method == "eagle3" and info.state == "serving" and info.limits.max_model_len == MML


def test_env_only_configuration_and_loading_state(tiny_root, tmp_path, one_torch_thread):
    """The container passes no arguments: DRAFTER_* alone configures serve; NOT_SERVING while loading."""
    _, model = tiny_dirs(tiny_root, "eagle3")
    env = {"DRAFTER_METHOD": "eagle3", "DRAFTER_MODEL": str(model / "head"), "DRAFTER_TARGET_MODEL": str(model / "target"),
           "DRAFTER_DEVICE": "cpu", "DRAFTER_HOST": "127.0.0.1", "DRAFTER_GRPC_PORT": "0", "DRAFTER_ZMQ_PORT": "0",
           "DRAFTER_HEALTH_PORT": "0", "DRAFTER_METRICS_PORT": "0", "DRAFTER_MAX_SESSIONS": "3",
           "DRAFTER_BATCH_WINDOW_US": "0", "DRAFTER_DRAIN_TIMEOUT_S": "20", "DRAFTER_LOG_FORMAT": "json",
           "DRAFTER_LOG_LEVEL": "info", "DRAFTER_NUM_SPECULATIVE_TOKENS": "2", "DRAFTER_MAX_MODEL_LEN": "64",
           "DRAFTER_MAX_NUM_SEQS": "4", "DRAFTER_MAX_NUM_BATCHED_TOKENS": "128", "DRAFTER_KV_BLOCKS": "48",
           "DRAFTER_BLOCK_SIZES": "16", "DRAFTER_DTYPE": "float32", "DRAFTER_TORCH_THREADS": "1",
           "DRAFTER_TEST_HOLD_LOADING": "1"}
    server = DrafterServer(None, "eagle3", env=env, env_only=True, log_path=tmp_path / "server.log", cwd=tmp_path)
    try:
        server.start(until="listening")
        for target in (server.grpc_target, server.health_target):
            with grpc.insecure_channel(target) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING, "loading"
        for client in (GrpcDrafterClient(server.grpc_target, timeout_s=10),
                       ZmqDrafterClient(server.zmq_endpoint, timeout_s=10)):
            with pytest.raises(DrafterError) as e:
                client.info()
            assert e.value.code == Code.UNAVAILABLE and "loading" in e.value.message
            client.close()
        server.signal(signal.SIGUSR1)  # the hold ends; the engine loads
        server.ready = server.wait_for("ready")
        with GrpcDrafterClient(server.grpc_target, timeout_s=10) as c:
            info = c.info()
            assert (info.num_speculative_tokens, info.limits.max_model_len, info.max_sessions) == (2, 64, 3)
            assert info.limits.kv_groups[0].num_blocks == 48 and info.limits.max_num_seqs == 4
            c.attach(layout_for(info, 40))
            with pytest.raises(DrafterError) as e:  # 8 of 48 blocks left
                GrpcDrafterClient(server.grpc_target, timeout_s=10).attach(layout_for(info, 9))
            assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "kv_groups[0].num_blocks")
        assert server.stop() == 0
    finally:
        server.stop()
