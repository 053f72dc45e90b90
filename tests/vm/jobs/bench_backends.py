#!/usr/bin/python3
"""In the guest: the median start-to-finish of an empty script through the
installed daemon, beside a bare bwrap + python3 start in the same guest.

  bench_backends.py LABEL ROUNDS     (the share's client/ on sys.path)

The script time is the engine's: from script.start sent to script.finished
received over the socket (the Python client's run()), as root with the package's
token key; the scripts run as the packaged run_as (scriptgate-script). The bare figure is bwrap with the same
namespaces around `python3 -c pass`, as nobody, fork to exit. Rounds alternate
the two, so a slow spell of the (emulated) machine costs both alike. Prints one
line: `bench LABEL script_ms=… bare_ms=… ratio=…`.

With pre-made sandboxes (a LABEL ending in `+pool`), each round first waits,
outside its timing, for one to be waiting (daemon.info's `pool.waiting`), so
that every timed script is a pre-made one."""
import asyncio, os, pwd, statistics, subprocess, sys, time, uuid

sys.path.insert(0, "/mnt/host/client")
from scriptgate_client import Client, Snapshot, load_key, mint_token, prepare_workspace  # noqa: E402

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


async def main():
    key = load_key("/etc/scriptgate/token.key")
    script, plain = [], []
    async with Client("/run/scriptgate/scriptgate.sock") as sg:
        for i in range(rounds + 1):
            if label.endswith("+pool"):
                await member_waiting(sg)
            run_id = f"bench-{uuid.uuid4().hex[:8]}"
            snap = Snapshot(str(prepare_workspace(os.path.join(ROOT, run_id))), "auto", [])
            t = time.perf_counter()
            r = await sg.run(mint_token(key, run_id, snap, 600), "pass\n", [], "bench")
            took = (time.perf_counter() - t) * 1000
            if not r.ok:
                sys.exit(f"bench {label}: the empty script ended {r.status}: {r.text}")
            b = bare()
            if i:  # the first round warms the caches
                script.append(took)
                plain.append(b)
    s, b = statistics.median(script), statistics.median(plain)
    print(f"bench {label} script_ms={s:.0f} bare_ms={b:.0f} ratio={s / b:.2f} rounds={rounds}")


asyncio.run(main())
