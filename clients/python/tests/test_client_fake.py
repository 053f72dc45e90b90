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
