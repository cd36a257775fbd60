"""Start, kill and restart real `drafter serve` processes on loopback (demo, tests, load test).

Ports start at 0 (the server picks free ones and reports them in its JSON "ready" line on
stdout); a restart reuses the ports it got, so clients find the new process where the old one
was, with a new epoch.  Nothing here sleeps: callers wait for the server's own events.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from coordinator.child_process import die_with_parent, stop_child
from coordinator.routing import Endpoint

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DrafterSpec:
    head_dir: str
    target_dir: str
    method: str
    num_speculative_tokens: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks: int
    block_size: int
    max_sessions: int = 16
    torch_threads: int = 1  # a small CPU host: one thread per process beats OpenMP spinning
    predraft_outcomes: int = 0  # --predraft-outcomes: pre-drafts pushed to ZMQ calls that ask (0 = off)


class DrafterProcess:
    def __init__(self, spec: DrafterSpec, *, name: str = "drafter", log_path: str | Path | None = None):
        self.spec = spec
        self.name = name
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}
        self.grpc_port = 0
        self.zmq_port = 0
        self.starts = 0
        self._events: queue.Queue = queue.Queue()

    def _args(self) -> list[str]:
        s = self.spec
        return [sys.executable, "-m", "drafter", "serve", "--method", s.method, "--model", s.head_dir,
                "--target-model", s.target_dir, "--device", "cpu", "--host", "127.0.0.1",
                "--grpc-port", str(self.grpc_port), "--zmq-port", str(self.zmq_port), "--health-port", "0",
                "--metrics-port", "0", "--log-format", "json", "--num-speculative-tokens",
                str(s.num_speculative_tokens), "--max-model-len", str(s.max_model_len), "--max-num-seqs",
                str(s.max_num_seqs), "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--kv-blocks",
                str(s.kv_blocks), "--block-sizes", str(s.block_size), "--max-sessions", str(s.max_sessions),
                "--torch-threads", str(s.torch_threads), "--predraft-outcomes", str(s.predraft_outcomes)]

    def launch(self) -> "DrafterProcess":
        """Start the process without waiting for it (wait_ready() does)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        stderr = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self._events = queue.Queue()
        self.proc = subprocess.Popen(die_with_parent(self._args()), stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=REPO)
        if self.log_path:
            stderr.close()
        self.starts += 1
        threading.Thread(target=self._read, args=(self.proc, self._events), daemon=True,
                         name=f"{self.name}-stdout").start()
        return self

    @staticmethod
    def _read(proc: subprocess.Popen, events: queue.Queue) -> None:
        for line in proc.stdout:
            try:
                events.put(json.loads(line))
            except json.JSONDecodeError:
                pass  # only the JSON event lines matter
        events.put({"event": "eof"})

    def wait_ready(self, timeout: float = 120.0) -> "DrafterProcess":
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"{self.name}: not ready within {timeout} s") from None
            if ev.get("event") == "ready":
                self.ready = ev
                self.grpc_port, self.zmq_port = int(ev["grpc_port"]), int(ev["zmq_port"])
                return self
            if ev.get("event") in ("eof", "failed"):
                raise RuntimeError(f"{self.name} ended before it was ready: {ev}; see {self.log_path}")

    def start(self, timeout: float = 120.0) -> "DrafterProcess":
        return self.launch().wait_ready(timeout)

    @property
    def epoch(self):
        return self.ready.get("epoch")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def endpoint(self, scheme: str) -> Endpoint:
        return Endpoint(scheme, "127.0.0.1", self.grpc_port if scheme == "grpc" else self.zmq_port)

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; in-flight calls just lose their peer."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self, timeout: float = 120.0) -> "DrafterProcess":
        """A new process on the same ports (a new epoch): what a supervisor or kubelet does."""
        self.kill()
        return self.start(timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        return None if self.proc is None else stop_child(self.proc, timeout)
