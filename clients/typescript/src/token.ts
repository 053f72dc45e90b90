import { createHmac } from "node:crypto";
import { readFileSync } from "node:fs";
import { validateSnapshot, type Snapshot } from "./snapshot.js";

/** The claims of a run token (protocol §2). */
export interface RunClaims {
  run_id: string;
  iat: number;
  exp: number;
  runner?: string;
  snapshot: Snapshot;
}

/** Key material: the exact bytes of the daemon's `auth.token_key_file`. */
export type TokenKey = Uint8Array | string;

function b64url(data: Buffer | string): string {
  return Buffer.from(data).toString("base64url");
}

/**
 * Read a token key file as the daemon does: its exact bytes (a trailing newline is
 * part of the key).
 */
export function readKeyFile(path: string): Buffer {
  return readFileSync(path);
}

/**
 * Mint a run token: a JWT signed with HS256 carrying `run_id`, `iat`, `exp`
 * (`iat + ttlSeconds`), `snapshot` and, when given, `runner`. The snapshot is checked
 * with {@link validateSnapshot} first, so a snapshot the daemon would refuse is
 * never signed.
 *
 * @param key the daemon's key (32 bytes or more); a string is taken as UTF-8.
 */
export function mintToken(
  key: TokenKey,
  runId: string,
  snapshot: Snapshot,
  ttlSeconds: number,
  runner?: string,
): string {
  const k = typeof key === "string" ? Buffer.from(key, "utf8") : Buffer.from(key);
  if (k.length < 32) throw new RangeError(`token key has ${k.length} bytes; the daemon needs 32 or more`);
  if (typeof runId !== "string" || runId === "") throw new TypeError("runId must be a non-empty string");
  if (!Number.isFinite(ttlSeconds)) throw new TypeError("ttlSeconds must be a finite number");
  validateSnapshot(snapshot);
  const iat = Math.floor(Date.now() / 1000);
  const claims: RunClaims = { run_id: runId, iat, exp: iat + Math.trunc(ttlSeconds), snapshot };
  if (runner !== undefined) claims.runner = runner;
  const header = b64url(JSON.stringify({ alg: "HS256", typ: "JWT" }));
  const payload = b64url(JSON.stringify(claims));
  const signature = createHmac("sha256", k).update(`${header}.${payload}`).digest("base64url");
  return `${header}.${payload}.${signature}`;
}

/**
 * The claims of a token, decoded without checking its signature (for logging and
 * tests; the daemon is the one that verifies).
 */
export function decodeToken(token: string): RunClaims {
  const parts = token.split(".");
  if (parts.length !== 3) throw new TypeError("a run token has three base64url parts");
  return JSON.parse(Buffer.from(parts[1] ?? "", "base64url").toString("utf8")) as RunClaims;
}
