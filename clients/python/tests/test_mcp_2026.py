"""`scriptgate mcp` in MCP 2026-07-28, on the wire and through the official
Python SDK (mcp 2.3, `mode="auto"`): the approval of declared write tools as an
`InputRequiredResult` whose `requestState` cannot be forged, edited, replayed or
taken to another process; long scripts as tasks (`tasks/get`, `tasks/cancel`,
ids bound to their client, served from the record after a restart);
`subscriptions/listen` with `taskIds`; a closed stdin or SIGTERM ending every
script as `cancelled`. Each scriptgate mcp here runs embedded, with a state
directory of its own (its store is read directly to count what ran)."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import queue
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

from conftest import REPO

SCRIPTGATE = Path(os.environ.get("SCRIPTGATE") or REPO / "target" / "debug" / "scriptgate")
FLEET = f"fleet=python3 {REPO / 'examples' / 'fleet' / 'fleet_server.py'}"
REBOOT = "import agent_tools\nprint(agent_tools.call('fleet__reboot_device', {'sn': 'SN0001'}))\n"
V = "2026-07-28"

pytestmark = pytest.mark.skipif(not SCRIPTGATE.exists(), reason=f"no {SCRIPTGATE}: run cargo build")


class State:
    """A state directory of its own: the embedded store, the task key."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="sg-mcp26-"))
        # Removed when the tests end: each holds the embedded daemon's copy of
        # its binary (some 290 MB for a debug build).
        atexit.register(shutil.rmtree, self.dir, True)
        os.chmod(self.dir, 0o755)
        self.config = self.dir / "scriptgate.toml"
        self.config.write_text(f'[state]\ndir = "{self.dir}"\n')

    def store(self) -> Path:
        # Root's embedded daemon keeps STATE/cli; a user's, the state directory.
        return self.dir / "cli" / "scriptgate.db" if os.geteuid() == 0 else self._home_store()

    def _home_store(self) -> Path:
        return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local/state") / "scriptgate/scriptgate.db"

    def rows(self, like: str) -> List[tuple]:
        if not self.store().exists():
            return []
        c = sqlite3.connect(f"file:{self.store()}?mode=ro", uri=True)
        try:
            return c.execute(
                "SELECT script_id, status FROM scripts WHERE code LIKE ? ORDER BY started_at", (f"%{like}%",)
            ).fetchall()
        except sqlite3.OperationalError as e:
            # The file is there before its tables: the daemon is making the store.
            if "no such table" in str(e):
                return []
            raise
        finally:
            c.close()

    def args(self, *extra: str) -> List[str]:
        return [str(SCRIPTGATE), "mcp", "--embedded", "--config", str(self.config), "--mcp", FLEET, *extra]


class Raw:
    """A 2026-07-28 client on the wire: JSON-RPC lines over the server's stdio."""

    def __init__(self, argv: List[str], tasks: bool = False, elicit: bool = True) -> None:
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        self.n = 0
        self.inbox: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.kept: List[Dict[str, Any]] = []
        caps: Dict[str, Any] = {}
        if tasks:
            caps["extensions"] = {"io.modelcontextprotocol/tasks": {}}
        if elicit:
            caps["elicitation"] = {"form": {}}
        self.caps = caps
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.inbox.put(json.loads(line))
            except ValueError:
                pass

    def meta(self) -> Dict[str, Any]:
        return {"io.modelcontextprotocol/protocolVersion": V,
                "io.modelcontextprotocol/clientInfo": {"name": "raw", "version": "1"},
                "io.modelcontextprotocol/clientCapabilities": self.caps}

    def send(self, method: str, params: Dict[str, Any]) -> int:
        self.n += 1
        params = dict(params, _meta=self.meta())
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": self.n, "method": method, "params": params}) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            # The server is gone: say how it ended and what it said last.
            code = self.p.wait(timeout=10)
            err = self.p.stderr.read()[-4000:] if self.p.stderr is not None else ""
            raise AssertionError(f"scriptgate mcp exited ({code}) before {method}: {err}") from None
        return self.n

    def wait_for(self, pred: Callable[[Dict[str, Any]], bool], timeout: float = 60) -> Dict[str, Any]:
        for m in list(self.kept):
            if pred(m):
                self.kept.remove(m)
                return m
        end = time.monotonic() + timeout
        while True:
            m = self.inbox.get(timeout=max(0.01, end - time.monotonic()))
            if pred(m):
                return m
            self.kept.append(m)

    def rpc(self, method: str, params: Dict[str, Any], timeout: float = 60) -> Dict[str, Any]:
        i = self.send(method, params)
        return self.wait_for(lambda m: m.get("id") == i and "method" not in m, timeout)

    def run(self, code: str, tools: Optional[List[str]] = None, **more: Any) -> Dict[str, Any]:
        args: Dict[str, Any] = {"code": code, "description": "reboot one"}
        if tools is not None:
            args["tools"] = tools
        return self.rpc("tools/call", {"name": "run_script", "arguments": args, **more})

    def close(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            self.p.wait(30)


def allow(state: str, value: Any = True, action: str = "accept") -> Dict[str, Any]:
    return {"requestState": state,
            "inputResponses": {"approval": {"action": action, "content": {"allow": value}}}}


def text(r: Dict[str, Any]) -> str:
    return "".join(c.get("text", "") for c in r["result"].get("content", []))


def test_the_approval_is_asked_once_as_input_required_and_its_answer_runs_the_script() -> None:
    st = State()
    c = Raw(st.args())
    try:
        first = c.run(REBOOT, ["fleet__reboot_device"])["result"]
        assert first["resultType"] == "input_required", first
        form = first["inputRequests"]["approval"]
        assert form["method"] == "elicitation/create"
        message = form["params"]["message"]
        assert "fleet__reboot_device (write)" in message and "   2 | print(agent_tools.call(" in message
        assert st.rows("SN0001") == [], "nothing runs before the answer"
        done = c.run(REBOOT, ["fleet__reboot_device"], **allow(first["requestState"]))
        r = done["result"]
        assert r["resultType"] == "complete" and r["isError"] is False, done
        assert "'rebooted': True" in text(done)
        assert r["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "scriptgate"
        assert [s for _, s in st.rows("SN0001")] == ["ok"]
    finally:
        c.close()


def test_a_forged_edited_replayed_or_foreign_approval_starts_nothing_new() -> None:
    st = State()
    a, b = Raw(st.args()), Raw(st.args())
    try:
        ask = lambda code: a.run(code, ["fleet__reboot_device"])["result"]["requestState"]  # noqa: E731
        s1 = ask(REBOOT)
        # Forged: one character of the seal changed.
        forged = s1[:-2] + ("AA" if not s1.endswith("AA") else "BB")
        r = a.run(REBOOT, ["fleet__reboot_device"], **allow(forged))
        assert r["result"]["isError"] and "does not verify" in text(r), r
        # Edited: the code is not what was approved.
        r = a.run(REBOOT + "print('more')\n", ["fleet__reboot_device"], **allow(s1))
        assert r["result"]["isError"] and "differ from what was approved" in text(r), r
        # Another process (another client of stdio): its key is not this one's.
        r = b.run(REBOOT, ["fleet__reboot_device"], **allow(s1))
        assert r["result"]["isError"] and "another scriptgate mcp process" in text(r), r
        assert st.rows("SN0001") == [], "none of these ran"
        # allow must be the boolean true; the answer uses the approval up.
        r = a.run(REBOOT, ["fleet__reboot_device"], **allow(s1, "true"))
        assert r["result"]["isError"] and "not the boolean true" in text(r), r
        r = a.run(REBOOT, ["fleet__reboot_device"], **allow(s1, True))
        assert r["result"]["isError"] and "used already" in text(r), r
        assert st.rows("SN0001") == [], "a refused approval runs nothing, then or later"
        # A fresh approval runs once; presented again it answers with that script.
        s2 = ask(REBOOT)
        one = a.run(REBOOT, ["fleet__reboot_device"], **allow(s2))
        again = a.run(REBOOT, ["fleet__reboot_device"], **allow(s2))
        assert not one["result"]["isError"], one
        sid = one["result"]["structuredContent"]["script_id"]
        assert again["result"]["structuredContent"]["script_id"] == sid, again
        assert [s for _, s in st.rows("SN0001")] == ["ok"], "one run, not two"
    finally:
        a.close()
        b.close()


def test_a_client_that_cannot_be_asked_is_told_so() -> None:
    st = State()
    c = Raw(st.args(), elicit=False)
    try:
        r = c.run(REBOOT, ["fleet__reboot_device"])
        assert r["result"]["resultType"] == "complete" and r["result"]["isError"], r
        assert "declares no form elicitation" in text(r), r
        assert r["result"]["structuredContent"]["status"] == "refused"
    finally:
        c.close()


def test_the_sdk_in_auto_mode_asks_through_its_elicitation_callback() -> None:
    mcp = pytest.importorskip("mcp")
    import mcp_types as types  # noqa: F401

    st = State()
    asked: List[Any] = []

    async def elicit(_ctx: Any, params: Any) -> Any:
        asked.append(params)
        return types.ElicitResult(action="accept", content={"allow": True})

    async def go() -> None:
        params = mcp.StdioServerParameters(command=str(SCRIPTGATE), args=st.args()[1:])
        async with mcp.Client(params, mode="auto", elicitation_callback=elicit) as c:
            assert c.protocol_version == V
            r = await c.call_tool("run_script", {"code": REBOOT, "tools": ["fleet__reboot_device"],
                                                 "description": "reboot one"})
            assert r.is_error is False, r
            assert "'rebooted': True" in "".join(x.text for x in r.content)

    asyncio.run(asyncio.wait_for(go(), 120))
    assert len(asked) == 1 and "fleet__reboot_device (write)" in asked[0].message


SLOW = "import time\nprint('started', flush=True)\ntime.sleep({s})\nprint('slept')\n"


def task_of(c: Raw, code: str) -> str:
    r = c.run(code)["result"]
    assert r["resultType"] == "task" and r["status"] == "working", r
    assert r["pollIntervalMs"] > 0 and r["ttlMs"] > 0
    return r["taskId"]


def poll(c: Raw, tid: str, until: Callable[[Dict[str, Any]], bool], limit: float = 60) -> Dict[str, Any]:
    end = time.monotonic() + limit
    while True:
        g = c.rpc("tasks/get", {"taskId": tid})["result"]
        if until(g) or time.monotonic() > end:
            return g
        time.sleep(g.get("pollIntervalMs", 100) / 1000)


def test_a_task_reads_as_working_then_completed_with_the_calls_answer_even_after_a_restart() -> None:
    st = State()
    a = Raw(st.args("--task-after", "0"), tasks=True)
    try:
        tid = task_of(a, SLOW.format(s=1))
        first = a.rpc("tasks/get", {"taskId": tid})["result"]
        assert first["status"] == "working" and first["resultType"] == "complete", first
        done = poll(a, tid, lambda g: g["status"] != "working")
        assert done["status"] == "completed", done
        result = done["result"]
        assert result["content"][0]["text"].startswith("run_script ok: 0 calls"), result
        assert "slept" in result["structuredContent"]["output"]
        # Unknown, forged: not found.
        bad = a.rpc("tasks/get", {"taskId": tid[:-3] + "xyz"})
        assert bad["error"]["code"] == -32602, bad
        # A running script, then the process ends (stdin closed).
        running = task_of(a, SLOW.format(s=60) + "# left-running\n")
        wait_running(st, "left-running")
    finally:
        a.close()
    b = Raw(st.args(), tasks=True)
    try:
        again = b.rpc("tasks/get", {"taskId": tid})["result"]
        assert again["status"] == "completed"
        assert again["result"] == result, "the record answers exactly what the call would have"
        gone = b.rpc("tasks/get", {"taskId": running})["result"]
        assert gone["status"] == "cancelled", gone
    finally:
        b.close()


def wait_running(st: State, like: str) -> None:
    end = time.monotonic() + 60
    while [s for _, s in st.rows(like)] != ["running"]:
        assert time.monotonic() < end, "the script never started"
        time.sleep(0.05)


def test_tasks_cancel_ends_the_script_and_its_record_says_cancelled() -> None:
    st = State()
    c = Raw(st.args("--task-after", "0"), tasks=True)
    try:
        tid = task_of(c, SLOW.format(s=120) + "# cancel-me\n")
        t0 = time.monotonic()
        ack = c.rpc("tasks/cancel", {"taskId": tid})
        assert ack["result"]["resultType"] == "complete", ack
        g = c.rpc("tasks/get", {"taskId": tid})["result"]
        took = time.monotonic() - t0
        assert g["status"] == "cancelled", g
        # Ended by the cancel, not by its 120 s: a bound far from both, so a busy
        # machine cannot fail it.
        assert took < 60.0, took
        assert [s for _, s in st.rows("cancel-me")] == ["cancelled"]
    finally:
        c.close()


def test_task_notifications_reach_a_subscription_that_names_the_task() -> None:
    st = State()
    c = Raw(st.args("--task-after", "0"), tasks=True)
    try:
        tid = task_of(c, SLOW.format(s=1))
        lid = c.send("subscriptions/listen", {"notifications": {"taskIds": [tid, "not-a-task"], "toolsListChanged": True}})
        ack = c.wait_for(lambda m: m.get("method") == "notifications/subscriptions/acknowledged")
        assert ack["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == lid
        assert ack["params"]["notifications"]["taskIds"] == [tid], ack
        assert ack["params"]["notifications"]["toolsListChanged"] is True
        n = c.wait_for(lambda m: m.get("method") == "notifications/tasks")
        assert n["params"]["taskId"] == tid and n["params"]["status"] == "completed", n
        assert n["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == lid
        assert "slept" in n["params"]["result"]["structuredContent"]["output"]
    finally:
        c.close()


def test_a_closed_stdin_then_sigterm_leaves_every_script_recorded_cancelled() -> None:
    st = State()
    c = Raw(st.args())
    try:
        c.send("tools/call", {"name": "run_script", "arguments": {"code": SLOW.format(s=120) + "# hang-up\n"}})
        wait_running(st, "hang-up")
        assert c.p.stdin is not None
        c.p.stdin.close()
        # A closed stdin alone ends it. Not within a client's 2 s every time:
        # it first gives its upstream MCP servers their own end (0.5 s, then
        # SIGTERM and 2 s more: cli::mcp's shutdown), and a slow upstream takes
        # that (2.7 to 3.2 s seen, before this stop's changes too). A client's
        # SIGTERM meanwhile records the same (the next test).
        try:
            c.p.wait(30)
        except subprocess.TimeoutExpired:
            c.p.send_signal(signal.SIGTERM)
            c.p.wait(30)
            pytest.fail("scriptgate mcp was still running 30 s after stdin closed")
        # Recorded before it exited, inside the clients' 2 s (how much sooner
        # is a figure of a busy machine, not a property: no bound on it here).
        assert [s for _, s in st.rows("hang-up")] == ["cancelled"]
    finally:
        c.close()


def test_sigterm_records_every_running_script_cancelled_before_exit() -> None:
    st = State()
    c = Raw(st.args())
    try:
        c.send("tools/call", {"name": "run_script", "arguments": {"code": SLOW.format(s=120) + "# sigterm\n"}})
        wait_running(st, "sigterm")
        c.p.send_signal(signal.SIGTERM)
        assert c.p.wait(10) == 0
        assert [s for _, s in st.rows("sigterm")] == ["cancelled"]
    finally:
        c.close()


def test_a_tool_list_change_reaches_a_subscription_and_the_list() -> None:
    st = State()
    log = st.dir / "m.log"
    grow = f"m=python3 {REPO / 'tests' / 'fixtures' / 'mcp_2026_server.py'} {log}"
    argv = [str(SCRIPTGATE), "mcp", "--embedded", "--config", str(st.config), "--passthrough", "--mcp", grow]
    c = Raw(argv)
    try:
        names = lambda r: [t["name"] for t in r["result"]["tools"]]  # noqa: E731
        listed = c.rpc("tools/list", {})
        assert listed["result"]["ttlMs"] == 60000 and listed["result"]["cacheScope"] == "private", listed
        assert "m__grow" in names(listed) and "m__extra" not in names(listed)
        lid = c.send("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
        ack = c.wait_for(lambda m: m.get("method") == "notifications/subscriptions/acknowledged")
        assert ack["params"]["notifications"] == {"toolsListChanged": True}, ack
        r = c.rpc("tools/call", {"name": "m__grow", "arguments": {}})
        assert not r["result"].get("isError"), r
        n = c.wait_for(lambda m: m.get("method") == "notifications/tools/list_changed")
        assert n["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == lid, n
        assert "m__extra" in names(c.rpc("tools/list", {}))
    finally:
        c.close()
