"""Host time of the drafter service's own per-call Python, part by part, on the CPU alone.

    python -m drafter.tools.bench.service_host [--batch 16 --k 3 --ctx 1024 --json OUT]

What a ZMQ propose call costs the server besides the engine's drafting, in the order it runs:
header_decode (msgpack body -> ProposeRequest), tensor_decode (frames -> tensors, drafter.wire.tensors),
check (sessions.check_call, the core's check), prepare (what the engine thread does to a call
alone in its engine call on a GPU host before engine.draft: offset_inputs, the finite check and
HostStager.stage, the copy into the pinned buffer, unpinned here; EngineRunner._prepare and
_run_group's stage, whichever of them stages) and validate (drafter.engine.inputs.validate, which engine.draft(validate=True) runs on
the staged call).  offsets, finite and stage time prepare's pieces alone; `total` runs the whole
path back to back.

The calls are EAGLE-3 / Llama-3.1-8B decode steps as they arrive from the wire: batch requests of
k + 1 tokens, hidden states [tokens, 3 x 4096] bf16, one KV group of block size 16, from the
second session attached (its blocks start past the first's, so offset_inputs really shifts).
The parts cycle through distinct calls totalling more than a server CPU's last-level cache, so
a call's hidden states come from memory as a fresh network message's do.  Each number is
microseconds per call, best of several repeats of many calls (drafter.tools.bench.host.per_call_us).
"""

from __future__ import annotations

import itertools

import msgspec
import torch

from drafter.tools.bench.host import call_shape_args, per_call_us, report
from drafter.tools.bench.transport import BLOCK_SIZE, decode_call, null_engine
from drafter.wire import schema
from drafter.service.batching.checks import check_finite, engine_validate
from drafter.service.batching.queue import Pending
from drafter.service.batching.runner import EngineRunner
from drafter.service.batching.stage import HostStager
from drafter.service.core import describe_engine
from drafter.service.sessions import PROTOCOL_VERSION, SessionTable, check_call, offset_inputs
from drafter.wire.records import ProposeInputs, ProposeRequest
from drafter.wire.tensors import request_from_frames, request_to_frames

COLD_BYTES = 160 << 20  # the distinct calls cycled through: several times any last-level cache


def _session(engine, blocks: int):
    """The second of two sessions of `blocks` blocks each: its block base is `blocks`, not 0."""
    desc = describe_engine(engine, 256 << 20)
    cfg = engine.config
    req = schema.AttachRequest(
        protocol_version=PROTOCOL_VERSION, method=cfg.method, num_speculative_tokens=cfg.num_speculative_tokens,
        hidden_dtype="bfloat16", hidden_size=desc.hidden_size, num_aux_layers=desc.num_aux_layers,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        kv_groups=[schema.KVGroup(block_size=BLOCK_SIZE, num_blocks=blocks)])
    table = SessionTable(desc, 2)
    table.attach(req)
    return desc, table.attach(req)


def wire_message(call: dict) -> tuple[bytes, list[memoryview]]:
    """The msgpack body and tensor frames a ZMQ client sends, as the server receives them."""
    header, frames = request_to_frames(ProposeRequest.from_keywords(**call))
    return msgspec.msgpack.encode(header), [memoryview(bytes(f)) for f in frames]


def measure(batch: int = 16, k: int = 3, ctx: int = 1024, calls: int = 2000) -> dict[str, float]:
    blocks = batch * -(-(ctx + k + 1) // BLOCK_SIZE)
    engine = null_engine(batch, k, ctx, 2 * blocks)
    desc, session = _session(engine, blocks)
    runner = EngineRunner(engine)
    runner.stager = HostStager(64 << 20, pin=False)  # as on a GPU host; pinning needs a GPU, the copy is the same
    hidden_bytes = batch * (k + 1) * desc.hidden_width * 2
    messages = [wire_message(decode_call(batch, k, ctx, blocks, desc.vocab_size, desc.hidden_width, seed=i))
                for i in range(max(2, COLD_BYTES // hidden_bytes))]
    decoder = msgspec.msgpack.Decoder(schema.ProposeRequest)
    decoded = [(body, decoder.decode(body), frames) for body, frames in messages]
    calls_ = [request_from_frames(req, frames) for _, req, frames in decoded]
    shifted = [offset_inputs(session, c.inputs) for c in calls_]
    staged = [runner.stager.stage(_prepare(runner, session, calls_[0]))]  # the buffer is reused
    for inp in staged:
        engine_validate(engine, inp)  # the calls are valid: every part below runs its whole path

    def cycled(fn, items):
        it = itertools.cycle(items)
        return per_call_us(lambda: fn(next(it)), calls)

    def total(message):
        body, _, frames = message
        call = request_from_frames(decoder.decode(body), frames)
        check_call(session, call, desc)
        engine_validate(engine, _prepare(runner, session, call))

    return {
        "header_decode_us": cycled(lambda m: decoder.decode(m[0]), decoded),
        "tensor_decode_us": cycled(lambda m: request_from_frames(m[1], m[2]), decoded),
        "check_us": cycled(lambda c: check_call(session, c, desc), calls_),
        "prepare_us": cycled(lambda c: _prepare(runner, session, c), calls_),
        "offsets_us": cycled(lambda c: offset_inputs(session, c.inputs), calls_),
        "finite_us": cycled(check_finite, shifted),
        "stage_us": cycled(runner.stager.stage, shifted),
        "validate_us": cycled(lambda inp: engine_validate(engine, inp), staged),
        "total_us": cycled(total, decoded),
    }


def _prepare(runner: EngineRunner, session, call) -> ProposeInputs:
    """The engine thread's work on a call alone in its engine call, up to engine.draft."""
    return runner.stager.stage(runner._prepare(Pending(session, call, None), True))


def main(argv=None) -> int:
    p = call_shape_args("python -m drafter.tools.bench.service_host", __doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per repeat")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # host overhead, not OpenMP: one thread keeps the numbers steady
    report(measure(args.batch, args.k, args.ctx, args.calls), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
