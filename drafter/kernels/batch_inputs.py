"""Loading a propose call into the static buffers from inside the first-pass CUDA graph.

The call's tensors live wherever the caller put them, so the graph cannot name them.  Instead
the host writes a small header (sizes, dtypes, the tensors' device addresses and the address of
the call's output tensor) into pinned host memory that the device reads in place; the captured
loader kernels read the header and load through those addresses, and the loop graph's last
kernel (draft_output.py) stores the drafts through it.  What is left on the host per call is
that header, the output's allocation and the replays: no per-input copies and no kernel launch
from Python.

The loader does what StaticBuffers.load does: shift the input ids by one, put next_token_ids at
the sampled rows, derive the sampled rows from query_start_loc minus the rejected tokens when
the caller names none, pad every per-token row to slot -1 and every per-request row to an
empty request (seq_len 0, query length 0).  Left stale, because nothing reads them: hidden
states of rows past the call's tokens (finite values from earlier calls, or zeros: they belong
to no request, write no KV, are never sampled) and block-table entries outside the call's rows
and columns (attention reads a request's table only below its seq_len).
"""

from __future__ import annotations

import struct
import time

import torch
import triton
import triton.language as tl

from drafter.attention.metadata import PADDING_SLOT_ID
from drafter.wire.errors import InvalidInput
from drafter.wire.records import ProposeInputs

PAD_SLOT = tl.constexpr(PADDING_SLOT_ID)  # globals a kernel reads must be constexpr

# header layout, in int64 words (constexprs: the kernels read them as globals).  Each 1-D int
# tensor is a pair of words: its address, then 1 if int64 (0: int32); an absent optional
# tensor has address 0.  The output is [B, width] int64, contiguous.
N, B, OUT, HIDDEN, HIDDEN_KIND, HIDDEN_STRIDE = (tl.constexpr(i) for i in range(6))
IDS, POS, NEXT, QSL, SEQ, SAMPLE, REJECTED = (tl.constexpr(i) for i in range(6, 20, 2))
MAX_GROUPS = 2
SLOTS = tl.constexpr(20)  # group g's slot mapping: the pair at SLOTS + 2 g
# group g's block table from word TABLES + 4 g: address, wide, row stride, width
TABLES, TABLE_WORDS = tl.constexpr(24), tl.constexpr(4)
# written by the device, not the host: 1 once the call's last kernel has read every header word
# it needs (draft_output.py), so the host may rewrite the header; the host sets it to 0 per call
DONE = tl.constexpr(32)
HEADER_WORDS = tl.constexpr(33)
_N, _B, _DONE = int(N), int(B), int(DONE)  # plain ints for the host's numpy indexing (constexprs are slower)
HIDDEN_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_WIDE = {torch.int32: 0, torch.int64: 1}


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
def _field(hdr_ptr, w, offs, mask, other):
    """Elements of the int tensor whose (address, wide) pair is at header words w, w + 1."""
    return _ints(_word(hdr_ptr, w), _word(hdr_ptr, w + 1) != 0, offs, mask, other)


@triton.jit
def load_inputs_kernel(
    hdr_ptr,  # [header words] int64
    group,  # which KV group
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
        table_word = TABLES + TABLE_WORDS * group
        col_ok = (cols < _word(hdr_ptr, table_word + 3)) & (cols < width)
        stride_in = _word(hdr_ptr, table_word + 2)
        for r0 in range(pid * BLOCK, tl.minimum((pid + 1) * BLOCK, b), TABLE_ROWS):
            trows = r0 + tl.arange(0, TABLE_ROWS)
            ok = (trows < b)[:, None] & col_ok[None, :]
            entry = _field(hdr_ptr, table_word, trows[:, None] * stride_in + cols[None, :], ok, 0)
            tl.store(table_ptr + trows[:, None] * stride_t + cols[None, :], entry.to(tl.int32), mask=ok)
        return

    # ---- per token row, up to the padded token count
    tok_ok = rows < num_tokens
    live = rows < n
    slots = _field(hdr_ptr, SLOTS + 2 * group, rows, live, PAD_SLOT)
    tl.store(slots_ptr + rows, slots, mask=tok_ok)
    if COMMON:
        pos = _field(hdr_ptr, POS, rows, live, 0)
        tl.store(positions_ptr + rows, pos, mask=tok_ok)
        # the drafter sees token t + 1 beside hidden state t; load_hidden_kernel, which runs after
        # this kernel, then puts next_token_ids at the sampled rows (no per-row request search here)
        shifted = _field(hdr_ptr, IDS, rows + 1, rows + 1 < n, 0)
        tl.store(input_ids_ptr + rows, shifted, mask=tok_ok)

        # ---- per request row, up to the padded batch
        # qsl[0] is 0 by definition: no read, so a neutral header (b = 0, null addresses) reads nothing
        qsl = _field(hdr_ptr, QSL, rows, (rows > 0) & (rows <= b), 0)
        qsl = tl.where(rows <= b, qsl, n)
        tl.store(qsl_ptr + rows, qsl.to(tl.int32), mask=rows <= num_reqs)
        seq = _field(hdr_ptr, SEQ, rows, real, 0)
        tl.store(seq_lens_ptr + rows, seq.to(tl.int32), mask=req_ok)
        if _word(hdr_ptr, SAMPLE) != 0:
            sample = _field(hdr_ptr, SAMPLE, rows, real, 0)
        else:
            sample = _field(hdr_ptr, QSL, rows + 1, real, 1) - 1
            if _word(hdr_ptr, REJECTED) != 0:
                sample -= _field(hdr_ptr, REJECTED, rows, real, 0)
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
            bonus = _field(hdr_ptr, NEXT, row, row >= 0, 0)
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
            header, g,
            buf.input_ids, buf.positions, buf.query_start_loc, buf.seq_lens, buf.sample_indices,
            buf.slot_mappings[g], table, table.stride(0), table.shape[1],
            num_tokens, num_reqs,
            COMMON=g == 0, BLOCK=block, BLOCK_W=block_w, TABLE_ROWS=16, num_warps=4)
    width = buf.hidden.shape[1]
    hb = min(2048, triton.next_power_of_2(width))
    load_hidden_kernel[(num_tokens, triton.cdiv(width, hb))](
        header, buf.hidden, buf.hidden.stride(0), buf.input_ids, buf.sample_indices, width, BLOCK=hb, num_warps=4)


class InputHeader:
    """The per-call header the captured graphs read: the loader (inputs in) and the loop's
    last kernel (drafts out, drafter.kernels.draft_output).

    On a GPU the header lives in pinned host memory, which the device reads in place (pinned
    memory is mapped into the device's address space): no copy per call, and the kernels' few
    word loads cross PCIe once.  The host must not rewrite the words before the previous call's
    graphs have read them.  The loop's last kernel says when: after its own header loads it
    sets word DONE to 1 in that same pinned memory, and `store` reads the word (a memory read,
    no CUDA call) before rewriting; in steady state the caller has consumed the previous drafts
    and the word is long set.  A CUDA event would say the same for two CUDA calls per propose
    (record, then query or wait), each 3-7 us on the GPU host inside a call
    (bench/results/2026-11-24-h100-host-probe), more than the rest of a bound call.  Elsewhere
    (the CPU emulation in tests) `device` is a separate tensor, `store` copies, and nothing waits.

    `describe` runs on every propose call, so it reads each tensor's dtype, contiguity, stride
    and address once, converts only what the kernels cannot index (rare), and `store` fills the
    words with one packed write into the header's memory."""

    def __init__(self, num_groups: int, device):
        if num_groups > MAX_GROUPS:
            raise ValueError(f"the input header holds {MAX_GROUPS} KV groups")
        mapped = torch.device(device).type == "cuda"
        self.host = torch.zeros(int(HEADER_WORDS), dtype=torch.int64, pin_memory=mapped)  # [header words]
        self.host_words = self.host.numpy()  # a view: writes land in the pinned memory
        self.device = self.host if mapped else torch.zeros(int(HEADER_WORDS), dtype=torch.int64, device=device)
        self.mapped = mapped
        self._device_index = torch.device(device).index if mapped else None
        self._pending = False  # a call's graphs were queued and may not have read the words yet
        self.owner = None  # who wrote the words now in place (a bound call rewrites only its sizes)
        self._unused_slots = (0, 0) * (MAX_GROUPS - num_groups)  # keeps the tables at word TABLES
        words = int(TABLES) + int(TABLE_WORDS) * num_groups
        self._pack = struct.Struct(f"={words}q").pack_into  # native int64s, the tensor's own layout
        self.inputs: tuple = ()  # the call's tensors (and any converted copies) stay referenced until the next

    def loaded(self) -> None:
        """Call after the last replay that reads the header has been queued."""
        self._pending = self.mapped

    def wait_until_read(self) -> None:
        """Return once the last queued call's graphs are done with the words (DONE set)."""
        if self._pending:
            if self.host_words[_DONE] != 1:
                self._wait_for_done()
            self._pending = False

    def _wait_for_done(self) -> None:
        """The caller queued this call before the previous one finished on the device (it did
        not wait for those drafts): poll the word, giving up the GIL between reads, as a CUDA
        event wait would spin; a device that stops making progress (a fault, a kernel stuck
        behind other work for a second) gets a full synchronize, which raises its error."""
        deadline = time.monotonic() + 1.0
        while self.host_words[_DONE] != 1:
            if time.monotonic() > deadline:
                torch.cuda.synchronize(self._device_index)
                if self.host_words[_DONE] != 1:
                    raise RuntimeError("the draft graphs finished without marking the input header read")
                break
            time.sleep(0)  # lets other Python threads run while the device finishes

    def write(self, inp: ProposeInputs, out: torch.Tensor) -> None:  # out: [batch, width] int64
        """Describe `inp` (tensors on the buffers' device) and `out` (where the drafts go) and make
        the header visible to the device."""
        converted: list[torch.Tensor] = []
        self.store(self.describe(inp, out, converted), (inp, out, converted))

    def describe(self, inp: ProposeInputs, out: torch.Tensor, converted: list | None) -> list[int]:
        """The header words for `inp` and `out` ([>= batch, width] int64, contiguous rows).  A tensor
        the kernels cannot index as it is is converted into `converted` (kept by the caller until
        the graphs have read it), or, with converted None, refused: InvalidInput naming it (a
        bound caller's buffers are read in place, drafter.engine.bound)."""
        hidden = inp.target_hidden_states
        kind, stride = HIDDEN_KINDS.get(hidden.dtype), hidden.stride()
        if kind is None or stride[1] != 1:
            hidden, kind, stride = _readable_hidden(hidden, _converting(converted, "target_hidden_states"))
        words = [inp.target_token_ids.shape[0], inp.next_token_ids.shape[0], out.data_ptr(), hidden.data_ptr(),
                 kind, stride[0]]
        # one loop, no call per tensor: this runs for ~9 tensors on every propose
        for name, t in zip(_INT_FIELDS, (inp.target_token_ids, inp.target_positions, inp.next_token_ids,
                                         inp.query_start_loc, inp.seq_lens, inp.token_indices_to_sample,
                                         inp.num_rejected_tokens, *inp.slot_mappings)):
            if t is None:
                words += (0, 0)
                continue
            wide = _WIDE.get(t.dtype)
            if wide is None or not t.is_contiguous():
                t, wide = _readable_ints(t, _converting(converted, name))
            words += (t.data_ptr(), wide)
        words += self._unused_slots
        for table in inp.block_tables:
            wide, stride = _WIDE.get(table.dtype), table.stride()
            if wide is None or stride[1] != 1:
                table, wide, stride = _readable_table(table, _converting(converted, "block_tables"))
            words += (table.data_ptr(), wide, stride[0], table.shape[1])
        return words

    def store(self, words: list[int], keep: tuple, owner=None) -> None:
        """Make `words` the header the device reads, once the previous call's graphs are done
        with the old ones; `keep` (the tensors the words point at) stays referenced until the
        next store; `owner` may later rewrite just the sizes (store_sizes)."""
        self.wait_until_read()
        self._pack(self.host_words, 0, *words)
        self.host_words[_DONE] = 0
        self.inputs, self.owner = keep, owner
        if self.device is not self.host:
            self.device.copy_(self.host)

    def store_sizes(self, num_tokens: int, batch: int) -> None:
        """Rewrite only the sizes of the words the last store put in place (its owner's call)."""
        self.wait_until_read()
        words = self.host_words
        words[_N], words[_B], words[_DONE] = num_tokens, batch, 0
        if self.device is not self.host:
            self.device.copy_(self.host)

    def clear(self) -> None:
        """0 tokens, 0 requests, no output: the kernels read and store nothing (capture)."""
        self.device.zero_()
        self.owner = None


_INT_FIELDS = ("target_token_ids", "target_positions", "next_token_ids", "query_start_loc", "seq_lens",
               "token_indices_to_sample", "num_rejected_tokens", "slot_mappings", "slot_mappings")


def _converting(converted: list | None, field: str) -> list:
    """Where a converted copy of `field` goes; None: no copy allowed (InvalidInput)."""
    if converted is None:
        raise InvalidInput(field, "a bound buffer is read in place: it must be contiguous (2-D: rows), "
                                  "int32 / int64, or for the hidden states bfloat16 / float16 / float32")
    return converted


# What the kernels cannot index as they are is converted (rare: validate() admits int32 / int64
# and float16 / bfloat16 / float32 of any layout); the copies stay referenced until the next call.
def _readable_ints(t: torch.Tensor, converted: list) -> tuple[torch.Tensor, int]:  # t: [n]
    """A 1-D int tensor the kernels index as ptr + i, and 1 if it is int64."""
    t = (t if t.dtype in _WIDE else t.long()).contiguous()
    converted.append(t)
    return t, _WIDE[t.dtype]


def _readable_hidden(hidden: torch.Tensor,  # [num_tokens, width] float
                     converted: list) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """The hidden states with contiguous rows in a dtype the loader reads."""
    hidden = hidden.float().contiguous()
    converted.append(hidden)
    return hidden, HIDDEN_KINDS[torch.float32], hidden.stride()


def _readable_table(table: torch.Tensor,  # [batch, width] int
                    converted: list) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """The block table with contiguous rows, and 1 if it is int64."""
    table = (table if table.dtype in _WIDE else table.long()).contiguous()
    converted.append(table)
    return table, _WIDE[table.dtype], table.stride()
