"""Run a function on N gloo ranks in fresh processes (gloo on the loopback interface, the rendezvous through a file) and collect what each returns."""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback
from pathlib import Path

import torch

from coordinator.demo.fleet import _context


def _entry(rank: int, world: int, init: str, out: str, fn, args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if os.environ.get("TRITON_INTERPRET") == "1":  # a fresh process: tests/conftest.py's shortcut is not in it
        from tests.support.triton_interp import install

        install()
    try:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                             timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
        torch.distributed.destroy_process_group()
    except BaseException:
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    ctx = _context()
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{out}/store"  # a FileStore: no listening socket at all (a TCPStore binds every interface)
        procs = [ctx.Process(target=_entry, args=(r, world, init, out, fn, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = [e.read_text() for e in sorted(Path(out).glob("*.err"))]
        if errors or any(p.exitcode for p in procs):
            raise RuntimeError(f"ranks failed: {[p.exitcode for p in procs]}\n" + "\n".join(errors))
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world)]
