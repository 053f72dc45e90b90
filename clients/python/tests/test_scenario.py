"""The fleet scenario, through the real daemon: an engine built on scriptgate_client
serves a script's tool calls, approves its write, and watches its progress."""

from __future__ import annotations

import asyncio
import re
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from scriptgate_client import (
    ApprovalError,
    ApprovalRequest,
    Client,
    Limits,
    ScriptgateError,
    ScriptResult,
    ScriptStatus,
    Snapshot,
    SnapshotError,
    StillRunning,
    TokenError,
    Tool,
    ToolCall,
    mint_token,
    prepare_workspace,
)

from conftest import KEY, REPO, Daemon

SN = {"type": "object", "properties": {"sn": {"type": "string"}}, "required": ["sn"]}
REBOOT = {"type": "object", "properties": {"sn": {"type": "string"}, "tenant": {"type": "string"}}, "required": ["sn"]}
DEVICES = {f"SN{i:03d}": {"sn": f"SN{i:03d}", "online": i % 10 != 0, "fw": "4.3.0" if i % 3 else "4.2.1"} for i in range(200)}


def fleet_snapshot(workspace: Path, mode: str = "approval", limits: Optional[Limits] = None) -> Snapshot:
    return Snapshot(
        workspace=str(workspace),
        permission_mode=mode,  # type: ignore[arg-type]
        tools=[
            Tool.read("fleet__get_device_status", SN),
            Tool.read("fleet__mcp_status", SN),
            Tool.read("fleet__mcp_fail", SN),
            Tool.read("fleet__bad_answer", SN),
            Tool.read("fleet__crash", SN),
            Tool.write("fleet__reboot_device", REBOOT, frozen={"tenant": "acme"}),
            Tool.destructive("fleet__wipe_device", SN),
        ],
        limits=limits,
    )


class Fleet:
    """The engine's side: tools over DEVICES, approvals, and what it saw."""

    def __init__(self, approve: Any = "allow_once") -> None:
        self.approve = approve
        self.calls: List[ToolCall] = []
        self.approvals: List[ApprovalRequest] = []
        self.progress: List[ScriptStatus] = []
        self.finished: List[ScriptResult] = []
        self.events: List[str] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def tool(self, call: ToolCall) -> Any:
        self.calls.append(call)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.005)
            dev = DEVICES.get(call.arguments.get("sn", ""))
            if call.tool == "fleet__get_device_status":
                return {"text": json.dumps(dev), "structured": dev, "is_error": dev is None}
            if call.tool == "fleet__reboot_device":
                return {"text": f"rebooted {call.arguments}", "structured": None, "is_error": False}
            if call.tool == "fleet__mcp_status":
                return {"content": [{"type": "text", "text": json.dumps(dev)}], "structuredContent": dev}
            if call.tool == "fleet__mcp_fail":
                return {"content": [{"type": "text", "text": f"{call.arguments['sn']} unreachable"}], "isError": True}
            if call.tool == "fleet__bad_answer":
                return {"foo": 1}
            if call.tool == "fleet__crash":
                raise RuntimeError("fleet backend down")
            raise KeyError(call.tool)
        finally:
            self.in_flight -= 1

    def approval(self, req: ApprovalRequest) -> Any:
        self.events.append("approval")
        self.approvals.append(req)
        return self.approve

    def on_progress(self, st: ScriptStatus) -> None:
        self.events.append("progress")
        self.progress.append(st)

    def on_finished(self, r: ScriptResult) -> None:
        self.events.append("finished")
        self.finished.append(r)

    def client(self, daemon: Daemon) -> Client:
        return Client(
            daemon.socket, tool_handler=self.tool, approval_handler=self.approval,
            on_progress=self.on_progress, on_finished=self.on_finished,
        )


def token(snapshot: Snapshot, run_id: str = "", key: bytes = KEY, ttl: int = 600) -> str:
    return mint_token(key, run_id or f"run-{uuid.uuid4().hex[:8]}", snapshot, ttl, runner="pytest")


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def settle(cond: Any, timeout: float = 5.0) -> None:
    """Wait until cond() holds (notifications are delivered by another task)."""
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def lines(r: ScriptResult) -> Dict[str, Any]:
    """The script prints `key json` lines."""
    out = {}
    for line in r.output.splitlines():
        k, _, v = line.partition(" ")
        out[k] = json.loads(v)
    return out


# --- the scenario ---------------------------------------------------------------------


def test_call_many_200_devices(daemon: Daemon) -> None:
    code = """
import agent_tools, json
sns = [f"SN{i:03d}" for i in range(200)]
res = agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in sns])
print("n", len(res))
print("order", json.dumps([r["sn"] for r in res] == sns))
print("offline", json.dumps(sorted(r["sn"] for r in res if not r["online"])))
"""
    fleet = Fleet()

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code, description="fleet census")

    r = run(main())
    assert r.status == "ok", r.text
    assert (r.calls, r.failures) == (200, 0)
    out = lines(r)
    assert out["n"] == 200 and out["order"] is True
    assert out["offline"] == [f"SN{i:03d}" for i in range(0, 200, 10)]
    assert sorted(c.arguments["sn"] for c in fleet.calls) == sorted(DEVICES)
    assert fleet.approvals == []  # reads need no approval
    assert fleet.max_in_flight > 1, "tool calls were not served concurrently"
    assert r.text.startswith("run_script ok: 200 calls, 0 failed")


def test_declared_write_approved_once(daemon: Daemon) -> None:
    code = """
import agent_tools, json
for sn in ["SN010", "SN020", "SN030"]:
    print("r" + sn, json.dumps(agent_tools.call("fleet__reboot_device", {"sn": sn})))
"""
    fleet = Fleet()
    order: List[str] = []

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            sid = await sg.start(token(fleet_snapshot(daemon.workspace())), code,
                                 tools=["fleet__reboot_device"], description="reboot the offline ones")
            order.extend(fleet.events)  # the approval came before start's answer
            return await sg.wait(sid)

    r = run(main())
    assert r.status == "ok", r.text
    assert order == ["approval"]
    assert len(fleet.approvals) == 1
    a = fleet.approvals[0]
    assert a.script_id == r.script_id and a.description == "reboot the offline ones"
    assert a.tools == [{"name": "fleet__reboot_device", "class": "write"}]
    assert "fleet__reboot_device" in a.code
    assert [c.arguments for c in fleet.calls] == [{"sn": s, "tenant": "acme"} for s in ("SN010", "SN020", "SN030")]
    assert r.calls == 3 and r.failures == 0


def test_declared_write_denied(daemon: Daemon) -> None:
    fleet = Fleet(approve=False)

    async def main() -> None:
        async with fleet.client(daemon) as sg:
            await sg.start(token(fleet_snapshot(daemon.workspace())), "print(1)", tools=["fleet__reboot_device"])

    with pytest.raises(ApprovalError) as e:
        run(main())
    assert e.value.code == -32013 and e.value.reason == "denied"
    assert len(fleet.approvals) == 1


def test_destructive_tool_refused(daemon: Daemon) -> None:
    code = """
import agent_tools
try:
    agent_tools.call("fleet__wipe_device", {"sn": "SN001"})
    print("wiped", 1)
except agent_tools.ToolError as e:
    print("code", '"' + e.code + '"')
"""
    fleet = Fleet()

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code)

    r = run(main())
    assert r.status == "ok", r.text
    assert lines(r) == {"code": "denied"}
    assert fleet.calls == []  # never reached the engine
    assert r.failures == 1


def test_progress_reaches_final_value(daemon: Daemon) -> None:
    code = """
import agent_tools
sns = [f"SN{i:03d}" for i in range(200)]
for k in range(0, 200, 50):
    agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in sns[k:k + 50]])
    agent_tools.progress(k + 50, 200, "devices checked")
"""
    fleet = Fleet()

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            r = await sg.run(token(fleet_snapshot(daemon.workspace())), code)
            await settle(lambda: bool(fleet.finished))
            return r

    r = run(main())
    assert r.status == "ok", r.text
    assert fleet.progress, "no script.progress at all"
    assert all(p.script_id == r.script_id for p in fleet.progress)
    last = fleet.progress[-1]
    assert last.progress is not None
    assert (last.progress.done, last.progress.total, last.progress.message) == (200, 200, "devices checked")
    assert last.calls == 200
    # The last progress comes before the finish.
    assert fleet.events[-2:] == ["progress", "finished"]
    assert fleet.finished[0].script_id == r.script_id


def test_mcp_shaped_results(daemon: Daemon) -> None:
    code = """
import agent_tools, json
print("ok", json.dumps(agent_tools.call("fleet__mcp_status", {"sn": "SN007"})))
raw = agent_tools.call_raw("fleet__mcp_status", {"sn": "SN008"})
print("raw", json.dumps(raw))
try:
    agent_tools.call("fleet__mcp_fail", {"sn": "SN009"})
    print("err", "null")
except agent_tools.ToolError as e:
    print("err", json.dumps([e.code, e.message]))
"""
    fleet = Fleet()

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code)

    r = run(main())
    assert r.status == "ok", r.text
    out = lines(r)
    assert out["ok"] == DEVICES["SN007"]
    assert out["raw"]["is_error"] is False and out["raw"]["structured"] == DEVICES["SN008"]
    assert json.loads(out["raw"]["text"]) == DEVICES["SN008"]  # the text content
    assert out["err"] == ["tool_error", "SN009 unreachable"]
    assert r.failures == 1


def test_malformed_tool_answer_is_engine_error(daemon: Daemon) -> None:
    code = """
import agent_tools, json
try:
    print("res", json.dumps(agent_tools.call("fleet__bad_answer", {"sn": "SN001"})))
except agent_tools.ToolError as e:
    print("code", json.dumps(e.code))
"""
    fleet = Fleet()

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code)

    r = run(main())
    assert r.status == "ok", r.text
    assert lines(r) == {"code": "engine"}
    assert r.failures == 1


def test_handler_exception_is_failed_call(daemon: Daemon) -> None:
    code = """
import agent_tools, json
try:
    agent_tools.call("fleet__crash", {"sn": "SN001"})
except agent_tools.ToolError as e:
    print("err", json.dumps([e.code, e.message]))
"""
    fleet = Fleet()

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code)

    r = run(main())
    assert r.status == "ok", r.text
    assert lines(r)["err"] == ["engine", "RuntimeError: fleet backend down"]


def test_timeout(daemon: Daemon) -> None:
    fleet = Fleet()
    snap = fleet_snapshot(daemon.workspace(), limits=Limits(timeout_s=1))

    async def main() -> ScriptResult:
        async with fleet.client(daemon) as sg:
            return await sg.run(token(snap), "import time\ntime.sleep(60)\n")

    t0 = time.monotonic()
    r = run(main())
    assert r.status == "timeout", r.text
    assert time.monotonic() - t0 < 20


def test_wait_still_running_then_cancel(daemon: Daemon) -> None:
    fleet = Fleet()

    async def main() -> Any:
        async with fleet.client(daemon) as sg:
            sid = await sg.start(token(fleet_snapshot(daemon.workspace())), "import time\ntime.sleep(60)\n")
            with pytest.raises(StillRunning) as e:
                await sg.wait(sid, timeout_s=0.2)
            assert e.value.code == -32017 and e.value.reason == "still_running"
            st = await sg.status(sid)
            assert st.state == "running" and st.script_id == sid.script_id
            ans = await sg.cancel(sid)
            return ans, await sg.wait(sid)

    ans, r = run(main())
    assert ans["state"] == "cancelled"
    assert r.status == "cancelled" and "cancelled by the engine" in (r.error or "")


def test_revoke_mid_run(daemon: Daemon) -> None:
    fleet = Fleet()
    tok = token(fleet_snapshot(daemon.workspace()), run_id=f"run-revoke-{uuid.uuid4().hex[:6]}")

    async def main() -> Any:
        async with fleet.client(daemon) as sg:
            sid = await sg.start(tok, "import time\ntime.sleep(60)\n")
            rev = await sg.revoke(tok)
            r = await sg.wait(sid)
            with pytest.raises(TokenError) as again:
                await sg.start(tok, "print(1)")
            return rev, r, again.value

    rev, r, again = run(main())
    assert rev["cancelled"] == 1
    assert r.status == "cancelled" and "revoked" in (r.error or "")
    assert again.reason == "revoked"


def test_bad_token_signature(daemon: Daemon) -> None:
    wrong = b"not-the-daemon-key-not-the-daemon-key!"

    async def main() -> None:
        async with Fleet().client(daemon) as sg:
            await sg.start(token(fleet_snapshot(daemon.workspace()), key=wrong), "print(1)")

    with pytest.raises(TokenError) as e:
        run(main())
    assert isinstance(e.value, ScriptgateError)
    assert e.value.code == -32010 and e.value.reason == "signature"


def test_workspace_not_writable(daemon: Daemon) -> None:
    ws = daemon.root / f"ro-{uuid.uuid4().hex[:6]}"
    ws.mkdir()
    # As root, scripts run as nobody: a root-owned 0755 dir is not theirs to write.
    os.chmod(ws, 0o755 if os.geteuid() == 0 else 0o555)

    async def main() -> None:
        async with Fleet().client(daemon) as sg:
            await sg.start(token(fleet_snapshot(ws)), "print(1)")

    try:
        with pytest.raises(SnapshotError) as e:
            run(main())
    finally:
        os.chmod(ws, 0o755)
    assert e.value.code == -32011 and e.value.reason == "not_writable"
    assert e.value.field == "workspace"


def test_info_and_describe(daemon: Daemon) -> None:
    async def main() -> Any:
        async with Client(daemon.socket) as sg:
            return await sg.info(), await sg.describe(token(fleet_snapshot(daemon.workspace())))

    info, text = run(main())
    assert info["protocol"] == 1
    assert "fleet__get_device_status" in text and "agent_tools" in text


def test_example_engine(daemon: Daemon) -> None:
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / "engine.py"), str(daemon.socket), str(daemon.key_file), str(daemon.root)],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("run_script ok:"), p.stdout
    assert "rebooted" in p.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="admin.prune answers root and auth.admin_groups only")
def test_example_engine_workspace_is_left_to_retention(daemon: Daemon) -> None:
    """The example marks the workspace it makes (created_by), so the daemon records
    it and retention removes it once unused: a dry run 40 days ahead lists it."""
    before = set(daemon.root.glob("example-*"))
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / "engine.py"), str(daemon.socket), str(daemon.key_file), str(daemon.root)],
        capture_output=True, text=True, timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    (ws,) = set(daemon.root.glob("example-*")) - before
    marker = json.loads((ws / ".agent" / "workspace.json").read_text())
    assert marker["created_by"] == "examples/engine.py" and marker["uid"] == 0, marker
    assert (ws / ".agent" / "workspace.json").stat().st_mode & 0o777 == 0o600

    async def main() -> Any:
        async with Client(daemon.socket) as sg:
            now = await sg.request("admin.prune", {"dry_run": True})
            later = await sg.request("admin.prune", {"dry_run": True, "as_of_ms": int(time.time() * 1000) + 40 * 86400_000})
            return now, later

    now, later = run(main())
    assert str(ws) not in [w["path"] for w in now["expired"]], now
    assert str(ws) in [w["path"] for w in later["expired"]], later


def test_prepare_workspace_marks_only_what_it_creates(tmp_path: Path) -> None:
    made = prepare_workspace(tmp_path / "new", created_by="my-engine", uid=os.geteuid(), gid=os.getegid())
    marker = json.loads((made / ".agent" / "workspace.json").read_text())
    assert marker["created_by"] == "my-engine" and marker["uid"] == os.geteuid()
    assert isinstance(marker["created_at_ms"], int)
    assert (made / ".agent").stat().st_mode & 0o777 == 0o700
    (tmp_path / "old").mkdir()
    kept = prepare_workspace(tmp_path / "old", created_by="my-engine", uid=os.geteuid(), gid=os.getegid())
    assert not (kept / ".agent").exists()
    plain = prepare_workspace(tmp_path / "plain", uid=os.geteuid(), gid=os.getegid())
    assert not (plain / ".agent").exists()


# --- issue 20 -------------------------------------------------------------------------

import threading

from scriptgate_client import CallContext


def test_sync_handlers_run_concurrently(daemon: Daemon) -> None:
    """8 calls of a plain handler that sleeps 0.5 s, via call_many: the daemon runs
    max_concurrency (4) at once and the client serves them in threads (one at a
    time on the event loop took 4.1 s)."""
    code = 'import agent_tools\nagent_tools.call_many("fleet__get_device_status", [{"sn": "SN%03d" % i} for i in range(8)])\n'
    stop = threading.Event()  # never set: a 0.5 s wait that ends early only if cancelled

    def slow(call: ToolCall) -> Any:
        stop.wait(0.5)
        return {"text": "ok", "structured": DEVICES[call.arguments["sn"]], "is_error": False}

    async def main() -> Any:
        async with Client(daemon.socket, tool_handler=slow) as sg:
            t0 = time.monotonic()
            r = await sg.run(token(fleet_snapshot(daemon.workspace())), code)
            return r, time.monotonic() - t0

    r, took = run(main())
    print(f"\n8 x 0.5 s plain handler calls via call_many: {took:.2f} s")
    assert r.status == "ok" and r.calls == 8 and r.failures == 0, r.text
    assert took < 3.0


def test_run_timeout_cancels_the_script(daemon: Daemon) -> None:
    async def main() -> Any:
        async with Client(daemon.socket) as sg:
            t0 = time.monotonic()
            r = await sg.run(token(fleet_snapshot(daemon.workspace())), "import time\ntime.sleep(60)\n", timeout_s=0.5)
            return r, time.monotonic() - t0, await sg.status(r.script_id)

    r, took, st = run(main())
    assert r.status == "cancelled" and "cancelled by the engine" in (r.error or "")
    assert st.state == "cancelled"
    assert took < 20


def test_tool_timeout_through_the_daemon(daemon: Daemon) -> None:
    code = """
import agent_tools, json
try:
    agent_tools.call("fleet__get_device_status", {"sn": "SN001"})
except agent_tools.ToolError as e:
    print("err", json.dumps([e.code, e.message]))
"""
    seen: Dict[str, Any] = {}

    def stuck(call: ToolCall, ctx: CallContext) -> str:
        seen["set"] = ctx.cancelled.wait(30)
        seen["reason"] = ctx.cancel_reason
        return "late"

    async def main() -> ScriptResult:
        async with Client(daemon.socket, tool_handler=stuck, tool_timeout_s=0.3) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code)

    r = run(main())
    code_, message = lines(r)["err"]
    assert code_ == "engine" and "tool_timeout_s = 0.3" in message and "stuck" in message, message
    assert seen == {"set": True, "reason": "timeout"}


def test_handler_exception_names_its_type(daemon: Daemon) -> None:
    code = """
import agent_tools, json
try:
    agent_tools.call("fleet__get_device_status", {"sn": "SN001"})
except agent_tools.ToolError as e:
    print("err", json.dumps([e.code, e.message]))
"""

    def tool(call: ToolCall) -> Any:
        return {}["nope"]

    async def main() -> ScriptResult:
        async with Client(daemon.socket, tool_handler=tool) as sg:
            return await sg.run(token(fleet_snapshot(daemon.workspace())), code)

    assert lines(run(main()))["err"] == ["engine", "KeyError: 'nope'"]


def test_no_approval_handler_says_so(daemon: Daemon) -> None:
    async def main() -> None:
        async with Client(daemon.socket) as sg:
            await sg.start(token(fleet_snapshot(daemon.workspace())), "print(1)", tools=["fleet__reboot_device"])

    with pytest.raises(ApprovalError) as e:
        run(main())
    assert e.value.reason == "denied" and "no approval handler is registered" in str(e.value)


def test_approval_timeout_denies(daemon: Daemon) -> None:
    async def never(req: ApprovalRequest) -> bool:
        await asyncio.Event().wait()
        return True

    async def main() -> None:
        async with Client(daemon.socket, approval_handler=never, approval_timeout_s=0.3) as sg:
            await sg.start(token(fleet_snapshot(daemon.workspace())), "print(1)", tools=["fleet__reboot_device"])

    with pytest.raises(ApprovalError) as e:
        run(main())
    assert e.value.reason == "denied" and "approval_timeout_s = 0.3" in str(e.value)


def test_tracing_one_tree(daemon: Daemon) -> None:
    """SPEC-20 §4: an outer agent span, a script of 3 calls whose handler makes its own
    span: one trace, one tree (every parent is a recorded span), and each tool span
    carries the call's span_id."""
    pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed in the test venv")
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    code = 'import agent_tools\nfor s in ["SN001", "SN002", "SN003"]:\n    agent_tools.call("fleet__get_device_status", {"sn": s})\n'
    span_ids: List[str] = []

    def tool(call: ToolCall, ctx: CallContext) -> Any:
        span_ids.append(ctx.span_id or "")
        with tracer.start_as_current_span("backend.lookup"):  # the handler's own span
            return {"text": "ok", "structured": DEVICES[call.arguments["sn"]], "is_error": False}

    async def main() -> ScriptResult:
        async with Client(daemon.socket, tool_handler=tool, on_finished=lambda r: None) as sg:
            with tracer.start_as_current_span("agent"):
                r = await sg.run(token(fleet_snapshot(daemon.workspace())), code)
            for _ in range(100):  # the run span ends when script.finished is delivered
                if any(s.name == "scriptgate.run_script" for s in exporter.get_finished_spans()):
                    break
                await asyncio.sleep(0.01)
            return r

    old = trace._TRACER_PROVIDER  # type: ignore[attr-defined]
    trace._TRACER_PROVIDER = provider  # type: ignore[attr-defined]  # set_tracer_provider sets it once only
    try:
        r = run(main())
    finally:
        trace._TRACER_PROVIDER = old  # type: ignore[attr-defined]
    assert r.status == "ok", r.text
    spans = exporter.get_finished_spans()
    names = sorted(s.name for s in spans)
    assert names == sorted(["agent", "scriptgate.run_script"] + ["scriptgate.tool_call", "backend.lookup"] * 3), names
    assert len({s.context.trace_id for s in spans}) == 1
    ids = {s.context.span_id for s in spans}
    roots = [s for s in spans if s.parent is None]
    assert [s.name for s in roots] == ["agent"]
    assert all(s.parent.span_id in ids for s in spans if s.parent is not None)
    by_id = {s.context.span_id: s for s in spans}
    for s in spans:
        if s.name == "scriptgate.tool_call":
            assert by_id[s.parent.span_id].name == "scriptgate.run_script"
            assert s.attributes["scriptgate.tool"] == "fleet__get_device_status"
            assert s.attributes["scriptgate.script_id"] == r.script_id
            assert re.fullmatch("[0-9a-f]{16}", s.attributes["scriptgate.call.span_id"])
        if s.name == "backend.lookup":
            assert by_id[s.parent.span_id].name == "scriptgate.tool_call"
    assert sorted(s.attributes["scriptgate.call.span_id"] for s in spans if s.name == "scriptgate.tool_call") == sorted(span_ids)
