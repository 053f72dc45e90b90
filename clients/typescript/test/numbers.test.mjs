// Numbers (scriptgate-protocol(7), NUMBERS; issue 32 §6): a script's integers reach
// the engine's handler exactly, as a bigint past Number.MAX_SAFE_INTEGER, and those
// the daemon cannot pass exactly are refused by it, never rounded. parseJson and
// stringifyJson on their own, then through a real scriptgated (see rig.mjs).
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { ScriptgateClient, mintToken, parseJson, stringifyJson } from "../dist/index.js";
import { KEY, startDaemon } from "./rig.mjs";

const T = { timeout: 60_000 };

test("parseJson: integers past 2^53 - 1 are exact bigints, the rest as JSON.parse", () => {
  const text = '{"a": 9007199254740991, "b": 9007199254740992, "c": [9007199254740993, -9223372036854775808], "d": 18446744073709551615, "e": 1.8446744073709552e19, "f": "9007199254740993", "g": 12345678901234567.5}';
  const v = parseJson(text);
  assert.equal(v.a, 9007199254740991);
  assert.equal(v.b, 9007199254740992n);
  assert.deepEqual(v.c, [9007199254740993n, -9223372036854775808n]);
  assert.equal(v.d, 18446744073709551615n);
  assert.equal(v.e, 18446744073709552000, "a float stays a number");
  assert.equal(v.f, "9007199254740993", "digits in a string are text");
  assert.equal(v.g, 12345678901234568);
  // What JSON.parse does with them: the reason.
  assert.equal(JSON.parse(text).c[0], 9007199254740992);
});

test("parseJson reads what JSON.parse reads, and refuses what it refuses", () => {
  const cases = [
    '{"__proto__": {"x": 1}, "k": 10000000000000001}',
    '{"a": 1, "a": 20000000000000001}',
    ' [ "\\u00e9\\ud83d\\ude00\\n\\"\\\\", true, false, null, -0, 0.5e-3, 1E400, {} , [ ] ] ',
    '"x"',
    "10000000000000001",
    "[[[[[[10000000000000001]]]]]]",
  ];
  for (const c of cases) {
    const mine = parseJson(c);
    const theirs = JSON.parse(c, (_k, v) => v);
    const canon = (x) => JSON.stringify(x, (_k, v) => (typeof v === "bigint" ? Number(v) : v));
    assert.equal(canon(mine), canon(theirs), c);
  }
  const proto = parseJson(cases[0]);
  assert.equal(Object.getPrototypeOf(proto), Object.prototype);
  assert.deepEqual(Object.keys(proto), ["__proto__", "k"]);
  assert.equal(proto.k, 10000000000000001n);
  assert.equal(parseJson(cases[1]).a, 20000000000000001n, "the last of a repeated key");
  for (const bad of ['{"a": 10000000000000001', '{"a" 10000000000000001}', "[10000000000000001,]", '["10000000000000001\\x"]', "[10000000000000001] x", '[10000000000000001, "\u0001"]', "[01, 10000000000000001]", '{"a": 10000000000000001, }']) {
    assert.throws(() => JSON.parse(bad), SyntaxError, bad);
    assert.throws(() => parseJson(bad), SyntaxError, bad);
  }
});

test("stringifyJson writes bigints as JSON integers", () => {
  const v = { n: 18446744073709551615n, m: [-9223372036854775808n, 1, "18446744073709551615n"], s: "scriptgate-bigint-x:1" };
  const text = stringifyJson(v);
  assert.equal(text, '{"n":18446744073709551615,"m":[-9223372036854775808,1,"18446744073709551615n"],"s":"scriptgate-bigint-x:1"}');
  assert.deepEqual(parseJson(text), v);
  assert.equal(stringifyJson({ a: 1 }), JSON.stringify({ a: 1 }));
  assert.equal(stringifyJson(5n), "5");
  assert.equal(stringifyJson(undefined), undefined);
  assert.throws(() => JSON.stringify(v), TypeError);
});

let rig;
before(async () => {
  rig = await startDaemon();
});
after(async () => {
  if (process.env.SG_KEEP) console.log(`# kept ${rig?.dir}`);
  else await rig?.stop();
});

const VALUES = [
  ["2^53", 2n ** 53n, true],
  ["2^53+1", 2n ** 53n + 1n, true],
  ["2^64-1", 2n ** 64n - 1n, true],
  ["2^64", 2n ** 64n, false],
  ["2^64+1", 2n ** 64n + 1n, false],
  ["2^70", 2n ** 70n, false],
  ["-2^63", -(2n ** 63n), true],
  ["-2^64-5", -(2n ** 64n) - 5n, false],
];

const SCRIPT = `
import agent_tools, json
V = [("2^53", 2**53), ("2^53+1", 2**53 + 1), ("2^64-1", 2**64 - 1), ("2^64", 2**64),
     ("2^64+1", 2**64 + 1), ("2^70", 2**70), ("-2^63", -2**63), ("-2^64-5", -2**64 - 5)]
out = {}
for name, v in V:
    for where, args in (("top", {"n": v}), ("nested", {"deep": {"list": [0, {"n": v}]}})):
        try:
            r = agent_tools.call("num__echo", {"case": f"{name} {where}", **args})
            got = r["n"] if where == "top" else r["deep"]["list"][1]["n"]
            out[f"{name} {where}"] = ["ok", got == v and type(got) is int]
        except agent_tools.ToolError as e:
            out[f"{name} {where}"] = [e.code, e.message]
many = agent_tools.call_many("num__echo", [{"case": f"{name} many", "n": v} for name, v in V], return_errors=True)
for (name, v), r in zip(V, many):
    out[f"{name} many"] = [r.code, r.message] if isinstance(r, agent_tools.ToolError) else ["ok", r["n"] == v and type(r["n"]) is int]
print(json.dumps(out))
`;

test("through the daemon: the handler gets each integer exactly or never", T, async () => {
  const seen = new Map();
  const client = await ScriptgateClient.connect(rig.socket, {
    // Echo: the answer carries the bigints back, written exactly (stringifyJson).
    onToolCall: (call) => {
      seen.set(call.arguments.case, call.arguments);
      return { text: "echo", structured: call.arguments, is_error: false };
    },
  });
  try {
    const snapshot = {
      workspace: rig.workspace,
      permission_mode: "auto",
      tools: [{ name: "num__echo", class: "read", input_schema: { type: "object", additionalProperties: true } }],
    };
    const r = await client.run({ token: mintToken(KEY, "ts-numbers", snapshot, 600), code: SCRIPT, description: "numbers" });
    assert.equal(r.status, "ok", r.text);
    const out = JSON.parse(r.output);
    const got = (args, place) => (place === "nested" ? args.deep.list[1].n : args.n);
    const report = [...seen].map(([k, a]) => `${k}: ${typeof got(a, k.split(" ")[1])} ${got(a, k.split(" ")[1])}`).join("\n");
    for (const [name, value, passes] of VALUES) {
      for (const place of ["top", "nested", "many"]) {
        const c = `${name} ${place}`;
        if (passes) {
          assert.ok(seen.has(c), `${c} never reached the handler\n${report}`);
          const v = got(seen.get(c), place);
          assert.equal(typeof v, "bigint", `${c}: ${typeof v} ${v}\n${report}`);
          assert.equal(v, value, `${c}\n${report}`);
          assert.deepEqual(out[c], ["ok", true], `${c}: the echo came back exact`);
        } else {
          assert.ok(!seen.has(c), `${c} reached the handler as ${seen.has(c) && got(seen.get(c), place)}`);
          assert.equal(out[c][0], "invalid_arguments", c);
          assert.match(out[c][1], new RegExp(`the integer ${value} at /(deep/list/1/)?n `), c);
        }
      }
    }
    assert.equal(seen.size, 12);
    // calls.jsonl holds what the handler got, digit for digit.
    const log = readFileSync(join(rig.workspace, r.details_dir, "calls.jsonl"), "utf8").trim().split("\n");
    assert.equal(log.length, 24);
    for (const [name, value, passes] of VALUES) {
      const line = log.find((l) => l.includes(`"case":"${name} top"`) || l.includes(`\\"case\\":\\"${name} top\\"`));
      assert.ok(line, name);
      assert.ok(line.includes(passes ? `"n":${value}` : `\\"n\\":${value}`), line);
    }
  } finally {
    await client.close();
  }
});
