"""agent_tools: call the run's tools from a scriptgate script.

The module talks to scriptgated over fd 3 (requests) and fd 4 (replies), one
JSON object per line. It is thread-safe: any number of threads may call at once;
the daemon keeps at most `max_concurrency` calls of this script in flight.

    call(tool, args)                       -> structured result (dict) or text; raises ToolError
    call_many(tool, args_list, return_errors=False) -> list, in input order
    call_raw(tool, args)                   -> {"text", "structured", "is_error"}
    progress(done, total, message="")      -> None
    ToolError                              -> .tool, .code, .message
"""

import json
import os
import sys
import threading

__all__ = ["call", "call_many", "call_raw", "progress", "ToolError"]

BATCH = 50


class ToolError(Exception):
    """A tool call failed or was refused.

    code is one of: denied, invalid_arguments, limit, tool_error, revoked, engine.
    """

    def __init__(self, tool, code, message):
        super().__init__(f"{tool}: {code}: {message}")
        self.tool = tool
        self.code = code
        self.message = message


class _Slot:
    __slots__ = ("event", "reply", "done")

    def __init__(self):
        self.event = threading.Event()
        self.reply = None
        self.done = False


class _Channel:
    """Requests go out on fd 3 with one write each; replies come back on fd 4.

    There is no reader thread: a caller waiting for its reply reads fd 4 itself
    when no other caller is reading (one reader at a time), hands the replies of
    other callers to them, and when it has its own, wakes the others so that
    one of them takes over. A single-threaded script thus never switches
    threads for a call.
    """

    def __init__(self):
        try:
            os.fstat(3)
            self._r = os.fdopen(4, "rb", buffering=1 << 16, closefd=False)
        except OSError as e:
            raise RuntimeError(
                "agent_tools: no daemon channel on fd 3/4; run this script with scriptgate"
            ) from e
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        self._plock = threading.Lock()
        self._pending = {}
        self._next = 0
        self._dead = None

    def send(self, obj):
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode("utf-8")
        with self._wlock:
            view = memoryview(data)
            while view:
                view = view[os.write(3, view):]

    def submit(self, obj):
        """Send a request; the slot its reply will land in (None once the channel is dead)."""
        slot = _Slot()
        with self._plock:
            if self._dead:
                return None
            self._next += 1
            rid = self._next
            self._pending[rid] = slot
        obj["id"] = rid
        try:
            self.send(obj)
        except OSError:
            # The daemon closed fd 3: the call is lost, as when fd 4 closes first.
            with self._plock:
                self._dead = "the daemon closed the tool channel"
                self._pending.pop(rid, None)
            return None
        return slot

    def wait(self, slot):
        """The reply for `slot` (None when the daemon closed the channel first)."""
        if slot is None:
            return None
        while not slot.done:
            if self._rlock.acquire(blocking=False):
                try:
                    self._read_until(slot)
                finally:
                    self._rlock.release()
                    self._wake_waiters()
            else:
                slot.event.wait()
                slot.event.clear()
        return slot.reply

    def request(self, obj):
        return self.wait(self.submit(obj))

    def _read_until(self, slot):
        while not slot.done:
            line = self._r.readline()
            if not line:
                with self._plock:
                    self._dead = "the daemon closed the tool channel"
                    pending, self._pending = self._pending, {}
                for s in pending.values():
                    s.done = True
                    s.event.set()
                return
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if not isinstance(msg, dict):
                continue
            with self._plock:
                s = self._pending.pop(msg.get("id"), None)
            if s is not None:
                s.reply = msg
                s.done = True
                if s is not slot:
                    s.event.set()

    def _wake_waiters(self):
        # The reader is leaving: whoever still waits may take over reading.
        with self._plock:
            waiting = list(self._pending.values())
        for s in waiting:
            s.event.set()


_chan = None
_chan_lock = threading.Lock()


def _channel():
    global _chan
    with _chan_lock:
        if _chan is None:
            _chan = _Channel()
        return _chan


def _check_args(tool, args):
    if not isinstance(tool, str):
        raise TypeError("tool must be a str, e.g. 'fleet__get_device_status'")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise TypeError(f"{tool}: args must be a dict of the tool's arguments")
    return args


def _lost(tool):
    return ToolError(tool, "engine", "the daemon closed the tool channel (script cancelled or timed out?)")


def _to_error(tool, err):
    return ToolError(tool, err.get("code", "engine"), err.get("message", "unknown error"))


def _raw_or_raise(tool, item):
    """A reply item is {"result": {...}} or {"error": {"code", "message"}}."""
    if "error" in item:
        raise _to_error(tool, item["error"])
    return item["result"]


def _value(tool, raw):
    if raw.get("is_error"):
        raise ToolError(tool, raw.get("code") or "tool_error", raw.get("text") or "tool reported an error")
    if raw.get("structured") is not None:
        return raw["structured"]
    return raw.get("text", "")


def _plain(raw):
    return {"text": raw.get("text", ""), "structured": raw.get("structured"), "is_error": bool(raw.get("is_error"))}


def call_raw(tool, args=None):
    """Call a tool; return {"text", "structured", "is_error"}.

    The tool's own errors come back with is_error=True. Refusals (denied,
    invalid_arguments, limit, revoked) and failures of the engine that serves the
    tools (code "engine": a malformed answer, a JSON-RPC error, a lost engine)
    raise ToolError, as call() does: a broken gateway is never taken for the
    tool's answer.
    """
    args = _check_args(tool, args)
    reply = _channel().request({"op": "call", "tool": tool, "args": args})
    if reply is None:
        raise _lost(tool)
    raw = _raw_or_raise(tool, reply)
    if raw.get("code") == "engine":
        raise ToolError(tool, "engine", raw.get("text") or "the engine failed")
    return _plain(raw)


def call(tool, args=None):
    """Call a tool; return its structured result if it has one, else its text.

    Raises ToolError when the call fails or is refused.
    """
    args = _check_args(tool, args)
    reply = _channel().request({"op": "call", "tool": tool, "args": args})
    if reply is None:
        raise _lost(tool)
    return _value(tool, _raw_or_raise(tool, reply))


def call_many(tool, args_list, return_errors=False):
    """Call one tool once for each args dict; results in input order.

    The daemon runs each batch of 50 up to max_concurrency at a time. The next
    batch is sent while the current one runs (two batches in flight), so when a
    failure is raised the batch after it may already have been called. With
    return_errors=True a failed item is a ToolError instance in the list;
    otherwise the first failure (in input order) is raised.
    """
    args_list = [_check_args(tool, a) for a in args_list]
    batches = [args_list[i:i + BATCH] for i in range(0, len(args_list), BATCH)]
    chan = _channel()

    def submit(batch):
        return chan.submit({"op": "call_many", "tool": tool, "args_list": batch})

    out = []
    ahead = [submit(b) for b in batches[:2]]
    for n, batch in enumerate(batches):
        reply = chan.wait(ahead[n])
        if n + 2 < len(batches):
            ahead.append(submit(batches[n + 2]))
        ahead[n] = None
        if reply is None:
            err = _lost(tool)
            if not return_errors:
                raise err
            out.extend(err for _ in batch)
            continue
        if "error" in reply:
            err = _to_error(tool, reply["error"])
            if not return_errors:
                raise err
            out.extend(err for _ in batch)
            continue
        for item in reply["results"]:
            try:
                out.append(_value(tool, _raw_or_raise(tool, item)))
            except ToolError as e:
                if not return_errors:
                    raise
                out.append(e)
    return out


def progress(done, total, message=""):
    """Report progress to the engine (the first at once, then at most once a second, and the last before the end)."""
    _channel().send({"op": "progress", "done": int(done), "total": int(total), "message": str(message)[:500]})


_prev_hook = sys.excepthook


def _excepthook(kind, value, tb):
    # Tell the daemon why the script is ending, so a budget overrun is reported
    # as status `limit` rather than a plain error.
    if isinstance(value, ToolError):
        try:
            _channel().send({"op": "uncaught", "code": value.code, "tool": value.tool})
        except Exception:
            pass
    _prev_hook(kind, value, tb)


sys.excepthook = _excepthook
