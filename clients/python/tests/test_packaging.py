"""Installing the package writes nothing into the source tree (no build/, no *.egg-info)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Set

HERE = Path(__file__).resolve().parents[1]


def tree() -> Set[str]:
    out = set()
    for d, dirs, files in os.walk(HERE):
        dirs[:] = [x for x in dirs if x not in (".venv", "__pycache__", ".pytest_cache")]
        out.update(os.path.relpath(os.path.join(d, f), HERE) for f in files + dirs)
    return out


def test_install_leaves_the_tree_alone() -> None:
    before = tree()
    with tempfile.TemporaryDirectory() as venv:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        target = os.path.join(venv, "site")
        p = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
             "--target", target, str(HERE)],
            capture_output=True, text=True, timeout=300,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        installed = sorted(os.listdir(os.path.join(target, "scriptgate_client")))
    assert {"__init__.py", "client.py", "py.typed", "types.py"} <= set(installed), installed
    assert tree() == before, sorted(tree() ^ before)
