"""Host time of the RemoteProposer's copies into its bound ring (one copy per tensor), per step.

    python -m coordinator.bench.bound_fill [--batch 1,16,64 --k 3 --threads 1 --json OUT]

coordinator.transport.bound_transport copies a decode step's tensors (EAGLE-3 at Llama-3.1-8B
shapes: 3 x 4096 bfloat16 hidden states per token, max_model_len 8192, 16-token blocks) into the
ring the bound session ships.  With CUDA the inputs live on the GPU: device copies into a mirror of
the ring there, then one device-to-host copy into the pinned ring and one stream sync
(fill_through), as the transport does; without, fill() copies host to host.  Printed per
batch: p50 and p99 microseconds over many steps, and the bytes a step ships.  --threads sets
torch's intra-op threads (default 1: on a busy host torch's thread pool turns a 1.6 MB copy from
~0.1 ms into tens of milliseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from coordinator.session import SessionSpec
from coordinator.transport.bound_client import BoundRing
from coordinator.transport.bound_transport import fill, fill_through, fits, session_buffers
from drafter.engine.config import KVGroupSpec
from drafter.wire.records import ProposeRequest

HIDDEN, AUX, MML, BLOCK = 4096, 3, 8192, 16


def decode_step(batch: int, k: int, device: str) -> ProposeRequest:
    """A padded decode step of `batch` sequences: k + 1 tokens each, one rejected in every other row."""
    n = batch * (k + 1)
    cols = -(-MML // BLOCK)
    qsl = torch.arange(0, n + 1, k + 1, dtype=torch.int32)
    rejected = (torch.arange(batch) % 2).to(torch.int32)
    kw = dict(target_token_ids=torch.randint(0, 128000, (n,), dtype=torch.int32),
              target_positions=torch.arange(n, dtype=torch.int64) + 1000,
              target_hidden_states=torch.randn(n, HIDDEN * AUX).to(torch.bfloat16),
              next_token_ids=torch.randint(0, 128000, (batch,), dtype=torch.int32),
              query_start_loc=qsl, seq_lens=torch.full((batch,), 1000 + k + 1, dtype=torch.int32),
              block_tables=torch.randint(0, 100000, (batch, cols), dtype=torch.int32),
              slot_mappings=torch.arange(n, dtype=torch.int64) * 7,
              token_indices_to_sample=qsl[1:] - 1 - rejected, num_rejected_tokens=rejected)
    return ProposeRequest.from_keywords(**{name: t.to(device) for name, t in kw.items()})


def measure(batch: int, k: int, steps: int, device: str) -> dict:
    spec = SessionSpec(method="eagle3", num_speculative_tokens=k, hidden_size=HIDDEN, num_aux_layers=AUX,
                       max_model_len=MML, max_num_seqs=batch, max_num_batched_tokens=8192,
                       kv_groups=(KVGroupSpec(BLOCK, 100000),), dtype="bfloat16")
    info = SimpleNamespace(max_num_seqs=batch, max_num_batched_tokens=8192)
    ring = BoundRing(session_buffers(spec, info, 0, 0, 0))
    mirror = BoundRing(ring.buffers, device=device) if device == "cuda" else None
    request = decode_step(batch, k, device)
    assert fits(ring, request, 1), "the step must go bound"
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        n, _ = fill_through(mirror, ring, request.inputs) if mirror is not None else fill(ring.views, request.inputs)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"batch": batch, "k": k, "device": device, "p50_us": round(statistics.median(times) * 1e6, 1),
            "p99_us": round(times[int(0.99 * (len(times) - 1))] * 1e6, 1),
            "step_bytes": ring.step_bytes(n), "ring_bytes": len(ring.bytes)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [measure(int(b), args.k, args.steps, device) for b in args.batch.split(",")]
    for r in rows:
        print(f"batch {r['batch']:3d} k {r['k']} ({r['device']}, {args.threads} thread(s)): copies into the ring p50 {r['p50_us']:.0f} us, "
              f"p99 {r['p99_us']:.0f} us; a step ships {r['step_bytes'] / 1e6:.2f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
