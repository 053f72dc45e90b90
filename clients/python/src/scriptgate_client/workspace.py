"""Workspaces the script's uid can write.

scriptgated runs a script as the engine's own uid, or as ``sandbox.run_as``
when the engine is root: ``scriptgate-script`` in the packages (a user of their
own), ``nobody`` in scriptgated's built-in default. The workspace must be writable by
that uid, and every directory above it searchable (``x``) by it.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]


PACKAGED_RUN_AS = "scriptgate-script"


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
) -> Path:
    """Create ``path`` (and missing parents, mode 0755) and give it to the uid
    scripts run as, with ``mode``. Returns the absolute path.

    An existing directory is re-owned and re-moded; a symlink or non-directory
    at ``path`` is refused (``OSError``: ELOOP or ENOTDIR). Directories above
    it must be searchable by that uid; this is not checked.
    """
    p = Path(os.path.abspath(os.fspath(path)))
    if uid is None or gid is None:
        su, sg = script_identity(run_as)
        uid = su if uid is None else uid
        gid = sg if gid is None else gid
    p.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_uid != uid or os.fstat(fd).st_gid != gid:
            os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return p
