#!/usr/bin/env python3
"""The MCP client of `scriptgate run`, timed: one script that makes 2000 calls
(`call_many`, 4 in flight; `--calls N` raises `--max-calls` to match) to the
fleet MCP server, run with `scriptgate run --embedded` several times, and, given a second binary (the build before a
change), the two in turn, A B A B, with the ratio pair by pair. What is timed is
the whole process: the server's start and handshake, tools/list, the embedded
daemon, the sandbox and Python, and the 2000 tools/call round trips.

usage: benches/mcp_client.py [--vs OTHER_SCRIPTGATE] [--rounds N] [--calls N]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLEET = f"fleet=python3 {REPO / 'examples' / 'fleet' / 'fleet_server.py'}"
CALLS = 2000


def once(binary: str, script: Path) -> float:
    t = time.monotonic()
    r = subprocess.run(
        [binary, "run", "--embedded", "--max-calls", str(CALLS), "--mcp", FLEET, str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    took = time.monotonic() - t
    if r.returncode != 0 or "ok" not in r.stdout:
        sys.exit(f"{binary}: exit {r.returncode}: {r.stderr[-2000:]}")
    return took


def show(name: str, xs: list) -> None:
    print(f"{name}: median {statistics.median(xs):.3f} s, min {min(xs):.3f}, max {max(xs):.3f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--binary", default=os.environ.get("SCRIPTGATE") or str(REPO / "target/release/scriptgate"))
    p.add_argument("--vs", help="a second scriptgate binary, timed in turn with the first")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    global CALLS
    CALLS = a.calls
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "calls.py"
        script.write_text(
            "import agent_tools as t\n"
            f"sns = ['SN%04d' % (i % 500) for i in range({a.calls})]\n"
            "r = t.call_many('fleet__get_device_status', [{'sn': s} for s in sns])\n"
            f"assert len(r) == {a.calls}\n"
            "print('ok')\n"
        )
        binaries = [a.binary] + ([a.vs] if a.vs else [])
        for b in binaries:
            once(b, script)  # warm-up
        times = {b: [] for b in binaries}
        for _ in range(a.rounds):
            for b in binaries:
                times[b].append(once(b, script))
    print(f"{a.calls} calls through scriptgate run --embedded, {a.rounds} rounds")
    for b in binaries:
        show(b, times[b])
    if a.vs:
        ratios = [x / y for x, y in zip(times[a.binary], times[a.vs])]
        print(f"ratio {a.binary} / {a.vs}: median {statistics.median(ratios):.2f}, "
              f"min {min(ratios):.2f}, max {max(ratios):.2f}")


if __name__ == "__main__":
    main()
