"""strands-agents 1.62's MCPClient (the official SDK 2.1.1 underneath, which probes
server/discover: 2026-07-28) against `scriptgate mcp` over stdio, in an Agent whose
model is ours: a scripted Model that streams one run_script tool use, then keeps
the tool result the Agent hands it back. No provider is reached. Also: a declared
write approved through the elicitation callback, a task round trip with
tasks_config, and Agent.cancel() while the script runs (recorded cancelled)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, AsyncIterator, Dict, List

from mcp import StdioServerParameters, stdio_client
import mcp_types as types
from strands import Agent
from strands.models.model import Model
from strands.tools.mcp import MCPClient
from strands.tools.mcp.mcp_tasks import TasksConfig

import hostlib as h


class Scripted(Model):
    """Streams one run_script tool use with `args`, then "done"; keeps what came back."""

    def __init__(self, args: Dict[str, Any]) -> None:
        self.args = args
        self.offered: List[str] = []
        self.results: List[dict] = []

    def update_config(self, **_kw: Any) -> None:
        pass

    def get_config(self) -> Any:
        return {}

    def structured_output(self, *a: Any, **kw: Any) -> Any:
        raise NotImplementedError

    async def stream(self, messages: Any, tool_specs: Any = None, system_prompt: Any = None,
                     **_kw: Any) -> AsyncIterator[Dict[str, Any]]:
        back = [c["toolResult"] for c in messages[-1]["content"] if "toolResult" in c]
        yield {"messageStart": {"role": "assistant"}}
        if back:
            self.results = back
            yield {"contentBlockStart": {"start": {}}}
            yield {"contentBlockDelta": {"delta": {"text": "done"}}}
            yield {"contentBlockStop": {}}
            yield {"messageStop": {"stopReason": "end_turn"}}
            return
        self.offered = [t["name"] for t in tool_specs or []]
        yield {"contentBlockStart": {"start": {"toolUse": {"toolUseId": "tool-1", "name": "run_script"}}}}
        yield {"contentBlockDelta": {"delta": {"toolUse": {"input": json.dumps(self.args)}}}}
        yield {"contentBlockStop": {}}
        yield {"messageStop": {"stopReason": "tool_use"}}

    def seen(self) -> str:
        """The tool result's text, as the model gets it."""
        assert len(self.results) == 1, self.results
        return "".join(c.get("text", "") for c in self.results[0]["content"])


def mcp_client(*extra: str, **kw: Any) -> MCPClient:
    params = StdioServerParameters(command=str(h.SCRIPTGATE), args=h.mcp_args(*extra))
    return MCPClient(lambda: stdio_client(params), **kw)


def run_agent(model: Scripted, client: MCPClient) -> Any:
    with client:
        agent = Agent(model=model, tools=client.list_tools_sync(), callback_handler=None)
        return agent("check the fleet")


def test_the_model_is_handed_the_500_call_summary() -> None:
    m = Scripted({"code": h.SUMMARY_CODE, "description": h.unique("summary")})
    c = mcp_client()
    run_agent(m, c)
    assert m.offered == ["run_script"]
    assert m.results[0]["status"] == "success"
    assert m.seen().startswith("run_script ok: 500 calls, 0 failed"), m.seen()
    assert h.expected_summary() in m.seen()


def test_the_model_is_handed_a_failing_scripts_output_and_error_tail() -> None:
    m = Scripted({"code": h.FAIL_CODE, "description": h.unique("fails")})
    run_agent(m, mcp_client())
    assert m.results[0]["status"] == "error"
    assert h.FAIL_OUTPUT in m.seen() and h.FAIL_TAIL in m.seen(), m.seen()


def test_a_declared_write_is_approved_through_the_elicitation_callback() -> None:
    asked: List[str] = []

    async def elicit(_ctx: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"allow": True})

    m = Scripted(h.reboot_args(h.unique("reboot")))
    run_agent(m, mcp_client(elicitation_callback=elicit))
    assert len(asked) == 1 and "fleet__reboot_device (write)" in asked[0], asked
    assert h.REBOOTED in m.seen(), m.seen()


def test_without_an_elicitation_callback_the_write_is_refused_and_the_model_told_why() -> None:
    m = Scripted(h.reboot_args(h.unique("no-elicitation")))
    run_agent(m, mcp_client())
    assert h.CANNOT_ASK in m.seen() and "--mode auto" in m.seen(), m.seen()


def test_with_tasks_config_the_summary_comes_through_a_task() -> None:
    m = Scripted({"code": h.SUMMARY_CODE, "description": h.unique("task-summary")})
    c = mcp_client("--task-after", "0", tasks_config=TasksConfig())
    sent: List[str] = []
    with c:
        session = c._background_thread_session
        send = session.send_request

        async def spy(request: Any, *a: Any, **kw: Any) -> Any:
            sent.append(getattr(request, "method", type(request).__name__))
            return await send(request, *a, **kw)

        session.send_request = spy
        agent = Agent(model=m, tools=c.list_tools_sync(), callback_handler=None)
        agent("check the fleet")
    assert h.expected_summary() in m.seen(), m.seen()
    assert "tasks/get" in sent, f"no task was polled: {sent}"


def test_agent_cancel_while_the_script_runs_leaves_it_recorded_cancelled() -> None:
    description = h.unique("cancel")
    m = Scripted({"code": h.SLEEP_CODE, "description": description})
    c = mcp_client()
    with c:
        agent = Agent(model=m, tools=c.list_tools_sync(), callback_handler=None)
        done: List[Any] = []
        t = threading.Thread(target=lambda: done.append(agent("wait")))
        t.start()
        h.wait_record_sync(description, running=True)
        agent.cancel()
        t.join(60)
        assert not t.is_alive()
        assert done and done[0].stop_reason == "cancelled", done
        assert h.wait_record_sync(description)["status"] == "cancelled"
