"""--gil-switch-interval-us (issue 19): validated at the edge, read from DRAFTER_GIL_SWITCH_INTERVAL_US, and
applied to the interpreter by the function `drafter serve` calls at start."""

from __future__ import annotations

import argparse
import sys

import pytest

from drafter.service.config import MAX_SWITCH_INTERVAL_US, ServerConfig, add_arguments, from_args
from drafter.service.server import set_switch_interval

BASE = dict(method="eagle3", model="/m")


@pytest.mark.parametrize("us", [0, -5, MAX_SWITCH_INTERVAL_US + 1])
def test_out_of_range_is_refused_naming_the_flag(us):
    with pytest.raises(ValueError, match="--gil-switch-interval-us"):
        ServerConfig(**BASE, gil_switch_interval_us=us).check()


def test_default_is_pythons_own():
    """Measured on a quiet host, a shorter interval did not help the valid clients under attack (issue 19)."""
    cfg = ServerConfig(**BASE)
    cfg.check()
    assert cfg.gil_switch_interval_us == 5000


def test_flag_and_environment():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    env = {"DRAFTER_GIL_SWITCH_INTERVAL_US": "750"}
    assert from_args(parser.parse_args([]), env).gil_switch_interval_us == 750
    assert from_args(parser.parse_args(["--gil-switch-interval-us", "40"]), env).gil_switch_interval_us == 40


def test_set_switch_interval_applies_it():
    before = sys.getswitchinterval()
    try:
        assert set_switch_interval(300) == 300
        assert sys.getswitchinterval() == pytest.approx(300e-6)
    finally:
        sys.setswitchinterval(before)


def test_zmq_drop_settings_out_of_range_are_refused():
    with pytest.raises(ValueError, match="--zmq-drop-burst"):
        ServerConfig(**BASE, zmq_drop_burst=0).check()
    with pytest.raises(ValueError, match="--zmq-drop-budget-us"):
        ServerConfig(**BASE, zmq_drop_budget_us=-1).check()
