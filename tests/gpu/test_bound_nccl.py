"""On two GPUs: bound sessions over the nccl_channel plane between this process and a real `drafter serve`.

Run on a host with two GPUs:  python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_bound_nccl.py
Elsewhere every test here is skipped (tests/integration/test_bound_channel.py runs the same plane on
CPU with gloo in place of NCCL).

The server is a `drafter serve` subprocess on cuda:1 (tiny EAGLE-3 head, bfloat16, CUDA graphs);
this process is the target, on cuda:0.  Three sessions of that server take the same steps: one bound
over the NCCL channel (the slab's prefix sent GPU to GPU, header-only steps, the guard on the
drafter's GPU, the output sent back), one bound over the host ring, one unbound sending bytes (the
drafter's fully validated in-process call on the same engine).  Their drafts must be equal, step by
step, exactly.  Then the NCCL session sends corrupt steps: each is refused naming the field (read
back from the guard's error word), and the two other sessions keep drafting equal drafts (their KV
untouched).  A target on the drafter's own GPU is refused naming device_uuid (NCCL refuses two ranks
on one GPU), and the RemoteProposer binds nccl_channel by itself for tensors on cuda:0.

Bounded waits: every client has a 60 s deadline, joining the channel 60 s, and faulthandler ends
this process with every thread's stack if the module runs past WATCHDOG_S (a hang fails the run).
"""

from __future__ import annotations

import faulthandler

import pytest
import torch

from coordinator.transport import ZmqDrafterClient
from coordinator.transport.bound_ipc import CudaIpcBoundClient
from drafter.wire import bound as wb
from drafter.wire.errors import Code, DrafterError
from tests.gpu.test_bound_ipc import PLANS, _buffers, _fill
from tests.integration.conftest import K, MAX_NUM_SEQS, MML, SERVER_SETTINGS, SESSION_BLOCKS
from tests.support.engines import tiny_dirs
from tests.support.scenario import Scenario
from tests.support.servers import DrafterServer, layout_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)"),
]

WATCHDOG_S = 480


@pytest.fixture(scope="module")
def nccl_server(tiny_root, tmp_path_factory):
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "bound-nccl-server.log"
    server = DrafterServer(model, "eagle3", log_path=log, device="cuda:1", dtype="bfloat16", allow_cuda_ipc="true",
                           kv_blocks=12 * SESSION_BLOCKS, block_sizes=16, batch_window_us=0,
                           env={"NCCL_NVLS_ENABLE": "0"}, **SERVER_SETTINGS)
    server.start(timeout=300)
    try:
        yield server
    finally:
        code = server.stop()
        faulthandler.cancel_dump_traceback_later()
    assert code == 0, f"the server exited with {code}: {server.log_tail()}"


class Target:
    def __init__(self, server, kind: str, device: str = "cuda:0", seed: int = 5):
        self.kind = kind
        probe = ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)
        info = probe.info()
        probe.close()
        limits = info.limits
        layout = layout_for(info, SESSION_BLOCKS, hidden_dtype="bfloat16", client_name=f"gpu-nccl-{kind}")
        self.scenario = Scenario(block_sizes=tuple(g.block_size for g in limits.kv_groups),
                                 num_blocks=(SESSION_BLOCKS,) * len(limits.kv_groups), vocab_size=limits.vocab_size,
                                 hidden_width=limits.hidden_width, k=K, max_model_len=MML, seed=seed,
                                 dtype=torch.bfloat16)
        if kind == "bytes":
            self.client = ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)
            self.client.attach(layout)
        else:
            self.client = CudaIpcBoundClient(server.zmq_endpoint, layout, _buffers(limits.hidden_width),
                                             max_batch=MAX_NUM_SEQS, device=device, timeout_s=60,
                                             allow_fallback=False, force_ring=kind == "ring", channel=kind == "nccl")

    def bind(self) -> "Target":
        if self.kind != "bytes":
            want = wb.HOST_RING if self.kind == "ring" else wb.NCCL_CHANNEL
            assert self.client.bind() == want, self.client.fallback_reason
        return self

    def step(self, plan, corrupt=None) -> torch.Tensor:
        kwargs = self.scenario.call(plan).kwargs
        if self.kind == "bytes":
            return self.client.propose(**kwargs).draft_token_ids
        n, b = _fill(self.client.views, kwargs)
        if corrupt is not None:
            corrupt(self.client.views, n, b)
        return self.client.step(n, b)

    def close(self):
        self.client.close()


def test_bound_nccl_drafts_equal_host_ring_and_bytes_and_corrupt_steps_are_named(nccl_server):
    targets = {kind: Target(nccl_server, kind).bind() for kind in ("nccl", "ring", "bytes")}
    try:
        for i, plan in enumerate(PLANS[:3]):
            got = {kind: t.step(plan) for kind, t in targets.items()}
            assert torch.equal(got["nccl"], got["bytes"]), (i, got)
            assert torch.equal(got["nccl"], got["ring"]), (i, got)
        nccl = targets["nccl"].client
        assert nccl.plane == wb.NCCL_CHANNEL and nccl.binds == 1
        stamps = nccl.stamps
        order = ["sent", *wb.STAMPS, "answered", "read"]
        assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stamps
        corruptions = {
            "block_tables[0]": lambda v, n, b: v["block_tables[0]"].__setitem__((b - 1, 0), SESSION_BLOCKS),
            wb.HIDDEN: lambda v, n, b: v[wb.HIDDEN].__setitem__((n // 2, 1), float("nan")),
            "slot_mappings[0]": lambda v, n, b: v["slot_mappings[0]"].__setitem__(n - 1, -7),
            "target_positions": lambda v, n, b: v["target_positions"].__setitem__(0, MML),
        }
        for field, corrupt in corruptions.items():
            with pytest.raises(DrafterError) as err:
                targets["nccl"].step(PLANS[3], corrupt)
            assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)
        assert nccl.link.alive, "masked steps keep the binding: both ends' transfers stayed paired"
        # the NCCL session's own KV is void now (masked steps ran): it takes no further part
        for plan in PLANS[3:]:  # the neighbours' KV was not touched: they still draft alike
            ring, raw = targets["ring"].step(plan), targets["bytes"].step(plan)
            assert torch.equal(ring, raw), plan
    finally:
        for t in targets.values():
            t.close()


def test_a_target_on_the_drafters_gpu_is_refused_naming_device_uuid(nccl_server):
    t = Target(nccl_server, "nccl", device="cuda:1")
    try:
        with pytest.raises(DrafterError) as err:
            t.client.bind()
        assert err.value.code == Code.FAILED_PRECONDITION and err.value.field == "plane", str(err.value)
        assert "device_uuid" in err.value.message and "two ranks on one GPU" in err.value.message, str(err.value)
    finally:
        t.close()


def test_the_remote_proposer_binds_nccl_channel_for_tensors_on_another_gpu(nccl_server):
    """BoundConfig(plane="nccl_channel", device="cuda:0"): bound at attach over NCCL, each step's
    tensors copied into the slab on cuda:0, drafts equal the unbound proposer's."""
    from coordinator.transport.bound_channel import ChannelLink
    from tests.gpu.test_bound_remote_proposer import _proposer

    probe = ZmqDrafterClient(nccl_server.zmq_endpoint, timeout_s=60)
    info = probe.info()
    probe.close()
    limits = info.limits
    bound = _proposer(nccl_server, info, "auto", plane="nccl_channel", device="cuda:0", channel_timeout_s=60.0)
    unbound = _proposer(nccl_server, info, "off")
    scenario = Scenario(block_sizes=tuple(g.block_size for g in limits.kv_groups),
                        num_blocks=(SESSION_BLOCKS,) * len(limits.kv_groups), vocab_size=limits.vocab_size,
                        hidden_width=limits.hidden_width, k=K, max_model_len=MML, seed=12, dtype=torch.bfloat16)
    try:
        assert bound.start() and unbound.start()
        transport = bound.transports[bound.endpoint]
        assert isinstance(transport.link, ChannelLink), transport.link
        for plan in PLANS:
            kwargs = {n: [t.to("cuda:0") for t in v] if isinstance(v, list) else v.to("cuda:0")
                      for n, v in scenario.call(plan).kwargs.items()}
            got, want = bound.propose(**kwargs), unbound.propose(**kwargs)
            assert got is not None and want is not None, (bound.events, unbound.events)
            assert torch.equal(got.cpu(), want.cpu()), plan
        assert transport.steps["bound"] >= len(PLANS) - 1, transport.steps
    finally:
        bound.close(timeout=5.0)
        unbound.close(timeout=5.0)
