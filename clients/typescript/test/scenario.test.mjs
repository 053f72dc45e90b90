// The engine scenario of issue 9 §5, through @scriptgate/client (the built dist)
// against a real scriptgated (see rig.mjs).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { createHmac } from "node:crypto";
import { ApprovalError, ScriptgateClient, ScriptgateError, mintToken, prepareWorkspace, validateSnapshot } from "../dist/index.js";
import { KEY, startDaemon } from "./rig.mjs";

// A test that fails only for want of a daemon change in flight (issue 9) is marked
// todo here; drop the mark once the change is merged.
const T = { timeout: 60_000 };

let rig;
before(async () => {
  rig = await startDaemon();
});
after(async () => {
  if (process.env.SG_KEEP) console.log(`# kept ${rig?.dir} (daemon.log, state, workspace)`);
  else await rig?.stop();
});

const SN = { type: "object", properties: { sn: { type: "string" } }, required: ["sn"] };

function fleetSnapshot(workspace, mode = "approval", limits) {
  const snap = {
    workspace,
    read_only: false,
    permission_mode: mode,
    tools: [
      { name: "fleet__get_device_status", class: "read", input_schema: SN },
      { name: "fleet__mcp_status", class: "read", input_schema: SN },
      { name: "fleet__mcp_fail", class: "read", input_schema: SN },
      { name: "fleet__bad_answer", class: "read", input_schema: SN },
      { name: "fleet__broken", class: "read", input_schema: SN },
      {
        name: "fleet__reboot_device",
        class: "write",
        input_schema: { type: "object", properties: { sn: { type: "string" }, tenant: { type: "string" } }, required: ["sn"] },
        frozen: { tenant: "acme" },
      },
      { name: "fleet__wipe_device", class: "destructive" },
    ],
  };
  if (limits) snap.limits = limits;
  return snap;
}

let runs = 0;
/** A token of a fresh run (revocations are per run and persist). */
function token(opts = {}) {
  const runId = `ts-run-${++runs}`;
  const snap = fleetSnapshot(opts.workspace ?? rig.workspace, opts.mode, opts.limits);
  return { runId, token: mintToken(opts.key ?? KEY, runId, snap, 600, "ts-test") };
}

/** The in-memory fleet, answering in every shape the protocol allows. */
function fleet(seen = []) {
  return async (call, { signal }) => {
    seen.push(call);
    await sleep(1, undefined, { signal }).catch(() => {}); // answer asynchronously
    const sn = String(call.arguments.sn);
    switch (call.tool) {
      case "fleet__get_device_status": {
        const online = Number(sn.slice(2)) % 10 !== 0;
        return { text: `${sn} ${online ? "online" : "offline"}`, structured: { sn, online }, is_error: false };
      }
      case "fleet__reboot_device":
        return { text: `rebooted ${sn} for ${call.arguments.tenant}`, structured: null, is_error: false };
      case "fleet__mcp_status":
        return { content: [{ type: "text", text: `${sn} online` }], structuredContent: { sn, online: true }, resultType: "complete" }; // an extra key (mcp 2.3.0): ignored
      case "fleet__mcp_fail":
        return { content: [{ type: "text", text: `${sn} unreachable` }], isError: true };
      case "fleet__bad_answer":
        return { foo: 1 };
      case "fleet__broken":
        throw new Error("fleet API is down");
    }
    throw new Error(`no tool ${call.tool}`);
  };
}

async function engine(options = {}) {
  const seen = [];
  const client = await ScriptgateClient.connect(rig.socket, { onToolCall: fleet(seen), ...options });
  return { client, seen };
}

const lines = (r) => r.output.trim().split("\n");

test("daemon.info over the client", T, async () => {
  const { client } = await engine();
  try {
    const info = await client.info();
    assert.equal(info.protocol, 1);
    assert.equal(typeof info.version, "string");
  } finally {
    await client.close();
  }
});

const MANY = `
import agent_tools
sns = [f"SN{i}" for i in range(1, 201)]
res = agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in sns])
off = [r["sn"] for r in res if not r["online"]]
print(f"{len(res)} devices, {len(off)} offline: {' '.join(off)}")
`;

test("a 200-device call_many", T, async () => {
  const { client, seen } = await engine();
  try {
    const { token: t } = token();
    const r = await client.run({ token: t, code: MANY, description: "fleet status" });
    assert.equal(r.status, "ok", r.text);
    assert.equal(r.calls, 200);
    assert.equal(r.failures, 0);
    const off = Array.from({ length: 20 }, (_, i) => `SN${(i + 1) * 10}`).join(" ");
    assert.deepEqual(lines(r), [`200 devices, 20 offline: ${off}`]);
    assert.equal(seen.length, 200);
    assert.deepEqual(new Set(seen.map((c) => c.arguments.sn)).size, 200);
    assert.ok(seen.every((c) => c.tool === "fleet__get_device_status" && c.run_id === r.run_id));
    const record = readFileSync(join(rig.workspace, r.details_dir, "calls.jsonl"), "utf8").trim().split("\n");
    assert.equal(record.length, 200);
  } finally {
    await client.close();
  }
});

const PROGRESS = `
import agent_tools
sns = [f"SN{i}" for i in range(1, 201)]
agent_tools.progress(0, len(sns), "starting")
done = 0
for i in range(0, len(sns), 50):
    agent_tools.call_many("fleet__get_device_status", [{"sn": s} for s in sns[i:i + 50]])
    done += 50
    agent_tools.progress(done, len(sns), f"{done} checked")
print("checked", done)
`;

/** Resolves when `pred()` holds (polled), or rejects after `ms`. */
async function until(what, pred, ms = 10000) {
  const t0 = Date.now();
  while (!pred()) {
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await sleep(10);
  }
}

test("progress: the first at once, the last (200/200) before script.finished", T, async () => {
  const { client } = await engine();
  const events = [];
  client.on("progress", (p) => events.push({ kind: "progress", p, at: Date.now() }));
  client.on("finished", (p) => events.push({ kind: "finished", p, at: Date.now() }));
  try {
    const { token: t } = token();
    const t0 = Date.now();
    const { script_id } = await client.start({ token: t, code: PROGRESS, description: "progress" });
    const r = await client.wait(script_id);
    assert.equal(r.status, "ok", r.text);
    // script.finished and the script.wait answer are not ordered with each other.
    await until("script.finished", () => events.some((e) => e.kind === "finished" && e.p.script_id === script_id));
    const mine = events.filter((e) => e.p.script_id === script_id);
    const fin = mine.findIndex((e) => e.kind === "finished");
    assert.ok(fin >= 0, "script.finished received");
    const progress = mine.slice(0, fin).filter((e) => e.kind === "progress");
    assert.equal(mine.slice(fin + 1).filter((e) => e.kind === "progress").length, 0, "no progress after script.finished");
    assert.ok(progress.length >= 1, "at least one script.progress");
    const first = progress[0];
    assert.ok(first.at - t0 < 900, `first script.progress ${first.at - t0} ms after script.start; expected at once`);
    const last = progress.at(-1).p;
    assert.deepEqual(last.progress, { done: 200, total: 200, message: "200 checked" });
    assert.equal(last.calls, 200);
  } finally {
    await client.close();
  }
});

const WRITE = `
import agent_tools
for sn in ["SN1", "SN2", "SN3"]:
    print(agent_tools.call("fleet__reboot_device", {"sn": sn}))
`;

test("a declared write, approved once", T, async () => {
  const order = [];
  const approvals = [];
  const { client, seen } = await engine({
    onApproval: async (req) => {
      order.push("approval");
      approvals.push(req);
      await sleep(20);
      return "allow_once";
    },
  });
  try {
    const { token: t, runId } = token({ mode: "approval" });
    const started = await client.start({ token: t, code: WRITE, tools: ["fleet__reboot_device"], description: "reboot three devices" });
    order.push("started");
    const r = await client.wait(started.script_id);
    assert.equal(r.status, "ok", r.text);
    assert.deepEqual(order, ["approval", "started"]);
    assert.equal(approvals.length, 1);
    assert.equal(approvals[0].run_id, runId);
    assert.equal(approvals[0].description, "reboot three devices");
    assert.deepEqual(approvals[0].tools, [{ name: "fleet__reboot_device", class: "write" }]);
    assert.equal(approvals[0].code, WRITE);
    assert.deepEqual(lines(r), ["rebooted SN1 for acme", "rebooted SN2 for acme", "rebooted SN3 for acme"]);
    assert.deepEqual(
      seen.map((c) => c.arguments),
      ["SN1", "SN2", "SN3"].map((sn) => ({ sn, tenant: "acme" })),
    );
  } finally {
    await client.close();
  }
});

test("a denied approval refuses the start (-32013)", T, async () => {
  const { client, seen } = await engine({ onApproval: () => false });
  try {
    const { token: t } = token({ mode: "approval" });
    const e = await client.start({ token: t, code: WRITE, tools: ["fleet__reboot_device"] }).catch((e) => e);
    assert.ok(e instanceof ScriptgateError, String(e));
    assert.equal(e.code, -32013);
    assert.equal(e.reason, "denied");
    assert.equal(seen.length, 0);
  } finally {
    await client.close();
  }
});

test("no approval handler: the daemon is answered deny, start rejects with an ApprovalError saying why, and the engine is warned", T, async () => {
  const { client, seen } = await engine();
  const warnings = [];
  client.on("warning", (w) => warnings.push(w));
  try {
    const { token: t } = token({ mode: "approval" });
    const e = await client.start({ token: t, code: WRITE, tools: ["fleet__reboot_device"] }).catch((e) => e);
    assert.ok(e instanceof ApprovalError, String(e));
    assert.equal(e.code, -32013);
    assert.equal(e.reason, "denied");
    assert.match(e.message, /: no approval handler is registered on this client \(onApproval\)$/);
    assert.equal(warnings.length, 1);
    assert.match(warnings[0], /^denied the approval of script \S+ of run ts-run-\d+ \(fleet__reboot_device\): no approval handler is registered/);
    assert.equal(seen.length, 0);
  } finally {
    await client.close();
  }
});

test("a destructive tool is refused: ToolError denied, never at the engine", T, async () => {
  const { client, seen } = await engine();
  try {
    const code = `
import agent_tools
try:
    agent_tools.call("fleet__wipe_device", {"sn": "SN1"})
    print("wiped")
except agent_tools.ToolError as e:
    print("refused", e.code, e.tool)
`;
    const r = await client.run({ token: token().token, code });
    assert.equal(r.status, "ok", r.text);
    assert.deepEqual(lines(r), ["refused denied fleet__wipe_device"]);
    assert.equal(r.failures, 1);
    assert.equal(seen.length, 0);
  } finally {
    await client.close();
  }
});

test("MCP-shaped answers: structuredContent for a success, tool_error for isError", T, async () => {
  const { client } = await engine();
  try {
    const code = `
import json, agent_tools
print("structured", json.dumps(agent_tools.call("fleet__mcp_status", {"sn": "SN7"}), sort_keys=True))
print("text", agent_tools.call_raw("fleet__mcp_status", {"sn": "SN7"})["text"])
try:
    agent_tools.call("fleet__mcp_fail", {"sn": "SN8"})
    print("no error")
except agent_tools.ToolError as e:
    print("error", e.code, e.message)
`;
    const r = await client.run({ token: token().token, code });
    assert.equal(r.status, "ok", r.text);
    assert.deepEqual(lines(r), ['structured {"online": true, "sn": "SN7"}', "text SN7 online", "error tool_error SN8 unreachable"]);
    assert.equal(r.failures, 1);
  } finally {
    await client.close();
  }
});

test("a malformed tool answer ({foo: 1}) is ToolError engine, never a success", T, async () => {
  const { client } = await engine();
  try {
    const code = `
import agent_tools
try:
    r = agent_tools.call("fleet__bad_answer", {"sn": "SN1"})
    print("accepted", repr(r))
except agent_tools.ToolError as e:
    print("refused", e.code)
`;
    const r = await client.run({ token: token().token, code });
    assert.equal(r.status, "ok", r.text);
    assert.deepEqual(lines(r), ["refused engine"]);
    assert.equal(r.failures, 1);
  } finally {
    await client.close();
  }
});

test("a handler exception is a JSON-RPC error answer: ToolError engine with its message", T, async () => {
  const { client } = await engine();
  try {
    const code = `
import agent_tools
try:
    agent_tools.call("fleet__broken", {"sn": "SN1"})
except agent_tools.ToolError as e:
    print(e.code, "|", e.message)
`;
    const r = await client.run({ token: token().token, code });
    assert.equal(r.status, "ok", r.text);
    assert.deepEqual(lines(r), ["engine | Error: fleet API is down"]);
  } finally {
    await client.close();
  }
});

const SLEEPER = `
import time
print("sleeping", flush=True)
time.sleep(60)
`;

test("a timeout (snapshot limits.timeout_s)", T, async () => {
  const { client } = await engine();
  try {
    const t0 = Date.now();
    const r = await client.run({ token: token({ limits: { timeout_s: 1 } }).token, code: SLEEPER });
    assert.equal(r.status, "timeout", r.text);
    assert.ok(Date.now() - t0 < 20000);
  } finally {
    await client.close();
  }
});

test("a cancel", T, async () => {
  const { client } = await engine();
  try {
    const { script_id } = await client.start({ token: token().token, code: SLEEPER });
    const st = await client.status(script_id);
    assert.equal(st.state, "running");
    const c = await client.cancel(script_id);
    assert.deepEqual(c, { script_id, state: "cancelled" });
    const r = await client.wait(script_id);
    assert.equal(r.status, "cancelled");
    assert.equal(r.error, "cancelled by the engine");
    await assert.rejects(client.wait("0000000000000000", { timeoutS: 1 }), (e) => e instanceof ScriptgateError && e.code === -32016 && e.reason === "not_found");
  } finally {
    await client.close();
  }
});

test("a revoke mid-run", T, async () => {
  let revoked;
  const { client, seen } = await engine();
  const { token: t, runId } = token();
  const handler = fleet(seen);
  client.onToolCall(async (call, ctx) => {
    if (seen.length === 3) revoked = client.revoke(t); // from inside a handler: the reader is not blocked
    return handler(call, ctx);
  });
  try {
    const code = `
import time, agent_tools
for i in range(1, 1000):
    agent_tools.call("fleet__get_device_status", {"sn": f"SN{i}"})
    time.sleep(0.02)
`;
    const r = await client.run({ token: t, code });
    assert.deepEqual(await revoked, { run_id: runId, cancelled: 1 });
    assert.equal(r.status, "cancelled", r.text);
    assert.match(r.error, /revoked/);
    assert.ok(seen.length < 20, `${seen.length} calls reached the engine`);
    const e = await client.start({ token: t, code: "print(1)" }).catch((e) => e);
    assert.ok(e instanceof ScriptgateError);
    assert.equal(e.code, -32010);
    assert.equal(e.reason, "revoked");
  } finally {
    await client.close();
  }
});

test("a bad token (wrong key) is refused: ScriptgateError reason signature", T, async () => {
  const { client } = await engine();
  try {
    const { token: t } = token({ key: Buffer.from("another-key-another-key-another-key!") });
    const e = await client.start({ token: t, code: "print(1)" }).catch((e) => e);
    assert.ok(e instanceof ScriptgateError, String(e));
    assert.equal(e.code, -32010);
    assert.equal(e.reason, "signature");
    assert.equal(e.method, "script.start");
  } finally {
    await client.close();
  }
});

test("a workspace the script's uid cannot write is refused at start (-32011 not_writable)", T, async () => {
  const { client, seen } = await engine();
  try {
    // As root, scripts run as nobody: a root-owned 0755 directory is not theirs to
    // write. Otherwise they run as us: a 0555 directory.
    const ro = join(rig.root, "not-writable");
    mkdirSync(ro);
    chmodSync(ro, process.getuid() === 0 ? 0o755 : 0o555);
    const e = await client.start({ token: token({ workspace: ro }).token, code: "print(1)" }).catch((e) => e);
    if (!(e instanceof ScriptgateError)) await client.cancel(e.script_id).catch(() => {});
    assert.ok(e instanceof ScriptgateError, `start was not refused: ${JSON.stringify(e)}`);
    assert.equal(e.code, -32011);
    assert.equal(e.reason, "not_writable");
    assert.equal(e.field, "workspace");
    assert.equal(seen.length, 0);
  } finally {
    await client.close();
  }
});

/** A token signed with the right key but never validated: what the daemon itself refuses. */
function unvalidatedToken(runId, snapshot) {
  const b64 = (o) => Buffer.from(JSON.stringify(o)).toString("base64url");
  const now = Math.floor(Date.now() / 1000);
  const body = `${b64({ alg: "HS256", typ: "JWT" })}.${b64({ run_id: runId, iat: now, exp: now + 600, snapshot })}`;
  return `${body}.${createHmac("sha256", KEY).update(body).digest("base64url")}`;
}

test("validateSnapshot refuses what the daemon refuses, with the same reason and field", T, async (t) => {
  const { client } = await engine();
  const base = () => ({
    workspace: rig.workspace,
    permission_mode: "approval",
    tools: [
      { name: "a__read", class: "read", input_schema: { type: "object" } },
      { name: "a__wipe", class: "destructive" },
      { name: "a__off", class: "write", enabled: false },
    ],
    limits: { max_calls: 10 },
  });
  const cases = [
    ["an unknown top-level field", (s) => (s.extra = 1), "unknown_field", "extra"],
    ["an unknown tool field", (s) => (s.tools[0].inputSchema = {}), "unknown_field", "tools[0].inputSchema"],
    ["an unknown limit", (s) => (s.limits.max_runtime = 1), "unknown_field", "limits.max_runtime"],
    ["a read tool without input_schema", (s) => delete s.tools[0].input_schema, "missing_field", "tools[0].input_schema"],
    ["a read tool with input_schema null", (s) => (s.tools[0].input_schema = null), "missing_field", "tools[0].input_schema"],
    ["no permission_mode", (s) => delete s.permission_mode, "missing_field", "permission_mode"],
    ["an unknown permission_mode", (s) => (s.permission_mode = "yolo"), "invalid_value", "permission_mode"],
    ["an unknown class", (s) => (s.tools[1].class = "admin"), "invalid_value", "tools[1].class"],
    ["a tool name with a space", (s) => (s.tools[1].name = "a b"), "invalid_value", "tools[1].name"],
    ["a tool listed twice", (s) => (s.tools[1].name = "a__read"), "duplicate_tool", "tools[1].name"],
    ["a negative limit", (s) => (s.limits.timeout_s = -1), "invalid_value", "limits.timeout_s"],
    ["a fractional limit", (s) => (s.limits.timeout_s = 1.5), "invalid_value", "limits.timeout_s"],
    ["read_only null", (s) => (s.read_only = null), "invalid_value", "read_only"],
    ["frozen null", (s) => (s.tools[0].frozen = null), "invalid_value", "tools[0].frozen"],
    ["a relative workspace", (s) => (s.workspace = "ws/run-1"), "not_absolute", "workspace"],
  ];
  try {
    validateSnapshot(base());
    for (const [what, mutate, reason, field, options] of cases) {
      await t.test(what, options ?? {}, async () => {
        const snap = base();
        mutate(snap);
        const same = (e) => e instanceof ScriptgateError && e.code === -32011 && e.reason === reason && e.field === field;
        assert.throws(() => validateSnapshot(snap), same, "validateSnapshot");
        const e = await client.start({ token: unvalidatedToken(`ts-snap-${++runs}`, snap), code: "print(1)" }).catch((e) => e);
        if (!(e instanceof Error)) await client.cancel(e.script_id).catch(() => {});
        assert.ok(same(e), `the daemon answered ${e instanceof ScriptgateError ? `${e.code} ${e.reason} ${e.field}` : JSON.stringify(e)}`);
      });
    }
  } finally {
    await client.close();
  }
});

test("examples/engine.mjs runs against the daemon", T, async () => {
  const { execFile } = await import("node:child_process");
  const example = fileURLToPath(new URL("../../../examples/engine.mjs", import.meta.url));
  const { stdout, stderr } = await new Promise((resolve, reject) =>
    execFile(process.execPath, [example, rig.socket, rig.keyFile, rig.root], { timeout: 60_000 }, (e, stdout, stderr) =>
      e ? reject(Object.assign(e, { message: `${e.message}\n${stdout}\n${stderr}` })) : resolve({ stdout, stderr }),
    ),
  );
  assert.match(stderr, /^approved fleet__reboot_device: reboot offline devices$/m);
  const out = stdout.trim().split("\n");
  assert.match(out[0], /^run_script ok: 6 calls, 0 failed, /);
  assert.deepEqual(out.slice(1), ["SN3 rebooted", "4 devices checked"]);
  // It marked the workspace it made (createdBy), so the daemon recorded it and
  // retention removes it once unused: a dry run 40 days ahead lists it.
  const made = readdirSync(rig.root).filter((n) => n.startsWith("engine-"));
  assert.equal(made.length, 1, `${made}`);
  const ws = join(rig.root, made[0]);
  const marker = JSON.parse(readFileSync(join(ws, ".agent", "workspace.json"), "utf8"));
  assert.equal(marker.created_by, "examples/engine.mjs");
  assert.equal(statSync(join(ws, ".agent", "workspace.json")).mode & 0o777, 0o600);
  if (process.getuid() !== 0) return; // admin.prune answers root and auth.admin_groups only
  const admin = await ScriptgateClient.connect(rig.socket);
  try {
    const expired = async (as_of_ms) =>
      (await admin.request("admin.prune", as_of_ms ? { dry_run: true, as_of_ms } : { dry_run: true })).expired.map((w) => w.path);
    assert.ok(!(await expired()).includes(ws));
    assert.ok((await expired(Date.now() + 40 * 86_400_000)).includes(ws));
  } finally {
    await admin.close();
  }
});

test("prepareWorkspace marks only the directory it creates, and only when asked", async () => {
  const dir = mkdtempSync(join(tmpdir(), "sg-ts-mark-"));
  try {
    const owner = { uid: process.getuid(), gid: process.getgid() };
    const made = await prepareWorkspace(join(dir, "new"), { owner, createdBy: "my-engine" });
    const marker = JSON.parse(readFileSync(join(made, ".agent", "workspace.json"), "utf8"));
    assert.equal(marker.created_by, "my-engine");
    assert.equal(marker.uid, process.geteuid());
    assert.ok(Number.isInteger(marker.created_at_ms));
    assert.equal(statSync(join(made, ".agent")).mode & 0o777, 0o700);
    mkdirSync(join(dir, "old"));
    assert.ok(!existsSync(join(await prepareWorkspace(join(dir, "old"), { owner, createdBy: "my-engine" }), ".agent")));
    assert.ok(!existsSync(join(await prepareWorkspace(join(dir, "plain"), { owner }), ".agent")));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
