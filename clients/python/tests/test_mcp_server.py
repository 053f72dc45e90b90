"""`scriptgate mcp` driven by the official MCP Python SDK's client over stdio: the
run_script tool and its description, 200 calls through call_many with progress,
the summary text and structuredContent, one declared write approved through
elicitation and the next denied, a client that cannot be asked, --mode auto,
--passthrough, and a cancelled call that cancels its script. The upstream server
is examples/fleet/fleet_server.py (Python, stdio)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, List, Optional

import pytest

mcp = pytest.importorskip("mcp", reason="the mcp SDK (Python 3.10+) is not installed in the test venv")
from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402
import mcp.types as types  # noqa: E402

from conftest import REPO, Daemon  # noqa: E402

SCRIPTGATE = Path(os.environ.get("SCRIPTGATE") or REPO / "target" / "debug" / "scriptgate")
FLEET = f"fleet=python3 {REPO / 'examples' / 'fleet' / 'fleet_server.py'}"
REBOOT = "import agent_tools\nprint(agent_tools.call('fleet__reboot_device', {'sn': 'SN0001'}))\n"

pytestmark = pytest.mark.skipif(not SCRIPTGATE.exists(), reason=f"no {SCRIPTGATE}: run cargo build")


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


@asynccontextmanager
async def session(*extra: str, elicitation: Any = None) -> AsyncIterator[ClientSession]:
    where = [] if "--socket" in extra else ["--embedded"]
    params = StdioServerParameters(command=str(SCRIPTGATE), args=["mcp", *where, "--mcp", FLEET, *extra])
    async with stdio_client(params) as (r, w):
        async with ClientSession(r, w, elicitation_callback=elicitation) as s:
            await s.initialize()
            yield s


def text_of(res: types.CallToolResult) -> str:
    return "".join(c.text for c in res.content if isinstance(c, types.TextContent))


def test_run_script_makes_200_calls_with_progress_and_returns_the_summary() -> None:
    async def go() -> None:
        async with session() as s:
            listed = (await s.list_tools()).tools
            assert [t.name for t in listed] == ["run_script"]
            tool = listed[0]
            # The describe text, with the never-callable tools named.
            assert "import agent_tools" in tool.description
            assert "tools.fleet.get_device_status(" in tool.description, "the typed API first"
            assert "fleet__get_device_status" in tool.description and "fleet__wipe_device" in tool.description
            assert tool.input_schema["required"] == ["code"]
            assert "not offered here" in tool.description, "scriptgate mcp offers no never-callable tool"
            assert tool.output_schema["required"] == ["status"]
            seen: List[tuple] = []

            async def progress(value: float, total: Optional[float], message: Optional[str]) -> None:
                seen.append((value, total, message))

            # 100 through call_many, 100 through the typed API.
            code = (
                "import agent_tools\n"
                "from agent_tools import tools\n"
                "agent_tools.progress(0, 200, 'checking')\n"
                "got = agent_tools.call_many('fleet__get_device_status', [{'sn': f'SN{i:04d}'} for i in range(100)])\n"
                "got += [tools.fleet.get_device_status(sn=f'SN{i:04d}') for i in range(100, 200)]\n"
                "print(sum(1 for d in got if d['online']), 'online of', len(got))\n"
            )
            res = await s.call_tool("run_script", {"code": code, "description": "count online devices"},
                                    progress_callback=progress)
            text = text_of(res)
            assert res.is_error is False, text
            first = text.splitlines()[0]
            assert first.startswith("run_script ok: 200 calls, 0 failed, "), text
            assert "details in .agent/scripts/" in first
            assert "online of 200" in text
            sc = res.structured_content
            assert (sc["status"], sc["calls"], sc["failures"], sc["exit_code"]) == ("ok", 200, 0, 0), sc
            # At least the final state, which came before the result; values only grow.
            assert seen, "no progress"
            assert seen[-1][2] == "ok: 200 calls, 0 failed", seen
            assert [v for v, _, _ in seen] == sorted(v for v, _, _ in seen), seen

    run(go())


def test_a_failing_script_is_an_error_result_with_its_error_tail() -> None:
    async def go() -> None:
        async with session() as s:
            res = await s.call_tool("run_script", {"code": "print('before')\n1/0\n", "description": "fails"})
            text = text_of(res)
            assert res.is_error is True
            assert text.startswith("run_script error: 0 calls"), text
            assert "before" in text and "ZeroDivisionError: division by zero" in text, text
            assert res.structured_content["status"] == "error"

    run(go())


def test_one_declared_write_is_approved_through_elicitation_and_the_next_denied() -> None:
    asked: List[types.ElicitRequestParams] = []

    async def elicit(_ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        if len(asked) == 1:
            return types.ElicitResult(action="accept", content={"allow": True})
        return types.ElicitResult(action="decline")

    async def go() -> None:
        async with session(elicitation=elicit) as s:
            args = {"code": REBOOT, "tools": ["fleet__reboot_device"], "description": "reboot SN0001"}
            ok = await s.call_tool("run_script", args)
            assert ok.is_error is False, text_of(ok)
            assert ok.structured_content["calls"] == 1
            assert "SN0001" in text_of(ok)
            denied = await s.call_tool("run_script", args)
            assert denied.is_error is True
            assert denied.structured_content["status"] == "refused", denied.structured_content
            assert "denied" in text_of(denied).lower(), text_of(denied)

    run(go())
    assert len(asked) == 2
    # The user sees the tools, what the script is for, and the script itself.
    message = asked[0].message
    assert "fleet__reboot_device (write)" in message and "reboot SN0001" in message, message
    assert "agent_tools.call('fleet__reboot_device'" in message, message
    assert asked[0].requested_schema["properties"]["allow"]["type"] == "boolean"


def test_a_client_that_cannot_be_asked_is_denied_and_told_how_to_allow_writes() -> None:
    async def go() -> None:
        async with session() as s:
            res = await s.call_tool("run_script", {"code": REBOOT, "tools": ["fleet__reboot_device"],
                                                   "description": "reboot SN0001"})
            assert res.is_error is True
            assert "cannot be asked" in text_of(res) and "--mode auto" in text_of(res), text_of(res)

    run(go())


def test_mode_auto_allows_declared_writes_without_asking() -> None:
    async def never(_ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        raise AssertionError(f"asked: {params.message}")

    async def go() -> None:
        async with session("--mode", "auto", elicitation=never) as s:
            res = await s.call_tool("run_script", {"code": REBOOT, "tools": ["fleet__reboot_device"],
                                                   "description": "reboot SN0001"})
            assert res.is_error is False, text_of(res)

    run(go())


def test_passthrough_offers_the_callable_upstream_tools_directly() -> None:
    async def go() -> None:
        async with session("--passthrough") as s:
            names = [t.name for t in (await s.list_tools()).tools]
            assert names[0] == "run_script"
            assert {"fleet__list_devices", "fleet__get_device_status", "fleet__reboot_device"} <= set(names), names
            assert "fleet__wipe_device" not in names, "destructive tools are never offered"
            res = await s.call_tool("fleet__get_device_status", {"sn": "SN0002"})
            assert res.is_error is False
            assert res.structured_content["sn"] == "SN0002"
            with pytest.raises(Exception, match="no tool"):
                await s.call_tool("fleet__wipe_device", {"sn": "SN0002"})

    run(go())


def test_a_cancelled_call_cancels_its_script(daemon: Daemon) -> None:
    """Through a daemon over its socket: the audit row says cancelled."""
    started = asyncio.Event

    async def go() -> str:
        up = started()

        async def progress(_v: float, _t: Optional[float], message: Optional[str]) -> None:
            up.set()

        async with session("--socket", str(daemon.socket), "--config", str(daemon.config)) as s:
            code = "import agent_tools, time\nagent_tools.progress(1, 2, 'waiting')\ntime.sleep(600)\n"
            call = asyncio.ensure_future(
                s.call_tool("run_script", {"code": code, "description": "wait forever"}, progress_callback=progress))
            await asyncio.wait_for(up.wait(), 60)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # The script's row: cancelled, once the sandbox is gone.
            for _ in range(300):
                rows = audit(daemon)
                mine = [r for r in rows if r.get("description") == "wait forever"]
                if mine and mine[0]["status"] != "running":
                    return mine[0]["status"]
                await asyncio.sleep(0.1)
            return "still running"

    assert run(go()) == "cancelled"


def audit(daemon: Daemon) -> List[dict]:
    out = subprocess.run([str(SCRIPTGATE), "audit", "--json", "--config", str(daemon.config), "--socket",
                          str(daemon.socket)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    return got if isinstance(got, list) else got.get("scripts", [])


# An upstream MCP server whose one read tool never answers: it writes the id of each
# tools/call, and each notifications/cancelled, to the file named by its argument
# (shared with tests/it/cli.rs).
SLOW_SERVER = REPO / "tests" / "fixtures" / "slow_mcp_server.py"


def test_a_cancelled_call_cancels_the_upstream_call_in_flight(tmp_path: Path) -> None:
    server, seen = SLOW_SERVER, tmp_path / "seen"
    seen.touch()

    async def lines(prefix: str) -> List[str]:
        for _ in range(300):
            got = [line for line in seen.read_text().splitlines() if line.startswith(prefix)]
            if got:
                return got
            await asyncio.sleep(0.05)
        return []

    async def go() -> None:
        params = StdioServerParameters(command=str(SCRIPTGATE), args=[
            "mcp", "--embedded", "--mcp", f"slow=python3 {server} {seen}"])
        async with stdio_client(params) as (r, w):
            async with ClientSession(r, w) as s:
                await s.initialize()
                code = "import agent_tools\nagent_tools.call('slow__slow', {})\n"
                call = asyncio.ensure_future(s.call_tool("run_script", {"code": code, "description": "slow"}))
                calls = await lines("call ")
                assert calls, "the upstream call never came"
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                cancelled = await lines("cancelled ")
                assert cancelled == ["cancelled " + calls[0].split()[1]], seen.read_text()
                # The session goes on.
                after = await s.call_tool("run_script", {"code": "print('after')", "description": "after"})
                assert "after" in text_of(after)

    run(go())


# An upstream whose tool `grow` adds a tool `extra` and says its list changed.
GROWING_SERVER = r'''
import json, sys
tools = [{"name": "grow", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}]
def send(m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    msg = json.loads(line)
    m = msg.get("method")
    if "id" not in msg:
        continue
    res = {}
    if m == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {"listChanged": True}},
               "serverInfo": {"name": "growing", "version": "1"}}
    elif m == "tools/list":
        res = {"tools": tools}
    elif m == "tools/call":
        tools.append({"name": "extra", "description": "added later", "inputSchema": {"type": "object"},
                      "annotations": {"readOnlyHint": True}})
        res = {"content": [{"type": "text", "text": "grown"}]}
        send({"jsonrpc": "2.0", "id": msg["id"], "result": res})
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        continue
    send({"jsonrpc": "2.0", "id": msg["id"], "result": res})
'''


def test_an_upstream_tool_list_change_refreshes_run_script_and_tells_the_client(tmp_path: Path) -> None:
    server = tmp_path / "growing.py"
    server.write_text(GROWING_SERVER)
    changed = asyncio.Event

    async def go() -> None:
        told = changed()

        async def on_message(message: Any) -> None:
            if isinstance(message, types.ToolListChangedNotification):
                told.set()

        params = StdioServerParameters(command=str(SCRIPTGATE), args=["mcp", "--embedded", "--passthrough",
                                                                      "--mcp", f"up=python3 {server}"])
        async with stdio_client(params) as (r, w):
            async with ClientSession(r, w, message_handler=on_message) as s:
                await s.initialize()
                before = (await s.list_tools()).tools
                assert "up__extra" not in before[0].description
                res = await s.call_tool("run_script", {"code": "import agent_tools\nagent_tools.call('up__grow', {})\n",
                                                       "description": "grow"})
                assert res.is_error is False, text_of(res)
                await asyncio.wait_for(told.wait(), 30)
                after = (await s.list_tools()).tools
                assert "up__extra" in after[0].description, after[0].description
                assert "up__extra" in [t.name for t in after], "passthrough lists it too"
                # And scripts may call it.
                res = await s.call_tool("run_script", {"code": "import agent_tools\nagent_tools.call('up__extra', {})\n",
                                                       "description": "extra"})
                assert res.is_error is False, text_of(res)

    run(go())


# An upstream whose tool `meet` answers nobody until three calls are waiting.
BARRIER_SERVER = r'''
import json, sys
waiting = []
def send(m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    msg = json.loads(line)
    m = msg.get("method")
    if "id" not in msg:
        continue
    if m == "tools/call":
        waiting.append(msg["id"])
        if len(waiting) == 3:
            for i in waiting:
                send({"jsonrpc": "2.0", "id": i, "result": {"content": [{"type": "text", "text": "met"}]}})
        continue
    res = {}
    if m == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "b", "version": "1"}}
    elif m == "tools/list":
        res = {"tools": [{"name": "meet", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}]}
    send({"jsonrpc": "2.0", "id": msg["id"], "result": res})
'''


def test_scripts_of_one_client_run_at_once(tmp_path: Path) -> None:
    """Three scripts each wait at an upstream barrier that opens only when all
    three are there: run one at a time, the first would never end."""
    server = tmp_path / "barrier.py"
    server.write_text(BARRIER_SERVER)

    async def go() -> list:
        params = StdioServerParameters(command=str(SCRIPTGATE), args=["mcp", "--embedded", "--mcp", f"b=python3 {server}"])
        async with stdio_client(params) as (r, w):
            async with ClientSession(r, w) as s:
                await s.initialize()
                code = "import agent_tools\nprint(agent_tools.call('b__meet', {}))\n"
                return await asyncio.wait_for(asyncio.gather(*[
                    s.call_tool("run_script", {"code": code, "description": f"meet {i}"}) for i in range(3)]), 60)

    results = run(go())
    assert [text_of(r).splitlines()[1] for r in results] == ["met"] * 3, [text_of(r) for r in results]


def embedded_audit(tmp_path: Path) -> List[dict]:
    """The embedded daemon's records (scriptgate(1), WHICH DAEMON)."""
    state = "/var/lib/scriptgate/cli" if os.geteuid() == 0 else os.path.expanduser("~/.local/state/scriptgate")
    config = tmp_path / "audit.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    out = subprocess.run([str(SCRIPTGATE), "audit", "--json", "--config", str(config), "--socket", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    return got if isinstance(got, list) else got.get("scripts", [])


def test_a_client_that_goes_away_leaves_its_scripts_cancelled_and_recorded(tmp_path: Path) -> None:
    """Raw JSON-RPC lines, so that the client closes stdin without a cancel."""
    description = f"left-{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen([str(SCRIPTGATE), "mcp", "--embedded", "--mcp", FLEET], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdin and p.stdout

    def send(m: dict) -> None:
        p.stdin.write(json.dumps(m) + "\n")
        p.stdin.flush()

    send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
    assert json.loads(p.stdout.readline())["id"] == 1
    send({"jsonrpc": "2.0", "method": "notifications/initialized"})
    code = "import agent_tools, time\nagent_tools.progress(1, 2, 'waiting')\ntime.sleep(600)\n"
    send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "run_script", "arguments": {"code": code, "description": description}, "_meta": {"progressToken": "t"}}})
    # The script runs once its progress comes.
    while json.loads(p.stdout.readline()).get("method") != "notifications/progress":
        pass
    p.stdin.close()
    assert p.wait(timeout=60) == 0
    mine = [r for r in embedded_audit(tmp_path) if r.get("description") == description]
    assert [r["status"] for r in mine] == ["cancelled"], mine


def sandbox_starts(config: Path) -> dict:
    """scriptgate_sandbox_starts_total by start (pre_made, cold) from a store."""
    out = subprocess.run([str(SCRIPTGATE), "metrics", "--config", str(config)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    found = {"pre_made": 0, "cold": 0}
    for line in out.stdout.splitlines():
        for start in found:
            if line.startswith(f'scriptgate_sandbox_starts_total{{start="{start}"}} '):
                found[start] = int(line.split()[-1])
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: only a root embedded daemon keeps pre-made sandboxes")
def test_as_root_scripts_run_in_pre_made_sandboxes_and_a_one_shot_run_keeps_none(tmp_path: Path) -> None:
    """A root `scriptgate mcp` starts its own mount server, so its embedded daemon
    keeps the default pool: its scripts run pre-made (said in the store's counters),
    each in its own workspace; `scriptgate run --embedded`, one script per process,
    keeps none (its script counts as neither)."""
    # The scripts' uid reaches the interpreter's copy kept in the state directory.
    state = Path(tempfile.mkdtemp(prefix="sg-pool-"))
    state.chmod(0o755)
    try:
        pooled_and_one_shot(tmp_path, state)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def pooled_and_one_shot(tmp_path: Path, state: Path) -> None:
    config = tmp_path / "scriptgate.toml"
    config.write_text(f'[state]\ndir = "{state}"\n')
    store = tmp_path / "store.toml"  # a root embedded daemon keeps its records in STATE/cli
    store.write_text(f'[state]\ndir = "{state / "cli"}"\n')
    code = "import os\nopen('mark', 'w').write(os.getcwd())\nprint('in', os.getcwd())\n"

    async def go() -> list:
        seen = []
        async with session("--config", str(config)) as s:
            # Members are made in the background from the start: the first calls
            # may come before one waits. Until one ran pre-made (or 20 calls).
            for i in range(20):
                res = await s.call_tool("run_script", {"code": code, "description": f"pooled {i}"})
                assert not res.is_error, text_of(res)
                seen.append(res.structured_content)
                if sandbox_starts(store)["pre_made"] > 0:
                    break
        return seen

    seen = run(go())
    counted = sandbox_starts(store)
    assert counted["pre_made"] >= 1 and counted["pre_made"] + counted["cold"] == len(seen), (counted, len(seen))
    workspaces = [s["workspace"] for s in seen]
    assert len(set(workspaces)) == len(seen), workspaces
    for s in seen:
        assert s["output"] == f"in {s['workspace']}\n", s
        assert (Path(s["workspace"]) / "mark").read_text() == s["workspace"]
    script = tmp_path / "one.py"
    script.write_text("print('one')\n")
    out = subprocess.run([str(SCRIPTGATE), "run", "--embedded", "--config", str(config), "--mcp", FLEET, str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sandbox_starts(store) == counted
