// The MCP TypeScript SDK v2 (@modelcontextprotocol/client 2.4.0) Client against
// `scriptgate mcp` over stdio: at its default (versionNegotiation 'legacy': initialize,
// 2025-11-25) and opted into { mode: 'auto' } (server/discover: 2026-07-28, where the
// approval is an input_required result that the client fulfils through the same
// elicitation handler). In each: the 500-call summary, a failing script's error tail,
// a declared write approved and refused where the client declares no elicitation, and
// an aborted call whose script is recorded cancelled.
import { describe, test } from "node:test";
import assert from "node:assert/strict";
import { Client } from "@modelcontextprotocol/client";
import { StdioClientTransport } from "@modelcontextprotocol/client/stdio";
import { SCRIPTGATE, h, mcpArgs, rebootArgs, textOf, unique, waitRecord } from "./lib.mjs";

const T = { timeout: 120_000 };
const MODES = { default: { options: {}, era: "2025-11-25" }, auto: { options: { versionNegotiation: { mode: "auto" } }, era: "2026-07-28" } };

for (const [name, { options, era }] of Object.entries(MODES)) {
  describe(`v2 client, ${name} (${era})`, () => {
    async function connect({ elicit } = {}) {
      const client = new Client(
        { name: "client-v2-host", version: "1.0.0" },
        { ...options, capabilities: elicit ? { elicitation: { form: {} } } : {} },
      );
      if (elicit) client.setRequestHandler("elicitation/create", (req) => elicit(req.params));
      await client.connect(new StdioClientTransport({ command: SCRIPTGATE, args: mcpArgs(), stderr: "ignore" }));
      assert.equal(client.protocolVersion ?? client.getNegotiatedProtocolVersion?.(), era);
      return client;
    }

    test("the 500-call summary reaches the client", T, async () => {
      const c = await connect();
      try {
        const r = await c.callTool({ name: "run_script", arguments: { code: h.SUMMARY_CODE, description: unique("summary") } });
        assert.equal(r.isError, false, textOf(r));
        assert.ok(textOf(r).includes(h.summary), textOf(r));
        assert.equal(r.structuredContent.output, h.summary + "\n");
        assert.equal(r.structuredContent.calls, 500);
      } finally {
        await c.close();
      }
    });

    test("a failing script is an error result with its tail", T, async () => {
      const c = await connect();
      try {
        const r = await c.callTool({ name: "run_script", arguments: { code: h.FAIL_CODE, description: unique("fails") } });
        assert.equal(r.isError, true);
        assert.ok(textOf(r).includes(h.FAIL_OUTPUT) && textOf(r).includes(h.FAIL_TAIL), textOf(r));
        assert.ok(r.structuredContent.error.endsWith(h.FAIL_TAIL));
      } finally {
        await c.close();
      }
    });

    test("a declared write is approved through the elicitation handler", T, async () => {
      const asked = [];
      const c = await connect({
        elicit: (p) => {
          asked.push(p.message);
          return { action: "accept", content: { allow: true } };
        },
      });
      try {
        const r = await c.callTool({ name: "run_script", arguments: rebootArgs(unique("reboot")) });
        assert.equal(r.isError, false, textOf(r));
        assert.ok(textOf(r).includes(h.REBOOTED), textOf(r));
        assert.equal(asked.length, 1);
        assert.ok(asked[0].includes("fleet__reboot_device (write)"), asked[0]);
      } finally {
        await c.close();
      }
    });

    test("a client without elicitation is refused the write and told why", T, async () => {
      const c = await connect();
      try {
        const r = await c.callTool({ name: "run_script", arguments: rebootArgs(unique("no-elicitation")) });
        assert.equal(r.isError, true);
        assert.ok(textOf(r).includes(h.CANNOT_ASK), textOf(r));
      } finally {
        await c.close();
      }
    });

    test("an aborted call leaves its script recorded cancelled", T, async () => {
      const c = await connect();
      try {
        const description = unique("cancel");
        const abort = new AbortController();
        let up;
        const running = new Promise((ok) => (up = ok));
        const call = c.callTool({ name: "run_script", arguments: { code: h.SLEEP_CODE, description } }, {
          signal: abort.signal,
          onprogress: () => up(),
        });
        await running;
        abort.abort();
        await assert.rejects(call);
        assert.equal((await waitRecord(description)).status, "cancelled");
      } finally {
        await c.close();
      }
    });
  });
}
