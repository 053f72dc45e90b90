"""The authorization snapshot (protocol section 2) and the daemon's answers.

The snapshot is a security boundary: the daemon refuses unknown fields, and so do
these types, before anything is sent. ``Snapshot.from_dict`` raises
``SnapshotError`` (reason ``unknown_field``, ``missing_field`` or
``invalid_value``, and ``field`` naming the place, e.g. ``tools[2].input_schema``)
just as the daemon would answer -32011.

Types of the daemon's answers (``Started``, ``ScriptResult``, ``ScriptStatus``,
``CancelResult``, ``RevokeResult``, ``DaemonInfo``) and requests (``ToolCall``,
``ApprovalRequest``) are lenient instead: fields a newer daemon adds are kept in
``extra``; ``to_dict()`` gives the wire object back.
"""

from __future__ import annotations

import enum
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypedDict, Union
from .errors import SnapshotError

JSON = Any


class ToolClass(str, enum.Enum):
    READ = "read"
    WRITE = "write"
    DESTRUCTIVE = "destructive"
    LONG_TASK = "long_task"


class PermissionMode(str, enum.Enum):
    APPROVAL = "approval"
    AUTO = "auto"


def _err(reason: str, fld: str, message: str) -> SnapshotError:
    return SnapshotError(message, data={"reason": reason, "field": fld})


def _check_keys(d: Any, where: str, required: Sequence[str], allowed: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise _err("invalid_value", where or ".", f"{where or 'snapshot'} must be an object")
    for k in d:
        if k not in allowed:
            path = f"{where}.{k}" if where else str(k)
            raise _err("unknown_field", path, f"unknown field {path!r} (allowed: {', '.join(allowed)})")
    for k in required:
        if k not in d:
            path = f"{where}.{k}" if where else k
            raise _err("missing_field", path, f"missing field {path!r}")
    return d


_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]+")


def _mcp_dict(obj: Any) -> Dict[str, Any]:
    """An mcp SDK (pydantic) model as its wire dict; a dict as it is."""
    if isinstance(obj, Mapping):
        return dict(obj)
    dump = getattr(obj, "model_dump", None)
    if callable(dump):
        d = dump(by_alias=True, exclude_none=True, mode="json")
        if isinstance(d, dict):
            return d
    raise TypeError(f"expected an mcp SDK model or a dict, not {type(obj).__name__}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _enum(cls: Any, v: Any, fld: str) -> Any:
    try:
        return cls(v)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise _err("invalid_value", fld, f"{fld} must be one of {allowed}, not {v!r}") from None


@dataclass
class Tool:
    """One tool of the snapshot. ``tool_class`` is the protocol's ``class``.

    Enabled read and write tools (those a script can call) need an
    ``input_schema``. The daemon takes it as closed: a key it does not declare
    is refused, and a top-level schema without ``properties`` takes no
    arguments; to accept any object: ``{"type": "object", "additionalProperties": true}``.
    """

    name: str
    tool_class: ToolClass
    input_schema: Optional[Dict[str, JSON]] = None
    enabled: bool = True
    frozen: Dict[str, JSON] = field(default_factory=dict)
    #: What the model reads about the tool (``run.describe`` shows it under the signature).
    description: Optional[str] = None

    FIELDS = ("name", "class", "enabled", "input_schema", "frozen", "description")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "tool") -> None:
        if not isinstance(self.name, str) or not self.name:
            raise _err("invalid_value", f"{where}.name", f"{where}.name must be a non-empty string")
        self.tool_class = _enum(ToolClass, self.tool_class, f"{where}.class")
        if not isinstance(self.enabled, bool):
            raise _err("invalid_value", f"{where}.enabled", f"{where}.enabled must be a bool")
        if self.input_schema is None:
            if self.enabled and self.tool_class in (ToolClass.READ, ToolClass.WRITE):
                raise _err(
                    "missing_field",
                    f"{where}.input_schema",
                    f"{self.tool_class.value} tool {self.name!r} needs an input_schema",
                )
        elif not isinstance(self.input_schema, (dict, bool)):
            raise _err("invalid_value", f"{where}.input_schema", f"{where}.input_schema must be a JSON Schema")
        if not isinstance(self.frozen, dict):
            raise _err("invalid_value", f"{where}.frozen", f"{where}.frozen must be an object")
        if self.description is not None and not isinstance(self.description, str):
            raise _err("invalid_value", f"{where}.description", f"{where}.description must be a string")

    @classmethod
    def read(cls, name: str, input_schema: Dict[str, JSON], **kw: Any) -> "Tool":
        return cls(name, ToolClass.READ, input_schema, **kw)

    @classmethod
    def write(cls, name: str, input_schema: Dict[str, JSON], **kw: Any) -> "Tool":
        return cls(name, ToolClass.WRITE, input_schema, **kw)

    @classmethod
    def destructive(cls, name: str, input_schema: Optional[Dict[str, JSON]] = None, **kw: Any) -> "Tool":
        return cls(name, ToolClass.DESTRUCTIVE, input_schema, **kw)

    @classmethod
    def long_task(cls, name: str, input_schema: Optional[Dict[str, JSON]] = None, **kw: Any) -> "Tool":
        return cls(name, ToolClass.LONG_TASK, input_schema, **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "tool") -> "Tool":
        _check_keys(d, where, ("name", "class"), cls.FIELDS)
        t = cls.__new__(cls)
        t.name = d["name"]
        t.tool_class = d["class"]
        t.enabled = d.get("enabled", True)
        t.input_schema = d.get("input_schema")
        t.frozen = d.get("frozen", {})
        t.description = d.get("description")
        t.validate(where)
        return t

    @classmethod
    def from_mcp(cls, tool: Any, server: str) -> "Tool":
        """The snapshot entry for an MCP ``Tool`` (the mcp SDK's model or its dict, as
        ``tools/list`` gives it), as ``scriptgate run`` makes it: named
        ``server__tool``; class ``long_task`` for ``execution.taskSupport:
        "required"``, else ``read`` for ``readOnlyHint: true``, else ``destructive``
        unless ``destructiveHint`` is false (its default is true), else ``write``;
        the ``inputSchema`` as it is (none: ``{"type": "object", "properties": {}}``,
        no arguments); the ``description``. ``server`` must be non-empty, of
        ``[A-Za-z0-9_-]`` and without ``__`` (``ValueError`` otherwise)."""
        if not isinstance(server, str) or not _SERVER_NAME.fullmatch(server) or "__" in server:
            raise ValueError(f"MCP server name {server!r}: it must be non-empty, of [A-Za-z0-9_-], without '__'")
        d = _mcp_dict(tool)
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"MCP tool of server {server!r} without a name: {d!r:.200}")
        execution = d.get("execution")
        ann = d.get("annotations")
        hint = lambda k: ann.get(k) if isinstance(ann, dict) and isinstance(ann.get(k), bool) else None
        if isinstance(execution, dict) and execution.get("taskSupport") == "required":
            klass = ToolClass.LONG_TASK
        elif hint("readOnlyHint") is True:
            klass = ToolClass.READ
        elif hint("destructiveHint") is not False:
            klass = ToolClass.DESTRUCTIVE
        else:
            klass = ToolClass.WRITE
        schema = d.get("inputSchema")
        desc = d.get("description")
        return cls(
            f"{server}__{name}",
            klass,
            {"type": "object", "properties": {}} if schema is None else schema,
            description=desc if isinstance(desc, str) else None,
        )

    def to_dict(self) -> Dict[str, JSON]:
        self.validate()
        out: Dict[str, JSON] = {"name": self.name, "class": self.tool_class.value, "enabled": self.enabled}
        if self.input_schema is not None:
            out["input_schema"] = self.input_schema
        out["frozen"] = dict(self.frozen)
        if self.description is not None:
            out["description"] = self.description
        return out


@dataclass
class Limits:
    """Per-run limits; each can only tighten the daemon's configured value."""

    max_calls: Optional[int] = None
    max_concurrency: Optional[int] = None
    timeout_s: Optional[int] = None
    memory_max_bytes: Optional[int] = None
    tasks_max: Optional[int] = None

    FIELDS = ("max_calls", "max_concurrency", "timeout_s", "memory_max_bytes", "tasks_max")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "limits") -> None:
        for k in self.FIELDS:
            v = getattr(self, k)
            if v is not None and (not _is_int(v) or v < 0):
                raise _err("invalid_value", f"{where}.{k}", f"{where}.{k} must be a non-negative integer")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "limits") -> "Limits":
        _check_keys(d, where, (), cls.FIELDS)
        lim = cls.__new__(cls)
        for k in cls.FIELDS:
            setattr(lim, k, d.get(k))
        lim.validate(where)
        return lim

    def to_dict(self) -> Dict[str, int]:
        self.validate()
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}


@dataclass
class Snapshot:
    """What a run may do; it travels signed inside the run token."""

    workspace: str
    permission_mode: PermissionMode
    tools: List[Tool]
    read_only: bool = False
    session_allowed: List[str] = field(default_factory=list)
    limits: Optional[Limits] = None

    FIELDS = ("workspace", "read_only", "permission_mode", "session_allowed", "tools", "limits")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.workspace, os.PathLike):
            self.workspace = os.fspath(self.workspace)
        if not isinstance(self.workspace, str) or not self.workspace:
            raise _err("invalid_value", "workspace", "workspace must be a path")
        if not os.path.isabs(self.workspace):
            raise _err("not_absolute", "workspace", f"workspace {self.workspace!r} is not absolute")
        self.permission_mode = _enum(PermissionMode, self.permission_mode, "permission_mode")
        if not isinstance(self.read_only, bool):
            raise _err("invalid_value", "read_only", "read_only must be a bool")
        if not isinstance(self.session_allowed, list) or not all(isinstance(s, str) for s in self.session_allowed):
            raise _err("invalid_value", "session_allowed", "session_allowed must be a list of tool names")
        if not isinstance(self.tools, list):
            raise _err("invalid_value", "tools", "tools must be a list")
        seen = set()
        for i, t in enumerate(self.tools):
            if not isinstance(t, Tool):
                raise _err("invalid_value", f"tools[{i}]", f"tools[{i}] must be a Tool")
            t.validate(f"tools[{i}]")
            if t.name in seen:
                raise _err("duplicate_tool", f"tools[{i}].name", f"tool {t.name!r} appears twice")
            seen.add(t.name)
        if self.limits is not None:
            if not isinstance(self.limits, Limits):
                raise _err("invalid_value", "limits", "limits must be Limits")
            self.limits.validate()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Snapshot":
        _check_keys(d, "", ("workspace", "permission_mode", "tools"), cls.FIELDS)
        tools = d["tools"]
        if not isinstance(tools, list):
            raise _err("invalid_value", "tools", "tools must be a list")
        s = cls.__new__(cls)
        s.workspace = d["workspace"]
        s.permission_mode = d["permission_mode"]
        s.tools = [Tool.from_dict(t, f"tools[{i}]") for i, t in enumerate(tools)]
        s.read_only = d.get("read_only", False)
        s.session_allowed = d.get("session_allowed", [])
        lim = d.get("limits")
        s.limits = None if lim is None else Limits.from_dict(lim)
        s.validate()
        return s

    def to_dict(self) -> Dict[str, JSON]:
        self.validate()
        out: Dict[str, JSON] = {
            "workspace": self.workspace,
            "read_only": self.read_only,
            "permission_mode": self.permission_mode.value,
            "session_allowed": list(self.session_allowed),
            "tools": [t.to_dict() for t in self.tools],
        }
        if self.limits is not None:
            out["limits"] = self.limits.to_dict()
        return out


SnapshotLike = Union[Snapshot, Mapping[str, Any]]


def as_snapshot(s: SnapshotLike) -> Snapshot:
    return s if isinstance(s, Snapshot) else Snapshot.from_dict(s)


# --- what the daemon sends ---------------------------------------------------
#
# One dataclass per answer, request and notification of scriptgate-protocol(7),
# with the fields the page names. ``from_dict`` is lenient (a field a newer daemon
# adds is kept in ``extra``); ``to_dict`` gives the wire object back as the daemon
# sent it. The answers that were plain dicts before (``cancel``, ``revoke``,
# ``info``) can still be read as dicts: ``ans["state"]``, ``"state" in ans``,
# ``ans.get("x")`` read the wire object.


class _ReadAsDict:
    """Dict-style reads of the wire object, for code written when the answer was a dict."""

    def to_dict(self) -> Dict[str, JSON]:  # pragma: no cover - every user defines it
        raise NotImplementedError

    def __getitem__(self, key: str) -> JSON:
        return self.to_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def get(self, key: str, default: JSON = None) -> JSON:
        return self.to_dict().get(key, default)

    def keys(self) -> Any:
        return self.to_dict().keys()


def _int(v: Any) -> int:
    return v if _is_int(v) else 0


def _opt_int(v: Any) -> Optional[int]:
    return v if _is_int(v) else None


def _strs(v: Any) -> List[str]:
    return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []


def _extra(d: Mapping[str, Any], known: Sequence[str]) -> Dict[str, JSON]:
    return {k: v for k, v in d.items() if k not in known}


@dataclass
class Progress:
    """What a script reported with ``agent_tools.progress(done, total, message)``."""

    done: int
    total: int
    message: str = ""

    def to_dict(self) -> Dict[str, JSON]:
        return {"done": self.done, "total": self.total, "message": self.message}


@dataclass
class ScriptStatus:
    """``script.status`` answers and ``script.progress`` notifications."""

    script_id: str
    state: str
    calls: int = 0
    failures: int = 0
    elapsed_ms: int = 0
    progress: Optional[Progress] = None
    extra: Dict[str, JSON] = field(default_factory=dict)

    FIELDS = ("script_id", "state", "calls", "failures", "elapsed_ms", "progress")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ScriptStatus":
        p = d.get("progress")
        prog = None
        if isinstance(p, Mapping):
            prog = Progress(int(p.get("done", 0)), int(p.get("total", 0)), str(p.get("message") or ""))
        return cls(
            script_id=str(d.get("script_id", "")),
            state=str(d.get("state", "")),
            calls=int(d.get("calls") or 0),
            failures=int(d.get("failures") or 0),
            elapsed_ms=int(d.get("elapsed_ms") or 0),
            progress=prog,
            extra=_extra(d, cls.FIELDS),
        )

    def to_dict(self) -> Dict[str, JSON]:
        return {
            "script_id": self.script_id, "state": self.state, "calls": self.calls, "failures": self.failures,
            "elapsed_ms": self.elapsed_ms, "progress": self.progress.to_dict() if self.progress else None,
            **self.extra,
        }


@dataclass
class ScriptResult:
    """The result object (protocol section RESULT OBJECT). ``text`` goes back to the model.

    Extensions, present only when the daemon sends them: ``memory_peak_bytes``
    and ``cpu_usec`` (``None`` when the backend does not measure them: never read
    that as 0), ``backend_notes`` (limits not in force), ``record_incomplete``
    (parts of the record the daemon could not write)."""

    script_id: str
    run_id: str
    status: str
    exit_code: Optional[int] = None
    calls: int = 0
    failures: int = 0
    duration_ms: int = 0
    details_dir: str = ""
    output: str = ""
    output_truncated: bool = False
    error: Optional[str] = None
    text: str = ""
    extra: Dict[str, JSON] = field(default_factory=dict)
    memory_peak_bytes: Optional[int] = None
    cpu_usec: Optional[int] = None
    backend_notes: List[str] = field(default_factory=list)
    record_incomplete: List[str] = field(default_factory=list)

    FIELDS = (
        "script_id", "run_id", "status", "exit_code", "calls", "failures", "duration_ms",
        "details_dir", "output", "output_truncated", "error", "text",
        "memory_peak_bytes", "cpu_usec", "backend_notes", "record_incomplete",
    )

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ScriptResult":
        ec = d.get("exit_code")
        return cls(
            script_id=str(d.get("script_id", "")),
            run_id=str(d.get("run_id", "")),
            status=str(d.get("status", "")),
            exit_code=ec if _is_int(ec) else None,
            calls=int(d.get("calls") or 0),
            failures=int(d.get("failures") or 0),
            duration_ms=int(d.get("duration_ms") or 0),
            details_dir=str(d.get("details_dir") or ""),
            output=str(d.get("output") or ""),
            output_truncated=bool(d.get("output_truncated")),
            error=d.get("error") if isinstance(d.get("error"), str) else None,
            text=str(d.get("text") or ""),
            extra=_extra(d, cls.FIELDS),
            memory_peak_bytes=_opt_int(d.get("memory_peak_bytes")),
            cpu_usec=_opt_int(d.get("cpu_usec")),
            backend_notes=_strs(d.get("backend_notes")),
            record_incomplete=_strs(d.get("record_incomplete")),
        )

    def to_dict(self) -> Dict[str, JSON]:
        out: Dict[str, JSON] = {
            "script_id": self.script_id, "run_id": self.run_id, "status": self.status, "exit_code": self.exit_code,
            "calls": self.calls, "failures": self.failures, "duration_ms": self.duration_ms,
            "details_dir": self.details_dir, "output": self.output, "output_truncated": self.output_truncated,
            "error": self.error, "text": self.text,
        }
        for k in ("memory_peak_bytes", "cpu_usec"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        for k in ("backend_notes", "record_incomplete"):
            if getattr(self, k):
                out[k] = list(getattr(self, k))
        out.update(self.extra)
        return out


@dataclass
class CancelResult(_ReadAsDict):
    """The answer to ``script.cancel`` (and ``admin.cancel``): the script's state
    once it has ended; ``already_finished`` when it had ended before the cancel."""

    script_id: str
    state: str
    already_finished: bool = False
    extra: Dict[str, JSON] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CancelResult":
        return cls(str(d.get("script_id", "")), str(d.get("state", "")), d.get("already_finished") is True,
                   _extra(d, ("script_id", "state", "already_finished")))

    def to_dict(self) -> Dict[str, JSON]:
        out: Dict[str, JSON] = {"script_id": self.script_id, "state": self.state}
        if self.already_finished:
            out["already_finished"] = True
        out.update(self.extra)
        return out


@dataclass
class RevokeResult(_ReadAsDict):
    """The answer to ``run.revoke``: the run and how many of its scripts were cancelled."""

    run_id: str
    cancelled: int
    extra: Dict[str, JSON] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RevokeResult":
        return cls(str(d.get("run_id", "")), _int(d.get("cancelled")), _extra(d, ("run_id", "cancelled")))

    def to_dict(self) -> Dict[str, JSON]:
        return {"run_id": self.run_id, "cancelled": self.cancelled, **self.extra}


@dataclass
class SandboxInfo:
    """``daemon.info``'s ``sandbox``: ``state`` ok, unavailable or unchecked;
    ``problem`` (cause and fix) and ``detail`` (bwrap's words) when not ok."""

    state: str
    nested_userns: str
    problem: Optional[str] = None
    detail: Optional[str] = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SandboxInfo":
        s = lambda k: d.get(k) if isinstance(d.get(k), str) else None
        return cls(str(d.get("state", "")), str(d.get("nested_userns", "")), s("problem"), s("detail"))

    def to_dict(self) -> Dict[str, JSON]:
        return {"state": self.state, "nested_userns": self.nested_userns, "problem": self.problem,
                "detail": self.detail}


@dataclass
class DaemonInfo(_ReadAsDict):
    """The answer to ``daemon.info``: ``{version, protocol, backend, backend_notes,
    running, limits}`` and the extensions ``limits_per_script``,
    ``limits_enforced``, ``sandbox``, ``same_uid``, ``disk`` (``None`` or empty
    when the daemon does not send them). ``limits`` maps each configured limit
    (``max_calls``, ``timeout_s``, ...) to its value."""

    version: str
    protocol: int
    backend: str
    backend_notes: List[str] = field(default_factory=list)
    running: int = 0
    limits: Dict[str, int] = field(default_factory=dict)
    limits_per_script: Optional[bool] = None
    limits_enforced: Optional[bool] = None
    sandbox: Optional[SandboxInfo] = None
    same_uid: List[str] = field(default_factory=list)
    disk: Optional[Dict[str, JSON]] = None
    extra: Dict[str, JSON] = field(default_factory=dict)

    FIELDS = ("version", "protocol", "backend", "backend_notes", "running", "limits", "limits_per_script",
              "limits_enforced", "sandbox", "same_uid", "disk")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DaemonInfo":
        b = lambda k: d.get(k) if isinstance(d.get(k), bool) else None
        lim, sb, disk = d.get("limits"), d.get("sandbox"), d.get("disk")
        return cls(
            version=str(d.get("version", "")),
            protocol=_int(d.get("protocol")),
            backend=str(d.get("backend", "")),
            backend_notes=_strs(d.get("backend_notes")),
            running=_int(d.get("running")),
            limits=dict(lim) if isinstance(lim, Mapping) else {},
            limits_per_script=b("limits_per_script"),
            limits_enforced=b("limits_enforced"),
            sandbox=SandboxInfo.from_dict(sb) if isinstance(sb, Mapping) else None,
            same_uid=_strs(d.get("same_uid")),
            disk=dict(disk) if isinstance(disk, Mapping) else None,
            extra=_extra(d, cls.FIELDS),
        )

    def to_dict(self) -> Dict[str, JSON]:
        out: Dict[str, JSON] = {
            "version": self.version, "protocol": self.protocol, "backend": self.backend,
            "backend_notes": list(self.backend_notes), "running": self.running, "limits": dict(self.limits),
        }
        for k in ("limits_per_script", "limits_enforced"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.sandbox is not None:
            out["sandbox"] = self.sandbox.to_dict()
        if self.same_uid:
            out["same_uid"] = list(self.same_uid)
        if self.disk is not None:
            out["disk"] = dict(self.disk)
        out.update(self.extra)
        return out


@dataclass
class CallProgress:
    """A tool handler's progress (``ctx.progress(...)``), as the progress stream yields it."""

    script_id: str
    call_id: str
    tool: str
    progress: float
    total: Optional[float] = None
    message: Optional[str] = None


class CallContext:
    """What a tool handler has besides the arguments: the second argument of a
    two-argument handler, and ``call.ctx`` for any handler.

    - ``cancelled``: a ``threading.Event``, set when the daemon sends
      ``tool.cancelled`` for the call (the script ended), when ``tool_timeout_s``
      passes, or when the connection closes; ``cancel_reason`` and
      ``cancel_message`` then say why (``cancelled``, ``timeout``, ...). An async
      handler's task is also cancelled (it sees ``CancelledError``); a plain
      handler, running in a thread, should check the event.
    - ``progress(progress, total=None, message=None)``: reports the call's
      progress to the engine's progress streams (``Client.progress``); thread-safe;
      also usable as the mcp SDK's ``progress_callback``. It is not sent to the daemon.
    - ``traceparent``, ``tracestate``, ``span_id``: the call's trace context
      (``None`` unless the script was started with one).
    """

    def __init__(
        self,
        call: "ToolCall",
        rpc_id: Any = None,
        traceparent: Optional[str] = None,
        tracestate: Optional[str] = None,
        span_id: Optional[str] = None,
        emit: Optional[Callable[[CallProgress], None]] = None,
    ) -> None:
        self._call = call
        self.script_id = call.script_id
        self.call_id = call.call_id
        self.tool = call.tool
        self.rpc_id = rpc_id
        self.traceparent = traceparent
        self.tracestate = tracestate
        self.span_id = span_id
        self.cancelled = threading.Event()
        self.cancel_reason: Optional[str] = None
        self.cancel_message: Optional[str] = None
        self._emit = emit

    def cancel(self, reason: str, message: str = "") -> None:
        if not self.cancelled.is_set():
            self.cancel_reason, self.cancel_message = reason, message
            self.cancelled.set()

    def progress(self, progress: float, total: Optional[float] = None, message: Optional[str] = None) -> "_Done":
        """Report progress. Returns an already-done awaitable, so that
        ``ctx.progress`` also serves as the mcp SDK's (async) ``progress_callback``."""
        if self._emit is not None:
            self._emit(CallProgress(self.script_id, self.call_id, self.tool, progress, total, message))
        return _DONE


class _Done:
    def __await__(self) -> Any:
        return iter(())


_DONE = _Done()


@dataclass
class ToolCall:
    """A ``tool.call`` request from the daemon; ``arguments`` include the frozen
    ones, numbers as the script wrote them (integers of up to 64 bits exactly).
    ``traceparent``, ``tracestate`` and ``span_id`` are the call's trace context
    (``None`` unless the script was started with one; also on ``ctx``)."""

    script_id: str
    run_id: str
    call_id: str
    tool: str
    arguments: Dict[str, JSON]
    ctx: Optional[CallContext] = field(default=None, repr=False, compare=False)
    traceparent: Optional[str] = None
    tracestate: Optional[str] = None
    span_id: Optional[str] = None

    FIELDS = ("script_id", "run_id", "call_id", "tool", "arguments", "traceparent", "tracestate", "span_id")

    def to_dict(self) -> Dict[str, JSON]:
        out: Dict[str, JSON] = {"script_id": self.script_id, "run_id": self.run_id, "call_id": self.call_id,
                                "tool": self.tool, "arguments": self.arguments}
        for k in ("traceparent", "tracestate", "span_id"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


@dataclass
class Started(_ReadAsDict):
    """The answer to ``script.start``: ``{script_id, state}`` (``running``)."""

    script_id: str
    state: str
    extra: Dict[str, JSON] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Started":
        return cls(
            str(d["script_id"]), str(d.get("state", "")),
            {k: v for k, v in d.items() if k not in ("script_id", "state")},
        )

    def to_dict(self) -> Dict[str, JSON]:
        return {"script_id": self.script_id, "state": self.state, **self.extra}


#: A tool of an ``approval.request``: ``{"name": ..., "class": "write"}`` (a dict).
ApprovalTool = TypedDict("ApprovalTool", {"name": str, "class": str})


@dataclass
class ApprovalRequest:
    """An ``approval.request``: may the script run with these write tools?
    ``traceparent`` and ``tracestate``: the script's trace (``None`` without one)."""

    script_id: str
    run_id: str
    description: str
    code: str
    tools: List[ApprovalTool]
    traceparent: Optional[str] = None
    tracestate: Optional[str] = None

    def to_dict(self) -> Dict[str, JSON]:
        out: Dict[str, JSON] = {"script_id": self.script_id, "run_id": self.run_id,
                                "description": self.description, "code": self.code,
                                "tools": [dict(t) for t in self.tools]}
        for k in ("traceparent", "tracestate"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out
