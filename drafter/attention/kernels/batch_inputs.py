"""Loading a propose call into the static buffers from inside the first-pass CUDA graph.

The call's tensors live wherever the caller put them, so the graph cannot name them.  Instead
the host writes a small header (sizes, dtypes and the tensors' device addresses) into pinned
memory and copies it to a fixed device buffer; the captured loader kernels read the header and
load through those addresses.  What is left on the host per call is that header, one copy and
the replays: no per-input copies and no kernel launch from Python.

The loader does what StaticBuffers.load does: shift the input ids by one, put next_token_ids at
the sampled rows, derive the sampled rows from query_start_loc minus the rejected tokens when
the caller names none, pad every per-token row to slot -1 and every per-request row to an
empty request (seq_len 0, query length 0).  Left stale, because nothing reads them: hidden
states of rows past the call's tokens (finite values from earlier calls, or zeros: they belong
to no request, write no KV, are never sampled) and block-table entries outside the call's rows
and columns (attention reads a request's table only below its seq_len).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drafter.attention.metadata import PADDING_SLOT_ID
from drafter.inputs import ProposeInputs

PAD_SLOT = tl.constexpr(PADDING_SLOT_ID)  # globals a kernel reads must be constexpr

# header layout, in int64 words (constexprs: the kernels read them as globals)
N, B, FLAGS, WIDE, HIDDEN_KIND, HIDDEN_STRIDE = (tl.constexpr(i) for i in range(6))
IDS, POS, NEXT, QSL, SEQ, SAMPLE, REJECTED, HIDDEN = (tl.constexpr(i) for i in range(6, 14))
GROUP0, GROUP_WORDS = 16, 6  # per group: slots, table, table stride, table width, slots wide, table wide
HEADER_WORDS = tl.constexpr(32)  # room for two KV groups
HAS_SAMPLE, HAS_REJECTED = tl.constexpr(1), tl.constexpr(2)  # FLAGS bits
INT_FIELDS = (IDS, POS, NEXT, QSL, SEQ, SAMPLE, REJECTED)  # WIDE bit i: field i of these is int64
_HAS_SAMPLE, _HAS_REJECTED = int(HAS_SAMPLE), int(HAS_REJECTED)  # plain ints for the host side
HIDDEN_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@triton.jit
def _word(hdr_ptr, i):
    """Header word i (independent scalar loads: they overlap)."""
    return tl.load(hdr_ptr + i)


@triton.jit
def _ints(addr, wide, offs, mask, other):
    """Load int elements through a caller's address, as int64 (int32 or int64 storage)."""
    if wide:
        v = tl.load(addr.to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=other)
    else:
        v = tl.load(addr.to(tl.pointer_type(tl.int32)) + offs, mask=mask, other=other).to(tl.int64)
    return v


@triton.jit
def load_inputs_kernel(
    hdr_ptr,  # [header words] int64
    group_word,  # first header word of this KV group
    input_ids_ptr, positions_ptr, qsl_ptr, seq_lens_ptr, sample_ptr,  # static buffers (COMMON only)
    slots_ptr,  # [max_tokens] int64: this group's slot mapping
    table_ptr, stride_t, width,  # [max_batch, width] int32: this group's block table
    num_tokens, num_reqs,  # the padded sizes the graph was captured for
    COMMON: tl.constexpr, BLOCK: tl.constexpr, BLOCK_W: tl.constexpr, TABLE_ROWS: tl.constexpr,
):
    """Program (i, 0): token and request rows [i * BLOCK, (i + 1) * BLOCK); program (i, j > 0):
    block-table columns [(j - 1) * BLOCK_W, j * BLOCK_W) of those request rows.  Independent
    loads only (header words, then the caller's tensors): a few memory round trips in all."""
    pid = tl.program_id(0)
    col_block = tl.program_id(1)
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    n = _word(hdr_ptr, N).to(tl.int32)
    b = _word(hdr_ptr, B).to(tl.int32)
    req_ok = rows < num_reqs
    real = rows < b
    if col_block > 0:
        # only the call's own rows and columns: a padded request (seq_len 0) and the columns past
        # what a request was given are never read (attention stops at seq_len, dead rows write
        # nothing), so the rest of the table keeps stale ids rather than costing a fill per call;
        # small [TABLE_ROWS, BLOCK_W] tiles keep the int64 entries in registers
        cols = (col_block - 1) * BLOCK_W + tl.arange(0, BLOCK_W)
        col_ok = (cols < _word(hdr_ptr, group_word + 3)) & (cols < width)
        table_in, table_wide = _word(hdr_ptr, group_word + 1), _word(hdr_ptr, group_word + 5) != 0
        stride_in = _word(hdr_ptr, group_word + 2)
        for r0 in range(pid * BLOCK, tl.minimum((pid + 1) * BLOCK, b), TABLE_ROWS):
            trows = r0 + tl.arange(0, TABLE_ROWS)
            ok = (trows < b)[:, None] & col_ok[None, :]
            entry = _ints(table_in, table_wide, trows[:, None] * stride_in + cols[None, :], ok, 0)
            tl.store(table_ptr + trows[:, None] * stride_t + cols[None, :], entry.to(tl.int32), mask=ok)
        return
    flags = _word(hdr_ptr, FLAGS)
    wide = _word(hdr_ptr, WIDE)
    qsl_addr = _word(hdr_ptr, QSL)
    qsl_wide = ((wide >> 3) & 1) != 0

    # ---- per token row, up to the padded token count
    tok_ok = rows < num_tokens
    live = rows < n
    slots = _ints(_word(hdr_ptr, group_word), _word(hdr_ptr, group_word + 4) != 0, rows, live, PAD_SLOT)
    tl.store(slots_ptr + rows, slots, mask=tok_ok)
    if COMMON:
        pos = _ints(_word(hdr_ptr, POS), ((wide >> 1) & 1) != 0, rows, live, 0)
        tl.store(positions_ptr + rows, pos, mask=tok_ok)
        # the drafter sees token t + 1 beside hidden state t; load_hidden_kernel, which runs after
        # this kernel, then puts next_token_ids at the sampled rows (no per-row request search here)
        shifted = _ints(_word(hdr_ptr, IDS), (wide & 1) != 0, rows + 1, rows + 1 < n, 0)
        tl.store(input_ids_ptr + rows, shifted, mask=tok_ok)

        # ---- per request row, up to the padded batch
        # qsl[0] is 0 by definition: no read, so a neutral header (b = 0, null addresses) reads nothing
        qsl = _ints(qsl_addr, qsl_wide, rows, (rows > 0) & (rows <= b), 0)
        qsl = tl.where(rows <= b, qsl, n)
        tl.store(qsl_ptr + rows, qsl.to(tl.int32), mask=rows <= num_reqs)
        seq = _ints(_word(hdr_ptr, SEQ), ((wide >> 4) & 1) != 0, rows, real, 0)
        tl.store(seq_lens_ptr + rows, seq.to(tl.int32), mask=req_ok)
        if (flags & HAS_SAMPLE) != 0:
            sample = _ints(_word(hdr_ptr, SAMPLE), ((wide >> 5) & 1) != 0, rows, real, 0)
        else:
            sample = _ints(qsl_addr, qsl_wide, rows + 1, real, 1) - 1
            if (flags & HAS_REJECTED) != 0:
                sample -= _ints(_word(hdr_ptr, REJECTED), ((wide >> 6) & 1) != 0, rows, real, 0)
        tl.store(sample_ptr + rows, tl.where(real, sample, 0), mask=req_ok)


@triton.jit
def load_hidden_kernel(
    hdr_ptr,  # [header words] int64
    hidden_ptr, stride_h,  # [max_tokens, width] static buffer
    input_ids_ptr, sample_ptr,  # static buffers, as load_inputs_kernel left them
    width,
    BLOCK: tl.constexpr,
):
    """Program (row, c): columns c of the row's hidden state; program (r, 0) for a request r also
    puts its next token at its sampled row (after load_inputs_kernel wrote the shifted ids)."""
    row = tl.program_id(0)
    col_block = tl.program_id(1)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    if col_block == 0:
        if row < _word(hdr_ptr, B):
            wide = _word(hdr_ptr, WIDE)
            bonus = _ints(_word(hdr_ptr, NEXT), ((wide >> 2) & 1) != 0, row, row >= 0, 0)
            tl.store(input_ids_ptr + tl.load(sample_ptr + row), bonus)
    if row < _word(hdr_ptr, N):
        ok = cols < width
        src = _word(hdr_ptr, HIDDEN)  # an address: cast to the caller's dtype below
        kind = _word(hdr_ptr, HIDDEN_KIND)
        off = row.to(tl.int64) * _word(hdr_ptr, HIDDEN_STRIDE) + cols
        if kind == 0:
            x = tl.load(src.to(tl.pointer_type(tl.bfloat16)) + off, mask=ok).to(tl.float32)
        elif kind == 1:
            x = tl.load(src.to(tl.pointer_type(tl.float16)) + off, mask=ok).to(tl.float32)
        else:
            x = tl.load(src.to(tl.pointer_type(tl.float32)) + off, mask=ok)
        tl.store(hidden_ptr + row.to(tl.int64) * stride_h + cols, x.to(hidden_ptr.dtype.element_ty), mask=ok)


def load_inputs(header: torch.Tensor, buf, num_tokens: int, num_reqs: int) -> None:
    """The graph-side loader: fill the static buffers from the call the header describes.
    header: [header words] int64 on the buffers' device; sizes are the graph's padded sizes."""
    block, block_w = 128, 64
    rows = triton.cdiv(max(num_tokens, num_reqs + 1), block)
    for g, table in enumerate(buf.block_tables):
        load_inputs_kernel[(rows, 1 + triton.cdiv(table.shape[1], block_w))](
            header, GROUP0 + GROUP_WORDS * g,
            buf.input_ids, buf.positions, buf.query_start_loc, buf.seq_lens, buf.sample_indices,
            buf.slot_mappings[g], table, table.stride(0), table.shape[1],
            num_tokens, num_reqs,
            COMMON=g == 0, BLOCK=block, BLOCK_W=block_w, TABLE_ROWS=16, num_warps=4)
    width = buf.hidden.shape[1]
    hb = min(2048, triton.next_power_of_2(width))
    load_hidden_kernel[(num_tokens, triton.cdiv(width, hb))](
        header, buf.hidden, buf.hidden.stride(0), buf.input_ids, buf.sample_indices, width, BLOCK=hb, num_warps=4)


class InputHeader:
    """The per-call header the captured loader reads.

    On a GPU the header lives in pinned host memory, which the device reads in place (pinned
    memory is mapped into the device's address space): no copy per call, and the loader's
    few word loads cross PCIe once.  The host must not rewrite the words before the previous
    call's loader has read them: `loaded()` records an event after the first-pass replay and
    `write` waits on it (in steady state long passed: the caller has consumed those drafts).
    Elsewhere (the CPU emulation in tests) `device` is a separate tensor and `write` copies."""

    def __init__(self, num_groups: int, device):
        words = GROUP0 + GROUP_WORDS * num_groups
        if words > HEADER_WORDS:
            raise ValueError(f"the input header holds {(int(HEADER_WORDS) - GROUP0) // GROUP_WORDS} KV groups")
        mapped = torch.device(device).type == "cuda"
        self.host = torch.zeros(int(HEADER_WORDS), dtype=torch.int64, pin_memory=mapped)
        self.words = self.host.numpy()
        self.device = self.host if mapped else torch.zeros(int(HEADER_WORDS), dtype=torch.int64, device=device)
        self._read = torch.cuda.Event() if mapped else None
        self._pending = False
        self.inputs: tuple = ()  # the call's tensors stay referenced until the next call

    def loaded(self) -> None:
        """Call after the work that reads the header has been queued (the first-pass replay)."""
        if self._read is not None:
            self._read.record()
            self._pending = True

    def write(self, inp: ProposeInputs) -> None:
        """Describe `inp` (tensors on the buffers' device) and send the header to the device."""
        ints = [_flat(t) for t in (inp.target_token_ids, inp.target_positions, inp.next_token_ids,
                                   inp.query_start_loc, inp.seq_lens, inp.token_indices_to_sample,
                                   inp.num_rejected_tokens)]
        hidden = inp.target_hidden_states
        if hidden.stride(1) != 1 or hidden.dtype not in HIDDEN_KINDS:
            hidden = hidden.contiguous().float()
        tables = [t if t.stride(1) == 1 else t.contiguous() for t in inp.block_tables]
        slots = [_flat(t) for t in inp.slot_mappings]
        flags = (_HAS_SAMPLE if ints[5] is not None else 0) | (_HAS_REJECTED if ints[6] is not None else 0)
        wide = sum(1 << i for i, t in enumerate(ints) if t is not None and t.dtype == torch.int64)
        words = [inp.num_tokens, inp.batch_size, flags, wide, HIDDEN_KINDS[hidden.dtype], hidden.stride(0)]
        words += [t.data_ptr() if t is not None else 0 for t in ints] + [hidden.data_ptr(), 0, 0]
        for table, slot in zip(tables, slots):  # from word GROUP0 = 16 on
            words += [slot.data_ptr(), table.data_ptr(), table.stride(0), table.shape[1],
                      int(slot.dtype == torch.int64), int(table.dtype == torch.int64)]
        if self._pending:
            self._read.synchronize()  # the previous call's loader is done with the words
            self._pending = False
        self.words[:len(words)] = words  # one numpy write: this runs once per propose
        self.inputs = (ints, hidden, tables, slots)
        if self.device is not self.host:
            self.device.copy_(self.host)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D int tensor the kernels can index as ptr + i."""
    if t is None or (t.dtype in _INTS and t.is_contiguous()):
        return t
    return (t if t.dtype in _INTS else t.long()).contiguous()


_INTS = (torch.int32, torch.int64)
