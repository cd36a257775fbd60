"""`drafter demo`: the whole system on one machine, in under a minute on 2 CPU cores.

  1. train a tiny target + EAGLE-3 head pair (coordinator.target.distill) in a temp dir;
  2. start two real `drafter serve` processes on loopback (ports 0); DP ranks reach one over
     gRPC and the other over ZMQ (rendezvous hashing picks which);
  3. decode a handful of prompts without speculation (the reference output);
  4. run the reference target as TP x DP processes (gloo) drafting through the RemoteProposer;
  5. check the output is token for token the reference, and print what happened: sessions,
     steps, DP agreement, acceptance (length and per draft position), drafts/step latency per
     transport, fail-closed events.  Exit status 1 when anything went wrong.
--chaos kills one drafter (SIGKILL) mid-run and restarts it: output stays identical, steps wait
at most the deadline, drafts resume after the re-attach.  --transport inprocess needs no servers.
--predraft N then runs one more target (TP = DP = 1) whose drafter pushes pre-drafts for N outcomes
per request (docs/predraft.md), over ZMQ (in-process with --transport inprocess): output identical,
hit rate by accepted length, acceptance with and without pre-drafting.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TRANSPORTS = ("both", "grpc", "zmq", "inprocess")


@dataclass(frozen=True)
class DemoConfig:
    tp: int = 2
    dp: int = 2
    prompts: int = 6
    max_new_tokens: int = 32
    k: int = 3
    method: str = "eagle3"
    transport: str = "both"
    deadline_s: float = 1.0
    temperature: float = 0.0
    seed: int = 0
    chaos: bool = False
    workdir: str | None = None
    max_model_len: int = 128
    predraft: int = 0  # outcomes pre-drafted per request in the extra pre-drafting run (0 = no such run)


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="run drafters + a simulated TP x DP target fleet on this machine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DemoConfig()
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel ranks per target")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel ranks (one drafter session each)")
    p.add_argument("--prompts", type=int, default=d.prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=d.k)
    p.add_argument("--method", choices=("eagle3", "eagle"), default=d.method)
    p.add_argument("--transport", choices=TRANSPORTS, default=d.transport,
                   help="both: one drafter over gRPC, one over ZMQ; inprocess: no servers")
    p.add_argument("--deadline", dest="deadline_s", metavar="SECONDS", type=float, default=d.deadline_s,
                   help="per-step budget for drafts")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chaos", action="store_true", help="SIGKILL a drafter mid-run, then restart it")
    p.add_argument("--workdir", default=None, help="keep checkpoints and logs here (default: a temp dir)")
    p.add_argument("--predraft", type=int, default=d.predraft, metavar="OUTCOMES",
                   help="also run one target with pre-drafting for this many outcomes per request (0 = off)")
    p.set_defaults(func=lambda ns: run(DemoConfig(**{f: getattr(ns, f) for f in DemoConfig.__dataclass_fields__
                                                     if hasattr(ns, f)})))
    return p


register = add_demo_parser  # drafter.cli's subcommand convention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="drafter")
    sub = parser.add_subparsers(dest="command")
    add_demo_parser(sub)
    ns = parser.parse_args(["demo", *(sys.argv[1:] if argv is None else argv)])
    return ns.func(ns)


# --------------------------------------------------------------------------- the run
def _pct(values, q):
    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else float("nan")


def run(cfg: DemoConfig) -> int:
    import torch
    from rich.console import Console

    from coordinator.demo import fleet as fleet_mod
    from coordinator.circuit import BreakerConfig
    from coordinator.remote_proposer import ProposerConfig
    from coordinator.target.distill import DistillConfig, train_pair
    from coordinator.target.engine import TargetConfig, TargetEngine
    from coordinator.target.request import random_requests

    console = _console(Console)
    t_start = time.perf_counter()
    work = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="drafter-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    drafters = []
    problems: list[str] = []
    torch.set_num_threads(1)
    try:
        # the fork server imports torch once while the pair trains (fleet ranks start from it)
        warm = threading.Thread(target=lambda: fleet_mod._context().Process(target=_noop).start(), daemon=True)
        warm.start()
        with console.status("training the tiny target + draft head pair ..."):
            report = train_pair(work / "pair", DistillConfig(method=cfg.method, seed=cfg.seed, unroll=cfg.k))
        pair = work / "pair"
        aux = (1, 2, 3) if cfg.method == "eagle3" else ()
        target = TargetConfig(str(pair / "target"), method=cfg.method, aux_layer_ids=aux, num_speculative_tokens=cfg.k,
                              max_model_len=cfg.max_model_len, max_num_seqs=8, max_num_batched_tokens=1024,
                              num_blocks=128, record_calls=False)
        endpoints, drafters = _start_drafters(cfg, pair, target, work, console)
        started = [(d.name, d.pid, d.grpc_port, d.zmq_port, d.epoch) for d in drafters]  # before any chaos
        # uneven DP load: the agreement pads every rank to one size, an idle rank runs dummy steps
        reqs = random_requests(cfg.prompts, vocab_size=512, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                               temperature=cfg.temperature)
        by_dp = _uneven([reqs[d::cfg.dp] for d in range(cfg.dp)])
        with console.status("decoding without speculation (reference) ..."):
            reference = {}
            for group in by_dp:
                ref = TargetEngine(replace(target, num_speculative_tokens=0))
                for r in group:
                    ref.add(r)
                reference.update(ref.run())
        proposer = ProposerConfig(deadline_s=cfg.deadline_s,
                                  breaker=BreakerConfig(failure_threshold=2, backoff_base_s=0.1, backoff_max_s=0.5))
        fcfg = fleet_mod.FleetConfig(target=target, tp=cfg.tp, dp=cfg.dp, name=_spread_name(endpoints, cfg.dp),
                                     endpoints=endpoints,
                                     head_dir=str(pair / "head"), proposer=proposer, timeout_s=300,
                                     gate_steps=(4, 6) if cfg.chaos else ())
        t_fleet = time.perf_counter()
        with console.status(f"running the TP={cfg.tp} x DP={cfg.dp} target fleet ..."):
            result, chaos_note = _run_fleet(fcfg, by_dp, work / "fleet", drafters, cfg)
        fleet_s = time.perf_counter() - t_fleet
        problems += _report(console, cfg, report, result, reference, drafters, started, fleet_s, chaos_note)
        if cfg.predraft:
            with console.status(f"pre-drafting run ({cfg.predraft} outcomes per request) ..."):
                problems += _predraft_run(console, cfg, pair, target, reqs, reference, drafters)
    except Exception as e:  # noqa: BLE001 - the demo reports and exits non-zero
        console.print_exception(max_frames=5)
        problems.append(f"{type(e).__name__}: {e}")
    finally:
        for d in drafters:
            d.stop()
        if not cfg.workdir:
            shutil.rmtree(work, ignore_errors=True)
    total = time.perf_counter() - t_start
    if problems:
        console.print(f"[bold red]FAILED[/] after {total:.1f} s: " + "; ".join(problems))
        return 1
    what = ("speculative output identical to plain decoding" if cfg.temperature == 0 else
            "sampled tokens follow the target's distribution")
    console.print(f"[bold green]OK[/] in {total:.1f} s: {what}")
    return 0


def _noop():
    pass


def _console(console_cls):
    """The terminal's width on a terminal; elsewhere (CI logs, `| tee`) wide enough that no table
    column is cut, instead of rich's 80 columns."""
    if sys.stdout.isatty():
        return console_cls(highlight=False)
    return console_cls(highlight=False, width=WIDE, soft_wrap=True)


WIDE = 200  # columns when stdout is no terminal: the widest table is ~150


def _spread_name(endpoints, dp: int) -> str:
    """The servers' ports are random, so rendezvous hashing may put every DP rank on one drafter;
    pick the first fleet name ("demo", "demo-1", ...) whose sessions use every drafter, so the
    demo always shows both transports."""
    from coordinator.routing import Endpoint, assign, session_key

    eps = [Endpoint.parse(e) for e in endpoints]
    want = min(len(eps), dp)
    for i in range(1000):
        name = "demo" if i == 0 else f"demo-{i}"
        if len(set(assign([session_key(name, d) for d in range(dp)], eps).values())) >= want:
            return name
    return "demo"


def _uneven(by_dp):
    """Move one request from the last DP rank to the first: ranks then finish at different steps."""
    if len(by_dp) > 1 and len(by_dp[-1]) > 1:
        by_dp[0].append(by_dp[-1].pop())
    return by_dp


def _start_drafters(cfg: DemoConfig, pair: Path, target, work: Path, console):
    if cfg.transport == "inprocess":
        return ("inprocess://drafter-a:0", "inprocess://drafter-b:0"), []
    from coordinator.demo.drafters import DrafterProcess, DrafterSpec

    spec = DrafterSpec(str(pair / "head"), str(pair / "target"), cfg.method, cfg.k, target.max_model_len,
                       max_num_seqs=16, max_num_batched_tokens=2048, kv_blocks=4 * target.num_blocks,
                       block_size=target.block_size, predraft_outcomes=cfg.predraft)
    drafters = [DrafterProcess(spec, name=n, log_path=work / f"{n}.log") for n in ("drafter-a", "drafter-b")]
    with console.status("starting two drafter servers ..."):
        for d in drafters:
            d.launch()
        for d in drafters:
            d.wait_ready()
    schemes = {"both": ("grpc", "zmq"), "grpc": ("grpc", "grpc"), "zmq": ("zmq", "zmq")}[cfg.transport]
    return tuple(str(d.endpoint(s)) for d, s in zip(drafters, schemes)), drafters


def _run_fleet(fcfg, by_dp, out, drafters, cfg: DemoConfig):
    from coordinator.demo import fleet as fleet_mod

    if not cfg.chaos:
        return fleet_mod.run_fleet(fcfg, by_dp, out), None
    gates = fleet_mod.make_gates(fcfg)
    procs = fleet_mod.start_fleet(fcfg, by_dp, out, gates)
    note = "no drafter to kill (inprocess)"
    if drafters:
        from coordinator.routing import Endpoint, assign, session_key

        eps = [Endpoint.parse(e) for e in fcfg.endpoints]
        used = assign([session_key(fcfg.name, 0)], eps)[session_key(fcfg.name, 0)]
        victim = drafters[eps.index(used)]  # the drafter DP rank 0 drafts from
        reached, go = gates[4]
        reached.wait(120)
        old_epoch = victim.epoch
        victim.kill()  # SIGKILL at step 4: no drain
        go.set()
        reached, go = gates[6]
        reached.wait(120)
        victim.start()  # same ports, new epoch
        go.set()
        note = f"{victim.name} SIGKILLed before step 4, restarted before step 6 (epoch {old_epoch} -> {victim.epoch})"
    else:
        for reached, go in gates.values():
            go.set()
    return fleet_mod.join_fleet(procs, out, fcfg.timeout_s), note


def _predraft_run(console, cfg: DemoConfig, pair: Path, target, reqs, reference, drafters) -> list[str]:
    """One target (TP = DP = 1) drafting with pre-drafts, and its report lines; problems found."""
    from coordinator.predraft import InProcessPreDrafting, PreDraftingTransport, PushedPreDrafting
    from coordinator.remote_proposer import ProposerConfig, RemoteProposer
    from coordinator.routing import Router, StaticEndpoints
    from coordinator.target.engine import TargetEngine

    if cfg.method != "eagle3":
        return []  # the in-process pre-drafting transport is wired for the eagle3 pair the demo trains
    engine = TargetEngine(replace(target, max_num_seqs=8))
    config = ProposerConfig(deadline_s=max(cfg.deadline_s, 5.0))
    if "bound" in ProposerConfig.__dataclass_fields__:  # pushes ride the unbound Propose
        config = replace(config, bound=replace(config.bound, mode="off"))
    if drafters:
        from coordinator.clients import ServiceTransport

        endpoint = str(drafters[-1].endpoint("zmq"))
        proposer = RemoteProposer(engine.session_spec("demo-predraft"), router=Router(StaticEndpoints([endpoint])),
                                  key="demo-predraft/dp0", connect=lambda ep: ServiceTransport(ep, timeout_s=5),
                                  config=config)
        # this CPU host verifies quicker than it pre-drafts: each step waits for the last push (an event)
        wrapped = PushedPreDrafting(proposer, push_wait_s=5.0)
        engine.proposer, picker, where = wrapped, wrapped.picker, f"pushed over ZMQ from {drafters[-1].name}"
    else:
        transport = PreDraftingTransport(pair / "head", pair / "target", cfg.method, outcomes=cfg.predraft)
        proposer = RemoteProposer(engine.session_spec("demo-predraft"),
                                  router=Router(StaticEndpoints(["inprocess://predraft:0"])), key="demo-predraft/dp0",
                                  connect=lambda ep: transport, config=config)
        engine.proposer, engine.predraft = proposer, InProcessPreDrafting(transport, proposer)
        picker, where = engine.predraft.picker, "in-process"
    engine.proposer.start()
    for r in reqs:
        engine.add(r)
    out = engine.run()
    engine.proposer.close()
    st, s = picker.stats, engine.stats
    by_a = ", ".join(f"a={a}: {st.hits.get(a, 0)}/{n}" for a, n in sorted(st.rows.items()))
    console.print(f"pre-drafting ({cfg.predraft} outcomes per request, {where}): hit rate {st.hit_rate:.2f} "
                  f"({by_a}); {st.late} sets late (dropped); acceptance length {s.acceptance_length:.2f}, per "
                  f"position {[round(x, 2) for x in s.acceptance_by_position]}"
                  + (f"; steps sent without waiting {wrapped.unawaited}" if drafters else ""))
    if cfg.temperature == 0 and out != reference:
        return ["pre-drafting: output differs from plain decoding"]
    return []


# --------------------------------------------------------------------------- the report
def drafter_lines(started, drafters) -> list[str]:
    """One line per drafter as it was started (name, pid, ports, epoch), plus its restart if --chaos
    restarted it: the epochs agree with the chaos line's "old -> new"."""
    out = []
    for (name, pid, grpc_port, zmq_port, epoch), d in zip(started, drafters):
        again = f" (restarted: pid {d.pid}, epoch {d.epoch})" if (d.pid, d.epoch) != (pid, epoch) else ""
        out.append(f"{name}: pid {pid}, gRPC :{grpc_port}, ZMQ :{zmq_port}, epoch {epoch}{again}")
    return out


def _report(console, cfg, report, result, reference, drafters, started, fleet_s, chaos_note) -> list[str]:
    from rich.table import Table

    problems = []
    if console.is_terminal:
        console.rule("[bold]drafter demo")
    else:
        console.print("=== drafter demo ===")
    console.print(f"pair trained here in {report.seconds:.1f} s: target corpus loss {report.target_loss:.2f} "
                  f"(floor {report.corpus_entropy:.2f}); {report.method} head held-out accuracy per position "
                  f"{[round(a, 2) for a in report.head_accuracy]}")
    for line in drafter_lines(started, drafters):
        console.print(line)
    if chaos_note:
        console.print(f"chaos: {chaos_note}")

    sessions = Table(title=f"sessions: TP={cfg.tp} x DP={cfg.dp} target ranks (TP rank 0 of each DP rank talks "
                           f"to its drafter)",
                     caption="gen: sessions attached (1 + re-attaches after a drafter restart); dummy: steps a DP "
                             "rank ran with no requests of its own, only to agree on the padded size with the "
                             "others; drafted: steps with drafts; acc len: tokens a request emits per verify step "
                             "(1 = no draft accepted); no drafts: steps that went on without drafts (fail closed)")
    for col in ("dp", "drafter", "gen", "reqs", "steps", "dummy", "drafted", "acc len", "tok/step", "no drafts"):
        sessions.add_column(col, justify="right")
    lat: dict[str, list[float]] = {}
    proposed = np.zeros(cfg.k)
    accepted = np.zeros(cfg.k)
    emitted = verify = 0
    events = []
    max_wait = 0.0
    for r in result.leaders:
        s = r.stats
        ok = sum(1 for st in r.steps if st.drafts_ok)
        ps = r.proposer_stats
        misses = sum(ps.no_drafts.values()) if ps else 0
        for name, values in (ps.latencies if ps else {}).items():
            lat.setdefault(name, []).extend(values)
        proposed += np.asarray(s.proposed)
        accepted += np.asarray(s.accepted)
        emitted += s.emitted_in_verify_steps
        verify += s.verify_steps
        events += [(r.dp, e) for e in r.events if e.kind != "no_drafts" or e.detail != "attached"]
        max_wait = max([max_wait] + [st.wait_s for st in r.steps])
        sessions.add_row(str(r.dp), str(r.endpoint), str(r.generation), str(len(r.outputs)), str(len(r.steps)),
                         str(sum(st.kind == "dummy" for st in r.steps)), str(ok), f"{s.acceptance_length:.2f}",
                         f"{s.tokens_per_decode_step:.2f}", str(misses))
    console.print(sessions)

    agree = Table(title="DP agreement (first steps): local drafter batch per rank -> one padded size")
    agree.add_column("step", justify="right")
    for r in result.leaders:
        agree.add_column(f"dp{r.dp} batch", justify="right")
    agree.add_column("padded batch", justify="right")
    agree.add_column("padded tokens", justify="right")
    steps = min(len(r.steps) for r in result.leaders)
    shown = list(range(min(4, steps))) + list(range(max(4, steps - 3), steps))
    for i in shown:
        pad = result.leaders[0].steps[i].padding
        agree.add_row(str(pad.step), *[str(r.steps[i].batch) for r in result.leaders], str(pad.batch_padded),
                      str(pad.tokens_padded))
    console.print(agree)

    acc = Table(title="acceptance")
    acc.add_column("draft position", justify="right")
    acc.add_column("verified", justify="right")
    acc.add_column("accepted", justify="right")
    acc.add_column("rate", justify="right")
    for i in range(cfg.k):
        acc.add_row(str(i + 1), str(int(proposed[i])), str(int(accepted[i])),
                    f"{accepted[i] / proposed[i]:.2f}" if proposed[i] else "-")
    console.print(acc)
    length = emitted / verify if verify else 0.0
    console.print(f"acceptance length (tokens per verify step, bonus included): [bold]{length:.2f}[/] with k={cfg.k}")

    lt = Table(title="drafts/step round trip (client side, successful calls)")
    for col in ("transport", "calls", "p50 ms", "p99 ms"):
        lt.add_column(col, justify="right")
    for name, values in sorted(lat.items()):
        lt.add_row(name, str(len(values)), f"{_pct(values, 50):.2f}", f"{_pct(values, 99):.2f}")
    console.print(lt)
    console.print(f"longest wait for drafts in any step: {max_wait * 1e3:.1f} ms "
                  f"(deadline {cfg.deadline_s * 1e3:.0f} ms)")

    if events:
        ev = Table(title="session events and fail-closed steps")
        for col in ("DP", "t (s)", "event", "endpoint", "detail", "wait ms"):
            ev.add_column(col)
        for dp, e in events[:30]:
            ev.add_row(str(dp), f"{e.t:.2f}", e.kind, e.endpoint, e.detail[:48], f"{e.wait_s * 1e3:.1f}")
        if len(events) > 30:
            ev.add_row("", "", f"... {len(events) - 30} more", "", "", "")
        console.print(ev)

    out = result.outputs
    same = out == reference
    n_tokens = sum(len(v) for v in out.values())
    console.print(f"fleet: {len(out)} requests, {n_tokens} tokens in {fleet_s:.1f} s (process start included)")
    if cfg.temperature == 0:
        console.print(f"output vs non-speculative decoding: {'[green]identical' if same else '[red]DIFFERENT'}")
        if not same:
            problems.append("speculative output differs from plain decoding")
    else:
        # sampled tokens differ run to run; what must hold is their distribution: each token's
        # randomised PIT under the target's own distribution is U(0, 1)
        from coordinator.target.verify import ks_uniform

        d, p = ks_uniform([u for r in result.leaders for u in r.stats.pit])
        console.print(f"sampling vs the target's distribution: KS D={d:.3f}, p={p:.3f} "
                      f"({'[green]consistent' if p > 1e-3 else '[red]INCONSISTENT'}[/])")
        if p <= 1e-3:
            problems.append(f"sampled tokens do not follow the target distribution (KS p={p:.2g})")
    if max_wait > cfg.deadline_s + 1.0:
        problems.append(f"a step waited {max_wait:.2f} s for drafts (deadline {cfg.deadline_s} s)")
    if verify == 0:
        problems.append("no drafts were ever verified")
    return problems


if __name__ == "__main__":
    raise SystemExit(main())
