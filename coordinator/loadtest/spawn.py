"""--spawn-server: a local `drafter serve` subprocess on loopback, its ports read from its ready line.

Ports are 0 (the server picks free ones) and come back in its JSON "ready" event on stdout, so
nothing races for a port and nothing sleeps: we wait for the line.  Its stderr (the structured
log) goes to a file kept beside the report.  The child is stopped on every way out: a failed
start stops it before raising, the caller holds the handle before start() and stops it in a
finally, and on Linux it gets SIGTERM should this process die without running either.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from coordinator.child_process import die_with_parent, stop_child


class SpawnedServer:
    def __init__(self, *, method: str, model: str, target_model: str | None, device: str, settings: dict,
                 log_path: Path, extra_args: list[str] = ()):
        self.args = [sys.executable, "-m", "drafter", "serve", "--method", method, "--model", str(model),
                     "--device", device, "--host", "127.0.0.1", "--grpc-port", "0", "--zmq-port", "0",
                     "--health-port", "0", "--metrics-port", "0", "--log-format", "json"]
        if target_model:
            self.args += ["--target-model", str(target_model)]
        for key, value in settings.items():
            self.args += ["--" + key.replace("_", "-"), str(value)]
        self.args += list(extra_args)
        # the server's settings are these flags: DRAFTER_* variables of this shell must not leak in
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
        self.env["PYTHONUNBUFFERED"] = "1"
        repo = str(Path(__file__).resolve().parents[2])  # a source checkout runs without being installed
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, self.env.get("PYTHONPATH", "")) if p)
        self.log_path = log_path
        self.events: queue.Queue = queue.Queue()
        self.proc: subprocess.Popen | None = None
        self.ready: dict = {}

    def start(self, timeout_s: float) -> "SpawnedServer":
        """Start it and wait for its ready line; on any failure (Ctrl-C included) it is stopped again."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(die_with_parent(self.args), stdout=subprocess.PIPE, stderr=log, env=self.env)
        threading.Thread(target=self._read, daemon=True, name="server-stdout").start()
        try:
            self.ready = self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> dict:
        while True:
            try:
                ev = self.events.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"the spawned drafter was not ready within {timeout_s} s (--ready-timeout); "
                                   f"its log: {self.log_path}: {self.last_log_line()}") from None
            if ev.get("event") == "ready":
                return ev
            if ev.get("event") in ("failed", "eof"):
                reason = ev.get("reason") or self.last_log_line() or "it exited"
                raise RuntimeError(f"the spawned drafter did not start: {reason} (its log: {self.log_path})")

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                pass  # only the JSON event lines matter
        self.events.put({"event": "eof"})

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def last_log_line(self) -> str:
        lines = [ln for ln in self.log_tail().splitlines() if ln.strip()]
        return lines[-1].strip()[:500] if lines else ""

    def endpoint(self, transport: str) -> str:
        port = self.ready["zmq_port"] if transport == "zmq" else self.ready["grpc_port"]
        return f"127.0.0.1:{port}"

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        return stop_child(self.proc, timeout_s)
