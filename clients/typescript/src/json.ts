/**
 * JSON with exact integers (scriptgate-protocol(7), NUMBERS).
 *
 * `JSON.parse` reads every number as a double, so an integer past
 * `Number.MAX_SAFE_INTEGER` (2^53 - 1) arrives rounded, silently: 2^53 + 1 as
 * 9007199254740992, 2^64 - 1 as 18446744073709551616. The daemon passes a
 * script's integers of up to 64 bits exactly, so the client reads each line
 * with {@link parseJson}: an integer outside the safe range is a `bigint`
 * (exact), every other number a `number`, as `JSON.parse` gives it. Node 18
 * and 20 have no `JSON.parse` source access, hence a small reader of our own,
 * used only for the lines that hold such an integer.
 *
 * {@link stringifyJson} writes a `bigint` as a JSON integer (`JSON.stringify`
 * throws on one), so that an answer that holds one goes back exactly.
 */

import { randomBytes } from "node:crypto";

/** An integer token of 16 digits or more: the only ones that may be unsafe. */
const LONG_DIGITS = /\d{16}/;
const NUMBER = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?/y;
/** Deeper than the daemon ever sends (serde_json reads 128 levels). */
const MAX_DEPTH = 4096;

/**
 * `JSON.parse`, with every integer outside the safe range (|n| > 2^53 - 1) as an
 * exact `bigint`. Throws a `SyntaxError` where `JSON.parse` would.
 */
export function parseJson(text: string): unknown {
  if (!LONG_DIGITS.test(text) || !hasUnsafeInteger(text)) return JSON.parse(text);
  return new Reader(text).document();
}

/** An integer token (no fraction, no exponent) that no `number` holds exactly. */
function unsafeInteger(token: string): boolean {
  return !/[.eE]/.test(token) && !Number.isSafeInteger(Number(token));
}

/** Whether `text` holds, outside strings, an integer token past the safe range. */
function hasUnsafeInteger(text: string): boolean {
  let i = 0;
  const n = text.length;
  while (i < n) {
    const c = text.charCodeAt(i);
    if (c === 0x22) {
      i = stringEnd(text, i);
    } else if (c === 0x2d || (c >= 0x30 && c <= 0x39)) {
      NUMBER.lastIndex = i;
      const m = NUMBER.exec(text);
      if (!m) return false; // not JSON: JSON.parse says so
      if (m[0].length >= 16 && unsafeInteger(m[0])) return true;
      i += m[0].length;
    } else {
      i++;
    }
  }
  return false;
}

/** The index after the string token that opens at `i` (or the end). */
function stringEnd(text: string, i: number): number {
  let j = i + 1;
  const n = text.length;
  while (j < n) {
    const c = text.charCodeAt(j);
    if (c === 0x5c) j += 2;
    else if (c === 0x22) return j + 1;
    else j++;
  }
  return n;
}

class Reader {
  private i = 0;
  constructor(private readonly text: string) {}

  document(): unknown {
    const v = this.value(0);
    this.space();
    if (this.i !== this.text.length) this.fail("unexpected data after the JSON value");
    return v;
  }

  private fail(what: string): never {
    throw new SyntaxError(`${what} in JSON at position ${this.i}`);
  }

  private space(): void {
    const t = this.text;
    for (;;) {
      const c = t.charCodeAt(this.i);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) this.i++;
      else return;
    }
  }

  private value(depth: number): unknown {
    if (depth > MAX_DEPTH) this.fail("nested too deeply");
    this.space();
    const t = this.text;
    const c = t.charCodeAt(this.i);
    if (c === 0x7b) return this.object(depth);
    if (c === 0x5b) return this.array(depth);
    if (c === 0x22) return this.string();
    if (c === 0x2d || (c >= 0x30 && c <= 0x39)) {
      NUMBER.lastIndex = this.i;
      const m = NUMBER.exec(t);
      if (!m) this.fail("malformed number");
      this.i += m[0].length;
      return unsafeInteger(m[0]) ? BigInt(m[0]) : Number(m[0]);
    }
    for (const [word, v] of [["true", true], ["false", false], ["null", null]] as const) {
      if (t.startsWith(word, this.i)) {
        this.i += word.length;
        return v;
      }
    }
    return this.fail(this.i >= t.length ? "unexpected end" : "unexpected token");
  }

  private string(): string {
    const start = this.i;
    const end = stringEnd(this.text, start);
    if (end > this.text.length || this.text.charCodeAt(end - 1) !== 0x22 || end === start + 1) this.fail("unterminated string");
    this.i = end;
    // The escapes, and what JSON forbids in a string, as JSON.parse reads them.
    return JSON.parse(this.text.slice(start, end)) as string;
  }

  private expect(c: number, what: string): void {
    this.space();
    if (this.text.charCodeAt(this.i) !== c) this.fail(`expected ${what}`);
    this.i++;
  }

  private object(depth: number): Record<string, unknown> {
    this.i++;
    const out: Record<string, unknown> = {};
    this.space();
    if (this.text.charCodeAt(this.i) === 0x7d) {
      this.i++;
      return out;
    }
    for (;;) {
      this.space();
      if (this.text.charCodeAt(this.i) !== 0x22) this.fail("expected a key");
      const key = this.string();
      this.expect(0x3a, "':'");
      const v = this.value(depth + 1);
      // As JSON.parse: an own property, even "__proto__"; the last of a repeated key.
      Object.defineProperty(out, key, { value: v, writable: true, enumerable: true, configurable: true });
      this.space();
      const c = this.text.charCodeAt(this.i++);
      if (c === 0x7d) return out;
      if (c !== 0x2c) {
        this.i--;
        this.fail("expected ',' or '}'");
      }
    }
  }

  private array(depth: number): unknown[] {
    this.i++;
    const out: unknown[] = [];
    this.space();
    if (this.text.charCodeAt(this.i) === 0x5d) {
      this.i++;
      return out;
    }
    for (;;) {
      out.push(this.value(depth + 1));
      this.space();
      const c = this.text.charCodeAt(this.i++);
      if (c === 0x5d) return out;
      if (c !== 0x2c) {
        this.i--;
        this.fail("expected ',' or ']'");
      }
    }
  }
}

/**
 * `JSON.stringify`, with a `bigint` written as a JSON integer (its digits)
 * instead of throwing a `TypeError`.
 */
export function stringifyJson(value: unknown): string | undefined {
  let mark: string | undefined;
  const text = JSON.stringify(value, (_key, v: unknown) => {
    if (typeof v !== "bigint") return v;
    mark ??= `scriptgate-bigint-${randomBytes(12).toString("hex")}:`;
    return `${mark}${v.toString()}`;
  });
  if (mark === undefined || text === undefined) return text;
  return text.replace(new RegExp(`"${mark}(-?\\d+)"`, "g"), "$1");
}
