"""Attach refusals a vLLM operator can act on: every mismatch at once, each with the `drafter serve`
flag (and value) that fixes it, one status code, times in milliseconds.

The plugin's side (drafter_vllm.sources.make_source -> RemoteProposer) attaches over ZMQ to a real
ZmqServer around a tiny engine, as vLLM's worker does at its first step.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from coordinator.remote_proposer import error_detail
from coordinator.transport.base import ms
from drafter.service import zmq_server
from drafter.wire import schema
from drafter.wire.errors import Code, DrafterError
from drafter.service.sessions import EngineDescription, SessionTable, check_layout
from drafter_vllm.settings import PluginSettings
from drafter_vllm.sources import TargetFacts, make_source
from tests.support.core import run_with_core
from tests.support.engines import build_engine

MML, BLOCKS = 96, 24

ENG = EngineDescription(
    method="eagle3", num_speculative_tokens=3, speculative_token_tree=None, dtype="float32", hidden_size=64,
    num_aux_layers=3, aux_layer_ids=(1, 2, 3), hidden_width=192, vocab_size=512, max_model_len=96,
    max_num_seqs=8, max_num_batched_tokens=256, block_sizes=(16,), pool_blocks=(100,),
    capture_sizes=(1, 2, 4, 8), token_capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), max_message_bytes=80_000)


def layout(**over) -> schema.AttachRequest:
    base = dict(protocol_version=1, method="eagle3", num_speculative_tokens=3, hidden_dtype="float32", hidden_size=64,
                num_aux_layers=3, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=128,
                kv_groups=[schema.KVGroup(block_size=16, num_blocks=30)])
    base.update(over)
    return schema.AttachRequest(**base)


def test_three_mismatches_come_back_in_one_refusal():
    table = SessionTable(ENG, max_sessions=4)
    with pytest.raises(DrafterError) as e:
        table.attach(layout(max_model_len=4096, kv_groups=[schema.KVGroup(block_size=32, num_blocks=16384)]))
    err = e.value
    assert err.code == Code.FAILED_PRECONDITION
    assert err.field.split(",") == ["max_model_len", "kv_groups[0].block_size", "kv_groups[0].num_blocks"]
    assert err.message.startswith("3 mismatches: ")
    # each with what the target has and the flag that makes this drafter fit it
    for part in ("the target has 4096, this drafter serves 96 (set drafter serve --max-model-len 4096)",
                 "the target has 32, this drafter serves 16 (set drafter serve --block-sizes 32)",
                 "the target has 16384 blocks, more than this drafter's whole pool of 100 "
                 "(set drafter serve --kv-blocks 16384)"):
        assert part in err.message, err.message
    assert table.free_blocks() == [100], "a refused attach must not keep blocks"


def test_one_mismatch_keeps_its_code_and_field():
    with pytest.raises(DrafterError) as e:
        check_layout(layout(max_num_seqs=9, max_num_batched_tokens=512), ENG)
    assert e.value.field == "max_num_seqs,max_num_batched_tokens"
    assert "--max-num-seqs 9" in e.value.message and "--max-num-batched-tokens 512" in e.value.message
    with pytest.raises(DrafterError) as e:
        check_layout(layout(kv_groups=[schema.KVGroup(block_size=16, num_blocks=101)]), ENG)
    assert (e.value.code, e.value.field) == (Code.RESOURCE_EXHAUSTED, "kv_groups[0].num_blocks")
    assert e.value.message.endswith("(set drafter serve --kv-blocks 101)")
    assert str(e.value).count("RESOURCE_EXHAUSTED") == 1


def test_per_group_flags_keep_the_other_groups_values():
    eng = EngineDescription(**{**ENG.__dict__, "block_sizes": (16, 8), "pool_blocks": (100, 60)})
    with pytest.raises(DrafterError) as e:
        check_layout(layout(kv_groups=[schema.KVGroup(block_size=16, num_blocks=30),
                                       schema.KVGroup(block_size=32, num_blocks=70)]), eng)
    assert "--block-sizes 16,32" in e.value.message and "--kv-blocks 100,70" in e.value.message


def test_a_valid_layout_passes():
    check_layout(layout(), ENG)


# ---------------------------------------------------------------- error texts of the client
@pytest.mark.parametrize("seconds, text", [(0.04998125200006598, "50 ms"), (0.0025, "2.5 ms"), (2.0, "2000 ms"),
                                           (0.001, "1.0 ms")])
def test_times_in_error_texts_are_rounded_milliseconds(seconds, text):
    assert ms(seconds) == text


def test_fail_closed_detail_names_the_status_code_once():
    err = DrafterError(Code.DEADLINE_EXCEEDED, "", f"no reply from tcp://h:1 within {ms(0.0499981)}")
    assert error_detail(err) == "no reply from tcp://h:1 within 50 ms"
    assert error_detail(DrafterError(Code.INVALID_ARGUMENT, "seq_lens", "bad")) == "seq_lens: bad"
    assert error_detail(ValueError("plain")) == "plain"


# ---------------------------------------------------------------- through the plugin, over ZMQ
@pytest.fixture(scope="module")
def engine(tiny_root):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(tiny_root, "eagle3", k=3, max_model_len=MML, num_blocks=BLOCKS)
    torch.set_num_threads(threads)


def test_the_plugin_sees_every_mismatch_in_one_event(engine, caplog):
    async def body(core):
        loop = asyncio.get_running_loop()
        server = zmq_server.ZmqServer(core, host="127.0.0.1", port=0, max_message_bytes=1 << 26)
        server.start()
        d = core.desc
        # a vLLM engine sized like a real one: all three differ from this drafter's flags
        facts = TargetFacts(method="eagle3", num_speculative_tokens=3, hidden_size=d.hidden_size,
                            num_aux_layers=d.num_aux_layers, dtype="float32", max_model_len=4096, max_num_seqs=4,
                            max_num_batched_tokens=128, block_size=32, num_blocks=16384, padded_drafter_batch=True,
                            head_dir="h", target_dir="t", device="cpu", client="/models/t/dp0")
        settings = PluginSettings(endpoints=(f"127.0.0.1:{server.port}",), transport="zmq", deadline_ms=30000)
        source = make_source(settings, facts)
        try:
            attached = await loop.run_in_executor(None, source.start)
        finally:
            await loop.run_in_executor(None, source.close)
            await server.close()
        return attached, list(source.events)

    attached, events = run_with_core(engine, body)
    assert not attached
    detail = events[-1].detail
    assert detail.startswith("attach FAILED_PRECONDITION: 3 mismatches: "), detail
    assert detail.count("FAILED_PRECONDITION") == 1
    for flag in ("--max-model-len 4096", "--block-sizes 32", "--kv-blocks 16384"):
        assert flag in detail, detail
    # and one error line in the target's log, already at the eager attach
    refused = [r.getMessage() for r in caplog.records if "refused the session" in r.getMessage()]
    assert len(refused) == 1 and "(FAILED_PRECONDITION): 3 mismatches" in refused[0], refused


def test_serve_prints_attach_requirements_without_loading_anything(tmp_path):
    import subprocess
    import sys

    # the head directory does not even exist: nothing is loaded, nothing listens
    proc = subprocess.run([sys.executable, "-m", "drafter", "serve", "--method", "eagle3", "--model",
                           str(tmp_path / "no-head"), "--max-model-len", "4096", "--block-sizes", "32",
                           "--kv-blocks", "16384", "--max-num-seqs", "256", "--print-attach-requirements"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("  ")[1].strip(): line for line in proc.stdout.splitlines()[1:]}
    assert "4096" in rows["max model len"] and "--max-model-len, exactly" in rows["max model len"]
    assert "32" in rows["KV block size"] and "<= 16384" in rows["KV blocks"] and "<= 256" in rows["max num seqs"]
