"""The fused step guard (drafter.kernels.step_guard, Triton) against the torch reference
(StepGuard.run_reference): the same error word and the same masked buffers, value for value, for
a clean step, every corrupt field of test_step_guard, two at once, rows past the step, and sizes
at the buffers' edges.  Without a GPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.engine.step_guard import StepGuard  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402
from tests.unit.test_step_guard import CORRUPTIONS, LIMITS, _clean  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _both(src: dict[str, torch.Tensor], n: int, b: int) -> tuple[StepGuard, StepGuard]:
    """The reference and the fused guard over the same buffers, each run once at (n, b)."""
    src = {k: v.to(DEVICE) for k, v in src.items()}
    guards = []
    for fused in (False, True):
        guard = StepGuard(src, LIMITS, torch.full((1,), -7, dtype=torch.int64, device=DEVICE), fused=fused)
        guard.step(n, b)
        guards.append(guard)
    assert guards[1].fused and not guards[0].fused
    return guards[0], guards[1]


def _same(ref: StepGuard, fused: StepGuard) -> None:
    assert fused.error.item() == ref.error.item()
    for name, want in ref.out.items():
        assert torch.equal(fused.out[name].cpu(), want.cpu()), name


@pytest.mark.parametrize("field,corrupt", CORRUPTIONS + [("clean", lambda s: None)])
def test_fused_equals_the_reference(field, corrupt):
    src = _clean()
    corrupt(src)
    ref, fused = _both(src, 9, 3)
    if field != "clean":
        assert wb.first_bad_guard_field(fused.error.item(), 2) == field
    else:
        assert fused.error.item() == 0
    _same(ref, fused)


def test_fused_two_bad_fields_and_rows_past_the_step():
    src = _clean()
    src["slot_mappings[1]"][0] = 1000
    src["target_positions"][0] = -1
    src["target_token_ids"][12] = -5  # past num_tokens 9: neither checked nor passed on
    src["block_tables[0]"][3] = 99  # past batch 3
    ref, fused = _both(src, 9, 3)
    assert bin(fused.error.item()).count("1") == 2
    _same(ref, fused)


@pytest.mark.parametrize("n,b", [(16, 4), (1, 1), (4, 4)])
def test_fused_at_the_edges_of_the_buffers(n, b):
    src = _clean()
    src["query_start_loc"] = torch.tensor([0, 4, 8, 12, 16], dtype=torch.int32)[:b + 1].clone() \
        if (n, b) == (16, 4) else torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    src["seq_lens"][:] = 5
    src["token_indices_to_sample"][:] = 0
    ref, fused = _both(src, n, b)
    _same(ref, fused)


@pytest.mark.parametrize("fused", [False, True])
def test_launch_reads_the_sizes_from_the_header(fused):
    """launch(header), what BoundPropose.fold captures: the sizes from the header's words 0 and 1
    (pinned host memory on a GPU, as the engine's input header), nothing from the guard's own
    sizes (left 0 here: read, they would mask every row); the same word and buffers as step()."""
    src = _clean()
    src["seq_lens"][1] = 41
    src = {k: v.to(DEVICE) for k, v in src.items()}
    alone = StepGuard(src, LIMITS, torch.full((1,), -7, dtype=torch.int64, device=DEVICE), fused=fused)
    alone.step(9, 3)
    header = torch.zeros(33, dtype=torch.int64, pin_memory=DEVICE == "cuda")  # [header words]
    header[0], header[1] = 9, 3
    folded = StepGuard(src, LIMITS, torch.full((1,), -7, dtype=torch.int64, device=DEVICE), fused=fused)
    folded.launch(header if DEVICE == "cuda" else header.to(DEVICE))
    assert folded.fused == fused
    assert wb.first_bad_guard_field(folded.error.item(), 2) == "seq_lens"
    _same(alone, folded)
    if fused:
        assert folded.sizes.tolist() == [0, 0], "the fused kernels read the header in place"
