"""What every Python host test of tests/hosts shares: how `scriptgate mcp` is started
(stdio, the embedded daemon, the fleet server of examples/fleet as the upstream), the
scripts each host runs, and the records that say how a script ended.

All tests of one run share one state directory ($SCRIPTGATE_HOSTS_STATE, made and
removed by tests/hosts/run-tests; one of their own when run alone): its config makes
the embedded daemon keep its records and workspaces there, away from the user's own
and from other runs on the machine. Each script is found in the records by its
description, made unique per test."""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[3]
SCRIPTGATE = Path(os.environ.get("SCRIPTGATE") or REPO / "target" / "debug" / "scriptgate")
FLEET_SERVER = REPO / "examples" / "fleet" / "fleet_server.py"


def _state() -> Path:
    given = os.environ.get("SCRIPTGATE_HOSTS_STATE")
    if given:
        return Path(given)
    made = Path(tempfile.mkdtemp(prefix="sg-hosts-"))
    atexit.register(shutil.rmtree, made, True)
    os.environ["SCRIPTGATE_HOSTS_STATE"] = str(made)
    return made


STATE = _state()
CONFIG = STATE / "scriptgate.toml"
if not CONFIG.exists():
    CONFIG.write_text(f'[state]\ndir = "{STATE}"\n')


def mcp_args(*extra: str) -> List[str]:
    """`scriptgate mcp`'s arguments (after the program): the embedded daemon with this
    run's state, the fleet server upstream."""
    return ["mcp", "--embedded", "--config", str(CONFIG), "--mcp", f"fleet=python3 {FLEET_SERVER}", *extra]


def unique(label: str) -> str:
    return f"{label}-{os.getpid()}-{time.monotonic_ns()}"


# The 500-call script: every device's status, and a summary line the host must hand
# its model.
SUMMARY_CODE = """import agent_tools
got = agent_tools.call_many('fleet__get_device_status', [{'sn': f'SN{i:04d}'} for i in range(500)])
online = sum(1 for d in got if d['online'])
hot = sorted(d['sn'] for d in got if d['temperature_c'] > 77)
print(f'fleet summary: {online} of {len(got)} online; over 77 C: {" ".join(hot)}')
"""


def expected_summary() -> str:
    """The summary line, computed here from the fleet server's own data."""
    spec = importlib.util.spec_from_file_location("fleet_server", FLEET_SERVER)
    assert spec and spec.loader
    fleet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fleet)
    devices = list(fleet.DEVICES.values())
    online = sum(1 for d in devices if d["online"])
    hot = sorted(d["sn"] for d in devices if d["temperature_c"] > 77)
    return f"fleet summary: {online} of {len(devices)} online; over 77 C: {' '.join(hot)}"


# A script that fails after printing: its output and its error's tail must reach the host.
FAIL_CODE = "print('checked 3 devices')\nraise RuntimeError('SN0042 did not answer')\n"
FAIL_OUTPUT = "checked 3 devices"
FAIL_TAIL = "RuntimeError: SN0042 did not answer"

# A declared write: rebooting one device (fleet__reboot_device is a write tool).
REBOOT_CODE = "import agent_tools\nprint('reboot:', agent_tools.call('fleet__reboot_device', {'sn': 'SN0001'}))\n"
REBOOT_TOOLS = ["fleet__reboot_device"]
REBOOTED = "reboot: {'rebooted': True, 'sn': 'SN0001'}"
# What a host that cannot be asked is told (ui.rs, CANNOT_ASK).
CANNOT_ASK = "this MCP client cannot be asked"

# A script that runs until cancelled.
SLEEP_CODE = "import agent_tools, time\nagent_tools.progress(1, 2, 'waiting')\ntime.sleep(600)\n"


def reboot_args(description: str) -> Dict[str, Any]:
    return {"code": REBOOT_CODE, "tools": REBOOT_TOOLS, "description": description}


def audit(limit: int = 500) -> List[dict]:
    """This run's records (`scriptgate audit --embedded --json`), newest first."""
    if not (STATE / "cli" / "scriptgate.db").exists():
        return []
    out = subprocess.run([str(SCRIPTGATE), "audit", "--embedded", "--json", "--config", str(CONFIG),
                          "--limit", str(limit)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    return got if isinstance(got, list) else got.get("scripts", [])


def record(description: str) -> Optional[dict]:
    mine = [r for r in audit() if r.get("description") == description]
    assert len(mine) <= 1, mine
    return mine[0] if mine else None


async def wait_record(description: str, running: bool = False, timeout: float = 60) -> dict:
    """The script's record once it exists and is running (`running`), or once it has
    ended: the records are polled (each poll a `scriptgate audit`)."""
    deadline = time.monotonic() + timeout
    while True:
        r = await asyncio.to_thread(record, description)
        if r is not None and (running or r["status"] != "running"):
            return r
        assert time.monotonic() < deadline, f"no {'running' if running else 'ended'} record of {description!r}: {r}"
        await asyncio.sleep(0.1)


def wait_record_sync(description: str, running: bool = False, timeout: float = 60) -> dict:
    return asyncio.run(wait_record(description, running, timeout))
