"""The official MCP Python SDK's `Client` (mcp 2.3.0) against `scriptgate mcp` over
stdio, in its default mode="auto" (it probes server/discover: 2026-07-28) and in
mode="legacy" (initialize: 2025-11-25): the 500-call script's summary, a failing
script's error tail, a declared write approved through its elicitation callback (an
InputRequiredResult in 2026-07-28, elicitation/create before) and refused where the
client declares no elicitation, and a cancelled call whose script is recorded
cancelled."""

from __future__ import annotations

import asyncio
from typing import Any, List

import pytest
import mcp_types as types
from mcp import Client, StdioServerParameters

import hostlib as h

ERAS = {"auto": "2026-07-28", "legacy": "2025-11-25"}
pytestmark = pytest.mark.parametrize("mode", list(ERAS))


def client(mode: str, **kw: Any) -> Client:
    return Client(StdioServerParameters(command=str(h.SCRIPTGATE), args=h.mcp_args()), mode=mode, **kw)


def text_of(r: types.CallToolResult) -> str:
    return "".join(c.text for c in r.content if isinstance(c, types.TextContent))


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_the_500_call_summary_reaches_the_client(mode: str) -> None:
    async def go() -> None:
        async with client(mode) as c:
            assert c.protocol_version == ERAS[mode]
            assert [t.name for t in (await c.list_tools()).tools] == ["run_script"]
            r = await c.call_tool("run_script", {"code": h.SUMMARY_CODE, "description": h.unique("summary")})
            text = text_of(r)
            assert r.is_error is False, text
            assert text.startswith("run_script ok: 500 calls, 0 failed"), text
            assert h.expected_summary() in text, text
            sc = r.structured_content
            assert (sc["status"], sc["calls"], sc["output"]) == ("ok", 500, h.expected_summary() + "\n"), sc

    run(go())


def test_a_failing_script_is_an_error_result_with_its_tail(mode: str) -> None:
    async def go() -> None:
        async with client(mode) as c:
            r = await c.call_tool("run_script", {"code": h.FAIL_CODE, "description": h.unique("fails")})
            assert r.is_error is True
            assert h.FAIL_OUTPUT in text_of(r) and h.FAIL_TAIL in text_of(r), text_of(r)
            sc = r.structured_content
            assert sc["status"] == "error" and sc["output"] == h.FAIL_OUTPUT + "\n", sc
            assert sc["error"].endswith(h.FAIL_TAIL), sc

    run(go())


def test_a_declared_write_is_approved_through_the_elicitation_callback(mode: str) -> None:
    asked: List[types.ElicitRequestParams] = []

    async def elicit(_ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        return types.ElicitResult(action="accept", content={"allow": True})

    async def go() -> None:
        async with client(mode, elicitation_callback=elicit) as c:
            r = await c.call_tool("run_script", h.reboot_args(h.unique("reboot")))
            assert r.is_error is False, text_of(r)
            assert h.REBOOTED in text_of(r), text_of(r)

    run(go())
    assert len(asked) == 1, asked
    assert "fleet__reboot_device (write)" in asked[0].message, asked[0].message


def test_a_client_that_cannot_be_asked_is_refused_the_write_and_told_why(mode: str) -> None:
    async def go() -> None:
        async with client(mode) as c:
            description = h.unique("no-elicitation")
            r = await c.call_tool("run_script", h.reboot_args(description))
            assert r.is_error is True
            assert h.CANNOT_ASK in text_of(r) and "--mode auto" in text_of(r), text_of(r)
            assert r.structured_content["status"] == "refused", r.structured_content
            assert h.CANNOT_ASK in r.structured_content["note"]

    run(go())


def test_a_cancelled_call_leaves_its_script_recorded_cancelled(mode: str) -> None:
    description = h.unique("cancel")

    async def go() -> None:
        up = asyncio.Event()

        async def progress(_v: float, _t: Any, _m: Any) -> None:
            up.set()

        async with client(mode) as c:
            call = asyncio.ensure_future(c.call_tool("run_script", {"code": h.SLEEP_CODE, "description": description},
                                                     progress_callback=progress))
            await asyncio.wait_for(up.wait(), 60)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            # Still connected: the record says how the script ended.
            assert (await h.wait_record(description))["status"] == "cancelled"

    run(go())
