"""pyproxy's version and the git commit it was built from.

The version has one source, pyproject.toml's `version`, read from the installed package's
metadata. The commit is found where it can be, in this order:

1. run from a git checkout (the editable install `make venv` makes): the checkout's HEAD;
2. installed (`make install`, `pip install .`, the image): the commit the build backend
   recorded in the package (`BUILD_INFO`, written by setup.py with `build_commit`): the
   `PYPROXY_COMMIT` environment variable when set (the image's build passes its `REVISION`
   build argument there: a build context need not hold .git), else HEAD of the checkout being
   built;
3. else "unknown".

A commit whose tracked files differ from the work tree ends in "-dirty", as `git describe
--dirty` writes it. Nothing here raises: a missing git, a repository git refuses (another
user's, "dubious ownership") or a damaged record each give "unknown".

setup.py runs this file by path at build time, before any dependency is installed, so it
imports only the standard library.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path

UNKNOWN = "0+unknown"  # run from a source tree that was never installed
UNKNOWN_COMMIT = "unknown"
# The record the build backend writes beside this module in an installed package.
BUILD_INFO = "_build_info.json"
# The commit to record at build time, when the source tree is no git checkout (the image).
COMMIT_ENV = "PYPROXY_COMMIT"
# A full or abbreviated commit name, as `git rev-parse [--short]` prints it.
COMMIT_PATTERN = re.compile(r"[0-9a-f]{7,40}(-dirty)?")
PACKAGE_DIR = Path(__file__).resolve().parent
GIT_TIMEOUT_S = 5.0


def version() -> str:
    try:
        return package_version("pyproxy")
    except PackageNotFoundError:
        return UNKNOWN


def commit(package_dir: Path = PACKAGE_DIR) -> str:
    """The commit this pyproxy was built from: its checkout's HEAD, else the build's record,
    else "unknown"."""
    return git_commit(package_dir.parent) or recorded_commit(package_dir) or UNKNOWN_COMMIT


def describe() -> str:
    """The one line `pyproxy --version` prints."""
    return f"pyproxy {version()} (commit {commit()})"


def _git(root: Path, *args: str) -> str | None:
    try:
        # No optional locks: `git status` would otherwise refresh the index, a write into a
        # checkout someone may be committing in.
        result = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                text=True, timeout=GIT_TIMEOUT_S, check=False,
                                env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def git_commit(root: Path) -> str | None:
    """HEAD of the git work tree whose top folder is root, "-dirty" when a tracked file
    differs from it; None when root is not such a top folder (a package installed inside
    some other checkout is not that checkout's code) or git is missing or refuses."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    head = _git(root, "rev-parse", "--verify", "HEAD")
    if head is None or not COMMIT_PATTERN.fullmatch(head):
        return None  # a repository without a commit yet
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    if changes is None:
        return None
    return head + ("-dirty" if changes else "")


def recorded_commit(package_dir: Path) -> str | None:
    """The commit the build backend recorded in the installed package; None without a
    readable record."""
    try:
        recorded = json.loads((package_dir / BUILD_INFO).read_text()).get("commit")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(recorded, str) and COMMIT_PATTERN.fullmatch(recorded):
        return recorded
    return None


def build_commit(source: Path, environ: Mapping[str, str]) -> str | None:
    """What a build of the source tree records: COMMIT_ENV when set (ValueError when it is
    not a commit name: asked to record something, the build must not record something
    else), else the source tree's git HEAD; None when neither is known."""
    given = environ.get(COMMIT_ENV, "").strip()
    if given:
        if not COMMIT_PATTERN.fullmatch(given):
            raise ValueError(f"{COMMIT_ENV}={given!r} is not a git commit name "
                             "(hex, 7 to 40 digits, optionally -dirty)")
        return given
    return git_commit(source)


def write_build_info(target: Path, commit_name: str | None) -> None:
    """Writes the record recorded_commit reads; when the commit is unknown, removes any: a
    build in place reuses its build/ folder, where an earlier build's record would stay."""
    if commit_name is None:
        target.unlink(missing_ok=True)
    else:
        target.write_text(json.dumps({"commit": commit_name}) + "\n")
