#!/usr/bin/python3
"""In the guest: the median start-to-finish of an empty script through the
installed daemon, beside a bare bwrap + python3 start in the same guest.

  bench_backends.py LABEL ROUNDS     (the share's client/ on sys.path)

The script time is the engine's: from script.start sent to script.finished
received over the socket (the Python client's run()), as root with the package's
token key; the scripts run as the packaged run_as (scriptgate-script). The bare figure is bwrap with the same
namespaces around `python3 -c pass`, as nobody, fork to exit. Rounds alternate
the two, so a slow spell of the (emulated) machine costs both alike. Each round
also times, from script.start sent, the engine's receiving the first tool.call of
a script whose first line calls a tool (`first_call_ms`, median, and its largest,
`first_call_max_ms`). Prints one line: `bench LABEL script_ms=… bare_ms=… ratio=…
first_call_ms=… first_call_max_ms=…`.

With pre-made sandboxes (a LABEL ending in `+pool`), each round first waits,
outside its timing, for one to be waiting (daemon.info's `pool.waiting`), so
that every timed script is a pre-made one."""
import asyncio, os, pwd, statistics, subprocess, sys, time, uuid

sys.path.insert(0, "/mnt/host/client")
from scriptgate_client import Client, Snapshot, Tool, ToolClass, load_key, mint_token, prepare_workspace  # noqa: E402

label, rounds = sys.argv[1], int(sys.argv[2])
nobody = pwd.getpwnam("nobody")
ROOT = "/var/lib/scriptgate/workspaces"


def bare():
    args = ["/usr/bin/bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
    for d in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp", "/usr/bin/python3", "-c", "pass"]

    def drop():
        os.setgroups([])
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)

    t = time.perf_counter()
    subprocess.run(args, check=True, preexec_fn=drop)
    return (time.perf_counter() - t) * 1000


async def member_waiting(sg):
    for _ in range(1200):
        info = await sg.request("daemon.info")
        if (info.get("pool") or {}).get("waiting", 0) >= 1:
            return
        await asyncio.sleep(0.05)
    sys.exit(f"bench {label}: no pre-made sandbox came in 60 s")


PING = Tool("b__ping", ToolClass.READ, {"type": "object", "properties": {}})
first_call = {}  # script id -> when its first tool.call came


def ping(call):
    first_call.setdefault(call.script_id, time.perf_counter())
    return {"text": "pong", "is_error": False}


async def timed(sg, key, code, tools):
    """One script through the daemon: (its start's time, its result)."""
    if label.endswith("+pool"):
        await member_waiting(sg)
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    snap = Snapshot(str(prepare_workspace(os.path.join(ROOT, run_id))), "auto", tools)
    t = time.perf_counter()
    r = await sg.run(mint_token(key, run_id, snap, 600), code, [], "bench")
    if not r.ok:
        sys.exit(f"bench {label}: the script ended {r.status}: {r.text}")
    return t, r


async def main():
    key = load_key("/etc/scriptgate/token.key")
    script, plain, calls = [], [], []
    async with Client("/run/scriptgate/scriptgate.sock", tool_handler=ping) as sg:
        for i in range(rounds + 1):
            t, _ = await timed(sg, key, "pass\n", [])
            took = (time.perf_counter() - t) * 1000
            b = bare()
            t, r = await timed(sg, key, "import agent_tools\nagent_tools.call('b__ping', {})\n", [PING])
            call = (first_call[r.script_id] - t) * 1000
            if i:  # the first round warms the caches
                script.append(took)
                plain.append(b)
                calls.append(call)
    s, b = statistics.median(script), statistics.median(plain)
    print(f"bench {label} script_ms={s:.0f} bare_ms={b:.0f} ratio={s / b:.2f} "
          f"first_call_ms={statistics.median(calls):.0f} first_call_max_ms={max(calls):.0f} rounds={rounds}")


asyncio.run(main())
