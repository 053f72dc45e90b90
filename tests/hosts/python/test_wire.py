"""`scriptgate mcp`'s 2026-07-28 wire over stdio, in raw JSON-RPC lines: what the
conformance suite would check with its own reference tools, here through run_script.
The approval's input_required round trip (asked again when the retry carries no
answer; a tampered requestState refused; an answer used once, a re-issue getting the
same script); subscriptions/listen with the tasks extension's taskIds, which tells a
task's completion (notifications/tasks, tagged with the subscription); and listen's
toolsListChanged, when an upstream server's tool list changes."""

from __future__ import annotations

import http.client
import json
import queue
import re
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

import hostlib as h

V = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
SUB = "io.modelcontextprotocol/subscriptionId"


class Wire:
    """`scriptgate mcp` over its stdin and stdout, one JSON message a line."""

    def __init__(self, *args: str, caps: Optional[Dict[str, Any]] = None) -> None:
        self.p = subprocess.Popen([str(h.SCRIPTGATE), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        self.caps = caps or {}
        self.got: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout
        for line in self.p.stdout:
            self.got.put(json.loads(line))

    def meta(self, **more: Any) -> Dict[str, Any]:
        return {"io.modelcontextprotocol/protocolVersion": V, "io.modelcontextprotocol/clientCapabilities": self.caps,
                **more}

    def send(self, method: str, params: Dict[str, Any]) -> int:
        self.next_id += 1
        params = {**params, "_meta": {**self.meta(), **params.get("_meta", {})}}
        assert self.p.stdin
        self.p.stdin.write(json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}) + "\n")
        self.p.stdin.flush()
        return self.next_id

    def messages(self, timeout: float = 60) -> Iterator[Dict[str, Any]]:
        while True:
            yield self.got.get(timeout=timeout)

    def answer(self, rid: int) -> Dict[str, Any]:
        """The answer to request `rid` (notifications before it are skipped)."""
        for m in self.messages():
            if m.get("id") == rid and "method" not in m:
                assert "result" in m, m
                return m["result"]
        raise AssertionError("unreachable")

    def call(self, arguments: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
        return self.answer(self.send("tools/call", {"name": "run_script", "arguments": arguments, **extra}))

    def close(self) -> None:
        """Hang up as a stdio client does: close stdin, SIGTERM after 2 s."""
        assert self.p.stdin
        self.p.stdin.close()
        try:
            self.p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.p.terminate()
            self.p.wait(timeout=30)
        finally:
            if self.p.poll() is None:
                self.p.kill()


@pytest.fixture
def wire() -> Iterator[Any]:
    made: List[Wire] = []

    def make(*extra: str, caps: Optional[Dict[str, Any]] = None) -> Wire:
        w = Wire(*h.mcp_args(*extra), caps=caps)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def test_the_approval_round_trip(wire: Any) -> None:
    w = wire(caps={"elicitation": {}})
    args = h.reboot_args(h.unique("wire-approval"))
    asked = w.call(args)
    assert asked["resultType"] == "input_required", asked
    request = asked["inputRequests"]["approval"]
    assert request["method"] == "elicitation/create"
    assert "fleet__reboot_device (write)" in request["params"]["message"]
    assert request["params"]["requestedSchema"]["properties"]["allow"]["type"] == "boolean"
    state = asked["requestState"]
    # A retry without the answer is asked again.
    again = w.call(args, requestState=state)
    assert again["resultType"] == "input_required" and "approval" in again["inputRequests"], again
    # A tampered state starts nothing, and says why.
    tampered = state[:-4] + ("AAAA" if not state.endswith("AAAA") else "BBBB")
    yes = {"approval": {"action": "accept", "content": {"allow": True}}}
    refused = w.call(args, requestState=tampered, inputResponses=yes)
    assert refused["resultType"] == "complete" and refused["isError"] is True, refused
    assert "does not verify" in refused["structuredContent"]["error"], refused
    # The answer starts the script, once: the same state again gets the same script.
    ok = w.call(args, requestState=state, inputResponses=yes)
    assert ok["resultType"] == "complete" and ok["isError"] is False, ok
    assert h.REBOOTED in ok["content"][0]["text"]
    assert ok["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "scriptgate"
    same = w.call(args, requestState=state, inputResponses=yes)
    assert same["structuredContent"]["script_id"] == ok["structuredContent"]["script_id"], same
    # A declined answer: refused, and the result says the user declined.
    asked = w.call(args)
    no = w.call(args, requestState=asked["requestState"], inputResponses={"approval": {"action": "decline"}})
    assert no["isError"] is True and "declined" in json.dumps(no), no


def listen_for_task(w: Wire, task_id: str) -> Iterator[Dict[str, Any]]:
    """Open subscriptions/listen for `task_id`: its acknowledgement, then each message."""
    listen = w.send("subscriptions/listen", {"notifications": {"taskIds": [task_id]}})
    for m in w.messages():
        if m.get("id") == listen:
            raise AssertionError(f"listen answered: {m}")
        if m.get("method") in ("notifications/subscriptions/acknowledged", "notifications/tasks"):
            assert m["params"]["_meta"][SUB] == listen, m
        yield m


def task_of(created: Dict[str, Any]) -> str:
    assert created["resultType"] == "task", created
    return created["taskId"]


def test_listen_with_task_ids_tells_a_tasks_completion(wire: Any) -> None:
    w = wire("--task-after", "0", caps={"extensions": {TASKS: {}}})
    task_id = task_of(w.call({"code": h.SUMMARY_CODE, "description": h.unique("wire-task")}))
    seen = listen_for_task(w, task_id)
    assert next(seen)["method"] == "notifications/subscriptions/acknowledged"
    told = next(m for m in seen if m.get("method") == "notifications/tasks")["params"]
    assert told["taskId"] == task_id and told["status"] == "completed", told
    assert told["result"]["structuredContent"]["output"] == h.expected_summary() + "\n"
    got = w.answer(w.send("tasks/get", {"taskId": task_id}))
    assert got["status"] == "completed", got
    assert got["result"]["structuredContent"]["output"] == h.expected_summary() + "\n"


def test_the_acknowledgement_lists_the_task_ids_accepted(wire: Any) -> None:
    w = wire("--task-after", "0", caps={"extensions": {TASKS: {}}})
    task_id = task_of(w.call({"code": h.SLEEP_CODE, "description": h.unique("wire-ack")}))
    ack = next(listen_for_task(w, task_id))
    assert ack["params"]["notifications"].get("taskIds") == [task_id], ack


def test_task_notifications_need_the_tasks_extension_declared(wire: Any) -> None:
    w = wire("--task-after", "0", caps={"extensions": {TASKS: {}}})
    task_id = task_of(w.call({"code": h.SLEEP_CODE, "description": h.unique("wire-undeclared")}))
    w.caps = {}
    listen = w.send("subscriptions/listen", {"notifications": {"taskIds": [task_id]}})
    m = next(m for m in w.messages() if m.get("id") == listen or "notifications/subscriptions" in m.get("method", ""))
    assert m.get("error", {}).get("code") == -32021, m


# An upstream whose tool `grow` adds a tool `extra` and says its list changed.
GROWING = r'''
import json, sys
tools = [{"name": "grow", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}}]
def send(m):
    sys.stdout.write(json.dumps(m) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    m, res = msg.get("method"), {}
    if m == "initialize":
        res = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {"listChanged": True}},
               "serverInfo": {"name": "growing", "version": "1"}}
    elif m == "tools/list":
        res = {"tools": tools}
    elif m == "tools/call":
        tools.append({"name": "extra", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}})
        send({"jsonrpc": "2.0", "id": msg["id"], "result": {"content": [{"type": "text", "text": "grown"}]}})
        send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        continue
    send({"jsonrpc": "2.0", "id": msg["id"], "result": res})
'''


def test_listen_tells_an_upstream_tool_list_change(wire: Any, tmp_path: Path) -> None:
    server = tmp_path / "growing.py"
    server.write_text(GROWING)
    w = wire("--mcp", f"up=python3 {server}")
    before = w.answer(w.send("tools/list", {}))
    assert "up__extra" not in before["tools"][0]["description"]
    assert (before["ttlMs"], before["cacheScope"]) == (60000, "private"), before
    listen = w.send("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
    for m in w.messages():
        if m.get("method") == "notifications/subscriptions/acknowledged":
            break
    call = w.send("tools/call", {"name": "run_script", "arguments": {
        "code": "import agent_tools\nagent_tools.call('up__grow', {})\n", "description": h.unique("wire-grow")}})
    changed = answered = False
    for m in w.messages():
        if m.get("id") == call:
            assert m["result"]["isError"] is False, m
            answered = True
        if m.get("method") == "notifications/tools/list_changed":
            assert m["params"]["_meta"][SUB] == listen, m
            changed = True
        if changed and answered:
            break
    after = w.answer(w.send("tools/list", {}))
    assert "up__extra" in after["tools"][0]["description"]


def http_server(*extra: str) -> Any:
    """`scriptgate mcp --http 127.0.0.1:0 --token-file F`: the process, its port, and
    the bearer token every request carries (F's, made by the server)."""
    token_file = Path(tempfile.mkdtemp(prefix="sg-http-")) / "token"
    p = subprocess.Popen([str(h.SCRIPTGATE), *h.mcp_args(*extra, "--http", "127.0.0.1:0", "--token-file",
                                                           str(token_file))],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert p.stderr
    said = ""
    for line in p.stderr:
        said += line
        m = re.search(r"Streamable HTTP at http://127\.0\.0\.1:(\d+)/", said)
        if m:
            threading.Thread(target=p.stderr.read, daemon=True).start()
            return p, int(m.group(1)), token_file.read_text().strip()
    raise AssertionError(f"scriptgate mcp --http said: {said}")


def test_listen_over_http_tells_a_tasks_completion() -> None:
    p, port, token = http_server("--task-after", "0")
    try:
        meta = {"io.modelcontextprotocol/protocolVersion": V,
                "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}}}

        def post(rid: int, method: str, params: Dict[str, Any], name: Optional[str] = None, wait: float = 30) -> Any:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=wait)
            headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                       "MCP-Protocol-Version": V, "Mcp-Method": method, **({"Mcp-Name": name} if name else {}),
                       "Authorization": f"Bearer {token}"}
            c.request("POST", "/mcp", json.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                                                  "params": {**params, "_meta": meta}}), headers)
            r = c.getresponse()
            assert r.status == 200, (r.status, r.read())
            return r

        def events(r: Any) -> Iterator[Dict[str, Any]]:
            while True:
                try:
                    line = r.readline()
                except TimeoutError:
                    return
                if not line:
                    return
                if line.startswith(b"data: ") and line.strip() != b"data:":
                    yield json.loads(line[6:])

        r = post(1, "tools/call", {"name": "run_script", "arguments": {
            "code": "print('done')", "description": h.unique("http-task")}}, name="run_script")
        created = next(m for m in events(r) if m.get("id") == 1)["result"]
        task_id = task_of(created)
        # The script prints one line: its task ends within a second. The stream is
        # read until a notification comes, or for 5 s.
        r = post(2, "subscriptions/listen", {"notifications": {"taskIds": [task_id]}}, wait=5)
        told = next((m for m in events(r) if m.get("method") == "notifications/tasks"), None)
        assert told and told["params"]["taskId"] == task_id, "no notifications/tasks within 5 s"
    finally:
        p.terminate()
        p.wait(timeout=30)
