"""The pdl setting: validated at the edge, resolved per device, plain launches on the CPU."""

from __future__ import annotations

import pytest
import torch

from drafter import pdl
from drafter.config import EngineConfig


def test_pdl_setting_is_validated():
    with pytest.raises(ValueError, match="pdl"):
        EngineConfig(method="eagle3", pdl="sometimes")


def test_pdl_resolves_to_plain_launches_on_the_cpu():
    cpu = torch.device("cpu")
    assert pdl.resolve("auto", cpu) is False
    assert pdl.resolve("off", cpu) is False
    with pytest.raises(ValueError, match="Hopper"):
        pdl.resolve("on", cpu)


def test_serve_flag_reaches_the_engine_config(tmp_path):
    import argparse
    import json

    from drafter.bench_remote import HEAD_CONFIG
    from drafter.service.config import add_arguments, from_args
    from drafter.service.server import engine_config

    (tmp_path / "config.json").write_text(json.dumps(HEAD_CONFIG))
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = from_args(p.parse_args(["--method", "eagle3", "--model", str(tmp_path), "--device", "cpu", "--pdl", "off"]))
    assert engine_config(cfg).pdl == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--pdl", "maybe"])
