import { closeSync, constants, fchmodSync, fchownSync, fstatSync, mkdirSync, openSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { execFileSync } from "node:child_process";
import { DEFAULT_SOCKET } from "./client.js";

export interface Owner {
  uid: number;
  gid: number;
}

/** The uid and primary gid of a user, through id(1). */
export function lookupUser(name: string): Owner {
  const id = (flag: string) => Number(execFileSync("id", [flag, "--", name], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] }).trim());
  const owner = { uid: id("-u"), gid: id("-g") };
  if (!Number.isSafeInteger(owner.uid) || !Number.isSafeInteger(owner.gid)) {
    throw new Error(`cannot resolve user ${name}`);
  }
  return owner;
}

/**
 * The uid/gid the scripts this process starts run as: the daemon runs a root peer's
 * scripts as `sandbox.run_as` ({@link defaultRunAs}: the packages' `scriptgate-script`
 * where it exists, else `nobody`; pass `runAs` if the daemon is configured otherwise)
 * and anyone else's as the peer itself.
 */
/** The packages' `sandbox.run_as`: a user of their own. */
export const PACKAGED_RUN_AS = "scriptgate-script";

/** The packages' `sandbox.run_as` where the package made its user, else scriptgated's built-in `nobody`. */
export function defaultRunAs(): string {
  try {
    lookupUser(PACKAGED_RUN_AS);
    return PACKAGED_RUN_AS;
  } catch {
    return "nobody";
  }
}

export function scriptOwner(runAs?: string): Owner {
  const uid = process.getuid?.();
  const gid = process.getgid?.();
  if (uid === undefined || gid === undefined) throw new Error("scriptOwner needs a POSIX platform");
  return uid === 0 ? lookupUser(runAs ?? defaultRunAs()) : { uid, gid };
}

export interface WorkspaceOptions {
  /** The daemon's `sandbox.run_as` (default {@link defaultRunAs}), used when this process is root. */
  runAs?: string;
  /** Explicit owner instead of {@link scriptOwner}. */
  owner?: Owner;
  /** Mode of the directory (default 0o700: the script's uid only). */
  mode?: number;
  /**
   * The daemon's socket (default `$SCRIPTGATE_SOCKET`, then the packaged one), asked
   * for `<root>/<uid>` when a non-root process may not create a parent.
   */
  socket?: string;
}

// The daemon's answer to daemon.info is one line, far below this.
const MAX_ANSWER = 1 << 20;
// Socket activation starts the daemon for the connection: its start-up checks
// (the sandbox preflight) take a few seconds on a slow host.
const ANSWER_TIMEOUT_MS = 30_000;

// Run by a child node (this function is synchronous): one daemon.info round trip,
// printing what the daemon said.
const ASK_DAEMON = `
const net = require("node:net");
const [where, max] = [process.argv[1], Number(process.argv[2])];
let said = null;
const say = (text) => {
  if (said === null) process.stdout.write((said = text));
};
// A peer the daemon does not serve gets the refusal on accept, and a close: our
// request may then fail with EPIPE, and node drops what was read. The second try
// only reads (the refusal comes unasked; a served peer never sees EPIPE).
const ask = (request) => {
  let got = "";
  const s = net.connect(where, () => request && s.write('{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\\n', () => {}));
  const settle = (why) => {
    s.destroy();
    try {
      const a = JSON.parse(got.split("\\n")[0]);
      say(a && a.error ? String(a.error.message) : "ok");
    } catch {
      say("no answer at " + where + (why ? ": " + why : ""));
    }
  };
  s.on("data", (d) => {
    got += d;
    if (got.includes("\\n") || got.length >= max) settle();
  });
  s.on("error", (e) => (request && e.code === "EPIPE" && !got ? (s.destroy(), ask(false)) : settle(e.message)));
  s.on("end", () => settle());
};
ask(true);
`;

/**
 * One `daemon.info` round trip: the daemon gives a connecting engine its
 * `<root>/<uid>` before it reads the request. Returns what it said; never throws.
 */
function askDaemon(socket?: string): string {
  const where = socket || process.env["SCRIPTGATE_SOCKET"] || DEFAULT_SOCKET;
  try {
    return execFileSync(process.execPath, ["-e", ASK_DAEMON, where, String(MAX_ANSWER)], {
      encoding: "utf8",
      stdio: ["ignore", "pipe", "pipe"],
      timeout: ANSWER_TIMEOUT_MS,
    });
  } catch (e) {
    return `no answer at ${where}: ${(e as Error).message}`;
  }
}

/**
 * Prepare a workspace the script's uid can write: create it (missing parents with mode
 * 0755), give it to the script's uid ({@link defaultRunAs} when this process is root,
 * else our own uid) and set its mode (0700 unless given). An existing directory is
 * re-owned and re-moded; a symlink or a non-directory at `path` is refused (ELOOP,
 * ENOTDIR). Returns the absolute path. Its parents must be searchable by that uid
 * (not checked), and it must lie under one of the daemon's `workspace.roots`.
 *
 * A non-root engine's workspaces live in `<root>/<uid>`, which the daemon makes at
 * start for each `[[auth.engine]]` user and on any engine's first connection. Under
 * socket activation no daemon runs before that connection: when this process may not
 * create a parent, it asks the daemon (`daemon.info`, which starts it) and tries once
 * more; the error (EACCES) then names what the daemon said.
 */
export function prepareWorkspace(path: string, options: WorkspaceOptions = {}): string {
  const p = resolve(path);
  const owner = options.owner ?? scriptOwner(options.runAs);
  try {
    mkdirSync(dirname(p), { recursive: true, mode: 0o755 });
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== "EACCES" || process.geteuid?.() === 0) throw e;
    const said = askDaemon(options.socket);
    try {
      mkdirSync(dirname(p), { recursive: true, mode: 0o755 });
    } catch (again) {
      if ((again as NodeJS.ErrnoException).code !== "EACCES") throw again;
      const err = new Error(
        `cannot create ${dirname(p)} (the daemon makes <root>/<uid> for engines it serves; it said: ${said})`,
      ) as NodeJS.ErrnoException;
      err.code = "EACCES";
      throw err;
    }
  }
  try {
    mkdirSync(p, { mode: 0o700 });
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e;
  }
  const fd = openSync(p, constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW);
  try {
    const st = fstatSync(fd);
    if (st.uid !== owner.uid || st.gid !== owner.gid) fchownSync(fd, owner.uid, owner.gid);
    fchmodSync(fd, options.mode ?? 0o700);
  } finally {
    closeSync(fd);
  }
  return p;
}
