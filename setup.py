"""Build hook: generate the gRPC/protobuf modules from proto/ into the package (metadata is in pyproject.toml).

Both `pip install .` and `pip install -e .` run build_py; the generated files are never committed.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _proto_build():
    # Loaded by path: importing the drafter package would need torch inside the build environment.
    spec = importlib.util.spec_from_file_location("_drafter_proto_build", HERE / "drafter" / "_proto" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithProto(build_py):
    def run(self):
        gen = _proto_build()
        if self.editable_mode:
            # An editable install imports the package from the source tree: generate there.
            gen.generate(HERE / "drafter" / "_proto", HERE / "proto")
            super().run()
        else:
            # Straight into the build: the source tree may be read-only, and stale files
            # a source checkout left behind are overwritten.
            super().run()
            gen.generate(Path(self.build_lib) / "drafter" / "_proto", HERE / "proto")


setup(cmdclass={"build_py": BuildPyWithProto})
