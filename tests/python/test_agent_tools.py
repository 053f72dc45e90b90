"""agent_tools.py, the module scripts import, tested on its own: the file in the
tree (src/sandbox/agent_tools.py) is imported by a Python child whose fds 3 and 4
are pipes, and this test plays the daemon's broker on the other ends, one JSON
object per line (man/scriptgate-protocol.7, "script messages"; the daemon's side
is src/protocol/script.rs). Editing the module needs no rebuild to test it.

The daemon ships this same file: src/daemon/mod.rs embeds it with
include_str!("../sandbox/agent_tools.py"), so the copy the sandbox mounts cannot
differ from the one tested here (and the Rust suites run it end to end).

Run with tests/python/run-tests (which .ci/run calls).
"""

import fcntl
import json
import os
import queue
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SANDBOX = os.path.join(REPO, "src", "sandbox")
WAIT_S = 20

# The child: its two pipe ends become fds 3 (requests out) and 4 (replies in), as
# the daemon's sandbox init leaves them; then the script runs as __main__.
DRIVER = r"""
import os, sys
w, r = int(sys.argv[1]), int(sys.argv[2])
os.dup2(w, 3, inheritable=False)
os.dup2(r, 4, inheritable=False)
os.close(w)
os.close(r)
sys.path.insert(0, sys.argv[3])
exec(compile(sys.argv[4], "<script>", "exec"), {"__name__": "__main__"})
"""

EOF_MARK = object()


class Broker:
    """The daemon's side of one script's fds 3 and 4."""

    def __init__(self, code, channel=True):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        # Above 4, so that the child's dup2 onto 3 and 4 clobbers nothing.
        cw = fcntl.fcntl(req_w, fcntl.F_DUPFD, 20)
        cr = fcntl.fcntl(rep_r, fcntl.F_DUPFD, 20)
        os.close(req_w)
        os.close(rep_r)
        argv = [sys.executable, "-B", "-c", DRIVER, str(cw), str(cr), SANDBOX, code]
        if not channel:
            # No fds 3/4: the driver's dup2 is skipped by running the script plainly.
            argv = [sys.executable, "-B", "-c", f"import sys; sys.path.insert(0, {SANDBOX!r})\n" + code]
        self.proc = subprocess.Popen(
            argv,
            pass_fds=(cw, cr) if channel else (),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        os.close(cw)
        os.close(cr)
        self._requests = os.fdopen(req_r, "rb")
        self._replies = os.fdopen(rep_w, "wb", buffering=0)
        self._queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._requests:
            self._queue.put(json.loads(line))
        self._queue.put(EOF_MARK)

    def next(self):
        """The script's next request (waits for it)."""
        try:
            msg = self._queue.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"no request within {WAIT_S}s: {self._stderr_so_far()}")
        assert msg is not EOF_MARK, f"the script closed fd 3: {self.finish()}"
        return msg

    def reply(self, obj):
        self._replies.write((json.dumps(obj) + "\n").encode())

    def close_replies(self):
        self._replies.close()

    def _stderr_so_far(self):
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")

    def finish(self):
        """Wait for the script to end: (exit status, stdout, stderr); every request
        it sent was taken with next() (fd 3 holds no more)."""
        try:
            out, err = self.proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"the script did not end: {err.decode(errors='replace')}")
        self._reader.join(WAIT_S)
        left = []
        while True:
            m = self._queue.get_nowait()
            if m is EOF_MARK:
                break
            left.append(m)
        assert left == [], f"requests not taken: {left}"
        if not self._replies.closed:
            self._replies.close()
        return self.proc.returncode, out.decode(), err.decode()

    def result(self):
        """The script's last stdout line, as JSON; the script must exit 0."""
        rc, out, err = self.finish()
        assert rc == 0, err
        return json.loads(out.strip().splitlines()[-1])


# Scripts print what they got as one JSON line; a ToolError as its three fields.
PRELUDE = """
import json, agent_tools as t
def show(v):
    if isinstance(v, t.ToolError):
        return {"ToolError": [v.tool, v.code, v.message, str(v)]}
    return v
def attempt(f, *a, **k):
    try:
        return show(f(*a, **k))
    except t.ToolError as e:
        return show(e)
"""


def script(body):
    return PRELUDE + body


def ok(text="", structured=None, is_error=False, code=None):
    r = {"text": text, "structured": structured, "is_error": is_error}
    if code is not None:
        r["code"] = code
    return {"result": r}


# -- call ---------------------------------------------------------------------


def test_call_sends_one_request_and_returns_structured_else_text():
    b = Broker(script(
        "a = t.call('fleet__get_device_status', {'sn': 'SN1'})\n"
        "b = t.call('fleet__list_devices')\n"
        "print(json.dumps([a, b]))\n"
    ))
    first = b.next()
    assert first == {"op": "call", "tool": "fleet__get_device_status", "args": {"sn": "SN1"}, "id": 1}
    b.reply({"id": 1, **ok("SN1 online", {"sn": "SN1", "online": True})})
    second = b.next()
    # No args: an empty object, never null; ids count up.
    assert second == {"op": "call", "tool": "fleet__list_devices", "args": {}, "id": 2}
    b.reply({"id": 2, **ok("3 devices")})
    assert b.result() == [{"sn": "SN1", "online": True}, "3 devices"]


def test_call_raises_tool_error_for_a_tools_error_and_for_a_refusal():
    b = Broker(script(
        "a = attempt(t.call, 'fleet__fail', {})\n"
        "b = attempt(t.call, 'fleet__fail', {})\n"
        "c = attempt(t.call, 'fleet__reboot_device', {'sn': 'A'})\n"
        "d = attempt(t.call, 'fleet__fail', {})\n"
        "print(json.dumps([a, b, c, d]))\n"
    ))
    b.reply({"id": b.next()["id"], **ok("device unreachable", is_error=True)})
    b.reply({"id": b.next()["id"], **ok("over budget", is_error=True, code="limit")})
    b.reply({"id": b.next()["id"], "error": {"code": "denied", "message": "a write tool not declared"}})
    b.reply({"id": b.next()["id"], **ok("", is_error=True)})
    assert b.result() == [
        {"ToolError": ["fleet__fail", "tool_error", "device unreachable", "fleet__fail: tool_error: device unreachable"]},
        {"ToolError": ["fleet__fail", "limit", "over budget", "fleet__fail: limit: over budget"]},
        {"ToolError": ["fleet__reboot_device", "denied", "a write tool not declared",
                       "fleet__reboot_device: denied: a write tool not declared"]},
        {"ToolError": ["fleet__fail", "tool_error", "tool reported an error",
                       "fleet__fail: tool_error: tool reported an error"]},
    ]


def test_bad_arguments_are_type_errors_and_send_nothing():
    b = Broker(script(
        "out = []\n"
        "for tool, args in [(1, {}), ('fleet__x', [1]), ('fleet__x', 'sn')]:\n"
        "    try:\n"
        "        t.call(tool, args)\n"
        "    except TypeError as e:\n"
        "        out.append(str(e))\n"
        "try:\n"
        "    t.call_many('fleet__x', [{}, 3])\n"
        "except TypeError as e:\n"
        "    out.append(str(e))\n"
        "print(json.dumps(out))\n"
    ))
    assert b.result() == [
        "tool must be a str, e.g. 'fleet__get_device_status'",
        "fleet__x: args must be a dict of the tool's arguments",
        "fleet__x: args must be a dict of the tool's arguments",
        "fleet__x: args must be a dict of the tool's arguments",
    ]


def test_replies_are_matched_by_id_across_threads():
    b = Broker(script(
        "import threading\n"
        "got = {}\n"
        "def one(sn):\n"
        "    got[sn] = t.call('fleet__get_device_status', {'sn': sn})\n"
        "ts = [threading.Thread(target=one, args=(f'SN{i}',)) for i in range(4)]\n"
        "[x.start() for x in ts]\n"
        "[x.join() for x in ts]\n"
        "print(json.dumps(got, sort_keys=True))\n"
    ))
    reqs = [b.next() for _ in range(4)]
    assert sorted(r["id"] for r in reqs) == [1, 2, 3, 4]
    # Answered last first, with a line that is no reply and one for no one between.
    b.reply({"id": 999, **ok("stray")})
    b._replies.write(b"not json\n[1]\n")
    for r in reversed(reqs):
        b.reply({"id": r["id"], **ok(structured={"sn": r["args"]["sn"]})})
    assert b.result() == {f"SN{i}": {"sn": f"SN{i}"} for i in range(4)}


def test_a_closed_channel_is_an_engine_error_for_the_call_waiting_and_the_next():
    b = Broker(script(
        "a = attempt(t.call, 'fleet__list_devices', {})\n"
        "b = attempt(t.call_raw, 'fleet__list_devices', {})\n"
        "c = attempt(t.call_many, 'fleet__list_devices', [{}])\n"
        "d = t.call_many('fleet__list_devices', [{}, {}], return_errors=True)\n"
        "print(json.dumps([a, b, c, [show(x) for x in d]]))\n"
    ))
    b.next()
    b.close_replies()
    lost = "the daemon closed the tool channel (script cancelled or timed out?)"
    err = {"ToolError": ["fleet__list_devices", "engine", lost, f"fleet__list_devices: engine: {lost}"]}
    # After the first loss nothing more is sent: the channel is dead.
    assert b.result() == [err, err, err, [err, err]]


def test_without_fds_3_and_4_the_first_call_says_how_to_run_it():
    b = Broker(
        "import json, agent_tools as t\n"
        "try:\n"
        "    t.call('fleet__list_devices')\n"
        "except RuntimeError as e:\n"
        "    print(json.dumps(str(e)))\n",
        channel=False,
    )
    assert b.result() == "agent_tools: no daemon channel on fd 3/4; run this script with scriptgate"


# -- call_raw -----------------------------------------------------------------


def test_call_raw_returns_the_tools_errors_and_raises_refusals_and_engine_failures():
    b = Broker(script(
        "a = attempt(t.call_raw, 'fleet__get_device_status', {'sn': 'SN1'})\n"
        "b = attempt(t.call_raw, 'fleet__fail')\n"
        "c = attempt(t.call_raw, 'fleet__fail')\n"
        "d = attempt(t.call_raw, 'fleet__fail')\n"
        "e = attempt(t.call_raw, 'fleet__fail')\n"
        "print(json.dumps([a, b, c, d, e]))\n"
    ))
    r = b.next()
    assert r == {"op": "call", "tool": "fleet__get_device_status", "args": {"sn": "SN1"}, "id": 1}
    b.reply({"id": 1, "result": {"text": "SN1 online", "structured": {"online": True}, "is_error": False, "extra": 1}})
    b.reply({"id": b.next()["id"], **ok("device unreachable", is_error=True, code="tool_error")})
    b.reply({"id": b.next()["id"], "error": {"code": "invalid_arguments", "message": "sn: required"}})
    b.reply({"id": b.next()["id"], **ok("the engine answered -32000", is_error=True, code="engine")})
    b.reply({"id": b.next()["id"], **ok("", is_error=True, code="engine")})
    assert b.result() == [
        # Exactly the three keys, whatever else the reply held.
        {"text": "SN1 online", "structured": {"online": True}, "is_error": False},
        {"text": "device unreachable", "structured": None, "is_error": True},
        {"ToolError": ["fleet__fail", "invalid_arguments", "sn: required", "fleet__fail: invalid_arguments: sn: required"]},
        {"ToolError": ["fleet__fail", "engine", "the engine answered -32000",
                       "fleet__fail: engine: the engine answered -32000"]},
        {"ToolError": ["fleet__fail", "engine", "the engine failed", "fleet__fail: engine: the engine failed"]},
    ]


# -- call_many ----------------------------------------------------------------


def test_call_many_sends_batches_of_50_two_ahead_and_keeps_input_order():
    b = Broker(script(
        "out = t.call_many('fleet__get_device_status', [{'sn': f'SN{i}'} for i in range(120)])\n"
        "print(json.dumps(out))\n"
    ))
    first, second = b.next(), b.next()
    assert (first["op"], first["tool"], first["id"]) == ("call_many", "fleet__get_device_status", 1)
    assert first["args_list"] == [{"sn": f"SN{i}"} for i in range(50)]
    assert second["args_list"] == [{"sn": f"SN{i}"} for i in range(50, 100)]
    # The third batch goes out only when the first is answered.
    assert b._queue.empty()

    def answer(req):
        b.reply({"id": req["id"], "results": [ok(structured=a["sn"]) for a in req["args_list"]]})

    answer(first)
    third = b.next()
    assert third["args_list"] == [{"sn": f"SN{i}"} for i in range(100, 120)]
    answer(third)
    answer(second)
    assert b.result() == [f"SN{i}" for i in range(120)]


def test_call_many_raises_the_first_failure_or_returns_it_in_place():
    items = [ok("a"), ok("bad", is_error=True), {"error": {"code": "limit", "message": "budget"}}, ok(structured=[4])]
    b = Broker(script(
        "raised = attempt(t.call_many, 'fleet__x', [{}] * 4)\n"
        "kept = t.call_many('fleet__x', [{}] * 4, return_errors=True)\n"
        "whole = t.call_many('fleet__x', [{}] * 2, return_errors=True)\n"
        "print(json.dumps([raised, [show(x) for x in kept], [show(x) for x in whole]]))\n"
    ))
    for _ in range(2):
        r = b.next()
        assert len(r["args_list"]) == 4
        b.reply({"id": r["id"], "results": items})
    r = b.next()
    b.reply({"id": r["id"], "error": {"code": "invalid_arguments", "message": "at most 50"}})
    whole = {"ToolError": ["fleet__x", "invalid_arguments", "at most 50", "fleet__x: invalid_arguments: at most 50"]}
    assert b.result() == [
        {"ToolError": ["fleet__x", "tool_error", "bad", "fleet__x: tool_error: bad"]},
        ["a", {"ToolError": ["fleet__x", "tool_error", "bad", "fleet__x: tool_error: bad"]},
         {"ToolError": ["fleet__x", "limit", "budget", "fleet__x: limit: budget"]}, [4]],
        [whole, whole],
    ]


def test_call_many_of_nothing_sends_nothing():
    b = Broker(script("print(json.dumps(t.call_many('fleet__x', [])))\n"))
    assert b.result() == []


# -- progress and the end -----------------------------------------------------


def test_progress_is_one_line_without_id_and_with_a_clipped_message():
    b = Broker(script(
        "t.progress(1, 9, 'first')\n"
        "t.progress(2.7, '9')\n"
        "t.progress(9, 9, 'x' * 600)\n"
        "print(json.dumps('done'))\n"
    ))
    assert b.next() == {"op": "progress", "done": 1, "total": 9, "message": "first"}
    assert b.next() == {"op": "progress", "done": 2, "total": 9, "message": ""}
    assert b.next() == {"op": "progress", "done": 9, "total": 9, "message": "x" * 500}
    assert b.result() == "done"


def test_an_uncaught_tool_error_tells_the_daemon_why_the_script_ends():
    b = Broker(script("t.call('fleet__x', {})\n"))
    b.reply({"id": b.next()["id"], "error": {"code": "limit", "message": "max_calls = 1 reached"}})
    assert b.next() == {"op": "uncaught", "code": "limit", "tool": "fleet__x"}
    rc, _, err = b.finish()
    assert rc == 1
    assert "agent_tools.ToolError: fleet__x: limit: max_calls = 1 reached" in err, err


def test_other_uncaught_errors_send_nothing():
    b = Broker(script("raise ValueError('boom')\n"))
    rc, _, err = b.finish()
    assert rc == 1
    assert "ValueError: boom" in err, err


def test_the_module_exports_what_the_man_page_names():
    b = Broker("import json, sys\nsys.path.insert(0, %r)\nimport agent_tools\nprint(json.dumps(agent_tools.__all__))\n" % SANDBOX,
               channel=False)
    assert b.result() == ["call", "call_many", "call_raw", "progress", "ToolError", "tools"]


# -- the typed API: tools.SERVER.TOOL ------------------------------------------
#
# The daemon answers {"op": "tools"} with the tools this script can call, their
# typed paths and keyword arguments already spelled (src/policy/describe.rs,
# script_tools; its Rust tests hold the spelling rules, and tests/it/typed_api.rs
# runs this module against the real daemon's list). These listings are in its
# format.


def param(key, schema, required=False, name=None):
    return {"key": key, "name": name or key, "required": required, "schema": schema}


def spec(name, path, params=(), description=None, cls="read", more=False):
    return {"name": name, "path": path, "class": cls, "description": description,
            "params": list(params), "more": more}


STATUS = spec("fleet__get_device_status", ["fleet", "get_device_status"],
              [param("sn", {"type": "string", "description": "Serial number."}, required=True),
               param("verbose", {"type": "boolean", "default": False})],
              description="Status of one device: online or not, and its firmware.")
LISTING = [
    STATUS,
    spec("fleet__reboot_device", ["fleet", "reboot_device"], [param("sn", {"type": "string"})], cls="write"),
    spec("my-srv__get.item", ["my_srv", "get_item"],
         [param("class", {"type": "integer"}, required=True, name="class_"),
          param("max-n", {"type": "integer"}, name="max_n")]),
    spec("ping", ["ping"]),
    spec("fleet__query", ["fleet", "query"], [param("q", {"type": "string"})], more=True),
]


def typed(body, listing=LISTING):
    """A Broker whose script's first request is `tools`, answered with `listing`."""
    b = Broker(script("from agent_tools import tools\n" + body))
    r = b.next()
    assert r == {"op": "tools", "id": 1}
    b.reply({"id": 1, "tools": listing})
    return b


def test_tools_is_asked_for_once_on_first_use_and_never_by_import_alone():
    b = Broker(script(
        "a = t.call('fleet__x')\n"
        "from agent_tools import tools\n"
        "x = dir(tools)\n"
        "y = dir(t.tools)\n"
        "print(json.dumps([a, x, y]))\n"
    ))
    assert b.next() == {"op": "call", "tool": "fleet__x", "args": {}, "id": 1}
    b.reply({"id": 1, **ok("x")})
    assert b.next() == {"op": "tools", "id": 2}
    b.reply({"id": 2, "tools": LISTING})
    assert b.result() == ["x", ["fleet", "my_srv", "ping"], ["fleet", "my_srv", "ping"]]


def test_a_typed_call_is_the_same_request_and_result_as_call():
    b = typed(
        "a = tools.fleet.get_device_status(sn='SN1')\n"
        "b = t.call('fleet__get_device_status', {'sn': 'SN1'})\n"
        "c = tools.fleet.get_device_status(sn='SN2', verbose=True)\n"
        "d = tools.ping()\n"
        "e = attempt(tools.fleet.reboot_device, sn='SN1')\n"
        "print(json.dumps([a, b, c, d, e]))\n"
    )
    assert b.next() == {"op": "call", "tool": "fleet__get_device_status", "args": {"sn": "SN1"}, "id": 2}
    b.reply({"id": 2, **ok("on", {"online": True})})
    assert b.next() == {"op": "call", "tool": "fleet__get_device_status", "args": {"sn": "SN1"}, "id": 3}
    b.reply({"id": 3, **ok("on", {"online": True})})
    # Omitted optional arguments are not sent: the tool applies its defaults.
    assert b.next()["args"] == {"sn": "SN2", "verbose": True}
    b.reply({"id": 4, **ok("off")})
    assert b.next() == {"op": "call", "tool": "ping", "args": {}, "id": 5}
    b.reply({"id": 5, **ok("pong")})
    # The daemon's refusals come back as from call().
    assert b.next()["tool"] == "fleet__reboot_device"
    b.reply({"id": 6, "error": {"code": "denied", "message": "not declared"}})
    assert b.result() == [{"online": True}, {"online": True}, "off", "pong",
                          {"ToolError": ["fleet__reboot_device", "denied", "not declared",
                                         "fleet__reboot_device: denied: not declared"]}]


def test_many_and_raw_are_call_many_and_call_raw():
    b = typed(
        "a = tools.fleet.get_device_status.many([{'sn': s} for s in ('A', 'B')])\n"
        "b = t.call_many('fleet__get_device_status', [{'sn': s} for s in ('A', 'B')])\n"
        "c = tools.fleet.get_device_status.raw(sn='A')\n"
        "d = t.call_raw('fleet__get_device_status', {'sn': 'A'})\n"
        "e = [show(x) for x in tools.fleet.get_device_status.many([{'sn': 'A'}, {'sn': 'B'}], return_errors=True)]\n"
        "print(json.dumps([a, b, c, d, e]))\n"
    )
    for n in (2, 3):
        assert b.next() == {"op": "call_many", "tool": "fleet__get_device_status",
                            "args_list": [{"sn": "A"}, {"sn": "B"}], "id": n}
        b.reply({"id": n, "results": [ok(structured="A"), ok(structured="B")]})
    for n in (4, 5):
        assert b.next() == {"op": "call", "tool": "fleet__get_device_status", "args": {"sn": "A"}, "id": n}
        b.reply({"id": n, **ok("down", is_error=True, code="tool_error")})
    r = b.next()
    b.reply({"id": r["id"], "results": [ok(structured="A"), ok("down", is_error=True)]})
    raw = {"text": "down", "structured": None, "is_error": True}
    assert b.result() == [["A", "B"], ["A", "B"], raw, raw,
                          ["A", {"ToolError": ["fleet__get_device_status", "tool_error", "down",
                                               "fleet__get_device_status: tool_error: down"]}]]


def test_bad_arguments_raise_invalid_arguments_and_send_nothing():
    sig = "tools.fleet.get_device_status(*, sn: str, verbose: bool = False)"
    b = typed(
        "out = [attempt(tools.fleet.get_device_status, sn='A', serial='A'),\n"
        "       attempt(tools.fleet.get_device_status, verbose=True),\n"
        "       attempt(tools.fleet.get_device_status, 'A'),\n"
        "       attempt(tools.fleet.get_device_status.raw, sn='A', x=1, y=2),\n"
        "       attempt(tools.fleet.get_device_status.many, [{'sn': 'A'}, {'sn': 'B', 'bad': 1}]),\n"
        "       attempt(tools.my_srv.get_item, class_=1, **{'class': 2})]\n"
        "kept = tools.fleet.get_device_status.many([{}, {'sn': 'B'}], return_errors=True)\n"
        "print(json.dumps(out + [[show(x) for x in kept]]))\n"
    )
    # The only request: the good item of the last call_many.
    r = b.next()
    assert r == {"op": "call_many", "tool": "fleet__get_device_status", "args_list": [{"sn": "B"}], "id": 2}
    b.reply({"id": 2, "results": [ok(structured="B")]})

    def refused(why, tool="fleet__get_device_status", signature=sig):
        msg = f"{why}; {signature}"
        return {"ToolError": [tool, "invalid_arguments", msg, f"{tool}: invalid_arguments: {msg}"]}

    assert b.result() == [
        refused("unknown argument 'serial'"),
        refused("missing required argument 'sn'"),
        refused("tools.fleet.get_device_status takes keyword arguments only, not 1 positional"),
        refused("unknown arguments 'x', 'y'"),
        refused("unknown argument 'bad'"),
        refused("argument 'class' given twice", "my-srv__get.item",
                "tools.my_srv.get_item(*, class_: int, max_n: int = None)"),
        [refused("missing required argument 'sn'"), "B"],
    ]


def test_a_schema_that_takes_more_keys_passes_them_on():
    b = typed("print(json.dumps(tools.fleet.query(q='x', since='1h', **{'a-b': 1})))\n")
    assert b.next()["args"] == {"q": "x", "since": "1h", "a-b": 1}
    b.reply({"id": 2, **ok("rows")})
    assert b.result() == "rows"


def test_spelled_names_send_the_tools_own_names():
    b = typed(
        "a = tools.my_srv.get_item(class_=1, max_n=2)\n"
        "b = tools.my_srv.get_item(**{'class': 1, 'max-n': 2})\n"
        "c = t.call('my-srv__get.item', {'class': 1})\n"
        "print(json.dumps([a, b, c, tools.my_srv.get_item.__name__, tools.my_srv.get_item.name]))\n"
    )
    for n, args in ((2, {"class": 1, "max-n": 2}), (3, {"class": 1, "max-n": 2}), (4, {"class": 1})):
        assert b.next() == {"op": "call", "tool": "my-srv__get.item", "args": args, "id": n}
        b.reply({"id": n, **ok(str(n))})
    assert b.result() == ["2", "3", "4", "get_item", "my-srv__get.item"]


TYPES = [
    ({"type": "string"}, "str"),
    ({"type": "integer"}, "int"),
    ({"type": "number"}, "float"),
    ({"type": "boolean"}, "bool"),
    ({"type": "object"}, "dict"),
    ({"type": "array"}, "list"),
    ({"type": "array", "items": {"type": "integer"}}, "list[int]"),
    ({"type": ["string", "null"]}, "str | None"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}]}, "int | None"),
    ({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, "str | list[str]"),
    ({"enum": ["a", "b", 3]}, "Literal['a', 'b', 3]"),
    ({"enum": [{"x": 1}]}, "Any"),
    ({"type": "sideways"}, "Any"),
    ({}, "Any"),
]


def test_each_schema_type_becomes_an_annotation():
    listing = [spec("x__t", ["x", "t"], [param(f"a{i}", s) for i, (s, _) in enumerate(TYPES)])]
    b = typed(
        "import inspect\n"
        "ps = inspect.signature(tools.x.t).parameters.values()\n"
        "print(json.dumps([inspect.formatannotation(p.annotation) for p in ps]))\n",
        listing,
    )
    assert b.result() == [want for _, want in TYPES]


def test_real_types_required_defaults_and_keyword_only():
    b = typed(
        "import inspect, typing\n"
        "sig = inspect.signature(tools.fleet.get_device_status)\n"
        "sn, verbose = sig.parameters['sn'], sig.parameters['verbose']\n"
        "print(json.dumps([str(sig), sn.annotation is str, sn.default is inspect.Parameter.empty,\n"
        "                  verbose.annotation is bool, verbose.default, sn.kind == inspect.Parameter.KEYWORD_ONLY,\n"
        "                  str(inspect.signature(tools.my_srv.get_item)), str(inspect.signature(tools.fleet.query))]))\n"
    )
    assert b.result() == [
        "(*, sn: str, verbose: bool = False)", True, True, True, False, True,
        "(*, class_: int, max_n: int = None)", "(*, q: str = None, **more)",
    ]


def test_help_shows_the_signature_description_and_each_argument():
    b = typed("help(tools.fleet.get_device_status)\nhelp(tools.my_srv.get_item)\nhelp(tools.fleet.reboot_device)\n")
    rc, out, err = b.finish()
    assert rc == 0, err
    assert (
        "get_device_status(*, sn: str, verbose: bool = False)\n"
        "    fleet__get_device_status: Status of one device: online or not, and its firmware.\n"
        "    \n"
        "    Arguments:\n"
        "        sn (str, required): Serial number.\n"
        "        verbose (bool, optional, default False)\n"
    ) in out, out
    assert "tools.fleet.get_device_status.many(args_list, return_errors=False)" in out, out
    assert "agent_tools.call('fleet__get_device_status', args) is the same call by name." in out, out
    assert "    my-srv__get.item: no description given.\n" in out, out
    assert "        class_ (int, required, sent as 'class')\n" in out, out
    assert "        max_n (int, optional, sent as 'max-n')\n" in out, out
    assert "A write tool: callable only if run_script's `tools` names fleet__reboot_device." in out, out


def test_dir_repr_and_a_missing_name():
    b = typed(
        "try:\n"
        "    tools.fleet.nope\n"
        "except AttributeError as e:\n"
        "    missing = str(e)\n"
        "print(json.dumps([dir(tools), dir(tools.fleet), repr(tools.fleet), repr(tools.ping), missing,\n"
        "                  tools.fleet.get_device_status.__doc__.splitlines()[0]]))\n"
    )
    assert b.result() == [
        ["fleet", "my_srv", "ping"],
        ["get_device_status", "query", "reboot_device"],
        "<tools.fleet: get_device_status, query, reboot_device>",
        "<tool ping: tools.ping()>",
        "tools.fleet has no 'nope'; it has: get_device_status, query, reboot_device "
        "(agent_tools.call('server__tool', args) calls any tool by its full name)",
        "fleet__get_device_status: Status of one device: online or not, and its firmware.",
    ]


def test_names_a_namespace_uses_itself_are_tools_like_any_other():
    listing = [spec("x___add", ["x", "_add"]), spec("x___add_2", ["x", "_add_2"]), spec("x__many", ["x", "many"]),
               spec("dir", ["dir"])]
    b = typed("print(json.dumps([tools.x._add(), tools.x._add_2(), tools.x.many(), tools.dir(), dir(tools.x)]))\n",
              listing)
    for n, name in ((2, "x___add"), (3, "x___add_2"), (4, "x__many"), (5, "dir")):
        assert b.next() == {"op": "call", "tool": name, "args": {}, "id": n}
        b.reply({"id": n, **ok(name)})
    assert b.result() == ["x___add", "x___add_2", "x__many", "dir", ["_add", "_add_2", "many"]]


def test_help_on_a_namespace_lists_its_tools_and_servers():
    b = typed("help(tools.fleet)\nhelp(tools)\n")
    rc, out, err = b.finish()
    assert rc == 0, err
    assert "Help on module tools.fleet" in out, out
    assert "The tools of server fleet; help() on one gives its arguments." in out, out
    assert "FUNCTIONS\n    get_device_status(*, sn: str, verbose: bool = False)\n" in out, out
    assert "    query(*, q: str = None, **more)\n" in out, out
    assert "SUBMODULES\n    fleet\n    my_srv\n" in out, out
    assert "FUNCTIONS\n    ping()\n        ping: no description given." in out, out


def test_a_daemon_that_refuses_the_tools_request_raises_tool_error():
    b = Broker(script("from agent_tools import tools\n"))
    r = b.next()
    b.reply({"id": r["id"], "error": {"code": "invalid_request", "message": "unknown op; use agent_tools"}})
    assert b.next() == {"op": "uncaught", "code": "invalid_request", "tool": "tools"}
    rc, _, err = b.finish()
    assert rc == 1
    assert "agent_tools.ToolError: tools: invalid_request: unknown op; use agent_tools" in err, err


@pytest.fixture(autouse=True)
def _no_bytecode_in_the_tree():
    yield
    assert not os.path.exists(os.path.join(SANDBOX, "__pycache__")), "the child wrote bytecode into src/sandbox"
