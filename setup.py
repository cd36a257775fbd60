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
        # Into the source tree first: an editable install imports from there, and a regular
        # build then copies the modules like any other file of the package.
        gen.generate(HERE / "drafter" / "_proto", HERE / "proto")
        super().run()
        if not self.editable_mode:
            gen.copy_generated(HERE / "drafter" / "_proto", Path(self.build_lib) / "drafter" / "_proto")


setup(cmdclass={"build_py": BuildPyWithProto})
