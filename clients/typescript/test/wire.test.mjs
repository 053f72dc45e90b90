// The wire vectors of tests/fixtures/wire/ (scriptgate-protocol(7), exact JSON),
// replayed by this client against a fake daemon that plays them: every request the
// client writes, every answer it makes of its handlers' results, and what it makes
// of every answer, request, notification and error the daemon writes (sent as the
// vector's exact bytes). The daemon's own replay is src/protocol/vectors.rs, the
// Python client's clients/python/tests/test_wire.py.
import { test } from "node:test";
import assert from "node:assert/strict";
import { createServer } from "node:net";
import { once } from "node:events";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { execFile } from "node:child_process";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import * as sg from "../dist/index.js";
import { CallCancelledError, ScriptgateClient, ScriptgateError } from "../dist/index.js";

const WIRE = new URL("../../../tests/fixtures/wire/", import.meta.url);
const T = { timeout: 10_000 };

/** Records of a vector file, each with `raw`: its `wire` member's exact text (the record's last). */
function load(name) {
  const out = [];
  for (const line of readFileSync(new URL(name, WIRE), "utf8").split("\n")) {
    if (!line.trim()) continue;
    const record = JSON.parse(line);
    const at = line.indexOf(',"wire":');
    assert.ok(at > 0, `${name}: no wire member: ${line.slice(0, 80)}`);
    const raw = line.slice(at + ',"wire":'.length, -1);
    assert.deepEqual(JSON.parse(raw), record.wire, `${record.name}: wire is not the last member`);
    out.push({ ...record, raw });
  }
  assert.equal(new Set(out.map((r) => r.name)).size, out.length, `${name}: a name twice`);
  return out;
}

const ENGINE = load("engine-to-daemon.jsonl");
const DAEMON = load("daemon-to-engine.jsonl");
const ERRORS = JSON.parse(readFileSync(new URL("errors.json", WIRE), "utf8"));
const SID = "4f1c9e0a2b3d5e6f";

const of = (records, kind, method) => records.filter((r) => r.kind === kind && (method === undefined || r.method === method));
const named = (records, name) => records.find((r) => r.name === name);
const answerTo = (method) => DAEMON.find((r) => r.kind === "answer" && r.method === method);
/** The exact line with its top-level id set to `id` (the id is the message's first number after `"id":`). */
const withId = (raw, id) => raw.replace(/^\{"jsonrpc":"2\.0","id":(null|-?\d+)/, `{"jsonrpc":"2.0","id":${JSON.stringify(id)}`);

let fakes = 0;
/** Run `body(client)` against a fake daemon driven by `script(peer)`; peer.send takes exact lines. */
async function replay(script, body, options = {}) {
  const path = `\0sg-ts-wire-${process.pid}-${++fakes}`;
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
    sock.on("error", () => {});
    const peer = {
      next: () => (queue.length ? Promise.resolve(queue.shift()) : new Promise((r) => waiters.push(r))),
      send: (line) => sock.write(line + "\n"),
      end: () => sock.end(),
    };
    done = script(peer);
  });
  server.listen(path);
  await once(server, "listening");
  const client = await ScriptgateClient.connect(path, { tracing: false, ...options });
  client.on("protocolError", () => {});
  try {
    const out = await body(client);
    await done;
    return out;
  } finally {
    await client.close();
    server.close();
  }
}

/** Each method the engine calls, through this client's own method for it (the admin extension: `request`). */
function callMethod(c, method, p = {}) {
  switch (method) {
    case "script.start": {
      const params = { token: p.token, code: p.code, tools: p.tools, description: p.description };
      if (p.traceparent !== undefined) params.traceparent = p.traceparent;
      if (p.tracestate !== undefined) params.tracestate = p.tracestate;
      return c.start(params);
    }
    case "script.wait":
      return c.wait(p.script_id, { timeoutS: p.timeout_s, token: p.token });
    case "script.status":
      return c.status(p.script_id, { token: p.token });
    case "script.cancel":
      return c.cancel(p.script_id, { token: p.token });
    case "run.revoke":
      return c.revoke(p.token);
    case "run.describe":
      return c.describe(p.token);
    case "daemon.info":
      return c.info();
    default:
      if (method.startsWith("admin.")) return c.request(method, Object.keys(p).length ? p : undefined);
      throw new Error(`no client method for ${method}: add it here`);
  }
}

// ---- what the engine writes -------------------------------------------------

for (const v of of(ENGINE, "request")) {
  test(`request ${v.name} is written as the vector`, T, async () => {
    let got;
    await replay(
      async (peer) => {
        got = await peer.next();
        peer.send(withId(answerTo(v.method).raw, got.id));
      },
      (c) => callMethod(c, v.method, v.wire.params),
    );
    assert.ok(Number.isSafeInteger(got.id) && got.id > 0, `id ${got.id}`);
    assert.deepEqual(got, { ...v.wire, id: got.id });
  });
}

function handlerResult(h) {
  if ("raises" in h) throw Object.assign(new Error(h.message), { name: h.raises });
  return structuredClone(h.returns);
}

for (const v of [...of(ENGINE, "answer", "tool.call"), ...of(ENGINE, "error", "tool.call")]) {
  test(`tool.call answer ${v.name} is written as the vector`, T, async () => {
    const request = named(DAEMON, "tool.call");
    assert.equal(request.wire.id, v.wire.id);
    let got;
    await replay(
      async (peer) => {
        peer.send(request.raw);
        got = await peer.next();
      },
      async () => {
        while (!got) await new Promise((r) => setTimeout(r, 5));
      },
      { onToolCall: () => handlerResult(v.handler) },
    );
    assert.deepEqual(got, v.wire);
  });
}

for (const v of of(ENGINE, "answer", "approval.request")) {
  test(`approval answer ${v.name} is written as the vector (from the string and the bool)`, T, async () => {
    const request = named(DAEMON, "approval.request");
    for (const returns of [v.handler.returns, v.handler.returns === "allow_once"]) {
      let got;
      await replay(
        async (peer) => {
          peer.send(request.raw);
          got = await peer.next();
        },
        async () => {
          while (!got) await new Promise((r) => setTimeout(r, 5));
        },
        { onApproval: () => returns },
      );
      assert.deepEqual(got, v.wire, String(returns));
    }
  });
}

// ---- what the daemon writes -------------------------------------------------

const ARGS = {
  "script.start": { token: "t", code: "print(1)", tools: [], description: "" },
  "script.wait": { script_id: SID },
  "script.status": { script_id: SID },
  "script.cancel": { script_id: SID },
  "run.revoke": { token: "t" },
  "run.describe": { token: "t" },
  "daemon.info": {},
  "admin.list": {},
  "admin.cancel": { script_id: SID },
  "admin.calls": { script_id: SID },
  "admin.prune": { dry_run: true },
};

for (const v of of(DAEMON, "answer")) {
  test(`answer ${v.name} is read as the daemon wrote it`, T, async () => {
    const got = await replay(
      async (peer) => {
        const req = await peer.next();
        assert.equal(req.method, v.method);
        peer.send(withId(v.raw, req.id));
      },
      (c) => callMethod(c, v.method, ARGS[v.method]),
    );
    assert.deepEqual(got, v.method === "run.describe" ? v.wire.result.text : v.wire.result);
  });
}

test("runScriptTool() is run.describe's tool", T, async () => {
  const v = answerTo("run.describe");
  const got = await replay(
    async (peer) => peer.send(withId(v.raw, (await peer.next()).id)),
    (c) => c.runScriptTool("t"),
  );
  assert.deepEqual(got, v.wire.result.tool);
});

/** The numbers of tool.call:numbers as the script wrote them: beyond 2^53 - 1 a bigint. */
const EXACT = { since: 18446744073709551615n, before: -9223372036854775808n, page: 9007199254740993n, ratio: 1.5, limit: 100000 };

for (const v of of(DAEMON, "request", "tool.call")) {
  test(`tool.call ${v.name} reaches the handler as sent`, T, async () => {
    let seen;
    let answered;
    await replay(
      async (peer) => {
        peer.send(v.raw);
        answered = await peer.next();
      },
      async () => {
        while (!answered) await new Promise((r) => setTimeout(r, 5));
      },
      {
        onToolCall: (call) => {
          seen = call;
          return "ok";
        },
      },
    );
    const params = v.wire.params;
    const { arguments: args, ...rest } = seen;
    const { arguments: expectedArgs, ...expectedRest } = params;
    assert.deepEqual(rest, expectedRest);
    for (const [k, a] of Object.entries(expectedArgs)) {
      if (k in EXACT) assert.equal(args[k], EXACT[k], k);
      else assert.deepEqual(args[k], a, k);
    }
    assert.deepEqual(Object.keys(args).sort(), Object.keys(expectedArgs).sort());
    assert.equal(answered.id, v.wire.id);
  });
}

for (const v of of(DAEMON, "request", "approval.request")) {
  test(`approval.request ${v.name} reaches the handler as sent`, T, async () => {
    let seen;
    let answered;
    await replay(
      async (peer) => {
        peer.send(v.raw);
        answered = await peer.next();
      },
      async () => {
        while (!answered) await new Promise((r) => setTimeout(r, 5));
      },
      {
        onApproval: (req) => {
          seen = req;
          return "deny";
        },
      },
    );
    assert.deepEqual(seen, v.wire.params);
    assert.deepEqual(answered, { jsonrpc: "2.0", id: v.wire.id, result: { decision: "deny" } });
  });
}

for (const v of [...of(DAEMON, "notification", "script.progress"), ...of(DAEMON, "notification", "script.finished")]) {
  test(`notification ${v.name} reaches its event as sent`, T, async () => {
    const event = v.method === "script.progress" ? "progress" : "finished";
    const got = await replay(
      async (peer) => peer.send(v.raw),
      async (c) => (await once(c, event))[0],
    );
    assert.deepEqual(got, v.wire.params);
  });
}

for (const v of of(DAEMON, "notification", "tool.cancelled")) {
  test(`${v.name} aborts its call, and no answer is sent for it`, T, async () => {
    const p = v.wire.params;
    const call = named(DAEMON, "tool.call");
    const line = withId(call.raw, p.id).replace(`"call_id":"${call.wire.params.call_id}"`, `"call_id":"${p.call_id}"`);
    let signal;
    let after;
    await replay(
      async (peer) => {
        peer.send(line);
        while (!signal) await new Promise((r) => setTimeout(r, 5));
        peer.send(v.raw);
        after = await peer.next(); // the body's request: no answer to the cancelled call came first
        peer.send(withId(answerTo("daemon.info").raw, after.id));
      },
      async (c) => {
        while (!signal?.aborted) await new Promise((r) => setTimeout(r, 5));
        return c.info();
      },
      {
        onToolCall: (_call, ctx) => {
          signal = ctx.signal;
          return new Promise(() => {}); // never answers by itself
        },
      },
    );
    assert.ok(signal.reason instanceof CallCancelledError);
    assert.deepEqual([signal.reason.reason, signal.reason.message, signal.reason.callId], [p.reason, p.message, p.call_id]);
    assert.equal(after.method, "daemon.info");
  });
}

function checkError(e, v) {
  const err = v.wire.error;
  assert.ok(e instanceof sg[v.class] && e instanceof ScriptgateError, `${v.name}: ${e?.name}`);
  assert.equal(e.name, v.class);
  assert.deepEqual([e.code, e.message], [err.code, err.message]);
  assert.deepEqual(e.data, err.data);
  const d = err.data ?? {};
  assert.deepEqual([e.reason, e.field, e.tool], [d.reason, d.field, d.tool]);
}

for (const v of of(DAEMON, "error").filter((v) => v.method !== null)) {
  test(`error ${v.name} rejects with ${v.class}`, T, async () => {
    const e = await replay(
      async (peer) => peer.send(withId(v.raw, (await peer.next()).id)),
      (c) => c.request(v.method, {}).then(() => assert.fail("resolved"), (e) => e),
    );
    checkError(e, v);
  });
}

for (const v of of(DAEMON, "error").filter((v) => v.method === null)) {
  test(`unasked error ${v.name} is reported, and what a pending request fails with when the daemon closes`, T, async () => {
    const reported = [];
    const e = await replay(
      async (peer) => {
        peer.send(v.raw);
        await peer.next();
        peer.end();
      },
      (c) => {
        c.on("protocolError", (e) => reported.push(e));
        return c.info().then(() => assert.fail("resolved"), (e) => e);
      },
    );
    checkError(e, v);
    assert.equal(reported[0], e);
  });
}

// ---- the declared types --------------------------------------------------------

/** The client's declared type of each message (its wire types, protocol.ts); the admin extension has none. */
function declaredType(v, direction) {
  if (v.kind === "error") return ["RpcErrorObject", v.wire.error];
  if (direction === "engine") {
    if (v.kind === "request" && v.method === "script.start") return ["StartParams", v.wire.params];
    if (v.kind === "answer" && v.method === "tool.call") return ["ToolAnswer", v.wire.result];
    return undefined;
  }
  const answers = {
    "script.start": "StartResult", "script.wait": "ScriptResult", "script.status": "ScriptState",
    "script.cancel": "CancelResult", "admin.cancel": "CancelResult", "run.revoke": "RevokeResult",
    "run.describe": "DescribeResult", "daemon.info": "DaemonInfo",
  };
  const others = {
    "tool.call": "ToolCall", "approval.request": "ApprovalRequest",
    "script.progress": "ScriptState", "script.finished": "ScriptResult", "tool.cancelled": "ToolCancelled",
  };
  if (v.kind === "answer") return answers[v.method] && [answers[v.method], v.wire.result];
  return [others[v.method], v.wire.params];
}

// Each message as an object literal that `satisfies` the client's declared type: a field
// the type lacks, a required field the message lacks, or a value of another type fails
// to compile. (At run time the client hands answers on as they came; its types are its
// reading of the wire.)
test("every message fits the client's declared type, exactly", { timeout: 120_000 }, async () => {
  const dir = mkdtempSync(join(tmpdir(), "sg-wire-types-"));
  try {
    const lines = [];
    const used = new Set();
    let n = 0;
    for (const [direction, records] of [["engine", ENGINE], ["daemon", DAEMON]]) {
      for (const v of records) {
        const t = declaredType(v, direction);
        if (!t || !t[0]) continue;
        used.add(t[0]);
        lines.push(`// ${direction}: ${v.name}\nexport const v${n++} = (${JSON.stringify(t[1])}) satisfies ${t[0]};`);
      }
    }
    const dist = fileURLToPath(new URL("../dist/index.js", import.meta.url));
    writeFileSync(join(dir, "vectors.ts"), `import type { ${[...used].join(", ")} } from ${JSON.stringify(dist)};\n${lines.join("\n")}\n`);
    const tsc = fileURLToPath(new URL("../node_modules/typescript/bin/tsc", import.meta.url));
    const args = [tsc, "--noEmit", "--strict", "--target", "ES2022", "--module", "NodeNext", "--moduleResolution", "NodeNext", "--types", "node", "--typeRoots", fileURLToPath(new URL("../node_modules/@types", import.meta.url)), join(dir, "vectors.ts")];
    const out = await new Promise((res) => execFile(process.execPath, args, (e, stdout, stderr) => res(e ? `${stdout}${stderr}` : "")));
    assert.equal(out, "", out);
    assert.ok(n >= 40, `${n} messages typed`);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

// ---- the error classes --------------------------------------------------------

/** The nearest named ancestor (the classes of the codes come from one anonymous maker). */
function parentName(cls) {
  let p = Object.getPrototypeOf(cls);
  while (p && p.name === "") p = Object.getPrototypeOf(p);
  return p.name;
}

test("the error classes are the shared ones: names, parents, one per code", () => {
  for (const [name, parent] of Object.entries(ERRORS.parents)) {
    const cls = sg[name];
    assert.equal(typeof cls, "function", `${name} is exported`);
    assert.equal(cls.name, name);
    assert.equal(parentName(cls), parent ?? "Error", name);
  }
  for (const [code, name] of Object.entries(ERRORS.by_code)) {
    const e = ScriptgateError.fromRpc({ code: Number(code), message: "m" });
    assert.ok(e instanceof sg[name] && e instanceof sg.DaemonError, code);
    assert.equal(e.name, name);
    assert.equal(sg[name].code, Number(code));
  }
  const other = ScriptgateError.fromRpc({ code: -32099, message: "m" });
  assert.equal(other.name, ERRORS.other_code);
  assert.equal(other.constructor, sg[ERRORS.other_code]);
});

test("every vector kind is replayed here", () => {
  const known = new Set([
    ...Object.keys(ARGS).flatMap((m) => [`request ${m}`, `answer ${m}`]),
    "answer tool.call", "error tool.call", "answer approval.request", "request tool.call", "request approval.request",
    "notification script.progress", "notification script.finished", "notification tool.cancelled",
  ]);
  for (const r of [...ENGINE, ...DAEMON]) {
    if (r.kind === "error" && "class" in r) assert.ok(r.class in ERRORS.parents, r.name);
    else assert.ok(known.has(`${r.kind} ${r.method}`), r.name);
  }
});
