"""The example commands of README.md and docs/*.md, found and run as written (bounded, loopback only).

What is checked: every fenced block labelled bash, sh, shell or console (unlabelled blocks hold
file maps and sample output and are never run).  A block is split into commands (backslash
continuations joined, `#` comments dropped); `a && b` runs as written after any `pip install ...`
step is dropped (installing is CI's setup, not the example).  Each command either runs or is
skipped for a reason from SKIPS, the one list of what this machine cannot do:

    pip install                     installs packages: CI's set-up does that before the tests
    bash scripts/test.sh            the whole test suite, which includes this check
    vllm ... / VLLM_*               vLLM serving a real model
    kubectl / kustomize / docker    a cluster, an image registry
    --device cuda, cuda:N, --shape  a GPU (or a multi-GB random checkpoint)
    drafter bench (no --replot)     a GPU benchmark
    /models/...                     checkpoints that are not part of the repository
    a host that is not loopback     this check talks only to 127.0.0.0/8
    ... or an ALL-CAPS placeholder  not a command (RUN.json, DIR, HOST:PORT)

A block can also opt out explicitly: a line `<!-- docs-check: skip REASON -->` right before its
fence (for what SKIPS cannot tell, e.g. a slow benchmark).

How a command runs: `bash -c` in a temporary directory, one per document, in document order (its
outputs land there and a later example may use them; absolute paths such as /tmp/tiny stay as
written), with `drafter` and `drafter-loadtest` on PATH as this
checkout's code, at most TIMEOUT_S.  `drafter serve` runs until its JSON "ready" line, then gets
SIGTERM and must drain and exit 0 (it serves forever otherwise).  Its listening ports are the one
thing not run as written: each `--*-port N` becomes `--*-port 0` (the server binds a free port and
its ready line names it, which the check requires for every port flag written).  A fixed port is
not this machine's to take: 50051 and 50052 lie in Linux's ephemeral range (32768-60999), where
any test's client socket may hold them as its source port, and a second run of this check (or a
real drafter) may hold any of them.  Every command must exit 0, and some must also print what the
text promises (EXPECT) and not what it must not (REJECT).

    python3 -m tests.e2e.docs_commands            # list every command and what happens to it
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/*.md")
SHELLS = {"bash", "sh", "shell", "console"}
TIMEOUT_S = 300

SKIPS: list[tuple[str, str]] = [
    (r"^bash scripts/test\.sh\b", "the whole test suite, which includes this check"),
    (r"(^|\s)(vllm\s|VLLM_)|DRAFTER_ENDPOINTS=", "needs vLLM serving a real model"),
    (r"^(kubectl|kustomize|docker)\b", "needs a Kubernetes cluster / an image registry"),
    (r"--device[ =]cuda|\bcuda:\d|--shape\s", "needs a GPU"),
    (r"^drafter bench(?!.*--replot)", "a GPU benchmark"),
    (r"(^|\s)/models/", "names checkpoints that are not part of the repository"),
    (r"(?<![\w.])(?!127\.)\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}(:\d+)?\b|\b[a-z][\w-]*-host:\d+",
     "names a remote host (this check talks only to loopback)"),
    (r"(^|\s)\.\.\.(\s|$)|\b[A-Z][A-Z_]{2,}(\.json|:[A-Z]+)?\b(?!=)", "a placeholder, not a command"),
]
INSTALL = re.compile(r"^\s*pip3?\s+install\b|^\s*python3?\s+-m\s+pip\s+install\b")
OPT_OUT = re.compile(r"<!--\s*docs-check:\s*skip\s*(.*?)\s*-->")

# what a command must also print (stdout + stderr), beyond exit status 0
EXPECT: list[tuple[str, str]] = [
    (r"^drafter demo\b", "OK in"),
    (r"^drafter loadtest\b", "knee: "),
    (r"^drafter make-tiny\b", "wrote "),
]
# what it must not print: a table cut to 80 columns (its output is a pipe here, as in CI logs)
REJECT: list[tuple[str, str]] = [(r"^drafter demo\b", "\u2026")]


@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command in the document
    text: str  # as written (continuations joined, comments dropped)
    run: str  # what runs: text without its pip install steps ("" when nothing is left)
    skip: str | None  # why it does not run here

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def documents() -> list[Path]:
    found = []
    for pattern in DOCS:
        found += sorted(REPO.glob(pattern))
    return found


def blocks(text: str):
    """(first line number, language, body, opt-out reason or None) of each fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        lang = m.group(2).lower()
        prev = lines[i - 1] if i else ""
        opt = OPT_OUT.search(prev)
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        yield i + 2, lang, lines[i + 1:j], (opt.group(1) or "opted out") if opt else None
        i = j + 1


def commands_of(body: list[str], first_line: int):
    """(line, command) with continuations joined and comments dropped."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(body, first_line):
        line = raw.rstrip()
        if not buf:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = n
        buf += line[:-1] + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            out.append((start, _strip_comment(buf).strip()))
            buf = ""
    if buf:
        out.append((start, _strip_comment(buf).strip()))
    return out


def _strip_comment(cmd: str) -> str:
    """Drop a trailing `  # ...` outside quotes."""
    quote = None
    for k, ch in enumerate(cmd):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or cmd[k - 1].isspace()):
            return cmd[:k]
    return cmd


def _skip_reason(cmd: str) -> str | None:
    for pattern, reason in SKIPS:
        if re.search(pattern, cmd):
            return reason
    return None


def classify(doc: str, line: int, text: str, opted_out: str | None) -> Command:
    steps = [s.strip() for s in text.split("&&")]
    kept = [s for s in steps if not INSTALL.search(s)]
    run = " && ".join(kept)
    skip = opted_out or (None if kept else "installs packages: CI's set-up does that before the tests")
    if skip is None:
        skip = next((r for r in map(_skip_reason, kept) if r), None)
    return Command(doc, line, text, run, skip)


def all_commands() -> list[Command]:
    out = []
    for path in documents():
        doc = str(path.relative_to(REPO))
        for first, lang, body, opted_out in blocks(path.read_text()):
            if lang not in SHELLS:
                continue
            if lang == "console":  # a transcript: only `$ ` lines are commands, the rest is output
                body = [ln.split("$ ", 1)[1] if ln.lstrip().startswith("$ ") else "" for ln in body]
            for line, text in commands_of(body, first):
                out.append(classify(doc, line, text, opted_out))
    return out


# ------------------------------------------------------------------ running
def _environment(shims: Path) -> dict:
    """This checkout's `drafter` first on PATH, whatever is installed; no DRAFTER_* from outside."""
    shims.mkdir(parents=True, exist_ok=True)
    for name, command in (("drafter", "drafter"), ("drafter-loadtest", "drafter loadtest")):
        script = shims / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {command} "$@"\n')
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTER_")}
    env["PATH"] = f"{shims}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(cmd: Command, workdir: Path, timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """(passed, what happened) for one runnable command."""
    env = _environment(workdir / ".shims")
    if re.match(r"^drafter serve\b", cmd.run):
        return _run_server(cmd, workdir, env, timeout_s)
    try:
        done = subprocess.run(["bash", "-c", cmd.run], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"still running after {timeout_s} s"
    output = done.stdout + done.stderr
    if done.returncode != 0:
        return False, f"exit {done.returncode}: {output[-3000:]}"
    for pattern, want in EXPECT:
        if re.search(pattern, cmd.run) and want not in output:
            return False, f"exit 0 but no {want!r} in its output: {output[-3000:]}"
    for pattern, bad in REJECT:
        if re.search(pattern, cmd.run) and bad in output:
            return False, f"its output has {bad!r}: {output[-3000:]}"
    return True, output[-500:]


PORT_FLAG = re.compile(r"(--(grpc|zmq|health|metrics)-port)(=|\s+)(\d+)\b")


def free_ports(command: str) -> tuple[str, tuple[str, ...]]:
    """(command with every listening port written as 0, the ready-line keys those flags fill):
    `--grpc-port 50051` -> `--grpc-port 0`, key "grpc_port"."""
    keys = tuple(f"{m.group(2)}_port" for m in PORT_FLAG.finditer(command))
    return PORT_FLAG.sub(lambda m: f"{m.group(1)}{m.group(3)}0", command), keys


def _run_server(cmd: Command, workdir: Path, env: dict, timeout_s: float) -> tuple[bool, str]:
    """Until its "ready" line, then SIGTERM: it must drain and exit 0.  Ports written in the
    command are bound as 0 (free ones), and the ready line must name a real port for each."""
    log = workdir / "serve.log"
    command, port_keys = free_ports(cmd.run)
    with open(log, "wb") as err:
        proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=workdir, env=env, stdout=subprocess.PIPE,
                                stderr=err)
    try:
        ready = None
        for line in proc.stdout:  # JSON event lines; EOF when it exits
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") in ("ready", "failed"):
                ready = ev
                break
        if not ready or ready["event"] != "ready":
            return False, f"no ready line ({ready}); log: {log.read_text()[-3000:]}"
        unbound = [k for k in port_keys if not isinstance(ready.get(k), int) or ready[k] <= 0]
        if unbound:
            proc.send_signal(signal.SIGTERM)
            return False, f"ready line names no port for {unbound}: {ready}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout_s)
        return code == 0, f"ready on ports {ready.get('grpc_port')}/{ready.get('zmq_port')}, exit {code} after SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> int:
    for cmd in all_commands():
        what = f"skip: {cmd.skip}" if cmd.skip else f"run: {cmd.run}"
        print(f"{cmd.id:<28} {what}")
    return 0


def fresh_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="docs-check-"))


if __name__ == "__main__":
    sys.exit(main())
