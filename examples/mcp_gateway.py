#!/usr/bin/env python3
"""A scriptgate gateway over a real MCP server (pip install ./clients/python mcp): its snapshot from tools/list, SDK results
passed back unchanged, a declared write approved, a script run, a long call cancelled. usage: mcp_gateway.py [SOCKET [KEY_FILE
[WORKSPACE_ROOT [SERVER_COMMAND...]]]], else SCRIPTGATE_SOCKET, ... as in engine.py; the server: mcp-server-everything."""
import asyncio, os, sys, time, uuid
from mcp import ClientSession, StdioServerParameters, stdio_client
from scriptgate_client import Client, Snapshot, Tool, load_key, mint_token, prepare_workspace
arg = lambda i, env, default: sys.argv[i] if len(sys.argv) > i else os.environ.get(env, default)
SOCK, KEY, ROOT = arg(1, "SCRIPTGATE_SOCKET", "/run/scriptgate/scriptgate.sock"), arg(2, "SCRIPTGATE_KEY_FILE", "/etc/scriptgate/token.key"), arg(3, "SCRIPTGATE_WORKSPACE_ROOT", "/var/lib/scriptgate/workspaces")
CODE = """import agent_tools
print(agent_tools.call("everything__echo", {"message": "hello"}))
print(agent_tools.call("everything__get-sum", {"a": 2, "b": 3}))
print(agent_tools.call("everything__toggle-simulated-logging", {}))
"""
LONG = 'import agent_tools\nagent_tools.call("everything__trigger-long-running-operation", {"duration": 60, "steps": 60})\n'
async def main():
    async with stdio_client(StdioServerParameters(command=(sys.argv[4:] or ["mcp-server-everything"])[0], args=sys.argv[5:])) as (r, w), ClientSession(r, w) as mcp:
        tools, busy, run_id = [Tool.from_mcp(t, "everything") for t in (await mcp.list_tools()).tools], asyncio.Event(), f"gw-{uuid.uuid4().hex[:8]}"
        token = mint_token(load_key(KEY), run_id, Snapshot(str(prepare_workspace(os.path.join(ROOT, run_id))), "approval", tools), 600)
        async def call(c, ctx):  # the SDK's CallToolResult goes back as it is; its progress reaches sg.progress()
            try:
                return await mcp.call_tool(c.tool.split("__", 1)[1], c.arguments, progress_callback=busy.set() or ctx.progress)
            except asyncio.CancelledError:
                print(f"MCP call {c.tool} aborted ({ctx.cancel_reason}: {ctx.cancel_message})", flush=True); raise
        async with Client(SOCK, tool_handler=call, approval_handler=lambda req: print("approving", [t["name"] for t in req.tools]) or True) as sg:
            print((await sg.run(token, CODE, ["everything__toggle-simulated-logging"], "echo, add, toggle logging")).text, flush=True)
            busy.clear(); long = await sg.start(token, LONG, description="a long operation")
            await busy.wait(); t0 = time.monotonic(); await sg.cancel(long)
            print(f"script.cancel answered in {(time.monotonic() - t0) * 1000:.0f} ms;", (await sg.wait(long)).text.splitlines()[0])
asyncio.run(main())
