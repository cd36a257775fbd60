"""The `drafter` command. Each subcommand lives in its own module with a register(subparsers)."""

from __future__ import annotations

import argparse
import importlib
import sys

def _register_make_tiny(subparsers) -> None:
    from drafter.models.tiny import VARIANTS

    p = subparsers.add_parser("make-tiny", help="write a tiny random head + matching target checkpoint")
    p.add_argument("--method", required=True, choices=sorted(VARIANTS), help="checkpoint layout to write")
    p.add_argument("--out", required=True, help="directory; gets out/target and out/head")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny)


def _make_tiny(ns) -> int:
    from drafter.models.tiny import write_tiny

    method = write_tiny(ns.method, ns.out, seed=ns.seed)
    print(f"wrote {ns.out}/head ({method}) and {ns.out}/target")
    return 0


# A module with register(subparsers), or such a function; add one line here per subcommand.
SUBCOMMANDS = [
    "drafter.service.serve_cli",  # serve
    _register_make_tiny,  # make-tiny
    "coordinator.demo",  # demo
    "drafter.loadtest.cli",  # loadtest
    "drafter.bench",  # bench
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drafter", description="Disaggregated speculative-decoding drafter")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in SUBCOMMANDS:
        register = importlib.import_module(entry).register if isinstance(entry, str) else entry
        register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
