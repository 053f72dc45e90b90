"""A stdio client that hangs up as stdio clients do (the MCP stdio transport: close the
server's stdin, then SIGTERM after 2 s, then SIGKILL): every script still running is
recorded cancelled within 1 s of the close, and `scriptgate mcp` exits by itself
before the SIGTERM. Raw JSON-RPC lines, so that the client sends no cancel first; in
each era (initialize for 2025-11-25, per-request _meta for 2026-07-28), and in
2026-07-28 with a subscriptions/listen stream open."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import IO, Any, Dict, List

import pytest

import hostlib as h

SCRIPTS = 3
# What a stdio client allows between closing stdin and SIGTERM.
GRACE = 2.0
# The bound on close -> every script recorded cancelled.
RECORDED_WITHIN = 1.0


def send(stdin: IO[str], m: Dict[str, Any]) -> None:
    stdin.write(json.dumps(m) + "\n")
    stdin.flush()



@pytest.mark.parametrize("era,listen", [
    ("2025-11-25", False),
    ("2026-07-28", False),
    ("2026-07-28", True),
])
def test_a_stdio_hang_up_records_every_script_cancelled_within_1s_and_exits_before_sigterm(
        era: str, listen: bool) -> None:
    p = subprocess.Popen([str(h.SCRIPTGATE), *h.mcp_args()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    assert p.stdin and p.stdout
    try:
        meta: Dict[str, Any] = {}
        if era == "2026-07-28":
            meta = {"io.modelcontextprotocol/protocolVersion": era, "io.modelcontextprotocol/clientCapabilities": {}}
        else:
            send(p.stdin, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": era, "capabilities": {}, "clientInfo": {"name": "hang-up", "version": "1"}}})
            assert json.loads(p.stdout.readline())["result"]["protocolVersion"] == era
            send(p.stdin, {"jsonrpc": "2.0", "method": "notifications/initialized"})
        if listen:
            # A 2026-07-28 client's stream for tool list changes, open while it runs.
            send(p.stdin, {"jsonrpc": "2.0", "id": 100, "method": "subscriptions/listen", "params": {
                "notifications": {"toolsListChanged": True}, "_meta": meta}})
            ack = json.loads(p.stdout.readline())
            assert ack["method"] == "notifications/subscriptions/acknowledged", ack
        descriptions: List[str] = [h.unique(f"hang-up-{era}-{i}") for i in range(SCRIPTS)]
        for i, d in enumerate(descriptions, 1):
            send(p.stdin, {"jsonrpc": "2.0", "id": i, "method": "tools/call", "params": {
                "name": "run_script", "arguments": {"code": h.SLEEP_CODE, "description": d},
                "_meta": {**meta, "progressToken": f"t{i}"}}})
        # Each script runs once its progress comes.
        running = set()
        while len(running) < SCRIPTS:
            m = json.loads(p.stdout.readline())
            assert "result" not in m and "error" not in m, m
            if m.get("method") == "notifications/progress":
                running.add(m["params"]["progressToken"])
        closed = time.time()
        p.stdin.close()
        try:
            code = p.wait(timeout=GRACE)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)
            pytest.fail(f"scriptgate mcp still ran {GRACE} s after its stdin closed: a stdio client sends SIGTERM now")
        assert code == 0
        ended = {}
        for d in descriptions:
            r = h.record(d)
            assert r is not None, d
            ended[d] = (r["status"], r["ended_at"] / 1000 - closed)
        print(era, ended)
        assert all(s == "cancelled" for s, _ in ended.values()), ended
        assert all(t <= RECORDED_WITHIN for _, t in ended.values()), ended
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_probe_that_only_discovers_then_hangs_up_is_a_clean_end() -> None:
    p = subprocess.Popen([str(h.SCRIPTGATE), *h.mcp_args()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdin and p.stdout
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}
    send(p.stdin, {"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": meta}})
    assert "2026-07-28" in json.loads(p.stdout.readline())["result"]["supportedVersions"]
    p.stdin.close()
    try:
        code = p.wait(timeout=GRACE)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.stderr
    said = p.stderr.read()
    assert code == 0 and "connection closed" not in said, (code, said)
