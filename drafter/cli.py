"""The `drafter` command. Each subcommand lives in its own module with a register(subparsers)."""

from __future__ import annotations

import argparse
import importlib
import sys

def _register_make_tiny(subparsers) -> None:
    from drafter.models.tiny import EAGLE3_LAYOUTS, ROPE_LAYOUTS, ROPE_PRESETS, VARIANTS

    p = subparsers.add_parser("make-tiny", help="write a tiny random head + matching target checkpoint")
    p.add_argument("--method", required=True, choices=sorted(VARIANTS), help="checkpoint layout to write")
    p.add_argument("--out", required=True, help="directory; gets out/target and out/head")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rope", default="default", choices=sorted(ROPE_PRESETS),
                   help="the head's rope (llama3: Llama-3.1's scaling with original_max_position_embeddings 32; "
                        "qwen3: theta 1e6; yarn / linear / dynamic / ntk: factor 4)")
    p.add_argument("--rope-layout", default="legacy", choices=ROPE_LAYOUTS,
                   help="legacy: rope_theta + rope_scaling; params: transformers-5 rope_parameters")
    p.add_argument("--eagle3-layout", default="speculators", choices=EAGLE3_LAYOUTS,
                   help="EAGLE-3 config.json: vLLM speculators, or SafeAILab's plain LlamaForCausalLMEagle3")
    p.add_argument("--attention-bias", action="store_true", help="q/k/v and o_proj biases in the head")
    p.add_argument("--mlp-bias", action="store_true", help="gate/up/down biases in the head")
    p.add_argument("--head-dim", type=int, default=None, help="attention head_dim (default 32; != hidden / heads)")
    p.add_argument("--partial-rotary-factor", type=float, default=None, help="rotate only this share of head_dim")
    p.set_defaults(func=_make_tiny)


def _make_tiny(ns) -> int:
    from drafter.models.tiny import head_sizes, write_tiny

    sizes = head_sizes(ns.method, rope=ns.rope, rope_layout=ns.rope_layout, eagle3_layout=ns.eagle3_layout,
                       attention_bias=ns.attention_bias, mlp_bias=ns.mlp_bias, head_dim=ns.head_dim,
                       partial_rotary_factor=ns.partial_rotary_factor)
    method = write_tiny(ns.method, ns.out, seed=ns.seed, sizes=sizes)
    print(f"wrote {ns.out}/head ({method}) and {ns.out}/target")
    return 0


# A module with register(subparsers), or such a function; add one line here per subcommand.
SUBCOMMANDS = [
    "drafter.service.serve_cli",  # serve
    _register_make_tiny,  # make-tiny
    "coordinator.demo.cli",  # demo
    "coordinator.loadtest.cli",  # loadtest
    "drafter.tools.bench.grid",  # bench
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
