"""pyproxy's version: one source, pyproject.toml's `version`, read from the installed package's
metadata (the Makefile labels the image with the same field)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

UNKNOWN = "0+unknown"  # run from a source tree that was never installed


def version() -> str:
    try:
        return package_version("pyproxy")
    except PackageNotFoundError:
        return UNKNOWN
