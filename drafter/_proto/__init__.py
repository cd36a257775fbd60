"""Generated protobuf/gRPC modules (from proto/, by drafter/_proto/build.py; never committed).

An installed package has them from its build; a source checkout generates them on first import.
"""

from drafter._proto import build as _build

if not _build.is_generated():
    try:
        _build.generate()
    except ImportError as exc:
        raise ImportError("drafter's gRPC stubs are not generated yet and grpcio-tools is missing: "
                          "`pip install grpcio-tools` (or install the package: pip install -e .)") from exc
