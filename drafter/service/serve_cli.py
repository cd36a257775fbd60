"""The `drafter serve` subcommand: flags (and DRAFTER_* variables) -> ServerConfig -> server.serve."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from drafter.service.config import add_arguments, from_args
from drafter.service.startup import StartupError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run the drafter service (gRPC + ZMQ + health + /metrics)",
        description="Serve a draft head over gRPC and ZMQ. Every flag has a DRAFTER_* environment "
                    "variable (the container passes no arguments); a flag wins over its variable.")
    add_arguments(p)
    p.add_argument("--print-attach-requirements", action="store_true",
                   help="print what a vLLM engine attaching to this drafter must match (from these flags; "
                        "nothing is loaded) and exit")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    try:
        cfg = from_args(ns)
        cfg.check()
    except ValueError as exc:
        print(f"drafter serve: {exc}", file=sys.stderr)
        return 2
    if getattr(ns, "print_attach_requirements", False):
        from drafter.service.sessions import attach_requirements

        print(attach_requirements(cfg))
        return 0
    import logging

    from drafter.service.logs import event, setup_logging
    from drafter.service.server import serve

    setup_logging(cfg.log_format, cfg.log_level)
    try:
        code = asyncio.run(serve(cfg))
    except (StartupError, OSError, ValueError) as exc:  # a port in use, a wrong flag, an unreadable file
        # one plain line for whoever started it, the reason in the "failed" event for a supervisor;
        # the traceback only in a debug log
        logging.getLogger("drafter.service.server").debug("cannot start", exc_info=exc,
                                                          extra={"event": "start_failed"})
        print(f"drafter serve: {exc}", file=sys.stderr)
        event("failed", reason=str(exc))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A stuck engine thread (drain timeout) must not keep PID 1 alive past the grace period.
    os._exit(code)
