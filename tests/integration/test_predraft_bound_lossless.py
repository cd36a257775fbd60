"""Pre-drafts pushed on a bound session (issue 23) under the reference target with the trained
pair: the target (coordinator.target.engine.TargetEngine) drafts through BoundPreDrafting over a
CudaIpcBoundClient (the cuda_ipc plane on CPU: cuda_slab.LocalSlabs, emulated graphs), the
drafter serving --predraft-outcomes.  Greedy output must equal plain decoding token for token,
with pushed pre-drafts used (steps whose rows all hit sent without waiting)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_bound_remote import Drafter  # noqa: E402  (sets TRITON_INTERPRET on CPU)

from coordinator.predraft import BoundPreDrafting, call_inputs  # noqa: E402
from coordinator.target.engine import TargetConfig, TargetEngine  # noqa: E402
from coordinator.target.predraft_report import LoopConfig, run_loop  # noqa: E402
from coordinator.target.request import random_requests  # noqa: E402
from coordinator.transport.bound_ipc import CudaIpcBoundClient  # noqa: E402
from drafter.engine.config import EngineConfig, KVGroupSpec  # noqa: E402
from drafter.engine.engine import DraftEngine  # noqa: E402
from drafter.engine.graphs import GraphRunner  # noqa: E402
from drafter.service import bound_ipc  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from drafter.wire.cuda_slab import LocalSlabs  # noqa: E402
from tests.support.pair import one_torch_thread, trained_pair  # noqa: F401,E402 (fixture)
from tests.support.servers import layout_for  # noqa: E402

K, MAX_BATCH, MAX_TOKENS, BLOCKS, MAX_LEN = 3, 4, 256, 64, 128


@pytest.fixture(autouse=True)
def _local_slabs(monkeypatch):
    monkeypatch.setattr(bound_ipc, "BACKEND", LocalSlabs())


def _served(pair) -> DraftEngine:
    engine = DraftEngine.from_dirs(pair / "head", pair / "target", EngineConfig(
        method="eagle3", num_speculative_tokens=K, max_model_len=MAX_LEN, max_num_seqs=MAX_BATCH,
        max_num_batched_tokens=MAX_TOKENS, kv_groups=(KVGroupSpec(16, BLOCKS),), predraft_outcomes=4,
        attention_backend="triton", device="cpu", skinny_gemm="off", capture_sizes=(MAX_BATCH,)))
    engine.graphs = GraphRunner(engine, emulate=True, combined=False)
    engine.graphs.token_sizes, engine.graphs.batch_sizes = [MAX_BATCH * (K + 1)], [MAX_BATCH]  # decode steps
    engine.graphs.capture()
    return engine


def _buffers(width: int) -> list[wb.BufferSpec]:
    return [wb.BufferSpec("target_token_ids", "int64", [MAX_TOKENS]),
            wb.BufferSpec("target_positions", "int64", [MAX_TOKENS]),
            wb.BufferSpec(wb.HIDDEN, "float32", [MAX_TOKENS, width]),
            wb.BufferSpec("next_token_ids", "int64", [MAX_BATCH]),
            wb.BufferSpec("query_start_loc", "int32", [MAX_BATCH + 1]),
            wb.BufferSpec("seq_lens", "int32", [MAX_BATCH]),
            wb.BufferSpec("num_rejected_tokens", "int32", [MAX_BATCH]),
            wb.BufferSpec("token_indices_to_sample", "int32", [MAX_BATCH]),
            wb.BufferSpec("block_tables[0]", "int32", [MAX_BATCH, -(-MAX_LEN // 16)]),
            wb.BufferSpec("slot_mappings[0]", "int64", [MAX_TOKENS])]


class BoundProposer:
    """What the TargetEngine calls (propose, generation), through BoundPreDrafting."""

    generation = 0
    last_batch_padded = None

    def __init__(self, client: CudaIpcBoundClient):
        self.client = client
        self.pd = BoundPreDrafting(client, push_wait_s=60.0)  # verification modelled as outlasting the pre-draft

    def propose(self, **kw) -> torch.Tensor:
        counts = kw.pop("accepted_counts", None)
        padded = (kw.pop("batch_padded", 0) or 0, kw.pop("tokens_padded", 0) or 0)
        drafts, _ = self.pd.step(call_inputs(kw), counts, *padded)
        return drafts


def test_bound_predrafting_output_equals_plain_decoding(tmp_path_factory):
    pair = trained_pair(tmp_path_factory)[0]
    reqs = random_requests(2, vocab_size=512, max_new_tokens=16, seed=2)
    base = run_loop(LoopConfig(str(pair), k=0), reqs)[1]
    served = _served(pair)
    with Drafter(served) as drafter:
        layout = layout_for(drafter.core.info(), BLOCKS, max_num_seqs=MAX_BATCH, max_num_batched_tokens=MAX_TOKENS)
        client = CudaIpcBoundClient(drafter.endpoint, layout, _buffers(served.spec.hidden_input_width),
                                    max_batch=MAX_BATCH, device="cpu", timeout_s=120, allow_fallback=False,
                                    slabs=LocalSlabs())
        target = TargetEngine(TargetConfig(str(pair / "target"), method="eagle3", aux_layer_ids=(1, 2, 3),
                                           num_speculative_tokens=K, max_model_len=MAX_LEN, max_num_seqs=MAX_BATCH,
                                           num_blocks=BLOCKS))
        proposer = BoundProposer(client)
        target.proposer = proposer
        try:
            for r in reqs:
                target.add(r)
            out = target.run()
            assert client.plane == wb.CUDA_IPC
        finally:
            client.close()
    stats = proposer.pd.picker.stats
    print(f"\n[predraft bound] hit rate {stats.hit_rate:.2f} by a {stats.hit_rate_by_a()}, sets {stats.offered}, "
          f"late {stats.late}, steps sent without waiting {proposer.pd.unawaited}, "
          f"acceptance length {target.stats.acceptance_length:.2f}")
    assert out == base, "greedy output differs from plain decoding"
    assert stats.offered > 3 and stats.hit_rate > 0.3 and proposer.pd.unawaited > 0 and stats.late == 0
