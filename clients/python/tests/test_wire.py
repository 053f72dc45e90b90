"""The wire vectors of tests/fixtures/wire/ (scriptgate-protocol(7), exact JSON),
replayed by this client against a fake daemon that plays them: every request the
client writes, every answer it makes of its handlers' results, and what it makes
of every answer, request, notification and error the daemon writes. The daemon's
own replay is src/protocol/vectors.rs, the TypeScript client's test/wire.test.mjs."""

from __future__ import annotations

import asyncio
import builtins
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Awaitable, Callable, Dict, List

import pytest

import scriptgate_client as sg
from scriptgate_client import (
    CancelResult, Client, DaemonInfo, RevokeResult, ScriptgateError, ScriptResult, ScriptStatus, Started,
)

WIRE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "wire"


def load(name: str) -> List[Dict[str, Any]]:
    out = [json.loads(line) for line in (WIRE / name).read_text().splitlines() if line.strip()]
    assert len({r["name"] for r in out}) == len(out), f"{name}: a name twice"
    return out


ENGINE = load("engine-to-daemon.jsonl")
DAEMON = load("daemon-to-engine.jsonl")
ERRORS = json.loads((WIRE / "errors.json").read_text())


def vectors(records: List[Dict[str, Any]], kind: str, method: Any = ...) -> List[Any]:
    return [pytest.param(r, id=r["name"]) for r in records
            if r["kind"] == kind and (method is ... or r["method"] == method)]


def named(records: List[Dict[str, Any]], name: str) -> Dict[str, Any]:
    return next(r for r in records if r["name"] == name)


def answer_to(method: str) -> Dict[str, Any]:
    """The daemon's answer vector for a method (the first of its variants)."""
    return next(r for r in DAEMON if r["kind"] == "answer" and r["method"] == method)


Fake = Callable[["Peer"], Awaitable[None]]


class Peer:
    """The fake daemon's side of the connection: raw lines, as the vectors hold them."""

    def __init__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.r, self.w = r, w

    async def next(self) -> Dict[str, Any]:
        line = await self.r.readline()
        assert line, "the client closed the connection"
        return json.loads(line)  # type: ignore[no-any-return]

    async def send(self, msg: Dict[str, Any]) -> None:
        self.w.write((json.dumps(msg, separators=(",", ":"), ensure_ascii=False) + "\n").encode())
        await self.w.drain()


def replay(fake: Fake, body: Callable[[Client], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        d = tempfile.mkdtemp(prefix="sg-wire-")
        path = os.path.join(d, "sock")
        done: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()

        async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                await fake(Peer(r, w))
                await r.read()
            except BaseException as e:  # noqa: BLE001 - handed to the test
                if not done.done():
                    done.set_exception(e)
                raise
            finally:
                w.close()
                if not done.done():
                    done.set_result(None)

        server = await asyncio.start_unix_server(serve, path)
        try:
            async with Client(path, **kw) as c:
                out = await asyncio.wait_for(body(c), 10)
            await asyncio.wait_for(done, 10)
            return out
        finally:
            server.close()
            await server.wait_closed()
            os.unlink(path)
            os.rmdir(d)

    return asyncio.run(main())


def with_id(msg: Dict[str, Any], rid: Any) -> Dict[str, Any]:
    return {**msg, "id": rid}


# --- what the engine writes -------------------------------------------------------

SID = "4f1c9e0a2b3d5e6f"


async def call_method(c: Client, method: str, p: Dict[str, Any]) -> Any:
    """Each method the engine calls, through this client's own method for it
    (the admin extension has none: the generic ``request``)."""
    if method == "script.start":
        return await c.start(p["token"], p["code"], p["tools"], p["description"],
                             traceparent=p.get("traceparent"), tracestate=p.get("tracestate"))
    if method == "script.wait":
        return await c.wait(p["script_id"], p.get("timeout_s"), token=p.get("token"))
    if method == "script.status":
        return await c.status(p["script_id"], token=p.get("token"))
    if method == "script.cancel":
        return await c.cancel(p["script_id"], token=p.get("token"))
    if method == "run.revoke":
        return await c.revoke(p["token"])
    if method == "run.describe":
        return await c.describe(p["token"])
    if method == "daemon.info":
        return await c.info()
    if method.startswith("admin."):
        return await c.request(method, p or None)
    raise AssertionError(f"no client method for {method}: add it here")


@pytest.mark.parametrize("v", vectors(ENGINE, "request"))
def test_each_request_is_written_as_the_vector(v: Dict[str, Any]) -> None:
    wire = v["wire"]
    seen: List[Dict[str, Any]] = []

    async def fake(peer: Peer) -> None:
        got = await peer.next()
        seen.append(got)
        await peer.send(with_id(answer_to(v["method"])["wire"], got["id"]))

    replay(fake, lambda c: call_method(c, v["method"], wire.get("params", {})))
    (got,) = seen
    assert isinstance(got["id"], int) and not isinstance(got["id"], bool)
    assert got == with_id(wire, got["id"])


def handler_result(h: Dict[str, Any]) -> Any:
    if "raises" in h:
        raise getattr(builtins, h["raises"])(h["message"])
    return copy.deepcopy(h["returns"])


@pytest.mark.parametrize("v", vectors(ENGINE, "answer", "tool.call") + vectors(ENGINE, "error", "tool.call"))
def test_each_tool_call_answer_is_written_as_the_vector(v: Dict[str, Any]) -> None:
    request = named(DAEMON, "tool.call")["wire"]
    assert request["id"] == v["wire"]["id"]
    seen: List[Dict[str, Any]] = []

    async def fake(peer: Peer) -> None:
        await peer.send(request)
        seen.append(await peer.next())

    async def body(c: Client) -> None:
        while not seen:
            await asyncio.sleep(0.01)

    replay(fake, body, tool_handler=lambda call: handler_result(v["handler"]))
    assert seen == [v["wire"]]


@pytest.mark.parametrize("v", vectors(ENGINE, "answer", "approval.request"))
def test_each_approval_answer_is_written_as_the_vector(v: Dict[str, Any]) -> None:
    request = named(DAEMON, "approval.request")["wire"]
    decision = v["handler"]["returns"]
    for returns in (decision, decision == "allow_once"):  # the string, and the bool
        seen: List[Dict[str, Any]] = []

        async def fake(peer: Peer) -> None:
            await peer.send(request)
            seen.append(await peer.next())

        async def body(c: Client) -> None:
            while not seen:
                await asyncio.sleep(0.01)

        replay(fake, body, approval_handler=lambda req, r=returns: r)
        assert seen == [v["wire"]], returns


# --- what the daemon writes -------------------------------------------------------

TYPED = {
    "script.start": Started, "script.wait": ScriptResult, "script.status": ScriptStatus,
    "script.cancel": CancelResult, "run.revoke": RevokeResult, "daemon.info": DaemonInfo,
}
ARGS = {
    "script.start": {"token": "t", "code": "print(1)", "tools": [], "description": ""},
    "script.wait": {"script_id": SID}, "script.status": {"script_id": SID}, "script.cancel": {"script_id": SID},
    "run.revoke": {"token": "t"}, "run.describe": {"token": "t"}, "daemon.info": {},
    "admin.list": {}, "admin.cancel": {"script_id": SID}, "admin.calls": {"script_id": SID},
    "admin.prune": {"dry_run": True},
}


@pytest.mark.parametrize("v", vectors(DAEMON, "answer"))
def test_each_answer_is_read_into_its_type(v: Dict[str, Any]) -> None:
    result = v["wire"]["result"]

    async def fake(peer: Peer) -> None:
        got = await peer.next()
        assert got["method"] == v["method"]
        await peer.send(with_id(v["wire"], got["id"]))

    got = replay(fake, lambda c: call_method(c, v["method"], ARGS[v["method"]]))
    typed = TYPED.get(v["method"])
    if typed is not None:
        assert type(got) is typed
        assert got.to_dict() == result  # every field read, none lost
        assert got.extra == {}, f"fields protocol(7) names that {typed.__name__} does not: {got.extra}"
    elif v["method"] == "run.describe":
        assert got == result["text"]
    else:  # the admin extension: the answer as it came
        assert got == result


def test_run_script_tool_is_the_describe_answers_tool() -> None:
    v = answer_to("run.describe")

    async def fake(peer: Peer) -> None:
        got = await peer.next()
        await peer.send(with_id(v["wire"], got["id"]))

    assert replay(fake, lambda c: c.run_script_tool("t")) == v["wire"]["result"]["tool"]


def test_the_answers_that_were_dicts_still_read_as_dicts() -> None:
    info = DaemonInfo.from_dict(answer_to("daemon.info")["wire"]["result"])
    assert info["protocol"] == 1 and "limits" in info and info.get("nope") is None
    assert info.limits["max_calls"] == 500 and info.sandbox is not None and info.sandbox.state == "ok"
    ans = CancelResult.from_dict(named(DAEMON, "script.cancel:already_finished")["wire"]["result"])
    assert (ans["state"], ans.already_finished) == ("ok", True)
    assert RevokeResult.from_dict(answer_to("run.revoke")["wire"]["result"])["cancelled"] == 2


@pytest.mark.parametrize("v", vectors(DAEMON, "request", "tool.call"))
def test_each_tool_call_reaches_the_handler_as_sent(v: Dict[str, Any]) -> None:
    calls: List[Any] = []
    answered: List[Dict[str, Any]] = []

    async def fake(peer: Peer) -> None:
        await peer.send(v["wire"])
        answered.append(await peer.next())

    async def body(c: Client) -> None:
        while not answered:
            await asyncio.sleep(0.01)

    def handler(call: Any, ctx: Any) -> str:
        calls.append((call, ctx))
        return "ok"

    replay(fake, body, tool_handler=handler)
    ((call, ctx),) = calls
    params = v["wire"]["params"]
    assert call.to_dict() == params
    assert (ctx.traceparent, ctx.tracestate, ctx.span_id) == tuple(params.get(k) for k in ("traceparent", "tracestate", "span_id"))
    # Numbers arrive as the script wrote them: ints exact, floats floats.
    for k, a in params["arguments"].items():
        assert type(call.arguments[k]) is type(a) and call.arguments[k] == a, k
    assert answered[0]["id"] == v["wire"]["id"]


@pytest.mark.parametrize("v", vectors(DAEMON, "request", "approval.request"))
def test_each_approval_request_reaches_the_handler_as_sent(v: Dict[str, Any]) -> None:
    seen: List[Any] = []
    answered: List[Dict[str, Any]] = []

    async def fake(peer: Peer) -> None:
        await peer.send(v["wire"])
        answered.append(await peer.next())

    async def body(c: Client) -> None:
        while not answered:
            await asyncio.sleep(0.01)

    replay(fake, body, approval_handler=lambda req: seen.append(req) or "deny")
    assert seen[0].to_dict() == v["wire"]["params"]
    assert answered == [{"jsonrpc": "2.0", "id": v["wire"]["id"], "result": {"decision": "deny"}}]


@pytest.mark.parametrize("v", vectors(DAEMON, "notification", "script.progress")
                         + vectors(DAEMON, "notification", "script.finished"))
def test_each_script_notification_reaches_the_callbacks_typed(v: Dict[str, Any]) -> None:
    got: List[Any] = []

    async def fake(peer: Peer) -> None:
        await peer.send(v["wire"])

    async def body(c: Client) -> None:
        while not got:
            await asyncio.sleep(0.01)

    replay(fake, body, on_progress=got.append, on_finished=got.append)
    typed = ScriptStatus if v["method"] == "script.progress" else ScriptResult
    assert type(got[0]) is typed
    assert got[0].to_dict() == v["wire"]["params"] and got[0].extra == {}


@pytest.mark.parametrize("v", vectors(DAEMON, "notification", "tool.cancelled"))
def test_each_tool_cancelled_cancels_its_call_and_no_answer_is_sent(v: Dict[str, Any]) -> None:
    p = v["wire"]["params"]
    call = with_id(named(DAEMON, "tool.call")["wire"], p["id"])
    call["params"] = {**call["params"], "call_id": p["call_id"], "script_id": p["script_id"]}
    ctxs: List[Any] = []
    after: List[Dict[str, Any]] = []

    async def fake(peer: Peer) -> None:
        await peer.send(call)
        while not ctxs:
            await asyncio.sleep(0.01)
        await peer.send(v["wire"])
        nxt = await peer.next()  # the body's request: no answer to the cancelled call came first
        after.append(nxt)
        await peer.send(with_id(answer_to("daemon.info")["wire"], nxt["id"]))

    async def handler(call: Any, ctx: Any) -> str:
        ctxs.append(ctx)
        await asyncio.sleep(60)
        return "too late"

    async def body(c: Client) -> Any:
        while not ctxs or not ctxs[0].cancelled.is_set():
            await asyncio.sleep(0.01)
        return await c.info()

    replay(fake, body, tool_handler=handler)
    assert (ctxs[0].cancel_reason, ctxs[0].cancel_message) == (p["reason"], p["message"])
    assert ctxs[0].call_id == p["call_id"]
    assert after[0]["method"] == "daemon.info"


def check_error(e: BaseException, v: Dict[str, Any]) -> None:
    err = v["wire"]["error"]
    assert type(e).__name__ == v["class"], type(e).__mro__
    assert isinstance(e, ScriptgateError)
    assert (e.code, e.message) == (err["code"], err["message"])
    assert e.data == err.get("data", {})
    d = err.get("data", {})
    assert (e.reason, e.field, e.tool) == (d.get("reason"), d.get("field"), d.get("tool"))


@pytest.mark.parametrize("v", [p for p in vectors(DAEMON, "error") if p.values[0]["method"] is not None])
def test_each_error_answer_raises_its_class(v: Dict[str, Any]) -> None:
    async def fake(peer: Peer) -> None:
        got = await peer.next()
        await peer.send(with_id(v["wire"], got["id"]))

    async def body(c: Client) -> BaseException:
        with pytest.raises(ScriptgateError) as e:
            await c.request(v["method"], {})
        return e.value

    check_error(replay(fake, body), v)


@pytest.mark.parametrize("v", [p for p in vectors(DAEMON, "error") if p.values[0]["method"] is None])
def test_each_unasked_error_becomes_the_connections_error(v: Dict[str, Any]) -> None:
    """An error with id null (a peer refused, a line that could not be read): kept
    as ``connection_error``, and what a request fails with once the daemon closes."""
    async def fake(peer: Peer) -> None:
        await peer.send(v["wire"])
        await peer.next()
        peer.w.close()

    async def body(c: Client) -> Any:
        with pytest.raises(ScriptgateError) as e:
            await c.info()
        return e.value, c.connection_error

    e, kept = replay(fake, body)
    check_error(e, v)
    assert kept is e


def test_the_error_classes_are_the_shared_ones() -> None:
    for name, parent in ERRORS["parents"].items():
        cls = getattr(sg.errors, name)
        assert cls.__name__ == name
        assert cls.__bases__[0].__name__ == (parent or "Exception"), name
        if parent:
            assert issubclass(cls, ScriptgateError)
    for code, name in ERRORS["by_code"].items():
        e = sg.error_from_rpc({"code": int(code), "message": "m"})
        assert type(e).__name__ == name and type(e).code == int(code)
    assert type(sg.error_from_rpc({"code": -32099, "message": "m"})).__name__ == ERRORS["other_code"]
    # Each in its language's idiom: the connection errors are the built-in OSErrors too.
    assert issubclass(sg.errors.SocketNotFoundError, FileNotFoundError)
    assert issubclass(sg.errors.ConnectionRefusedError, builtins.ConnectionRefusedError)
    assert issubclass(sg.errors.PermissionDeniedError, PermissionError)
    assert issubclass(sg.errors.ConnectionClosedError, builtins.ConnectionError)
    # The names of 0.1.0 are the same classes.
    assert sg.ConnectionClosed is sg.ConnectionClosedError and sg.InvalidParams is sg.InvalidParamsError
    assert sg.ConnectFailed is sg.errors.ConnectionError and sg.StillRunning is sg.StillRunningError


def test_every_vector_kind_is_replayed() -> None:
    """A vector of a kind or method these tests do not know fails here, not silently."""
    known = {("request", m) for m in ARGS} | {("answer", m) for m in ARGS} | {
        ("answer", "tool.call"), ("error", "tool.call"), ("answer", "approval.request"),
        ("request", "tool.call"), ("request", "approval.request"),
        ("notification", "script.progress"), ("notification", "script.finished"),
        ("notification", "tool.cancelled"),
    }
    for r in ENGINE + DAEMON:
        if r["kind"] == "error" and "class" in r:
            assert r["class"] in ERRORS["parents"], r["name"]
            continue
        assert (r["kind"], r["method"]) in known, r["name"]
