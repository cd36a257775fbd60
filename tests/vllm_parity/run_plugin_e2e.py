"""Run a real vLLM 0.32 (CPU) several ways on the same prompts and record what it generated and drafted.

Run with the vLLM venv's python (tests/vllm_parity/setup_venv.sh installs this repository there,
so the plugin's entry point is registered).  One process runs every engine of the plan one after
the other (vLLM is imported once).  Modes:

    nospec      vLLM without speculative decoding
    vllm        vLLM with its own in-process EAGLE drafter
    inprocess   vLLM + plugin, drafter engine in vLLM's process (DRAFTER_TRANSPORT=inprocess)
    zmq / grpc  vLLM + plugin + a `drafter serve` subprocess on 127.0.0.1 (ports picked by the server)
    kill-zmq / kill-grpc
                as zmq / grpc, and the drafter is SIGKILLed right after the plugin's
                `kill_after`-th propose call returned (counted in vLLM's runner, no timing involved);
                with "restart": true a fresh drafter is started on the same ports right after
    unreachable-zmq / unreachable-grpc
                the plugin pointed at a local port nobody listens on
    bypass-ngram
                remote drafting configured for a method the plugin cannot stand in for (ngram):
                vLLM must not start; records the error it stopped with

    python run_plugin_e2e.py PLAN.json OUT.json
PLAN: {"drafter_python": PY, "runs": [{"name", "mode", "target", "head", "method", "k",
       "max_model_len", ...}]}.  OUT: per run: the generated token ids per prompt, every propose
call's drafts (rows in vLLM's batch order, with the request ids), the plugin's counters, whether
a draft model and a draft KV cache exist in vLLM, and timings.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# vLLM reads these at import time; CPU traps measured on the 2-core CI machine (see README.md)
_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)
for _k in ("DRAFTER_ENDPOINTS", "DRAFTER_TRANSPORT", "DRAFTER_DEADLINE_MS"):
    os.environ.pop(_k, None)  # each run configures the plugin explicitly

REPO = Path(__file__).resolve().parents[2]
SPEC_MODES = ("vllm", "inprocess", "zmq", "grpc", "kill-zmq", "kill-grpc", "unreachable-zmq", "unreachable-grpc")
PLUGIN_MODES = SPEC_MODES[1:]


def make_prompts(num: int, vocab: int, max_model_len: int, k: int, seed: int, to_limit: bool = False):
    """Random prompts of varied lengths in one batch; every third request stops early so rows of the
    batch move.  No request comes within 2k+2 tokens of max_model_len: there vLLM skips drafting for
    the whole batch, and its in-process drafter then reads a stale input id our engine does not
    copy (docs/vllm-0.32-proposer.md sections 9 and 11), which would make drafts (never outputs)
    differ for reasons that have nothing to do with the plugin.  `to_limit` lets the long requests run
    to max_model_len instead (drafting is then skipped for whole steps near the end)."""
    rng = random.Random(seed)
    room_end = max_model_len if to_limit else max_model_len - 2 * k - 2
    prompts, max_tokens = [], []
    for i in range(num):
        n = 3 + (i * (room_end // 2)) // max(1, num - 1) + rng.randint(0, 3)
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
        room = room_end - n
        max_tokens.append(max(1, room // 3) if i % 3 == 1 else room)
    return prompts, max_tokens


class Recorder:
    """Wraps vLLM's runner (once per process) to see every step and every propose call."""

    current: "Recorder | None" = None

    def __init__(self, on_call=None):
        self.steps = 0
        self.calls: list[dict] = []
        self.runner = None
        self.on_call = on_call
        self.pending_rejected = None

    @classmethod
    def install(cls) -> None:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        if getattr(GPUModelRunner, "_e2e_wrapped", False):
            return
        GPUModelRunner._e2e_wrapped = True
        orig_exec, orig_pdt = GPUModelRunner.execute_model, GPUModelRunner.propose_draft_token_ids

        def execute_model(runner, *a, **kw):
            rec = cls.current
            if rec is not None:
                rec.runner = runner
                rec.steps += 1
            return orig_exec(runner, *a, **kw)

        def propose_draft_token_ids(runner, *a, **kw):
            drafts = orig_pdt(runner, *a, **kw)
            rec = cls.current
            if rec is not None:
                n = drafts.shape[0]
                rec.calls.append({"step": rec.steps, "req_ids": [str(r) for r in runner.input_batch.req_ids[:n]],
                                  "drafts": drafts.detach().cpu().tolist(), "rejected": rec.pending_rejected})
                rec.pending_rejected = None
                if rec.on_call is not None:
                    rec.on_call(len(rec.calls))
            return drafts

        GPUModelRunner.execute_model = execute_model
        GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids

        # rejected counts per row (what the previous step's verification threw away), to show that
        # acceptance is partial; both vLLM's proposer and the plugin's receive them
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        from drafter_vllm.proposer import RemoteEagleProposer

        for klass in (SpecDecodeBaseProposer, RemoteEagleProposer):
            klass.propose = cls._note_rejected(klass.propose)

    @classmethod
    def _note_rejected(cls, propose):
        def wrapped(proposer, *a, **kw):
            rec = cls.current
            rejected = kw.get("num_rejected_tokens_gpu")
            if rec is not None:
                rec.pending_rejected = None if rejected is None else rejected.detach().cpu().tolist()
            return propose(proposer, *a, **kw)

        return wrapped


class DrafterProcess:
    """`drafter serve` on 127.0.0.1, ports picked by the server and read from its ready line."""

    def __init__(self, python: str, run: dict, log_path: Path, ports: dict | None = None):
        mml, k = run["max_model_len"], run["k"]
        self.args = [python, "-m", "drafter", "serve", "--method", run["method"], "--model", run["head"],
                     "--target-model", run["target"], "--device", "cpu", "--dtype", "float32",
                     "--host", "127.0.0.1", "--num-speculative-tokens", str(k), "--max-model-len", str(mml),
                     "--max-num-seqs", str(run.get("max_num_seqs", 8)),
                     "--max-num-batched-tokens", str(run["max_num_batched_tokens"]),
                     "--block-sizes", str(run.get("block_size", 32)), "--kv-blocks", str(run["num_blocks"]),
                     "--torch-threads", "1", "--log-format", "json"]
        ports = ports or {}
        for name in ("grpc_port", "zmq_port", "health_port", "metrics_port"):
            self.args += ["--" + name.replace("_", "-"), str(ports.get(name, 0))]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=REPO)
        self.ready = self._wait_ready()

    def _wait_ready(self) -> dict:
        # blocking reads of the server's own event lines: it says when it listens, nothing is timed
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if ev.get("event") == "ready":
                threading.Thread(target=self._drain, daemon=True).start()
                return ev
            if ev.get("event") == "failed":
                break
        raise RuntimeError(f"drafter serve did not become ready (exit {self.proc.poll()}); see {self.log.name}")

    def _drain(self) -> None:
        for _ in self.proc.stdout:
            pass

    def endpoint(self, transport: str) -> str:
        port = self.ready["zmq_port" if transport == "zmq" else "grpc_port"]
        return f"127.0.0.1:{port}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()  # the drafter is gone before vLLM's next step starts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_one(run: dict, plan: dict, out_dir: Path) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    mode = run["mode"]
    if mode == "bypass-ngram":
        return run_bypass(run, t0)
    k, mml = run["k"], run["max_model_len"]
    with open(os.path.join(run["target"], "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    llm_kw = dict(model=run["target"], skip_tokenizer_init=True, dtype="float32", max_model_len=mml,
                  block_size=run.get("block_size", 32), enforce_eager=True, enable_prefix_caching=False,
                  max_num_seqs=run.get("max_num_seqs", 8), max_num_batched_tokens=run["max_num_batched_tokens"],
                  num_gpu_blocks_override=run["num_blocks"], seed=0,
                  tensor_parallel_size=run.get("tensor_parallel_size", 1), disable_log_stats=False)
    if mode != "nospec":
        llm_kw["speculative_config"] = {"method": run["method"], "model": run["head"], "num_speculative_tokens": k}

    servers: list[DrafterProcess] = []
    killed = {"after_call": None, "restarted": False}
    transport = mode.split("-")[-1] if mode in PLUGIN_MODES else None
    # equality runs get a deadline no loaded CI box reaches: a missed step would change drafts
    deadline_ms = run.get("deadline_ms", 60000)
    if mode.startswith("unreachable-"):
        drafter_cfg = {"transport": transport, "endpoints": f"127.0.0.1:{_closed_port()}", "deadline_ms": deadline_ms}
    elif transport in ("zmq", "grpc"):
        servers.append(DrafterProcess(plan["drafter_python"], run, out_dir / f"{run['name']}.drafter.log"))
        drafter_cfg = {"transport": transport, "endpoints": servers[0].endpoint(transport), "deadline_ms": deadline_ms}
    elif transport == "inprocess":
        drafter_cfg = {"transport": "inprocess"}
    else:
        drafter_cfg = None
    if drafter_cfg is not None:
        if run.get("config_via") == "env":
            os.environ.update({"DRAFTER_" + key.upper(): str(v) for key, v in drafter_cfg.items()})
        else:
            llm_kw["additional_config"] = {"drafter": drafter_cfg}

    def on_call(n: int) -> None:
        if mode.startswith("kill-") and n == run["kill_after"]:
            killed["after_call"] = n
            servers[-1].kill()
            if run.get("restart"):
                # a fresh drafter (new epoch, empty KV) on the same ports before the next step:
                # the plugin must find it and attach again
                ports = {p: servers[0].ready[p] for p in ("grpc_port", "zmq_port", "health_port", "metrics_port")}
                servers.append(DrafterProcess(plan["drafter_python"], run, out_dir / f"{run['name']}.drafter2.log",
                                              ports=ports))
                killed["restarted"] = True

    rec = Recorder(on_call)
    Recorder.install()
    Recorder.current = rec
    try:
        llm = LLM(**llm_kw)
        t_engine = time.time()
        prompts, max_tokens = make_prompts(run.get("num_prompts", 6), vocab, mml, k, run.get("seed", 0),
                                          run.get("to_limit", False))
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for m in max_tokens]
        before = spec_counters(llm)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        t_gen = time.time()
        after = spec_counters(llm)  # counters live in one registry per process: take the difference
        ranks = llm.collective_rpc(worker_facts)
        facts = {**ranks[0], "ranks": ranks,
                 "spec_decode": {k: v - before.get(k, 0) for k, v in after.items()}}
        result = {
            "name": run["name"], "mode": mode, "method": run["method"],
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "request_ids": [o.request_id for o in outs],
            "steps": rec.steps, "calls": rec.calls, "killed_after_call": killed["after_call"],
            "restarted": killed["restarted"],
            **facts,
            "timing_s": {"engine_start": round(t_engine - t0, 2), "generate": round(t_gen - t_engine, 2)},
        }
        _stop_engine(llm)
        del llm
    finally:
        Recorder.current = None
        for s in servers:
            s.stop()
        for key in ("DRAFTER_TRANSPORT", "DRAFTER_ENDPOINTS", "DRAFTER_DEADLINE_MS"):
            os.environ.pop(key, None)
        _cleanup()
    result["timing_s"]["total"] = round(time.time() - t0, 2)
    print(json.dumps({"run": run["name"], "timing_s": result["timing_s"]}), flush=True)
    return result


def run_bypass(run: dict, t0: float) -> dict:
    """An engine whose runner would draft in-process although remote drafting is configured."""
    from vllm import LLM

    error = None
    try:
        llm = LLM(model=run["target"], skip_tokenizer_init=True, dtype="float32", max_model_len=run["max_model_len"],
                  block_size=32, enforce_eager=True, num_gpu_blocks_override=run["num_blocks"], seed=0,
                  max_num_batched_tokens=run["max_num_batched_tokens"],
                  speculative_config={"method": "ngram", "num_speculative_tokens": run["k"], "prompt_lookup_max": 3},
                  additional_config={"drafter": {"endpoints": f"127.0.0.1:{_closed_port()}"}})
        _stop_engine(llm)
        del llm
    except Exception as exc:  # noqa: BLE001 - what vLLM stopped with is the result
        error = f"{type(exc).__name__}: {exc}"
        cause = exc
        while cause.__cause__ is not None or cause.__context__ is not None:  # the plugin's own error inside
            cause = cause.__cause__ or cause.__context__
            error += f" <- {type(cause).__name__}: {cause}"
    finally:
        _cleanup()
    return {"name": run["name"], "mode": run["mode"], "method": run["method"], "error": error,
            "timing_s": {"total": round(time.time() - t0, 2)}}


def _closed_port() -> int:
    """A local port nobody listens on (the kernel just handed it out and it was closed again)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_facts(worker) -> dict:
    """Runs in every vLLM worker (collective_rpc): what that rank's runner holds."""
    runner = worker.model_runner
    kvc = runner.kv_cache_config
    drafter = getattr(runner, "drafter", None)
    from vllm.distributed import get_tp_group

    return {"tp_rank": get_tp_group().rank_in_group,
            "kv_layers": sorted(n for g in kvc.kv_cache_groups for n in g.layer_names),
            "num_kv_blocks": int(kvc.num_blocks),
            "drafter_class": type(drafter).__name__ if drafter is not None else None,
            "draft_model_loaded": drafter is not None and runner.get_draft_model() is not None,
            "num_target_layers": int(runner.model_config.hf_config.num_hidden_layers),
            "plugin_stats": dict(drafter.stats) if hasattr(drafter, "stats") else None,
            "has_drafter_source": getattr(drafter, "source", None) is not None,
            "attaches": getattr(getattr(drafter, "source", None), "generation", None),
            "no_drafts": dict(drafter.source.stats.no_drafts) if getattr(drafter, "source", None) else None}


def spec_counters(llm) -> dict:
    """vLLM's own speculative-decoding counters (summed over its label sets)."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                      "vllm:spec_decode_num_accepted_tokens"):
            key = m.name.split(":spec_decode_")[1]
            out[key] = out.get(key, 0) + int(m.value)
    return out


def _stop_engine(llm) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _cleanup() -> None:
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main() -> None:
    plan_path, out_path = sys.argv[1], sys.argv[2]
    with open(plan_path) as f:
        plan = json.load(f)
    out_dir = Path(out_path).resolve().parent
    t0 = time.time()
    import vllm  # noqa: F401 - timed once here

    t_import = time.time() - t0
    results = [run_one(run, plan, out_dir) for run in plan["runs"]]
    with open(out_path, "w") as f:
        json.dump({"vllm_import_s": round(t_import, 2), "total_s": round(time.time() - t0, 2), "runs": results}, f)


if __name__ == "__main__":
    main()
