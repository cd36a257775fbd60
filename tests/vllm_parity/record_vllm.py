"""Record every EAGLE-1 / EAGLE-3 proposer call of a real vLLM 0.32 engine (CPU).

Standalone: run it with the vLLM venv's python (see setup_venv.sh); it never imports the
`drafter` package. vLLM runs offline and in-process; `SpecDecodeBaseProposer.propose` is wrapped
so that each call's inputs (cloned before vLLM mutates them), the drafts vLLM returned, and the
per-step internals (positions, slots, seq_lens, head inputs/outputs, logits) land in one
safetensors file per call, described by `manifest.json`.  See README.md for the format.

Usage:
  python record_vllm.py --target DIR --head DIR --method eagle|eagle3 --k 3 \
      --max-model-len 128 --out DIR [--disable-padded-drafter-batch]
  python record_vllm.py --runs RUNS.json   # a JSON list of such argument lists, one process
  python record_vllm.py [--runs RUNS.json] --rope-tables CASES.json OUT   # + vLLM's draft rotary
      tables per config case (tests/fixtures/rope_cases.json), in the same process
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

# vLLM reads these at import time; CPU traps measured on the 2-core CI machine.
_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # one OMP thread: on a shared 2-core box spinning OMP workers made generate() 10-30x slower;
    # results are bit-identical to 2 threads (measured)
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
for _k, _v in _ENV.items():
    os.environ.setdefault(_k, _v)

FORMAT = "vllm-propose-recording/1"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target checkpoint dir (HF LlamaForCausalLM)")
    ap.add_argument("--head", required=True, help="draft head checkpoint dir")
    ap.add_argument("--method", required=True, choices=["eagle", "eagle3"])
    ap.add_argument("--k", type=int, required=True, help="num_speculative_tokens")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--out", required=True, help="output dir (created; must be empty or absent)")
    ap.add_argument("--disable-padded-drafter-batch", action="store_true",
                    help="use vLLM's unpadded prepare_inputs path instead of the padded default")
    ap.add_argument("--block-size", type=int, default=32, help="KV block size (CPU: multiple of 32)")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="small values force chunked prefill (partial-prefill propose calls)")
    ap.add_argument("--no-synthetic-clamp", action="store_true",
                    help="skip the extra direct propose() call that exercises the max_model_len clamp")
    ap.add_argument("--no-debug", action="store_true",
                    help="do not record per-step internals (head inputs/outputs, logits)")
    return ap.parse_args(argv)


def make_prompts(num: int, vocab: int, max_model_len: int, seed: int):
    """Random prompts of varied lengths; most run to max_model_len, a few stop early so that
    the batch shrinks (rows of the block table move) while others keep going."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for i in range(num):
        lo, hi = 3, max(4, max_model_len * 2 // 3)
        n = lo + (i * (hi - lo)) // max(1, num - 1)
        n = max(2, min(n + rng.randint(-2, 2), max_model_len - 4))
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
        room = max_model_len - n
        # every third request stops early, the rest run until the sequence is max_model_len long
        max_tokens.append(max(1, room // 3) if i % 3 == 1 else room)
    return prompts, max_tokens


class _Active:
    """Forwards to the recorder of the run in progress: vLLM is patched once per process, and
    several runs (engines) may follow each other in one process."""

    current = None

    def __getattr__(self, name):
        return getattr(_Active.current, name)

    def __setattr__(self, name, value):
        setattr(_Active.current, name, value)


_REC = _Active()
_PATCHED = [False]


class Recorder:
    """Captures one run; the vLLM patches (installed once) write into the active Recorder."""

    def __init__(self, out_dir: str, debug: bool):
        self.out_dir = out_dir
        self.calls_dir = os.path.join(out_dir, "calls")
        os.makedirs(self.calls_dir, exist_ok=True)
        self.debug = debug
        self.calls: list[dict] = []
        self.runner = None
        self.engine_facts: dict = {}
        self._cur: dict | None = None
        # one entry per target step (execute_model): which requests ran how many tokens,
        # blocks vLLM zeroed, and the propose call of that step (None = drafter skipped)
        self.steps: list[dict] = []
        self.synthetic = False

    # -- capture helpers ----------------------------------------------------------------
    @staticmethod
    def _c(t):
        return None if t is None else t.detach().clone().cpu().contiguous()

    def install(self):
        _Active.current = self
        if _PATCHED[0]:
            return
        _PATCHED[0] = True
        import torch
        from vllm.v1.spec_decode import llm_base_proposer as lbp
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        rec = _REC

        orig_pdt = GPUModelRunner.propose_draft_token_ids

        def propose_draft_token_ids(runner, *a, **kw):
            rec.runner = runner
            return orig_pdt(runner, *a, **kw)

        GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids

        orig_exec = GPUModelRunner.execute_model

        def execute_model(runner, scheduler_output, *a, **kw):
            rec.runner = runner
            zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
            rec.steps.append({
                "step": len(rec.steps),
                "num_scheduled_tokens": {str(k): int(v) for k, v in
                                         scheduler_output.num_scheduled_tokens.items()},
                "scheduled_spec_decode_tokens": {
                    str(k): [int(x) for x in v]
                    for k, v in scheduler_output.scheduled_spec_decode_tokens.items()},
                "new_block_ids_to_zero": [int(b) for b in zero] if zero else [],
                "propose_call": None,
            })
            return orig_exec(runner, scheduler_output, *a, **kw)

        GPUModelRunner.execute_model = execute_model

        orig_step = lbp.eagle_step_update_slot_mapping_and_metadata

        def step_update(positions_1d, block_table_tensor, seq_lens, block_size, max_model_len,
                        out_clamped_positions, out_slot_mapping, input_batch_size=None):
            cur = rec._cur
            if cur is not None:
                cur["steps_in"].append(rec._c(positions_1d))
                cur["step_block_tables"].append(rec._c(block_table_tensor))
            orig_step(positions_1d, block_table_tensor, seq_lens, block_size, max_model_len,
                      out_clamped_positions, out_slot_mapping, input_batch_size)
            if cur is not None:
                b = positions_1d.shape[0]
                cur["step_positions"].append(rec._c(out_clamped_positions[:b]))
                cur["step_slot_mapping"].append(rec._c(out_slot_mapping[:b]))
                cur["step_seq_lens"].append(rec._c(seq_lens))

        lbp.eagle_step_update_slot_mapping_and_metadata = step_update

        orig_build = lbp.SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata

        def build_md(proposer, common_attn_metadata, draft_index=0):
            # what attention really sees at chain step `draft_index` (after every in-place update;
            # on CPU-unpadded this differs from the step kernel's output, see the notes)
            cur = rec._cur
            if cur is not None and draft_index >= 1:
                cad = common_attn_metadata
                cur["attn_seq_lens"].append(rec._c(cad.seq_lens))
                cur["attn_slot_mapping"].append(rec._c(cad.slot_mapping))
            return orig_build(proposer, common_attn_metadata, draft_index)

        lbp.SpecDecodeBaseProposer.build_per_group_and_layer_attn_metadata = build_md

        orig_propose = lbp.SpecDecodeBaseProposer.propose

        def propose(proposer, *a, **kw):
            names = ["num_speculative_tokens", "target_token_ids", "target_positions",
                     "target_hidden_states", "next_token_ids", "token_indices_to_sample",
                     "common_attn_metadata", "sampling_metadata", "mm_embed_inputs",
                     "num_rejected_tokens_gpu", "slot_mappings"]
            args = dict(zip(names, a))
            args.update(kw)
            rec._hook_model(proposer)
            cad = args["common_attn_metadata"]
            rec.engine_facts.setdefault("target_hidden_in", int(args["target_hidden_states"].shape[-1]))
            cur = {
                "steps_in": [], "step_block_tables": [], "step_positions": [],
                "step_slot_mapping": [], "step_seq_lens": [], "forwards": [], "logits": [],
                "attn_seq_lens": [], "attn_slot_mapping": [],
            }
            t = {
                "target_token_ids": rec._c(args["target_token_ids"]),
                "target_positions": rec._c(args["target_positions"]),
                "target_hidden_states": rec._c(args["target_hidden_states"]),
                "next_token_ids": rec._c(args["next_token_ids"]),
                "token_indices_to_sample": rec._c(args.get("token_indices_to_sample")),
                "num_rejected_tokens": rec._c(args.get("num_rejected_tokens_gpu")),
                "query_start_loc": rec._c(cad.query_start_loc),
                "seq_lens": rec._c(cad.seq_lens),
                "block_table": rec._c(cad.block_table_tensor),
                "slot_mapping": rec._c(cad.slot_mapping),
            }
            scalars = {
                "num_speculative_tokens": int(args["num_speculative_tokens"]),
                "batch_size": int(cad.seq_lens.shape[0]),
                "num_reqs": int(cad.num_reqs),
                "num_actual_tokens": int(cad.num_actual_tokens),
                "max_query_len": int(cad.max_query_len),
                "max_seq_len": int(cad.max_seq_len),
                "causal": bool(cad.causal) if not isinstance(cad.causal, torch.Tensor) else None,
            }
            runner = rec.runner
            req_ids = (list(runner.input_batch.req_ids[: scalars["batch_size"]])
                       if runner is not None and not rec.synthetic else None)
            rec._cur = cur
            try:
                draft = orig_propose(proposer, *a, **kw)
            finally:
                rec._cur = None
            t["draft_token_ids"] = rec._c(draft)
            if rec.debug:
                for j, (inp, out) in enumerate(cur["forwards"]):
                    for name, v in inp.items():
                        t[f"fwd{j}.{name}"] = v
                    t[f"fwd{j}.out_last_hidden"], t[f"fwd{j}.out_hidden"] = out
                for j, lg in enumerate(cur["logits"]):
                    t[f"logits{j}"] = lg
                for key in ("step_positions", "step_slot_mapping", "step_seq_lens",
                            "attn_seq_lens", "attn_slot_mapping"):
                    if cur[key]:
                        t[key] = torch.stack(cur[key])
                if cur["step_block_tables"]:
                    t["step_block_table"] = torch.stack(cur["step_block_tables"])
            if "block_size" not in rec.engine_facts:
                rec.engine_facts.update(rec._facts(proposer))
            rec._save(t, scalars, req_ids)
            return draft

        lbp.SpecDecodeBaseProposer.propose = propose

    def _hook_model(self, proposer):
        if getattr(proposer, "_rec_hooked", False):
            return
        proposer._rec_hooked = True
        rec = _REC
        model = proposer.model

        def fwd_hook(module, args, kwargs, output):
            cur = rec._cur
            if cur is None or not rec.debug:
                return
            inp = {k: rec._c(v) for k, v in kwargs.items() if v is not None and hasattr(v, "shape")}
            for i, v in enumerate(args):
                if hasattr(v, "shape"):
                    inp[f"arg{i}"] = rec._c(v)
            if isinstance(output, tuple):
                out = (rec._c(output[0]), rec._c(output[1]))
            else:
                out = (rec._c(output), rec._c(output))
            cur["forwards"].append((inp, out))

        model.register_forward_hook(fwd_hook, with_kwargs=True)
        orig_cl = model.compute_logits

        def compute_logits(hidden_states):
            logits = orig_cl(hidden_states)
            cur = rec._cur
            if cur is not None and rec.debug:
                cur["logits"].append(rec._c(logits))
            return logits

        model.compute_logits = compute_logits

    def _facts(self, proposer) -> dict:
        facts = {
            "proposer_class": type(proposer).__name__,
            "model_class": type(proposer.model).__name__,
            "block_size": int(proposer.block_size),
            "kv_cache_gid": int(proposer.kv_cache_gid),
            "draft_attn_layer_names": sorted(proposer._draft_attn_layer_names),
            "hidden_size": int(proposer.hidden_size),
            "max_model_len": int(proposer.max_model_len),
            "has_own_embed_tokens": bool(getattr(proposer.model, "has_own_embed_tokens", False)),
            "has_own_lm_head": bool(getattr(proposer.model, "has_own_lm_head", False)),
            "kernel_block_size": [getattr(g, "kernel_block_size", None) for g in proposer.draft_attn_groups],
        }
        d2t = getattr(proposer.model, "draft_id_to_target_id", None)
        facts["draft_vocab_size"] = int(d2t.shape[0]) if d2t is not None else None
        runner = self.runner
        if runner is not None:
            kvc = runner.kv_cache_config
            facts["num_kv_blocks"] = int(kvc.num_blocks)
            facts["kv_cache_groups"] = [
                {"layer_names": list(g.layer_names), "block_size": int(g.kv_cache_spec.block_size),
                 "spec": type(g.kv_cache_spec).__name__} for g in kvc.kv_cache_groups]
            ctx = runner.vllm_config.compilation_config.static_forward_context
            shapes = {}
            for name in facts["draft_attn_layer_names"]:
                kv = getattr(ctx.get(name), "kv_cache", None)
                if kv is not None and hasattr(kv, "shape"):
                    shapes[name] = list(kv.shape)
            facts["draft_kv_cache_shapes"] = shapes
            facts["aux_hidden_state_layers"] = list(getattr(runner.model.model, "aux_hidden_state_layers", ()) or ())
        return facts

    def _save(self, tensors: dict, scalars: dict, req_ids):
        from safetensors.torch import save_file

        idx = len(self.calls)
        fname = f"calls/call_{idx:05d}.safetensors"
        present = {k: v for k, v in tensors.items() if v is not None}
        save_file(present, os.path.join(self.out_dir, fname))
        step = None
        if not self.synthetic and self.steps:
            step = self.steps[-1]["step"]
            self.steps[-1]["propose_call"] = idx
        entry = {"index": idx, "file": fname, **scalars, "req_ids": req_ids,
                 "step": step, "synthetic": self.synthetic,
                 "has_token_indices_to_sample": tensors["token_indices_to_sample"] is not None,
                 "has_num_rejected_tokens": tensors["num_rejected_tokens"] is not None,
                 "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                             for k, v in present.items()}}
        self.calls.append(entry)


def synthetic_clamp_calls(rec: Recorder, k: int, max_model_len: int, block_size: int,
                          vocab: int, seed: int) -> int:
    """vLLM's runner never lets the chain cross max_model_len: it skips the drafter for the
    whole batch once max_seq_len + k > max_model_len.  To still pin down the clamp branch of
    propose(), call the live proposer directly (after generate) on prefill-like rows that end at
    max_model_len, max_model_len-1, ... over fresh block ids no request used.  Rows are fed
    from position 0 in chunks that fit the token budget, so every key slot a row reads was
    written by these synthetic calls themselves (replay needs no other KV)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    runner = rec.runner
    proposer = runner.drafter
    g = torch.Generator().manual_seed(seed + 1234)
    lens = [max_model_len, max_model_len - 1, max_model_len - (k - 1), max(2, max_model_len // 2)]
    lens = [n for n in lens if 1 <= n <= max_model_len][: proposer.max_batch_size]
    nblk = -(-max_model_len // block_size)
    width = runner.input_batch.block_table[proposer.kv_cache_gid].block_table.cpu.shape[1]
    top = int(runner.kv_cache_config.num_blocks) - 1  # the scheduler hands out low ids first
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for r in range(len(lens)):
        for b in range(nblk):
            table[r, b] = top - r * nblk - b
    hid_dim = rec.engine_facts.get("target_hidden_in") or proposer.hidden_size
    tokens = [torch.randint(3, vocab, (n,), generator=g, dtype=torch.int32) for n in lens]
    hidden = [torch.randn(n, hid_dim, generator=g, dtype=torch.float32) for n in lens]
    budget = int(proposer.max_num_tokens)
    chunk = max(1, budget // len(lens))
    done = [0] * len(lens)
    ncalls = 0
    while any(d < n for d, n in zip(done, lens)):
        rows = [r for r in range(len(lens)) if done[r] < lens[r]]
        ids, pos, slots, hid, qsl, seq, nxt = [], [], [], [], [0], [], []
        for r in rows:
            a, b = done[r], min(lens[r], done[r] + chunk)
            p = torch.arange(a, b, dtype=torch.int64)
            pos.append(p)
            ids.append(tokens[r][a:b])
            hid.append(hidden[r][a:b])
            slots.append(table[r, p // block_size].to(torch.int64) * block_size + p % block_size)
            qsl.append(qsl[-1] + (b - a))
            seq.append(b)
            # the "sampled" token: the row's next token, or a random one at the row's end
            nxt.append(int(tokens[r][b]) if b < lens[r] else int(torch.randint(3, vocab, (1,), generator=g)))
            done[r] = b
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        seq_t = torch.tensor(seq, dtype=torch.int32)
        cad = CommonAttentionMetadata(
            query_start_loc=qsl_t.clone(), query_start_loc_cpu=qsl_t.clone(), seq_lens=seq_t.clone(),
            num_reqs=len(rows), num_actual_tokens=qsl[-1],
            max_query_len=int((qsl_t[1:] - qsl_t[:-1]).max()), max_seq_len=max(seq),
            block_table_tensor=table[rows].clone(), slot_mapping=torch.cat(slots),
            causal=True, seq_lens_cpu_upper_bound=seq_t.clone())
        rec.synthetic = True
        try:
            with torch.inference_mode():
                proposer.propose(
                    num_speculative_tokens=k, target_token_ids=torch.cat(ids),
                    target_positions=torch.cat(pos), target_hidden_states=torch.cat(hid),
                    next_token_ids=torch.tensor(nxt, dtype=torch.int32),
                    token_indices_to_sample=None, common_attn_metadata=cad,
                    sampling_metadata=runner.input_batch.sampling_metadata, mm_embed_inputs=None,
                    num_rejected_tokens_gpu=None, slot_mappings=None)
        finally:
            rec.synthetic = False
        ncalls += 1
    return ncalls


def record_one(args) -> dict:
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"--out {args.out} exists and is not empty")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    rec = Recorder(args.out, debug=not args.no_debug)
    rec.install()  # before the engine exists: vLLM runs in this process

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(args.target, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    t_import = time.time()
    spec = {"method": args.method, "model": os.path.abspath(args.head),
            "num_speculative_tokens": args.k,
            "disable_padded_drafter_batch": bool(args.disable_padded_drafter_batch)}
    llm_kw = dict(model=os.path.abspath(args.target), skip_tokenizer_init=True, dtype="float32",
                  max_model_len=args.max_model_len, block_size=args.block_size, enforce_eager=True,
                  enable_prefix_caching=False, max_num_seqs=args.max_num_seqs, seed=0,
                  speculative_config=spec)
    if args.max_num_batched_tokens:
        llm_kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(**llm_kw)
    t_engine = time.time()

    prompts, max_tokens = make_prompts(args.num_prompts, vocab, args.max_model_len, args.seed)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False)
              for m in max_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    t_gen = time.time()
    num_synth = 0
    if not args.no_synthetic_clamp:
        num_synth = synthetic_clamp_calls(rec, args.k, args.max_model_len, args.block_size, vocab,
                                          args.seed)

    requests = []
    for p, m, o in zip(prompts, max_tokens, outs):
        requests.append({"request_id": o.request_id, "prompt_token_ids": p, "max_tokens": m,
                         "output_token_ids": list(o.outputs[0].token_ids),
                         "finish_reason": o.outputs[0].finish_reason})
    manifest = {
        "format": FORMAT,
        "vllm_version": vllm.__version__,
        "method": args.method,
        "k": args.k,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "padded_drafter_batch": not args.disable_padded_drafter_batch,
        "dtype": "float32",
        "target": os.path.abspath(args.target),
        "head": os.path.abspath(args.head),
        "llm_kwargs": {k: v for k, v in llm_kw.items() if k != "speculative_config"},
        "speculative_config": spec,
        "engine": rec.engine_facts,
        "debug_tensors": not args.no_debug,
        "requests": requests,
        "num_calls": len(rec.calls),
        "num_synthetic_calls": num_synth,
        "steps": rec.steps,
        "calls": rec.calls,
        "timing_s": {"import": round(t_import - t0, 2), "engine_start": round(t_engine - t_import, 2),
                     "generate": round(t_gen - t_engine, 2), "total": round(time.time() - t0, 2)},
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    _stop_engine(llm)
    del llm
    _cleanup()
    _Active.current = None
    summary = {"out": args.out, "num_calls": len(rec.calls), "timing_s": manifest["timing_s"]}
    print(json.dumps(summary), flush=True)
    return summary


def _stop_engine(llm) -> None:
    """Tear the in-process engine down so that the next run can start another one."""
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _cleanup() -> None:
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def rope_case_configs(spec: dict, case: dict) -> dict:
    """method -> the head config.json of one rope case in that method's layout (EAGLE-1: a plain
    Llama config; EAGLE-3: speculators, the case keys inside transformer_layer_config, in order)."""
    layer = {**spec["base_layer_config"], **case["keys"]}
    return {"eagle": layer, "eagle3": {**spec["speculators_top"], "transformer_layer_config": layer}}


def _draft_rotary(head_dir: str, method: str, max_model_len: int):
    """The rotary embedding vLLM 0.32 builds for the draft layer of this head: its config classes
    (get_config, the EAGLE max_position_embeddings raise, EAGLEConfig), then get_rope with the
    arguments LlamaAttention passes.  Returns (rope module, hf config)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    config = get_config(head_dir, trust_remote_code=False)
    SpeculativeConfig._maybe_override_draft_max_position_embeddings(config, max_model_len)
    if not isinstance(config, (EAGLEConfig, SpeculatorsConfig)):
        config = EAGLEConfig(config, method=method, model_type="eagle")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with set_current_vllm_config(VllmConfig()):  # custom ops are built under a current config
        rope = get_rope(head_dim, max_position=getattr(config, "max_position_embeddings", 8192), is_neox_style=True,
                        rope_parameters=getattr(config, "rope_parameters", None), dtype=torch.float32)
    return rope, config


def _cos_sin_rows(rope, positions: int, max_model_len: int):
    """[positions, rotary_dim] (cos | sin) rows vLLM's rotary module reads for positions 0..n-1."""
    import torch

    if hasattr(rope, "long_short_cos_sin_cache"):  # longrope: short rows first, long rows from omp on
        offset = rope.original_max_position_embeddings if rope.use_long_rope else 0
        table = rope.long_short_cos_sin_cache
        return table[offset: offset + positions].clone()
    return rope.cos_sin_cache[:positions].clone()


def record_rope_tables(cases_path: str, out_dir: str) -> None:
    """For every case of tests/fixtures/rope_cases.json and both layouts: the cos / sin rows vLLM's
    draft layer rotates with, or the error vLLM raises on the config.  Writes OUT/rope_tables.json
    (per case: rope_parameters and max_position_embeddings as vLLM resolved them, or the error) and
    OUT/rope_tables.safetensors (case/method -> [positions, rotary_dim] float32)."""
    import tempfile
    import types

    from safetensors.torch import save_file
    from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as longrope

    with open(cases_path) as f:
        spec = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    results, tables = {}, {}
    for case in spec["cases"]:
        mml = case["max_model_len"]
        # longrope reads max_model_len from the current vLLM config: this process has none, so the
        # recorder hands it the case's value (the engine's max_model_len)
        longrope.get_current_vllm_config = lambda mml=mml: types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=mml))
        for method, config in rope_case_configs(spec, case).items():
            key = f"{case['name']}/{method}"
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "config.json"), "w") as f:
                    json.dump(config, f)
                try:
                    rope, hf = _draft_rotary(d, method, mml)
                    rows = _cos_sin_rows(rope, spec["positions"], mml)
                except Exception as e:  # noqa: BLE001 - what vLLM refuses is the point here
                    results[key] = {"error": f"{type(e).__name__}: {e}"[:400]}
                    continue
            n = min(spec["positions"], rows.shape[0])
            tables[key] = rows[:n].float().contiguous()
            results[key] = {"rope_parameters": getattr(hf, "rope_parameters", None),
                            "max_position_embeddings": getattr(hf, "max_position_embeddings", None),
                            "rotary_dim": int(rows.shape[1]), "positions": n}
    save_file(tables, os.path.join(out_dir, "rope_tables.safetensors"))
    with open(os.path.join(out_dir, "rope_tables.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(json.dumps({"rope_tables": out_dir, "cases": len(results),
                      "errors": sum("error" in r for r in results.values())}), flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    rope_tables = None
    if "--rope-tables" in argv:
        # no engine: vLLM's config classes and rotary modules for each case of a rope cases file
        i = argv.index("--rope-tables")
        rope_tables, argv = argv[i + 1: i + 3], argv[:i] + argv[i + 3:]
    if rope_tables:
        record_rope_tables(*rope_tables)
        if not argv:
            return
    if argv[:1] == ["--runs"]:
        # several runs in one process: vLLM's import (10-20 s here) is paid once
        with open(argv[1]) as f:
            runs = json.load(f)
        for run_argv in runs:
            record_one(parse_args(run_argv))
        return
    record_one(parse_args(argv))


if __name__ == "__main__":
    main()
