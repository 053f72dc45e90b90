"""Task round trips (the io.modelcontextprotocol/tasks extension, SEP-2663) against
`scriptgate mcp --task-after 0` over stdio, with the hosts that declare tasks: the
official Python SDK's Client (mcp 2.3.0, mode="auto") with fastmcp-tasks 4.1.4's
TasksClientExtension, and fastmcp 4.1.4's Client (which registers that extension
itself) through its explicit task handle (call_tool_task), and pydantic-ai 2.68 on
that fastmcp, at its defaults, with a FunctionModel. A call declaring the
extension is answered with a task; tasks/get polls it to the same result the call
would have had; tasks/cancel ends the script, whose record says cancelled."""

from __future__ import annotations

import asyncio
from typing import Any, List

import mcp_types as types
import pytest
from fastmcp import Client as FastMCPClient
from fastmcp.client.transports import StdioTransport
from fastmcp_tasks.client import TasksClientExtension, call_tool_task
from fastmcp_tasks.client_models import ClientCreateTaskResult
from mcp import Client, StdioServerParameters

import hostlib as h


class Counted(TasksClientExtension):
    """The extension, counting the tasks it resolved (so that a call's answer is known
    to have come through a task, not at once)."""

    def __init__(self, elicitation_callback: Any = None) -> None:
        super().__init__(elicitation_callback)
        self.resolved: List[str] = []

    async def _resolve_task(self, create_result: ClientCreateTaskResult, ctx: Any) -> types.CallToolResult:
        self.resolved.append(create_result.task_id)
        return await super()._resolve_task(create_result, ctx)


def sdk(ext: TasksClientExtension, **kw: Any) -> Client:
    params = StdioServerParameters(command=str(h.SCRIPTGATE), args=h.mcp_args("--task-after", "0"))
    return Client(params, extensions=[ext], **kw)


def text_of(r: Any) -> str:
    return "".join(getattr(c, "text", "") for c in r.content)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_the_sdk_with_the_tasks_extension_gets_the_500_call_summary_through_a_task() -> None:
    ext = Counted()

    async def go() -> None:
        async with sdk(ext) as c:
            assert c.protocol_version == "2026-07-28"
            r = await c.call_tool("run_script", {"code": h.SUMMARY_CODE, "description": h.unique("task-summary")})
            assert r.is_error is False, text_of(r)
            assert h.expected_summary() in text_of(r)
            assert r.structured_content["output"] == h.expected_summary() + "\n"
            assert r.structured_content["calls"] == 500

    run(go())
    assert len(ext.resolved) == 1, "the call was answered with a task"


def test_a_task_handle_polled_with_tasks_get_ends_completed_with_the_calls_result() -> None:
    async def go() -> None:
        async with sdk(TasksClientExtension()) as c:
            created = await c.session.call_tool(
                "run_script", {"code": h.FAIL_CODE, "description": h.unique("task-fails")}, allow_claimed=True)
            assert isinstance(created, ClientCreateTaskResult), created
            assert created.status == "working" and created.poll_interval_ms and created.ttl_ms, created
            final = await asyncio.wait_for(call_wait(c, created.task_id), 60)
            # A script that failed is a completed task whose result is the error result.
            assert final.status == "completed", final
            assert final.result["isError"] is True
            assert final.result["structuredContent"]["error"].endswith(h.FAIL_TAIL)
            assert h.FAIL_TAIL in final.result["content"][0]["text"]

    run(go())


async def call_wait(c: Client, task_id: str) -> Any:
    """tasks/get until the task is terminal, as often as it asks (pollIntervalMs)."""
    from fastmcp_tasks.client import _send_get

    while True:
        got = await _send_get(c.session, task_id)
        if got.status in ("completed", "failed", "cancelled"):
            return got
        await asyncio.sleep((got.poll_interval_ms or 1000) / 1000)


def test_a_declared_write_is_approved_then_runs_as_a_task() -> None:
    asked: List[str] = []

    async def elicit(_ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"allow": True})

    ext = Counted(elicit)

    async def go() -> None:
        async with sdk(ext, elicitation_callback=elicit) as c:
            r = await c.call_tool("run_script", h.reboot_args(h.unique("task-reboot")))
            assert r.is_error is False and h.REBOOTED in text_of(r), text_of(r)

    run(go())
    assert len(asked) == 1 and "fleet__reboot_device (write)" in asked[0]
    assert len(ext.resolved) == 1


def test_tasks_cancel_ends_the_script_cancelled() -> None:
    description = h.unique("task-cancel")

    async def go() -> None:
        async with sdk(TasksClientExtension()) as c:
            created = await c.session.call_tool("run_script", {"code": h.SLEEP_CODE, "description": description},
                                                allow_claimed=True)
            assert isinstance(created, ClientCreateTaskResult), created
            await h.wait_record(description, running=True)
            from fastmcp_tasks.client import _send_cancel

            await _send_cancel(c.session, created.task_id)
            final = await asyncio.wait_for(call_wait(c, created.task_id), 60)
            assert final.status == "cancelled", final
            assert (await h.wait_record(description))["status"] == "cancelled"

    run(go())


def test_fastmcp_s_task_handle_waits_for_the_result_and_cancels() -> None:
    description = h.unique("fastmcp-task-cancel")

    async def go() -> None:
        client = FastMCPClient(StdioTransport(command=str(h.SCRIPTGATE), args=h.mcp_args("--task-after", "0")))
        async with client:
            task = await call_tool_task(client, "run_script",
                                        {"code": h.SUMMARY_CODE, "description": h.unique("fastmcp-task")})
            r = await task.result()
            assert r.data.output == h.expected_summary() + "\n", r.data
            task = await call_tool_task(client, "run_script", {"code": h.SLEEP_CODE, "description": description})
            await h.wait_record(description, running=True)
            await task.cancel()
            assert (await task.wait(timeout=60)).status == "cancelled"
            with pytest.raises(Exception, match="cancelled"):
                await task.result()
            assert (await h.wait_record(description))["status"] == "cancelled"

    run(go())


def test_pydantic_ai_with_fastmcp_tasks_hands_its_model_the_summary_of_a_task() -> None:
    """pydantic-ai's MCPToolset at its defaults (prefer_tasks), fastmcp-tasks installed:
    the call is answered with a task, which it polls to the result its FunctionModel
    is handed."""
    from pydantic_ai import Agent
    from pydantic_ai.mcp import MCPToolset
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    returned: List[Any] = []

    def model(messages: Any, info: Any) -> ModelResponse:
        back = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        if back:
            returned.extend(back)
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart("run_script", {"code": h.SUMMARY_CODE,
                                                                "description": h.unique("pydantic-ai-task")})])

    sent: List[str] = []

    async def go() -> None:
        toolset = MCPToolset(StdioTransport(command=str(h.SCRIPTGATE), args=h.mcp_args("--task-after", "0")))
        agent = Agent(FunctionModel(model), toolsets=[toolset])
        async with agent:
            session = toolset.client.session
            send = session.send_request

            async def spy(request: Any, *a: Any, **kw: Any) -> Any:
                sent.append(getattr(request, "method", type(request).__name__))
                return await send(request, *a, **kw)

            session.send_request = spy
            assert (await agent.run("check the fleet")).output == "done"

    run(go())
    assert "tasks/get" in sent, f"no task was polled: {sent}"
    assert len(returned) == 1 and returned[0].content["output"] == h.expected_summary() + "\n", returned
