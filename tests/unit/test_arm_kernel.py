"""The armed step's first kernel (drafter.kernels.arm) against its CPU emulation: the engine header's
sizes become the queued step's where the target's record is exactly (step, sizes), and 0 and 0 for any
other record (each field off by one, a record of the step before, none at all), the other header words
untouched.  Without a GPU the kernel runs under the Triton interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from drafter.kernels import arm as arm_mod  # noqa: E402
from drafter.kernels.batch_inputs import B, HEADER_WORDS, N  # noqa: E402
from drafter.wire import bound as wb  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEP, KEY = 41, (13, 3, 4, 16)


def _record(values) -> torch.Tensor:  # [ARM_WORDS] int64: go word, then the record
    row = torch.zeros(wb.ARM_WORDS, dtype=torch.int64)
    row[wb.ARM_GO:wb.ARM_GO + 1].view(torch.int32)[:] = values[0]  # the two go words
    row[wb.ARM_STEP:wb.ARM_STEP + wb.ARM_RECORD] = torch.tensor(values)
    return row


CASES = {"exact": (STEP, *KEY), "no record": (0, 0, 0, 0, 0), "the step before": (STEP - 1, *KEY)}
CASES.update({f"field {i} off by one": tuple(v + (i == j) for j, v in enumerate((STEP, *KEY))) for i in range(5)})


@pytest.mark.parametrize("case", list(CASES))
def test_the_header_gets_the_queued_sizes_only_from_an_exact_record(case):
    record = _record(CASES[case])
    header = torch.arange(100, 100 + int(HEADER_WORDS), dtype=torch.int64)  # [header words]: every word marked
    emulated = header.clone()
    arm_mod.arm(record, emulated, STEP, KEY)  # the CPU emulation
    on_kernel = header.clone().to(DEVICE)
    arm_mod.arm_kernel[(1,)](record.to(DEVICE), on_kernel, STEP, *KEY)
    on_kernel = on_kernel.cpu()
    want = (KEY[0], KEY[1]) if case == "exact" else (0, 0)
    assert (int(on_kernel[int(N)]), int(on_kernel[int(B)])) == want
    assert torch.equal(on_kernel, emulated)
    rest = [i for i in range(int(HEADER_WORDS)) if i not in (int(N), int(B))]
    assert torch.equal(on_kernel[rest], header[rest]), "only the two sizes are written"
