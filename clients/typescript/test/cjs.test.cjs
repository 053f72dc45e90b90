// The package from CommonJS: require("@scriptgate/client") (the package's own name,
// resolved through its "exports" require condition to dist/cjs).
const { test } = require("node:test");
const assert = require("node:assert/strict");
const path = require("node:path");

test("require('@scriptgate/client') loads the CommonJS build", async () => {
  const sg = require("@scriptgate/client");
  const resolved = require.resolve("@scriptgate/client");
  assert.equal(resolved, path.join(__dirname, "..", "dist", "cjs", "index.js"));
  for (const name of ["ScriptgateClient", "mintToken", "validateSnapshot", "toolFromMcp", "ScriptgateError", "TokenError", "SocketNotFoundError", "CallCancelledError", "prepareWorkspace"]) {
    assert.equal(typeof sg[name], "function", name);
  }
  const token = sg.mintToken(Buffer.alloc(32, 1), "run-cjs", { workspace: "/w/x", permission_mode: "auto", tools: [sg.toolFromMcp({ name: "echo", annotations: { readOnlyHint: true } }, { server: "e" })] }, 60);
  assert.equal(sg.decodeToken(token).snapshot.tools[0].name, "e__echo");
  assert.throws(() => sg.validateSnapshot({ workspace: "w", permission_mode: "auto", tools: [] }), (e) => e instanceof sg.SnapshotError && e instanceof sg.ScriptgateError && e.reason === "not_absolute");
  const e = await sg.ScriptgateClient.connect("/nonexistent/scriptgate.sock").catch((e) => e);
  assert.ok(e instanceof sg.SocketNotFoundError && e instanceof sg.ConnectionError, String(e));
  assert.equal(e.path, "/nonexistent/scriptgate.sock");
  assert.equal(new sg.TokenError("x").name, "TokenError");
});
