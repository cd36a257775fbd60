"""The `drafter serve` subcommand: flags (and DRAFTER_* variables) -> ServerConfig -> server.serve."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from drafter.service.config import add_arguments, from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="run the drafter service (gRPC + ZMQ + health + /metrics)",
        description="Serve a draft head over gRPC and ZMQ. Every flag has a DRAFTER_* environment "
                    "variable (the container passes no arguments); a flag wins over its variable.")
    add_arguments(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    try:
        cfg = from_args(ns)
        cfg.check()
    except ValueError as exc:
        print(f"drafter serve: {exc}", file=sys.stderr)
        return 2
    from drafter.service.logs import setup_logging
    from drafter.service.server import serve

    setup_logging(cfg.log_format, cfg.log_level)
    code = asyncio.run(serve(cfg))
    sys.stdout.flush()
    sys.stderr.flush()
    # A stuck engine thread (drain timeout) must not keep PID 1 alive past the grace period.
    os._exit(code)
