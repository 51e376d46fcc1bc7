"""The build backend's one addition to pyproject.toml: the built package records the git
commit it was built from (pyproxy/_build_info.json), which `pyproxy version` prints once
installed, where no checkout is left to ask (pyproxy/version.py says how it is found).

pyproxy/version.py is run as a file (it imports only the standard library): the build
imports nothing of the package it builds.
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE = Path(__file__).resolve().parent
VERSION_MODULE = runpy.run_path(str(SOURCE / "pyproxy" / "version.py"))


class BuildPyRecordingCommit(build_py):
    """build_py, then the commit record into the built package. Not for an editable install:
    its package is the checkout itself, whose commit git tells."""

    def run(self) -> None:
        super().run()
        if self.dry_run or getattr(self, "editable_mode", False):
            return
        commit = VERSION_MODULE["build_commit"](SOURCE, os.environ)
        target = Path(self.build_lib) / "pyproxy" / VERSION_MODULE["BUILD_INFO"]
        VERSION_MODULE["write_build_info"](target, commit)


setup(cmdclass={"build_py": BuildPyRecordingCommit})
