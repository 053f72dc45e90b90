"""openai-agents 0.24's MCPServerStdio (the official SDK's Client, mode="auto":
2026-07-28) against `scriptgate mcp`, in an Agent run by the Runner with a model of
ours: a scripted Model that calls run_script once and keeps the tool output the
Runner hands it back (the call's text content, at the default
use_structured_content=False). No provider is reached: the model is ours and tracing
is off. openai-agents declares no elicitation, so a declared write is refused, and
the model is told why."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Dict, List

from agents import Agent, Runner, set_tracing_disabled
from agents.items import ModelResponse
from agents.mcp import MCPServerStdio
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

import hostlib as h

set_tracing_disabled(True)


class Scripted(Model):
    """Calls run_script with `args`, then answers "done"; keeps what it was offered and
    handed back."""

    def __init__(self, args: Dict[str, Any]) -> None:
        self.args = args
        self.offered: List[str] = []
        self.outputs: List[Any] = []

    async def get_response(self, system_instructions: Any, input: Any, model_settings: Any, tools: Any,
                           output_schema: Any, handoffs: Any, tracing: Any, **_kw: Any) -> ModelResponse:
        items = input if isinstance(input, list) else []
        back = [i["output"] for i in items if isinstance(i, dict) and i.get("type") == "function_call_output"]
        if back:
            self.outputs = back
            out: Any = ResponseOutputMessage(id="msg_1", type="message", role="assistant", status="completed",
                                             content=[ResponseOutputText(type="output_text", text="done",
                                                                         annotations=[])])
        else:
            self.offered = [t.name for t in tools]
            out = ResponseFunctionToolCall(type="function_call", id="fc_1", call_id="call_1", name="run_script",
                                           arguments=json.dumps(self.args), status="completed")
        return ModelResponse(output=[out], usage=Usage(), response_id=None)

    def stream_response(self, *a: Any, **kw: Any) -> Any:
        raise NotImplementedError("the Runner is not streamed here")

    def seen(self) -> str:
        assert len(self.outputs) == 1, self.outputs
        o = self.outputs[0]
        if isinstance(o, str):
            return o
        parts = o if isinstance(o, list) else [o]
        return "".join(p.get("text", "") for p in parts)


def server() -> MCPServerStdio:
    return MCPServerStdio({"command": str(h.SCRIPTGATE), "args": h.mcp_args()}, name="scriptgate")


async def run_agent(model: Scripted, description: str = "") -> str:
    async with server() as s:
        agent = Agent(name="fleet", instructions="check the fleet", model=model, mcp_servers=[s])
        return (await Runner.run(agent, "check the fleet")).final_output


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_the_model_is_handed_the_500_call_summary() -> None:
    m = Scripted({"code": h.SUMMARY_CODE, "description": h.unique("summary")})
    assert run(run_agent(m)) == "done"
    assert m.offered == ["run_script"]
    assert m.seen().startswith("run_script ok: 500 calls, 0 failed"), m.seen()
    assert h.expected_summary() in m.seen()


def test_the_model_is_handed_a_failing_scripts_output_and_error_tail() -> None:
    m = Scripted({"code": h.FAIL_CODE, "description": h.unique("fails")})
    run(run_agent(m))
    assert m.seen().startswith("run_script error:"), m.seen()
    assert h.FAIL_OUTPUT in m.seen() and h.FAIL_TAIL in m.seen(), m.seen()


def test_a_declared_write_is_refused_and_the_model_told_why() -> None:
    """openai-agents cannot be asked (no elicitation): the write is refused before the
    script starts, and the text says so and how to allow writes."""
    description = h.unique("no-elicitation")
    m = Scripted(h.reboot_args(description))
    run(run_agent(m))
    assert h.CANNOT_ASK in m.seen() and "--mode auto" in m.seen(), m.seen()
    assert h.REBOOTED not in m.seen()


def test_a_cancelled_run_leaves_its_script_recorded_cancelled() -> None:
    description = h.unique("cancel")
    m = Scripted({"code": h.SLEEP_CODE, "description": description})

    async def go() -> None:
        async with server() as s:
            agent = Agent(name="fleet", model=m, mcp_servers=[s])
            task = asyncio.ensure_future(Runner.run(agent, "wait"))
            await h.wait_record(description, running=True)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert (await h.wait_record(description))["status"] == "cancelled"

    run(go())
