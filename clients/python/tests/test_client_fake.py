"""The client's reader against a scripted fake daemon: concurrency, error answers, bounds."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from typing import Any, Awaitable, Callable, Dict, List

import pytest

from scriptgate_client import Client, ConnectionClosed, PeerNotAllowed, ProtocolError, ToolCall

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def with_fake(script: Script, client: Client, body: Callable[[Client], Awaitable[Any]]) -> Any:
    d = tempfile.mkdtemp(prefix="sg-fake-")
    path = os.path.join(d, "sock")
    server = await asyncio.start_unix_server(script, path)
    client.path = path
    try:
        async with client:
            return await asyncio.wait_for(body(client), 10)
    finally:
        server.close()
        await server.wait_closed()
        os.unlink(path)
        os.rmdir(d)


def send(w: asyncio.StreamWriter, msg: Dict[str, Any]) -> None:
    w.write((json.dumps(msg) + "\n").encode())


async def recv(r: asyncio.StreamReader) -> Dict[str, Any]:
    return json.loads(await r.readline())  # type: ignore[no-any-return]


def test_requests_from_the_daemon_are_served_concurrently() -> None:
    """approval.request arrives before script.start's answer, then a tool.call; the
    approval handler only decides once the tool call was answered, which a reader
    serving one request at a time could never do."""
    seen: List[Dict[str, Any]] = []
    ev: Dict[str, asyncio.Event] = {}  # made inside the loop (Python 3.9 binds it there)

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        start = await recv(r)
        assert start["method"] == "script.start" and start["id"] == 1
        # Our ids are independent of the client's: reuse 1.
        send(w, {"jsonrpc": "2.0", "id": 1, "method": "approval.request",
                 "params": {"script_id": "s1", "run_id": "r", "description": "d", "code": "c",
                            "tools": [{"name": "w", "class": "write"}]}})
        send(w, {"jsonrpc": "2.0", "id": 2, "method": "tool.call",
                 "params": {"script_id": "s1", "run_id": "r", "call_id": "1", "tool": "t", "arguments": {"a": 1}}})
        send(w, {"jsonrpc": "2.0", "id": 3, "method": "no.such"})
        for _ in range(3):
            seen.append(await recv(r))
        send(w, {"jsonrpc": "2.0", "method": "script.progress",
                 "params": {"script_id": "s1", "state": "running", "calls": 1, "failures": 0, "elapsed_ms": 5,
                            "progress": {"done": 1, "total": 2, "message": "half"}}})
        send(w, {"jsonrpc": "2.0", "id": 1, "result": {"script_id": "s1", "state": "running"}})
        await w.drain()
        await r.read()

    async def tool(call: ToolCall) -> Dict[str, Any]:
        await asyncio.sleep(0.05)
        ev["tool_done"].set()
        return {"content": [{"type": "text", "text": "x"}], "isError": False}

    async def approve(req: Any) -> str:
        await ev["tool_done"].wait()
        return "allow_once"

    progress: List[Any] = []
    client = Client(tool_handler=tool, approval_handler=approve, on_progress=progress.append)

    async def body(c: Client) -> str:
        ev["tool_done"] = asyncio.Event()
        started = await c.start("tok", "code", ["w"])
        while not progress:
            await asyncio.sleep(0.01)
        return started

    started = asyncio.run(with_fake(fake, client, body))
    assert (started.script_id, started.state) == ("s1", "running")
    by_id = {m["id"]: m for m in seen}
    assert by_id[2]["result"] == {"content": [{"type": "text", "text": "x"}], "isError": False}  # sent as returned
    assert by_id[1]["result"] == {"decision": "allow_once"}
    assert by_id[3]["error"]["code"] == -32601
    order = [m["id"] for m in seen]
    assert order.index(2) < order.index(1)  # the tool call was answered while the approval waited
    assert progress[0].progress.done == 1 and progress[0].progress.message == "half"


def test_handler_failures_become_error_answers() -> None:
    answers: List[Dict[str, Any]] = []

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for i, tool in enumerate(["raise", "nan", "list", "text"], 1):
            send(w, {"jsonrpc": "2.0", "id": i, "method": "tool.call",
                     "params": {"script_id": "s", "run_id": "r", "call_id": str(i), "tool": tool, "arguments": {}}})
        send(w, {"jsonrpc": "2.0", "id": 9, "method": "approval.request", "params": {"tools": []}})
        for _ in range(5):
            answers.append(await recv(r))
        await r.read()

    def tool(call: ToolCall) -> Any:
        if call.tool == "raise":
            raise RuntimeError("backend down")
        if call.tool == "nan":
            return {"text": "", "structured": float("nan"), "is_error": False}
        if call.tool == "list":
            return [1]
        return "plain text"

    async def body(c: Client) -> None:
        while len(answers) < 5:
            await asyncio.sleep(0.01)

    asyncio.run(with_fake(fake, Client(tool_handler=tool, approval_handler=lambda req: "maybe"), body))
    by_id = {a["id"]: a for a in answers}
    assert by_id[1]["error"] == {"code": -32000, "message": "RuntimeError: backend down"}
    assert by_id[2]["error"]["code"] == -32000  # not JSON: an error, not a lost answer
    assert by_id[3]["error"]["code"] == -32000
    assert by_id[4]["result"] == {"text": "plain text", "structured": None, "is_error": False}
    assert by_id[9]["error"]["code"] == -32000  # neither allow_once nor deny


def test_no_approval_handler_denies() -> None:
    got: List[Dict[str, Any]] = []

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, {"jsonrpc": "2.0", "id": 1, "method": "approval.request", "params": {"tools": []}})
        got.append(await recv(r))
        await r.read()

    async def body(c: Client) -> None:
        while not got:
            await asyncio.sleep(0.01)

    asyncio.run(with_fake(fake, Client(), body))
    assert got[0]["result"] == {"decision": "deny"}


def test_overlong_line_ends_the_connection() -> None:
    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await recv(r)
        w.write(b'{"jsonrpc":"2.0","id":1,"result":"' + b"x" * 5000 + b'"}\n')
        await w.drain()
        await r.read()

    async def body(c: Client) -> Any:
        with pytest.raises(ProtocolError):
            await c.info()
        with pytest.raises(ProtocolError):
            await c.info()  # the connection stays closed
        return c.closed

    assert asyncio.run(with_fake(fake, Client(max_line_bytes=1024), body)) is True


def test_peer_refusal_and_disconnect() -> None:
    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await recv(r)
        send(w, {"jsonrpc": "2.0", "id": None,
                 "error": {"code": -32001, "message": "peer not allowed", "data": {"reason": "peer_not_allowed"}}})
        w.close()

    async def body(c: Client) -> None:
        with pytest.raises(PeerNotAllowed) as e:
            await c.info()
        assert e.value.reason == "peer_not_allowed"

    asyncio.run(with_fake(fake, Client(), body))

    async def fake2(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await recv(r)
        w.close()

    async def body2(c: Client) -> None:
        with pytest.raises(ConnectionClosed):
            await c.status("x")

    asyncio.run(with_fake(fake2, Client(), body2))


# --- issue 20 -------------------------------------------------------------------------

import logging
import socket
import subprocess
import sys
import threading
import time

from scriptgate_client import (
    CallContext, CallProgress, ConnectFailed, ConnectionRefused, PermissionDenied, ScriptResult, ScriptStatus,
    ScriptgateError, SocketNotFound,
)


def tool_call(i: int, tool: str = "t", script_id: str = "s1") -> Dict[str, Any]:
    return {"jsonrpc": "2.0", "id": i, "method": "tool.call",
            "params": {"script_id": script_id, "run_id": "r", "call_id": str(i), "tool": tool, "arguments": {}}}


def cancelled(i: int, script_id: str = "s1") -> Dict[str, Any]:
    return {"jsonrpc": "2.0", "method": "tool.cancelled",
            "params": {"id": i, "script_id": script_id, "call_id": str(i), "reason": "cancelled",
                       "message": "cancelled by the engine"}}


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_tool_cancelled_cancels_the_handler(kind: str) -> None:
    """tool.cancelled: an async handler's task sees CancelledError, a plain one (in a
    thread) its ctx.cancelled event; the call is not answered; the next one is."""
    answers: List[Dict[str, Any]] = []
    seen: Dict[str, Any] = {}
    started = threading.Event()
    ev: Dict[str, asyncio.Event] = {}

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, tool_call(1, "long"))
        await w.drain()
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        send(w, cancelled(1))
        send(w, tool_call(2, "short"))
        await w.drain()
        answers.append(await recv(r))
        ev["answered"].set()
        await r.read()

    async def async_handler(call: ToolCall, ctx: CallContext) -> Any:
        if call.tool == "short":
            return "second"
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["how"] = ("CancelledError", ctx.cancel_reason, ctx.cancel_message, ctx.cancelled.is_set())
            raise
        return "too late"

    def sync_handler(call: ToolCall, ctx: CallContext) -> str:
        if call.tool == "short":
            return "second"
        started.set()
        set_ = ctx.cancelled.wait(10)
        seen["how"] = ("event", ctx.cancel_reason, ctx.cancel_message, set_)
        return "too late"

    async def body(c: Client) -> None:
        await ev["answered"].wait()
        while "how" not in seen:  # the sync handler's thread returns after the event
            await asyncio.sleep(0.01)

    async def main() -> None:
        ev["answered"] = asyncio.Event()
        handler = async_handler if kind == "async" else sync_handler
        await with_fake(fake, Client(tool_handler=handler), body)

    asyncio.run(main())
    how = "CancelledError" if kind == "async" else "event"
    assert seen["how"] == (how, "cancelled", "cancelled by the engine", True)
    assert [a["id"] for a in answers] == [2] and answers[0]["result"]["text"] == "second"


def test_sync_handlers_run_in_threads_one_arg_still_works() -> None:
    """Plain handlers run in threads (so they run at once, and the loop stays free);
    one-argument handlers get ctx as call.ctx."""
    answers: List[Dict[str, Any]] = []
    barrier = threading.Barrier(4, timeout=10)

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for i in range(1, 5):
            send(w, tool_call(i))
        for _ in range(4):
            answers.append(await recv(r))
        await r.read()

    def tool(call: ToolCall) -> str:
        assert isinstance(call.ctx, CallContext) and call.ctx.call_id == call.call_id
        barrier.wait()  # all four at once, or this times out
        return threading.current_thread().name

    async def body(c: Client) -> None:
        while len(answers) < 4:
            await asyncio.sleep(0.01)

    asyncio.run(with_fake(fake, Client(tool_handler=tool), body))
    assert sorted(a["id"] for a in answers) == [1, 2, 3, 4]
    assert all(a["result"]["text"].startswith("scriptgate-handler") for a in answers), answers


def test_malformed_answer_is_logged_and_named(caplog: Any) -> None:
    answers: List[Dict[str, Any]] = []

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, tool_call(1, "bad"))
        send(w, tool_call(2, "keyerror"))
        answers.extend([await recv(r), await recv(r)])
        await r.read()

    def my_handler(call: ToolCall) -> Any:
        if call.tool == "bad":
            return {"text": "x", "is_error": False, "foo": 1}
        return {}["nope"]

    async def body(c: Client) -> None:
        while len(answers) < 2:
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="scriptgate_client"):
        asyncio.run(with_fake(fake, Client(tool_handler=my_handler), body))
    by_id = {a["id"]: a["error"] for a in answers}
    assert by_id[1]["code"] == -32000
    assert "my_handler" in by_id[1]["message"] and "unknown field `foo`" in by_id[1]["message"]
    assert by_id[2] == {"code": -32000, "message": "KeyError: 'nope'"}
    errs = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("my_handler" in r.getMessage() and "unknown field `foo`" in r.getMessage() for r in errs)


def test_tool_timeout_cancels_the_handler() -> None:
    answers: List[Dict[str, Any]] = []
    seen: Dict[str, Any] = {}

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, tool_call(1, "slow"))
        answers.append(await recv(r))
        await r.read()

    async def slow(call: ToolCall, ctx: CallContext) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["cancelled"] = (ctx.cancel_reason, ctx.cancelled.is_set())
            raise
        return "never"

    async def body(c: Client) -> None:
        while not answers or "cancelled" not in seen:
            await asyncio.sleep(0.01)

    t0 = time.monotonic()
    asyncio.run(with_fake(fake, Client(tool_handler=slow, tool_timeout_s=0.2), body))
    assert time.monotonic() - t0 < 5
    err = answers[0]["error"]
    assert err["code"] == -32000 and "tool_timeout_s = 0.2" in err["message"] and "slow" in err["message"]
    assert seen["cancelled"] == ("timeout", True)


def test_approval_timeout_and_no_handler_deny_with_a_warning(caplog: Any) -> None:
    answers: List[Dict[str, Any]] = []

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, {"jsonrpc": "2.0", "id": 1, "method": "approval.request",
                 "params": {"script_id": "s9", "run_id": "r", "tools": [{"name": "w", "class": "write"}]}})
        answers.append(await recv(r))
        await r.read()

    async def never(req: Any) -> bool:
        await asyncio.sleep(30)
        return True

    async def body(c: Client) -> None:
        while not answers:
            await asyncio.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="scriptgate_client"):
        asyncio.run(with_fake(fake, Client(approval_handler=never, approval_timeout_s=0.2), body))
        assert answers.pop()["result"] == {"decision": "deny"}
        assert any("approval_timeout_s = 0.2" in r.getMessage() for r in caplog.records)
        asyncio.run(with_fake(fake, Client(), body))
        assert answers.pop()["result"] == {"decision": "deny"}
        assert any("no approval handler is registered" in r.getMessage() and "s9" in r.getMessage()
                   for r in caplog.records if r.levelno == logging.WARNING)


def test_progress_stream_in_order_with_handler_progress() -> None:
    """script.progress and the handler's ctx.progress (from its thread) in one stream,
    ending at script.finished; events before the stream was made are replayed."""
    ev: Dict[str, asyncio.Event] = {}
    status = {"script_id": "s1", "state": "running", "calls": 1, "failures": 0, "elapsed_ms": 5, "progress": None}
    result = {"script_id": "s1", "run_id": "r", "status": "ok", "text": "run_script ok"}

    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        send(w, {"jsonrpc": "2.0", "method": "script.progress", "params": status})
        send(w, tool_call(1, "fleet__x"))
        await recv(r)  # the call's answer: its progress was reported before it
        send(w, {"jsonrpc": "2.0", "method": "script.progress", "params": dict(status, calls=2)})
        send(w, {"jsonrpc": "2.0", "method": "script.finished", "params": result})
        await w.drain()
        await r.read()

    def tool(call: ToolCall, ctx: CallContext) -> str:
        ctx.progress(1, 2, "half")
        ctx.progress(2)
        return "done"

    async def body(c: Client) -> List[Any]:
        while not c._backlog.get("s1"):  # the first event came before anyone streams
            await asyncio.sleep(0.01)
        return [e async for e in c.progress("s1")]

    events = asyncio.run(with_fake(fake, Client(tool_handler=tool), body))
    assert [type(e) for e in events] == [ScriptStatus, CallProgress, CallProgress, ScriptStatus, ScriptResult]
    assert events[1] == CallProgress("s1", "1", "fleet__x", 1, 2, "half")
    assert events[2] == CallProgress("s1", "1", "fleet__x", 2, None, None)
    assert events[3].calls == 2 and events[4].text == "run_script ok"


def test_progress_stream_raises_when_the_connection_drops() -> None:
    async def fake(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await recv(r)
        w.close()

    async def body(c: Client) -> None:
        stream = c.progress("s1")
        with pytest.raises(ConnectionClosed) as e:
            await c.status("s1")
        assert c.path in str(e.value) and e.value.path == c.path
        with pytest.raises(ConnectionClosed):
            async for _ in stream:
                pass

    asyncio.run(with_fake(fake, Client(), body))


def test_connect_errors_are_typed_and_name_the_path(tmp_path: Any, monkeypatch: Any) -> None:
    missing = str(tmp_path / "nope.sock")
    with pytest.raises(SocketNotFound) as e:
        asyncio.run(Client(missing).connect())
    assert missing in str(e.value) and e.value.path == missing
    assert isinstance(e.value, ConnectFailed) and isinstance(e.value, ScriptgateError)
    assert isinstance(e.value, FileNotFoundError)  # what connect raised before: still caught

    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()  # a socket file nobody listens on
    with pytest.raises(ConnectionRefused) as e2:
        asyncio.run(Client(stale).connect())
    assert stale in str(e2.value) and isinstance(e2.value, ConnectionRefusedError)

    monkeypatch.setenv("SCRIPTGATE_SOCKET", missing)
    assert Client().path == missing
    monkeypatch.delenv("SCRIPTGATE_SOCKET")
    assert Client().path == "/run/scriptgate/scriptgate.sock"


def test_connect_permission_denied(tmp_path: Any) -> None:
    """A socket this user may not open: as root, checked in a child that runs as nobody."""
    d = tmp_path / "private"
    d.mkdir()
    path = str(d / "sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(1)
    os.chmod(path, 0o600)
    os.chmod(d, 0o755)
    code = f"""
import asyncio
from scriptgate_client import Client, PermissionDenied
try:
    asyncio.run(Client({path!r}).connect())
except PermissionDenied as e:
    assert isinstance(e, PermissionError) and {path!r} in str(e), e
    print("denied")
"""
    kw: Dict[str, Any] = {}
    if os.geteuid() == 0:
        import pwd
        nobody = pwd.getpwnam("nobody")
        kw["user"], kw["group"], kw["extra_groups"] = nobody.pw_uid, nobody.pw_gid, []
        os.chmod(tmp_path, 0o755)
    try:
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd="/", **kw)
        except PermissionError:
            pytest.skip(f"nobody may not run this interpreter ({sys.executable}), e.g. one under /root")
    finally:
        srv.close()
    assert p.stdout == "denied\n", p.stdout + p.stderr
