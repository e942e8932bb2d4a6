"""`autosp history run --commits A..B [C ...]`: record a range of commits, each measured with its own code.

As asv does it: the revisions are resolved in the repository (a range `A..B` is every commit after A up to B,
oldest first, as `git rev-list` lists them), a commit the store already holds samples of for this suite on this
machine is skipped, and each other one gets a temporary detached git worktree (removed afterwards, also when
its suite fails or is interrupted) in which the suite's cells run with that commit's code
(`history.suites.run_suite(checkout=...)`); the results are recorded by this version's code. A rerun of the same
range records nothing new. Unlike asv, no environment is built per commit: every commit runs in the current
Python environment (DESIGN.md, "Regression history").
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from autosp.harness.config import ConfigError


def _git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        first = (proc.stderr.strip().splitlines() or ["git failed"])[-1]
        raise ConfigError(f"git {' '.join(args)}: {first}")
    return proc.stdout.strip()


def resolve_commits(revisions: list[str], repo: Path) -> list[str]:
    """Full shas of `revisions` (each a revision or a range `A..B`), in the order given, ranges oldest first,
    each commit once."""
    shas: list[str] = []
    for revision in revisions:
        if ".." in revision:
            listed = _git(repo, "rev-list", "--reverse", revision).split()
            if not listed:
                raise ConfigError(f"--commits {revision} names no commit (is the range the right way round?)")
        else:
            listed = [_git(repo, "rev-parse", "--verify", f"{revision}^{{commit}}")]
        shas += [sha for sha in listed if sha not in shas]
    return shas


def recorded_commits(store: str | Path, suite: str, device: str, device_name: str) -> set[str]:
    """Commits with samples of `suite` measured from a clean checkout on this machine in `store`."""
    from autosp.experiments.history.store import open_store

    if not Path(store).exists():
        return set()
    with open_store(store) as con:
        rows = con.execute("SELECT DISTINCT commit_sha FROM samples WHERE suite = ? AND device = ? "
                           "AND device_name = ? AND dirty = 0", (suite, device, device_name)).fetchall()
    return {sha for (sha,) in rows}


@contextmanager
def temporary_worktree(repo: Path, sha: str) -> Iterator[Path]:
    """A detached worktree of `sha`, removed (and pruned from git's list) when the block ends."""
    path = Path(tempfile.mkdtemp(prefix=f"autosp-history-{sha[:9]}-"))
    try:
        _git(repo, "worktree", "add", "--detach", "--force", str(path), sha)
        yield path
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True,
                       check=False, timeout=120)
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True, check=False, timeout=120)


@dataclass
class RangeReport:
    recorded: dict[str, int] = field(default_factory=dict)  # sha -> samples added
    skipped: list[str] = field(default_factory=list)  # already in the store
    failed: dict[str, list[str]] = field(default_factory=dict)  # sha -> its failed cells


def run_commits(revisions: list[str], *, suite, store: str | Path, runs_dir: str | Path, autosp_cmd: str,
                repo: Path, device_name: str) -> RangeReport:
    """Run `suite` at each commit of `revisions` not yet recorded on this machine, and record it."""
    from autosp.experiments.history.store import record_files
    from autosp.experiments.history.suites import default_out_dir, run_suite

    commits = resolve_commits(revisions, repo)
    done = recorded_commits(store, suite.name, suite.device, device_name)
    report = RangeReport()
    for index, sha in enumerate(commits, 1):
        title = _git(repo, "show", "-s", "--format=%h %s", sha)[:100]
        if sha in done:
            print(f"commit {index}/{len(commits)} {title}: already recorded, skipped", flush=True)
            report.skipped.append(sha)
            continue
        print(f"commit {index}/{len(commits)} {title}", flush=True)
        with temporary_worktree(repo, sha) as checkout:
            stamped = default_out_dir(runs_dir, suite)
            out_dir = stamped.with_name(f"{stamped.name}-{sha[:9]}")
            files, failed = run_suite(suite, out_dir=out_dir, autosp_cmd=autosp_cmd, checkout=checkout)
        report.recorded[sha] = record_files(store, files, suite=suite.name, reference=suite.reference, repo=repo)
        if failed:
            report.failed[sha] = failed
    return report
