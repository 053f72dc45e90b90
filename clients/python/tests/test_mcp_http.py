"""`scriptgate mcp --http` is for the user who started it: every request needs its
bearer token (401 before anything is read, for another local user too, who cannot
read the token file), both protocol eras work with it (the official MCP Python
SDK's client), slow bodies and slow headers cannot hold the connection slots,
32 parallel 4 MiB requests stay under the documented memory bound, a dropped
connection cancels its script (or leaves it to a re-issue where the request
declared tasks), and a `subscriptions/listen` names its accepted task ids.

Each test starts its own `scriptgate mcp --embedded --http 127.0.0.1:0` with a
state directory of its own (its records, its token file), over
examples/fleet/fleet_server.py. Raw HTTP (http.client, sockets) where an attack
needs it."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from conftest import REPO

SCRIPTGATE = Path(os.environ.get("SCRIPTGATE") or REPO / "target" / "debug" / "scriptgate")
FLEET = f"fleet=python3 {REPO / 'examples' / 'fleet' / 'fleet_server.py'}"
MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
# The bounds of scriptgate(1), --http.
MAX_OWN_CONNECTIONS = 64
MAX_OTHER_CONNECTIONS = 8
BODY_TIMEOUT = 20
HEADER_TIMEOUT = 10
# What requests may add to the process at its peak: the 96 MiB the requests in
# flight may hold, and 64 KiB for each connection (scriptgate(1), --http).
MEMORY_BOUND_MIB = 100

pytestmark = pytest.mark.skipif(not SCRIPTGATE.exists(), reason=f"no {SCRIPTGATE}: run cargo build")


class Server:
    """`scriptgate mcp --http` as this test's child, with its own state directory."""

    def __init__(self, *extra: str, home: Optional[Path] = None) -> None:
        self.home = home or Path(tempfile.mkdtemp(prefix="sg-http-"))
        # Others may traverse it (scripts run as nobody when this is root): what
        # keeps them from the token is the token file's own mode and directory.
        os.chmod(self.home, 0o755)
        self.config = self.home / "scriptgate.toml"
        self.config.write_text(f'[state]\ndir = "{self.home / "state"}"\n')
        self.log = self.home / "mcp.log"
        self.proc = subprocess.Popen(
            [str(SCRIPTGATE), "mcp", "--embedded", "--config", str(self.config), "--http", "127.0.0.1:0",
             "--mcp", FLEET, *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert self.proc.stderr
        err = b""
        self.port = 0
        self.token = ""
        while not self.token:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"scriptgate mcp exited {self.proc.wait()}: {err.decode(errors='replace')}")
            err += line
            m = re.search(rb"Streamable HTTP at http://127\.0\.0\.1:(\d+)/mcp", line)
            if m:
                self.port = int(m.group(1))
            m = re.search(rb'"Authorization: Bearer ([^"\s]+)" \(the token is in (.+), kept across restarts\)', line)
            if m:
                self.token = m.group(1).decode()
                self.token_file = Path(m.group(2).decode())
        # The line after: a client's entry.
        self.banner = (err + self.proc.stderr.readline()).decode()
        # The rest of stderr, kept so that the pipe never fills.
        self.stderr: List[bytes] = []
        threading.Thread(target=lambda: self.stderr.extend(iter(self.proc.stderr.readline, b"")), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}/mcp"

    def auth(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def peak_reset(self) -> int:
        """Reset the process's peak RSS (Linux: clear_refs 5) and answer its RSS in KiB."""
        with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
            f.write("5")
        return self.vm("VmRSS")

    def vm(self, key: str) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(rf"{key}:\s+(\d+) kB", status).group(1))

    def records(self) -> List[dict]:
        out = subprocess.run([str(SCRIPTGATE), "audit", "--embedded", "--json", "--limit", "1000",
                              "--config", str(self.config)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        return got if isinstance(got, list) else got.get("scripts", [])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def server(*extra: str, home: Optional[Path] = None, keep: bool = False) -> Iterator[Server]:
    s = Server(*extra, home=home)
    try:
        yield s
    finally:
        s.stop()
        if not keep:
            shutil.rmtree(s.home, ignore_errors=True)


def init_body(i: int = 1) -> dict:
    return {"jsonrpc": "2.0", "id": i, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}}


def post(s: Server, body: Any, headers: Optional[Dict[str, str]] = None,
         timeout: float = 60) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST `body` (JSON) to the endpoint; the response unread."""
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=timeout)
    h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    h.update(headers or {})
    c.request("POST", "/mcp", body if isinstance(body, bytes) else json.dumps(body).encode(), h)
    return c, c.getresponse()


def modern(s: Server, method: str, params: dict, i: int = 1, name: Optional[str] = None,
           caps: Optional[dict] = None) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A 2026-07-28 request (no session; its version and capabilities in `_meta`)."""
    params = dict(params, _meta=dict(params.get("_meta", {}), **{
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": caps or {},
        "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"}}))
    h = dict(s.auth(), **{"MCP-Protocol-Version": MODERN, "Mcp-Method": method})
    if name:
        h["Mcp-Name"] = name
    return post(s, {"jsonrpc": "2.0", "id": i, "method": method, "params": params}, h)


def events(r: http.client.HTTPResponse) -> Iterator[dict]:
    """The JSON-RPC messages of an SSE response, as they come."""
    while True:
        line = r.readline()
        if not line:
            return
        if line.startswith(b"data:") and line[5:].strip():
            yield json.loads(line[5:])


def legacy_session(s: Server) -> str:
    c, r = post(s, init_body(), s.auth())
    assert r.status == 200, r.read()
    sid = r.getheader("mcp-session-id")
    r.read()
    c.close()
    c, r = post(s, {"jsonrpc": "2.0", "method": "notifications/initialized"}, dict(s.auth(), **{"mcp-session-id": sid}))
    assert r.status == 202, r.read()
    c.close()
    return sid


def wait_for(what: str, check: Any, limit: float) -> float:
    """Poll `check` until true; the seconds it took. Fails past `limit`."""
    t = time.monotonic()
    while not check():
        assert time.monotonic() - t < limit, f"{what}: not within {limit} s"
        time.sleep(0.05)
    return time.monotonic() - t


def as_nobody(code: str, **kw: Any) -> subprocess.Popen:
    """`code` in the system's python3, as the user nobody."""
    if os.geteuid() != 0:
        pytest.skip("needs root: runs another local user's client as nobody")
    nobody = pwd.getpwnam("nobody")
    return subprocess.Popen(["/usr/bin/python3", "-c", code], user=nobody.pw_uid, group=nobody.pw_gid,
                            extra_groups=[], cwd="/", text=True, **kw)


def test_without_the_token_every_request_is_refused_before_it_is_read_and_nothing_runs() -> None:
    with server() as s:
        code = {"name": "run_script", "arguments": {"code": "print('ran')", "description": "unauthorized"}}
        refused = [
            {},
            {"Authorization": "Bearer " + "0" * len(s.token)},
            {"Authorization": "Bearer " + s.token[:-1]},
            {"Authorization": s.token},
            {"Authorization": "Basic " + s.token},
        ]
        for h in refused:
            for body in [init_body(), {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": code}]:
                c, r = post(s, body, h)
                assert r.status == 401, (h, r.status)
                assert r.getheader("www-authenticate", "").startswith("Bearer"), r.getheaders()
                assert b"bearer token" in r.read()
                c.close()
        # A 2026-07-28 call, a GET and a DELETE: the same.
        c, r = post(s, {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": dict(code, _meta={
            "io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {}})},
            {"MCP-Protocol-Version": MODERN, "Mcp-Method": "tools/call", "Mcp-Name": "run_script"})
        assert r.status == 401
        c.close()
        for method in ["GET", "DELETE"]:
            c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            c.request(method, "/mcp", headers={"Accept": "text/event-stream", "mcp-session-id": "x"})
            assert c.getresponse().status == 401, method
            c.close()
        # The answer comes before the body: headers that announce 4 MiB, and no body.
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw:
            raw.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nContent-Type: application/json\r\n"
                        f"Accept: application/json, text/event-stream\r\nContent-Length: {4 << 20}\r\n\r\n".encode())
            assert raw.recv(64).startswith(b"HTTP/1.1 401 "), "answered without the body"
        # Two Authorization headers, one of them right: refused.
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw:
            body = json.dumps(init_body()).encode()
            raw.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nAuthorization: Bearer {s.token}\r\n"
                        f"Authorization: Bearer x\r\nContent-Type: application/json\r\n"
                        f"Accept: application/json, text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                        + body)
            assert raw.recv(64).startswith(b"HTTP/1.1 401 ")
        assert s.records() == [], "nothing ran"
        # With the token (the scheme in any case), served.
        c, r = post(s, init_body(), {"Authorization": f"bearer {s.token}"})
        assert r.status == 200, r.read()
        c.close()
        # The token file: the user's own, 0600; the banner says where, with a
        # client's entry.
        assert s.token_file == s.home / "state" / "cli" / "mcp-http.token"
        assert s.token_file.read_text().strip() == s.token
        assert s.token_file.stat().st_mode & 0o777 == 0o600
        snippet = json.loads(next(l for l in s.banner.splitlines() if l.startswith("  {")))
        assert snippet["scriptgate"]["url"] == s.url, snippet
        assert snippet["scriptgate"]["headers"] == {"Authorization": f"Bearer {s.token}"}, snippet


def test_another_local_user_gets_401_and_cannot_read_the_token_file() -> None:
    with server() as s:
        guess = "0" * len(s.token)
        code = f"""
import http.client, json
out = {{}}
try:
    open({str(s.token_file)!r}).read()
    out["read"] = "read it"
except OSError as e:
    out["read"] = e.errno
for name, h in [("none", {{}}), ("guess", {{"Authorization": "Bearer {guess}"}})]:
    c = http.client.HTTPConnection("127.0.0.1", {s.port}, timeout=30)
    body = json.dumps({{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {{"name": "run_script",
        "arguments": {{"code": "print(1)", "description": "nobody's"}}}}}})
    c.request("POST", "/mcp", body, dict(h, **{{"Content-Type": "application/json",
        "Accept": "application/json, text/event-stream"}}))
    out[name] = c.getresponse().status
print(json.dumps(out))
"""
        p = as_nobody(code, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        import errno
        assert json.loads(out) == {"read": errno.EACCES, "none": 401, "guess": 401}, out
        assert s.records() == [], "nothing ran"


def test_with_the_token_both_eras_work_through_the_sdk() -> None:
    pytest.importorskip("mcp", reason="the mcp SDK (Python 3.10+) is not installed in the test venv")
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def go(s: Server, mode: str) -> Tuple[str, str, List[str]]:
        async with httpx2.AsyncClient(headers=s.auth(), timeout=httpx2.Timeout(60, read=120)) as h:
            async with Client(streamable_http_client(s.url, http_client=h), mode=mode) as c:
                tools = [t.name for t in (await c.list_tools()).tools]
                r = await c.call_tool("run_script", {
                    "code": "from agent_tools import tools\nprint(tools.fleet.get_device_status(sn='SN0001')['sn'])",
                    "description": f"era {mode}"})
                text = "".join(getattr(x, "text", "") for x in r.content)
                assert r.is_error is False, text
                return c.protocol_version, text, tools

    with server() as s:
        modern_version, text, tools = asyncio.run(asyncio.wait_for(go(s, "auto"), 120))
        assert modern_version == MODERN
        assert tools == ["run_script"] and "SN0001" in text, text
        legacy_version, text, _ = asyncio.run(asyncio.wait_for(go(s, "legacy"), 120))
        assert legacy_version < MODERN, legacy_version
        assert "SN0001" in text, text
        assert sorted(r["status"] for r in s.records()) == ["ok", "ok"]
        # Without the token, the SDK's client gets nowhere.
        async def without() -> None:
            async with Client(s.url, mode="auto") as c:
                await c.list_tools()
        # Without the token, the SDK's client gets an error response (it does not
        # say which: 401) and nothing else.
        with pytest.raises(BaseException) as refused:
            asyncio.run(asyncio.wait_for(without(), 60))

        def leaves(e: BaseException) -> List[BaseException]:
            inner = getattr(e, "exceptions", None)
            return [x for i in inner for x in leaves(i)] if inner else [e]
        from mcp.shared.exceptions import MCPError
        assert all(isinstance(e, MCPError) and "error response" in str(e) for e in leaves(refused.value)), refused.value


def test_other_users_slow_headers_and_bodies_cannot_hold_the_slots() -> None:
    """Another user opens 4 times as many connections as there are slots, half with
    complete headers (and no token) and a body trickled a byte a second, half with
    headers trickled: those with headers are answered 401 at once, and all are
    closed as newer ones come; meanwhile this user's requests are served at once."""
    with server() as s:
        n = 4 * MAX_OWN_CONNECTIONS
        code = f"""
import socket, sys, threading, json
port = {s.port}
conns = []
for i in range({n}):
    c = socket.create_connection(("127.0.0.1", port), timeout=30)
    if i % 2:
        c.sendall(f"POST /mcp HTTP/1.1\\r\\nHost: 127.0.0.1:{{port}}\\r\\nContent-Type: application/json\\r\\n"
                  f"Accept: application/json, text/event-stream\\r\\nContent-Length: 100000\\r\\n\\r\\n{{{{".encode())
    else:
        c.sendall(b"POST /mcp HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nX-Slow: ")
    conns.append(c)
stop = threading.Event()
def trickle():
    while not stop.wait(1):
        for c in conns:
            try:
                c.send(b"a")
            except OSError:
                pass
threading.Thread(target=trickle, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
stop.set()
got = {{"401": 0, "closed": 0, "open": 0}}
for c in conns:
    c.settimeout(0.2)
    try:
        d = c.recv(64)
        what = "401" if d.startswith(b"HTTP/1.1 401 ") else "closed" if d == b"" else repr(d)
    except socket.timeout:
        what = "open"
    except ConnectionResetError:
        what = "closed"
    got[what] = got.get(what, 0) + 1
print(json.dumps(got), flush=True)
"""
        p = as_nobody(code, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout and p.stdin
        assert p.stdout.readline() == "ready\n", p.stderr.read() if p.stderr else ""
        # This user, while the other one's connections are all open: served at once.
        for i in range(8):
            t = time.monotonic()
            c, r = post(s, init_body(i), s.auth(), timeout=HEADER_TIMEOUT)
            assert r.status == 200, r.read()
            c.close()
            assert time.monotonic() - t < 5, "served at once"
        p.stdin.write("\n")
        p.stdin.flush()
        got = json.loads(p.stdout.readline())
        p.wait(30)
        # Each was answered 401 (those with complete headers, before being
        # closed) or closed, but for at most the newest MAX_OTHER_CONNECTIONS.
        assert set(got) == {"401", "closed", "open"}, got
        assert got["open"] <= MAX_OTHER_CONNECTIONS, got
        assert got["401"] > 0, got


def test_slow_bodies_with_the_token_are_cut_at_the_deadline_and_free_their_slots() -> None:
    """All this user's slots taken by requests whose body (under 64 KiB: no share of
    the bytes in flight to wait for) trickles a byte every 5 s: each is answered
    408 once its body is BODY_TIMEOUT late, and the request that waited for a
    slot is then served."""
    with server() as s:
        head = (f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nAuthorization: Bearer {s.token}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Content-Length: 60000\r\n\r\n{{").encode()
        slow = []
        t0 = time.monotonic()
        for _ in range(MAX_OWN_CONNECTIONS):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=60)
            c.sendall(head)
            slow.append(c)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(5):
                for c in slow:
                    try:
                        c.send(b" ")
                    except OSError:
                        pass
        threading.Thread(target=trickle, daemon=True).start()
        try:
            # One more request: it waits for a slot.
            waited: Dict[str, Any] = {}

            def owner() -> None:
                c, r = post(s, init_body(), s.auth(), timeout=90)
                waited["status"], waited["at"] = r.status, time.monotonic() - t0
                c.close()
            th = threading.Thread(target=owner)
            th.start()
            answers = []
            for c in slow:
                answers.append(c.recv(64).split(b"\r\n")[0])
            cut = time.monotonic() - t0
            th.join(90)
        finally:
            stop.set()
            for c in slow:
                c.close()
        assert answers == [b"HTTP/1.1 408 Request Timeout"] * MAX_OWN_CONNECTIONS, set(answers)
        assert BODY_TIMEOUT - 1 <= cut <= BODY_TIMEOUT + HEADER_TIMEOUT, cut
        assert waited.get("status") == 200, waited
        assert waited["at"] >= BODY_TIMEOUT - 1, "it waited for a slot"


def test_32_parallel_4mib_requests_stay_under_the_memory_bound() -> None:
    """Tiny arrays (refused once read: too costly once parsed), and bodies of one
    large string and as many arrays as the cost bound lets through (parsed):
    either way the process's peak RSS grows by less than MEMORY_BOUND_MIB."""
    size = 4 * 1024 * 1024 - 1024
    head = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_script","arguments":{"code":"x","tools":['
    tail = b"]}}}"
    tiny = head + b",".join([b"[]"] * ((size - len(head) - len(tail)) // 3)) + tail
    k = 5000
    mixed = head + b'"' + b"y" * (size - len(head) - len(tail) - 3 * k - 3) + b'",' + b",".join([b"[]"] * k) + tail
    with server() as s:
        for body, ok in [(tiny, {413}), (mixed, {400})]:
            before = s.peak_reset()
            statuses: List[Any] = []

            def one() -> None:
                try:
                    c, r = post(s, body, s.auth(), timeout=120)
                    statuses.append(r.status)
                    r.read()
                    c.close()
                except OSError as e:
                    statuses.append(repr(e))
            threads = [threading.Thread(target=one) for _ in range(32)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            grown = (s.vm("VmHWM") - before) / 1024
            assert set(statuses) <= ok, statuses
            assert grown < MEMORY_BOUND_MIB, f"peak RSS grew by {grown:.0f} MiB"
            print(f"{len(body)} bytes x 32: peak RSS +{grown:.1f} MiB")
        # A body over 4 MiB: refused as soon as it says so, or, chunked, as it passes.
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as raw:
            raw.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nAuthorization: Bearer {s.token}\r\n"
                        f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                        f"Content-Length: {(4 << 20) + 1}\r\n\r\n".encode())
            assert raw.recv(64).startswith(b"HTTP/1.1 413 ")
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as raw:
            raw.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{s.port}\r\nAuthorization: Bearer {s.token}\r\n"
                        f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                        f"Transfer-Encoding: chunked\r\n\r\n".encode())
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            try:
                for _ in range(5):
                    raw.sendall(chunk)
            except OSError:
                pass  # closed once past the bound
            assert raw.recv(64).startswith(b"HTTP/1.1 413 ")
        # Then a small request is served.
        c, r = post(s, init_body(), s.auth())
        assert r.status == 200
        c.close()


def test_a_dropped_connection_cancels_its_script_or_leaves_a_tasks_to_its_reissue() -> None:
    code = "import agent_tools, time\nagent_tools.progress(1, 2, 'started')\ntime.sleep(600)\n"

    def status_of(s: Server, description: str) -> List[str]:
        return [r["status"] for r in s.records() if r.get("description") == description]

    with server() as s:
        # The handshake era: its session lives on, its connection closes.
        sid = legacy_session(s)
        c, r = post(s, {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "run_script", "arguments": {"code": code, "description": "legacy dropped"},
            "_meta": {"progressToken": "p"}}}, dict(s.auth(), **{"mcp-session-id": sid}))
        assert r.status == 200
        assert next(m for m in events(r) if m.get("method") == "notifications/progress")
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        took = wait_for("cancelled", lambda: status_of(s, "legacy dropped") == ["cancelled"], 10)
        assert took < 2.5, f"recorded cancelled {took:.1f} s after the connection closed"
        print(f"handshake era: recorded cancelled {took:.2f} s after its connection closed")
        # 2026-07-28 without tasks: the same.
        c, r = modern(s, "tools/call", {"name": "run_script", "arguments": {"code": code, "description": "modern dropped"},
                                        "_meta": {"progressToken": "p"}}, name="run_script")
        assert r.status == 200
        assert next(m for m in events(r) if m.get("method") == "notifications/progress")
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        took = wait_for("cancelled", lambda: status_of(s, "modern dropped") == ["cancelled"], 10)
        assert took < 2.5, took
        print(f"2026-07-28: recorded cancelled {took:.2f} s after its connection closed")
        # 2026-07-28 declaring tasks: the script runs on, and the same call again gets it.
        # The re-issue comes at once, often before the server has read the
        # hang-up on the first connection (CI once ran such a script twice):
        # several rounds, so that a regression shows.
        short = "import agent_tools, time\nagent_tools.progress(1, 2, 'started')\ntime.sleep(1)\nprint('finished')\n"
        caps = {"extensions": {TASKS: {}}}
        for n in range(6):
            call = {"name": "run_script", "arguments": {"code": short, "description": f"modern task {n}"},
                    "_meta": {"progressToken": "p"}}
            c, r = modern(s, "tools/call", call, name="run_script", caps=caps)
            assert next(m for m in events(r) if m.get("method") == "notifications/progress")
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
            c, r = modern(s, "tools/call", call, i=2, name="run_script", caps=caps)
            result = next(m for m in events(r) if m.get("id") == 2)["result"]
            c.close()
            assert "finished" in json.dumps(result), result
            assert status_of(s, f"modern task {n}") == ["ok"], f"round {n}: one script, not cancelled, not run twice"


def test_listen_names_the_accepted_task_ids_and_tasks_outlive_a_restart() -> None:
    home = Path(tempfile.mkdtemp(prefix="sg-http-"))
    token_file = home / "my.token"
    try:
        with server("--task-after", "0", "--token-file", str(token_file), home=home, keep=True) as s:
            assert s.token_file == token_file and token_file.read_text().strip() == s.token
            call = {"name": "run_script", "arguments": {"code": "import time\ntime.sleep(2)\nprint('done')",
                                                        "description": "a task"}}
            c, r = modern(s, "tools/call", call, name="run_script", caps={"extensions": {TASKS: {}}})
            handle = next(m for m in events(r) if m.get("id") == 1)["result"]
            c.close()
            assert handle["resultType"] == "task", handle
            task = handle["taskId"]
            altered = task[:-2] + ("AA" if not task.endswith("AA") else "BB")
            ids = {"notifications": {"taskIds": [task, altered, "made-up"]}}
            # Task ids need the tasks extension declared in the listen's own _meta.
            c, r = modern(s, "subscriptions/listen", ids, i=2)
            refused = json.loads(r.read())
            c.close()
            assert (r.status, refused["id"], refused["error"]["code"]) == (400, 2, -32021), refused
            c, r = modern(s, "subscriptions/listen", ids, i=2, caps={"extensions": {TASKS: {}}})
            assert r.status == 200
            got = events(r)
            ack = next(got)
            assert ack["method"] == "notifications/subscriptions/acknowledged", ack
            assert ack["params"]["notifications"]["taskIds"] == [task], ack
            done = next(m for m in got if m.get("method") == "notifications/tasks")
            c.close()
            assert done["params"]["taskId"] == task and done["params"]["status"] == "completed", done
            # A listen names at most 256 task ids: one past them is not taken.
            c, r = modern(s, "subscriptions/listen", {"notifications": {"taskIds": ["x"] * 256 + [task]}}, i=3,
                          caps={"extensions": {TASKS: {}}})
            ack = next(events(r))
            c.close()
            assert ack["params"]["notifications"]["taskIds"] == [], ack
        # Restarted with the same token file: the same principal, so the task is still its.
        with server("--token-file", str(token_file), home=home) as s:
            c, r = modern(s, "tasks/get", {"taskId": task}, name=task, caps={"extensions": {TASKS: {}}})
            m = next(events(r)) if r.getheader("content-type") == "text/event-stream" else json.loads(r.read())
            c.close()
            assert m.get("result", {}).get("status") == "completed", m
            assert "done" in json.dumps(m["result"]), m
    finally:
        shutil.rmtree(home, ignore_errors=True)
