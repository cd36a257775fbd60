"""The package boundaries, read from the imports themselves (ast; nothing is imported).

drafter/wire is what both ends speak, so it imports neither the server (drafter.service) nor the
client (coordinator).  The client library target engines import (coordinator, less its
reference target, demo, load test and benchmarks) speaks drafter.wire and never drafter.service; the drafter never
imports coordinator (its tools, which drive real clients, excepted); measurement code
(drafter.tools) is imported by nothing in the product; and inside drafter no package imports one
above it: wire < kernels < attention, models < engine < service < tools, cli.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("drafter", "coordinator", "drafter_vllm")

# Lower layers never import higher ones.  Longest prefix wins; a module matching none is unranked.
LAYERS = {
    "drafter._proto": 0,
    "drafter.wire": 0,
    "drafter.kernels": 1,
    "drafter.attention.metadata": 1,  # the plain record attention kernels read: below them
    "drafter.attention": 2,
    "drafter.models": 2,
    "drafter.engine": 3,
    "drafter.service": 4,
    "drafter.tools": 5,
    "drafter.cli": 5,
    "drafter.__main__": 5,
}
CLIENT_EXCLUDED = ("coordinator.target", "coordinator.demo", "coordinator.loadtest", "coordinator.bench")
TOOLS = ("drafter.tools",)
PRODUCT = ("drafter.wire", "drafter.kernels", "drafter.attention", "drafter.models", "drafter.engine",
           "drafter.service")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(module: str, source: str, is_package: bool = False) -> set[str]:
    """Every module `source` may import (top level, in functions, under TYPE_CHECKING): for
    `from a import b`, both a and a.b (b may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def layer(name: str) -> int | None:
    best = max((p for p in LAYERS if within(name, p)), key=len, default=None)
    return None if best is None else LAYERS[best]


def is_client_library(module: str) -> bool:
    return within(module, "coordinator") and not any(within(module, p) for p in CLIENT_EXCLUDED)


def violations(module: str, imports: set[str]) -> list[str]:
    """What `module` importing `imports` breaks, one line each."""
    broken = {}
    for name in sorted(imports):
        if any(within(name, p) for p in PACKAGES):
            why = broken_rule(module, name)
            if why:
                broken[name] = why
    # `from a import b` names a and a.b: report the statement once
    return [f"{module} imports {name}: {why}" for name, why in broken.items() if name.rsplit(".", 1)[0] not in broken]


def broken_rule(module: str, name: str) -> str:
    if within(module, "drafter.wire") and (within(name, "drafter") and not within(name, "drafter.wire")
                                           and not within(name, "drafter._proto")):
        return "drafter.wire imports nothing of either end"
    if within(module, "drafter.wire") and within(name, "coordinator"):
        return "drafter.wire imports nothing of either end"
    if (within(module, "coordinator") or within(module, "drafter_vllm")) and within(name, "drafter.service"):
        return "clients speak drafter.wire, never drafter.service"
    if within(module, "drafter") and not any(within(module, t) for t in TOOLS) and within(name, "coordinator"):
        return "the drafter never imports coordinator"
    if (is_client_library(module) or within(module, "drafter_vllm")) and any(within(name, p)
                                                                             for p in CLIENT_EXCLUDED):
        return "the client library never imports the reference target, the demo or the load test"
    if within(module, "coordinator.target") and within(name, "coordinator.demo"):
        return "the reference target never imports the demo"
    if any(within(module, p) for p in PRODUCT) and any(within(name, t) for t in TOOLS):
        return "tools are imported by nothing in the product"
    own, other = layer(module), layer(name)
    if own is not None and other is not None and other > own:
        return f"upward import (layer {own} -> {other})"
    return ""


def all_modules() -> dict[str, tuple[str, bool]]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            out[module_name(path)] = (path.read_text(), path.name == "__init__.py")
    return out


def test_the_tree_keeps_the_rules():
    modules = all_modules()
    assert "drafter.wire.schema" in modules and "coordinator.transport.zmq_client" in modules
    found = [v for m, (src, pkg) in modules.items() for v in violations(m, imported_names(m, src, pkg))]
    assert not found, "\n".join(found)


def test_each_rule_catches_a_violation():
    """The checker itself: one offending import per rule, each reported."""
    cases = {
        ("drafter.wire.tensors", "from drafter.service import core"): "either end",
        ("drafter.wire.errors", "from drafter.engine.inputs import validate"): "either end",
        ("drafter.wire.schema", "import coordinator.session"): "either end",
        ("coordinator.transport.zmq_client", "from drafter.service.core import ServiceCore"): "never drafter.service",
        ("drafter_vllm.sources", "from drafter.service import sessions"): "never drafter.service",
        ("drafter.service.core", "from coordinator.routing import Router"): "never imports coordinator",
        ("coordinator.tp", "from coordinator.target.drafting import CallBuilder"): "reference target",
        ("coordinator.remote_proposer", "from coordinator.demo import fleet"): "reference target",
        ("coordinator.target.engine", "from coordinator.demo.fleet import run_fleet"): "never imports the demo",
        ("drafter.service.core", "from drafter.tools.bench import grid"): "nothing in the product",
        ("coordinator.session", "from coordinator.loadtest import cli"): "reference target",
        ("drafter.kernels.kv_write", "from drafter.engine.inputs import ProposeInputs"): "upward",
        ("drafter.engine.graphs", "from drafter.service import sessions"): "upward",
        ("drafter.attention.triton_backend", "from ..engine import config"): "upward",
    }
    for (module, line), why in cases.items():
        found = violations(module, imported_names(module, line))
        assert found and why in found[0], (module, line, found)


def test_allowed_imports_pass():
    for module, line in [("coordinator.transport.base", "from drafter.wire import schema"),
                         ("coordinator.loadtest.clients", "from coordinator.transport import ZmqDrafterClient"),
                         ("coordinator.demo.fleet", "from coordinator.target.engine import TargetEngine"),
                         ("drafter.service.core", "from drafter.engine.engine import DraftEngine"),
                         ("drafter.engine.graphs", "from drafter.kernels import batch_inputs")]:
        assert violations(module, imported_names(module, line)) == [], (module, line)


def test_relative_imports_resolve():
    assert "drafter.engine.config" in imported_names("drafter.attention.triton_backend", "from ..engine import config")
    assert "drafter.wire.schema" in imported_names("drafter.wire", "from . import schema", is_package=True)
