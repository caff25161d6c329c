"""Builds the wire code into the package: `flatc --python` over the repository's schemas writes
the `moeline.wire` package next to `moeline_client` in the build (pyproject.toml has the rest)."""

import glob
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMAS = os.path.join(HERE, "..", "..", "schemas")


class BuildWithWireCode(build_py):
    def run(self):
        super().run()
        flatc = shutil.which("flatc")
        if flatc is None:
            raise RuntimeError("flatc is needed to build the wire code (Debian: flatbuffers-compiler)")
        schemas = sorted(glob.glob(os.path.join(SCHEMAS, "*.fbs")))
        if not schemas:
            raise RuntimeError(f"no schemas in {SCHEMAS}: build from a moeline checkout")
        subprocess.run([flatc, "--python", "--require-explicit-ids", "-o", self.build_lib,
                        *schemas], check=True)
        for folder in ("moeline", os.path.join("moeline", "wire")):
            init = os.path.join(self.build_lib, folder, "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()


setup(cmdclass={"build_py": BuildWithWireCode})
