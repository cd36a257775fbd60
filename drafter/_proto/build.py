"""Generate the Python protobuf/gRPC modules from proto/ with grpcio-tools.

Runs at build/install time (setup.py's build_py loads this file by path, without importing the
drafter package, whose dependencies may not be installed in an isolated build environment), and
on first import in a source checkout (drafter/_proto/__init__.py).  The output is never committed.

    python drafter/_proto/build.py            # regenerate in a source checkout
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
OUT_ROOT = Path(__file__).resolve().parent  # drafter/_proto
# protoc names Python modules after the .proto path ("drafter/v1/..." -> "drafter.v1"), which would
# collide with the drafter package itself; the modules live under drafter._proto instead.
_IMPORT = re.compile(r"^from drafter\.v1 import", re.MULTILINE)
_IMPORT_FIXED = "from drafter._proto.drafter.v1 import"


def proto_files(proto_root: Path = PROTO_ROOT) -> list[str]:
    return sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))


def generate(out_root: Path = OUT_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write <out_root>/drafter/v1/*_pb2*.py(i); return the written files."""
    from grpc_tools import protoc  # build requirement; imported lazily so this file loads without it
    import grpc_tools

    files = proto_files(proto_root)
    if not files:
        raise FileNotFoundError(f"no .proto files under {proto_root}")
    wkt = Path(grpc_tools.__file__).parent / "_proto"
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{proto_root}", f"-I{wkt}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", *files]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {files}")
        for src in sorted(Path(tmp).rglob("*_pb2*.py*")):
            rel = src.relative_to(tmp)
            dst = Path(out_root) / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            for parent in rel.parents:  # the generated modules are packages all the way down
                init = Path(out_root) / parent / "__init__.py"
                if parent != Path(".") and not init.exists():
                    init.write_text("")
            _replace(dst, _IMPORT.sub(_IMPORT_FIXED, src.read_text()))
            written.append(dst)
    return written


def _replace(dst: Path, text: str) -> None:
    """Write dst as a whole or not at all (a module another process imports meanwhile, e.g. a test run
    beside the vLLM venv's editable install, reads the old file or the new one, never half of one);
    unchanged content is not rewritten."""
    if dst.exists() and dst.read_text() == text:
        return
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, dst)


def is_generated(out_root: Path = OUT_ROOT) -> bool:
    return (Path(out_root) / "drafter" / "v1" / "drafter_pb2.py").exists()


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
