"""Workspaces the script's uid can write.

scriptgated runs a script as the engine's own uid, or as ``sandbox.run_as``
when the engine is root: ``scriptgate-script`` in the packages (a user of their
own), ``nobody`` in scriptgated's built-in default. The workspace must be writable by
that uid, and every directory above it searchable (``x``) by it.

A non-root engine's workspaces live in ``<root>/<uid>``, which the daemon makes
(0700, the engine's) at start for each ``[[auth.engine]]`` user, and on any
engine's first connection. Under socket activation no daemon runs before that
connection, so ``prepare_workspace`` asks the daemon (``daemon.info``, which
starts it) when it may not create a parent, and tries once more.
"""

from __future__ import annotations

import json
import os
import pwd
import socket as _socket
import time
from pathlib import Path
from typing import Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]


PACKAGED_RUN_AS = "scriptgate-script"

# The daemon's answer to daemon.info is one line, far below this.
_MAX_ANSWER = 1 << 20
# Socket activation starts the daemon for the connection: its start-up checks
# (the sandbox preflight) take a few seconds on a slow host.
_ANSWER_TIMEOUT_S = 30.0


def default_run_as() -> str:
    """The packages' ``sandbox.run_as`` where the package made its user, else
    scriptgated's built-in ``nobody``."""
    try:
        pwd.getpwnam(PACKAGED_RUN_AS)
        return PACKAGED_RUN_AS
    except KeyError:
        return "nobody"


def script_identity(run_as: Optional[str] = None) -> Tuple[int, int]:
    """``(uid, gid)`` scripts of this process will run as: ``run_as`` when we are
    root (pass the daemon's ``sandbox.run_as``; by default ``default_run_as()``),
    else our own."""
    if os.geteuid() == 0:
        pw = pwd.getpwnam(run_as or default_run_as())
        return pw.pw_uid, pw.pw_gid
    return os.geteuid(), os.getegid()


def prepare_workspace(
    path: PathLike,
    *,
    run_as: Optional[str] = None,
    uid: Optional[int] = None,
    gid: Optional[int] = None,
    mode: int = 0o700,
    socket: Optional[PathLike] = None,
    created_by: Optional[str] = None,
) -> Path:
    """Create ``path`` (and missing parents, mode 0755) and give it to the uid
    scripts run as, with ``mode``. Returns the absolute path.

    An existing directory is re-owned and re-moded; a symlink or non-directory
    at ``path`` is refused (``OSError``: ELOOP or ENOTDIR). Directories above
    it must be searchable by that uid; this is not checked.

    Not root and not allowed to create a parent (``<root>/<uid>`` before the
    daemon made it): connects to the daemon at ``socket`` (default
    ``$SCRIPTGATE_SOCKET``, then ``/run/scriptgate/scriptgate.sock``), which makes
    that directory on connect, and tries again. ``PermissionError`` names the
    daemon's answer when that did not help.

    ``created_by`` (e.g. your engine's name): when this call creates the
    directory, it also writes the retention marker ``.agent/workspace.json``
    (this process's, mode 0600 in a 0700 ``.agent``), as ``scriptgate run`` does
    for the workspaces it makes. Once a script of this engine has run in it, the
    daemon's ``[workspace] retain_days`` removes it when unused (scriptgated(8),
    WORKSPACE RETENTION). A directory that already existed is never marked.
    """
    p = Path(os.path.abspath(os.fspath(path)))
    if uid is None or gid is None:
        su, sg = script_identity(run_as)
        uid = su if uid is None else uid
        gid = sg if gid is None else gid
    try:
        p.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    except PermissionError as e:
        if os.geteuid() == 0:
            raise
        said = _ask_daemon(socket)
        try:
            p.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        except PermissionError:
            raise PermissionError(
                e.errno,
                f"cannot create {p.parent} (the daemon makes <root>/<uid> for engines "
                f"it serves; it said: {said})",
                e.filename,
            ) from None
    try:
        os.mkdir(p, 0o700)
        made = True
    except FileExistsError:
        made = False
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if made and created_by is not None:
            _mark(fd, created_by)
        if os.fstat(fd).st_uid != uid or os.fstat(fd).st_gid != gid:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return p


MARKER_DIR, MARKER = ".agent", "workspace.json"


def _mark(ws_fd: int, created_by: str) -> None:
    """Write the retention marker below the opened, just-created workspace."""
    os.mkdir(MARKER_DIR, 0o700, dir_fd=ws_fd)
    agent = os.open(MARKER_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=ws_fd)
    try:
        f = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=agent)
    finally:
        os.close(agent)
    text = json.dumps({"created_by": created_by, "created_at_ms": int(time.time() * 1000), "uid": os.geteuid()})
    with os.fdopen(f, "w") as out:
        out.write(text + "\n")


def _ask_daemon(path: Optional[PathLike]) -> str:
    """One ``daemon.info`` round trip: the daemon gives a connecting engine its
    ``<root>/<uid>`` before it reads the request. Returns what it said, for an
    error message; never raises."""
    from .client import DEFAULT_SOCKET

    where = os.fspath(path or os.environ.get("SCRIPTGATE_SOCKET") or DEFAULT_SOCKET)
    try:
        with _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM) as s:
            s.settimeout(_ANSWER_TIMEOUT_S)
            s.connect(where)
            try:
                s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n')
            except BrokenPipeError:
                # A peer it does not serve gets the refusal on accept, and a
                # close: the refusal is still there to read.
                pass
            got = b""
            while b"\n" not in got and len(got) < _MAX_ANSWER:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
    except OSError as e:
        return f"no answer at {where}: {e}"
    try:
        answer = json.loads(got.split(b"\n", 1)[0])
    except ValueError:
        return f"no answer at {where}"
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message"))
    return "ok"
