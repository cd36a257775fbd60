"""The load test's outputs: a JSON report and a PNG (latency over time + its distribution).

report.json
  tool, version, command          how it was produced
  started_at, finished_at         ISO 8601 UTC
  host                            where the load generator ran (hostname, platform, CPUs, GPUs)
  server                          what the drafter said (Info) + how it was started when spawned
  config                          transport, endpoint, schedule, workload, bounds, seed
  layout                          what each session attached with, and what it got
  end_s                           end of the measured window (seconds from the start)
  load_generator                  this process's CPU time during the run (is the generator the limit?)
  summary                         stats.summarize(): percentiles, throughput, errors by code, bytes
  percentiles                     {"method": "linear", "values": [50, 90, 99, 99.9]}
  samples                         every call, column-wise (stats.Samples.COLUMNS); the summary is
                                  computed from exactly these values (recompute_summary does it again)

    python -m coordinator.loadtest.report REPORT.json [PNG]   # (re)draw the PNG from a report
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from coordinator.loadtest.stats import OK, PERCENTILE_METHOD, PERCENTILES, Samples, summarize

SCHEMA = "drafter-loadtest/1"


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")


def gpus() -> list[str]:
    """GPU names from nvidia-smi, without initialising CUDA in this process."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def host_info() -> dict:
    import numpy
    import torch

    return {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "numpy": numpy.__version__, "gpus": gpus()}


def build_report(result, *, config: dict, server: dict, command: list[str]) -> dict:
    import msgspec

    from importlib.metadata import version

    summary = summarize(result.samples, warmup_s=config["warmup_s"], end_s=result.end_s)
    return {
        "schema": SCHEMA,
        "tool": "drafter loadtest",
        "version": version("specdec-drafter"),
        "command": command,
        "started_at": iso(result.started_at),
        "finished_at": iso(result.started_at + result.wall_s),
        "host": host_info(),
        "server": {**server, "info": msgspec.to_builtins(result.info)},
        "config": config,
        "layout": {"dp": config["dp"], "tp": config["tp"],
                   "tp_note": "TP rank 0 sends for its group: TP does not multiply drafter traffic",
                   "attach_request": msgspec.to_builtins(result.layout),
                   "sessions": [{"session_id": a.session_id, "capture_sizes": list(a.capture_sizes),
                                 "limits": msgspec.to_builtins(a.limits)} for a in result.attach],
                   "shape": vars(result.shape)},
        "end_s": result.end_s,
        "notes": result.notes,
        # A saturated load generator shows as CPU near (cores it can use) and a growing send lag:
        # then the numbers describe the generator, not the drafter.
        "load_generator": {"cpu_s": round(result.generator_cpu_s, 3),
                           "cpu_per_call_us": round(result.generator_cpu_s / max(len(result.samples), 1) * 1e6, 1),
                           "threads": "one sender per connection + a dispatcher (open loop)"},
        "summary": summary,
        "percentiles": {"method": PERCENTILE_METHOD, "values": list(PERCENTILES)},
        "samples": result.samples.to_columns(),
    }


def recompute_summary(report: dict) -> dict:
    """The summary again, from the report's own samples (what a reader or a test can check)."""
    return summarize(Samples.from_columns(report["samples"]), warmup_s=report["config"]["warmup_s"],
                     end_s=report["end_s"])


def write_json(report: dict, path: Path) -> None:
    """Indented, except that each sample column is one line (tens of thousands of values)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in report.items() if k != "samples"}
    # allow_nan=False: NaN is no JSON; to_columns already turned "never sent" into null
    text = json.dumps(head, indent=1, allow_nan=False)
    cols = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'), allow_nan=False)}"
                       for k, v in report["samples"].items())
    path.write_text(text[:-2] + ',\n "samples": {\n' + cols + "\n }\n}\n")


def plot(report: dict, path: Path) -> None:
    """Latency over time (each call a dot, failures in red, warm-up shaded) and its distribution."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    import numpy as np

    s = report["samples"]
    t = np.asarray(s["scheduled_s"], dtype=float)
    lat = np.asarray(s["latency_us"], dtype=float) / 1e3  # ms
    ok = np.asarray(s["code"], dtype=object) == OK
    warm = report["config"]["warmup_s"]
    summ = report["summary"]
    cfg = report["config"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    ax1.axvspan(0, warm, color="0.9", label="warm-up (excluded)")
    ax1.scatter(t[ok], lat[ok], s=3, alpha=0.5, lw=0, label="ok")
    if (~ok).any():
        ax1.scatter(t[~ok], lat[~ok], s=8, color="tab:red", marker="x", lw=0.8, label="error")
    ax1.set_yscale("log")
    ax1.set_xlabel("scheduled send time (s)")
    ax1.set_ylabel("latency (ms, from scheduled send)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.grid(True, which="both", alpha=0.3)
    measured = lat[ok & (t >= warm)]
    if measured.size:
        lo, hi = max(measured.min(), 1e-3), measured.max()
        bins = np.logspace(np.log10(lo), np.log10(hi * 1.0001), 60) if hi > lo else 10
        ax2.hist(measured, bins=bins, color="tab:blue", alpha=0.6)
        ax2.set_xscale("log")
        ax3 = ax2.twinx()
        xs = np.sort(measured)
        ax3.plot(xs, np.arange(1, xs.size + 1) / xs.size, color="k", lw=1)
        ax3.set_ylim(0, 1.01)
        ax3.set_ylabel("CDF")
        for key, color in (("p50", "tab:green"), ("p99", "tab:orange"), ("p99_9", "tab:red")):
            v = summ["latency_us"].get(key)
            if v is not None:
                ax2.axvline(v / 1e3, color=color, ls="--", lw=1, label=f"{key.replace('_', '.')} {v / 1e3:.3g} ms")
        ax2.legend(loc="upper left", fontsize=8)
    ax2.set_xlabel("latency (ms)")
    ax2.set_ylabel("calls")
    sched = cfg["schedule"]
    mode = (f"open loop {sched['rate']:g}/s {sched['arrival']}" if sched["mode"] == "open"
            else f"closed loop x{sched['concurrency']}/session")
    server = report.get("server", {})
    title = (f"{cfg['transport']} | {mode} | dp={cfg['dp']} | {server.get('info', {}).get('method', '?')} "
             f"on {server.get('device') or '?'} | {summ['throughput']['calls_per_s']:.0f} calls/s, "
             f"{summ['errors']} errors | {report['started_at']}")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m coordinator.loadtest.report REPORT.json [OUT.png]", file=sys.stderr)
        return 2
    src = Path(argv[0])
    dst = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    plot(json.loads(src.read_text()), dst)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
