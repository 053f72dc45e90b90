"""The asyncio engine client: JSON-RPC 2.0 lines over scriptgated's Unix socket.

Both sides send requests. The daemon's requests (``tool.call``,
``approval.request``) may arrive at any time -- an ``approval.request`` arrives
*before* the answer to the ``script.start`` that caused it -- so the reader never
serves one request at a time: each becomes a task, and the reader goes on reading.
Ids of the two directions are independent.

Notifications (``script.progress``, ``script.finished``) are delivered in the
order they arrive, by one task, to the registered callbacks.

The connection that starts a script owns it: if the connection closes, the
daemon cancels the script (``error: "engine disconnected"``).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import os
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Optional, Set, Union

from .errors import ConnectionClosed, ProtocolError, ScriptgateError, error_from_rpc
from .types import ApprovalRequest, ScriptResult, ScriptStatus, Tool, ToolCall

log = logging.getLogger("scriptgate_client")

DEFAULT_SOCKET = "/run/scriptgate/scriptgate.sock"
#: Longest line read from the daemon (its own default ``max_message_bytes``).
DEFAULT_MAX_LINE_BYTES = 16 << 20
#: Daemon requests served at once; past this the reader waits for one to end.
DEFAULT_MAX_HANDLERS = 256
#: Notifications queued for the callbacks; past this, progress ones are dropped.
NOTIFY_QUEUE = 1024

ToolResult = Dict[str, Any]
ToolHandler = Callable[[ToolCall], Union[ToolResult, str, Awaitable[Union[ToolResult, str]]]]
ApprovalHandler = Callable[[ApprovalRequest], Union[str, bool, Awaitable[Union[str, bool]]]]
ProgressCallback = Callable[[ScriptStatus], Optional[Awaitable[None]]]
FinishedCallback = Callable[[ScriptResult], Optional[Awaitable[None]]]

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


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


class Client:
    """An engine's connection to scriptgated.

    ::

        async with Client(sock, tool_handler=call_tool, approval_handler=ask_user) as sg:
            result = await sg.run(token, code, tools=["fleet__reboot_device"])
            print(result.text)

    ``tool_handler(call: ToolCall)`` returns ``{"text", "structured", "is_error"}``,
    an MCP ``CallToolResult`` (``{"content": [...], "structuredContent"?, "isError"?}``)
    or a plain string (taken as text); it is sent as returned. If it raises, the
    daemon is answered with a JSON-RPC error and the script sees a failed call.
    ``approval_handler(req: ApprovalRequest)`` returns ``"allow_once"``/``"deny"``
    or a bool; without one every approval is denied. Handlers and callbacks may be
    plain or async callables. A plain one runs on the event loop and holds it
    while it runs; with ``threaded_handlers=True`` plain handlers run in the
    loop's default thread pool instead (so they must be thread-safe).

    Bounds: a line from the daemon longer than ``max_line_bytes`` ends the
    connection (``ProtocolError``); at most ``max_handlers`` daemon requests are
    served at once (then the reader waits); at most 1024 notifications wait for
    the callbacks (then further ``script.progress`` ones are dropped and counted
    in ``dropped_progress``; ``script.finished`` ones are never dropped).
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
        threaded_handlers: bool = False,
    ) -> None:
        self.path = os.fspath(path or os.environ.get("SCRIPTGATE_SOCKET") or DEFAULT_SOCKET)
        self._tool_handler = tool_handler
        self._approval_handler = approval_handler
        self._progress_cbs: List[ProgressCallback] = [on_progress] if on_progress else []
        self._finished_cbs: List[FinishedCallback] = [on_finished] if on_finished else []
        self.max_line_bytes = max_line_bytes
        self.max_handlers = max_handlers
        self.threaded_handlers = threaded_handlers
        self._ids = itertools.count(1)
        self._pending: Dict[int, "asyncio.Future[Dict[str, Any]]"] = {}
        self._tasks: Set["asyncio.Task[Any]"] = set()
        self._reader: Optional[asyncio.StreamReader] = None
        self._writer: Optional[asyncio.StreamWriter] = None
        self._wlock: Optional[asyncio.Lock] = None
        self._handler_slots: Optional[asyncio.Semaphore] = None
        self._notes: Optional["asyncio.Queue[Any]"] = None
        self._read_task: Optional["asyncio.Task[None]"] = None
        self._note_task: Optional["asyncio.Task[None]"] = None
        self._closed: Optional[ScriptgateError] = ConnectionClosed("not connected")
        #: The last error the daemon sent with id null (e.g. -32001, -32600).
        self.connection_error: Optional[ScriptgateError] = None
        #: ``script.progress`` notifications dropped because the callbacks lagged.
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
        if self._closed is None:
            return self
        self._reader, self._writer = await asyncio.open_unix_connection(self.path, limit=self.max_line_bytes)
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
        self._shutdown(ConnectionClosed("connection closed by the client"))
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

    def _shutdown(self, why: ScriptgateError) -> None:
        if self._closed is not None:
            return
        self._closed = why
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self._closed)
        self._pending.clear()
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
    ) -> str:
        """``script.start``: returns the script id once the script runs.

        ``tools`` are the write tools the script declares; when approval is
        needed the approval handler is asked before this returns."""
        names = [t.name if isinstance(t, Tool) else t for t in tools]
        r = await self.request(
            "script.start", {"token": token, "code": code, "tools": names, "description": description}
        )
        sid: object = r.get("script_id") if isinstance(r, dict) else None
        if not isinstance(sid, str):
            raise ProtocolError(f"script.start answered {r!r:.200}")
        return sid

    async def wait(
        self, script_id: str, timeout_s: Optional[float] = None, *, token: Optional[str] = None
    ) -> ScriptResult:
        """``script.wait``: the result once the script has finished.
        Raises ``StillRunning`` after ``timeout_s`` (the script goes on)."""
        p: Dict[str, Any] = {"script_id": script_id}
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
        """Start a script and wait for its result."""
        sid = await self.start(token, code, tools, description)
        return await self.wait(sid, timeout_s)

    async def status(self, script_id: str, *, token: Optional[str] = None) -> ScriptStatus:
        p: Dict[str, Any] = {"script_id": script_id}
        if token is not None:
            p["token"] = token
        return ScriptStatus.from_dict(_object("script.status", await self.request("script.status", p)))

    async def cancel(self, script_id: str, *, token: Optional[str] = None) -> Dict[str, Any]:
        """``script.cancel``: answers ``{script_id, state}`` once the script has ended."""
        p: Dict[str, Any] = {"script_id": script_id}
        if token is not None:
            p["token"] = token
        return _object("script.cancel", await self.request("script.cancel", p))

    async def revoke(self, token: str) -> Dict[str, Any]:
        """``run.revoke``: cancels the run's scripts, refuses its further starts
        and calls. Answers ``{run_id, cancelled}``."""
        return _object("run.revoke", await self.request("run.revoke", {"token": token}))

    async def describe(self, token: str) -> str:
        """``run.describe``: the run_script tool description for the token's snapshot."""
        r = await self.request("run.describe", {"token": token})
        text: object = r.get("text") if isinstance(r, dict) else None
        if not isinstance(text, str):
            raise ProtocolError(f"run.describe answered {r!r:.200}")
        return text

    async def info(self) -> Dict[str, Any]:
        """``daemon.info``: ``{version, protocol, backend, limits, ...}``."""
        return _object("daemon.info", await self.request("daemon.info"))

    # --- the reader -----------------------------------------------------------

    async def _send(self, msg: Union[Dict[str, Any], bytes]) -> None:
        data = msg if isinstance(msg, bytes) else _dumps(msg)
        if self._closed is not None or self._writer is None or self._wlock is None:
            raise self._closed or ConnectionClosed("not connected")
        async with self._wlock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (OSError, ConnectionError) as e:
                self._shutdown(ConnectionClosed(f"connection lost: {e}"))
                raise self._closed or ConnectionClosed(str(e)) from e

    async def _read_loop(self) -> None:
        assert self._reader is not None and self._handler_slots is not None
        why: ScriptgateError = ConnectionClosed("the daemon closed the connection")
        try:
            while True:
                try:
                    line = await self._reader.readline()
                except ValueError:  # asyncio.LimitOverrunError, wrapped by readline
                    why = ProtocolError(f"the daemon sent a line longer than {self.max_line_bytes} bytes")
                    break
                except (OSError, ConnectionError) as e:
                    why = ConnectionClosed(f"connection lost: {e}")
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
                        self._spawn(self._serve(msg))
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

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the daemon's requests --------------------------------------------------

    async def _serve(self, msg: Dict[str, Any]) -> None:
        assert self._handler_slots is not None
        rid, method, params = msg["id"], msg["method"], msg.get("params")
        try:
            try:
                if method not in ("tool.call", "approval.request"):
                    raise _HandlerError(METHOD_NOT_FOUND, f"method not found: {method}")
                if not isinstance(params, dict):
                    raise _HandlerError(INVALID_PARAMS, f"{method}: params must be an object")
                if method == "tool.call":
                    result: Any = await self._serve_tool_call(params)
                else:
                    result = await self._serve_approval(params)
                # A result that is not JSON is an error answer, not a lost one.
                line: Union[Dict[str, Any], bytes] = _dumps({"jsonrpc": "2.0", "id": rid, "result": result})
            except asyncio.CancelledError:
                raise
            except _HandlerError as e:
                line = {"jsonrpc": "2.0", "id": rid, "error": {"code": e.code, "message": e.message}}
            except Exception as e:  # the handler failed: the script sees a failed call
                log.warning("%s handler failed: %r", method, e, exc_info=log.isEnabledFor(logging.DEBUG))
                text = str(e) or type(e).__name__
                line = {"jsonrpc": "2.0", "id": rid, "error": {"code": HANDLER_FAILED, "message": text[:2000]}}
            try:
                await self._send(line)
            except ScriptgateError:
                pass
        finally:
            self._handler_slots.release()

    async def _call_handler(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        if self.threaded_handlers and not _is_async(fn):
            return await _maybe_await(await asyncio.get_running_loop().run_in_executor(None, fn, arg))
        return await _maybe_await(fn(arg))

    async def _serve_tool_call(self, p: Dict[str, Any]) -> Any:
        if self._tool_handler is None:
            raise _HandlerError(METHOD_NOT_FOUND, "this engine serves no tool calls")
        args = p.get("arguments")
        call = ToolCall(
            script_id=str(p.get("script_id", "")),
            run_id=str(p.get("run_id", "")),
            call_id=str(p.get("call_id", "")),
            tool=str(p.get("tool", "")),
            arguments=args if isinstance(args, dict) else {},
        )
        result = await self._call_handler(self._tool_handler, call)
        if isinstance(result, str):
            return {"text": result, "structured": None, "is_error": False}
        if not isinstance(result, dict):
            raise TypeError(f"tool handler returned {type(result).__name__}, not a result dict")
        return result

    async def _serve_approval(self, p: Dict[str, Any]) -> Dict[str, str]:
        tools = p.get("tools")
        req = ApprovalRequest(
            script_id=str(p.get("script_id", "")),
            run_id=str(p.get("run_id", "")),
            description=str(p.get("description", "")),
            code=str(p.get("code", "")),
            tools=[t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else [],
        )
        if self._approval_handler is None:
            return {"decision": "deny"}
        d = await self._call_handler(self._approval_handler, req)
        if d is True or d == "allow_once":
            return {"decision": "allow_once"}
        if d is False or d == "deny":
            return {"decision": "deny"}
        raise ValueError(f"approval handler returned {d!r}; expected 'allow_once', 'deny' or a bool")

    # --- notifications ----------------------------------------------------------

    def _notify(self, method: str, params: Any) -> None:
        if not isinstance(params, dict):
            log.warning("ignoring %s without params", method)
            return
        if method in ("script.progress", "script.finished"):
            self._queue_note((method, params))
        else:
            log.debug("ignoring notification %s", method)

    def _queue_note(self, note: Any) -> None:
        assert self._notes is not None
        try:
            self._notes.put_nowait(note)
        except asyncio.QueueFull:
            if note is not None and note[0] == "script.progress":
                self.dropped_progress += 1
            else:  # never lose a finish (or the end marker): wait for room
                self._spawn(self._notes.put(note))

    async def _note_loop(self) -> None:
        assert self._notes is not None
        while True:
            note = await self._notes.get()
            if note is None:
                return
            method, params = note
            cbs: List[Callable[[Any], Any]]
            arg: Any
            try:
                if method == "script.progress":
                    cbs, arg = list(self._progress_cbs), ScriptStatus.from_dict(params)
                else:
                    cbs, arg = list(self._finished_cbs), ScriptResult.from_dict(params)
            except (TypeError, ValueError) as e:
                log.warning("ignoring a malformed %s: %s", method, e)
                continue
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
