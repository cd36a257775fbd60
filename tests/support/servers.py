"""Real `drafter serve` processes on loopback for integration tests.

Ports are 0 (the server picks free ones) and read back from its JSON event lines on stdout,
so tests never race for ports and never sleep: they wait for the event they need.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from coordinator.child_process import die_with_parent

REPO = Path(__file__).resolve().parents[2]


class DrafterServer:
    """`python -m drafter serve` with flags for the settings; env_only: no arguments, DRAFTER_* only."""

    def __init__(self, model_dir: Path | None, method: str, *, env: dict | None = None, env_only: bool = False,
                 log_path: Path | None = None, cwd: Path = REPO, **settings):
        self.args = [sys.executable, "-m", "drafter", "serve"]
        if not env_only:
            self.args += ["--method", method, "--model", str(model_dir / "head"),
                          "--target-model", str(model_dir / "target"), "--host", "127.0.0.1", "--grpc-port", "0",
                          "--zmq-port", "0", "--health-port", "0", "--metrics-port", "0", "--log-format", "json"]
            for key, value in settings.items():
                self.args += ["--" + key.replace("_", "-"), str(value)]
        # the caller's DRAFTER_* only: nothing of this shell's environment leaks into the settings
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
        # the repo first, then whatever the caller's PYTHONPATH holds (packages a GPU host carries)
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        self.env.update({"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.cwd = cwd
        self.log_path = log_path
        self.events: queue.Queue = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}

    def start(self, timeout: float = 120.0, until: str = "ready") -> "DrafterServer":
        stderr = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(die_with_parent(self.args), stdout=subprocess.PIPE, stderr=stderr, env=self.env, cwd=self.cwd)
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.wait_for(until, timeout)
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.events.put({"event": "stdout", "line": line.decode(errors="replace")})
        self.events.put({"event": "eof"})

    def wait_for(self, name: str, timeout: float = 60.0) -> dict:
        while True:
            try:
                ev = self.events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no {name!r} event from the server within {timeout} s") from None
            if ev["event"] == name:
                return ev
            if ev["event"] in ("eof", "failed"):
                raise RuntimeError(f"server ended before {name!r}: {ev}; log: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.ready['grpc_port']}"

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.ready['zmq_port']}"

    @property
    def health_target(self) -> str:
        return f"127.0.0.1:{self.ready['health_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ready['metrics_port']}/metrics"

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def layout_for(info, num_blocks, *, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
               hidden_dtype: str = "float32", client_name: str = "test"):
    """An AttachRequest that fits what the server's Info says it serves."""
    from drafter.wire import schema

    groups = info.limits.kv_groups
    blocks = list(num_blocks) if isinstance(num_blocks, (list, tuple)) else [num_blocks] * len(groups)
    return schema.AttachRequest(
        protocol_version=info.protocol_version, method=info.method,
        num_speculative_tokens=info.num_speculative_tokens, speculative_token_tree=info.speculative_token_tree,
        hidden_dtype=hidden_dtype, hidden_size=info.hidden_size, num_aux_layers=info.num_aux_layers,
        max_model_len=info.limits.max_model_len, max_num_seqs=max_num_seqs or info.limits.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or info.limits.max_num_batched_tokens,
        kv_groups=[schema.KVGroup(block_size=g.block_size, num_blocks=n) for g, n in zip(groups, blocks)],
        client_name=client_name)
