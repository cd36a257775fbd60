"""On a GPU: bound sessions over CUDA IPC between this process and a real `drafter serve`.

Run on a GPU host:  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bound_ipc.py
Elsewhere every test here is skipped (tests/integration/test_bound_ipc.py runs the same plane on
CPU over cuda_slab.LocalSlabs, tests/unit/test_step_guard.py the guard).

The server is a `drafter serve` subprocess on cuda:0 (tiny EAGLE-3 head, bfloat16, CUDA graphs);
this process is the target.  Three sessions of that server take the same steps: one bound over
CUDA IPC (the slab shared once, header-only steps, the guard on the GPU), one bound over the host
ring, one unbound sending bytes.  Their drafts must be equal, step by step, exactly.  Then the
CUDA IPC session sends corrupt steps: each is refused naming the field (read back from the GPU
guard's error word), and the two other sessions keep drafting equal drafts (their KV untouched).
"""

from __future__ import annotations

import pytest
import torch

from coordinator.transport import ZmqDrafterClient
from coordinator.transport.bound_ipc import CudaIpcBoundClient
from drafter.wire import bound as wb
from drafter.wire.errors import Code, DrafterError
from tests.integration.conftest import K, MAX_NUM_SEQS, MAX_TOKENS, MML, SERVER_SETTINGS, SESSION_BLOCKS
from tests.support.engines import tiny_dirs
from tests.support.scenario import Scenario
from tests.support.servers import DrafterServer, layout_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

q = K + 1
PLANS = [[(0, 9, 0), (1, 30, 0)], [(0, q, 1), (1, q, 0), (2, 12, 0)], [(1, q, 2), (0, q, 0), (2, q, 3)],
         [(0, q, 0), (2, q, 1), (1, q, 0)], [(2, q, 0), (1, q, 1), (0, q, 2)]]
COLUMNS = 32  # block-table columns: more than the engine's max_blocks_per_req at max_model_len MML


@pytest.fixture(scope="module")
def gpu_server(tiny_root, tmp_path_factory):
    _, model = tiny_dirs(tiny_root, "eagle3")
    log = tmp_path_factory.mktemp("logs") / "bound-ipc-server.log"
    server = DrafterServer(model, "eagle3", log_path=log, device="cuda:0", dtype="bfloat16", allow_cuda_ipc="true",
                           kv_blocks=12 * SESSION_BLOCKS, block_sizes=16, batch_window_us=0, **SERVER_SETTINGS)
    server.start(timeout=900)
    yield server
    code = server.stop()
    assert code == 0, f"the server exited with {code}: {server.log_tail()}"


def _buffers(width: int) -> list[wb.BufferSpec]:
    return [wb.BufferSpec("target_token_ids", "int64", [MAX_TOKENS]),
            wb.BufferSpec("target_positions", "int64", [MAX_TOKENS]),
            wb.BufferSpec(wb.HIDDEN, "bfloat16", [MAX_TOKENS, width]),
            wb.BufferSpec("next_token_ids", "int64", [MAX_NUM_SEQS]),
            wb.BufferSpec("query_start_loc", "int32", [MAX_NUM_SEQS + 1]),
            wb.BufferSpec("seq_lens", "int32", [MAX_NUM_SEQS]),
            wb.BufferSpec("num_rejected_tokens", "int32", [MAX_NUM_SEQS]),
            wb.BufferSpec("token_indices_to_sample", "int32", [MAX_NUM_SEQS]),
            wb.BufferSpec("block_tables[0]", "int32", [MAX_NUM_SEQS, COLUMNS]),
            wb.BufferSpec("slot_mappings[0]", "int64", [MAX_TOKENS])]


def _fill(views: dict, call: dict) -> tuple[int, int]:
    """A call's rows written into the target's persistent GPU buffers; (num_tokens, batch)."""
    call = dict(call)
    b = call["next_token_ids"].shape[0]
    call.setdefault("num_rejected_tokens", torch.zeros(b, dtype=torch.int32))
    call.setdefault("token_indices_to_sample", call["query_start_loc"][1:] - 1 - call["num_rejected_tokens"])
    call.pop("temperatures", None)
    for name, value in call.items():
        pairs = ([(views[f"{name}[{g}]"], v) for g, v in enumerate(value)] if isinstance(value, list)
                 else [(views[name], value)])
        for dst, src in pairs:
            rows = tuple(slice(0, min(a, c)) for a, c in zip(src.shape, dst.shape))
            dst[rows].copy_(src[rows])
    return call["target_token_ids"].shape[0], b


class Target:
    def __init__(self, server, kind: str, seed: int = 5):
        self.kind = kind
        probe = ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)
        info = probe.info()
        probe.close()
        limits = info.limits
        layout = layout_for(info, SESSION_BLOCKS, hidden_dtype="bfloat16", client_name=f"gpu-bound-{kind}")
        self.scenario = Scenario(block_sizes=tuple(g.block_size for g in limits.kv_groups),
                                 num_blocks=(SESSION_BLOCKS,) * len(limits.kv_groups), vocab_size=limits.vocab_size,
                                 hidden_width=limits.hidden_width, k=K, max_model_len=MML, seed=seed,
                                 dtype=torch.bfloat16)
        if kind == "bytes":
            self.client = ZmqDrafterClient(server.zmq_endpoint, timeout_s=60)
            self.client.attach(layout)
        else:
            self.client = CudaIpcBoundClient(server.zmq_endpoint, layout, _buffers(limits.hidden_width),
                                             max_batch=MAX_NUM_SEQS, device="cuda:0", timeout_s=60,
                                             allow_fallback=False, force_ring=kind == "ring")
            assert self.client.bind() == (wb.HOST_RING if kind == "ring" else wb.CUDA_IPC), self.client.fallback_reason

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


def test_bound_cuda_ipc_drafts_equal_host_ring_and_bytes_and_corrupt_steps_are_named(gpu_server):
    targets = {kind: Target(gpu_server, kind) for kind in ("ipc", "ring", "bytes")}
    try:
        for i, plan in enumerate(PLANS[:3]):
            got = {kind: t.step(plan) for kind, t in targets.items()}
            assert torch.equal(got["ipc"], got["ring"]), (i, got)
            assert torch.equal(got["ipc"], got["bytes"]), (i, got)
        ipc = targets["ipc"].client
        assert ipc.plane == wb.CUDA_IPC and ipc.binds == 1
        assert ipc.link.bell is not None, f"the steps went by the data socket: {ipc.link.bell_reason}"
        corruptions = {
            "block_tables[0]": lambda v, n, b: v["block_tables[0]"].__setitem__((b - 1, 0), SESSION_BLOCKS),
            wb.HIDDEN: lambda v, n, b: v[wb.HIDDEN].__setitem__((n // 2, 1), float("nan")),
            "slot_mappings[0]": lambda v, n, b: v["slot_mappings[0]"].__setitem__(n - 1, -7),
            "target_positions": lambda v, n, b: v["target_positions"].__setitem__(0, MML),
        }
        for field, corrupt in corruptions.items():
            with pytest.raises(DrafterError) as err:
                targets["ipc"].step(PLANS[3], corrupt)
            assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == field, str(err.value)
        # the CUDA IPC session's own KV is void now (masked steps ran): it takes no further part
        for plan in PLANS[3:]:  # the neighbours' KV was not touched: they still draft alike
            ring, raw = targets["ring"].step(plan), targets["bytes"].step(plan)
            assert torch.equal(ring, raw), plan
    finally:
        for t in targets.values():
            t.close()
