import { closeSync, constants, fchmodSync, fchownSync, fstatSync, mkdirSync, openSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { execFileSync } from "node:child_process";

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
}

/**
 * Prepare a workspace the script's uid can write: create it (missing parents with mode
 * 0755), give it to the script's uid ({@link defaultRunAs} when this process is root,
 * else our own uid) and set its mode (0700 unless given). An existing directory is
 * re-owned and re-moded; a symlink or a non-directory at `path` is refused (ELOOP,
 * ENOTDIR). Returns the absolute path. Its parents must be searchable by that uid
 * (not checked), and it must lie under one of the daemon's `workspace.roots`.
 */
export function prepareWorkspace(path: string, options: WorkspaceOptions = {}): string {
  const p = resolve(path);
  const owner = options.owner ?? scriptOwner(options.runAs);
  mkdirSync(dirname(p), { recursive: true, mode: 0o755 });
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
