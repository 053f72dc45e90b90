"""A real scriptgated for the tests, started as this session's child.

Like the Rust rig (tests/common/mod.rs): a temp dir (mode 0755, so the script's
uid can reach the workspace) with a key file (0600), a config, a state dir and a
workspace root. The daemon binary is $SCRIPTGATED or <repo>/target/debug/scriptgated.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from scriptgate_client import prepare_workspace

REPO = Path(__file__).resolve().parents[3]
KEY = b"python-client-test-key-0123456789abcdef"


class Daemon:
    def __init__(self, binary: Path, allowed_groups: tuple = ()) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sg-py-"))
        os.chmod(self.dir, 0o755)
        self.root = self.dir / "roots"
        self.root.mkdir(mode=0o755)
        os.chmod(self.root, 0o755)
        self.key_file = self.dir / "token.key"
        self.key_file.write_bytes(KEY)
        os.chmod(self.key_file, 0o600)
        self.state = self.dir / "state"
        self.socket = self.dir / "sock"
        self.log = self.dir / "daemon.log"
        self.config = self.dir / "scriptgate.toml"
        # Root is always served; anyone else through their primary group.
        if os.geteuid() != 0:
            allowed_groups = (grp.getgrgid(os.getegid()).gr_name,)
        groups = f"allowed_groups = {json.dumps(list(allowed_groups))}\n" if allowed_groups else ""
        self.config.write_text(
            f'[auth]\ntoken_key_file = "{self.key_file}"\n{groups}'
            f'[workspace]\nroots = ["{self.root}"]\n'
            f'[state]\ndir = "{self.state}"\n'
        )
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "--listen", str(self.socket), "--config", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"scriptgated exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(self.socket))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"scriptgated did not listen:\n{self.log_text()}")
                time.sleep(0.02)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def workspace(self, name: str = "") -> Path:
        """A fresh workspace under the root, owned by the uid scripts run as."""
        return prepare_workspace(self.root / (name or f"ws-{uuid.uuid4().hex[:8]}"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def daemon_binary() -> Path:
    binary = Path(os.environ.get("SCRIPTGATED") or REPO / "target" / "debug" / "scriptgated")
    if not binary.exists():
        pytest.fail(f"no daemon binary at {binary}: run `cargo build` or set SCRIPTGATED")
    return binary


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    d = Daemon(daemon_binary())
    try:
        yield d
    finally:
        d.stop()
