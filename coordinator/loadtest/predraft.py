"""`drafter loadtest --predraft`: sessions of a simulated target against a drafter that pushes
pre-drafts (`drafter serve --predraft-outcomes N`), without and with pre-drafting.

Each session (--dp of them, one thread each) is the simulated target of coordinator.bench.
predraft_target: a batch of rows whose calls carry the verified drafts, the accepted counts and the
next token, so the drafter can read every outcome; each step "verifies" for --verify-ms (the
target's own time: a timed wait of this process, not a GPU), draws each row's accepted length from
--acceptance, and gets its next drafts.  Without pre-drafting it waits for the drafter's reply;
with it the drafter pushes the next step's drafts for its likeliest outcomes while the target
verifies, the target picks locally, and a step whose rows all hit sends its call without waiting
(b follows the trained pair's hit rates, as in that bench).  Reported per run: steps and tokens
per second over all sessions, the draft latency (verification's end to drafts in hand: the part
of a step drafting adds) p50 / p90 / p99, the hit rate (by accepted length), steps sent without
waiting, sets that came after their verification ended.  predraft.json in --out.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import torch

from coordinator.bench.predraft_target import Assumptions, ExactRemote, PreDraft, Rows, SimConfig
from coordinator.predraft import PickerStats
from coordinator.transport.zmq_client import CurveConfig, ZmqDrafterClient
from drafter.wire import schema
from drafter.wire.tensors import DTYPES

BLOCK_SIZE_DEFAULT = 16


class HostVerify:
    """The target's verify as this process sees it: ready `ms` after it started (a timed wait)."""

    def __init__(self, ms: float):
        self.ms, self.end = ms, 0.0

    def launch(self) -> None:
        self.end = time.perf_counter() + self.ms / 1e3

    def wait(self) -> None:
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)  # the simulated target's verification time, not synchronisation


def _attach(endpoint: str, batch: int, timeout_s: float,
            curve: CurveConfig | None = None) -> tuple[ZmqDrafterClient, schema.InfoResponse]:
    client = ZmqDrafterClient(endpoint, timeout_s=timeout_s, curve=curve)
    info = client.info(timeout=max(timeout_s, 10.0))
    lim = info.limits
    client.attach(schema.AttachRequest(
        protocol_version=info.protocol_version, method=info.method, num_speculative_tokens=info.num_speculative_tokens,
        speculative_token_tree=info.speculative_token_tree, hidden_dtype=info.dtype, hidden_size=info.hidden_size,
        num_aux_layers=info.num_aux_layers, max_model_len=lim.max_model_len, max_num_seqs=batch,
        max_num_batched_tokens=batch * (info.num_speculative_tokens + 1),
        kv_groups=[schema.KVGroup(block_size=g.block_size, num_blocks=batch * -(-lim.max_model_len // g.block_size))
                   for g in lim.kv_groups],
        client_name="drafter-loadtest/predraft"), timeout=max(timeout_s, 10.0))
    return client, info


def _session(endpoint: str, predraft: bool, batch: int, verify_ms: float, acceptance: float, duration_s: float,
             warmup_s: float, seed: int, timeout_s: float, out: dict, curve: CurveConfig | None = None) -> None:
    """One target session's loop; fills `out` with its latencies and counts."""
    client, info = _attach(endpoint, batch, timeout_s, curve)
    k, lim = info.num_speculative_tokens, info.limits
    assume = Assumptions(acceptance=(acceptance,))
    cfg = SimConfig(batch, k, ctx=2 * (k + 2), max_len=lim.max_model_len, vocab=lim.vocab_size,
                    width=lim.hidden_width, seed=seed)
    drafter = PreDraft(client) if predraft else ExactRemote(client)
    verify = HostVerify(verify_ms)
    latencies, tokens, steps, t_start = [], 0, 0, time.perf_counter()
    rows = None
    try:
        while time.perf_counter() - t_start < duration_s:
            if rows is None or int(rows.p.max()) + 3 * (k + 1) >= lim.max_model_len:  # new requests
                rows = Rows(cfg, torch.device("cpu"), DTYPES[info.dtype], assume)
                kw, counts = rows.call(None, rows._tokens(batch), drafter.hidden(rows))
                drafter.steps += 1
                rows.set_drafts(*drafter.draft(drafter.steps, kw, counts))
            verify.launch()
            accepted = rows.draw_accepted()
            verify.wait()
            t0 = time.perf_counter()
            sent, next_tokens = drafter.outcomes(rows, accepted, {"not_arrived": 0, "remapped": 0, "empty": 0})
            kw, counts = rows.call(sent, next_tokens, drafter.hidden(rows))
            drafter.steps += 1
            rows.set_drafts(*drafter.draft(drafter.steps, kw, counts))
            if t0 - t_start >= warmup_s:
                latencies.append((time.perf_counter() - t0) * 1e6)
                tokens += sum(a + 1 for a in accepted)
                steps += 1
            elif predraft:
                drafter.picker.stats = PickerStats()  # hit statistics of the measured window only
                drafter.unawaited = 0
    finally:
        drafter.close()
        client.close()
    out.update(latency_us=latencies, tokens=tokens, steps=steps)
    if predraft:
        s = drafter.picker.stats
        out.update(rows=dict(s.rows), hits=dict(s.hits), late=s.late, unawaited=drafter.unawaited)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def run_mode(endpoint: str, predraft: bool, *, dp: int, batch: int, verify_ms: float, acceptance: float,
             duration_s: float, warmup_s: float, seed: int, timeout_s: float, curve: CurveConfig | None = None) -> dict:
    """dp sessions side by side for duration_s; the summary of the measured window (curve: the
    client's CURVE keys, --curve-*)."""
    outs = [{} for _ in range(dp)]
    errors: list[str] = []

    def one(s: int) -> None:
        try:
            _session(endpoint, predraft, batch, verify_ms, acceptance, duration_s, warmup_s, seed * 7919 + s,
                     timeout_s, outs[s], curve)
        except Exception as exc:  # noqa: BLE001 - reported, the other sessions go on
            errors.append(f"session {s}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(s,), name=f"predraft-session-{s}", daemon=True) for s in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = [x for o in outs for x in o.get("latency_us", [])]
    window = max(duration_s - warmup_s, 1e-9)
    summary = {"predraft": predraft, "sessions": dp, "batch": batch, "verify_ms": verify_ms, "errors": errors,
               "steps_per_s": sum(o.get("steps", 0) for o in outs) / window,
               "tokens_per_s": sum(o.get("tokens", 0) for o in outs) / window,
               "draft_latency_us": {"p50": _pct(lat, 0.5), "p90": _pct(lat, 0.9), "p99": _pct(lat, 0.99),
                                    "mean": statistics.fmean(lat) if lat else None}}
    if predraft:
        rows, hits = {}, {}
        for o in outs:
            for a, n in o.get("rows", {}).items():
                rows[a] = rows.get(a, 0) + n
            for a, n in o.get("hits", {}).items():
                hits[a] = hits.get(a, 0) + n
        total = sum(rows.values())
        summary.update(hit_rate=sum(hits.values()) / total if total else 0.0,
                       hit_rate_by_a={a: hits.get(a, 0) / n for a, n in sorted(rows.items())},
                       unawaited=sum(o.get("unawaited", 0) for o in outs),
                       late_sets=sum(o.get("late", 0) for o in outs))
    return summary


def line(s: dict) -> str:
    lat = s["draft_latency_us"]
    ms = lambda v: "-" if v is None else f"{v / 1e3:8.3f}"  # noqa: E731
    extra = (f"  hit {s['hit_rate']:.2f} {json.dumps({str(a): round(h, 2) for a, h in s['hit_rate_by_a'].items()})}"
             f" unawaited {s['unawaited']} late {s['late_sets']}") if s["predraft"] else ""
    return (f"{'pre-draft' if s['predraft'] else 'exact':<10} {s['steps_per_s']:8.1f} {s['tokens_per_s']:9.1f} "
            f"{ms(lat['p50'])} {ms(lat['p90'])} {ms(lat['p99'])}{extra}"
            + (f"  errors: {s['errors']}" if s["errors"] else ""))


def run(endpoint: str, out: Path, curve: CurveConfig | None = None, **kw) -> list[dict]:
    """Without, then with pre-drafting; prints a line per run, writes predraft.json."""
    print(f"{'run':<10} {'steps/s':>8} {'tokens/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}   (draft latency: "
          "verification's end to drafts in hand)", flush=True)
    results = []
    for predraft in (False, True):
        s = run_mode(endpoint, predraft, curve=curve, **kw)
        print(line(s), flush=True)
        results.append(s)
    (out / "predraft.json").write_text(json.dumps({"config": {"endpoint": endpoint, **kw}, "runs": results},
                                                  indent=1) + "\n")
    return results
