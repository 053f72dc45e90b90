"""Through the real daemon with a real MCP server (server-everything over stdio, driven
by the official mcp SDK): SDK results passed back as they are, snapshots from
tools/list, cancellation of a running MCP call, MCP progress in the progress stream,
and examples/mcp_gateway.py. Needs the issue-20 daemon (tool descriptions,
tool.cancelled, run.describe's tool)."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Dict, List, Optional

import pytest

mcp = pytest.importorskip("mcp", reason="the mcp SDK (Python 3.10+) is not installed in the test venv")
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

from scriptgate_client import (  # noqa: E402
    CallContext, CallProgress, Client, ScriptResult, Snapshot, Started, Tool, ToolCall, ToolClass, mint_token,
)

from conftest import KEY, REPO, Daemon  # noqa: E402

EVERYTHING = REPO / "tests" / "mcp" / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
LONG_TOOL = "everything__trigger-long-running-operation"

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or not EVERYTHING.exists(),
    reason="node or server-everything (tests/mcp/node_modules; tools/install-deps) is missing",
)


class SentLog:
    """The SDK's write stream to the server, recording when each cancel went out."""

    def __init__(self, inner: Any, cancels: List[float]) -> None:
        self._inner, self._cancels = inner, cancels

    async def send(self, msg: Any) -> None:
        if "notifications/cancelled" in repr(msg):
            self._cancels.append(time.monotonic())
        await self._inner.send(msg)

    async def __aenter__(self) -> "SentLog":
        await self._inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> Any:
        return await self._inner.__aexit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@asynccontextmanager
async def everything(cancels: Optional[List[float]] = None) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command="node", args=[str(EVERYTHING), "stdio"])
    async with stdio_client(params) as (r, w):
        async with ClientSession(r, SentLog(w, cancels) if cancels is not None else w) as session:
            yield session


async def snapshot_of(session: ClientSession, daemon: Daemon) -> Snapshot:
    tools = [Tool.from_mcp(t, "everything") for t in (await session.list_tools()).tools]
    return Snapshot(str(daemon.workspace()), "approval", tools)


def token(snap: Snapshot) -> str:
    return mint_token(KEY, f"run-{uuid.uuid4().hex[:8]}", snap, 600, runner="pytest")


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def mcp_handler(session: ClientSession, seen: Dict[str, Any]) -> Any:
    async def handler(call: ToolCall, ctx: CallContext) -> Any:
        name = call.tool.split("__", 1)[1]
        seen.setdefault("calls", []).append(call.tool)
        if call.tool == LONG_TOOL:
            seen["long_started"].set()
        try:
            return await session.call_tool(name, call.arguments, progress_callback=ctx.progress)  # as it is
        except asyncio.CancelledError:
            seen["aborted_at"] = time.monotonic()
            seen["abort_reason"] = (ctx.cancel_reason, ctx.cancel_message)
            seen["aborted"].set()
            raise
    return handler


def test_snapshot_from_tools_list_and_run_script_tool(daemon: Daemon) -> None:
    async def main() -> Any:
        async with everything() as session:
            snap = await snapshot_of(session, daemon)
            async with Client(daemon.socket) as sg:
                tok = token(snap)
                return snap, await sg.run_script_tool(tok), await sg.describe(tok)

    snap, tool, text = run(main())
    by_name = {t.name: t for t in snap.tools}
    assert by_name["everything__echo"].tool_class is ToolClass.READ
    assert by_name["everything__toggle-simulated-logging"].tool_class is ToolClass.WRITE
    assert by_name["everything__echo"].description == "Echoes back the input string"
    assert tool["name"] == "run_script" and tool["description"] == text
    assert tool["inputSchema"]["required"] == ["code"]
    assert set(tool["inputSchema"]["properties"]) == {"code", "tools", "description"}
    assert "Echoes back the input string" in text  # the description reaches the model


def test_sdk_result_and_mcp_progress_reach_the_stream(daemon: Daemon) -> None:
    code = f"""
import agent_tools
print(agent_tools.call({LONG_TOOL!r}, {{"duration": 0.4, "steps": 4}}))
print(agent_tools.call("everything__get-structured-content", {{"location": "New York"}}))
"""

    async def main() -> Any:
        async with everything() as session:
            seen: Dict[str, Any] = {"long_started": asyncio.Event(), "aborted": asyncio.Event()}
            snap = await snapshot_of(session, daemon)
            async with Client(daemon.socket, tool_handler=mcp_handler(session, seen)) as sg:
                started = await sg.start(token(snap), code, description="progress")
                assert isinstance(started, Started) and started.state == "running"
                return [ev async for ev in sg.progress(started)]

    events = run(main())
    result = events[-1]
    assert isinstance(result, ScriptResult) and result.status == "ok", result.text
    assert "Long running operation completed" in result.output
    assert "'conditions': 'Cloudy'" in result.output  # structuredContent came back as the structured result (a dict)
    mcp_progress = [e for e in events if isinstance(e, CallProgress)]
    assert [(e.progress, e.total) for e in mcp_progress] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert {e.tool for e in mcp_progress} == {LONG_TOOL} and all(e.script_id == result.script_id for e in mcp_progress)


def test_cancel_aborts_the_mcp_call(daemon: Daemon) -> None:
    """script.cancel while a tool handler awaits a long MCP call: tool.cancelled reaches
    the handler (CancelledError), the SDK sends notifications/cancelled to the server,
    and script.cancel answers at once (the old daemon: no tool.cancelled at all, and
    the answer after a 3 s grace)."""
    code = f'import agent_tools\nagent_tools.call({LONG_TOOL!r}, {{"duration": 60, "steps": 120}})\n'
    cancels: List[float] = []

    async def main() -> Dict[str, Any]:
        async with everything(cancels) as session:
            seen: Dict[str, Any] = {"long_started": asyncio.Event(), "aborted": asyncio.Event()}
            snap = await snapshot_of(session, daemon)
            async with Client(daemon.socket, tool_handler=mcp_handler(session, seen)) as sg:
                started = await sg.start(token(snap), code, description="a long one")
                stream = sg.progress(started)
                async for ev in stream:  # the server is at work: its first progress came back
                    if isinstance(ev, CallProgress):
                        break
                t0 = time.monotonic()
                ans = await sg.cancel(started)
                seen["cancel_answer_s"] = time.monotonic() - t0
                await asyncio.wait_for(seen["aborted"].wait(), 10)
                seen["abort_s"] = seen["aborted_at"] - t0
                seen["answer"], seen["result"] = ans, await sg.wait(started)
                seen["sdk_cancel_s"] = cancels[0] - t0 if cancels else None
                return seen

    seen = run(main())
    print(f"\ncancel -> handler CancelledError {seen['abort_s'] * 1000:.0f} ms; -> SDK notifications/cancelled "
          f"{(seen['sdk_cancel_s'] or 0) * 1000:.0f} ms; script.cancel answered in {seen['cancel_answer_s'] * 1000:.0f} ms")
    assert seen["answer"]["state"] == "cancelled" and seen["result"].status == "cancelled"
    assert seen["abort_reason"] == ("cancelled", "cancelled by the engine")
    assert seen["sdk_cancel_s"] is not None, "the SDK sent the server no notifications/cancelled"
    assert seen["abort_s"] < 1.0 and seen["sdk_cancel_s"] < 1.0
    assert seen["cancel_answer_s"] < 2.0


def test_mcp_gateway_example(daemon: Daemon) -> None:
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / "mcp_gateway.py"), str(daemon.socket), str(daemon.key_file),
         str(daemon.root), "node", str(EVERYTHING), "stdio"],
        capture_output=True, text=True, timeout=120,
    )
    out = p.stdout
    assert p.returncode == 0, out + p.stderr
    assert "approving ['everything__toggle-simulated-logging']" in out
    assert "run_script ok: 3 calls, 0 failed" in out and "Echo: hello" in out and "The sum of 2 and 3 is 5" in out
    assert f"MCP call {LONG_TOOL} aborted (cancelled: cancelled by the engine)" in out
    m = re.search(r"script.cancel answered in (\d+) ms; run_script cancelled", out)
    assert m, out
    print(f"\nmcp_gateway.py: script.cancel answered in {m.group(1)} ms")
    assert int(m.group(1)) < 2000
