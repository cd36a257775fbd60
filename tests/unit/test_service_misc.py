"""Errors, settings (flags and DRAFTER_* variables), acceptance metrics."""

from __future__ import annotations

import argparse

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from drafter.wire.errors import InvalidInput
from drafter.service.config import ServerConfig, add_arguments, from_args
from drafter.wire.errors import Code, DrafterError, from_exception
from drafter.service.metrics import Metrics, accepted_from_report


def test_codes_map_to_grpc_and_back():
    for code in Code:
        assert code.grpc.value[0] == int(code)
        assert Code.from_grpc(code.grpc) is code
    assert Code.from_grpc(grpc.StatusCode.CANCELLED) is Code.INTERNAL


def test_engine_validation_errors_keep_their_field():
    err = from_exception(InvalidInput("query_start_loc", "must start at 0"))
    assert (err.code, err.field, err.message) == (Code.INVALID_ARGUMENT, "query_start_loc", "must start at 0")
    err = from_exception(RuntimeError("boom"))
    assert err.code is Code.INTERNAL
    same = DrafterError(Code.NOT_FOUND, "session_id", "x")
    assert from_exception(same) is same


def _parse(argv, environ):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(argv), environ)


def test_settings_come_from_flags_then_environment_then_defaults():
    env = {"DRAFTER_METHOD": "eagle3", "DRAFTER_MODEL": "/m", "DRAFTER_GRPC_PORT": "6000",
           "DRAFTER_PADDED_DRAFTER_BATCH": "false", "DRAFTER_LOG_LEVEL": "INFO", "DRAFTER_KV_BLOCKS": "100,50",
           "DRAFTER_DRAIN_TIMEOUT_S": "7.5"}
    cfg = _parse(["--grpc-port", "7000", "--zmq-port", "0"], env)
    assert (cfg.method, cfg.model, cfg.grpc_port, cfg.zmq_port) == ("eagle3", "/m", 7000, 0)
    assert cfg.padded_drafter_batch is False and cfg.drain_timeout_s == 7.5 and cfg.log_level == "info"
    assert cfg.kv_blocks_per_group(2) == (100, 50)
    assert cfg.block_sizes_per_group(2) == (16, 16)
    assert cfg.host == "127.0.0.1", "loopback unless told otherwise"
    cfg.check()
    with pytest.raises(ValueError, match="KV groups"):
        cfg.kv_blocks_per_group(3)


def test_every_setting_has_an_environment_variable_and_bad_values_are_named():
    cfg = _parse([], {})
    with pytest.raises(ValueError, match="DRAFTER_METHOD"):
        cfg.check()
    with pytest.raises(ValueError, match="DRAFTER_GRPC_PORT"):
        _parse([], {"DRAFTER_GRPC_PORT": "many"})
    with pytest.raises(ValueError, match="DRAFTER_LOG_FORMAT"):
        _parse([], {"DRAFTER_LOG_FORMAT": "xml"})
    with pytest.raises(ValueError, match="tls-key"):
        ServerConfig(method="eagle", model="/m", tls_cert="/c").check()


def test_acceptance_per_position():
    m = Metrics(method="eagle3")
    m.record_acceptance(torch.tensor([3, 0, 1, -1]), 3)  # -1: no report for that request
    m.record_acceptance(torch.tensor([2]), 3)
    text = generate_latest(m.registry).decode()

    def value(name, pos):
        line = [l for l in text.splitlines() if l.startswith(name + "{") and f'position="{pos}"' in l][0]
        return float(line.rsplit(" ", 1)[1])
    assert [value("drafter_draft_tokens_verified_total", p) for p in (1, 2, 3)] == [4, 4, 4]
    assert [value("drafter_accepted_tokens_total", p) for p in (1, 2, 3)] == [3, 2, 1]
    assert [value("drafter_draft_position_acceptance", p) for p in (1, 2, 3)] == [0.75, 0.5, 0.25]


def test_acceptance_report_from_rejected_counts_of_decode_rows():
    qsl = torch.tensor([0, 4, 24, 28])  # decode (k + 1 = 4), a prefill chunk of 20, decode
    acc = accepted_from_report(None, torch.tensor([1, 0, 3]), qsl, 3)
    assert acc.tolist() == [2, -1, 0]
    explicit = torch.tensor([1, 1, 1])
    assert accepted_from_report(explicit, torch.tensor([1, 0, 3]), qsl, 3) is explicit
    assert accepted_from_report(None, None, qsl, 3) is None
