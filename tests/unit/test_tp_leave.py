"""How a tensor-parallel rank ends (drafter.service.tp.worker.leave_group): on the host it destroys its
process group and returns; on a GPU it exits at once with its code and never calls destroy_process_group
(which hung on 2 H100s with CUDA graphs alive that captured NCCL collectives)."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch


def _leave(device: str, marks: str) -> None:
    from drafter.service.tp.worker import leave_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("gloo", init_method=f"file://{marks}.store", rank=0, world_size=1)
    real = torch.distributed.destroy_process_group

    def destroy() -> None:
        Path(marks + ".destroyed").touch()
        real()

    torch.distributed.destroy_process_group = destroy
    leave_group(torch.device(device), code=7)
    Path(marks + ".returned").touch()


@pytest.mark.parametrize("device, code, destroyed", [("cpu", 0, True), ("cuda", 7, False)])
def test_a_rank_leaves_its_group_by_its_device(tmp_path, device, code, destroyed):
    marks = str(tmp_path / device)
    p = multiprocessing.get_context("spawn").Process(target=_leave, args=(device, marks))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        pytest.fail("the rank did not end within 120 s")
    assert p.exitcode == code
    assert Path(marks + ".destroyed").exists() == destroyed
    assert Path(marks + ".returned").exists() == destroyed  # on a GPU nothing after leave_group runs
