"""prepare_workspace for a non-root engine, before it ever connected: the
daemon makes <root>/<uid> on connect, and the helper asks it to."""

from __future__ import annotations

import grp
import os
import pwd
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, Daemon, daemon_binary

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: runs the engine as nobody")

PREPARE = (
    "import sys\n"
    "from scriptgate_client import prepare_workspace\n"
    "try:\n"
    "    print(prepare_workspace(sys.argv[1], socket=sys.argv[2]))\n"
    "except PermissionError as e:\n"
    "    print('PermissionError:', e)\n"
    "    sys.exit(3)\n"
)


def prepare_as_nobody(path: Path, socket: Path) -> subprocess.CompletedProcess:
    nobody = pwd.getpwnam("nobody")
    return subprocess.run(
        ["/usr/bin/python3", "-c", PREPARE, str(path), str(socket)],
        user=nobody.pw_uid, group=nobody.pw_gid, extra_groups=[],
        env={"PYTHONPATH": str(REPO / "clients" / "python" / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )


@needs_root
def test_a_non_root_engine_prepares_its_workspace_before_connecting() -> None:
    nobody = pwd.getpwnam("nobody")
    d = Daemon(daemon_binary(), allowed_groups=(grp.getgrgid(nobody.pw_gid).gr_name,))
    try:
        mine = d.root / str(nobody.pw_uid)
        # The root is root's, 0755, and the daemon has not seen this uid yet.
        assert not mine.exists()
        ws = mine / "run-1" / "ws"
        got = prepare_as_nobody(ws, d.socket)
        assert got.returncode == 0, got.stdout + got.stderr
        assert got.stdout.strip() == str(ws)
        st = os.stat(mine)
        assert (st.st_mode & 0o777, st.st_uid) == (0o700, nobody.pw_uid), "made by the daemon"
        st = os.stat(ws)
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o700, nobody.pw_uid, nobody.pw_gid)
    finally:
        d.stop()


@needs_root
def test_a_peer_the_daemon_does_not_serve_gets_its_refusal_in_the_error(daemon: Daemon) -> None:
    # The session daemon serves root alone.
    got = prepare_as_nobody(daemon.root / str(pwd.getpwnam("nobody").pw_uid) / "ws", daemon.socket)
    assert got.returncode == 3, got.stdout + got.stderr
    assert "the daemon makes <root>/<uid> for engines it serves; it said:" in got.stdout
    assert "may not use scriptgated" in got.stdout, got.stdout
