// Test rig: a real scriptgated on its own socket, with a fresh config, key, state dir
// and workspace in a temp dir (as tests/common/mod.rs does for the Rust tests).
// The daemon is $SCRIPTGATED, default <repo>/target/debug/scriptgated.
import { execFileSync, spawn } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { prepareWorkspace } from "../dist/index.js";

const here = dirname(fileURLToPath(import.meta.url));
export const DAEMON = process.env.SCRIPTGATED || resolve(here, "../../../target/debug/scriptgated");
export const KEY = Buffer.from("test-key-test-key-test-key-test-key!");

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function canConnect(path) {
  return new Promise((res) => {
    const s = connect(path);
    s.once("connect", () => {
      s.destroy();
      res(true);
    });
    s.once("error", () => res(false));
  });
}

/**
 * Start a daemon; `extra` is TOML appended to the config, `allowedGroups` the groups
 * besides root it serves (default: none as root, else our own primary group).
 */
export async function startDaemon(extra = "", { allowedGroups } = {}) {
  if (!existsSync(DAEMON)) {
    throw new Error(`no daemon at ${DAEMON}: run \`cargo build\` in the repository or set SCRIPTGATED`);
  }
  const dir = mkdtempSync(join(tmpdir(), "sg-ts-"));
  chmodSync(dir, 0o755); // the script's uid must traverse it to its workspace
  const root = join(dir, "roots");
  const workspace = await prepareWorkspace(join(root, "ws"));
  const keyFile = join(dir, "token.key");
  writeFileSync(keyFile, KEY, { mode: 0o600 });
  const state = join(dir, "state");
  const config = join(dir, "scriptgate.toml");
  const q = JSON.stringify;
  // Not root: our own primary group is the one allowed to connect.
  const served = allowedGroups ?? (process.getuid() === 0 ? [] : [execFileSync("id", ["-gn"], { encoding: "utf8" }).trim()]);
  const groups = served.length ? `allowed_groups = ${q(served)}\n` : "";
  writeFileSync(config, `[auth]\ntoken_key_file = ${q(keyFile)}\n${groups}[workspace]\nroots = [${q(root)}]\n[state]\ndir = ${q(state)}\n${extra}`);
  const socket = join(dir, "sock");
  const logFile = join(dir, "daemon.log");
  const log = openSync(logFile, "a");
  const child = spawn(DAEMON, ["--listen", socket, "--config", config], { stdio: ["ignore", log, log] });
  let exited = null;
  child.on("exit", (code, signal) => (exited = signal ?? code));
  // A test process that dies before its after() hook (an uncaught error, EPIPE on a
  // closed stdout) must not leave the daemon behind.
  const reap = () => {
    child.kill("SIGKILL");
    if (!process.env.SG_KEEP) rmSync(dir, { recursive: true, force: true });
  };
  process.once("exit", reap);
  const logText = () => (existsSync(logFile) ? readFileSync(logFile, "utf8") : "");
  const t0 = Date.now();
  while (!(await canConnect(socket))) {
    if (exited !== null) throw new Error(`daemon exited (${exited}):\n${logText()}`);
    if (Date.now() - t0 > 20000) throw new Error(`daemon did not listen:\n${logText()}`);
    await sleep(20);
  }
  return {
    dir,
    root,
    workspace,
    keyFile,
    socket,
    logText,
    async stop() {
      process.off("exit", reap);
      if (exited === null) {
        const gone = new Promise((r) => child.once("exit", r));
        child.kill("SIGTERM");
        await Promise.race([gone, sleep(5000)]);
        if (exited === null) child.kill("SIGKILL");
      }
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
