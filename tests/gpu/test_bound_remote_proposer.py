"""On a GPU: the RemoteProposer bound to a real `drafter serve`, its inputs on the GPU.

Run on a GPU host:  python3 -m pytest -q -p no:cacheprovider -s tests/gpu/test_bound_remote_proposer.py
Elsewhere it is skipped (tests/integration/test_bound_remote.py runs the same client on CPU).

The server is a `drafter serve` subprocess on cuda:0 (tiny EAGLE-3 head, bfloat16, CUDA graphs,
--allow-cuda-ipc); this process is the target, with two RemoteProposers on it: one bound, one with
BoundConfig(mode="off") sending the same steps unbound.  The bound one runs twice: over cuda_ipc
(the default plane for tensors on a GPU the drafter reads; BoundConfig.device binds it at attach:
the step's CUDA tensors copied into the shared slab, one device copy each, the header alone, the
drafts a GPU tensor, the error word the one host read) and over the host ring (plane="host_ring":
a mirror of the ring on the GPU, one device-to-host copy into the pinned ring,
bound_transport.fill_through).  Drafts must equal the unbound proposer's step by step; the host
time of the bound side's copies is printed (the copy the issue asks to measure).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from coordinator.clients import ServiceTransport
from coordinator.remote_proposer import ProposerConfig, RemoteProposer
from coordinator.routing import Endpoint, Router, StaticEndpoints
from coordinator.session import SessionSpec
from coordinator.transport import ZmqDrafterClient
from coordinator.transport.bound_transport import BoundConfig
from drafter.engine.config import KVGroupSpec
from tests.gpu.test_bound_ipc import PLANS, gpu_server  # noqa: F401 (the fixture: one real server)
from tests.integration.conftest import K, MAX_NUM_SEQS, MAX_TOKENS, MML, SESSION_BLOCKS
from tests.support.scenario import Scenario

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run on a GPU host"),
]


def _proposer(server, info, mode: str, **bound) -> RemoteProposer:
    limits = info.limits
    spec = SessionSpec(method=info.method, num_speculative_tokens=K, hidden_size=info.hidden_size,
                       num_aux_layers=info.num_aux_layers, max_model_len=MML, max_num_seqs=MAX_NUM_SEQS,
                       max_num_batched_tokens=MAX_TOKENS, dtype="bfloat16", client=f"gpu-proposer-{mode}",
                       kv_groups=tuple(KVGroupSpec(g.block_size, SESSION_BLOCKS) for g in limits.kv_groups))
    host, port = server.zmq_endpoint.split("://", 1)[-1].rsplit(":", 1)
    return RemoteProposer(spec, router=Router(StaticEndpoints([Endpoint("zmq", host, int(port))])), key=spec.client,
                          connect=lambda ep: ServiceTransport(ep, timeout_s=60),
                          config=ProposerConfig(deadline_s=60, bound=BoundConfig(mode=mode, **bound)))


PLANE_CONFIGS = {"cuda_ipc": dict(device="cuda"), "host_ring": dict(plane="host_ring")}


@pytest.mark.parametrize("plane", list(PLANE_CONFIGS))
def test_bound_remote_proposer_drafts_equal_unbound_from_gpu_inputs(gpu_server, plane, capsys):
    from coordinator.transport.bound_ipc import IpcLink

    probe = ZmqDrafterClient(gpu_server.zmq_endpoint, timeout_s=60)
    info = probe.info()
    probe.close()
    limits = info.limits
    bound, unbound = _proposer(gpu_server, info, "auto", **PLANE_CONFIGS[plane]), _proposer(gpu_server, info, "off")
    scenario = Scenario(block_sizes=tuple(g.block_size for g in limits.kv_groups),
                        num_blocks=(SESSION_BLOCKS,) * len(limits.kv_groups), vocab_size=limits.vocab_size,
                        hidden_width=limits.hidden_width, k=K, max_model_len=MML, seed=11, dtype=torch.bfloat16)
    try:
        assert bound.start() and unbound.start()
        transport = bound.transports[bound.endpoint]
        assert transport.link is not None and transport.link.plane == plane, "the GPU drafter binds the session"
        assert isinstance(transport.link, IpcLink) == (plane == "cuda_ipc")
        for plan in PLANS:
            kwargs = {n: [t.cuda() for t in v] if isinstance(v, list) else v.cuda()
                      for n, v in scenario.call(plan).kwargs.items()}
            got, want = bound.propose(**kwargs), unbound.propose(**kwargs)
            assert got is not None and want is not None, (bound.events, unbound.events)
            assert got.device.type == "cuda" and torch.equal(got, want), plan
        # the ring holds a decode batch (max_num_seqs * (k + 1) token rows): a step with more rows (the
        # first plan's prefill) goes unbound on the same session, every other one bound
        ring_rows = MAX_NUM_SEQS * (K + 1)
        too_big = sum(sum(q for _, q, _ in plan) > ring_rows for plan in PLANS)
        assert too_big == 1 and transport.steps == {"bound": len(PLANS) - too_big, "unbound": too_big}
        copies = sorted(transport.fill_s)
        with capsys.disabled():
            what = "the shared slab, one device copy per tensor" if plane == "cuda_ipc" else \
                "GPU mirror + one device-to-host copy"
            print(f"\n[gpu bound proposer, {plane}] copies into the ring ({what}), host time "
                  f"per step: p50 {statistics.median(copies) * 1e6:.0f} us, max {copies[-1] * 1e6:.0f} us "
                  f"over {len(copies)} steps")
    finally:
        bound.close(timeout=5.0)
        unbound.close(timeout=5.0)
