"""The fleet launcher: a rank that fails takes the fleet down at once, with its traceback."""

from __future__ import annotations

import pytest

from coordinator.demo.fleet import FleetConfig, FleetError, run_fleet
from coordinator.target.engine import TargetConfig
from coordinator.target.request import RequestSpec, random_requests
from tests.support.engines import tiny_dirs


def test_a_failing_rank_stops_the_fleet_quickly(tmp_path_factory, tmp_path):
    _, dirs = tiny_dirs(tmp_path_factory.mktemp("fleet"), "eagle")
    target = TargetConfig(str(dirs / "target"), method="eagle", num_speculative_tokens=0, max_model_len=64)
    good = random_requests(2, vocab_size=512, max_new_tokens=4, seed=0)
    bad = [RequestSpec(99, (1, 2, 3), max_new_tokens=500)]  # longer than max_model_len: rank 1 raises
    # taken down by the failing rank ("a rank failed"), not by the fleet's timeout ("timed out after")
    with pytest.raises(FleetError, match=r"(?s)\(a rank failed;.*exceeds max_model_len"):
        run_fleet(FleetConfig(target=target, tp=2, dp=2, timeout_s=120), [good, bad], tmp_path)


def test_plain_decoding_fleet_agrees_with_itself(tmp_path_factory, tmp_path):
    _, dirs = tiny_dirs(tmp_path_factory.mktemp("fleet2"), "eagle")
    target = TargetConfig(str(dirs / "target"), method="eagle", num_speculative_tokens=0, max_model_len=64)
    reqs = random_requests(3, vocab_size=512, max_new_tokens=6, seed=1)
    result = run_fleet(FleetConfig(target=target, tp=2, dp=1, timeout_s=120), [reqs], tmp_path)
    assert sorted(result.outputs) == [0, 1, 2] and all(len(v) == 6 for v in result.outputs.values())
