// The client's own rules, against a scripted fake daemon (no scriptgated needed):
// concurrency of the two request directions, handler answers, the line bound,
// and the token and snapshot helpers.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHmac } from "node:crypto";
import { createServer } from "node:net";
import { once } from "node:events";
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
    assert.deepEqual(got.get(1).error, { code: -32000, message: "fleet API is down" });
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
  f.client.on("protocolError", (e) => seen.push(["protocolError", e.code]));
  try {
    await once(f.client, "finished");
    assert.equal((await f.client.info()).protocol, 1);
    await f.done;
    assert.deepEqual(seen, [["progress", 1], ["protocolError", -32700], ["protocolError", -32700], ["finished", "ok"]]);
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
