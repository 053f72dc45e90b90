import { constants, readFileSync } from "node:fs";
import { mkdir, open, readFile } from "node:fs/promises";
import { connect } from "node:net";
import { dirname, resolve } from "node:path";
import { execFile, execFileSync } from "node:child_process";
import { DEFAULT_SOCKET } from "./client.js";

export interface Owner {
  uid: number;
  gid: number;
}

/** The user's line of /etc/passwd, if it has one. */
function fromPasswd(passwd: string, name: string): Owner | undefined {
  for (const line of passwd.split("\n")) {
    const f = line.split(":");
    if (f.length >= 4 && f[0] === name) {
      const owner = { uid: Number(f[2]), gid: Number(f[3]) };
      if (Number.isSafeInteger(owner.uid) && Number.isSafeInteger(owner.gid)) return owner;
    }
  }
  return undefined;
}

function checked(name: string, owner: Owner): Owner {
  if (!Number.isSafeInteger(owner.uid) || !Number.isSafeInteger(owner.gid)) throw new Error(`cannot resolve user ${name}`);
  return owner;
}

function readPasswd(): string {
  try {
    return readFileSync("/etc/passwd", "utf8");
  } catch {
    return "";
  }
}

/**
 * The uid and primary gid of a user: from /etc/passwd, else (a user of another NSS
 * source, such as LDAP, which Node cannot ask) through id(1).
 */
export function lookupUser(name: string): Owner {
  const local = fromPasswd(readPasswd(), name);
  if (local) return local;
  const id = (flag: string) => Number(execFileSync("id", [flag, "--", name], { encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] }).trim());
  return checked(name, { uid: id("-u"), gid: id("-g") });
}

/** {@link lookupUser}, without blocking: /etc/passwd read asynchronously, id(1) only for a user it lacks. */
export async function lookupUserAsync(name: string): Promise<Owner> {
  const local = fromPasswd(await readFile("/etc/passwd", "utf8").catch(() => ""), name);
  if (local) return local;
  const id = (flag: string) =>
    new Promise<number>((res, rej) =>
      execFile("id", [flag, "--", name], { encoding: "utf8" }, (e, out) => (e ? rej(new Error(`cannot resolve user ${name}: ${e.message}`)) : res(Number(out.trim())))),
    );
  return checked(name, { uid: await id("-u"), gid: await id("-g") });
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

/** {@link scriptOwner}, without blocking. */
async function scriptOwnerAsync(runAs?: string): Promise<Owner> {
  const uid = process.getuid?.();
  const gid = process.getgid?.();
  if (uid === undefined || gid === undefined) throw new Error("scriptOwner needs a POSIX platform");
  if (uid !== 0) return { uid, gid };
  if (runAs !== undefined) return lookupUserAsync(runAs);
  try {
    return await lookupUserAsync(PACKAGED_RUN_AS);
  } catch {
    return lookupUserAsync("nobody");
  }
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
  /**
   * Your engine's name: when this call creates the directory, it also writes the
   * retention marker `.agent/workspace.json` (this process's, mode 0600 in a 0700
   * `.agent`), as `scriptgate run` does for the workspaces it makes. Once a script of
   * this engine has run in it, the daemon's `[workspace] retain_days` removes it when
   * unused (scriptgated(8), WORKSPACE RETENTION). A directory that already existed is
   * never marked.
   */
  createdBy?: string;
}

// The daemon's answer to daemon.info is one line, far below this.
const MAX_ANSWER = 1 << 20;
// Socket activation starts the daemon for the connection: its start-up checks
// (the sandbox preflight) take a few seconds on a slow host.
const ANSWER_TIMEOUT_MS = 30_000;

/**
 * One `daemon.info` round trip, in this process: the daemon gives a connecting
 * engine its `<root>/<uid>` before it reads the request. Resolves with what it said
 * (its error message, or "ok"); never rejects.
 *
 * A peer the daemon does not serve gets the refusal on accept, and a close: the
 * request may then fail with EPIPE and what was read be dropped, so the second
 * try only reads (the refusal comes unasked; a served peer never sees EPIPE).
 */
function askDaemon(socket?: string): Promise<string> {
  const where = socket || process.env["SCRIPTGATE_SOCKET"] || DEFAULT_SOCKET;
  const ask = (request: boolean): Promise<string | "retry"> =>
    new Promise((res) => {
      let got = "";
      let settled = false;
      const s = connect(where, () => {
        if (request) s.write('{"jsonrpc":"2.0","id":1,"method":"daemon.info"}\n', () => {});
      });
      const timer = setTimeout(() => settle(`no answer within ${ANSWER_TIMEOUT_MS} ms`), ANSWER_TIMEOUT_MS);
      const settle = (why?: string, retry = false) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        s.destroy();
        if (retry) return res("retry");
        try {
          const a = JSON.parse(got.split("\n")[0] ?? "") as { error?: { message?: unknown } } | null;
          res(a && a.error ? String(a.error.message) : "ok");
        } catch {
          res(`no answer at ${where}${why ? `: ${why}` : ""}`);
        }
      };
      s.setEncoding("utf8");
      s.on("data", (d: string) => {
        got += d;
        if (got.includes("\n") || got.length >= MAX_ANSWER) settle();
      });
      s.on("error", (e: NodeJS.ErrnoException) => settle(e.message, request && e.code === "EPIPE" && !got));
      s.on("end", () => settle());
    });
  return ask(true).then((r) => (r === "retry" ? ask(false) : r)).then((r) => (r === "retry" ? `no answer at ${where}` : r));
}

/** Write the retention marker below the just-created workspace `ws`. */
async function mark(ws: string, createdBy: string): Promise<void> {
  const agent = `${ws}/.agent`;
  await mkdir(agent, { mode: 0o700 });
  const text = JSON.stringify({ created_by: createdBy, created_at_ms: Date.now(), uid: process.geteuid?.() ?? 0 });
  const f = await open(`${agent}/workspace.json`, constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW, 0o600);
  try {
    await f.writeFile(text + "\n");
  } finally {
    await f.close();
  }
}

function errno(e: unknown): string | undefined {
  return (e as NodeJS.ErrnoException).code;
}

/**
 * Prepare a workspace the script's uid can write: create it (missing parents with mode
 * 0755), give it to the script's uid ({@link defaultRunAs} when this process is root,
 * else our own uid) and set its mode (0700 unless given). An existing directory is
 * re-owned and re-moded; a symlink or a non-directory at `path` is refused (ELOOP,
 * ENOTDIR). Resolves with the absolute path. Its parents must be searchable by that
 * uid (not checked), and it must lie under one of the daemon's `workspace.roots`.
 * Asynchronous throughout, in this process.
 *
 * A non-root engine's workspaces live in `<root>/<uid>`, which the daemon makes at
 * start for each `[[auth.engine]]` user and on any engine's first connection. Under
 * socket activation no daemon runs before that connection: when this process may not
 * create a parent, it asks the daemon (`daemon.info`, which starts it) and tries once
 * more; the error (EACCES) then names what the daemon said.
 */
export async function prepareWorkspace(path: string, options: WorkspaceOptions = {}): Promise<string> {
  const p = resolve(path);
  const owner = options.owner ?? (await scriptOwnerAsync(options.runAs));
  try {
    await mkdir(dirname(p), { recursive: true, mode: 0o755 });
  } catch (e) {
    if (errno(e) !== "EACCES" || process.geteuid?.() === 0) throw e;
    const said = await askDaemon(options.socket);
    try {
      await mkdir(dirname(p), { recursive: true, mode: 0o755 });
    } catch (again) {
      if (errno(again) !== "EACCES") throw again;
      const err = new Error(
        `cannot create ${dirname(p)} (the daemon makes <root>/<uid> for engines it serves; it said: ${said})`,
      ) as NodeJS.ErrnoException;
      err.code = "EACCES";
      throw err;
    }
  }
  let made = true;
  try {
    await mkdir(p, { mode: 0o700 });
  } catch (e) {
    if (errno(e) !== "EEXIST") throw e;
    made = false;
  }
  // Marked before it is given away: until then the new directory is this process's
  // alone (0700), so nobody else can put a link in it between the steps.
  if (made && options.createdBy !== undefined) await mark(p, options.createdBy);
  const fh = await open(p, constants.O_RDONLY | constants.O_DIRECTORY | constants.O_NOFOLLOW);
  try {
    const st = await fh.stat();
    if (st.uid !== owner.uid || st.gid !== owner.gid) await fh.chown(owner.uid, owner.gid);
    await fh.chmod(options.mode ?? 0o700);
  } finally {
    await fh.close();
  }
  return p;
}
