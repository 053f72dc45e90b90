"""agent_tools: call the run's tools from a scriptgate script.

The module talks to scriptgated over fd 3 (requests) and fd 4 (replies), one
JSON object per line. It is thread-safe: any number of threads may call at once;
the daemon keeps at most `max_concurrency` calls of this script in flight.

    tools.fleet.get_device_status(sn="SN1")          -> call("fleet__get_device_status", {"sn": "SN1"})
    tools.fleet.get_device_status.many([{"sn": s}, ...], return_errors=False) -> call_many(...)
    tools.fleet.get_device_status.raw(sn="SN1")      -> call_raw(...)
    call(tool, args)                       -> structured result (dict) or text; raises ToolError
    call_many(tool, args_list, return_errors=False) -> list, in input order
    call_raw(tool, args)                   -> {"text", "structured", "is_error"}
    progress(done, total, message="")      -> None
    ToolError                              -> .tool, .code, .message

`tools` is built on first use from the daemon's list of the tools this script
can call (the fd-3 `tools` request): one attribute per server, then one function
per tool, whose keyword arguments, types and docstring come from the tool's
input schema and description. The daemon spells the names (a tool without a
`server__` prefix sits on `tools` itself; see scriptgate-protocol(7)).

Numbers reach the tool exactly as given: every float, and every int from -2**63
to 2**64-1. A call whose arguments hold a larger int, float("nan") or
float("inf") fails with ToolError invalid_arguments naming it (nothing is
sent); pass such a value as a string.
"""

import json
import os
import sys
import threading
import types

__all__ = ["call", "call_many", "call_raw", "progress", "ToolError", "tools"]

BATCH = 50


class ToolError(Exception):
    """A tool call failed or was refused.

    code is one of: denied, invalid_arguments, limit, tool_error, revoked,
    expired (the run token's exp passed), engine.
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
    invalid_arguments, limit, revoked, expired) and failures of the engine that serves the
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


# -- the typed API: tools.SERVER.TOOL(**args) ----------------------------------

_TYPES = {"string": str, "integer": int, "number": float, "boolean": bool,
          "array": list, "object": dict, "null": type(None)}


# inspect and typing are imported where the typed API needs them, not by every
# script: with them, a script's start and its interpreter's exit took about
# 4 ms more (they bring dozens of modules to load and tear down).


def _union(alts):
    import typing

    out = alts[0]
    for a in alts[1:]:
        try:
            out = out | a
        except TypeError:  # Python < 3.10
            out = typing.Union[out, a]
    return out


def _annotation(schema):
    """The Python type of a JSON schema (as run.describe prints it)."""
    import typing

    if not isinstance(schema, dict):
        return typing.Any
    values = schema.get("enum")
    if isinstance(values, list) and values:
        plain = tuple(v for v in values if v is None or isinstance(v, (str, int, float, bool)))
        return typing.Literal[plain] if len(plain) == len(values) else typing.Any
    kind = schema.get("type")
    if kind == "array" and isinstance(schema.get("items"), dict):
        return list[_annotation(schema["items"])]
    if isinstance(kind, str):
        return _TYPES.get(kind, typing.Any)
    if isinstance(kind, list) and kind:
        return _union([_TYPES.get(k, typing.Any) for k in kind])
    alts = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alts, list) and alts:
        return _union([_annotation(a) for a in alts])
    return typing.Any


class Tool:
    """One tool as a function of its keyword arguments: tool(**args) is
    call(name, args), tool.many(args_list) is call_many(name, args_list) and
    tool.raw(**args) is call_raw(name, args), once the arguments are checked
    against the tool's keyword arguments (unknown or missing ones raise
    ToolError invalid_arguments, and nothing is sent)."""

    def __init__(self, spec):
        import inspect

        self.name = spec["name"]
        self._params = spec["params"]
        self._more = spec["more"]
        self._keys = {p["name"]: p["key"] for p in self._params}
        self._keys.update({p["key"]: p["key"] for p in self._params})
        self.__name__ = spec["path"][-1]
        self.__qualname__ = "tools." + ".".join(spec["path"])
        params = [inspect.Parameter(
            p["name"], inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty if p["required"] else p["schema"].get("default"),
            annotation=_annotation(p["schema"])) for p in self._params]
        if self._more:
            params.append(inspect.Parameter("more", inspect.Parameter.VAR_KEYWORD))
        self.__signature__ = inspect.Signature(params)
        self.__doc__ = self._docstring(spec)

    def _docstring(self, spec):
        import inspect

        lines = [f"{self.name}: {(spec.get('description') or '').strip() or 'no description given.'}", ""]
        lines.append("Arguments:" if self._params or self._more else "Arguments: none.")
        for p in self._params:
            about = [inspect.formatannotation(_annotation(p["schema"]))]
            about.append("required" if p["required"] else "optional")
            if "default" in p["schema"]:
                about.append(f"default {p['schema']['default']!r}")
            if p["key"] != p["name"]:
                about.append(f"sent as {p['key']!r}")
            desc = p["schema"].get("description")
            lines.append(f"    {p['name']} ({', '.join(about)})" + (f": {desc}" if desc else ""))
        if self._more:
            lines.append("    **more: other keys the tool's schema takes, passed on as given.")
        if spec.get("class") == "write":
            lines += ["", f"A write tool: callable only if run_script's `tools` names {self.name}."]
        lines += ["", f"{self.__qualname__}.many(args_list, return_errors=False) calls it once per args dict;",
                  f"{self.__qualname__}.raw(**args) gives {{\"text\", \"structured\", \"is_error\"}};",
                  f"agent_tools.call({self.name!r}, args) is the same call by name."]
        return "\n".join(lines)

    def _args(self, args, kwargs):
        """The call's arguments as the tool takes them, or ToolError invalid_arguments."""
        def refuse(why):
            return ToolError(self.name, "invalid_arguments", f"{why}; {self.__qualname__}{self.__signature__}")
        if args:
            raise refuse(f"{self.__qualname__} takes keyword arguments only, not {len(args)} positional")
        out = {}
        unknown = [k for k in kwargs if k not in self._keys and not self._more]
        if unknown:
            raise refuse(f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
        for k, v in kwargs.items():
            key = self._keys.get(k, k)
            if key in out:
                raise refuse(f"argument {key!r} given twice")
            out[key] = v
        missing = [p["name"] for p in self._params if p["required"] and p["key"] not in out]
        if missing:
            raise refuse(f"missing required argument{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}")
        return out

    def __call__(self, *args, **kwargs):
        return call(self.name, self._args(args, kwargs))

    def raw(self, *args, **kwargs):
        """call_raw: {"text", "structured", "is_error"}."""
        return call_raw(self.name, self._args(args, kwargs))

    def many(self, args_list, return_errors=False):
        """call_many: one call per args dict, results in input order. Every item
        is checked first; with return_errors=True a bad item is a ToolError in
        the list (the others are called), otherwise it is raised before any call."""
        checked = []
        for a in args_list:
            if not isinstance(a, dict):
                raise TypeError(f"{self.__qualname__}.many: each item must be a dict of arguments")
            try:
                checked.append(self._args((), a))
            except ToolError as e:
                if not return_errors:
                    raise
                checked.append(e)
        got = iter(call_many(self.name, [a for a in checked if not isinstance(a, ToolError)], return_errors))
        return [a if isinstance(a, ToolError) else next(got) for a in checked]

    def __get__(self, obj, owner=None):
        # A descriptor without __set__: help() and pydoc take a tool for a
        # routine, and show its signature and docstring.
        return self

    def __repr__(self):
        return f"<tool {self.name}: {self.__qualname__}{self.__signature__}>"


class _Namespace(types.ModuleType):
    """tools, or one server's tools: an attribute per entry. A module, so that
    help() lists its tools with their signatures; every attribute a module has
    of its own is a dunder, which no entry's spelling is."""

    def __init__(self, name, doc):
        super().__init__(name, doc)
        self.__all__ = []

    def _add(self, name, entry):
        if name not in vars(self):
            vars(self)[name] = entry
            self.__all__.append(name)
        return vars(self)[name]

    def __dir__(self):
        return sorted(self.__all__)

    def __getattr__(self, name):
        raise AttributeError(f"{self.__name__} has no {name!r}; it has: {', '.join(dir(self)) or 'nothing'}"
                             " (agent_tools.call('server__tool', args) calls any tool by its full name)")

    def __repr__(self):
        return f"<{self.__name__}: {', '.join(dir(self))}>"


def _build(listing):
    # _add is called on the class: an entry may be spelled `_add` itself.
    root = _Namespace("tools", "The tools this script can call; help() on one gives its arguments.")
    for spec in listing:
        ns = root
        for part in spec["path"][:-1]:
            sub = _Namespace(f"{ns.__name__}.{part}", f"The tools of server {part}; help() on one gives its arguments.")
            ns = _Namespace._add(ns, part, sub)
        _Namespace._add(ns, spec["path"][-1], Tool(spec))
    return root


_tools = None
_tools_lock = threading.Lock()


def __getattr__(name):
    # `tools` is asked of the daemon once, when a script first uses it.
    global _tools
    if name != "tools":
        raise AttributeError(f"module 'agent_tools' has no attribute {name!r}")
    with _tools_lock:
        if _tools is None:
            reply = _channel().request({"op": "tools"})
            if reply is None:
                raise _lost("tools")
            if "error" in reply:
                raise _to_error("tools", reply["error"])
            _tools = _build(reply["tools"])
    return _tools


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
