"""The host ring's pieces on this host, and the bound they set: where a host_ring step's bytes go.

    python bench/probe_host_ring.py [--batches 1,16,64 --k 3 --width 12288 --steps 30 --out DIR
        --inprocess-us 730,850,1090]

The bytes of one bound EAGLE-3 step at Llama-3.1-8B shapes (the slab's prefix: --width bf16
columns of hidden states, 24 KB, per token, batch * (k + 1) tokens, plus SMALL bytes of ids and
tables), timed piece by piece, p50 / p99 us of --steps each:

  * d2h: a GPU buffer to a pinned host buffer, one copy and a stream sync (no GPU: a host memcpy);
  * h2d: a pinned host buffer to the GPU, one copy and a sync (no GPU: a host memcpy);
  * zmq_tcp, zmq_ipc: the ZMQ host ring as the data socket carries it: [header, prefix] from a
    DEALER (zero-copy frame), received by a child process's ROUTER with recv_into a pinned ring,
    a small reply back (the round trip);
  * stream_tcp, stream_unix: the ring stream (drafter.wire.ring_stream): the prefix on one plain
    connection, received by the child in RECV_BYTES pieces straight into its pinned ring, a small
    reply; stream_tcp_2, stream_tcp_4, stream_tcp_8, stream_unix_4: the same striped over 2, 4, 8
    lanes (connections; every lane that gets at least CHUNK), each lane sent by a thread of its own
    and received by the child's ring_stream.Lanes (a thread per lane past the first, blocked on its
    connection), as the drafter receives; stream_tcp_timeout_mode: one lane with the child's socket
    in Python's timeout mode (a recv call per piece the kernel has, where the drafter's blocking
    socket takes a chunk per call);
  * pipelined_tcp, pipelined_tcp_4 (GPU, with --child-device): the whole host_ring data path
    without an engine: the prefix's D2H copies in pieces, each span sent as its piece lands
    (bound_client.device_parts, as BoundLink sends a GPU source), the child's H2D copy of each
    span queued as it lands on its GPU, its sync, the reply; pipelined_tcp_auto: four lanes as the
    client stripes by default (ring_stream.plan with LANE_BYTES: as many lanes as get a MiB each);
    d2h_only_tcp_4 and h2d_only_tcp_4: the four-lane path with one end's copies alone (which end
    costs what).

The bandwidth table: bytes / p50 of the bare stream over tcp on 1, 2, 4, 8 lanes at each size.

The bound: the loopback bandwidth of the fastest transfer at the largest size gives the time the
prefix alone needs at each batch; with the pieces overlapped perfectly a step cannot take less
than the in-process call plus that (--inprocess-us: the trusted in-process p50 at each batch, r0's
on two H200s by default), so (in-process + transfer) / in-process is the best ratio the host ring
can reach over this link (--inprocess-json: read them from a bound bench's bound.json).
host_ring_probe.md / host_ring_probe.json in --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the checkout's packages
from coordinator.transport.bound_client import D2H_PIECES, device_parts  # noqa: E402
from drafter.wire import ring_stream as rs  # noqa: E402

SMALL = 16 << 10  # bytes of the small buffers ahead of the hidden states (ids, positions, tables)
TOKEN = "probe-ring-binding"
STREAMS = {  # name: (transport, lanes, held: the receiver's sockets as the drafter holds them)
    "stream_tcp": ("tcp", 1, True), "stream_tcp_2": ("tcp", 2, True), "stream_tcp_4": ("tcp", 4, True),
    "stream_tcp_8": ("tcp", 8, True), "stream_unix": ("ipc", 1, True),
    "stream_unix_4": ("ipc", 4, True), "stream_tcp_timeout_mode": ("tcp", 1, False)}
REPLY = b"\x00" * 64
TCP_LANES = {1: "stream_tcp", 2: "stream_tcp_2", 4: "stream_tcp_4", 8: "stream_tcp_8"}  # the bandwidth table's rows


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": xs[len(xs) // 2], "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))], "n": len(xs)}


# ---------------------------------------------------------------------- the receiving side (child)
def child(max_bytes: int, device: str) -> None:
    """Serve the ZMQ ROUTERs and the streams until stdin closes; print the endpoints first."""
    pinned = torch.cuda.is_available()
    ring = torch.zeros(max_bytes, dtype=torch.uint8, pin_memory=pinned)
    view = memoryview(ring.numpy())
    slab = torch.zeros(max_bytes, dtype=torch.uint8, device=device) if device else None
    ctx = zmq.Context()
    routers, ends = [], {}
    for name, where in (("zmq_tcp", "tcp://127.0.0.1:*"), ("zmq_ipc", f"ipc:///tmp/probe-ring-{id(ring)}")):
        r = ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.bind(where)
        routers.append(r)
        ends[name] = r.getsockopt_string(zmq.LAST_ENDPOINT)
    listeners = {name: rs.listen(transport, "127.0.0.1") for name, (transport, _, _) in STREAMS.items()}
    ends.update({name: address for name, (_, address) in listeners.items()})
    stop = threading.Event()
    threads = [threading.Thread(target=_serve_zmq, args=(routers, view, stop), daemon=True)]
    threads += [threading.Thread(target=_serve_stream, args=(listeners[name][0], view, ring, slab, stop, lanes, held),
                                 daemon=True) for name, (_, lanes, held) in STREAMS.items()]
    for t in threads:
        t.start()
    print(json.dumps(ends), flush=True)
    sys.stdin.read()
    stop.set()


def _serve_zmq(routers, view: memoryview, stop: threading.Event) -> None:
    poller = zmq.Poller()
    for r in routers:
        poller.register(r, zmq.POLLIN)
    while not stop.is_set():
        for r, _ in poller.poll(100):
            identity = r.recv()
            r.recv()  # the header
            r.recv_into(view)
            r.send_multipart([identity, REPLY])


def _serve_stream(listener, view: memoryview, ring: torch.Tensor, slab, stop: threading.Event, lanes: int,
                  held: bool) -> None:
    """As the drafter's stream thread serves a binding: lanes connections, a thread per lane past
    the first (ring_stream.Lanes).  held: the sockets as the drafter holds them (blocking,
    MSG_WAITALL: one recv per piece); else Python's timeout mode (a recv per piece the kernel has).
    A head of b"h2d" has each piece's copy to the child's GPU queued as it lands (from that message
    on: the lanes may land before the head is read, so the first message after a switch may differ)
    and synchronized before the reply."""
    conns = rs.accept(listener, TOKEN, lambda: not stop.is_set(), 0.1, 5.0, lanes)
    if conns is None:
        return
    device = slab.device if slab is not None else None
    if device is not None:
        torch.cuda.set_device(device)
    for conn in conns:
        rs.hold_timeout(conn, 30.0) if held else conn.settimeout(30.0)
    lock, h2d = threading.Lock(), [False]

    def landed(a: int, z: int) -> None:
        if h2d[0]:
            with lock:
                slab[a:z].copy_(ring[a:z], non_blocking=True)

    alive = lambda: not stop.is_set()  # noqa: E731
    group = rs.Lanes(conns, view, landed, alive, 0.1, lambda: device and torch.cuda.set_device(device)).start() \
        if lanes > 1 else None
    try:
        while not stop.is_set():
            if not rs.wait_readable(conns[0], 0.1):
                continue
            head_len, body_len, used = rs.read_prefix(conns[0], rs.MAX_HEAD, len(view), lanes)
            h2d[0] = rs.read_exact(conns[0], head_len) == b"h2d" and slab is not None
            rs.receive_body(conns[0], view, body_len, used, group, landed, 30.0, alive)
            if h2d[0]:
                torch.cuda.current_stream(device).synchronize()
            rs.send_message(conns[0], REPLY, [])
    except (OSError, rs.Closed):
        pass


# ---------------------------------------------------------------------- the sending side
def _time(fn, steps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return _stats(times)


def _copies(nbytes: int, steps: int) -> dict:
    """d2h and h2d of nbytes (a host memcpy where there is no GPU)."""
    cuda = torch.cuda.is_available()
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
    other = torch.zeros(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return {"d2h": _time(lambda: (host.copy_(other, non_blocking=cuda), sync()), steps),
            "h2d": _time(lambda: (other.copy_(host, non_blocking=cuda), sync()), steps)}


def _zmq_path(ctx, endpoint: str, payload: memoryview, steps: int) -> dict:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        def one():
            sock.send_multipart([b"h", payload], copy=False)
            sock.recv()
        return _time(one, steps)
    finally:
        sock.close(linger=0)


def _stream_path(conns: list, head: bytes, nbytes: int, parts, pool, steps: int, lane_bytes: int = 0) -> dict:
    """As BoundLink sends a step: the head first, then parts() -> part(start, end) (the D2H pieces
    queued), the stripes (every lane that gets CHUNK, or as lane_bytes says), the reply."""
    seq = iter(range(1, 1 << 62))

    def one():
        spans = rs.plan(nbytes, len(conns), lane_bytes)
        n = next(seq)
        rs.send_head(conns[0], head, nbytes, spans, n)
        rs.send_stripes(conns, spans, n, parts(), pool)
        rs.read_message(conns[0], 1 << 10)
    return _time(one, steps)


def measure(args) -> dict:
    sizes = {b: SMALL + b * (args.k + 1) * args.width * 2 for b in args.batches}
    top = max(sizes.values())
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(top), args.child_device],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ends = json.loads(proc.stdout.readline())
        ctx = zmq.Context()
        conns = {name: [rs.connect(ends[name], TOKEN, 10.0, lane) for lane in range(lanes)]
                 for name, (_, lanes, _) in STREAMS.items()}
        pool = ThreadPoolExecutor(max(lanes for _, lanes, _ in STREAMS.values()))
        cuda = torch.cuda.is_available()
        host = torch.zeros(top, dtype=torch.uint8, pin_memory=cuda)
        view = memoryview(host.numpy())
        gpu = torch.zeros(top, dtype=torch.uint8, device="cuda") if cuda else None
        events = [torch.cuda.Event() for _ in range(D2H_PIECES)] if cuda else []
        out = {}
        for b, nbytes in sizes.items():
            row = {"bytes": nbytes, **_copies(nbytes, args.steps)}
            for name in ("zmq_tcp", "zmq_ipc"):
                row[name] = _zmq_path(ctx, ends[name], view[:nbytes], args.steps)
            for name, c in conns.items():
                row[name] = _stream_path(c, b"h", nbytes, lambda: (lambda a, z: view[a:z]), pool, args.steps)
            if gpu is not None and args.child_device:
                def d2h():
                    return device_parts(gpu, host, view, nbytes, events)
                for name in ("stream_tcp", "stream_tcp_4"):
                    row["pipelined_" + name[len("stream_"):]] = _stream_path(conns[name], b"h2d", nbytes, d2h, pool,
                                                                             args.steps)
                row["pipelined_tcp_auto"] = _stream_path(conns["stream_tcp_4"], b"h2d", nbytes, d2h, pool, args.steps,
                                                         rs.LANE_BYTES)
                # each end's copies alone over four lanes: the sender's D2H pieces, the receiver's H2D
                row["d2h_only_tcp_4"] = _stream_path(conns["stream_tcp_4"], b"h", nbytes, d2h, pool, args.steps)
                row["h2d_only_tcp_4"] = _stream_path(conns["stream_tcp_4"], b"h2d", nbytes,
                                                     lambda: (lambda a, z: view[a:z]), pool, args.steps)
            out[b] = row
            print(f"batch {b}: {nbytes / 1e6:.2f} MB " + ", ".join(
                f"{k} {v['p50_us']:.0f}" for k, v in row.items() if isinstance(v, dict)) + " us p50", flush=True)
        pool.shutdown()
        for c in conns.values():
            for conn in c:
                conn.close()
        ctx.term()
        return {"sizes": sizes, "rows": out}
    finally:
        proc.stdin.close()
        proc.wait(30)


def bound(result: dict, inprocess: list[float]) -> dict:
    """Loopback bandwidth (the fastest transport at the largest size) and the best ratio per batch."""
    rows = result["rows"]
    top = max(rows, key=lambda b: rows[b]["bytes"])
    paths = ("zmq_tcp", "stream_tcp", "stream_tcp_2", "stream_tcp_4", "stream_tcp_8")
    best = min(paths, key=lambda p: rows[top][p]["p50_us"])
    gbps = rows[top]["bytes"] / rows[top][best]["p50_us"] / 1e3  # GB/s (round trip, tiny reply)
    out = {"path": best, "gb_per_s": gbps,
           "lanes_gb_per_s": {str(n): {str(b): rows[b]["bytes"] / rows[b][p]["p50_us"] / 1e3 for b in rows}
                              for n, p in TCP_LANES.items()}}
    for b, local in zip(rows, inprocess):
        transfer = rows[b]["bytes"] / gbps / 1e3
        out[b] = {"transfer_us": transfer, "inprocess_us": local, "best_ratio": (local + transfer) / local}
    return out


def table(result: dict, limit: dict) -> str:
    names = [k for k in next(iter(result["rows"].values())) if k != "bytes"]
    lines = ["| batch | MB | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for b, row in result["rows"].items():
        lines.append(f"| {b} | {row['bytes'] / 1e6:.2f} | " + " | ".join(
            f"{row[n]['p50_us']:.0f} / {row[n]['p99_us']:.0f}" for n in names) + " |")
    lines += ["", f"Loopback bandwidth ({limit['path']}, the largest prefix): {limit['gb_per_s']:.2f} GB/s", "",
              "| batch | transfer us | in-process us | best ratio over tcp |", "|---|---|---|---|"]
    for b in result["rows"]:
        r = limit[b]
        lines.append(f"| {b} | {r['transfer_us']:.0f} | {r['inprocess_us']:.0f} | {r['best_ratio']:.2f} |")
    batches = list(result["rows"])
    lines += ["", "Bare stream over tcp, GB/s (bytes / round-trip p50) by lanes:", "",
              "| lanes | " + " | ".join(f"batch {b} ({result['rows'][b]['bytes'] / 1e6:.2f} MB)"
                                        for b in batches) + " |",
              "|---|" + "---|" * len(batches)]
    for n, by in limit["lanes_gb_per_s"].items():
        lines.append(f"| {n} | " + " | ".join(f"{by[str(b)]:.2f}" for b in batches) + " |")
    return "p50 / p99 us per piece (round trips carry a 64-byte reply)\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(int(argv[1]), argv[2] if len(argv) > 2 else "")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--width", type=int, default=3 * 4096, help="hidden columns (bf16) per token")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--inprocess-us", default="730,850,1090", help="in-process p50 per batch, for the ratio bound")
    p.add_argument("--inprocess-json", default="", help="a coordinator.bench.bound bound.json: its trusted in-process "
                                                       "p50 per batch instead of --inprocess-us")
    p.add_argument("--child-device", default="", help="the receiving child's GPU for the pipelined path (cuda:1)")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    inprocess = [float(x) for x in args.inprocess_us.split(",")]
    if args.inprocess_json and Path(args.inprocess_json).exists():
        rows = json.loads(Path(args.inprocess_json).read_text())["batches"]
        inprocess = [rows[str(b)]["in_process"]["trusted_propose"]["p50_us"] for b in args.batches]
    if len(inprocess) != len(args.batches):
        raise SystemExit("--inprocess-us: one figure per batch")
    result = measure(args)
    result["bound"] = bound(result, inprocess)
    text = table(result, result["bound"])
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_ring_probe.json").write_text(json.dumps(result, indent=1))
        (out / "host_ring_probe.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
