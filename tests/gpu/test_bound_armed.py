"""On a GPU: armed cuda_ipc bindings (drafter.wire.bound.ARM_WORDS) against a real `drafter serve`.

Run on a GPU host:  python3 -m pytest -q -p no:cacheprovider tests/gpu/test_bound_armed.py
Elsewhere every test here is skipped (tests/integration/test_bound_armed.py runs the same logic on CPU).

The server and targets are tests/gpu/test_bound_ipc.py's.  An armed binding's steps start on the
drafter's GPU from this process's stream (the record and the go word copied after the inputs, the
drafter's stream waiting on the word through the driver's stream memory operations): its drafts must
equal an unarmed cuda_ipc binding's and an unbound session's at every step, while it steps alone (its
next step queued ahead, found queued) and while another binding's steps come between its own (the step
queued ahead drained); a corrupt armed step is named, and the neighbours keep drafting alike.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.transport.bound_ipc import CudaIpcBoundClient
from drafter.wire import bound as wb
from drafter.wire.errors import Code, DrafterError
from tests.gpu.test_bound_ipc import PLANS, Target, gpu_server  # noqa: F401  (the module's server fixture)
from tests.integration.conftest import K

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]

q = K + 1
DECODE = [[(0, q, 0), (1, q, 1), (2, q, 0)], [(2, q, 2), (0, q, 0), (1, q, 0)], [(1, q, 0), (2, q, 1), (0, q, 3)]]


class ArmedTarget(Target):
    def __init__(self, server, seed: int = 5):
        super().__init__(server, "ring", seed)  # the layout and scenario; the client is replaced below
        self.client.close()
        self.kind = "armed"
        probe_layout = self.client.layout
        self.client = CudaIpcBoundClient(server.zmq_endpoint, probe_layout, self.client.buffers,
                                         max_batch=self.client.max_batch, device="cuda:0", timeout_s=60,
                                         allow_fallback=False, armed=True)
        assert self.client.bind() == wb.CUDA_IPC, self.client.fallback_reason
        assert self.client.link.armed, "the drafter did not grant the armed binding"


def test_armed_steps_draft_what_unarmed_and_unbound_sessions_draft(gpu_server):
    armed = ArmedTarget(gpu_server)
    others = {kind: Target(gpu_server, kind) for kind in ("ipc", "bytes")}
    try:
        steps = PLANS[:2] + DECODE * 3
        alone = [armed.step(plan) for plan in steps[:5]]  # no other binding's steps between: queued ahead
        for i, plan in enumerate(steps[:5]):
            for kind, t in others.items():
                assert torch.equal(alone[i], t.step(plan)), (i, kind, alone[i])
        for i, plan in enumerate(steps[5:], 5):  # the others' steps between the armed one's: drained each time
            got = armed.step(plan)
            for kind, t in others.items():
                assert torch.equal(got, t.step(plan)), (i, kind, got)
        corrupt = lambda v, n, b: v["block_tables[0]"].__setitem__((b - 1, 0), 10**6)  # noqa: E731
        with pytest.raises(DrafterError) as err:
            armed.step(DECODE[0], corrupt)
        assert err.value.code == Code.INVALID_ARGUMENT and err.value.field == "block_tables[0]", str(err.value)
        for plan in DECODE[1:]:  # the neighbours' KV untouched: they still draft alike
            assert torch.equal(others["ipc"].step(plan), others["bytes"].step(plan)), plan
    finally:
        armed.close()
        for t in others.values():
            t.close()
