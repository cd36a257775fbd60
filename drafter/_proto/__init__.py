"""Generated protobuf/gRPC modules (from proto/, by drafter/_proto/build.py; never committed).

An installed package has them from its build; a source checkout generates them on first import.
"""

from drafter._proto import build as _build

if not _build.is_generated():
    _build.generate()
