"""drafter.tools.bench.predraft: its model's arithmetic, and a tiny smoke run on CPU (the GPU run
is the lead's; this keeps the tool runnable)."""

from __future__ import annotations

import json

import pytest

from drafter.tools.bench.predraft import Model, main
from tests.support.pair import one_torch_thread  # noqa: F401 (fixture)


def test_model_arithmetic():
    m = Model(acceptance=(0.5,), hit_by_a=(0.2,), hit_all=1.0, predraft_factor=1.0, remote_overhead_us=1000.0,
              push_overhead_us=0.0)
    assert m.tau(2) == pytest.approx(1 + 0.5 + 0.25)
    # P(a=0) = 0.5, P(a=1) = 0.25, P(a=2) = 0.25
    assert m.hit_rate(2) == pytest.approx(0.5 * 0.2 + 0.25 * 0.2 + 0.25 * 1.0)
    fast = m.rates(batch=2, k=2, v_us=10_000, d_us=1000, p_us=1000)
    assert fast["fits"] and fast["in_process"] == pytest.approx(2e6 * 1.75 / 11_000)
    assert fast["exact_remote"] == pytest.approx(2e6 * 1.75 / 12_000)
    h = m.hit_rate(2)
    assert fast["predraft_remote"] == pytest.approx(2e6 * 1.75 / (10_000 + (1 - h) * 2000))
    late = m.rates(batch=2, k=2, v_us=10_000, d_us=1000, p_us=9500)  # pre-drafts cannot be in time
    assert not late["fits"] and late["predraft_remote"] == pytest.approx(late["exact_remote"])


def test_tiny_smoke_run_writes_its_table(tmp_path):
    assert main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--batches", "2", "--ks", "3", "--iters", "1",
                 "--ctx", "32"]) == 0
    data = json.loads((tmp_path / "predraft.json").read_text())
    row = data["rows"][0]
    assert row["batch"] == 2 and row["k"] == 3 and row["draft_us"] > 0 and row["predraft_us"] > 0
    assert {t["verify_ms"] for t in data["table"]} == {10.0, 25.0}
    assert "Assumptions" in (tmp_path / "predraft.md").read_text()


def test_served_drafter_records_each_calls_stages(tmp_path, monkeypatch):
    """`serve`'s stage recorder: a call that asked for pre-drafts leaves one JSON line with its
    request id and the marks of its pre-draft and push, in order, after the transport's marks."""
    from dataclasses import replace
    from types import SimpleNamespace

    import torch

    from drafter.engine.engine import DraftEngine
    from drafter.engine.predraft import PreDraftGraphs
    from drafter.service.predraft import PreDraftService
    from drafter.tools.bench.predraft import record_stages
    from drafter.wire import probes
    from drafter.wire.records import ProposeRequest
    from tests.unit.test_predraft_target import _engine, _rows

    for cls, name in ((DraftEngine, "predraft"), (PreDraftService, "_predraft"), (PreDraftService, "after_batch"),
                      (PreDraftGraphs, "run")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
    path = tmp_path / "stages.jsonl"
    record_stages(str(path))
    try:
        engine = _engine(2)
        service = PreDraftService(engine)
        kw, _ = _rows().call(None, torch.zeros(2, dtype=torch.long), _rows().hidden)
        call = replace(ProposeRequest.from_keywords(**kw, request_id=41), want_predrafts=True)
        call.probe = probes.start("test")
        call.probe.mark("send")
        out = engine.propose(**kw)
        pushed = []
        session = SimpleNamespace(id="s", bases=(0,), block_sizes=(16,), num_speculative_tokens=3)
        service.after_batch([SimpleNamespace(call=call, session=session, push=pushed.append)], [out])
    finally:
        probes.disable()
    rec = json.loads(path.read_text().splitlines()[0])
    names = [name for name, _ in rec["marks"]]
    assert rec["request_id"] == 41 and len(pushed) == 1 and (pushed[0].accepted >= 0).any()
    assert names == ["start", "send", "predraft_start", "predraft_engine_start", "predraft_engine", "predraft", "push"]
    assert all(a[1] <= b[1] for a, b in zip(rec["marks"], rec["marks"][1:]))
