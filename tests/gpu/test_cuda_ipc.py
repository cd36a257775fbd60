"""On a GPU: hidden states by CUDA IPC reference, between this process and a real `drafter serve`.

Run on a GPU host:  python3 -m pytest -q -m gpu tests/gpu/test_cuda_ipc.py
Elsewhere every test here is skipped (tests/unit/test_cuda_ipc_opener.py and
tests/integration/test_service_cuda_ipc.py cover what needs no GPU).

The server is a `drafter serve` subprocess on cuda:0 (tiny EAGLE-3 head, bfloat16, CUDA graphs);
this test process is the target: it keeps its hidden states in one static GPU buffer and sends
references to it.  Each IPC session is paired with a session of the same server that sends the
same steps as bytes: their drafts must be equal, step by step, exactly.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from coordinator.transport import GrpcDrafterClient, ZmqDrafterClient
from drafter.wire import cuda_ref
from drafter.service.cuda_ipc import TorchCudaIpc
from drafter.wire.cuda_ref import FIELD
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import K, MML, SERVER_SETTINGS, SESSION_BLOCKS
from tests.support.engines import tiny_dirs
from tests.support.scenario import Scenario
from tests.support.servers import DrafterServer, layout_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

q = K + 1
PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, q, 1), (1, q, 0), (2, 12, 0)], [(1, q, 2), (0, q, 0), (2, q, 3)],
         [(0, q, 0), (2, q, 1), (1, q, 0)]]
FAULT_STEP = 2  # the step before which the faulty calls of the fault test go


@pytest.fixture(scope="module")
def gpu_server(tiny_root, tmp_path_factory):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "cuda-ipc-server.log"
    server = DrafterServer(model, "eagle3", log_path=log, device="cuda:0", dtype="bfloat16", allow_cuda_ipc="true",
                           kv_blocks=12 * SESSION_BLOCKS, block_sizes=16, batch_window_us=0, **SERVER_SETTINGS)
    server.start(timeout=900)  # CUDA-graph capture and Triton compiles before `ready`
    yield server
    code = server.stop()
    assert code == 0, f"the server exited with {code}: {server.log_tail()}"


class Target:
    """One session of this process: a transport, a scenario, and (shared) a static GPU buffer."""

    def __init__(self, server, transport: str, share: bool, seed: int):
        self.client = (ZmqDrafterClient(server.zmq_endpoint, timeout_s=60, share_cuda=share) if transport == "zmq"
                       else GrpcDrafterClient(server.grpc_target, timeout_s=60, share_cuda=share))
        info = self.client.info()
        self.client.attach(layout_for(info, SESSION_BLOCKS, hidden_dtype="bfloat16",
                                      client_name=f"gpu-{transport}-{'ipc' if share else 'bytes'}"))
        self.stream = self.client.stream() if transport == "grpc-stream" else None
        limits = info.limits
        self.scenario = Scenario(block_sizes=tuple(g.block_size for g in limits.kv_groups),
                                 num_blocks=(SESSION_BLOCKS,) * len(limits.kv_groups), vocab_size=limits.vocab_size,
                                 hidden_width=limits.hidden_width, k=K, max_model_len=MML, seed=seed,
                                 dtype=torch.bfloat16)
        # [max tokens, hidden_width]: one static buffer, as a CUDA-graph target keeps its hidden states
        self.buffer = torch.zeros(limits.max_num_batched_tokens, limits.hidden_width, dtype=torch.bfloat16,
                                  device="cuda:0") if share else None

    def propose(self, kwargs: dict) -> torch.Tensor:
        kw = dict(kwargs)
        if self.buffer is not None:
            hidden = kw["target_hidden_states"]
            self.buffer[:hidden.shape[0]].copy_(hidden)
            kw["target_hidden_states"] = self.buffer[:hidden.shape[0]]  # a view: the same storage every step
        call = self.stream.propose if self.stream is not None else self.client.propose
        return call(**kw).draft_token_ids

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.client.detach()
        self.client.close()


def _opens(server, session_id: str) -> int:
    """How often the server opened a reference for the session (its log says so before replying)."""
    from drafter.service.logs import session_tag

    count = 0
    for line in server.log_path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        count += rec.get("event") == "cuda_ipc_open" and rec.get("session") == session_tag(session_id)
    return count


def test_the_driver_reports_an_allocation_extent():
    t = torch.empty(1000, dtype=torch.float32, device="cuda:0")  # [1000]
    assert TorchCudaIpc().mapped_bytes(t.untyped_storage()) >= 4000


def test_the_drafter_advertises_this_host_and_gpu(gpu_server):
    with ZmqDrafterClient(gpu_server.zmq_endpoint, timeout_s=60, share_cuda=True) as client:
        support = client.info().cuda_ipc  # asked for: share_cuda clients flag cuda_ipc_capable
    assert support.enabled, support.reason
    assert support.host_id == cuda_ref.host_id()
    assert support.device_uuids[0] == cuda_ref.device_uuid("cuda:0")


@pytest.mark.parametrize("transport", ["zmq", "grpc-stream", "grpc-unary"])
def test_drafts_by_reference_equal_drafts_by_bytes(gpu_server, transport):
    shared, plain = Target(gpu_server, transport, True, seed=5), Target(gpu_server, transport, False, seed=5)
    for step, plan in enumerate(PLANS):
        got = shared.propose(shared.scenario.call(plan).kwargs)
        want = plain.propose(plain.scenario.call(plan).kwargs)
        assert shared.client.cuda.enabled, f"the client fell back to bytes: {shared.client.cuda.reason}"
        assert torch.equal(got, want), f"{transport} step {step}"
    assert len(shared.client.cuda.exports) == 1, "one static buffer, shared once"
    assert _opens(gpu_server, shared.client.session.session_id) == 1, "opened once, then served from the cache"
    shared.close()
    plain.close()


def _refusal(target: Target, kwargs: dict, forge=None) -> DrafterError:
    """Send one step whose reference `forge` rewrites (None: as it is), without falling back to bytes."""
    cuda = target.client.cuda
    honest = cuda.reference
    if forge is not None:
        cuda.reference = lambda t: forge(honest(t))
    cuda.refused = lambda err: False
    try:
        with pytest.raises(DrafterError) as err:
            target.propose(kwargs)
    finally:  # the instance's own methods again
        del cuda.refused
        if forge is not None:
            del cuda.reference
    assert err.value.code == Code.INVALID_ARGUMENT
    return err.value


def test_nan_and_forged_references_are_refused_and_harm_no_session(gpu_server):
    shared, plain = Target(gpu_server, "zmq", True, seed=8), Target(gpu_server, "zmq", False, seed=8)
    bystander = Target(gpu_server, "grpc-stream", True, seed=9)
    for step, plan in enumerate(PLANS):
        kwargs = shared.scenario.call(plan).kwargs
        if step == FAULT_STEP:
            poisoned = dict(kwargs, target_hidden_states=kwargs["target_hidden_states"].clone())
            poisoned["target_hidden_states"][1, 7] = float("nan")
            err = _refusal(shared, poisoned)
            assert (err.field, err.message) == (FIELD, "must be finite")
            err = _refusal(shared, kwargs, lambda r: dataclasses.replace(r, handle=bytes(range(64))))
            assert err.field == f"{FIELD}.handle", err.message
            # a storage claimed far past the real allocation: the driver's extent check refuses it (the
            # counter slot is an unused one: a refused storage's release decrements it)
            err = _refusal(shared, kwargs, lambda r: dataclasses.replace(
                r, storage_offset=2**30, storage_size_bytes=(2**30 + r.shape[0] * r.stride[0]) * r.dtype.itemsize,
                ref_counter_offset=9999))
            assert err.field == f"{FIELD}.storage_size_bytes", err.message
        got = shared.propose(kwargs)
        assert torch.equal(got, plain.propose(plain.scenario.call(plan).kwargs)), f"step {step}"
        bystander.propose(bystander.scenario.call(plan).kwargs)
    assert shared.client.cuda.enabled and bystander.client.cuda.enabled
    assert gpu_server.proc.poll() is None
    for t in (shared, plain, bystander):
        t.close()
