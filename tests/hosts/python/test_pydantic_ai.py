"""pydantic-ai 2.68's MCPToolset (on fastmcp's Client, mode="auto": 2026-07-28) against
`scriptgate mcp` over stdio, driven by a FunctionModel: a function that plays the
model, calls run_script, and keeps what the agent hands it back. pydantic-ai gives
the model a tool's structuredContent, not its text, when every content block is text
(and, for an error result, always): so the script's output and its error's tail
reach the model only through structuredContent's `output` and `error`."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List

from fastmcp.client.transports import StdioTransport
from pydantic_ai import Agent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, RetryPromptPart, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import hostlib as h


class Model:
    """Calls run_script once with `args`, then answers; keeps the tools it was offered
    and what came back from the call, as the model saw it."""

    def __init__(self, args: Dict[str, Any]) -> None:
        self.args = args
        self.offered: List[str] = []
        self.description = ""
        self.returned: List[Any] = []

    def __call__(self, messages: List[ModelMessage], info: AgentInfo) -> ModelResponse:
        last = messages[-1]
        assert isinstance(last, ModelRequest)
        back = [p for p in last.parts if isinstance(p, (ToolReturnPart, RetryPromptPart))]
        if back:
            self.returned += back
            return ModelResponse(parts=[TextPart("done")])
        self.offered = [t.name for t in info.function_tools]
        self.description = info.function_tools[0].description or ""
        return ModelResponse(parts=[ToolCallPart("run_script", self.args)])

    def seen(self) -> str:
        """What the model was handed back, as the text it reads."""
        assert len(self.returned) == 1, self.returned
        p = self.returned[0]
        return p.model_response() if isinstance(p, RetryPromptPart) else p.model_response_str()


def toolset(**kw: Any) -> MCPToolset:
    return MCPToolset(StdioTransport(command=str(h.SCRIPTGATE), args=h.mcp_args()), **kw)


def run_agent(model: Model, **kw: Any) -> str:
    async def go() -> str:
        agent = Agent(FunctionModel(model), toolsets=[toolset(**kw)])
        async with agent:
            return (await agent.run("check the fleet")).output

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_the_model_is_handed_the_500_call_summary() -> None:
    m = Model({"code": h.SUMMARY_CODE, "description": h.unique("summary")})
    assert run_agent(m) == "done"
    assert m.offered == ["run_script"]
    assert "import agent_tools" in m.description
    part = m.returned[0]
    assert isinstance(part, ToolReturnPart)
    # The structured content, as the model gets it: the output is in it.
    assert part.content["output"] == h.expected_summary() + "\n", part.content
    assert (part.content["status"], part.content["calls"]) == ("ok", 500)
    assert h.expected_summary() in m.seen()


def test_the_model_is_handed_a_failing_scripts_output_and_error_tail() -> None:
    m = Model({"code": h.FAIL_CODE, "description": h.unique("fails")})
    run_agent(m)
    seen = m.seen()
    assert h.FAIL_OUTPUT in seen and h.FAIL_TAIL in seen, seen
    # pydantic-ai hands a failed call's structuredContent back as its JSON (with
    # tool_error_behavior="retry", its default, for the model to try again).
    part = m.returned[0]
    got = json.loads(part.content if isinstance(part, ToolReturnPart) else part.model_response())
    assert got["status"] == "error" and got["output"] == h.FAIL_OUTPUT + "\n", got
    assert got["error"].endswith(h.FAIL_TAIL), got


def test_a_declared_write_is_approved_through_the_elicitation_handler() -> None:
    asked: List[str] = []

    async def elicit(message: str, response_type: Any, params: Any, ctx: Any) -> Any:
        asked.append(message)
        return {"allow": True}

    m = Model(h.reboot_args(h.unique("reboot")))
    run_agent(m, elicitation_handler=elicit)
    assert len(asked) == 1 and "fleet__reboot_device (write)" in asked[0], asked
    assert h.REBOOTED in m.seen(), m.seen()


def test_without_an_elicitation_handler_the_model_is_told_the_write_was_refused_and_why() -> None:
    m = Model(h.reboot_args(h.unique("no-elicitation")))
    run_agent(m)
    assert h.CANNOT_ASK in m.seen() and "--mode auto" in m.seen(), m.seen()


def test_a_cancelled_run_leaves_its_script_recorded_cancelled() -> None:
    description = h.unique("cancel")
    m = Model({"code": h.SLEEP_CODE, "description": description})

    async def go() -> None:
        agent = Agent(FunctionModel(m), toolsets=[toolset()])
        async with agent:
            run = asyncio.ensure_future(agent.run("wait"))
            await h.wait_record(description, running=True)
            run.cancel()
            try:
                await run
            except asyncio.CancelledError:
                pass
            assert (await h.wait_record(description))["status"] == "cancelled"

    asyncio.run(asyncio.wait_for(go(), 120))
