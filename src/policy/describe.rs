//! The `run_script` tool description a model is given for one snapshot: how to use
//! `agent_tools`, the limits, and which tools it may call, as Python-style
//! signatures taken from their JSON schemas. Pure.

use crate::policy::Limits;
use crate::protocol::snapshot::{PermissionMode, Snapshot, ToolClass, ToolSpec};
use serde_json::Value;

fn py_type(schema: &Value) -> String {
    let one = |t: &str| match t {
        "string" => "str",
        "integer" => "int",
        "number" => "float",
        "boolean" => "bool",
        "array" => "list",
        "object" => "dict",
        "null" => "None",
        _ => "Any",
    };
    if let Some(e) = schema.get("enum").and_then(Value::as_array) {
        let vals: Vec<String> = e.iter().take(6).map(|v| v.to_string()).collect();
        return format!("Literal[{}]", vals.join(", ")).replace('"', "'");
    }
    match schema.get("type") {
        Some(Value::String(t)) if t == "array" => match schema.get("items") {
            Some(items) => format!("list[{}]", py_type(items)),
            None => "list".into(),
        },
        Some(Value::String(t)) => one(t).into(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .map(one)
            .collect::<Vec<_>>()
            .join(" | "),
        _ => match schema
            .get("anyOf")
            .or_else(|| schema.get("oneOf"))
            .and_then(Value::as_array)
        {
            Some(alts) => alts.iter().map(py_type).collect::<Vec<_>>().join(" | "),
            None => "Any".into(),
        },
    }
}

fn py_default(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::String(s) => format!("{s:?}").replace('"', "'"),
        other => other.to_string(),
    }
}

/// `name(a: str, b: int = 5, c: list[str] = None)`: required arguments first,
/// frozen ones left out (the engine binds them).
pub fn signature(tool: &ToolSpec) -> String {
    let schema = tool.input_schema.as_ref();
    let props = schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object);
    let required: Vec<&str> = schema
        .and_then(|s| s.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut req = Vec::new();
    let mut opt = Vec::new();
    for (k, s) in props.into_iter().flatten() {
        if tool.frozen.contains_key(k) {
            continue;
        }
        if required.contains(&k.as_str()) {
            req.push(format!("{k}: {}", py_type(s)));
        } else {
            let d = s
                .get("default")
                .map(py_default)
                .unwrap_or_else(|| "None".into());
            opt.push(format!("{k}: {} = {d}", py_type(s)));
        }
    }
    req.extend(opt);
    format!("{}({})", tool.name, req.join(", "))
}

/// The most characters of a tool's description that `describe` gives.
pub const DESCRIPTION_MAX_CHARS: usize = 500;

/// A tool's description on one line (whitespace runs made one space), at most
/// `DESCRIPTION_MAX_CHARS` characters; `None` when it has none.
fn one_line(description: Option<&str>) -> Option<String> {
    let words: Vec<&str> = description?.split_whitespace().collect();
    if words.is_empty() {
        return None;
    }
    let line = words.join(" ");
    Some(if line.chars().count() > DESCRIPTION_MAX_CHARS {
        line.chars()
            .take(DESCRIPTION_MAX_CHARS - 1)
            .collect::<String>()
            + "…"
    } else {
        line
    })
}

/// `run.describe`'s `tool`: an MCP `Tool` definition of `run_script` an engine
/// hands its model as it is. Its arguments are `script.start`'s.
pub fn run_script_tool(description: &str) -> Value {
    serde_json::json!({
        "name": "run_script",
        "description": description,
        "inputSchema": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python 3 script. It imports agent_tools and prints what should come back."},
                "tools": {"type": "array", "items": {"type": "string"}, "description": "The write tools the script calls (each must be named here)."},
                "description": {"type": "string", "description": "One line on what the script does, shown when approval is asked."}
            },
            "required": ["code"],
            "additionalProperties": false
        }
    })
}

pub fn describe(snap: &Snapshot, limits: &Limits, return_max_chars: usize) -> String {
    let enabled = || snap.tools.iter().filter(|t| t.enabled);
    let reads: Vec<_> = enabled().filter(|t| t.class == ToolClass::Read).collect();
    let writes: Vec<_> = enabled()
        .filter(|t| t.class == ToolClass::Write && !snap.read_only)
        .collect();
    let direct: Vec<_> = enabled()
        .filter(|t| matches!(t.class, ToolClass::Destructive | ToolClass::LongTask))
        .collect();
    let mut d = String::new();
    d.push_str(
        "run_script: run one Python 3 script that calls this run's tools, in loops if need be. \
Only what the script prints comes back to you, so use it when a task needs many tool calls \
(tens to thousands) and print a short summary, not raw data.\n\n\
Inside the script:\n    \
    import agent_tools\n    \
    agent_tools.call(tool, args)            # structured result (dict) if the tool gives one, else its text; raises agent_tools.ToolError\n    \
    agent_tools.call_many(tool, args_list, return_errors=False)  # one call per args dict, run in parallel, results in input order\n    \
    agent_tools.call_raw(tool, args)        # {\"text\", \"structured\", \"is_error\"}; a tool's own error comes back as is_error, refusals and engine failures raise ToolError\n    \
    agent_tools.progress(done, total, message=\"\")  # report progress\n    \
    agent_tools.ToolError                   # .tool, .code (denied, invalid_arguments, limit, tool_error, revoked, engine), .message\n\
args is a dict of the tool's arguments, e.g. agent_tools.call(\"srv__get_item\", {\"id\": 7}).\n\n",
    );
    d.push_str(&format!(
        "Limits: at most {} tool calls per script ({} at a time), {} s, {} MiB of memory; the first {} characters of output come back, all of it is kept in the workspace. \
No network. The working directory is the workspace, {}; files the script writes there stay.\n",
        limits.max_calls,
        limits.max_concurrency,
        limits.timeout_s,
        limits.memory_max_bytes >> 20,
        return_max_chars,
        if snap.read_only { "read-only" } else { "read-write" },
    ));
    let about = |d: &mut String, t: &ToolSpec| {
        if let Some(line) = one_line(t.description.as_deref()) {
            d.push_str("        ");
            d.push_str(&line);
            d.push('\n');
        }
    };
    let list = |d: &mut String, tools: &[&ToolSpec]| {
        for t in tools {
            d.push_str("    ");
            d.push_str(&signature(t));
            d.push('\n');
            about(d, t);
        }
    };
    d.push_str("\nTools the script can call directly:\n");
    if reads.is_empty() {
        d.push_str("    (none)\n");
    }
    list(&mut d, &reads);
    if !writes.is_empty() {
        let how = if snap.permission_mode == PermissionMode::Approval {
            "the user approves them once before the script runs"
        } else {
            "they are allowed without asking"
        };
        d.push_str(&format!(
            "\nWrite tools: the script may call these only if you name them in run_script's `tools` argument ({how}):\n"
        ));
        list(&mut d, &writes);
    }
    if !direct.is_empty() {
        d.push_str("\nNever callable from a script; call these directly as tools:\n");
        for t in &direct {
            let why = if t.class == ToolClass::Destructive {
                "destructive, confirmed one call at a time"
            } else {
                "runs as a long task"
            };
            d.push_str(&format!("    {} ({why})\n", t.name));
            about(&mut d, t);
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scripts;
    use crate::protocol::snapshot::parse_snapshot;
    use serde_json::json;

    fn snap(read_only: bool) -> Snapshot {
        parse_snapshot(json!({"workspace": "/w", "permission_mode": "approval", "read_only": read_only, "tools": [
            {"name": "fs__read_file", "class": "read", "description": "Read a file.\n  Give its path\tbelow the workspace.", "input_schema": {"type": "object",
                "properties": {"path": {"type": "string"}, "head": {"type": "number"}, "mode": {"enum": ["a", "b"], "default": "a"}},
                "required": ["path"]}},
            {"name": "fs__mkdir", "class": "write", "input_schema": {"type": "object",
                "properties": {"path": {"type": "string"}, "tenant": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}},
             "frozen": {"tenant": "acme"}},
            {"name": "fs__write_file", "class": "destructive", "description": "Overwrite a file."},
            {"name": "x__research", "class": "long_task"},
            {"name": "x__off", "class": "read", "enabled": false}
        ]}))
        .unwrap()
    }

    #[test]
    fn signatures_from_schemas() {
        let s = snap(false);
        assert_eq!(
            signature(&s.tools[0]),
            "fs__read_file(path: str, head: float = None, mode: Literal['a', 'b'] = 'a')"
        );
        assert_eq!(
            signature(&s.tools[1]),
            "fs__mkdir(path: str = None, tags: list[str] = None)",
            "frozen args are bound"
        );
    }

    #[test]
    fn description_lists_what_is_callable_and_how() {
        let l = Limits::effective(&Scripts::default(), &Default::default());
        let d = describe(&snap(false), &l, 20000);
        assert!(d.contains("agent_tools.call_many(tool, args_list, return_errors=False)"));
        assert!(d.contains("at most 2000 tool calls per script (4 at a time), 1800 s, 1024 MiB"));
        assert!(d.contains("Tools the script can call directly:\n    fs__read_file(path: str"));
        assert!(
            d.contains("name them in run_script's `tools` argument (the user approves them once")
        );
        assert!(d.contains("    fs__mkdir(path: str = None"));
        assert!(d.contains("    fs__write_file (destructive, confirmed one call at a time)\n        Overwrite a file.\n    x__research (runs as a long task)"));
        assert!(!d.contains("x__off"));
        assert!(
            d.contains("mode: Literal['a', 'b'] = 'a')\n        Read a file. Give its path below the workspace.\n"),
            "a description on one line under its signature"
        );
        assert!(
            d.contains("(destructive, confirmed one call at a time)\n        Overwrite a file.\n")
        );
        let ro = describe(&snap(true), &l, 20000);
        assert!(!ro.contains("fs__mkdir") && ro.contains("read-only"));
    }

    #[test]
    fn long_descriptions_are_clipped_and_empty_ones_left_out() {
        let long = "word ".repeat(400);
        let line = one_line(Some(&long)).unwrap();
        assert_eq!(line.chars().count(), DESCRIPTION_MAX_CHARS);
        assert!(line.ends_with('…'));
        assert_eq!(one_line(Some(" \n\t")), None);
        assert_eq!(one_line(None), None);
    }

    #[test]
    fn the_run_script_tool_is_an_mcp_tool_of_script_start_arguments() {
        let t = run_script_tool("the text");
        assert_eq!(t["name"], "run_script");
        assert_eq!(t["description"], "the text");
        let props = t["inputSchema"]["properties"].as_object().unwrap();
        assert_eq!(
            props.keys().collect::<Vec<_>>(),
            ["code", "description", "tools"]
        );
        assert_eq!(t["inputSchema"]["required"], serde_json::json!(["code"]));
        // Its arguments, as a model gives them, are script.start's params.
        let args = serde_json::json!({"code": "print(1)", "tools": ["a__b"], "description": "d"});
        let mut params = args.as_object().unwrap().clone();
        params.insert("token".into(), "t".into());
        serde_json::from_value::<crate::protocol::StartParams>(params.into()).unwrap();
    }

    /// The description is what the model reads: any change to it is reviewed as a
    /// diff of `tests/fixtures/describe*.txt`.
    #[test]
    fn description_matches_the_golden_files() {
        let l = Limits::effective(&Scripts::default(), &Default::default());
        crate::golden::check("describe.txt", &describe(&snap(false), &l, 20000));
        crate::golden::check("describe-read-only.txt", &describe(&snap(true), &l, 20000));
    }
}
