#!/usr/bin/env python3
"""scriptgate mcp, timed from the client, side by side in one run (one machine, one
build, one load):

- an empty script's tools/call to its result, through one `scriptgate mcp` (the
  official MCP Python SDK's Client over stdio), in each protocol era: mode="legacy"
  (initialize, 2025-11-25) and mode="auto" (server/discover, 2026-07-28);
- beside `scriptgate run` on the same script (a process, its MCP server and an
  embedded daemon per run): what one long-lived server saves per script;
- the same script as an MCP task (`--task-after 0`, a request that declares the tasks
  extension; raw JSON-RPC lines): tools/call to the task handle, and to the client's
  knowing it completed, by polling tasks/get as often as the task asks
  (pollIntervalMs), or by a notifications/tasks on subscriptions/listen with
  notifications.taskIds;
- a cancel: from the client's cancelling a running script's call (the SDK sends
  notifications/cancelled) to the script's record saying it ended (`ended_at`,
  written once its sandbox is gone).

All of it runs the embedded daemon with a state directory of its own (removed at
the end). Nothing is asserted: the figures are printed.

usage: benches/mcp_server.py [N]
  (a Python with the MCP SDK 2.x: tests/hosts/venv/bin/python after tests/hosts/install,
  or clients/python/.venv/bin/python; $SCRIPTGATE, default target/release/scriptgate)
"""
import asyncio
import json
import os
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mcp import Client, ClientSession, StdioServerParameters, stdio_client

REPO = Path(__file__).resolve().parents[1]
SCRIPTGATE = os.environ.get("SCRIPTGATE") or str(REPO / "target" / "release" / "scriptgate")
FLEET = f"fleet=python3 {REPO / 'examples' / 'fleet' / 'fleet_server.py'}"
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
STATE = Path(tempfile.mkdtemp(prefix="sg-bench-"))
STATE.chmod(0o755)  # the sandbox's user reaches the interpreter kept under it
CONFIG = STATE / "scriptgate.toml"
CONFIG.write_text(f'[state]\ndir = "{STATE}"\n')
# The same daemon with no pre-made sandboxes, for the side-by-side figure.
COLD = STATE / "cold.toml"
COLD.write_text(f'[state]\ndir = "{STATE}"\n[sandbox]\npool_size = 0\n')
# Where a root embedded daemon keeps its store (`scriptgate metrics` reads it).
STORE = STATE / "store.toml"
STORE.write_text(f'[state]\ndir = "{STATE / "cli"}"\n')
MCP = ["mcp", "--embedded", "--config", str(CONFIG), "--mcp", FLEET]
V = "2026-07-28"


def params(*extra: str, config: Path = CONFIG) -> StdioServerParameters:
    args = [*MCP, *extra]
    args[args.index(str(CONFIG))] = str(config)
    return StdioServerParameters(command=SCRIPTGATE, args=args)


def starts() -> dict:
    """scriptgate_sandbox_starts_total by start, from the embedded store (root only)."""
    out = subprocess.run([SCRIPTGATE, "metrics", "--config", str(STORE)], capture_output=True, text=True).stdout
    found = {}
    for m in re.finditer(r'^scriptgate_sandbox_starts_total\{start="(\w+)"\} (\d+)', out, re.M):
        found[m.group(1)] = int(m.group(2))
    return found


async def through_mcp(mode: str, config: Path = CONFIG, pause: float = 0.0) -> list:
    """`pause`: the client's wait between calls, outside the timing (a model's turn:
    room for the pool to make the next member)."""
    times = []
    async with Client(stdio_client(params(config=config), errlog=open(os.devnull, "w")), mode=mode) as c:
        await c.call_tool("run_script", {"code": "pass", "description": "warm-up"})
        for _ in range(N):
            await asyncio.sleep(pause)
            t = time.perf_counter()
            res = await c.call_tool("run_script", {"code": "pass", "description": "empty"})
            times.append(time.perf_counter() - t)
            assert not res.is_error, res
    return times


class Wire:
    """`scriptgate mcp` over its stdin and stdout, raw JSON-RPC lines (2026-07-28, the
    tasks extension declared)."""

    def __init__(self, *extra: str) -> None:
        self.p = subprocess.Popen([SCRIPTGATE, *MCP, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        self.got: "queue.Queue[dict]" = queue.Queue()
        self.id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.got.put(json.loads(line))

    def send(self, method: str, params: dict, notification: bool = False) -> int:
        meta = {"io.modelcontextprotocol/protocolVersion": V,
                "io.modelcontextprotocol/clientCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}}}
        m = {"jsonrpc": "2.0", "method": method, "params": {**params, "_meta": meta}}
        if not notification:
            self.id += 1
            m["id"] = self.id
        self.p.stdin.write(json.dumps(m) + "\n")
        self.p.stdin.flush()
        return self.id

    def wait(self, match) -> dict:
        while True:
            m = self.got.get(timeout=60)
            if match(m):
                return m

    def answer(self, rid: int) -> dict:
        return self.wait(lambda m: m.get("id") == rid and "method" not in m)["result"]

    def close(self) -> None:
        self.p.stdin.close()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.terminate()
            self.p.wait()


def tasks() -> tuple:
    """Per run: tools/call -> task handle; -> completion known by tasks/get polled every
    pollIntervalMs; -> completion known by notifications/tasks on listen."""
    handle, polled, told = [], [], []
    w = Wire("--task-after", "0")
    try:
        call = {"name": "run_script", "arguments": {"code": "pass", "description": "task"}}
        w.answer(w.send("tools/call", call))  # warm-up
        for i in range(2 * N):
            t = time.perf_counter()
            r = w.answer(w.send("tools/call", call))
            assert r["resultType"] == "task", r
            handle.append(time.perf_counter() - t)
            task = r["taskId"]
            if i % 2 == 0:
                while True:
                    time.sleep(r["pollIntervalMs"] / 1000)
                    r = w.answer(w.send("tasks/get", {"taskId": task}))
                    if r["status"] in ("completed", "failed", "cancelled"):
                        break
                polled.append(time.perf_counter() - t)
            else:
                listen = w.send("subscriptions/listen", {"notifications": {"taskIds": [task]}})
                n = w.wait(lambda m: m.get("method") == "notifications/tasks" and m["params"]["taskId"] == task)
                told.append(time.perf_counter() - t)
                assert n["params"]["status"] == "completed", n
                w.send("notifications/cancelled", {"requestId": listen}, notification=True)
    finally:
        w.close()
    return handle, polled, told


async def cancels() -> list:
    out = []
    async with stdio_client(params(), errlog=open(os.devnull, "w")) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            for i in range(N):
                up = asyncio.Event()

                async def progress(*_a) -> None:
                    up.set()

                description = f"bench-cancel-{os.getpid()}-{i}"
                code = "import agent_tools, time\nagent_tools.progress(1, 2, 'x')\ntime.sleep(600)\n"
                call = asyncio.ensure_future(s.call_tool("run_script", {"code": code, "description": description},
                                                        progress_callback=progress))
                await up.wait()
                t0 = time.time()
                call.cancel()
                try:
                    await call
                except asyncio.CancelledError:
                    pass
                while True:
                    rows = json.loads(subprocess.run(
                        [SCRIPTGATE, "audit", "--embedded", "--json", "--limit", "5", "--config", str(CONFIG)],
                        capture_output=True, text=True, check=True).stdout)
                    mine = [row for row in rows if row["description"] == description and row["status"] != "running"]
                    if mine:
                        assert mine[0]["status"] == "cancelled", mine[0]["status"]
                        out.append(mine[0]["ended_at"] / 1000 - t0)
                        break
                    await asyncio.sleep(0.05)
    return out


def through_run() -> list:
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write("pass\n")
        f.flush()
        times = []
        for _ in range(N + 1):
            t = time.perf_counter()
            subprocess.run([SCRIPTGATE, "run", "--embedded", "--config", str(CONFIG), "--mcp", FLEET, f.name],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - t)
        return times[1:]


def line(name: str, t: list) -> float:
    med = statistics.median(t)
    print(f"{name:50} median {med * 1000:7.1f} ms   min {min(t) * 1000:7.1f}   max {max(t) * 1000:7.1f}   (n={len(t)})")
    return med


if __name__ == "__main__":
    try:
        print(f"{SCRIPTGATE}, an empty script, {N} times each")
        legacy = line("scriptgate mcp 2025-11-25: tools/call -> result", asyncio.run(through_mcp("legacy")))
        modern = line("scriptgate mcp 2026-07-28: tools/call -> result", asyncio.run(through_mcp("auto")))
        if os.geteuid() == 0:
            # A root embedded daemon keeps pre-made sandboxes (sandbox.pool_size, 2 by
            # default); a pause between calls lets the pool refill, as a model's turn
            # would. Pool and cold alternate, five rounds, so both see the same load.
            pooled, cold, before = [], [], starts()
            for _ in range(5):
                pooled += asyncio.run(through_mcp("auto", CONFIG, 0.1))
                cold += asyncio.run(through_mcp("auto", COLD, 0.1))
            after = starts()
            p = line("scriptgate mcp, pre-made sandboxes, 0.1 s apart", pooled)
            c = line("scriptgate mcp, cold (pool_size = 0), 0.1 s apart", cold)
            made = after.get("pre_made", 0) - before.get("pre_made", 0)
            print(f"pre-made / cold: {p / c:.2f}x; {made} of the {len(pooled) + 5} pooled daemons' runs "
                  f"started in a pre-made sandbox")
        else:
            print("(not root: the embedded daemon keeps no pre-made sandboxes; no pool figure)")
        r = line("scriptgate run (process per script)", through_run())
        print(f"ratio run / mcp (2025-11-25): {r / legacy:.1f}x; 2026-07-28 / 2025-11-25: {modern / legacy:.2f}")
        handle, polled, told = tasks()
        line("task: tools/call -> task handle", handle)
        line("task: -> completed, tasks/get every pollIntervalMs", polled)
        line("task: -> completed, notifications/tasks (listen)", told)
        line("cancel -> the script's record ended", asyncio.run(cancels()))
    finally:
        shutil.rmtree(STATE, ignore_errors=True)
