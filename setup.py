"""Everything is declared in pyproject.toml; this only adds one file to the wheel's root: the
``.pth`` line that runs nascompress/_torchvision_hook.py at start-up, so that a plain ``import timm``
works after ``pip install nascompress`` next to a CPU-only torch (see that module for why)."""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "nascompress"))
from _torchvision_hook import PTH_LINE, PTH_NAME  # noqa: E402  (a plain module: no torch needed)

sys.path.pop(0)


class BuildWithPth(build_py):
    def run(self):
        super().run()
        target = os.path.join(self.build_lib, PTH_NAME)
        with open(target, "w") as f:
            f.write(PTH_LINE)


setup(cmdclass={"build_py": BuildWithPth})
