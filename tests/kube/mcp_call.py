#!/usr/bin/env python3
"""mcp_call.py PORT TOKEN_FILE DESCRIPTION < CODE: one run_script call to a
`scriptgate mcp --http` at 127.0.0.1:PORT, as an MCP client of 2026-07-28 would
make it (one request, no session), with the standard library only (it runs in
the image, which has python3 and nothing else of MCP). Prints the call's result
as JSON; exit 1 when there is none."""
import http.client
import json
import sys

VERSION = "2026-07-28"


def main() -> int:
    port, token_file, description = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    token = open(token_file).read().strip()
    params = {"name": "run_script", "arguments": {"code": sys.stdin.read(), "description": description},
              "_meta": {"io.modelcontextprotocol/protocolVersion": VERSION,
                        "io.modelcontextprotocol/clientCapabilities": {},
                        "io.modelcontextprotocol/clientInfo": {"name": "kube-check", "version": "1"}}}
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}).encode()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request("POST", "/mcp", body, {
        "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {token}", "MCP-Protocol-Version": VERSION,
        "Mcp-Method": "tools/call", "Mcp-Name": "run_script"})
    r = c.getresponse()
    if r.status != 200:
        print(f"HTTP {r.status}: {r.read()[:2000]!r}", file=sys.stderr)
        return 1
    if r.getheader("content-type", "").startswith("application/json"):
        messages = [json.loads(r.read())]
    else:
        messages = [json.loads(line[5:]) for line in r.read().splitlines()
                    if line.startswith(b"data:") and line[5:].strip()]
    for m in messages:
        if m.get("id") == 1:
            print(json.dumps(m.get("result", m)))
            return 0 if "result" in m else 1
    print(f"no answer among {messages!r}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
