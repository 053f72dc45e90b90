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
    assert b.result() == ["call", "call_many", "call_raw", "progress", "ToolError"]


@pytest.fixture(autouse=True)
def _no_bytecode_in_the_tree():
    yield
    assert not os.path.exists(os.path.join(SANDBOX, "__pycache__")), "the child wrote bytecode into src/sandbox"
