// The client's own rules, against a scripted fake daemon (no scriptgated needed):
// concurrency of the two request directions, handler answers, the line bound,
// and the token and snapshot helpers.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { createServer } from "node:net";
import { once } from "node:events";
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync, symlinkSync, mkdirSync, lstatSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { spawn, execFileSync } from "node:child_process";
import * as sg from "../dist/index.js";
import { startDaemon } from "./rig.mjs";
import {
  ConnectionClosedError,
  ScriptgateClient,
  ScriptgateError,
  decodeToken,
  defaultRunAs,
  lookupUser,
  mintToken,
  validateSnapshot,
} from "../dist/index.js";

const T = { timeout: 10_000 };
let fakes = 0;
/** A fake daemon: `script(peer)` drives one connection; peer.next() reads a message. */
async function fake(script, clientOptions = {}) {
  const path = `\0sg-ts-fake-${process.pid}-${++fakes}`; // abstract socket: nothing to clean up
  let done;
  const server = createServer((sock) => {
    let buf = "";
    const queue = [];
    const waiters = [];
    sock.on("data", (d) => {
      buf += d;
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const msg = JSON.parse(buf.slice(0, i));
        buf = buf.slice(i + 1);
        const w = waiters.shift();
        if (w) w(msg);
        else queue.push(msg);
      }
    });
    const peer = {
      next: () => (queue.length ? Promise.resolve(queue.shift()) : new Promise((r) => waiters.push(r))),
      send: (msg) => sock.write((typeof msg === "string" ? msg : JSON.stringify(msg)) + "\n"),
      raw: (s) => sock.write(s),
      end: () => sock.end(),
    };
    done = script(peer);
  });
  server.listen(path);
  await once(server, "listening");
  const client = await ScriptgateClient.connect(path, clientOptions);
  return {
    client,
    get done() {
      return done;
    },
    async close() {
      await client.close();
      server.close();
    },
  };
}

test("an approval.request (same id as ours) is served before the script.start answer", T, async () => {
  const f = await fake(
    async (peer) => {
      const start = await peer.next();
      assert.equal(start.method, "script.start");
      assert.deepEqual(start.params, { token: "t", code: "print(1)", tools: ["w"], description: "d" });
      // The daemon's ids are its own: reuse the id of the pending request.
      peer.send({ jsonrpc: "2.0", id: start.id, method: "approval.request", params: { script_id: "s1", run_id: "r", description: "d", code: "print(1)", tools: [{ name: "w", class: "write" }] } });
      peer.send({ jsonrpc: "2.0", id: "call-7", method: "tool.call", params: { script_id: "s1", run_id: "r", call_id: "1", tool: "t", arguments: { a: 1 } } });
      const answers = [await peer.next(), await peer.next()].sort((a, b) => String(a.id).localeCompare(String(b.id)));
      assert.deepEqual(answers[0], { jsonrpc: "2.0", id: start.id, result: { decision: "allow_once" } });
      assert.deepEqual(answers[1], { jsonrpc: "2.0", id: "call-7", result: { text: "t ok", structured: { a: 1 }, is_error: false } });
      peer.send({ jsonrpc: "2.0", id: start.id, result: { script_id: "s1", state: "running" } });
    },
    {
      onApproval: async (req) => req.tools[0].name === "w",
      onToolCall: (call) => ({ text: `${call.tool} ok`, structured: call.arguments, is_error: false }),
    },
  );
  try {
    assert.deepEqual(await f.client.start({ token: "t", code: "print(1)", tools: ["w"], description: "d" }), { script_id: "s1", state: "running" });
    await f.done;
  } finally {
    await f.close();
  }
});

test("handler failures and odd answers become JSON-RPC errors; no handler: tool error, approval denied", T, async () => {
  const f = await fake(async (peer) => {
    const ask = (id, method, params) => peer.send({ jsonrpc: "2.0", id, method, params });
    const call = (tool) => ({ script_id: "s", run_id: "r", call_id: "1", tool, arguments: {} });
    ask(1, "tool.call", call("throws"));
    ask(2, "tool.call", call("undefined"));
    ask(3, "tool.call", call("mcp"));
    ask(4, "approval.request", { tools: [] });
    ask(5, "nope.method", {});
    const got = new Map();
    for (let i = 0; i < 5; i++) {
      const m = await peer.next();
      got.set(m.id, m);
    }
    assert.deepEqual(got.get(1).error, { code: -32000, message: "Error: fleet API is down" });
    assert.equal(got.get(2).error.code, -32603);
    assert.deepEqual(got.get(3).result, { content: [{ type: "text", text: "hi" }], isError: true });
    assert.equal(got.get(4).error.code, -32603); // "yes" is no decision
    assert.equal(got.get(5).error.code, -32601);
  });
  f.client.onToolCall(async (c) => {
    if (c.tool === "throws") throw new Error("fleet API is down");
    if (c.tool === "undefined") return undefined;
    return { content: [{ type: "text", text: "hi" }], isError: true };
  });
  f.client.onApproval(() => "yes");
  try {
    await f.done;
  } finally {
    await f.close();
  }

  const g = await fake(async (peer) => {
    peer.send({ jsonrpc: "2.0", id: 1, method: "approval.request", params: { tools: [] } });
    peer.send({ jsonrpc: "2.0", id: 2, method: "tool.call", params: { tool: "t", arguments: {} } });
    const got = [await peer.next(), await peer.next()].sort((a, b) => a.id - b.id);
    assert.deepEqual(got[0].result, { decision: "deny" });
    assert.equal(got[1].error.code, -32601);
  });
  try {
    await g.done;
  } finally {
    await g.close();
  }
});

test("notifications reach the events; a parse error is reported and the connection stays usable", T, async () => {
  const f = await fake(async (peer) => {
    peer.send({ jsonrpc: "2.0", method: "script.progress", params: { script_id: "s", state: "running", calls: 1, failures: 0, elapsed_ms: 5, progress: { done: 1, total: 2, message: "" } } });
    peer.send("{not json");
    peer.send({ jsonrpc: "2.0", id: null, error: { code: -32700, message: "parse error" } });
    peer.send({ jsonrpc: "2.0", method: "script.finished", params: { script_id: "s", status: "ok" } });
    const req = await peer.next();
    peer.send({ jsonrpc: "2.0", id: req.id, result: { version: "x", protocol: 1, backend: "b", limits: {} } });
  });
  const seen = [];
  f.client.on("progress", (p) => seen.push(["progress", p.progress.done]));
  f.client.on("finished", (r) => seen.push(["finished", r.status]));
  f.client.on("protocolError", (e) => seen.push(["protocolError", e.name, e.code]));
  try {
    await once(f.client, "finished");
    assert.equal((await f.client.info()).protocol, 1);
    await f.done;
    // The unreadable line is the client's finding (ProtocolError); the -32700 the daemon's (ParseError).
    assert.deepEqual(seen, [["progress", 1], ["protocolError", "ProtocolError", undefined], ["protocolError", "ParseError", -32700], ["finished", "ok"]]);
  } finally {
    await f.close();
  }
});

test("a line longer than maxLineBytes closes the connection; pending requests reject", T, async () => {
  const f = await fake(
    async (peer) => {
      await peer.next();
      peer.raw("x".repeat(3000)); // no newline: must not be buffered without bound
    },
    { maxLineBytes: 1024 },
  );
  try {
    const closed = once(f.client, "close");
    await assert.rejects(f.client.info(), (e) => e instanceof ConnectionClosedError && /maxLineBytes/.test(e.cause?.message ?? ""));
    const [why] = await closed;
    assert.match(why.message, /longer than maxLineBytes/);
    assert.equal(f.client.isClosed, true);
    await assert.rejects(f.client.info(), ConnectionClosedError);
  } finally {
    await f.close();
  }
});

test("a peer refusal (-32001, id null) rejects the pending requests with it", T, async () => {
  const f = await fake(async (peer) => {
    await peer.next();
    peer.send({ jsonrpc: "2.0", id: null, error: { code: -32001, message: "peer not allowed", data: { reason: "peer_not_allowed" } } });
    peer.end();
  });
  f.client.on("protocolError", () => {});
  try {
    await assert.rejects(f.client.info(), (e) => e instanceof ScriptgateError && e.code === -32001 && e.reason === "peer_not_allowed");
  } finally {
    await f.close();
  }
});

const KEY = Buffer.from("0123456789abcdef0123456789abcdef");
const snap = () => ({
  workspace: "/srv/ws/run-1",
  permission_mode: "approval",
  tools: [
    { name: "a__read", class: "read", input_schema: { type: "object" } },
    { name: "a__wipe", class: "destructive" },
    { name: "a__off", class: "write", enabled: false },
  ],
  limits: { max_calls: 10 },
});

test("mintToken: an HS256 JWT with run_id, iat, exp, snapshot and runner", T, () => {
  const t = mintToken(KEY, "run-1", snap(), 60, "runner-a");
  const [h, p, s] = t.split(".");
  assert.deepEqual(JSON.parse(Buffer.from(h, "base64url")), { alg: "HS256", typ: "JWT" });
  assert.equal(s, createHmac("sha256", KEY).update(`${h}.${p}`).digest("base64url"));
  const c = decodeToken(t);
  assert.equal(c.run_id, "run-1");
  assert.equal(c.runner, "runner-a");
  assert.equal(c.exp - c.iat, 60);
  assert.ok(Math.abs(c.iat - Date.now() / 1000) < 5);
  assert.deepEqual(c.snapshot, snap());
  assert.equal("runner" in decodeToken(mintToken(KEY, "run-1", snap(), 60)), false);
  assert.throws(() => mintToken(Buffer.alloc(31), "run-1", snap(), 60), RangeError);
});

test("validateSnapshot refuses what the daemon refuses, with its reason and field", T, () => {
  const refused = (mutate, reason, field) => {
    const s = snap();
    mutate(s);
    assert.throws(
      () => validateSnapshot(s),
      (e) => e instanceof ScriptgateError && e.code === -32011 && e.reason === reason && e.field === field,
      `${reason} ${field}`,
    );
    assert.throws(() => mintToken(KEY, "run-1", s, 60), ScriptgateError);
  };
  validateSnapshot(snap());
  refused((s) => (s.extra = 1), "unknown_field", "extra");
  refused((s) => (s.tools[0].inputSchema = {}), "unknown_field", "tools[0].inputSchema");
  refused((s) => (s.limits.max_runtime = 1), "unknown_field", "limits.max_runtime");
  refused((s) => delete s.tools[0].input_schema, "missing_field", "tools[0].input_schema");
  refused((s) => (s.tools[0].input_schema = null), "missing_field", "tools[0].input_schema");
  refused((s) => delete s.permission_mode, "missing_field", "permission_mode");
  refused((s) => (s.permission_mode = "yolo"), "invalid_value", "permission_mode");
  refused((s) => (s.tools[1].class = "admin"), "invalid_value", "tools[1].class");
  refused((s) => (s.tools[1].name = "a b"), "invalid_value", "tools[1].name");
  refused((s) => (s.tools[1].name = "a__read"), "duplicate_tool", "tools[1].name");
  refused((s) => (s.limits.timeout_s = -1), "invalid_value", "limits.timeout_s");
  refused((s) => (s.workspace = "ws/run-1"), "not_absolute", "workspace");
});

test("the default run_as is the packaged user where it exists, else nobody", () => {
  let packaged = true;
  try {
    lookupUser("scriptgate-script");
  } catch {
    packaged = false;
  }
  assert.equal(defaultRunAs(), packaged ? "scriptgate-script" : "nobody");
});

// ---- issue 20 -----------------------------------------------------------------

const call = (tool, extra = {}) => ({ script_id: "s1", run_id: "r", call_id: String(extra.call_id ?? 1), tool, arguments: {}, ...extra });

/** Collect `n` answers from the peer, by id. */
async function answers(peer, n) {
  const got = new Map();
  for (let i = 0; i < n; i++) {
    const m = await peer.next();
    got.set(m.id, m);
  }
  return got;
}

test("answers are checked before they are sent: bad ones are a JSON-RPC error naming the tool and the problem, and a handlerError", T, async () => {
  const bad = {
    "t.undefined": undefined,
    "t.null": null,
    "t.array": [1],
    "t.unknown_key": { text: "x", is_error: false, foo: 1 },
    "t.no_is_error": { text: "x" },
    "t.text_number": { text: 5, is_error: false },
    "t.content_object": { content: { type: "text", text: "x" } },
    "t.block_no_type": { content: [{ text: "x" }] },
    "t.iserror_string": { content: [], isError: "yes" },
    "t.structured_array": { content: [], structuredContent: [1] },
    "t.meta_string": { content: [], _meta: "m" },
    "t.mixed": { content: [{ type: "text", text: "x" }], is_error: false },
  };
  const good = {
    "g.string": ["just text", { text: "just text", structured: null, is_error: false }],
    "g.plain": [{ text: "t", is_error: true }, { text: "t", is_error: true }],
    "g.mcp_extra": [
      { content: [{ type: "text", text: "hi", annotations: { priority: 1 } }], isError: false, structuredContent: null, _meta: { a: 1 }, resultType: "complete" },
      { content: [{ type: "text", text: "hi", annotations: { priority: 1 } }], isError: false, structuredContent: null, _meta: { a: 1 }, resultType: "complete" },
    ],
    "g.legacy": [{ toolResult: { sn: "SN1" } }, { text: '{"sn":"SN1"}', structured: { sn: "SN1" }, is_error: false }],
    "g.legacy_text": [{ toolResult: "plain" }, { text: "plain", structured: null, is_error: false }],
  };
  const thrown = {
    "x.type_error": [new TypeError("boom"), "TypeError: boom"],
    "x.object": [{ code: 7, why: "nope" }, '{"code":7,"why":"nope"}'],
    "x.string": ["bare", "bare"],
  };
  const tools = [...Object.keys(bad), ...Object.keys(good), ...Object.keys(thrown)];
  const reported = [];
  const f = await fake(async (peer) => {
    tools.forEach((t, i) => peer.send({ jsonrpc: "2.0", id: i + 1, method: "tool.call", params: call(t, { call_id: i + 1 }) }));
    const got = await answers(peer, tools.length);
    tools.forEach((t, i) => {
      const m = got.get(i + 1);
      if (t in bad) {
        assert.equal(m.error?.code, -32603, t);
        assert.match(m.error.message, new RegExp(`^the tool handler for ${t.replace(".", "\\.")} \\(call ${i + 1} of script s1\\) `), t);
      } else if (t in good) assert.deepEqual(m.result, good[t][1], t);
      else assert.deepEqual(m.error, { code: -32000, message: thrown[t][1] }, t);
    });
    const msg = (t) => got.get(tools.indexOf(t) + 1).error.message;
    assert.match(msg("t.unknown_key"), /unknown key `foo`/);
    assert.match(msg("t.no_is_error"), /is_error must be a boolean/);
    assert.match(msg("t.block_no_type"), /content\[0\] must be an object with a string `type`/);
    assert.match(msg("t.undefined"), /answered undefined; expected/);
    assert.match(msg("t.structured_array"), /structuredContent must be an object/);
    assert.match(msg("t.mixed"), /`is_error` beside `content` mixes the two answer shapes/);
  }, {
    onToolCall: (c) => {
      if (c.tool in bad) return bad[c.tool];
      if (c.tool in good) return good[c.tool][0];
      throw thrown[c.tool][0];
    },
  });
  f.client.on("handlerError", (e) => reported.push(e));
  try {
    await f.done;
    const malformed = reported.filter((e) => e.reason === "malformed_answer");
    assert.deepEqual(malformed.map((e) => e.tool).sort(), Object.keys(bad).sort());
    assert.ok(malformed.every((e) => e instanceof sg.HandlerError && e.handler === "tool" && e.message.includes(e.tool)));
    assert.deepEqual(reported.filter((e) => e.reason === "threw").map((e) => e.tool).sort(), Object.keys(thrown).sort());
  } finally {
    await f.close();
  }
});

test("a malformed answer without a handlerError listener is printed with console.error, naming the handler", T, async () => {
  const printed = [];
  const orig = console.error;
  console.error = (...a) => printed.push(a.join(" "));
  const f = await fake(async (peer) => {
    peer.send({ jsonrpc: "2.0", id: 1, method: "tool.call", params: call("a__b") });
    assert.equal((await peer.next()).error.code, -32603);
  }, { onToolCall: () => ({ foo: 1 }) });
  try {
    await f.done;
  } finally {
    console.error = orig;
    await f.close();
  }
  assert.equal(printed.length, 1);
  assert.match(printed[0], /^scriptgate: the tool handler for a__b \(call 1 of script s1\) answered a malformed result: unknown key `foo`/);
});

test("tool.cancelled aborts that call's own signal (reason in signal.reason); script.finished aborts the rest; no answer is sent for them", T, async () => {
  const started = new Map();
  const reasons = new Map();
  let release;
  const released = new Promise((r) => (release = r));
  const f = await fake(async (peer) => {
    for (const [id, cid] of [[1, "1"], [2, "2"], [3, "3"]]) peer.send({ jsonrpc: "2.0", id, method: "tool.call", params: call("slow", { call_id: cid }) });
    await until(() => started.size === 3, "3 started");
    peer.send({ jsonrpc: "2.0", method: "tool.cancelled", params: { id: 2, script_id: "s1", call_id: "2", reason: "timeout", message: "the script timed out" } });
    await until(() => reasons.has("2"), "2 aborted");
    assert.equal(started.get("1").aborted, false, "call 1's signal is its own");
    assert.equal(started.get("3").aborted, false);
    release();
    // Call 1 and 3 answer; call 2 (cancelled) does not: its answer is not sent.
    const a = await answers(peer, 2);
    assert.deepEqual([...a.keys()].sort(), [1, 3]);
    peer.send({ jsonrpc: "2.0", id: 4, method: "tool.call", params: call("slow", { call_id: "4" }) });
    await until(() => started.has("4"), "4 started");
    peer.send({ jsonrpc: "2.0", method: "script.finished", params: { script_id: "s1", status: "cancelled" } });
    await until(() => reasons.has("4"), "4 aborted");
    peer.send({ jsonrpc: "2.0", id: 5, method: "tool.call", params: call("echo", { call_id: "5" }) });
    const last = await peer.next();
    assert.equal(last.id, 5, "nothing was sent for the abandoned call 4");
  }, { onToolCall: async (c, { signal }) => {
    if (c.tool === "echo") return "echo";
    started.set(c.call_id, signal);
    signal.addEventListener("abort", () => reasons.set(c.call_id, signal.reason));
    const aborted = new Promise((r) => signal.addEventListener("abort", r));
    await (c.call_id === "4" ? aborted : Promise.race([released, aborted]));
    if (c.call_id === "4") await new Promise((r) => setImmediate(r)); // answers after the abort, to be dropped
    return "done";
  } });
  const cancelled = [];
  f.client.on("cancelled", (p) => cancelled.push(p));
  try {
    await f.done;
    const r2 = reasons.get("2");
    assert.ok(r2 instanceof sg.CallCancelledError);
    assert.equal(r2.reason, "timeout");
    assert.equal(r2.message, "the script timed out");
    assert.equal(r2.callId, "2");
    assert.equal(reasons.get("4").reason, "finished");
    assert.equal(reasons.has("1") || reasons.has("3"), false);
    assert.deepEqual(cancelled.map((p) => p.id), [2]);
  } finally {
    await f.close();
  }
});

/** Resolves once `pred()` holds, checking after each turn of the event loop. */
async function until(pred, what = "a condition") {
  for (let i = 0; !pred(); i++) {
    if (i > 100000) throw new Error(`never: ${what}`);
    await new Promise((r) => setImmediate(r));
  }
}

test("toolTimeoutMs: the call's signal aborts (handler_timeout) and the call is answered with an error naming the timeout", T, async () => {
  let reason;
  const f = await fake(
    async (peer) => {
      peer.send({ jsonrpc: "2.0", id: 1, method: "tool.call", params: call("hang") });
      const m = await peer.next();
      assert.equal(m.error.code, -32000);
      assert.match(m.error.message, /the tool handler for hang \(call 1 of script s1\) did not answer within toolTimeoutMs = 50 ms/);
    },
    {
      toolTimeoutMs: 50,
      onToolCall: (c, { signal }) => new Promise((_, rej) => signal.addEventListener("abort", () => ((reason = signal.reason), rej(signal.reason)))),
    },
  );
  const errs = [];
  f.client.on("handlerError", (e) => errs.push(e));
  try {
    await f.done;
    assert.equal(reason.reason, "handler_timeout");
    assert.deepEqual(errs.map((e) => e.reason), ["timeout"]);
  } finally {
    await f.close();
  }
});

test("no approval handler: denied with a warning, and start's ApprovalError says no handler is registered; approvalTimeoutMs denies with a warning", T, async () => {
  const f = await fake(async (peer) => {
    const start = await peer.next();
    peer.send({ jsonrpc: "2.0", id: 1, method: "approval.request", params: { script_id: "s", run_id: "r", description: "d", code: "", tools: [{ name: "w", class: "write" }] } });
    assert.deepEqual((await peer.next()).result, { decision: "deny" });
    peer.send({ jsonrpc: "2.0", id: start.id, error: { code: -32013, message: "approval denied", data: { reason: "denied" } } });
  });
  const warnings = [];
  f.client.on("warning", (w) => warnings.push(w));
  try {
    const e = await f.client.start({ token: "t", code: "", tools: ["w"] }).catch((e) => e);
    assert.ok(e instanceof sg.ApprovalError, String(e));
    assert.equal(e.code, -32013);
    assert.equal(e.reason, "denied");
    assert.match(e.message, /^approval denied: no approval handler is registered/);
    assert.equal(warnings.length, 1);
    assert.match(warnings[0], /denied the approval of script s of run r \(w\): no approval handler is registered/);
    await f.done;
  } finally {
    await f.close();
  }

  const g = await fake(
    async (peer) => {
      peer.send({ jsonrpc: "2.0", id: 1, method: "approval.request", params: { script_id: "s", run_id: "r", description: "d", code: "", tools: [] } });
      assert.deepEqual((await peer.next()).result, { decision: "deny" });
    },
    { approvalTimeoutMs: 30, onApproval: () => new Promise(() => {}) },
  );
  const w2 = [];
  g.client.on("warning", (w) => w2.push(w));
  try {
    await g.done;
    assert.match(w2[0], /approval handler did not answer within approvalTimeoutMs = 30 ms/);
  } finally {
    await g.close();
  }
});

test("progress(): script.progress and handler progress, from the start (same chunk as the start answer), ending at script.finished", T, async () => {
  const f = await fake(async (peer) => {
    const start = await peer.next();
    const st = (n) => ({ script_id: "s9", state: "running", calls: n, failures: 0, elapsed_ms: n, progress: { done: n, total: 2, message: "" } });
    // One write: the start answer and the first progress arrive in the same chunk.
    peer.raw(JSON.stringify({ jsonrpc: "2.0", id: start.id, result: { script_id: "s9", state: "running" } }) + "\n" + JSON.stringify({ jsonrpc: "2.0", method: "script.progress", params: st(0) }) + "\n");
    peer.send({ jsonrpc: "2.0", id: 1, method: "tool.call", params: { ...call("mcp__op"), script_id: "s9", call_id: "c1" } });
    assert.equal((await peer.next()).result.text, "ok");
    peer.raw(JSON.stringify({ jsonrpc: "2.0", method: "script.progress", params: st(1) }) + "\n" + JSON.stringify({ jsonrpc: "2.0", method: "script.finished", params: { script_id: "s9", status: "ok" } }) + "\n");
  });
  f.client.onToolCall((c, ctx) => {
    ctx.progress(1, 3, "one");
    ctx.requestOptions.onprogress({ progress: 2 }); // as the MCP SDK calls it
    return "ok";
  });
  try {
    const { script_id } = await f.client.start({ token: "t", code: "" });
    const seen = [];
    for await (const ev of f.client.progress(script_id)) seen.push(ev);
    assert.deepEqual(seen.map((e) => (e.type === "script" ? ["script", e.calls] : ["call", e.call_id, e.tool, e.progress, e.total, e.message])), [
      ["script", 0],
      ["call", "c1", "mcp__op", 1, 3, "one"],
      ["call", "c1", "mcp__op", 2, null, null],
      ["script", 1],
    ]);
    // A finished script's history stays for a late iterator; an unknown id throws.
    const again = [];
    for await (const ev of f.client.progress(script_id)) again.push(ev.type);
    assert.equal(again.length, 4);
    assert.throws(() => f.client.progress("nope"), sg.NotFoundError);
    await f.done;
  } finally {
    await f.close();
  }
});

test("one error class per daemon code (protocol(7): no -32014), with code, reason, field, tool", T, async () => {
  const table = [
    [-32700, sg.ParseError], [-32600, sg.InvalidRequestError], [-32601, sg.MethodNotFoundError], [-32602, sg.InvalidParamsError],
    [-32603, sg.InternalError], [-32001, sg.PeerNotAllowedError], [-32010, sg.TokenError], [-32011, sg.SnapshotError],
    [-32012, sg.ToolsError], [-32013, sg.ApprovalError], [-32015, sg.BusyError], [-32016, sg.NotFoundError],
    [-32017, sg.StillRunningError], [-32018, sg.NotAdminError],
  ];
  const f = await fake(async (peer) => {
    for (const [code] of table) {
      const m = await peer.next();
      peer.send({ jsonrpc: "2.0", id: m.id, error: { code, message: `m${code}`, data: { reason: "r", field: "f", tool: "t" } } });
    }
    const m = await peer.next();
    peer.send({ jsonrpc: "2.0", id: m.id, error: { code: -32099, message: "other" } });
  });
  try {
    for (const [code, cls] of table) {
      const e = await f.client.request("x.y").catch((e) => e);
      assert.ok(e instanceof cls && e instanceof sg.ScriptgateError, `${code}: ${e?.constructor?.name}`);
      assert.equal(e.name, cls.name);
      assert.deepEqual([e.code, e.message, e.reason, e.field, e.tool, e.method], [code, `m${code}`, "r", "f", "t", "x.y"]);
      assert.equal(sg.errorClassOf(code), cls);
    }
    const other = await f.client.request("x.y").catch((e) => e);
    assert.equal(other.constructor, sg.DaemonError); // a code without a class of its own
    assert.ok(other instanceof sg.ScriptgateError && other.code === -32099);
    assert.equal(sg.errorClassOf(-32014), undefined);
    await f.done;
  } finally {
    await f.close();
  }
});

test("connection errors are typed and name the path: missing socket, refused, permission denied; SCRIPTGATE_SOCKET is the default", T, async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "sg-ts-conn-"));
  try {
    const missing = join(dir, "missing.sock");
    const e1 = await ScriptgateClient.connect(missing).catch((e) => e);
    assert.ok(e1 instanceof sg.SocketNotFoundError && e1 instanceof sg.ConnectionError && e1 instanceof sg.ScriptgateError, String(e1));
    assert.equal(e1.path, missing);
    assert.equal(e1.code, undefined);
    assert.ok(e1.message.includes(missing));

    // A socket file nobody listens on (bound, never listening).
    const stale = join(dir, "stale.sock");
    execFileSync("python3", ["-c", "import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])", stale]);
    const e2 = await ScriptgateClient.connect(stale).catch((e) => e);
    assert.ok(e2 instanceof sg.ConnectionRefusedError, String(e2));
    assert.ok(e2.message.includes(stale));

    const prev = process.env.SCRIPTGATE_SOCKET;
    process.env.SCRIPTGATE_SOCKET = missing;
    try {
      const e3 = await ScriptgateClient.connect().catch((e) => e);
      assert.ok(e3 instanceof sg.SocketNotFoundError);
      assert.equal(e3.path, missing);
    } finally {
      if (prev === undefined) delete process.env.SCRIPTGATE_SOCKET;
      else process.env.SCRIPTGATE_SOCKET = prev;
    }

    // Permission denied: a socket in a 0700 directory, connected to by another uid
    // (as root: nobody, in a child process; otherwise: a directory we may not search).
    const locked = join(dir, "locked");
    mkdirSync(locked, { mode: 0o700 });
    const sockPath = join(locked, "sock");
    const server = (await import("node:net")).createServer(() => {});
    server.listen(sockPath);
    await once(server, "listening");
    try {
      const dist = new URL("../dist/index.js", import.meta.url).href;
      const code = `import(${JSON.stringify(dist)}).then((m) => m.ScriptgateClient.connect(${JSON.stringify(sockPath)})).then(() => console.log("connected"), (e) => console.log(e.constructor.name, e.path, e instanceof Error))`;
      let out;
      if (process.getuid() === 0) {
        const nobody = lookupUser("nobody");
        try {
          out = await new Promise((res, rej) => {
            const c = spawn(process.execPath, ["--input-type=module", "-e", code], { uid: nobody.uid, gid: nobody.gid, cwd: "/" });
            let o = "";
            c.stdout.on("data", (d) => (o += d));
            c.stderr.on("data", (d) => (o += d));
            c.on("exit", () => res(o.trim()));
            c.on("error", rej);
          });
        } catch (e) {
          t.skip(`cannot run a child as nobody: ${e.message}`);
          return;
        }
        if (/Cannot find module|ERR_MODULE_NOT_FOUND|EACCES.*dist/.test(out)) {
          t.skip(`nobody cannot read the built client: ${out}`);
          return;
        }
      } else {
        const { chmodSync } = await import("node:fs");
        chmodSync(locked, 0o000);
        out = execFileSync(process.execPath, ["--input-type=module", "-e", code], { encoding: "utf8" }).trim();
        chmodSync(locked, 0o700);
      }
      assert.equal(out, `PermissionDeniedError ${sockPath} true`);
    } finally {
      server.close();
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("a dropped connection rejects pending requests with ConnectionClosedError naming the socket", T, async () => {
  const f = await fake(async (peer) => {
    await peer.next();
    peer.end();
  });
  try {
    const e = await f.client.info().catch((e) => e);
    assert.ok(e instanceof ConnectionClosedError && e instanceof sg.ConnectionError && e instanceof sg.ScriptgateError, String(e));
    assert.match(e.path, /sg-ts-fake-/);
    assert.ok(e.message.includes(e.path), e.message);
  } finally {
    await f.close();
  }
});

const FIXTURE = JSON.parse(readFileSync(new URL("../../../tests/fixtures/mcp-tools.json", import.meta.url), "utf8"));

test("toolFromMcp: every case of tests/fixtures/mcp-tools.json", T, async (t) => {
  assert.ok(FIXTURE.cases.length >= 12);
  for (const c of FIXTURE.cases) {
    await t.test(c.what, () => {
      if (c.error) {
        assert.throws(() => sg.toolFromMcp(c.tool, { server: c.server }), TypeError);
        return;
      }
      const got = sg.toolFromMcp(c.tool, { server: c.server });
      const want = { name: c.expect.name, class: c.expect.class, enabled: c.expect.enabled };
      if (c.expect.input_schema !== null) want.input_schema = c.expect.input_schema;
      if (c.expect.description !== null) want.description = c.expect.description;
      assert.deepEqual(got, want);
      // Every entry is a valid snapshot tool.
      validateSnapshot({ workspace: "/w/x", permission_mode: "auto", tools: [got] });
    });
  }
});

test("validateSnapshot: a tool description is accepted; a non-string one and other unknown fields are refused", T, () => {
  const s = snap();
  s.tools[0].description = "Status of one device.";
  validateSnapshot(s);
  s.tools[0].description = 5;
  assert.throws(() => validateSnapshot(s), (e) => e instanceof sg.SnapshotError && e.reason === "invalid_value" && e.field === "tools[0].description");
  const u = snap();
  u.tools[0].annotations = {};
  assert.throws(() => validateSnapshot(u), (e) => e instanceof sg.SnapshotError && e.reason === "unknown_field" && e.field === "tools[0].annotations");
});

test("prepareWorkspace: mode 0700 (parents 0755), owned by the script's uid, a symlink refused", T, async () => {
  const dir = mkdtempSync(join(tmpdir(), "sg-ts-ws-"));
  try {
    const pending = sg.prepareWorkspace(join(dir, "a", "b", "ws"));
    assert.ok(pending instanceof Promise, "asynchronous");
    const ws = await pending;
    assert.equal(ws, join(dir, "a", "b", "ws"));
    assert.equal(statSync(ws).mode & 0o777, 0o700);
    assert.equal(statSync(join(dir, "a", "b")).mode & 0o777, 0o755);
    assert.equal(statSync(ws).uid, sg.scriptOwner().uid);
    assert.equal(statSync(ws).gid, sg.scriptOwner().gid);
    assert.equal(await sg.prepareWorkspace(ws, { mode: 0o750 }), ws, "an existing directory is re-moded");
    assert.equal(statSync(ws).mode & 0o777, 0o750);
    symlinkSync(ws, join(dir, "link"));
    await assert.rejects(sg.prepareWorkspace(join(dir, "link")), (e) => e.code === "ELOOP" || e.code === "ENOTDIR");
    assert.equal(lstatSync(join(dir, "link")).isSymbolicLink(), true);
    writeFileSync(join(dir, "file"), "");
    await assert.rejects(sg.prepareWorkspace(join(dir, "file")), (e) => e.code === "ENOTDIR");
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

// A non-root engine before it ever connected: the daemon makes <root>/<uid> on
// connect, and prepareWorkspace asks it to (in a node run as nobody).
test("prepareWorkspace as a non-root engine before connecting: the daemon makes <root>/<uid>", { timeout: 60_000, skip: process.getuid() !== 0 && "needs root: runs the engine as nobody" }, async () => {
  const nobody = sg.lookupUser("nobody");
  const group = execFileSync("id", ["-gn", "nobody"], { encoding: "utf8" }).trim();
  // The child counts the processes it starts (the async and the sync spawns both):
  // prepareWorkspace starts none (it once ran a second node for its daemon.info).
  const prepare = (path, socket, as = nobody, runAs = "") => {
    const out = execFileSync(process.execPath, ["--no-deprecation", "--input-type=module", "-e", `
      import { ChildProcess } from "node:child_process";
      let spawned = 0;
      const sync = process.binding("spawn_sync");
      const s0 = sync.spawn;
      sync.spawn = function (...a) { spawned++; return s0.apply(this, a); };
      const a0 = ChildProcess.prototype.spawn;
      ChildProcess.prototype.spawn = function (...a) { spawned++; return a0.apply(this, a); };
      const { prepareWorkspace } = await import(${JSON.stringify(new URL("../dist/index.js", import.meta.url).href)});
      try { const p = await prepareWorkspace(process.argv[1], { socket: process.argv[2], runAs: process.argv[3] || undefined }); process.stdout.write(spawned + " " + p); }
      catch (e) { process.stdout.write(spawned + " " + e.code + ": " + e.message); process.exitCode = 3; }`, path, socket, runAs],
      { uid: as.uid, gid: as.gid, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
    const [n, ...rest] = out.split(" ");
    assert.equal(n, "0", `prepareWorkspace started ${n} processes`);
    return rest.join(" ");
  };
  const d = await startDaemon("", { allowedGroups: [group] });
  try {
    const mine = join(d.root, String(nobody.uid));
    assert.equal(existsSync(mine), false, "the daemon has not seen this uid yet");
    const ws = join(mine, "run-1", "ws");
    assert.equal(prepare(ws, d.socket), ws);
    assert.deepEqual([statSync(mine).mode & 0o777, statSync(mine).uid], [0o700, nobody.uid], "made by the daemon");
    assert.deepEqual([statSync(ws).mode & 0o777, statSync(ws).uid, statSync(ws).gid], [0o700, nobody.uid, nobody.gid]);
  } finally {
    await d.stop();
  }
  // A daemon that serves root alone: the error names its refusal.
  const only = await startDaemon();
  try {
    let out = "";
    try {
      prepare(join(only.root, String(nobody.uid), "ws"), only.socket);
    } catch (e) {
      const [n, ...rest] = e.stdout.split(" ");
      assert.equal(n, "0", `prepareWorkspace started ${n} processes`);
      out = rest.join(" ");
    }
    assert.match(out, /^EACCES: cannot create .* it said: uid \d+ may not use scriptgated/, out);
  } finally {
    await only.stop();
  }
  // As root: the script's uid is sandbox.run_as's, found without a process either.
  const dir = mkdtempSync(join(tmpdir(), "sg-ts-ws-root-"));
  try {
    const ws = join(dir, "ws");
    assert.equal(prepare(ws, "/nonexistent.sock", { uid: 0, gid: 0 }, "nobody"), ws);
    assert.deepEqual([statSync(ws).uid, statSync(ws).gid], [nobody.uid, nobody.gid]);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test("a lost connection aborts the calls being served (reason connection_closed)", T, async () => {
  let signal;
  const f = await fake(
    async (peer) => {
      peer.send({ jsonrpc: "2.0", id: 1, method: "tool.call", params: call("slow") });
      await until(() => signal !== undefined, "the call started");
      peer.end();
    },
    { onToolCall: (c, ctx) => ((signal = ctx.signal), new Promise(() => {})) },
  );
  try {
    await once(f.client, "close");
    assert.equal(signal.aborted, true);
    assert.ok(signal.reason instanceof sg.CallCancelledError);
    assert.equal(signal.reason.reason, "connection_closed");
    assert.ok(signal.reason.message.includes(f.client.path));
  } finally {
    await f.close();
  }
});
