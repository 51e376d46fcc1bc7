"""`pyproxy version`: the version from pyproject.toml and the commit the code came from — a
checkout's HEAD, else what the build recorded, else "unknown" (pyproxy/version.py), and the
build backend's record itself (setup.py). Offline; the git repositories are temporary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from pyproxy import version
from pyproxy.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
PYPROXY = str(Path(sys.executable).parent / "pyproxy")
A_COMMIT = "0123456789abcdef0123456789abcdef01234567"

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    # An identity of the test's own: the machine's git configuration is not asked for one.
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True, env=env).stdout.strip()


@pytest.fixture(name="repo")
def repo_fixture(tmp_path: Path) -> Path:
    """A checkout with one commit holding pyproxy/__init__.py."""
    repo = tmp_path / "repo"
    (repo / "pyproxy").mkdir(parents=True)
    (repo / "pyproxy" / "__init__.py").write_text("")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    return repo


@needs_git
class TestGitCommit:
    def test_a_clean_checkout_gives_its_head(self, repo: Path) -> None:
        """A checkout whose tracked files are HEAD's gives HEAD, whole."""
        assert version.git_commit(repo) == git(repo, "rev-parse", "HEAD")

    def test_a_changed_tracked_file_makes_it_dirty(self, repo: Path) -> None:
        """A tracked file that differs from HEAD adds "-dirty", as git describe --dirty."""
        (repo / "pyproxy" / "__init__.py").write_text("x = 1\n")
        assert version.git_commit(repo) == git(repo, "rev-parse", "HEAD") + "-dirty"

    def test_an_untracked_file_does_not(self, repo: Path) -> None:
        """Untracked files are not part of the commit's state (git describe --dirty agrees)."""
        (repo / "notes.txt").write_text("")
        assert version.git_commit(repo) == git(repo, "rev-parse", "HEAD")

    def test_a_folder_inside_a_checkout_is_not_that_checkout(self, repo: Path) -> None:
        """A package installed into a virtualenv inside some checkout is not its code."""
        site = repo / ".venv" / "site-packages"
        site.mkdir(parents=True)
        assert version.git_commit(site) is None

    def test_no_repository_no_commit_and_no_git(self, tmp_path: Path, repo: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
        """Outside a repository, in one without a commit, or with no git at all: None."""
        assert version.git_commit(tmp_path / "nowhere") is None
        empty = tmp_path / "empty"
        empty.mkdir()
        git(empty, "init", "-q")
        assert version.git_commit(empty) is None
        monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
        assert version.git_commit(repo) is None


class TestRecordedCommit:
    @pytest.mark.parametrize(("record", "expected"), [
        pytest.param(json.dumps({"commit": A_COMMIT}), A_COMMIT, id="a commit"),
        pytest.param(json.dumps({"commit": A_COMMIT + "-dirty"}), A_COMMIT + "-dirty",
                     id="a dirty one"),
        pytest.param(json.dumps({"commit": "main"}), None, id="not a commit name"),
        pytest.param(json.dumps([A_COMMIT]), None, id="not an object"),
        pytest.param("{", None, id="not JSON"),
        pytest.param(None, None, id="no record"),
    ])
    def test_what_a_record_gives(self, tmp_path: Path, record: str | None,
                                 expected: str | None) -> None:
        """Only a well-formed record of a commit name counts; anything else is no record."""
        if record is not None:
            (tmp_path / version.BUILD_INFO).write_text(record)
        assert version.recorded_commit(tmp_path) == expected

    def test_written_as_read(self, tmp_path: Path) -> None:
        """The build's writer and the runtime's reader agree; an unknown commit leaves no
        record, not even an earlier build's."""
        version.write_build_info(tmp_path / version.BUILD_INFO, A_COMMIT)
        assert version.recorded_commit(tmp_path) == A_COMMIT
        version.write_build_info(tmp_path / version.BUILD_INFO, None)
        assert not (tmp_path / version.BUILD_INFO).exists()


@needs_git
class TestCommit:
    def test_a_checkout_wins_over_a_record(self, repo: Path) -> None:
        """Run from a checkout, its HEAD counts, not a record left in it."""
        version.write_build_info(repo / "pyproxy" / version.BUILD_INFO, A_COMMIT)
        assert version.commit(repo / "pyproxy") == git(repo, "rev-parse", "HEAD")

    def test_installed_it_is_the_record_else_unknown(self, tmp_path: Path) -> None:
        """Installed (no checkout around the package), the build's record; without one,
        "unknown"."""
        package = tmp_path / "site-packages" / "pyproxy"
        package.mkdir(parents=True)
        assert version.commit(package) == "unknown"
        version.write_build_info(package / version.BUILD_INFO, A_COMMIT)
        assert version.commit(package) == A_COMMIT


@needs_git
class TestBuildCommit:
    def test_the_environment_wins(self, repo: Path) -> None:
        """PYPROXY_COMMIT (the image's REVISION) is recorded even in a checkout."""
        assert version.build_commit(repo, {version.COMMIT_ENV: A_COMMIT}) == A_COMMIT

    def test_else_the_checkout_else_nothing(self, repo: Path, tmp_path: Path) -> None:
        """Empty or unset, the checkout's HEAD; outside a checkout, nothing."""
        head = git(repo, "rev-parse", "HEAD")
        assert version.build_commit(repo, {version.COMMIT_ENV: " "}) == head
        assert version.build_commit(repo, {}) == head
        assert version.build_commit(tmp_path, {}) is None

    def test_a_name_that_is_no_commit_is_refused(self, repo: Path) -> None:
        """Asked to record "main", the build fails rather than record something else."""
        with pytest.raises(ValueError, match="PYPROXY_COMMIT='main' is not a git commit"):
            version.build_commit(repo, {version.COMMIT_ENV: "main"})


class TestCommandLine:
    def test_version_and_commit_printed(self) -> None:
        """`--version`, `run --version` and `version` (table and JSON) print pyproject's
        version and this checkout's commit."""
        expected = version.git_commit(ROOT) or "unknown"
        for argv in (["--version"], ["run", "--version"]):
            out = subprocess.run([PYPROXY, *argv], capture_output=True, text=True, check=True)
            assert out.stdout == f"pyproxy {VERSION} (commit {expected})\n"
        out = subprocess.run([PYPROXY, "version"], capture_output=True, text=True, check=True)
        assert out.stdout.startswith(f"pyproxy {VERSION} (commit {expected}, Python 3.")
        out = subprocess.run([PYPROXY, "version", "-o", "json"], capture_output=True,
                             text=True, check=True)
        assert json.loads(out.stdout) | {"python": "-"} == {
            "version": VERSION, "commit": expected, "python": "-"}

    def test_the_commit_is_found_only_when_asked(self, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
        """Building the parser (every command does) runs no git: --version asks at use."""
        calls: list[Path] = []

        def recording(root: Path) -> str:
            calls.append(root)
            return A_COMMIT

        monkeypatch.setattr(version, "git_commit", recording)
        build_parser()
        assert calls == []
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--version"])
        assert calls == [version.PACKAGE_DIR.parent]
        assert capsys.readouterr().out == f"pyproxy {VERSION} (commit {A_COMMIT})\n"


def _debian_builds_offline() -> str | None:
    probe = subprocess.run(["/usr/bin/python3", "-c", "import setuptools, wheel, pip"],
                           capture_output=True, check=False)
    return None if probe.returncode == 0 else "needs Debian's python3-pip (setuptools, wheel)"


def _source_copy(dest: Path) -> Path:
    """The files a build of the package reads, without the checkout's .git."""
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "pyproxy", dest / "pyproxy",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", version.BUILD_INFO))
    return dest


def _built_record(source: Path, out: Path, commit_env: str | None) -> str | None:
    """The commit a wheel built from source records (offline: Debian's setuptools)."""
    env = {k: v for k, v in os.environ.items() if k != version.COMMIT_ENV}
    if commit_env is not None:
        env[version.COMMIT_ENV] = commit_env
    subprocess.run(["/usr/bin/python3", "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--no-index", "--wheel-dir", str(out), str(source)],
                   check=True, capture_output=True, env=env, timeout=300)
    (wheel,) = out.glob("pyproxy-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        if f"pyproxy/{version.BUILD_INFO}" not in archive.namelist():
            return None
        recorded = json.loads(archive.read(f"pyproxy/{version.BUILD_INFO}"))["commit"]
        assert isinstance(recorded, str)
        return recorded


@needs_git
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no /usr/bin/python3")
def test_a_built_package_records_its_commit(tmp_path: Path) -> None:
    """The build backend records PYPROXY_COMMIT (the image's way), else the checkout's HEAD
    (`make install`, `pip install .`), else nothing: installed, `pyproxy version` then says
    "unknown"."""
    why = _debian_builds_offline()
    if why:
        pytest.skip(why)
    source = _source_copy(tmp_path / "src")
    assert _built_record(source, tmp_path / "given", A_COMMIT) == A_COMMIT
    # Built again in the same place (pip builds in the source's build/): no stale record.
    assert _built_record(source, tmp_path / "none", None) is None
    git(source, "init", "-q")
    git(source, "add", ".")
    git(source, "commit", "-q", "-m", "one")
    # The build writes its egg-info and build/ into the source: untracked, not "dirty".
    assert _built_record(source, tmp_path / "checkout", None) == git(source, "rev-parse",
                                                                      "HEAD")
