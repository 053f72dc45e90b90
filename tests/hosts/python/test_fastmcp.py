"""fastmcp 4.2.3's `Client` at its defaults (mode="auto": 2026-07-28) against
`scriptgate mcp` over stdio: the 500-call summary (its `.data`, what fastmcp hands an
application, is the structuredContent with the output), a failing script's error
tail, a declared write approved through its elicitation_handler and refused without
one, and a cancelled call whose script is recorded cancelled."""

from __future__ import annotations

import asyncio
from typing import Any, List

import pytest
from fastmcp import Client
from fastmcp.client.transports import StdioTransport

import hostlib as h


def client(**kw: Any) -> Client:
    return Client(StdioTransport(command=str(h.SCRIPTGATE), args=h.mcp_args()), **kw)


def text_of(r: Any) -> str:
    return "".join(getattr(c, "text", "") for c in r.content)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_the_500_call_summary_reaches_the_client() -> None:
    async def go() -> None:
        async with client() as c:
            assert c.session.protocol_version == "2026-07-28"
            r = await c.call_tool("run_script", {"code": h.SUMMARY_CODE, "description": h.unique("summary")})
            assert r.is_error is False
            assert h.expected_summary() in text_of(r)
            # fastmcp parses structuredContent against the tool's outputSchema.
            assert r.data.output == h.expected_summary() + "\n", r.data
            assert (r.data.status, r.data.calls) == ("ok", 500)

    run(go())


def test_a_failing_script_is_an_error_result_with_its_tail() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.call_tool("run_script", {"code": h.FAIL_CODE, "description": h.unique("fails")},
                                  raise_on_error=False)
            assert r.is_error is True
            assert h.FAIL_TAIL in text_of(r) and h.FAIL_OUTPUT in text_of(r), text_of(r)
            assert r.structured_content["error"].endswith(h.FAIL_TAIL)
            # At its default (raise_on_error=True) fastmcp raises ToolError with the text.
            with pytest.raises(Exception, match="SN0042 did not answer"):
                await c.call_tool("run_script", {"code": h.FAIL_CODE, "description": h.unique("fails")})

    run(go())


def test_a_declared_write_is_approved_through_the_elicitation_handler() -> None:
    asked: List[str] = []

    async def elicit(message: str, response_type: Any, params: Any, ctx: Any) -> Any:
        asked.append(message)
        return {"allow": True}

    async def go() -> None:
        async with client(elicitation_handler=elicit) as c:
            r = await c.call_tool("run_script", h.reboot_args(h.unique("reboot")))
            assert r.is_error is False and h.REBOOTED in text_of(r), text_of(r)

    run(go())
    assert len(asked) == 1 and "fleet__reboot_device (write)" in asked[0], asked


def test_a_client_without_an_elicitation_handler_is_refused_the_write_and_told_why() -> None:
    async def go() -> None:
        async with client() as c:
            r = await c.call_tool("run_script", h.reboot_args(h.unique("no-elicitation")), raise_on_error=False)
            assert r.is_error is True and h.CANNOT_ASK in text_of(r), text_of(r)

    run(go())


def test_a_cancelled_call_leaves_its_script_recorded_cancelled() -> None:
    description = h.unique("cancel")

    async def go() -> None:
        up = asyncio.Event()

        async def progress(_v: float, _t: Any, _m: Any) -> None:
            up.set()

        async with client(progress_handler=progress) as c:
            call = asyncio.ensure_future(c.call_tool("run_script", {"code": h.SLEEP_CODE, "description": description}))
            await asyncio.wait_for(up.wait(), 60)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert (await h.wait_record(description))["status"] == "cancelled"

    run(go())
