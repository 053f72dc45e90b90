"""The asyncio engine client: JSON-RPC 2.0 lines over scriptgated's Unix socket.

Both sides send requests. The daemon's requests (``tool.call``,
``approval.request``) may arrive at any time -- an ``approval.request`` arrives
*before* the answer to the ``script.start`` that caused it -- so the reader never
serves one request at a time: each becomes a task, and the reader goes on reading.
Ids of the two directions are independent.

Notifications (``script.progress``, ``script.finished``) and the handlers' own
progress are delivered in the order they arrive, by one task, to the registered
callbacks and the progress streams. ``tool.cancelled`` is acted on by the reader
at once: the call's task is cancelled and its ``cancelled`` event set.

The connection that starts a script owns it: if the connection closes, the
daemon cancels the script (``error: "engine disconnected"``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import inspect
import itertools
import json
import logging
import os
from typing import (
    Any, Awaitable, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple, Union,
)

from . import _otel
from . import errors
from .errors import (
    ApprovalError, ConnectionClosedError, InvalidParamsError, PermissionDeniedError, ProtocolError, ScriptgateError,
    SocketNotFoundError, StillRunningError, error_from_rpc,
)
from .types import (
    ApprovalRequest, CallContext, CallProgress, CancelResult, DaemonInfo, RevokeResult, ScriptResult, ScriptStatus,
    Started, Tool, ToolCall, _mcp_dict,
)

log = logging.getLogger("scriptgate_client")

DEFAULT_SOCKET = "/run/scriptgate/scriptgate.sock"
#: Longest line read from the daemon (its own default ``max_message_bytes``).
DEFAULT_MAX_LINE_BYTES = 16 << 20
#: Daemon requests served at once; past this the reader waits for one to end.
DEFAULT_MAX_HANDLERS = 256
#: Threads for plain (non-async) handlers.
DEFAULT_MAX_THREADS = 32
#: Notifications queued for the callbacks; past this, progress ones are dropped.
NOTIFY_QUEUE = 1024
#: Progress events kept for a script nobody streams yet (per script, and scripts).
BACKLOG_EVENTS, BACKLOG_SCRIPTS = 256, 64

ToolResult = Dict[str, Any]
ToolHandler = Callable[..., Any]
ApprovalHandler = Callable[[ApprovalRequest], Union[str, bool, Awaitable[Union[str, bool]]]]
ProgressCallback = Callable[[ScriptStatus], Optional[Awaitable[None]]]
FinishedCallback = Callable[[ScriptResult], Optional[Awaitable[None]]]
ProgressEvent = Union[ScriptStatus, CallProgress, ScriptResult]

# JSON-RPC codes this client answers the daemon's requests with.
HANDLER_FAILED = -32000
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602


class _HandlerError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _maybe_await(v: Any) -> Any:
    if inspect.isawaitable(v):
        return await v
    return v


def _object(method: str, r: Any) -> Dict[str, Any]:
    if not isinstance(r, dict):
        raise ProtocolError(f"{method} answered {r!r:.200}, not an object")
    return r


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _takes_ctx(fn: Any) -> bool:
    """Whether the handler takes a second positional argument (the CallContext)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = [p.kind for p in params]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return True
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(k in positional for k in kinds) >= 2


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _sid(s: Union[str, Started]) -> str:
    return s.script_id if isinstance(s, Started) else s


def tool_answer(result: Any) -> Dict[str, Any]:
    """A tool handler's return value as the ``tool.call`` answer, checked as the
    daemon checks it (scriptgate-protocol(7), tool.call); ``ValueError`` names the
    problem. A string is the text; an mcp SDK ``CallToolResult`` (or any pydantic
    model) is dumped with ``by_alias=True, exclude_none=True, mode="json"``. Of an
    MCP result, ``content``, ``structuredContent``, ``isError`` and ``_meta`` are
    sent (null ones left out; other keys, e.g. ``resultType``, dropped, as the
    daemon ignores them; ``text``, ``structured`` or ``is_error`` among them is a
    mix-up of the shapes and refused, as the daemon refuses it);
    ``{text, structured, is_error}`` is strict."""
    if isinstance(result, str):
        return {"text": result, "structured": None, "is_error": False}
    if not isinstance(result, dict):
        try:
            result = _mcp_dict(result)
        except TypeError:
            raise ValueError(
                f"returned {type(result).__name__}; expected a string, {{text, structured, is_error}} "
                "or an MCP CallToolResult"
            ) from None
    if "content" in result:
        mixed = [k for k in ("text", "structured", "is_error") if k in result]
        if mixed:
            raise ValueError(f"`{mixed[0]}` in an MCP CallToolResult (a mix of the two answer shapes)")
        items = result["content"]
        if not isinstance(items, list):
            raise ValueError("`content` must be an array of content items")
        for i, c in enumerate(items):
            if not isinstance(c, dict) or not isinstance(c.get("type"), str):
                raise ValueError(f"content[{i}] has no string `type`")
        out: Dict[str, Any] = {"content": items}
        for k, ok, what in (
            ("isError", lambda v: isinstance(v, bool), "a boolean"),
            ("structuredContent", lambda v: isinstance(v, dict), "an object"),
            ("_meta", lambda v: isinstance(v, dict), "an object"),
        ):
            v = result.get(k)
            if v is None:
                continue
            if not ok(v):
                raise ValueError(f"`{k}` must be {what}, not {v!r:.100}")
            out[k] = v
        return out
    if "text" not in result:
        raise ValueError("neither `text` ({text, structured, is_error}) nor `content` (an MCP CallToolResult)")
    for k in result:
        if k not in ("text", "structured", "is_error"):
            raise ValueError(f"unknown field `{k}` (a {{text, structured, is_error}} answer has no other)")
    if not isinstance(result["text"], str):
        raise ValueError("`text` must be a string")
    if not isinstance(result.get("is_error"), bool):
        raise ValueError("`is_error` must be present and a boolean")
    return result


class ProgressStream:
    """``async for ev in client.progress(script_id)``: the script's
    ``ScriptStatus`` (``script.progress``) and ``CallProgress`` (its tool
    handlers' ``ctx.progress``) events in order, then its ``ScriptResult``
    (``script.finished``), which ends the stream. Events that came before the
    stream was made are replayed (up to 256 per script)."""

    def __init__(self, client: "Client", script_id: str) -> None:
        self._client = client
        self.script_id = script_id
        self._q: "asyncio.Queue[Any]" = asyncio.Queue()
        self._done = False
        self.result: Optional[ScriptResult] = None

    def __aiter__(self) -> "ProgressStream":
        return self

    async def __anext__(self) -> ProgressEvent:
        if self._done:
            raise StopAsyncIteration
        ev = await self._q.get()
        if isinstance(ev, BaseException):
            self._done = True
            self._client._unstream(self)
            raise ev
        if isinstance(ev, ScriptResult):
            self._done = True
            self.result = ev
            self._client._unstream(self)
        return ev  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        self._done = True
        self._client._unstream(self)


class _PendingStart:
    def __init__(self, key: Tuple[str, str, Tuple[str, ...]]) -> None:
        self.key = key
        self.denied_why: Optional[str] = None


class Client:
    """An engine's connection to scriptgated.

    ::

        async with Client(sock, tool_handler=call_tool, approval_handler=ask_user) as sg:
            result = await sg.run(token, code, tools=["fleet__reboot_device"])
            print(result.text)

    ``tool_handler(call)`` or ``tool_handler(call, ctx)`` returns
    ``{"text", "structured", "is_error"}``, an MCP ``CallToolResult`` (the mcp
    SDK's model, or its dict), or a string (the text); the answer is checked
    (``tool_answer``) before it is sent. ``approval_handler(req)`` returns
    ``"allow_once"``/``"deny"`` or a bool; without one every approval is denied.
    Handlers and callbacks may be plain or async callables. Plain handlers run in
    a pool of ``max_threads`` threads (``threaded_handlers=False``: on the event
    loop); plain callbacks run on the loop.

    ``tool_timeout_s``: a tool handler that has not answered by then is
    cancelled and the call answered with an error naming the timeout.
    ``approval_timeout_s``: an approval handler that has not answered by then is
    taken as a deny (logged). ``path`` defaults to ``$SCRIPTGATE_SOCKET``, then
    ``/run/scriptgate/scriptgate.sock``.

    Bounds: a line from the daemon longer than ``max_line_bytes`` ends the
    connection (``ProtocolError``); at most ``max_handlers`` daemon requests are
    served at once (then the reader waits); at most 1024 notifications wait for
    the callbacks (then further progress ones are dropped and counted in
    ``dropped_progress``; ``script.finished`` ones are never dropped).
    """

    def __init__(
        self,
        path: Optional[Union[str, "os.PathLike[str]"]] = None,
        *,
        tool_handler: Optional[ToolHandler] = None,
        approval_handler: Optional[ApprovalHandler] = None,
        on_progress: Optional[ProgressCallback] = None,
        on_finished: Optional[FinishedCallback] = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_handlers: int = DEFAULT_MAX_HANDLERS,
        threaded_handlers: bool = True,
        max_threads: int = DEFAULT_MAX_THREADS,
        tool_timeout_s: Optional[float] = None,
        approval_timeout_s: Optional[float] = None,
    ) -> None:
        self.path = os.fspath(path or os.environ.get("SCRIPTGATE_SOCKET") or DEFAULT_SOCKET)
        self._tool_handler = tool_handler
        self._approval_handler = approval_handler
        self._progress_cbs: List[ProgressCallback] = [on_progress] if on_progress else []
        self._finished_cbs: List[FinishedCallback] = [on_finished] if on_finished else []
        self.max_line_bytes = max_line_bytes
        self.max_handlers = max_handlers
        self.threaded_handlers = threaded_handlers
        self.max_threads = max_threads
        self.tool_timeout_s = tool_timeout_s
        self.approval_timeout_s = approval_timeout_s
        self._ids = itertools.count(1)
        self._pending: Dict[int, "asyncio.Future[Dict[str, Any]]"] = {}
        self._tasks: Set["asyncio.Task[Any]"] = set()
        self._calls: Dict[Any, Tuple["asyncio.Task[Any]", CallContext]] = {}
        self._starts: List[_PendingStart] = []
        self._streams: Dict[str, List[ProgressStream]] = {}
        self._backlog: "collections.OrderedDict[str, Deque[Any]]" = collections.OrderedDict()
        self._run_spans: Dict[str, Any] = {}
        self._finished_early: Deque[Tuple[str, ScriptResult]] = collections.deque(maxlen=64)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._wlock: Optional[asyncio.Lock] = None
        self._handler_slots: Optional[asyncio.Semaphore] = None
        self._notes: Optional["asyncio.Queue[Any]"] = None
        self._read_task: Optional["asyncio.Task[None]"] = None
        self._note_task: Optional["asyncio.Task[None]"] = None
        self._closed: Optional[ScriptgateError] = ConnectionClosedError("not connected")
        #: The last error the daemon sent with id null (e.g. -32001, -32600).
        self.connection_error: Optional[ScriptgateError] = None
        #: Progress events dropped because the callbacks lagged.
        self.dropped_progress = 0

    # --- registration -------------------------------------------------------

    def handle_tool_call(self, fn: ToolHandler) -> ToolHandler:
        """Set the ``tool.call`` handler (usable as a decorator)."""
        self._tool_handler = fn
        return fn

    def handle_approval(self, fn: ApprovalHandler) -> ApprovalHandler:
        """Set the ``approval.request`` handler (usable as a decorator)."""
        self._approval_handler = fn
        return fn

    def on_progress(self, fn: ProgressCallback) -> ProgressCallback:
        """Add a ``script.progress`` callback (usable as a decorator)."""
        self._progress_cbs.append(fn)
        return fn

    def on_finished(self, fn: FinishedCallback) -> FinishedCallback:
        """Add a ``script.finished`` callback (usable as a decorator)."""
        self._finished_cbs.append(fn)
        return fn

    # --- connection ---------------------------------------------------------

    async def connect(self) -> "Client":
        """Connect; ``SocketNotFoundError``, ``ConnectionRefusedError``,
        ``PermissionDeniedError`` (all ``scriptgate_client.ConnectionError``,
        naming the path) when that fails."""
        if self._closed is None:
            return self
        p = self.path
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(p, limit=self.max_line_bytes)
        except FileNotFoundError:
            raise SocketNotFoundError(
                f"no socket at {p}: scriptgated does not listen there (is scriptgate.socket active? "
                "the path is SCRIPTGATE_SOCKET, else /run/scriptgate/scriptgate.sock)", p) from None
        except ConnectionRefusedError:
            raise errors.ConnectionRefusedError(
                f"connection refused at {p}: the socket file exists but no scriptgated listens on it", p) from None
        except PermissionError:
            raise PermissionDeniedError(
                f"permission denied connecting to {p}: this user may not open the socket (scriptgated serves "
                "root and members of auth.allowed_groups, default group scriptgate)", p) from None
        except OSError as e:
            raise errors.ConnectionError(f"cannot connect to {p}: {e.strerror or e}", p) from None
        self._loop = asyncio.get_running_loop()
        self._executor = concurrent.futures.ThreadPoolExecutor(self.max_threads, "scriptgate-handler")
        self._wlock = asyncio.Lock()
        self._handler_slots = asyncio.Semaphore(self.max_handlers)
        self._notes = asyncio.Queue(NOTIFY_QUEUE)
        self._closed = None
        self.connection_error = None
        self._read_task = asyncio.ensure_future(self._read_loop())
        self._note_task = asyncio.ensure_future(self._note_loop())
        return self

    async def __aenter__(self) -> "Client":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def close(self) -> None:
        """Close the connection; scripts it started are cancelled by the daemon."""
        self._shutdown(ConnectionClosedError(f"connection to {self.path} closed by the client", self.path))
        current = asyncio.current_task()
        tasks = [t for t in (self._read_task, self._note_task, *self._tasks) if t is not None and t is not current]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._writer is not None:
            try:
                await self._writer.wait_closed()
            except (OSError, ConnectionError):
                pass
        if self._executor is not None:
            self._executor.shutdown(wait=False)

    def _shutdown(self, why: ScriptgateError) -> None:
        if self._closed is not None:
            return
        self._closed = why
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._closed)
        self._pending.clear()
        for _, ctx in list(self._calls.values()):
            ctx.cancel("closed", str(why))
        for span in self._run_spans.values():
            _otel.end_span(span, False, str(why))
        self._run_spans.clear()
        if self._writer is not None:
            self._writer.close()

    # --- requests to the daemon ---------------------------------------------

    async def request(self, method: str, params: Optional[Dict[str, Any]] = None) -> Any:
        """Send one request and return its ``result``; raise the typed error."""
        if self._closed is not None:
            raise self._closed
        rid = next(self._ids)
        fut: "asyncio.Future[Dict[str, Any]]" = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        msg: Dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        try:
            await self._send(msg)
            answer = await fut
        finally:
            self._pending.pop(rid, None)
        if "error" in answer:
            raise error_from_rpc(answer["error"])
        return answer.get("result")

    async def start(
        self,
        token: str,
        code: str,
        tools: Iterable[Union[str, Tool]] = (),
        description: str = "",
        *,
        traceparent: Optional[str] = None,
        tracestate: Optional[str] = None,
    ) -> Started:
        """``script.start``: ``Started(script_id, state)`` once the script runs.

        ``tools`` are the write tools the script declares; when approval is
        needed the approval handler is asked before this returns. With
        OpenTelemetry, a ``scriptgate.run_script`` span is opened under the
        current context, sent as ``traceparent``/``tracestate``, and ended when
        the script finishes. ``traceparent`` (and ``tracestate``) given here are
        sent as they are instead, and no span is opened."""
        names = [t.name if isinstance(t, Tool) else t for t in tools]
        params: Dict[str, Any] = {"token": token, "code": code, "tools": names, "description": description}
        if traceparent is not None:
            span, trace_params = None, {"traceparent": traceparent}
            if tracestate is not None:
                trace_params["tracestate"] = tracestate
        else:
            span, trace_params = _otel.start_run_span()
        params.update(trace_params)
        pending = _PendingStart((code, description, tuple(sorted(set(names)))))
        self._starts.append(pending)
        try:
            try:
                r = await self.request("script.start", params)
            except InvalidParamsError as e:  # a daemon from before trace contexts: start untraced
                if not trace_params or traceparent is not None or "traceparent" not in e.message:
                    raise
                log.warning("the daemon takes no traceparent (older than scriptgate issue 20): not traced")
                params = {k: v for k, v in params.items() if k not in trace_params}
                r = await self.request("script.start", params)
            if not isinstance(r, dict) or not isinstance(r.get("script_id"), str):
                raise ProtocolError(f"script.start answered {r!r:.200}")
        except ApprovalError as e:
            if pending.denied_why and e.reason == "denied":
                e = ApprovalError(f"{e.message}: {pending.denied_why}", e.code, e.data)
            _otel.end_span(span, False, str(e))
            raise e from None
        except BaseException as e:
            _otel.end_span(span, False, str(e))
            raise
        finally:
            self._starts.remove(pending)
        started = Started.from_dict(r)
        if span is not None:
            span.set_attribute("scriptgate.script_id", started.script_id)
            early = [res for sid, res in self._finished_early if sid == started.script_id]
            if early:
                _otel.end_span(span, early[0].ok, early[0].status)
            else:
                self._run_spans[started.script_id] = span
        return started

    async def wait(
        self, script_id: Union[str, Started], timeout_s: Optional[float] = None, *, token: Optional[str] = None
    ) -> ScriptResult:
        """``script.wait``: the result once the script has finished.
        Raises ``StillRunningError`` after ``timeout_s`` (the script goes on)."""
        p: Dict[str, Any] = {"script_id": _sid(script_id)}
        if timeout_s is not None:
            p["timeout_s"] = timeout_s
        if token is not None:
            p["token"] = token
        return ScriptResult.from_dict(_object("script.wait", await self.request("script.wait", p)))

    async def run(
        self,
        token: str,
        code: str,
        tools: Iterable[Union[str, Tool]] = (),
        description: str = "",
        timeout_s: Optional[float] = None,
    ) -> ScriptResult:
        """Start a script and wait for its result. After ``timeout_s`` (from the
        start's answer) the script is cancelled (``script.cancel``) and the
        cancelled result returned."""
        started = await self.start(token, code, tools, description)
        try:
            return await self.wait(started.script_id, timeout_s)
        except StillRunningError:
            log.info("script %s still ran after %s s: cancelling it", started.script_id, timeout_s)
            await self.cancel(started.script_id)
            return await self.wait(started.script_id)

    async def status(self, script_id: Union[str, Started], *, token: Optional[str] = None) -> ScriptStatus:
        p: Dict[str, Any] = {"script_id": _sid(script_id)}
        if token is not None:
            p["token"] = token
        return ScriptStatus.from_dict(_object("script.status", await self.request("script.status", p)))

    async def cancel(self, script_id: Union[str, Started], *, token: Optional[str] = None) -> CancelResult:
        """``script.cancel``: ``CancelResult(script_id, state, already_finished)``
        once the script has ended (readable as a dict too: ``ans["state"]``)."""
        p: Dict[str, Any] = {"script_id": _sid(script_id)}
        if token is not None:
            p["token"] = token
        return CancelResult.from_dict(_object("script.cancel", await self.request("script.cancel", p)))

    async def revoke(self, token: str) -> RevokeResult:
        """``run.revoke``: cancels the run's scripts, refuses its further starts
        and calls. ``RevokeResult(run_id, cancelled)`` (readable as a dict too)."""
        return RevokeResult.from_dict(_object("run.revoke", await self.request("run.revoke", {"token": token})))

    async def describe(self, token: str) -> str:
        """``run.describe``: the run_script tool description for the token's snapshot."""
        r = await self.request("run.describe", {"token": token})
        text: object = r.get("text") if isinstance(r, dict) else None
        if not isinstance(text, str):
            raise ProtocolError(f"run.describe answered {r!r:.200}")
        return text

    async def run_script_tool(self, token: str) -> Dict[str, Any]:
        """The ready-made MCP ``Tool`` definition of ``run_script`` for the token's
        snapshot (``run.describe``'s ``tool``): hand it to the model as it is;
        its arguments are ``start``'s ``code``, ``tools`` and ``description``."""
        r = await self.request("run.describe", {"token": token})
        tool: object = r.get("tool") if isinstance(r, dict) else None
        if not isinstance(tool, dict):
            raise ProtocolError(f"run.describe answered no `tool` (a daemon from before issue 20?): {r!r:.200}")
        return tool

    async def info(self) -> DaemonInfo:
        """``daemon.info``: ``DaemonInfo(version, protocol, backend, limits, ...)``
        (readable as a dict too: ``info["protocol"]``)."""
        return DaemonInfo.from_dict(_object("daemon.info", await self.request("daemon.info")))

    def progress(self, script_id: Union[str, Started]) -> ProgressStream:
        """An async iterator of the script's progress events, ending with its
        result (see ``ProgressStream``). Only for scripts this connection started."""
        sid = _sid(script_id)
        stream = ProgressStream(self, sid)
        ended = False
        for ev in self._backlog.pop(sid, ()):
            stream._q.put_nowait(ev)
            ended = ended or isinstance(ev, ScriptResult)
        if self._closed is not None and not ended:
            stream._q.put_nowait(self._closed)
        self._streams.setdefault(sid, []).append(stream)
        return stream

    def _unstream(self, stream: ProgressStream) -> None:
        lst = self._streams.get(stream.script_id, [])
        if stream in lst:
            lst.remove(stream)
        if not lst:
            self._streams.pop(stream.script_id, None)

    # --- the reader -----------------------------------------------------------

    async def _send(self, msg: Union[Dict[str, Any], bytes]) -> None:
        data = msg if isinstance(msg, bytes) else _dumps(msg)
        if self._closed is not None or self._writer is None or self._wlock is None:
            raise self._closed or ConnectionClosedError("not connected")
        async with self._wlock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (OSError, ConnectionError) as e:
                self._shutdown(ConnectionClosedError(f"connection to {self.path} lost: {e}", self.path))
                raise self._closed or ConnectionClosedError(str(e), self.path) from e

    async def _read_loop(self) -> None:
        assert self._reader is not None and self._handler_slots is not None
        why: ScriptgateError = ConnectionClosedError(f"the daemon closed the connection ({self.path})", self.path)
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # asyncio.LimitOverrunError, wrapped by readline
                    why = ProtocolError(f"the daemon sent a line longer than {self.max_line_bytes} bytes")
                    break
                except (OSError, ConnectionError) as e:
                    why = ConnectionClosedError(f"connection to {self.path} lost: {e}", self.path)
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    log.warning("ignoring a line from the daemon that is not JSON: %.200r", line)
                    continue
                if not isinstance(msg, dict):
                    log.warning("ignoring a message that is not an object: %.200r", line)
                    continue
                method = msg.get("method")
                if isinstance(method, str):
                    if "id" in msg:
                        await self._handler_slots.acquire()
                        self._serve_request(msg)
                    else:
                        self._notify(method, msg.get("params"))
                elif "id" in msg and ("result" in msg or "error" in msg):
                    self._answer(msg)
                else:
                    log.warning("ignoring a message of no known kind: %.200r", line)
        finally:
            self._shutdown(self.connection_error or why)
            if self._notes is not None:
                self._queue_note(None)

    def _answer(self, msg: Dict[str, Any]) -> None:
        rid = msg.get("id")
        if rid is None:
            err = error_from_rpc(msg.get("error"))
            self.connection_error = err
            log.warning("daemon: %s", err)
            return
        fut = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if fut is None:
            log.debug("answer to an unknown or abandoned request %r", rid)
        elif not fut.done():
            fut.set_result(msg)

    def _spawn(self, coro: Awaitable[Any]) -> "asyncio.Task[Any]":
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # --- the daemon's requests --------------------------------------------------

    def _serve_request(self, msg: Dict[str, Any]) -> None:
        """Serve one daemon request as its own task. A tool call is registered at
        once (before its task runs) so that a ``tool.cancelled`` finds it."""
        assert self._handler_slots is not None
        slots = self._handler_slots
        rid, params = msg["id"], msg.get("params")
        ctx: Optional[CallContext] = None
        if msg["method"] == "tool.call" and isinstance(params, dict):
            ctx = self._call_context(rid, params)
        task = self._spawn(self._serve(msg, ctx))
        task.add_done_callback(lambda _t: slots.release())
        if ctx is not None:
            key = self._key(rid)
            self._calls[key] = (task, ctx)
            task.add_done_callback(lambda _t: self._calls.pop(key, None))

    @staticmethod
    def _key(rid: Any) -> Any:
        return rid if isinstance(rid, (int, str)) else json.dumps(rid)

    def _call_context(self, rid: Any, p: Dict[str, Any]) -> CallContext:
        args = p.get("arguments")
        s = lambda k: p.get(k) if isinstance(p.get(k), str) else None
        call = ToolCall(
            script_id=str(p.get("script_id", "")),
            run_id=str(p.get("run_id", "")),
            call_id=str(p.get("call_id", "")),
            tool=str(p.get("tool", "")),
            arguments=args if isinstance(args, dict) else {},
            traceparent=s("traceparent"),
            tracestate=s("tracestate"),
            span_id=s("span_id"),
        )
        ctx = CallContext(call, rid, call.traceparent, call.tracestate, call.span_id, self._emit_call_progress)
        call.ctx = ctx
        return ctx

    async def _serve(self, msg: Dict[str, Any], ctx: Optional[CallContext]) -> None:
        rid, method, params = msg["id"], msg["method"], msg.get("params")
        try:
            if method not in ("tool.call", "approval.request"):
                raise _HandlerError(METHOD_NOT_FOUND, f"method not found: {method}")
            if not isinstance(params, dict):
                raise _HandlerError(INVALID_PARAMS, f"{method}: params must be an object")
            if ctx is not None:
                result: Any = await self._serve_tool_call(ctx)
            else:
                result = await self._serve_approval(params)
            # A result that is not JSON is an error answer, not a lost one.
            try:
                line: Union[Dict[str, Any], bytes] = _dumps({"jsonrpc": "2.0", "id": rid, "result": result})
            except (TypeError, ValueError) as e:
                raise _HandlerError(HANDLER_FAILED, f"the {method} handler's answer is not JSON: {e}") from None
        except asyncio.CancelledError:
            if ctx is not None and ctx.cancel_reason not in (None, "closed"):
                return  # tool.cancelled: the daemon ignores any answer now
            raise
        except _HandlerError as e:
            line = {"jsonrpc": "2.0", "id": rid, "error": {"code": e.code, "message": e.message[:2000]}}
        except Exception as e:  # the handler failed: the script sees a failed call
            log.warning("%s handler failed: %s: %s", method, type(e).__name__, e, exc_info=True)
            text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            line = {"jsonrpc": "2.0", "id": rid, "error": {"code": HANDLER_FAILED, "message": text[:2000]}}
        try:
            await self._send(line)
        except ScriptgateError:
            pass

    async def _invoke(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a handler: async ones on the loop, plain ones in the thread pool
        (with the current contextvars, so an OpenTelemetry span stays current)."""
        if _is_async(fn) or not self.threaded_handlers or self._executor is None:
            return await _maybe_await(fn(*args))
        run = contextvars.copy_context().run
        r = await asyncio.get_running_loop().run_in_executor(self._executor, run, fn, *args)
        return await _maybe_await(r)

    async def _bounded(self, coro: Awaitable[Any], timeout: Optional[float]) -> Tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` once ``timeout`` passed (the
        work is then cancelled). A handler's own TimeoutError stays its own."""
        if timeout is None:
            return True, await coro
        task = asyncio.ensure_future(coro)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            return False, None
        return True, task.result()

    async def _serve_tool_call(self, ctx: CallContext) -> Any:
        fn = self._tool_handler
        if fn is None:
            raise _HandlerError(METHOD_NOT_FOUND, "this engine serves no tool calls")
        span, token = _otel.start_call_span(ctx.traceparent, ctx.tracestate, {
            "scriptgate.tool": ctx.tool, "scriptgate.script_id": ctx.script_id,
            **({"scriptgate.call.span_id": ctx.span_id} if ctx.span_id else {}),
        })
        call = ctx._call
        ok, why = False, "cancelled"
        try:
            args = (call, ctx) if _takes_ctx(fn) else (call,)
            finished, result = await self._bounded(self._invoke(fn, *args), self.tool_timeout_s)
            if not finished:
                ctx.cancel("timeout", f"tool_timeout_s = {self.tool_timeout_s} passed")
                msg = (f"the engine's tool handler {_name(fn)} did not answer {ctx.tool} within "
                       f"tool_timeout_s = {self.tool_timeout_s} s; the call was cancelled")
                log.error("%s (call %s of script %s)", msg, ctx.call_id, ctx.script_id)
                raise _HandlerError(HANDLER_FAILED, msg)
            try:
                answer = tool_answer(result)
            except ValueError as e:
                msg = f"the engine's tool handler {_name(fn)} gave a malformed answer for {ctx.tool}: {e}"
                log.error("%s (call %s of script %s)", msg, ctx.call_id, ctx.script_id)
                raise _HandlerError(HANDLER_FAILED, msg) from None
            ok = not (answer.get("is_error") or answer.get("isError"))
            why = "the tool result is an error"
            return answer
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
            raise
        finally:
            if span is not None:
                if ctx.cancel_reason:
                    span.set_attribute("scriptgate.cancelled", ctx.cancel_reason)
                _otel.detach(token)
                _otel.end_span(span, ok, why)

    def _emit_call_progress(self, ev: CallProgress) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._queue_note, ("call.progress", ev))
        except RuntimeError:  # the loop closed meanwhile
            pass

    async def _serve_approval(self, p: Dict[str, Any]) -> Dict[str, str]:
        tools = p.get("tools")
        s = lambda k: p.get(k) if isinstance(p.get(k), str) else None
        req = ApprovalRequest(
            script_id=str(p.get("script_id", "")),
            run_id=str(p.get("run_id", "")),
            description=str(p.get("description", "")),
            code=str(p.get("code", "")),
            tools=[t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else [],  # type: ignore[misc]
            traceparent=s("traceparent"),
            tracestate=s("tracestate"),
        )
        fn = self._approval_handler
        if fn is None:
            why = ("no approval handler is registered in the engine (Client(approval_handler=...) "
                   "or handle_approval), so every approval is denied")
            log.warning("approval.request of script %s (run %s) denied: %s", req.script_id, req.run_id, why)
            return self._deny(req, why)
        finished, d = await self._bounded(self._invoke(fn, req), self.approval_timeout_s)
        if not finished:
            why = (f"the engine's approval handler {_name(fn)} did not answer within "
                   f"approval_timeout_s = {self.approval_timeout_s} s, which denies")
            log.warning("approval.request of script %s (run %s) denied: %s", req.script_id, req.run_id, why)
            return self._deny(req, why)
        if d is True or d == "allow_once":
            return {"decision": "allow_once"}
        if d is False or d == "deny":
            return {"decision": "deny"}
        raise ValueError(f"approval handler {_name(fn)} returned {d!r}; expected 'allow_once', 'deny' or a bool")

    def _deny(self, req: ApprovalRequest, why: str) -> Dict[str, str]:
        """Deny, and tell the matching pending ``start`` why (its ApprovalError says it)."""
        key = (req.code, req.description, tuple(sorted({str(t.get("name", "")) for t in req.tools})))
        for s in self._starts:
            if s.key == key and s.denied_why is None:
                s.denied_why = why
                break
        return {"decision": "deny"}

    # --- notifications ----------------------------------------------------------

    def _notify(self, method: str, params: Any) -> None:
        if not isinstance(params, dict):
            log.warning("ignoring %s without params", method)
            return
        if method == "tool.cancelled":
            self._cancel_call(params)
        elif method in ("script.progress", "script.finished"):
            self._queue_note((method, params))
        else:
            log.debug("ignoring notification %s", method)

    def _cancel_call(self, p: Dict[str, Any]) -> None:
        entry = self._calls.get(self._key(p.get("id")))
        if entry is None:
            log.debug("tool.cancelled for a call not in flight: %.200r", p)
            return
        task, ctx = entry
        reason = p.get("reason") if isinstance(p.get("reason"), str) else "cancelled"
        message = p.get("message") if isinstance(p.get("message"), str) else ""
        log.info("call %s (%s) of script %s cancelled by the daemon: %s (%s)",
                 ctx.call_id, ctx.tool, ctx.script_id, reason, message)
        ctx.cancel(reason, message)
        task.cancel()

    def _queue_note(self, note: Any) -> None:
        assert self._notes is not None
        try:
            self._notes.put_nowait(note)
        except asyncio.QueueFull:
            if note is not None and note[0] in ("script.progress", "call.progress"):
                self.dropped_progress += 1
            else:  # never lose a finish (or the end marker): wait for room
                self._spawn(self._notes.put(note))

    def _route(self, sid: str, ev: Any) -> None:
        streams = self._streams.get(sid)
        if streams:
            for s in list(streams):
                s._q.put_nowait(ev)
            return
        q = self._backlog.get(sid)
        if q is None:
            q = self._backlog[sid] = collections.deque(maxlen=BACKLOG_EVENTS)
            while len(self._backlog) > BACKLOG_SCRIPTS:
                self._backlog.popitem(last=False)
        q.append(ev)

    async def _note_loop(self) -> None:
        assert self._notes is not None
        while True:
            note = await self._notes.get()
            if note is None:
                for streams in list(self._streams.values()):
                    for s in list(streams):
                        s._q.put_nowait(self._closed or ConnectionClosedError("connection closed", self.path))
                return
            method, params = note
            cbs: List[Callable[[Any], Any]]
            arg: Any
            if method == "call.progress":
                self._route(params.script_id, params)
                continue
            try:
                if method == "script.progress":
                    cbs, arg = list(self._progress_cbs), ScriptStatus.from_dict(params)
                else:
                    cbs, arg = list(self._finished_cbs), ScriptResult.from_dict(params)
            except (TypeError, ValueError) as e:
                log.warning("ignoring a malformed %s: %s", method, e)
                continue
            self._route(arg.script_id, arg)
            if isinstance(arg, ScriptResult):
                span = self._run_spans.pop(arg.script_id, None)
                if span is not None:
                    _otel.end_span(span, arg.ok, f"script {arg.status}")
                elif _otel.api() is not None:
                    self._finished_early.append((arg.script_id, arg))
            for cb in cbs:
                try:
                    await _maybe_await(cb(arg))
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s callback failed", method)


async def connect(path: Optional[Union[str, "os.PathLike[str]"]] = None, **kw: Any) -> Client:
    """``Client(path, **kw)``, connected."""
    return await Client(path, **kw).connect()
