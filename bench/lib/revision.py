"""Run a bench script's inner measurement in a subprocess, from this checkout or from a git
worktree of another revision (that revision's mxserve first on sys.path), and read the JSON
line it prints last. For side-by-side runs against a baseline revision on the same machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_inner(script: str, argv: list[str], rev: str | None = None):
    """`python script --inner *argv` at `rev` (None: this checkout); its last stdout line as
    JSON."""
    command = [sys.executable, os.path.abspath(script), "--inner", *argv]
    if rev is None:
        out = subprocess.run(command, check=True, capture_output=True, text=True,
                             cwd=REPO).stdout
        return json.loads(out.splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "mxserve")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, rev], check=True,
                       capture_output=True)
        try:
            out = subprocess.run(command, env={**os.environ, "PYTHONPATH": tmp}, cwd=tmp,
                                 check=True, capture_output=True, text=True).stdout
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree],
                           check=True, capture_output=True)
    return json.loads(out.splitlines()[-1])


COMMIT_ENV = "MXSERVE_COMMIT"


def head_commit() -> str:
    """This checkout's commit; $MXSERVE_COMMIT where set (bench/lib/on_device.sh sets it: the
    device's copy of the tree keeps the git metadata of the first call to a warm machine)."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()


def write_result(out: str, result: dict, markdown: str) -> None:
    """The JSON at `out` and the markdown beside it (.md)."""
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    with open(out.replace(".json", ".md"), "w") as f:
        f.write(markdown)
