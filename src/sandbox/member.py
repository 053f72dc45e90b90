"""A pre-made sandbox's Python (scriptgate's pool): started before its run is
known, with agent_tools already imported, it waits on its stdin for one script.

It first says it is ready on the tool channel (fd 3). The daemon then mounts
the run's workspace into the sandbox (the mount helper,
`sandbox::mounter`), then writes one JSON line, {"workspace": PATH, "name":
FILE}, then the script's code, and closes the pipe: the close is the "go". The
script then runs as the cold path runs it: in a fresh __main__, named
/run/scriptgate-script/FILE, from the workspace, with /dev/null as stdin.

A script is refused (exit status 125, the reason on stderr) unless a mount is at
the workspace's path: code never runs in a sandbox whose workspace is missing.
"""

import json
import os
import sys
import types

import agent_tools  # noqa: F401  (imported ahead, so that the script's import is free)

SCRIPT_MOUNT = "/run/scriptgate-script"
REFUSED = 125
HEADER_MAX = 8192


def _unescape(field):
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out = bytearray()
    i = 0
    while i < len(field):
        if field[i] == 0x5C and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(int(field[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)


def _mount_points():
    with open("/proc/self/mountinfo", "rb") as f:
        return {_unescape(line.split(b" ")[4]) for line in f}


def _refuse(why):
    sys.stderr.write("scriptgate: " + why + "; the script was not run\n")
    sys.stderr.flush()
    os._exit(REFUSED)


def _read_run():
    # Read with os.read on fd 0 itself: a file object over it would close fd 0
    # when collected, after /dev/null took its place.
    header = b""
    while not header.endswith(b"\n"):
        b = os.read(0, 1)
        if not b:
            _refuse("no run came")
        header += b
        if len(header) > HEADER_MAX:
            _refuse("a run header longer than %d bytes" % HEADER_MAX)
    chunks = []
    while True:
        b = os.read(0, 1 << 16)
        if not b:
            break
        chunks.append(b)
    run = json.loads(header)
    # The script's stdin is /dev/null, as on the cold path.
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return run["workspace"], run["name"], b"".join(chunks)


def _ready():
    # One line on the tool channel before any run: the sandbox is built (bwrap
    # is done with its mounts) and Python is warm, so the daemon may start the
    # mount helper, which enters the sandbox's mount namespace as it is now.
    os.write(3, b'{"op": "member-ready"}\n')


def main():
    _ready()
    workspace, name, code = _read_run()
    if os.fsencode(workspace) not in _mount_points():
        _refuse("no workspace is mounted at %s" % workspace)
    os.chdir(workspace)
    os.environ["PWD"] = workspace  # as bwrap's --chdir sets it on the cold path
    path = SCRIPT_MOUNT + "/" + os.path.basename(name)
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [path]
    sys.path[0] = SCRIPT_MOUNT
    source = code.decode("utf-8", "surrogateescape")
    import linecache

    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    try:
        exec(compile(code, path, "exec"), module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        # As Python reports an uncaught exception, without this frame.
        sys.excepthook(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


main()
