#!/usr/bin/env python3
"""scriptgate mcp, timed from the client: an empty script's tools/call to its
result through `scriptgate mcp` (one server, many calls, the official MCP Python
SDK's client over stdio), beside `scriptgate run` on the same script (a process,
its MCP server and an embedded daemon per run). Both run the embedded daemon, so
the difference is what one long-lived server saves per script. Then a cancel: from
the client's cancelling a running script's call (the SDK sends
notifications/cancelled) to the script's record saying it ended (`ended_at`,
written once its sandbox is gone).

usage: benches/mcp_server.py [N]   (the MCP SDK: clients/python/.venv/bin/python)
"""
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mcp import ClientSession, StdioServerParameters, stdio_client

REPO = Path(__file__).resolve().parents[1]
SCRIPTGATE = os.environ.get("SCRIPTGATE") or str(REPO / "target" / "release" / "scriptgate")
FLEET = f"fleet=python3 {REPO / 'examples' / 'fleet' / 'fleet_server.py'}"
N = int(sys.argv[1]) if len(sys.argv) > 1 else 20


async def through_mcp() -> list:
    params = StdioServerParameters(command=SCRIPTGATE, args=["mcp", "--embedded", "--mcp", FLEET])
    times = []
    async with stdio_client(params, errlog=open(os.devnull, "w")) as (r, w):
        async with ClientSession(r, w) as s:
            await s.initialize()
            await s.call_tool("run_script", {"code": "pass", "description": "warm-up"})
            for _ in range(N):
                t = time.perf_counter()
                res = await s.call_tool("run_script", {"code": "pass", "description": "empty"})
                times.append(time.perf_counter() - t)
                assert not res.is_error, res
    return times


async def cancels() -> list:
    import json
    state = "/var/lib/scriptgate/cli" if os.geteuid() == 0 else os.path.expanduser("~/.local/state/scriptgate")
    with tempfile.TemporaryDirectory() as d:
        config = Path(d) / "audit.toml"
        config.write_text(f'[state]\ndir = "{state}"\n')
        params = StdioServerParameters(command=SCRIPTGATE, args=["mcp", "--embedded", "--mcp", FLEET])
        out = []
        async with stdio_client(params, errlog=open(os.devnull, "w")) as (r, w):
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
                            [SCRIPTGATE, "audit", "--json", "--limit", "5", "--config", str(config), "--socket",
                             str(Path(d) / "none")], capture_output=True, text=True, check=True).stdout)
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
            subprocess.run([SCRIPTGATE, "run", "--embedded", "--mcp", FLEET, f.name], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - t)
        return times[1:]


def line(name: str, t: list) -> float:
    med = statistics.median(t)
    print(f"{name:38} median {med * 1000:7.1f} ms   min {min(t) * 1000:7.1f}   max {max(t) * 1000:7.1f}   (n={len(t)})")
    return med


if __name__ == "__main__":
    print(f"{SCRIPTGATE}, an empty script, {N} times each")
    m = line("scriptgate mcp: tools/call -> result", asyncio.run(through_mcp()))
    r = line("scriptgate run (process per script)", through_run())
    print(f"ratio run / mcp: {r / m:.1f}x")
    line("cancel -> the script's record ended", asyncio.run(cancels()))
