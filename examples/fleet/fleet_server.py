#!/usr/bin/env python3
"""A small fleet-management MCP server over stdio, for scriptgate's examples.

500 simulated devices (SN0000..SN0499). Tools, with MCP annotations:
  list_devices          read         the serial numbers, optionally by site
  get_device_status     read         status of one device (structured)
  reboot_device         write        reboots one device (not destructive)
  wipe_device           destructive  factory reset
No dependencies beyond the Python standard library.
"""
import json
import random
import sys

SITES = ["ams", "fra", "lis", "waw"]
DEVICES = {}
rng = random.Random(42)
for i in range(500):
    sn = f"SN{i:04d}"
    DEVICES[sn] = {
        "sn": sn,
        "site": SITES[i % 4],
        "online": rng.random() > 0.07,
        "firmware": rng.choice(["4.2.1", "4.2.1", "4.2.1", "4.3.0", "4.1.9"]),
        "temperature_c": round(rng.uniform(31, 78), 1),
        "uptime_h": rng.randint(1, 9000),
    }

READ = {"readOnlyHint": True, "destructiveHint": False, "idempotentHint": True, "openWorldHint": False}
TOOLS = [
    {"name": "list_devices", "description": "List device serial numbers, optionally of one site.",
     "inputSchema": {"type": "object", "properties": {"site": {"type": "string", "enum": SITES}}, "additionalProperties": False},
     "annotations": READ},
    {"name": "get_device_status", "description": "Status of one device.",
     "inputSchema": {"type": "object", "properties": {"sn": {"type": "string"}}, "required": ["sn"], "additionalProperties": False},
     "annotations": READ},
    {"name": "reboot_device", "description": "Reboot one device.",
     "inputSchema": {"type": "object", "properties": {"sn": {"type": "string"}}, "required": ["sn"], "additionalProperties": False},
     "annotations": {"readOnlyHint": False, "destructiveHint": False, "idempotentHint": False, "openWorldHint": False}},
    {"name": "wipe_device", "description": "Factory-reset one device. Irreversible.",
     "inputSchema": {"type": "object", "properties": {"sn": {"type": "string"}}, "required": ["sn"], "additionalProperties": False},
     "annotations": {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": True, "openWorldHint": False}},
]


def result(payload, text=None, error=False):
    return {"content": [{"type": "text", "text": text if text is not None else json.dumps(payload)}],
            "structuredContent": payload, "isError": error}


def call(name, args):
    if name == "list_devices":
        site = args.get("site")
        return result({"devices": [d["sn"] for d in DEVICES.values() if site in (None, d["site"])]})
    dev = DEVICES.get(args.get("sn", ""))
    if dev is None:
        return {"content": [{"type": "text", "text": f"no device {args.get('sn')!r}"}], "isError": True}
    if name == "get_device_status":
        return result(dev)
    if name == "reboot_device":
        if not dev["online"]:
            return {"content": [{"type": "text", "text": f"{dev['sn']} is offline"}], "isError": True}
        dev["uptime_h"] = 0
        return result({"sn": dev["sn"], "rebooted": True})
    if name == "wipe_device":
        return result({"sn": dev["sn"], "wiped": True})
    raise KeyError(name)


def main():
    for line in sys.stdin:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        mid, method = msg.get("id"), msg.get("method")
        if mid is None:
            continue
        if method == "initialize":
            res = {"protocolVersion": msg["params"].get("protocolVersion", "2025-06-18"),
                   "capabilities": {"tools": {}}, "serverInfo": {"name": "fleet", "version": "1.0"}}
        elif method == "tools/list":
            res = {"tools": TOOLS}
        elif method == "tools/call":
            try:
                res = call(msg["params"]["name"], msg["params"].get("arguments") or {})
            except KeyError:
                out = {"jsonrpc": "2.0", "id": mid, "error": {"code": -32602, "message": "unknown tool"}}
                print(json.dumps(out), flush=True)
                continue
        elif method == "ping":
            res = {}
        else:
            print(json.dumps({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": method}}), flush=True)
            continue
        print(json.dumps({"jsonrpc": "2.0", "id": mid, "result": res}), flush=True)


if __name__ == "__main__":
    main()
