# A report over a directory, through the MCP filesystem server.
#   scriptgate run --mcp "fs=npx -y @modelcontextprotocol/server-filesystem $PWD/examples/sample-docs" examples/files_report.py
import json
import agent_tools

root = agent_tools.call("fs__list_allowed_directories", {})["content"].splitlines()[-1].strip()
tree = json.loads(agent_tools.call("fs__directory_tree", {"path": root})["content"])

def files(nodes, prefix):
    for n in nodes:
        path = f"{prefix}/{n['name']}"
        if n["type"] == "directory":
            yield from files(n.get("children", []), path)
        else:
            yield path

paths = sorted(files(tree, root))
texts = agent_tools.call_many("fs__read_text_file", [{"path": p} for p in paths], return_errors=True)
rows = []
for path, text in zip(paths, texts):
    if isinstance(text, agent_tools.ToolError):
        rows.append((path, None, None, text.message))
        continue
    body = text["content"]
    rows.append((path, len(body.splitlines()), len(body.split()), None))

print(f"{len(paths)} files under {root}")
for path, lines, words, err in rows:
    rel = path[len(root) + 1:]
    print(f"  {rel:32} " + (f"{lines:4} lines {words:5} words" if err is None else f"unreadable: {err}"))
total = sum(r[2] or 0 for r in rows)
todo = [r[0][len(root) + 1:] for r, t in zip(rows, texts) if not isinstance(t, agent_tools.ToolError) and "TODO" in t["content"]]
print(f"{total} words in all; files with a TODO: {', '.join(todo) or 'none'}")
