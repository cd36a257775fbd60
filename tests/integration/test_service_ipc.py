"""ZMQ over ipc:// (a target and its drafter on one host): same drafts as in-process, same
security (a private socket file, CURVE as on tcp://), refused on paths anyone could hijack."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from coordinator.transport import ZmqDrafterClient
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import SERVER_SETTINGS, SESSION_BLOCKS, reference_engine
from tests.integration.test_service_parity import plans, scenario
from tests.support.auth_material import write_curve
from tests.support.engines import tiny_dirs
from tests.support.servers import DrafterServer, layout_for


@pytest.fixture(scope="module")
def ipc_server(tiny_root, tmp_path_factory, one_torch_thread):
    run = tmp_path_factory.mktemp("run")
    os.chmod(run, 0o700)
    _, model = tiny_dirs(tiny_root, "eagle3")
    server = DrafterServer(model, "eagle3", log_path=run / "server.log", kv_blocks=4 * SESSION_BLOCKS,
                           block_sizes=16, zmq_ipc=run / "drafter.sock", **SERVER_SETTINGS)
    with server:
        yield server, run / "drafter.sock"
    assert not (run / "drafter.sock").exists(), "the socket file goes with the server"


def test_ipc_drafts_equal_in_process_and_the_socket_is_private(ipc_server, tiny_root):
    server, path = ipc_server
    assert server.ready["zmq_ipc"] == f"ipc://{path}"
    st_ = os.stat(path)
    assert stat.S_ISSOCK(st_.st_mode) and stat.S_IMODE(st_.st_mode) == 0o600
    for endpoint in (server.ready["zmq_ipc"], server.zmq_endpoint):  # tcp:// keeps working beside it
        with ZmqDrafterClient(endpoint, timeout_s=30) as client:
            client.attach(layout_for(client.info(), SESSION_BLOCKS))
            engine = reference_engine(tiny_root)
            remote_scn, local_scn = scenario(engine, 5), scenario(engine, 5)
            for i, plan in enumerate(plans()):
                want = engine.propose(**local_scn.call(plan).kwargs).draft_token_ids
                got = client.propose(**remote_scn.call(plan).kwargs).draft_token_ids
                assert torch.equal(got, want), f"{endpoint} step {i}"
            client.detach()


def test_ipc_refusals_answer_like_tcp(ipc_server):
    server, _ = ipc_server
    with ZmqDrafterClient(server.ready["zmq_ipc"], timeout_s=30) as client:
        client.session.session_id, client.session.epoch = "nope", 1
        with pytest.raises(DrafterError) as e:
            client.propose(target_token_ids=torch.zeros(1, dtype=torch.int64))
    assert e.value.code in (Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION)


def test_curve_applies_on_ipc(tiny_root, tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    material = write_curve(tmp_path)
    _, model = tiny_dirs(tiny_root, "eagle3")
    with DrafterServer(model, "eagle3", log_path=tmp_path / "server.log", kv_blocks=64, block_sizes=16,
                       zmq_ipc=run / "d.sock", **material.serve(), transports="zmq", **SERVER_SETTINGS) as server:
        endpoint = server.ready["zmq_ipc"]
        with ZmqDrafterClient(endpoint, curve=material.config(), timeout_s=10) as c:
            assert c.info().method == "eagle3"
        for curve in (None, material.config("intruder")):
            with ZmqDrafterClient(endpoint, curve=curve, timeout_s=1.0) as c:
                with pytest.raises(DrafterError) as e:
                    c.info()
            assert e.value.code == Code.DEADLINE_EXCEEDED, "an unauthenticated peer gets nothing on ipc either"


@pytest.mark.parametrize("case", ["world-writable-directory", "regular-file", "relative"])
def test_the_server_refuses_bad_ipc_paths(tiny_root, tmp_path, case):
    _, model = tiny_dirs(tiny_root, "eagle3")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "d.sock"
    if case == "world-writable-directory":
        os.chmod(run, 0o777)
    elif case == "regular-file":
        path.write_text("precious")
    server = DrafterServer(model, "eagle3", log_path=tmp_path / "server.log", kv_blocks=64, block_sizes=16,
                           zmq_ipc="run/d.sock" if case == "relative" else path, **SERVER_SETTINGS)
    with pytest.raises(RuntimeError) as e:
        server.start(until="ready", timeout=60)
    code = server.stop()
    assert code != 0
    assert "ipc://" in str(e.value) + server.log_tail(), "the refusal names the ipc path"
    if case == "regular-file":
        assert path.read_text() == "precious"
    else:
        assert not path.exists()
