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
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's parser: its usage, not the top level's
        sub = _subparser(parser, getattr(ns, "command", None))
        (sub or parser).error(_unrecognized(unknown, sub or parser))
    if not getattr(ns, "func", None):
        parser.print_help()
        return 2
    return ns.func(ns)


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


def _unrecognized(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's words, plus the nearest flag the parser knows when one is close."""
    import difflib

    text = f"unrecognized arguments: {' '.join(unknown)}"
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for arg in unknown:
        if arg.startswith("--"):
            near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
            if near:
                return f"{text} (did you mean {near[0]}?)"
    return text


if __name__ == "__main__":
    sys.exit(main())
