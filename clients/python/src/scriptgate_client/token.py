"""Run tokens: HS256 JWTs (JWS compact) carrying the authorization snapshot."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from typing import Any, Dict, Optional, Union

from .types import SnapshotLike, as_snapshot

MIN_KEY_BYTES = 32


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def load_key(path: Union[str, "os.PathLike[str]"]) -> bytes:
    """The exact bytes of ``auth.token_key_file`` (the daemon uses them unchanged)."""
    with open(path, "rb") as f:
        key = f.read()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"{os.fspath(path)}: token key has {len(key)} bytes, needs {MIN_KEY_BYTES} or more")
    return key


def mint_token(
    key: Union[bytes, str],
    run_id: str,
    snapshot: SnapshotLike,
    ttl: int,
    runner: Optional[str] = None,
    *,
    now: Optional[int] = None,
) -> str:
    """Sign a run token for ``run_id`` that expires ``ttl`` seconds from now.

    ``snapshot`` is a ``Snapshot`` or a dict, which is checked first
    (``SnapshotError`` on unknown or missing fields).
    """
    if isinstance(key, str):
        key = key.encode("utf-8")
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the token key must be {MIN_KEY_BYTES} bytes or more")
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("run_id must be a non-empty string")
    if not isinstance(ttl, int) or isinstance(ttl, bool):
        raise ValueError("ttl must be an integer number of seconds")
    if runner is not None and not isinstance(runner, str):
        raise ValueError("runner must be a string")
    iat = int(time.time()) if now is None else int(now)
    claims: Dict[str, Any] = {
        "run_id": run_id,
        "iat": iat,
        "exp": iat + ttl,
        "snapshot": as_snapshot(snapshot).to_dict(),
    }
    if runner is not None:
        claims["runner"] = runner
    signing_input = _b64url(_json({"alg": "HS256", "typ": "JWT"})) + "." + _b64url(_json(claims))
    sig = hmac.new(bytes(key), signing_input.encode("ascii"), hashlib.sha256).digest()
    return signing_input + "." + _b64url(sig)
