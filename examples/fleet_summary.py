# The 500-device fleet summary: one script instead of 500 model turns.
#   scriptgate run --mcp "fleet=python3 examples/fleet/fleet_server.py" examples/fleet_summary.py
import collections
import agent_tools

devices = agent_tools.call("fleet__list_devices", {})["devices"]
statuses = []
for start in range(0, len(devices), 100):
    batch = devices[start:start + 100]
    statuses += agent_tools.call_many("fleet__get_device_status", [{"sn": sn} for sn in batch])
    agent_tools.progress(len(statuses), len(devices), "querying devices")

offline = [s for s in statuses if not s["online"]]
hot = sorted((s for s in statuses if s["online"] and s["temperature_c"] > 70), key=lambda s: -s["temperature_c"])
firmware = collections.Counter(s["firmware"] for s in statuses)
by_site = collections.Counter(s["site"] for s in offline)

print(f"{len(statuses)} devices, {len(offline)} offline ({', '.join(f'{k} {v}' for k, v in sorted(by_site.items()))})")
print("firmware:", ", ".join(f"{v} x {k}" for k, v in firmware.most_common()))
print(f"{len(hot)} online devices above 70 C; hottest:", ", ".join(f"{s['sn']} {s['temperature_c']} C" for s in hot[:5]))
