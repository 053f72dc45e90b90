// SPEC-20 §4 through a real daemon: with OpenTelemetry installed and a tracer provider
// registered (sdk-trace-base's InMemorySpanExporter, AsyncLocalStorageContextManager),
// an outer "agent" span, the client's scriptgate.run_script and scriptgate.tool_call
// spans and the handlers' own spans form one tree of one trace. Its own process
// (node --test runs each file apart): the global provider is registered here only.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { ScriptgateClient, mintToken } from "../dist/index.js";
import { KEY, startDaemon } from "./rig.mjs";
import { importTestModule } from "./mcp-rig.mjs";

const T = { timeout: 60_000 };
const otel = await importTestModule("@opentelemetry/api");
const base = await importTestModule("@opentelemetry/sdk-trace-base");
const hooks = await importTestModule("@opentelemetry/context-async-hooks");
const missing = !otel || !base || !hooks ? "OpenTelemetry (api, sdk-trace-base, context-async-hooks) is not installed in tests/mcp (tools/install-deps)" : undefined;

let rig;
before(async () => {
  rig = await startDaemon();
});
after(async () => {
  await rig?.stop();
});

const SN = { type: "object", properties: { sn: { type: "string" } }, required: ["sn"] };

test("one trace, one tree: agent > scriptgate.run_script > scriptgate.tool_call (x3) > the handler's span", T, async (t) => {
  if (missing) {
    t.skip(missing);
    return;
  }
  const api = otel.default?.trace ? otel.default : otel;
  const exporter = new base.InMemorySpanExporter();
  const provider = new base.BasicTracerProvider({ spanProcessors: [new base.SimpleSpanProcessor(exporter)] });
  api.context.setGlobalContextManager(new hooks.AsyncLocalStorageContextManager().enable());
  api.trace.setGlobalTracerProvider(provider);
  const tracer = api.trace.getTracer("agent");

  const snap = { workspace: rig.workspace, permission_mode: "auto", tools: [{ name: "fleet__status", class: "read", input_schema: SN }] };
  const token = mintToken(KEY, "ts-trace-1", snap, 600, "ts-trace");
  const client = await ScriptgateClient.connect(rig.socket, {
    onToolCall: async (call) => {
      // The handler's own span (an MCP client's, say): current context is the tool span.
      await new Promise((r) => setImmediate(r)); // across an await: AsyncLocalStorage keeps it
      return tracer.startActiveSpan("handler.fetch", (s) => {
        s.setAttribute("sn", String(call.arguments.sn));
        s.end();
        return { text: `${call.arguments.sn} ok`, is_error: false };
      });
    },
  });
  let r;
  try {
    const code = `
import agent_tools
for sn in ["SN1", "SN2", "SN3"]:
    print(agent_tools.call("fleet__status", {"sn": sn}))
`;
    r = await tracer.startActiveSpan("agent", async (span) => {
      try {
        return await client.run({ token, code });
      } finally {
        span.end();
      }
    });
  } finally {
    await client.close();
  }
  assert.equal(r.status, "ok", r.text);
  // script.finished comes before the script.wait answer: the run span has ended.
  const spans = exporter.getFinishedSpans();
  const byName = (n) => spans.filter((s) => s.name === n);
  assert.deepEqual(spans.map((s) => s.name).sort(), ["agent", "handler.fetch", "handler.fetch", "handler.fetch", "scriptgate.run_script", "scriptgate.tool_call", "scriptgate.tool_call", "scriptgate.tool_call"]);
  const traceIds = new Set(spans.map((s) => s.spanContext().traceId));
  assert.equal(traceIds.size, 1, "one trace id");
  const ids = new Map(spans.map((s) => [s.spanContext().spanId, s]));
  const parentOf = (s) => s.parentSpanContext?.spanId ?? s.parentSpanId;
  const [agent] = byName("agent");
  const [run] = byName("scriptgate.run_script");
  assert.equal(parentOf(agent), undefined);
  for (const s of spans) if (s !== agent) assert.ok(ids.has(parentOf(s)), `${s.name}'s parent ${parentOf(s)} is a recorded span`);
  assert.equal(parentOf(run), agent.spanContext().spanId);
  assert.equal(run.attributes["scriptgate.script_id"], r.script_id);
  assert.equal(run.status.code, 1, "run span status OK");
  const calls = byName("scriptgate.tool_call");
  for (const c of calls) {
    assert.equal(parentOf(c), run.spanContext().spanId, "a tool span's parent is the run span (the call's traceparent)");
    assert.equal(c.attributes["scriptgate.tool"], "fleet__status");
    assert.equal(c.attributes["scriptgate.script_id"], r.script_id);
    assert.match(c.attributes["scriptgate.call.span_id"], /^[0-9a-f]{16}$/);
  }
  const callSpanIds = new Set(calls.map((c) => c.spanContext().spanId));
  for (const h of byName("handler.fetch")) assert.ok(callSpanIds.has(parentOf(h)), "a handler's span nests under its tool span");
  // The daemon's span_id per call is the one calls.jsonl records.
  const record = readFileSync(join(rig.workspace, r.details_dir, "calls.jsonl"), "utf8").trim().split("\n").map((l) => JSON.parse(l));
  assert.deepEqual(record.map((l) => l.span_id).sort(), calls.map((c) => c.attributes["scriptgate.call.span_id"]).sort());
  await provider.shutdown();
});
