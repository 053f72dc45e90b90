#!/usr/bin/env python3
"""A complete scriptgate engine over an in-memory fleet, using scriptgate_client (pip install
./clients/python): starts a script that reboots the offline devices, answers its tool calls,
approves its declared write, prints the result text; exits 1 unless the script ended ok.
usage: engine.py [SOCKET [KEY_FILE [WORKSPACE_ROOT]]], else SCRIPTGATE_SOCKET, SCRIPTGATE_KEY_FILE,
SCRIPTGATE_WORKSPACE_ROOT (defaults: /run/scriptgate/scriptgate.sock, /etc/scriptgate/token.key,
/var/lib/scriptgate/workspaces, and its <uid>/ for a non-root engine). It must be in the daemon's workspace.roots."""
import asyncio, os, sys, uuid
from scriptgate_client import Client, Snapshot, Tool, load_key, mint_token, prepare_workspace
arg = lambda i, env, default: sys.argv[i] if len(sys.argv) > i else os.environ.get(env, default)
SOCK, KEY = arg(1, "SCRIPTGATE_SOCKET", "/run/scriptgate/scriptgate.sock"), arg(2, "SCRIPTGATE_KEY_FILE", "/etc/scriptgate/token.key")
ROOT = arg(3, "SCRIPTGATE_WORKSPACE_ROOT", "/var/lib/scriptgate/workspaces" + (f"/{os.getuid()}" if os.getuid() else ""))
FLEET = {f"SN{i}": {"sn": f"SN{i}", "online": i % 4 != 0} for i in range(12)}
SN = {"type": "object", "properties": {"sn": {"type": "string"}}, "required": ["sn"]}
CODE = """import agent_tools
sns = agent_tools.call("fleet__list_devices", {})["devices"]
offline = [d["sn"] for d in agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in sns]) if not d["online"]]
for sn in offline:
    print(agent_tools.call("fleet__reboot_device", {"sn": sn}))
print(f"{len(sns)} devices checked, {len(offline)} rebooted")
"""
def tool(call):  # stands in for the engine's normal tool path (policy, MCP, result processing)
    if call.tool == "fleet__list_devices":
        return {"text": "", "structured": {"devices": sorted(FLEET)}, "is_error": False}
    dev = FLEET[call.arguments["sn"]]
    if call.tool == "fleet__reboot_device":
        dev["online"] = True
        return {"text": f"rebooted {dev['sn']}", "structured": None, "is_error": False}
    return {"text": str(dev), "structured": dev, "is_error": False}
async def main():
    run_id = f"example-{uuid.uuid4().hex[:8]}"
    snap = Snapshot(str(prepare_workspace(os.path.join(ROOT, run_id), created_by="examples/engine.py")), "approval", [Tool.read("fleet__list_devices",
        {"type": "object"}), Tool.read("fleet__get_device_status", SN), Tool.write("fleet__reboot_device", SN)])
    approve = lambda req: print("approving", [t["name"] for t in req.tools], file=sys.stderr) or True
    async with Client(SOCK, tool_handler=tool, approval_handler=approve) as sg:
        r = await sg.run(mint_token(load_key(KEY), run_id, snap, 600), CODE, ["fleet__reboot_device"], "reboot offline devices")
    print(r.text)
    sys.exit(0 if r.ok else 1)
asyncio.run(main())
