"""Pre-drafting (issue 23) with the trained pair: the engine's pre-drafts (scratch KV only, each
outcome isolated, the all-accepted outcome equal to a longer chain), the target's local pick
(stale and late pre-drafts dropped), and the reference target loop with pre-drafting on: output
unchanged (greedy identical, sampling distributed as the target), hit rate by a and acceptance
printed, and every pre-draft the target used equal to what a fresh engine pre-drafts offline."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from coordinator.predraft import PreDraftPicker, call_inputs
from coordinator.target.predraft_report import LoopConfig, hit_step_acceptance, run_loop
from coordinator.target.request import random_requests
from coordinator.target.verify import ks_uniform
from drafter.engine.config import EngineConfig, KVGroupSpec
from drafter.engine.engine import DraftEngine
from drafter.service.config import ServerConfig
from drafter.wire.errors import InvalidInput
from drafter.wire.predraft import PreDrafts, lookup, merge, outcomes_of_call
from tests.support.pair import one_torch_thread, trained_pair  # noqa: F401 (fixture)
from tests.support.predraft import replay_against_offline

K = 3
KP = 5  # k' of the deeper pre-drafts: a hit's row verifies 5 drafts where exact steps verify 3
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root, _ = trained_pair(tmp_path_factory)
    return root


def _engine(pair, k=K, outcomes=4, **kw) -> DraftEngine:
    return DraftEngine.from_dirs(pair / "head", pair / "target", EngineConfig(
        method="eagle3", num_speculative_tokens=k, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=1024,
        kv_groups=(KVGroupSpec(16, NUM_BLOCKS),), predraft_outcomes=outcomes, **kw))


def _run(pair, requests, k=K, outcomes=0, predraft_tokens=0):
    """The reference target loop over the in-process drafter; pre-drafting on when outcomes > 0."""
    return run_loop(LoopConfig(str(pair), k=k, outcomes=outcomes, num_blocks=NUM_BLOCKS,
                               predraft_tokens=predraft_tokens), requests)


@pytest.fixture(scope="module")
def greedy_runs(pair):
    reqs = random_requests(6, vocab_size=512, max_new_tokens=40, seed=1)
    return reqs, _run(pair, reqs, k=0)[1], _run(pair, reqs), _run(pair, reqs, outcomes=4)


# --------------------------------------------------------------------------- the engine
def _decode_call(greedy_runs):
    """A recorded decode call of the plain loop (every row verified drafts), and the calls before it."""
    _, _, (plain, _), _ = greedy_runs
    for n, call in enumerate(plain.calls):
        if n and call.drafts is not None and bool((call.accepted_counts >= 0).all()):
            return plain.calls[: n + 1]
    raise AssertionError("no decode call")


def _replay(engine, calls):
    out = None
    for call in calls:
        out = engine.propose(**call.kwargs, batch_padded=call.padding.batch_padded,
                             tokens_padded=call.padding.tokens_padded)
    return out.draft_token_ids


def test_predraft_writes_only_scratch_and_isolates_outcomes(pair, greedy_runs):
    calls = _decode_call(greedy_runs)
    wide, narrow = _engine(pair, outcomes=8), _engine(pair, outcomes=2)
    drafts = _replay(wide, calls)
    assert torch.equal(drafts, _replay(narrow, calls))
    before = [t[:, :NUM_BLOCKS].clone() for t in wide.kv.layers]
    inp = call_inputs(calls[-1].kwargs)
    pre8 = wide.predraft(inp, drafts, step=7)
    assert all(torch.equal(b, t[:, :NUM_BLOCKS]) for b, t in zip(before, wide.kv.layers)), "session KV written"
    pre2 = narrow.predraft(inp, drafts, step=7)
    assert pre8.drafts.shape == (inp.batch_size, 8, K) and pre2.drafts.shape == (inp.batch_size, 2, K)
    assert torch.equal(pre8.conditioned_on, drafts) and pre8.step == 7
    # ranked by joint probability; the two likeliest are the same outcomes with the same drafts,
    # however many other outcomes shared the batch (a branch sees only its own keys)
    assert bool((pre8.log_probs[:, :-1] >= pre8.log_probs[:, 1:]).all())
    assert torch.equal(pre8.accepted[:, :2], pre2.accepted) and torch.equal(pre8.next_tokens[:, :2], pre2.next_tokens)
    assert torch.equal(pre8.drafts[:, :2], pre2.drafts)
    # b is never the rejected draft itself
    for r in range(inp.batch_size):
        for a, b in zip(pre8.accepted[r].tolist(), pre8.next_tokens[r].tolist()):
            assert 0 <= a <= K and (a == K or b != int(drafts[r, a]))


def test_all_accepted_predraft_continues_the_longer_chain(pair, greedy_runs):
    """The outcome 'all k accepted, then the head's own next token' conditions on exactly what a
    chain of 2k + 1 drafts conditions on: its pre-draft must be that chain's last k drafts."""
    calls = _decode_call(greedy_runs)
    short = _engine(pair, outcomes=4)
    drafts = _replay(short, calls)
    pre = short.predraft(call_inputs(calls[-1].kwargs), drafts, step=0)
    longer = _replay(_engine(pair, k=2 * K + 1, outcomes=0), calls)
    assert torch.equal(longer[:, :K], drafts)
    checked = 0
    for r in range(drafts.shape[0]):
        match = ((pre.accepted[r] == K) & (pre.next_tokens[r] == longer[r, K])).nonzero()
        if match.numel():
            assert pre.drafts[r, int(match[0, 0])].tolist() == longer[r, K + 1:].tolist(), f"row {r}"
            checked += 1
    assert checked >= 1


def test_deeper_predrafts_rank_the_same_outcomes_and_continue_the_longer_chain(pair, greedy_runs):
    """k' > k: the trunk runs along the k drafts verified, padded with -1 to k' (no outcome accepts a
    pad), so the outcomes and their ranks are those of k' = k, each branch extends k' = k's branch,
    and the all-accepted outcome's pre-draft is the last k' drafts of a chain of k + 1 + k'."""
    calls = _decode_call(greedy_runs)
    same, deeper = _engine(pair), _engine(pair, predraft_tokens=KP)
    drafts = _replay(same, calls)
    assert torch.equal(_replay(deeper, calls), drafts)
    inp = call_inputs(calls[-1].kwargs)
    p3, p5 = same.predraft(inp, drafts, step=0), deeper.predraft(inp, drafts, step=0)
    assert p5.drafts.shape[-1] == KP and p5.conditioned_on[:, K:].eq(-1).all()
    assert torch.equal(p5.conditioned_on[:, :K], drafts)
    assert torch.equal(p5.accepted, p3.accepted) and torch.equal(p5.next_tokens, p3.next_tokens)
    assert torch.allclose(p5.log_probs, p3.log_probs, atol=1e-5) and int(p5.accepted.max()) <= K
    assert torch.equal(p5.drafts[..., :K], p3.drafts), "a deeper branch extends the k-long one"
    longer = _replay(_engine(pair, k=K + 1 + KP, outcomes=0), calls)
    checked = 0
    for r in range(drafts.shape[0]):
        match = ((p5.accepted[r] == K) & (p5.next_tokens[r] == longer[r, K])).nonzero()
        if match.numel():
            assert p5.drafts[r, int(match[0, 0])].tolist() == longer[r, K + 1:].tolist(), f"row {r}"
            checked += 1
    assert checked >= 1
    # after hits the target verifies k' drafts: the next pre-draft conditions on all of them
    used, flags = merge(drafts, [p5.drafts[0, 0]] + [None] * (drafts.shape[0] - 1))
    assert used.shape == (drafts.shape[0], KP) and flags[0] and not any(flags[1:])
    assert torch.equal(used[0], p5.drafts[0, 0]) and used[1:, K:].eq(-1).all() and torch.equal(used[1:, :K], drafts[1:])
    again = deeper.predraft(inp, used, step=1)
    assert int(again.accepted[0].max()) <= KP and int(again.accepted[1:].max()) <= K
    with pytest.raises(InvalidInput) as e:
        deeper.predraft(inp, torch.zeros(drafts.shape[0], KP + 1, dtype=torch.long), 0)
    assert e.value.field == "drafts"


def _first_request_of(call) -> dict:
    """The propose keywords of a recorded call cut to its first request (a small call)."""
    kw = call.kwargs
    end = int(kw["query_start_loc"][1])
    one = {n: kw[n][:end] for n in ("target_token_ids", "target_positions", "target_hidden_states")}
    one.update({n: kw[n][:1] for n in ("next_token_ids", "seq_lens", "token_indices_to_sample",
                                       "num_rejected_tokens")})
    one.update(query_start_loc=kw["query_start_loc"][:2], block_tables=[t[:1] for t in kw["block_tables"]],
               slot_mappings=[t[:end] for t in kw["slot_mappings"]])
    return one


def test_predraft_on_the_triton_path_equals_the_reference_path(pair, greedy_runs):
    """The GPU engine's backend and fused head (Triton, interpreted on CPU here) pre-draft what
    the reference backend pre-drafts (one request's prompt: interpreted kernels are slow)."""
    _, _, (plain, _), _ = greedy_runs
    kwargs = _first_request_of(plain.calls[0])
    out = []
    for backend in ("reference", "triton"):
        engine = _engine(pair, outcomes=3, attention_backend=backend)
        drafts = engine.propose(**kwargs).draft_token_ids
        out.append((drafts, engine.predraft(call_inputs(kwargs), drafts, step=1)))
    (d_ref, p_ref), (d_tri, p_tri) = out
    assert torch.equal(d_ref, d_tri)
    for name in ("accepted", "next_tokens", "drafts"):
        assert torch.equal(getattr(p_ref, name), getattr(p_tri, name)), name


def test_predraft_refusals(pair):
    off = _engine(pair, outcomes=0)
    inp = call_inputs(dict(
        target_token_ids=torch.tensor([1, 2, 3]), target_positions=torch.arange(3),
        target_hidden_states=torch.zeros(3, off.spec.hidden_input_width), next_token_ids=torch.tensor([4]),
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32), seq_lens=torch.tensor([3], dtype=torch.int32),
        block_tables=torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32),
        slot_mappings=torch.tensor([16, 17, 18])))
    with pytest.raises(InvalidInput) as e:
        off.predraft(inp, torch.zeros(1, K, dtype=torch.long), 0)
    assert e.value.field == "predraft_outcomes"
    on = _engine(pair)
    with pytest.raises(InvalidInput) as e:
        on.predraft(replace(inp, temperatures=torch.tensor([0.7])), torch.zeros(1, K, dtype=torch.long), 0)
    assert e.value.field == "temperatures"
    with pytest.raises(InvalidInput) as e:
        on.predraft(inp, torch.zeros(1, K + 1, dtype=torch.long), 0)
    assert e.value.field == "drafts"
    with pytest.raises(ValueError, match="predraft_outcomes"):
        EngineConfig(method="mtp", predraft_outcomes=2)
    serve = dict(method="eagle3", model=str(pair / "head"), target_model=str(pair / "target"))
    ServerConfig(**serve, predraft_outcomes=2).check()
    with pytest.raises(ValueError, match="--predraft-outcomes"):
        ServerConfig(**serve, predraft_outcomes=2, tensor_parallel_size=2).check()
    ServerConfig(**serve, predraft_outcomes=2, predraft_k=6).check()
    for bad, why in ((dict(predraft_outcomes=2, predraft_k=-1), ">= 1"), (dict(predraft_k=6), "--predraft-outcomes"),
                     (dict(predraft_outcomes=2, predraft_k=6, max_num_seqs=64, max_num_batched_tokens=256),
                      "--max-num-batched-tokens 256"),
                     (dict(predraft_outcomes=2, predraft_k=2048, max_num_seqs=1, max_num_batched_tokens=4096),
                      "--max-model-len")):
        with pytest.raises(ValueError, match="--predraft-k") as e:
            ServerConfig(**serve, **bad).check()
        assert why in str(e.value), (bad, str(e.value))
    with pytest.raises(ValueError, match="predraft_tokens 8"):
        EngineConfig(method="eagle3", max_num_seqs=64, max_num_batched_tokens=256, predraft_outcomes=2,
                     predraft_tokens=8)


def test_a_deeper_predrafting_drafter_says_so_and_takes_k_prime_accepted(pair):
    """The drafter's description carries k' (InfoResponse.predraft_tokens, both transports), and a
    call may report up to k' drafts accepted (a row that verified a deeper pre-draft); k' = k: 0."""
    from drafter.service.core import describe_engine

    desc = describe_engine(_engine(pair, predraft_tokens=KP), 1 << 20)
    assert desc.predraft_tokens == KP and desc.verify_width == KP
    plain = describe_engine(_engine(pair), 1 << 20)
    assert plain.predraft_tokens == 0 and plain.verify_width == K


# --------------------------------------------------------------------------- the target's pick
def _pre(step, block=5, position=20, drafts=(7, 8, 9)):
    return PreDrafts(step, torch.tensor([block]), torch.tensor([position]), torch.tensor([list(drafts)]),
                     accepted=torch.tensor([[3, 1]]), next_tokens=torch.tensor([[11, 12]]),
                     drafts=torch.tensor([[[21, 22, 23], [31, 32, 33]]]), log_probs=torch.tensor([[-0.1, -2.0]]))


def _next_call(a, b, verified=(7, 8, 9), block=5, position=20):
    """The padded-batch call after a verification of `verified` (drafted from `position`) that
    accepted a of them and sampled b."""
    j = len(verified)
    positions = torch.arange(position + 1, position + 2 + j)
    return call_inputs(dict(
        target_token_ids=torch.tensor([99, *verified]), target_positions=positions,
        target_hidden_states=torch.zeros(j + 1, 4), next_token_ids=torch.tensor([b]),
        query_start_loc=torch.tensor([0, j + 1], dtype=torch.int32),
        seq_lens=torch.tensor([position + 2 + j], dtype=torch.int32),
        block_tables=torch.tensor([[block, 6]], dtype=torch.int32), slot_mappings=positions,
        token_indices_to_sample=torch.tensor([a]), num_rejected_tokens=torch.tensor([j - a]))), torch.tensor([a])


def test_pick_hits_only_the_matching_outcome_of_the_previous_call():
    picker = PreDraftPicker()
    assert picker.pick(4, *_next_call(3, 11)) == [None]  # nothing offered yet
    assert picker.offer(_pre(4))
    assert picker.pick(5, *_next_call(1, 12))[0].tolist() == [31, 32, 33]
    picker.offer(_pre(5))
    assert picker.pick(6, *_next_call(1, 11)) == [None]  # (1, 11) was not predicted
    picker.offer(_pre(6))
    assert picker.pick(7, *_next_call(3, 11, verified=(7, 8, 4))) == [None]  # other drafts were verified
    picker.offer(_pre(7))
    assert picker.pick(8, *_next_call(3, 11, block=9)) == [None]  # another request
    assert picker.stats.hits == {1: 1} and picker.stats.rows == {3: 3, 1: 2}


def test_late_or_stale_predrafts_are_dropped_never_used():
    picker = PreDraftPicker()
    picker.pick(4, *_next_call(3, 11))
    picker.pick(5, *_next_call(3, 11))  # the call after 4: its verification has ended
    assert not picker.offer(_pre(4))  # pre-drafts for call 4 arrive now: late
    assert picker.stats.late == 1
    assert picker.pick(6, *_next_call(3, 11)) == [None]  # and were not kept for a later call
    picker.offer(_pre(6))
    picker.offer(_pre(3))  # older than the latest pick: late too
    assert picker.stats.late == 2
    # a call with no draft call between: the pre-drafts of step 6 serve only the pick right after 6
    assert picker.pick(7, *_next_call(3, 11))[0].tolist() == [21, 22, 23]
    assert picker.pick(8, *_next_call(3, 11)) == [None]
    # the same lookup the drafter side uses
    assert lookup(_pre(1), outcomes_of_call(*_next_call(3, 11))[0]).tolist() == [21, 22, 23]


# --------------------------------------------------------------------------- the target loop
def test_greedy_loop_with_predrafts_is_lossless_and_uses_offline_predrafts(pair, greedy_runs):
    reqs, base, (plain, plain_out), (pre, pre_out) = greedy_runs
    assert plain_out == base and pre_out == base
    picker = pre.predraft.picker.stats
    by_a = {a: f"{picker.hits.get(a, 0)}/{n}" for a, n in sorted(picker.rows.items())}
    s, p = pre.stats, plain.stats
    exact, used = hit_step_acceptance(pre, pre_out)
    print(f"\n[predraft] hit rate {picker.hit_rate:.2f}, by a {by_a}, pre-drafts per row "
          f"{picker.predrafts_per_row:.1f}; acceptance length {s.acceptance_length:.2f} with pre-drafting, "
          f"{p.acceptance_length:.2f} without; per position {[round(x, 2) for x in s.acceptance_by_position]} vs "
          f"{[round(x, 2) for x in p.acceptance_by_position]}; pre-drafted tokens accepted per position "
          f"{[f'{a}/{n}' for a, n in zip(s.accepted_pre, s.proposed_pre)]}; on hit steps {used:.2f} tokens "
          f"with the pre-drafts vs {exact:.2f} with the exact drafts")
    assert picker.hit_rate > 0.5 and len(s.hits) > 20 and picker.late == 0
    # every call's drafts, replayed on a fresh engine: a row whose outcome the offline pre-drafts
    # cover verified exactly that pre-draft, every other row the exact drafts
    hits, misses = replay_against_offline(pre.calls, _engine(pair))
    assert hits == len(s.hits) and misses > 0


def test_greedy_loop_with_deeper_predrafts_is_lossless_and_verifies_them_whole(pair, greedy_runs):
    """k' = 5 > k = 3: a hit's row verifies all 5 pre-drafted tokens (the target takes what it
    receives), output is plain decoding's token for token, and every pre-draft the target used is
    what a fresh engine with k' = 5 pre-drafts offline for that outcome."""
    reqs, base, _, _ = greedy_runs
    pre, out = _run(pair, reqs, outcomes=4, predraft_tokens=KP)
    assert out == base, "greedy output differs from plain decoding"
    s = pre.stats
    print(f"\n[predraft k'={KP}] hit rate {pre.predraft.picker.stats.hit_rate:.2f}, acceptance length "
          f"{s.acceptance_length:.2f}, verified per position {s.proposed}, pre-drafted accepted per position "
          f"{[f'{a}/{n}' for a, n in zip(s.accepted_pre, s.proposed_pre)]}")
    assert len(s.hits) > 10 and all(len(used) == KP for _, _, _, used in s.hits)
    assert s.proposed_pre[KP - 1] > 0 and s.proposed[KP - 1] == s.proposed_pre[KP - 1], \
        "drafts past k are verified, and only on pre-drafted rows"
    hits, misses = replay_against_offline(pre.calls, _engine(pair, predraft_tokens=KP))
    assert hits == len(s.hits) and misses > 0


def test_sampling_loop_with_predrafts_equals_plain_decoding(pair):
    """Sampled output is the same token for token with pre-drafts, exact drafts and no drafts (the
    target samples each position from noise keyed by (seed, position)), and follows the target's
    distribution (KS over the randomised PIT of every emitted token)."""
    reqs = random_requests(6, vocab_size=512, max_new_tokens=40, seed=4, temperature=1.0)
    engine, out = _run(pair, reqs, outcomes=4)
    assert out == _run(pair, reqs, k=0)[1] == _run(pair, reqs)[1]
    stats = engine.predraft.picker.stats
    d, pvalue = ks_uniform(engine.stats.pit)
    print(f"\n[predraft sampling] {len(engine.stats.pit)} tokens, KS D={d:.3f} p={pvalue:.3f}, hit rate "
          f"{stats.hit_rate:.2f} by a {stats.hit_rate_by_a()}, acceptance length {engine.stats.acceptance_length:.2f}")
    assert len(engine.stats.pit) == sum(len(v) for v in out.values())
    assert pvalue > 1e-3 and len(engine.stats.hits) > 0


def test_service_predrafts_yield_when_requests_wait():
    """drafter.service.predraft: with requests waiting for the engine no pre-draft is made (exact
    drafting is never delayed by it); otherwise the call's set is pushed."""
    from types import SimpleNamespace

    from drafter.service.predraft import PreDraftService

    made, pushed, skipped = [], [], []

    class Engine:
        config = SimpleNamespace(predraft_outcomes=2)

        def predraft(self, inputs, drafts, step, outcomes=None):
            made.append(step)
            return _pre(step)

    inputs, accepted = _next_call(3, 11)
    session = SimpleNamespace(id="s", bases=(0,), block_sizes=(16,))
    item = SimpleNamespace(session=session, push=pushed.append,
                           call=SimpleNamespace(want_predrafts=True, inputs=inputs, accepted_counts=accepted,
                                                request_id=9))
    result = SimpleNamespace(draft_token_ids=torch.tensor([[1, 2, 3]]))
    service = PreDraftService(Engine())
    service.on_skip = lambda: skipped.append(1)
    service.busy = lambda: True
    service.after_batch([item], [result])
    assert not made and skipped == [1]
    # the set pushed says "none": no outcome for any row, so nothing can be picked from it
    assert len(pushed) == 1 and pushed[0].step == 9 and not (pushed[0].accepted >= 0).any()
    assert PreDraftPicker().offer(pushed[0]) and lookup(pushed[0], outcomes_of_call(inputs, accepted)[0]) is None
    pushed.clear()
    service.busy = lambda: False
    service.after_batch([item], [result])
    assert made == [9] and len(pushed) == 1 and pushed[0].step == 9


def test_budget_halves_when_late_probes_at_zero_and_grows_in_time():
    from drafter.service.predraft import Budget

    b = Budget(4, probe_every=3)
    assert b.take() == 4
    b.late()
    b.late()
    assert b.take() == 1
    b.late()
    assert [b.take() for _ in range(3)] == [0, 0, 1]  # a probe of one outcome every probe_every calls
    b.in_time()
    b.in_time()
    b.in_time()
    b.in_time()
    assert b.take() == 4  # never above the most


def _service_chain(late: bool):
    """Three calls of one session through PreDraftService with a fake engine: call 2's outcome is
    a hit this side counts (the target verifies the pre-draft next); call 3 shows what the target
    verified: the pre-draft (in time) or call 2's exact drafts (the set came late)."""
    from types import SimpleNamespace

    from drafter.service.predraft import PreDraftService

    made, budgets = [], []

    class Engine:
        config = SimpleNamespace(predraft_outcomes=2)

        def predraft(self, inputs, drafts, step, outcomes=None):
            made.append(outcomes)
            p = int(inputs.target_positions[-1 - int(inputs.num_rejected_tokens[0])])
            n = outcomes or 2
            return PreDrafts(step, torch.tensor([5]), torch.tensor([p]), drafts.clone(),
                             accepted=torch.tensor([[3, 1]])[:, :n], next_tokens=torch.tensor([[11, 12]])[:, :n],
                             drafts=torch.tensor([[[21, 22, 23], [31, 32, 33]]])[:, :n])

    service = PreDraftService(Engine())
    service.on_budget = lambda n, was_late: budgets.append((n, was_late))
    sources = []
    service.on_acceptance = lambda source, verified, accepted: sources.append(source)
    session = SimpleNamespace(id="s", bases=(0,), block_sizes=(16,))
    exact = torch.tensor([[1, 2, 3]])
    calls = [_next_call(3, 11, verified=(7, 8, 9), position=20),   # drafted from 24 after it
             _next_call(3, 11, verified=(1, 2, 3), position=24),   # (3, 11) predicted: a hit, 28 next
             _next_call(3, 11, verified=(1, 2, 3) if late else (21, 22, 23), position=28)]
    for n, (inputs, accepted) in enumerate(calls):
        item = SimpleNamespace(session=session, push=lambda pre: None, call=SimpleNamespace(
            want_predrafts=True, inputs=inputs, accepted_counts=accepted, request_id=n + 1))
        service.after_batch([item], [SimpleNamespace(draft_token_ids=exact)])
    return made, budgets, sources


def test_service_budget_halves_when_the_target_verified_exact_drafts_after_a_hit():
    made, budgets, sources = _service_chain(late=False)
    assert made == [2, 2, 2] and budgets == [(2, False)] * 3
    assert sources == ["exact", "predraft"]  # call 3 verified call 2's pre-draft
    made, budgets, sources = _service_chain(late=True)
    assert made == [2, 2, 1] and budgets[-1] == (1, True)
    assert sources == ["exact", "exact"]  # the late row counts as the exact drafts it was


def _first_requests(kw: dict, n: int) -> dict:
    """A call's propose keywords cut to its first n requests."""
    end = int(kw["query_start_loc"][n])
    out = {k: kw[k][:end] for k in ("target_token_ids", "target_positions", "target_hidden_states")}
    out.update({k: kw[k][:n] for k in ("next_token_ids", "seq_lens", "token_indices_to_sample", "num_rejected_tokens")
                if kw.get(k) is not None})
    out.update(query_start_loc=kw["query_start_loc"][: n + 1], block_tables=[t[:n] for t in kw["block_tables"]],
               slot_mappings=[t[:end] for t in kw["slot_mappings"]])
    return out


@pytest.mark.parametrize("kp", [0, KP])
def test_predraft_graphs_equal_the_eager_predraft(pair, greedy_runs, kp):
    """The GPU path: every outcome of every request in one replay over static buffers, the batch
    padded to a capture size (padded rows write nothing anyone reads), emulated here as the graph
    runner emulates (capture keeps the function, replay calls it again): the same pre-drafts as the
    eager path, for the full budget and a smaller one; with k' = 5 > k also after a hit (one row's
    drafts verified are a 5-long pre-draft, the others k padded with -1)."""
    from types import SimpleNamespace

    engine = _engine(pair, capture_sizes=(1, 2, 4), predraft_tokens=kp)
    calls = _decode_call(greedy_runs)
    drafts = _replay(engine, calls)[:3]
    inp = call_inputs(_first_requests(calls[-1].kwargs, 3))  # 3 rows: pads to 4
    eager = [engine.predraft(inp, drafts, 7), engine.predraft(inp, drafts, 7, outcomes=2)]
    if kp:
        used = merge(drafts, [eager[0].drafts[0, 0], None, None])[0]
        eager.append(engine.predraft(inp, used, 8))

    def capture_extra(fn):
        replay = torch.inference_mode()(fn)
        replay()
        return replay
    engine.graphs = SimpleNamespace(capture_extra=capture_extra)  # the runner's emulated capture
    graphed = [engine.predraft(inp, drafts, 7), engine.predraft(inp, drafts, 7, outcomes=2)]
    graphs = engine._predraft_graphs
    assert graphs.count == 2 and sorted(graphs.replays) == [1, 2, 4]
    if kp:
        graphed.append(engine.predraft(inp, used, 8))
    print(f"\n[predraft graphs] batch {inp.batch_size} padded to {min(b for b in graphs.sizes if b >= inp.batch_size)}")
    assert inp.batch_size not in graphs.sizes  # the call pads: padded rows are exercised
    # host inputs (a server's) went through the graphs' host stage, not a copy per tensor to the device
    assert torch.equal(graphs.stage.host[0][:3], eager[0].positions)
    last = used if kp else drafts.to(torch.long)  # the last call's drafts verified, padded with -1 to max(k, k')
    width = last.shape[1]
    assert torch.equal(graphs.stage.host[3][:3, :width], last) and graphs.stage.host[3][:3, width:].eq(-1).all()
    for e, g in zip(eager, graphed):
        for name in ("block_ids", "positions", "conditioned_on", "accepted", "next_tokens", "drafts"):
            assert torch.equal(getattr(e, name), getattr(g, name)), name
        assert torch.allclose(e.log_probs, g.log_probs)
