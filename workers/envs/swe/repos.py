"""The repository store: where SWE instances' repositories come from, offline.

A directory holding one git repository per ``repo`` name, as Forkyard keeps them: a
bare repository ``owner__name.git`` (``forkyard repos add PATH`` makes one from a
checkout, a bare repository or a bundle). Nothing is fetched from a network: a missing
repository or commit is a task error naming it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from workers.errors import TaskFormatError

logger = logging.getLogger(__name__)

_GIT_TIMEOUT_S = 300.0
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def _git(*args: str, cwd: Path | None = None, timeout: float = _GIT_TIMEOUT_S, stdin: bytes | None = None) -> bytes:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
    done = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, timeout=timeout, env=env,
                          check=False)
    if done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, ["git", *args], done.stdout, done.stderr)
    return done.stdout


def store_name(repo: str) -> str:
    """Return the directory name a repo is kept under (``owner/name`` -> ``owner__name.git``)."""
    return _SAFE.sub("_", repo.replace("/", "__")) + ".git"


class RepoStore:
    """A directory of bare git repositories, one per ``repo`` name."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, repo: str) -> Path:
        """Return where ``repo`` is (or would be) kept."""
        return self.root / store_name(repo)

    def has(self, repo: str) -> bool:
        """Tell whether ``repo`` is in the store."""
        return (self.path(repo) / "HEAD").is_file()

    def repos(self) -> list[str]:
        """Return the stored repositories' directory names, sorted."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / "HEAD").is_file())

    def resolve(self, repo: str, commit: str) -> str:
        """Return the full id of ``commit`` in ``repo``.

        Raises:
            TaskFormatError: the repository is not in the store, or lacks the commit.
        """
        if not self.has(repo):
            raise TaskFormatError(
                f"repository {repo!r} is not in the repository store {str(self.root)!r} "
                f"(add it with `forkyard repos add PATH --name {repo}`)", field="repo")
        try:
            out = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=self.path(repo))
        except subprocess.CalledProcessError:
            raise TaskFormatError(f"repository {repo!r} has no commit {commit!r}", field="base_commit") from None
        return out.decode().strip()

    def archive(self, repo: str, commit: str) -> bytes:
        """Return a tar of the tree at ``commit`` (no history, no ``.git``)."""
        full = self.resolve(repo, commit)
        return _git("archive", "--format=tar", full, cwd=self.path(repo))

    def add(self, source: str | os.PathLike[str], *, name: str) -> Path:
        """Copy a repository into the store as ``name``.

        ``source`` is a checkout, a bare repository, a bundle, or a plain directory, which
        becomes a repository of one commit made the same way every time (fixed author,
        date and message), so instances written against it name the same commit id on
        every machine. An existing entry of that name is replaced only once the new copy
        is complete.

        Raises:
            TaskFormatError: ``source`` does not exist or cannot be read as a repository.
        """
        source = Path(source).resolve()
        if not source.exists():
            raise TaskFormatError(f"{str(source)!r} does not exist", field="repo")
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path(name)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=self.root))
        try:
            if source.is_dir() and not (source / ".git").exists() and not (source / "HEAD").is_file():
                source = commit_directory(source, staging / "tree")
            try:
                _git("clone", "--quiet", "--mirror", "--no-hardlinks", str(source), str(staging / "repo"))
            except subprocess.CalledProcessError as exc:
                detail = exc.stderr.decode(errors="replace").strip()[-300:]
                raise TaskFormatError(f"{str(source)!r} is not a git repository or bundle: {detail}",
                                      field="repo") from None
            if target.exists():
                shutil.rmtree(target)
            (staging / "repo").rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("repository %s added to %s from %s", name, self.root, source)
        return target


#: Who and when the one commit of a plain directory is (fixed, so its id is too).
_FIXED_COMMIT_ENV = {
    "GIT_AUTHOR_NAME": "forkyard", "GIT_AUTHOR_EMAIL": "forkyard@localhost", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "forkyard", "GIT_COMMITTER_EMAIL": "forkyard@localhost",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}
_JUNK = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "*.pyc", "*.egg-info", ".DS_Store")


def commit_directory(source: Path, work: Path) -> Path:
    """Make a repository of one deterministic commit holding ``source``'s files; return its path."""
    shutil.copytree(source, work, ignore=shutil.ignore_patterns(*_JUNK), symlinks=True)
    _git("init", "--quiet", "--initial-branch=main", cwd=work)
    for path in sorted(p for p in work.rglob("*") if p.is_file() and ".git" not in p.relative_to(work).parts):
        path.chmod(0o755 if os.access(path, os.X_OK) else 0o644)
    _git("add", "--all", cwd=work)
    env_args = [f"{k}={v}" for k, v in _FIXED_COMMIT_ENV.items()]
    done = subprocess.run(["env", *env_args, "git", "-c", "commit.gpgsign=false", "commit", "--quiet",
                           "--no-verify", "-m", f"{source.name}: imported by forkyard"],
                          cwd=work, capture_output=True, timeout=_GIT_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise TaskFormatError(f"cannot commit {str(source)!r}: {done.stderr.decode(errors='replace')[-300:]}",
                              field="repo")
    return work


def head_commit(path: str | os.PathLike[str]) -> str:
    """Return the commit id HEAD names in the repository at ``path``."""
    return _git("rev-parse", "HEAD", cwd=Path(path)).decode().strip()


__all__ = ["RepoStore", "commit_directory", "head_commit", "store_name"]
