// What the Node host tests of tests/hosts share with the Python ones: the scripts, the
// expected summary and the messages, read from tests/hosts/python/hostlib.py (one
// source), how `scriptgate mcp` is started (stdio, the embedded daemon with this run's
// state in $SCRIPTGATE_HOSTS_STATE, the fleet server upstream), and the records.
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = fileURLToPath(new URL(".", import.meta.url));
const REPO = join(HERE, "..", "..", "..");
export const SCRIPTGATE = process.env.SCRIPTGATE || join(REPO, "target", "debug", "scriptgate");

if (!process.env.SCRIPTGATE_HOSTS_STATE) {
  const made = mkdtempSync(join(tmpdir(), "sg-hosts-"));
  process.env.SCRIPTGATE_HOSTS_STATE = made;
  process.on("exit", () => rmSync(made, { recursive: true, force: true }));
}

/** hostlib's constants (and the expected summary), as JSON from Python. */
export const h = JSON.parse(
  execFileSync(
    "python3",
    [
      "-c",
      `import json, sys
sys.path.insert(0, ${JSON.stringify(join(HERE, "..", "python"))})
import hostlib as h
print(json.dumps({k: getattr(h, k) for k in ["SUMMARY_CODE", "FAIL_CODE", "FAIL_OUTPUT", "FAIL_TAIL", "REBOOT_CODE",
  "REBOOT_TOOLS", "REBOOTED", "CANNOT_ASK", "SLEEP_CODE"]} | {"summary": h.expected_summary(), "args": h.mcp_args(),
  "config": str(h.CONFIG)}))`,
    ],
    { encoding: "utf8" },
  ),
);

/** `scriptgate mcp`'s arguments, then `extra`. */
export const mcpArgs = (...extra) => [...h.args, ...extra];

let n = 0;
export const unique = (label) => `${label}-${process.pid}-${Date.now()}-${n++}`;

export const rebootArgs = (description) => ({ code: h.REBOOT_CODE, tools: h.REBOOT_TOOLS, description });

export const textOf = (r) => (r.content ?? []).filter((c) => c.type === "text").map((c) => c.text).join("");

/** The script's record, or undefined. */
export function record(description) {
  let out;
  try {
    out = execFileSync(SCRIPTGATE, ["audit", "--embedded", "--json", "--config", h.config, "--limit", "500"], {
      encoding: "utf8",
      stdio: ["ignore", "pipe", "pipe"],
    });
  } catch (e) {
    if (/has no audit store yet/.test(String(e.stderr))) return undefined;
    throw e;
  }
  const rows = JSON.parse(out);
  const mine = (Array.isArray(rows) ? rows : rows.scripts).filter((r) => r.description === description);
  if (mine.length > 1) throw new Error(`two records of ${description}`);
  return mine[0];
}

/** The record once it is running (`running`) or has ended: polled, each poll a `scriptgate audit`. */
export async function waitRecord(description, { running = false, timeoutMs = 60_000 } = {}) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const r = record(description);
    if (r && (running || r.status !== "running")) return r;
    if (Date.now() > deadline) throw new Error(`no ${running ? "running" : "ended"} record of ${description}: ${JSON.stringify(r)}`);
    await new Promise((ok) => setTimeout(ok, 100));
  }
}
