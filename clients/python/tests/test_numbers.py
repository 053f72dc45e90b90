"""Numbers (scriptgate-protocol(7), NUMBERS; issue 32 section 6), through the real daemon:
a script's integers reach an engine on scriptgate_client exactly (Python's int), those
the daemon cannot pass exactly are refused by it and never reach the handler, and
calls.jsonl holds what the handler got."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Dict

from scriptgate_client import Client, Snapshot, Tool, ToolCall, mint_token

from conftest import KEY, Daemon

VALUES = [
    ("2^53", 2**53, True),
    ("2^53+1", 2**53 + 1, True),
    ("2^64-1", 2**64 - 1, True),
    ("2^64", 2**64, False),
    ("2^64+1", 2**64 + 1, False),
    ("2^70", 2**70, False),
    ("-2^63", -(2**63), True),
    ("-2^64-5", -(2**64) - 5, False),
]

SCRIPT = """
import agent_tools, json
V = [("2^53", 2**53), ("2^53+1", 2**53 + 1), ("2^64-1", 2**64 - 1), ("2^64", 2**64),
     ("2^64+1", 2**64 + 1), ("2^70", 2**70), ("-2^63", -2**63), ("-2^64-5", -2**64 - 5)]
out = {}
for name, v in V:
    for where, args in (("top", {"n": v}), ("nested", {"deep": {"list": [0, {"n": v}]}})):
        try:
            r = agent_tools.call("num__echo", {"case": f"{name} {where}", **args})
            got = r["n"] if where == "top" else r["deep"]["list"][1]["n"]
            out[f"{name} {where}"] = ["ok", got == v and type(got) is int]
        except agent_tools.ToolError as e:
            out[f"{name} {where}"] = [e.code, e.message]
many = agent_tools.call_many("num__echo", [{"case": f"{name} many", "n": v} for name, v in V], return_errors=True)
for (name, v), r in zip(V, many):
    out[f"{name} many"] = [r.code, r.message] if isinstance(r, agent_tools.ToolError) else ["ok", r["n"] == v and type(r["n"]) is int]
print(json.dumps(out))
"""


def _got(args: Dict[str, Any], place: str) -> Any:
    return args["deep"]["list"][1]["n"] if place == "nested" else args["n"]


def test_integers_reach_the_handler_exactly_or_never(daemon: Daemon) -> None:
    seen: Dict[str, Dict[str, Any]] = {}

    async def echo(call: ToolCall) -> Any:
        seen[call.arguments["case"]] = call.arguments
        return {"text": "echo", "structured": call.arguments, "is_error": False}

    workspace = daemon.workspace()
    snapshot = Snapshot(
        workspace=str(workspace),
        permission_mode="auto",
        tools=[Tool.read("num__echo", {"type": "object", "additionalProperties": True})],
    )

    async def main() -> Any:
        async with Client(daemon.socket, tool_handler=echo) as sg:
            return await sg.run(mint_token(KEY, "py-numbers", snapshot, 600), SCRIPT, description="numbers")

    r = asyncio.run(asyncio.wait_for(main(), 120))
    assert r.status == "ok", r.text
    out = json.loads(r.output)
    report = "\n".join(f"{k}: {_got(a, k.split(' ')[1])!r}" for k, a in seen.items())
    for name, value, passes in VALUES:
        for place in ("top", "nested", "many"):
            case = f"{name} {place}"
            if passes:
                assert case in seen, f"{case} never reached the handler\n{report}"
                got = _got(seen[case], place)
                assert type(got) is int and got == value, f"{case}: {got!r}\n{report}"
                assert out[case] == ["ok", True], case
            else:
                assert case not in seen, f"{case} reached the handler as {_got(seen[case], place)!r}"
                code, message = out[case]
                assert code == "invalid_arguments", case
                at = "/deep/list/1/n" if place == "nested" else "/n"
                assert f"the integer {value} at {at} " in message, message
    assert len(seen) == 12
    assert (r.calls, r.failures) == (24, 12)

    # calls.jsonl: what the handler got, digit for digit; the refused calls'
    # arguments as the script sent them (text).
    log = [json.loads(line) for line in (Path(workspace) / r.details_dir / "calls.jsonl").read_text().splitlines()]
    assert len(log) == 24
    for line in log:
        args = line["arguments"]
        if isinstance(args, str):
            sent = json.loads(args)
            assert sent["case"] not in seen
            assert line["arguments_bytes"] == len(args.encode())
            assert line["summary"].startswith("refused (invalid_arguments): ")
        else:
            assert args == seen[args["case"]]
