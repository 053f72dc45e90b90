// Packaging: the package installs from its `npm pack` tarball (ESM import and CommonJS
// require both work there), and `npm install <this directory>` from another project
// writes nothing into the source tree (no install-time build: there is no `prepare`).
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";

const T = { timeout: 120_000 };
const pkgDir = fileURLToPath(new URL("..", import.meta.url));
const npm = (args, cwd) => execFileSync("npm", [...args, "--no-audit", "--no-fund", "--loglevel=error"], { cwd, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
const node = (args, cwd) => execFileSync(process.execPath, args, { cwd, encoding: "utf8" }).trim();

const USE = `
const check = (sg, how) => {
  const ok = ["ScriptgateClient", "mintToken", "toolFromMcp", "TokenError", "SocketNotFoundError"].every((n) => typeof sg[n] === "function");
  const t = sg.toolFromMcp({ name: "echo", annotations: { readOnlyHint: true } }, { server: "e" });
  console.log(how, ok, t.name, t.class);
};`;

function project() {
  const dir = mkdtempSync(join(tmpdir(), "sg-ts-pkg-"));
  writeFileSync(join(dir, "package.json"), JSON.stringify({ name: "consumer", version: "1.0.0", private: true }));
  writeFileSync(join(dir, "use.cjs"), `${USE}\ncheck(require("@scriptgate/client"), "require"); console.log(require.resolve("@scriptgate/client"));\n`);
  writeFileSync(join(dir, "use.mjs"), `${USE}\ncheck(await import("@scriptgate/client"), "import"); console.log(import.meta.resolve("@scriptgate/client"));\n`);
  return dir;
}

const gitStatus = () => execFileSync("git", ["status", "--porcelain", "--ignored", "--untracked-files=all", "--", "."], { cwd: pkgDir, encoding: "utf8" });

/** Everything under the package directory with its mtime and size (ignored files too). */
function tree() {
  return execFileSync("find", [pkgDir, "-printf", "%P %T@ %s\\n"], { encoding: "utf8" }).split("\n").sort().join("\n");
}

test("npm pack: a tarball of dist (ESM, dist/cjs) and the README; installed from it, import and require both work", T, () => {
  const out = mkdtempSync(join(tmpdir(), "sg-ts-pack-"));
  const dir = project();
  try {
    // dist/ is built (run-tests); --ignore-scripts skips prepack's rebuild.
    const [info] = JSON.parse(npm(["pack", "--json", "--ignore-scripts", "--pack-destination", out], pkgDir));
    const files = info.files.map((f) => f.path).sort();
    for (const f of ["package.json", "README.md", "dist/index.js", "dist/index.d.ts", "dist/cjs/index.js", "dist/cjs/index.d.ts", "dist/cjs/package.json"]) assert.ok(files.includes(f), f);
    assert.deepEqual(files.filter((f) => !f.startsWith("dist/") && !["package.json", "README.md"].includes(f)), []);
    npm(["install", "--offline", join(out, info.filename)], dir);
    const manifest = JSON.parse(readFileSync(join(dir, "node_modules/@scriptgate/client/package.json"), "utf8"));
    assert.equal(manifest.scripts.prepare, undefined);
    assert.deepEqual(node(["use.cjs"], dir).split("\n"), ["require true e__echo read", join(dir, "node_modules/@scriptgate/client/dist/cjs/index.js")]);
    assert.deepEqual(node(["use.mjs"], dir).split("\n"), ["import true e__echo read", `file://${join(dir, "node_modules/@scriptgate/client/dist/index.js")}`]);
  } finally {
    rmSync(out, { recursive: true, force: true });
    rmSync(dir, { recursive: true, force: true });
  }
});

test("npm install <clients/typescript> from another project writes nothing into the source tree", T, () => {
  const dir = project();
  try {
    const before = tree();
    const statusBefore = gitStatus();
    npm(["install", "--offline", pkgDir], dir);
    assert.equal(tree(), before, "files under clients/typescript changed (created, removed or modified)");
    assert.equal(gitStatus(), statusBefore, "git status changed");
    assert.equal(node(["use.cjs"], dir).split("\n")[0], "require true e__echo read");
    assert.equal(node(["use.mjs"], dir).split("\n")[0], "import true e__echo read");
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
