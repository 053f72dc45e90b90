// A complete scriptgate engine on @scriptgate/client: it starts a script over a small
// in-memory fleet, answers its tool calls, approves its declared write, prints the result.
// Usage: node examples/engine.mjs [SOCKET] [KEY_FILE] [WORKSPACE_ROOT], or env SCRIPTGATE_SOCKET,
// SCRIPTGATE_KEY_FILE, SCRIPTGATE_WORKSPACE_ROOT (defaults /run/scriptgate/scriptgate.sock,
// /etc/scriptgate/token.key, /var/lib/scriptgate/workspaces[/<uid> unless root]). The script works in WORKSPACE_ROOT/engine-<pid>
// (the root is one of workspace.roots). Setup: npm ci && npm run build in clients/typescript, then npm ci in examples
// (examples/package.json: @scriptgate/client from this tree, by its package name, as a user's engine has it).
import { join } from "node:path";
import { ScriptgateClient, mintToken, prepareWorkspace, readKeyFile } from "@scriptgate/client";

const env = process.env, [socket = env.SCRIPTGATE_SOCKET ?? "/run/scriptgate/scriptgate.sock",
  keyFile = env.SCRIPTGATE_KEY_FILE ?? "/etc/scriptgate/token.key", root = env.SCRIPTGATE_WORKSPACE_ROOT ?? `/var/lib/scriptgate/workspaces${process.getuid() ? `/${process.getuid()}` : ""}`] = process.argv.slice(2);
const fleet = new Map(["SN1", "SN2", "SN3", "SN4"].map((sn, i) => [sn, { sn, online: i !== 2, fw: i % 2 ? "1.3" : "1.2" }]));
const SN = { type: "object", properties: { sn: { type: "string" } }, required: ["sn"] };
const snapshot = { workspace: await prepareWorkspace(join(root, `engine-${process.pid}`), { createdBy: "examples/engine.mjs" }), permission_mode: "approval", tools: [
  { name: "fleet__list_devices", class: "read", input_schema: { type: "object" } },
  { name: "fleet__get_device_status", class: "read", input_schema: SN },
  { name: "fleet__reboot_device", class: "write", input_schema: SN }] };
const token = mintToken(readKeyFile(keyFile), `example-${process.pid}`, snapshot, 600, "examples/engine.mjs");
const ok = (text, structured = null) => ({ text, structured, is_error: false });
const client = await ScriptgateClient.connect(socket, {
  onApproval: ({ tools, description }) => (console.error(`approved ${tools.map((t) => t.name)}: ${description}`), "allow_once"),
  onToolCall: ({ tool, arguments: { sn } }) => {
    if (tool === "fleet__list_devices") return ok([...fleet.keys()].join(" "), { devices: [...fleet.keys()] });
    const d = fleet.get(sn);
    if (!d) return { text: `no device ${sn}`, structured: null, is_error: true };
    if (tool === "fleet__get_device_status") return ok(`${sn} ${d.online ? "online" : "offline"}`, d);
    d.online = true; // fleet__reboot_device
    return ok(`${sn} rebooted`);
  },
});
const code = `import agent_tools
devices = agent_tools.call("fleet__list_devices", {})["devices"]
for st in agent_tools.call_many("fleet__get_device_status", [{"sn": sn} for sn in devices]):
    if not st["online"]:
        print(agent_tools.call("fleet__reboot_device", {"sn": st["sn"]}))
print(f"{len(devices)} devices checked")`;
const result = await client.run({ token, code, tools: ["fleet__reboot_device"], description: "reboot offline devices" });
console.log(result.text);
process.exitCode = result.status === "ok" ? 0 : 1;
await client.close();
