//! The `run_script` tool description a model is given for one snapshot: how to use
//! `agent_tools`, the limits, and which tools it may call, as Python-style
//! signatures taken from their JSON schemas. Pure.

use crate::policy::admit::LeftOut;
use crate::policy::Limits;
use crate::protocol::snapshot::{PermissionMode, Snapshot, ToolClass, ToolSpec};
use crate::text::escape;
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

/// Python's keywords: a name part spelled as one gets a `_` after it.
const PY_KEYWORDS: [&str; 35] = [
    "False", "None", "True", "and", "as", "assert", "async", "await", "break", "class", "continue",
    "def", "del", "elif", "else", "except", "finally", "for", "from", "global", "if", "import",
    "in", "is", "lambda", "nonlocal", "not", "or", "pass", "raise", "return", "try", "while",
    "with", "yield",
];

/// The Python spelling of one part of a name (a server, a tool, an argument):
/// every character other than an ASCII letter, digit or `_` becomes `_`; a
/// leading digit gets a `_` before it; a Python keyword or a dunder (`__x__`)
/// gets a `_` after it. A part that is already a plain identifier stays as it is.
pub fn py_name(part: &str) -> String {
    let mut s: String = part
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.is_empty() || s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    if PY_KEYWORDS.contains(&s.as_str())
        || (s.len() > 4 && s.starts_with("__") && s.ends_with("__"))
    {
        s.push('_');
    }
    s
}

/// Distinct spellings for distinct `parts` (each with a rank that orders equal
/// names: a server's namespace before a tool), in input order. A part that is
/// its own spelling is served first; then the others, by name; a spelling
/// already taken gets `_2`, `_3`, … (the first that is free).
fn spell_all(parts: &[(&str, u8)]) -> Vec<String> {
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&i| (py_name(parts[i].0) != parts[i].0, parts[i].0, parts[i].1));
    let mut taken = std::collections::HashSet::new();
    let mut out = vec![String::new(); parts.len()];
    for i in order {
        let base = py_name(parts[i].0);
        let mut name = base.clone();
        let mut n = 1;
        while !taken.insert(name.clone()) {
            n += 1;
            name = format!("{base}_{n}");
        }
        out[i] = name;
    }
    out
}

/// A tool's server and its own name: split at the first `__` when both sides
/// are non-empty; otherwise no server.
fn split_name(name: &str) -> (Option<&str>, &str) {
    match name.split_once("__") {
        Some((server, tool)) if !server.is_empty() && !tool.is_empty() => (Some(server), tool),
        _ => (None, name),
    }
}

/// Where each tool a script can call (enabled `read` and `write` tools, in a
/// read-only run too, so that the spellings do not depend on it) sits under
/// `agent_tools.tools`: `["fleet", "get_device_status"]` for
/// `fleet__get_device_status`, `["ping"]` for a tool without a server. Servers
/// and tools without one share `tools`' attributes; each server's tools its own.
pub fn typed_paths(tools: &[ToolSpec]) -> std::collections::HashMap<String, Vec<String>> {
    let names: Vec<&str> = tools
        .iter()
        .filter(|t| t.script_callable())
        .map(|t| t.name.as_str())
        .collect();
    let mut top: Vec<(&str, u8)> = Vec::new();
    let mut servers: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for n in &names {
        match split_name(n) {
            (Some(server), tool) => {
                if !servers.contains_key(server) {
                    top.push((server, 0));
                }
                servers.entry(server).or_default().push(tool);
            }
            (None, tool) => top.push((tool, 1)),
        }
    }
    let top_names = spell_all(&top);
    let spelt = |part: &str, rank: u8| {
        let i = top.iter().position(|&p| p == (part, rank)).unwrap_or(0);
        top_names[i].clone()
    };
    let mut paths = std::collections::HashMap::new();
    for (server, tools) in &servers {
        let parts: Vec<(&str, u8)> = tools.iter().map(|t| (*t, 1)).collect();
        for (tool, name) in tools.iter().zip(spell_all(&parts)) {
            paths.insert(format!("{server}__{tool}"), vec![spelt(server, 0), name]);
        }
    }
    for n in names {
        if let (None, tool) = split_name(n) {
            paths.insert(n.to_string(), vec![spelt(tool, 1)]);
        }
    }
    paths
}

/// One keyword argument of a tool's typed function.
struct Param<'a> {
    key: &'a str,
    name: String,
    schema: &'a Value,
    required: bool,
}

/// A tool's keyword arguments: its schema's top-level properties, frozen ones
/// left out, required ones first, each spelled by `py_name` (distinct).
fn params(tool: &ToolSpec) -> Vec<Param<'_>> {
    let schema = tool.input_schema.as_ref();
    let required: Vec<&str> = schema
        .and_then(|s| s.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut props: Vec<(&str, &Value)> = schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter(|(k, _)| !tool.frozen.contains_key(*k))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    props.sort_by_key(|(k, _)| !required.contains(k));
    let parts: Vec<(&str, u8)> = props.iter().map(|(k, _)| (*k, 0)).collect();
    props
        .into_iter()
        .zip(spell_all(&parts))
        .map(|((key, schema), name)| Param {
            key,
            name,
            schema,
            required: required.contains(&key),
        })
        .collect()
}

/// Does the schema take keys beyond its `properties` at the top level (or say
/// what it takes in a way the typed API does not read)? Then the typed function
/// passes other keywords on, and the daemon's check is the only one.
fn takes_more(schema: Option<&Value>) -> bool {
    let Some(Value::Object(m)) = schema else {
        return schema.is_some();
    };
    let open = |k: &str| m.get(k).is_some_and(|v| v != &Value::Bool(false));
    open("additionalProperties")
        || open("unevaluatedProperties")
        || [
            "patternProperties",
            "allOf",
            "anyOf",
            "oneOf",
            "$ref",
            "$dynamicRef",
            "if",
            "dependentSchemas",
        ]
        .iter()
        .any(|k| m.contains_key(*k))
}

/// `tools.fleet.get_device_status(sn: str, n: int = 5)`: the typed function's
/// signature (Python spellings; required arguments first; frozen ones left out).
pub fn typed_signature(tool: &ToolSpec, path: &[String]) -> String {
    let mut args: Vec<String> = params(tool)
        .iter()
        .map(|p| {
            let t = py_type(p.schema);
            if p.required {
                format!("{}: {t}", p.name)
            } else {
                let d = p
                    .schema
                    .get("default")
                    .map(py_default)
                    .unwrap_or_else(|| "None".into());
                format!("{}: {t} = {d}", p.name)
            }
        })
        .collect();
    if takes_more(tool.input_schema.as_ref()) {
        args.push("**more".into());
    }
    format!("tools.{}({})", path.join("."), args.join(", "))
}

/// What the script's `tools` is built from (the fd-3 `tools` request): each
/// tool a script can call, with its typed path, class, description, keyword
/// arguments (`key` as the tool takes it, `name` as Python spells it, its
/// schema) and whether it takes more keys than those.
pub fn script_tools(tools: &[ToolSpec]) -> Value {
    let paths = typed_paths(tools);
    let tools: Vec<Value> = tools
        .iter()
        .filter(|t| t.script_callable())
        .map(|t| {
            let params: Vec<Value> = params(t)
                .into_iter()
                .map(|p| {
                    serde_json::json!({"key": p.key, "name": p.name, "required": p.required, "schema": p.schema})
                })
                .collect();
            serde_json::json!({
                "name": t.name,
                "path": paths.get(&t.name),
                "class": t.class.as_str(),
                "description": t.description,
                "params": params,
                "more": takes_more(t.input_schema.as_ref()),
            })
        })
        .collect();
    Value::Array(tools)
}

/// The most characters of a tool's description that `describe` gives.
pub const DESCRIPTION_MAX_CHARS: usize = 500;

/// A tool's description on one line (whitespace runs made one space, control
/// and reordering characters escaped: an upstream server wrote it, and a model
/// and a person read it), at most `DESCRIPTION_MAX_CHARS` characters; `None`
/// when it has none.
fn one_line(description: Option<&str>) -> Option<String> {
    let words: Vec<&str> = description?.split_whitespace().collect();
    if words.is_empty() {
        return None;
    }
    let line = crate::text::escape(&words.join(" ")).into_owned();
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

/// What the `describe` text says of the tools a script can never call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeverCallable {
    /// The engine offers them to the model as tools of their own (a gateway).
    OfferedDirectly,
    /// Nothing offers them (`scriptgate mcp`): they are named so the model knows.
    NotOffered,
}

pub fn describe(snap: &Snapshot, limits: &Limits, return_max_chars: usize) -> String {
    describe_for(
        snap,
        limits,
        return_max_chars,
        NeverCallable::OfferedDirectly,
        &LeftOut::default(),
    )
}

/// How a script calls the tools: the text that opens every description.
const HOW_TO_CALL: &str = "run_script: run one Python 3 script that calls this run's tools, in loops if need be. \
Only what the script prints comes back to you, so use it when a task needs many tool calls \
(tens to thousands) and print a short summary, not raw data.\n\n\
Inside the script, each tool is a function of its arguments, by keyword (its signature below):\n    \
    from agent_tools import tools, ToolError\n    \
    tools.srv.get_item(id=7)                # structured result (dict) if the tool gives one, else its text; raises ToolError\n    \
    tools.srv.get_item.many([{\"id\": 7}, {\"id\": 8}], return_errors=False)  # one call per args dict, run in parallel, results in input order\n    \
    tools.srv.get_item.raw(id=7)            # {\"text\", \"structured\", \"is_error\"}; a tool's own error comes back as is_error, refusals and engine failures raise ToolError\n    \
    help(tools.srv.get_item)                # its description and arguments; dir(tools), dir(tools.srv) list them\n\
An unknown or missing argument raises ToolError invalid_arguments before anything is sent. \
Tool srv__get_item is tools.srv.get_item (one without a server__ prefix is on tools itself); \
names that are not Python identifiers are spelled as the signatures below show.\n\
The same calls by the tool's full name, args a dict:\n    \
    import agent_tools\n    \
    agent_tools.call(tool, args)            # e.g. agent_tools.call(\"srv__get_item\", {\"id\": 7})\n    \
    agent_tools.call_many(tool, args_list, return_errors=False)\n    \
    agent_tools.call_raw(tool, args)\n    \
    agent_tools.progress(done, total, message=\"\")  # report progress\n    \
    agent_tools.ToolError                   # .tool, .code (denied, invalid_arguments, limit, tool_error, revoked, expired, engine), .message\n\n";

/// The description for `snap`'s tools; `left_out` are the tools an MCP
/// server listed that are not offered at all (`policy::admit`), named last
/// with why. Tool names are shown escaped, as descriptions are.
pub fn describe_for(
    snap: &Snapshot,
    limits: &Limits,
    return_max_chars: usize,
    never: NeverCallable,
    left_out: &LeftOut,
) -> String {
    let enabled = || snap.tools.iter().filter(|t| t.enabled);
    let reads: Vec<_> = enabled().filter(|t| t.class == ToolClass::Read).collect();
    let writes: Vec<_> = enabled()
        .filter(|t| t.class == ToolClass::Write && !snap.read_only)
        .collect();
    let direct: Vec<_> = enabled()
        .filter(|t| matches!(t.class, ToolClass::Destructive | ToolClass::LongTask))
        .collect();
    let paths = typed_paths(&snap.tools);
    let mut d = String::from(HOW_TO_CALL);
    d.push_str(&limits_line(snap, limits, return_max_chars));
    d.push_str("\nTools the script can call directly:\n");
    if reads.is_empty() {
        d.push_str("    (none)\n");
    }
    list_callable(&mut d, &reads, &paths);
    if !writes.is_empty() {
        let how = if snap.permission_mode == PermissionMode::Approval {
            "the user approves them once before the script runs"
        } else {
            "they are allowed without asking"
        };
        d.push_str(&format!(
            "\nWrite tools: the script may call these only if you name them in run_script's `tools` argument ({how}):\n"
        ));
        list_callable(&mut d, &writes, &paths);
    }
    if !direct.is_empty() {
        list_never_callable(&mut d, &direct, never);
    }
    if !left_out.is_empty() {
        list_left_out(&mut d, left_out);
    }
    d
}

/// The limits a script runs under, and where it runs, as one paragraph.
fn limits_line(snap: &Snapshot, limits: &Limits, return_max_chars: usize) -> String {
    format!(
        "Limits: at most {} tool calls per script ({} at a time), {} s, {} MiB of memory; the first {} characters of output come back, all of it is kept in the workspace. \
No network. The working directory is the workspace, {}; files the script writes there stay.\n",
        limits.max_calls,
        limits.max_concurrency,
        limits.timeout_s,
        limits.memory_max_bytes >> 20,
        return_max_chars,
        if snap.read_only { "read-only" } else { "read-write" },
    )
}

/// A tool's description on the lines under its name, indented, if it has one.
fn about(d: &mut String, t: &ToolSpec) {
    if let Some(line) = one_line(t.description.as_deref()) {
        d.push_str("        ");
        d.push_str(&line);
        d.push('\n');
    }
}

/// Tools a script may call: each one's signature (typed where it has a path in
/// `paths`), its name, and its description.
fn list_callable(
    d: &mut String,
    tools: &[&ToolSpec],
    paths: &std::collections::HashMap<String, Vec<String>>,
) {
    for t in tools {
        let sig = match paths.get(&t.name) {
            Some(path) => typed_signature(t, path),
            None => signature(t),
        };
        d.push_str(&format!("    {}  # {}\n", escape(&sig), escape(&t.name)));
        about(d, t);
    }
}

/// The destructive and long-task tools, which no script may call, with why.
fn list_never_callable(d: &mut String, direct: &[&ToolSpec], never: NeverCallable) {
    d.push_str(match never {
        NeverCallable::OfferedDirectly => {
            "\nNever callable from a script; call these directly as tools:\n"
        }
        NeverCallable::NotOffered => {
            "\nNever callable from a script, and not offered here (ask the user to use them another way):\n"
        }
    });
    for t in direct {
        let why = if t.class == ToolClass::Destructive {
            "destructive, confirmed one call at a time"
        } else {
            "runs as a long task"
        };
        d.push_str(&format!("    {} ({why})\n", escape(&t.name)));
        about(d, t);
    }
}

/// The tools an MCP server listed that are not offered at all, with why.
fn list_left_out(d: &mut String, left_out: &LeftOut) {
    d.push_str(
        "\nNot offered at all, and not callable from a script (what their server lists of them cannot be used):\n",
    );
    for (name, why) in &left_out.named {
        d.push_str(&format!("    {} ({why})\n", escape(name)));
    }
    if left_out.more > 0 {
        d.push_str(&format!("    and {} more\n", left_out.more));
    }
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
    fn python_types_and_defaults_of_schemas() {
        let t = |s: Value| py_type(&s);
        assert_eq!(t(json!({"type": "string"})), "str");
        assert_eq!(t(json!({"type": "integer"})), "int");
        assert_eq!(t(json!({"type": "number"})), "float");
        assert_eq!(t(json!({"type": "boolean"})), "bool");
        assert_eq!(t(json!({"type": "object"})), "dict");
        assert_eq!(t(json!({"type": "null"})), "None");
        assert_eq!(t(json!({"type": "array"})), "list");
        assert_eq!(
            t(json!({"type": "array", "items": {"type": "integer"}})),
            "list[int]"
        );
        assert_eq!(t(json!({"type": "array", "items": {}})), "list[Any]");
        assert_eq!(t(json!({"type": "tuple"})), "Any");
        assert_eq!(t(json!({})), "Any");
        // A list of types is a union, each spelled alone.
        assert_eq!(
            t(json!({"type": ["array", "object", "null"]})),
            "list | dict | None"
        );
        assert_eq!(
            t(
                json!({"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})
            ),
            "str | list[str]"
        );
        assert_eq!(
            t(json!({"oneOf": [{"type": "boolean"}, {"enum": [1]}]})),
            "bool | Literal[1]"
        );
        // An enum: its first six values.
        assert_eq!(
            t(json!({"enum": ["a", 2, "c", "d", "e", "f", "g"]})),
            "Literal['a', 2, 'c', 'd', 'e', 'f']"
        );
        let d = |v: Value| py_default(&v);
        assert_eq!(
            [
                json!(null),
                json!(true),
                json!(false),
                json!("x y"),
                json!(2.5)
            ]
            .map(d),
            ["None", "True", "False", "'x y'", "2.5"]
        );
    }

    #[test]
    fn a_schema_takes_more_than_its_properties_when_open_or_unread() {
        let more = |s: Value| takes_more(Some(&s));
        assert!(!takes_more(None));
        assert!(takes_more(Some(&json!(true))), "a schema that is no object");
        assert!(!more(json!({"type": "object", "properties": {"a": {}}})));
        assert!(!more(
            json!({"additionalProperties": false, "unevaluatedProperties": false})
        ));
        for open in [json!(true), json!({"type": "string"})] {
            assert!(more(json!({"additionalProperties": open})));
            assert!(more(json!({"unevaluatedProperties": open})));
        }
        for k in [
            "patternProperties",
            "allOf",
            "anyOf",
            "oneOf",
            "$ref",
            "$dynamicRef",
            "if",
            "dependentSchemas",
        ] {
            let mut s = json!({"additionalProperties": false});
            s[k] = json!({});
            assert!(more(s), "{k}");
        }
    }

    #[test]
    fn description_lists_what_is_callable_and_how() {
        let l = Limits::effective(&Scripts::default(), &Default::default());
        let d = describe(&snap(false), &l, 20000);
        assert!(d.contains("agent_tools.call_many(tool, args_list, return_errors=False)"));
        assert!(d.contains("at most 2000 tool calls per script (4 at a time), 1800 s, 1024 MiB"));
        assert!(d.contains("Tools the script can call directly:\n    tools.fs.read_file(path: str"));
        assert!(
            d.find("tools.srv.get_item(id=7)") < d.find("agent_tools.call(tool, args)"),
            "the typed API first"
        );
        assert!(
            d.contains("name them in run_script's `tools` argument (the user approves them once")
        );
        assert!(d.contains(
            "    tools.fs.mkdir(path: str = None, tags: list[str] = None)  # fs__mkdir\n"
        ));
        assert!(d.contains("    fs__write_file (destructive, confirmed one call at a time)\n        Overwrite a file.\n    x__research (runs as a long task)"));
        assert!(!d.contains("x__off"));
        assert!(
            d.contains("mode: Literal['a', 'b'] = 'a')  # fs__read_file\n        Read a file. Give its path below the workspace.\n"),
            "a description on one line under its signature"
        );
        assert!(
            d.contains("(destructive, confirmed one call at a time)\n        Overwrite a file.\n")
        );
        let ro = describe(&snap(true), &l, 20000);
        assert!(!ro.contains("fs__mkdir") && ro.contains("read-only"));
    }

    #[test]
    fn a_description_shows_hidden_characters_escaped() {
        assert_eq!(
            one_line(Some("read\u{202e}eliF a\x1b[2J \u{200b}x")).as_deref(),
            Some("read\\u202eeliF a\\x1b[2J \\u200bx")
        );
    }

    #[test]
    fn long_descriptions_are_clipped_and_empty_ones_left_out() {
        let long = "word ".repeat(400);
        let line = one_line(Some(&long)).unwrap();
        assert_eq!(line.chars().count(), DESCRIPTION_MAX_CHARS);
        assert!(line.ends_with('…'));
        assert_eq!(one_line(Some(" \n\t")), None);
        assert_eq!(one_line(None), None);
        // One of DESCRIPTION_MAX_CHARS is whole.
        let full = "x".repeat(DESCRIPTION_MAX_CHARS);
        assert_eq!(one_line(Some(&full)).as_ref(), Some(&full));
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

    fn tool(name: &str) -> Value {
        json!({"name": name, "class": "read", "input_schema": {"type": "object"}})
    }

    fn paths(tools: Vec<Value>) -> Vec<(String, String)> {
        let s =
            parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto", "tools": tools}))
                .unwrap();
        let p = typed_paths(&s.tools);
        let mut v: Vec<(String, String)> = p.into_iter().map(|(k, v)| (k, v.join("."))).collect();
        v.sort();
        v
    }

    #[test]
    fn python_spellings_of_name_parts() {
        for (given, spelt) in [
            ("get_device_status", "get_device_status"),
            ("get-device.status", "get_device_status"),
            ("2fa", "_2fa"),
            ("class", "class_"),
            ("None", "None_"),
            ("match", "match"),
            ("__init__", "__init___"),
            ("__a__", "__a___"),
            // No name between the underscores: no dunder.
            ("____", "____"),
            ("--", "__"),
            ("_private", "_private"),
            ("über", "_ber"),
            ("-", "_"),
        ] {
            assert_eq!(py_name(given), spelt, "{given}");
        }
    }

    #[test]
    fn typed_paths_split_servers_and_resolve_collisions() {
        let p = paths(vec![
            tool("fleet__get_device_status"),
            tool("fleet__get-device-status"),
            tool("fleet__get_device_status_2"),
            tool("my-srv__list"),
            tool("my_srv__list"),
            tool("ping"),
            tool("fleet"),
            tool("__odd"),
            tool("srv__"),
            tool("a____b"),
            tool("3d__class"),
            json!({"name": "fleet__wipe", "class": "destructive"}),
            json!({"name": "fleet__off", "class": "read", "enabled": false, "input_schema": {}}),
        ]);
        let want: Vec<(String, String)> = [
            ("3d__class", "_3d.class_"),
            ("__odd", "__odd"),
            ("a____b", "a.__b"),
            // A spelling that is the name itself comes first; the others by name.
            ("fleet", "fleet_2"),
            ("fleet__get-device-status", "fleet.get_device_status_3"),
            ("fleet__get_device_status", "fleet.get_device_status"),
            ("fleet__get_device_status_2", "fleet.get_device_status_2"),
            ("my-srv__list", "my_srv_2.list"),
            ("my_srv__list", "my_srv.list"),
            ("ping", "ping"),
            ("srv__", "srv__"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        assert_eq!(p, want, "destructive and disabled tools have no typed path");
    }

    #[test]
    fn typed_signatures_and_what_the_script_is_given() {
        let s = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto", "tools": [
            {"name": "x__f", "class": "write", "description": "F.", "frozen": {"tenant": "t"},
             "input_schema": {"type": "object", "required": ["max-n", "id"], "properties": {
                "id": {"type": "integer"}, "max-n": {"type": ["integer", "null"]}, "class": {"type": "boolean", "default": false},
                "max_n": {"type": "string"}, "tenant": {"type": "string"}}}},
            {"name": "x__free", "class": "read", "input_schema": {"type": "object", "additionalProperties": true, "properties": {"q": {"type": "string"}}}},
            {"name": "x__closed", "class": "read", "input_schema": {"type": "object", "additionalProperties": false}}
        ]})).unwrap();
        let p = typed_paths(&s.tools);
        assert_eq!(
            typed_signature(&s.tools[0], &p["x__f"]),
            "tools.x.f(id: int, max_n_2: int | None, class_: bool = False, max_n: str = None)"
        );
        assert_eq!(
            typed_signature(&s.tools[1], &p["x__free"]),
            "tools.x.free(q: str = None, **more)"
        );
        assert_eq!(
            typed_signature(&s.tools[2], &p["x__closed"]),
            "tools.x.closed()"
        );
        let listing = script_tools(&s.tools);
        assert_eq!(
            listing[0],
            json!({"name": "x__f", "path": ["x", "f"], "class": "write", "description": "F.", "more": false, "params": [
                {"key": "id", "name": "id", "required": true, "schema": {"type": "integer"}},
                {"key": "max-n", "name": "max_n_2", "required": true, "schema": {"type": ["integer", "null"]}},
                {"key": "class", "name": "class_", "required": false, "schema": {"type": "boolean", "default": false}},
                {"key": "max_n", "name": "max_n", "required": false, "schema": {"type": "string"}}]}),
            "frozen arguments are not the script's"
        );
        assert_eq!(
            (listing[1]["more"].clone(), listing[2]["more"].clone()),
            (json!(true), json!(false))
        );
    }

    #[test]
    fn the_tool_error_codes_named_are_those_a_script_can_be_given() {
        let d = describe(
            &snap(false),
            &Limits::effective(&Scripts::default(), &Default::default()),
            100,
        );
        let listed = d
            .split_once(".code (")
            .and_then(|(_, rest)| rest.split_once(')'))
            .map(|(codes, _)| codes.split(", ").collect::<Vec<_>>())
            .expect("the ToolError line names its codes");
        // Every code but invalid_request, which only a malformed request line
        // (never agent_tools') is given; in the man page's order.
        let codes: Vec<&str> = crate::protocol::script::ToolErrorCode::ALL
            .iter()
            .filter(|c| **c != crate::protocol::script::ToolErrorCode::InvalidRequest)
            .map(|c| c.as_str())
            .collect();
        assert_eq!(listed, codes);
        assert!(listed.contains(&"expired"));
    }

    fn left_out() -> LeftOut {
        LeftOut {
            named: vec![
                (
                    "fs__bad name".into(),
                    "its name has white space in it".into(),
                ),
                (
                    "fs__x\u{202e}y".into(),
                    "its name has a control, invisible or reordering character (\\u202e)".into(),
                ),
                (
                    "fs__big".into(),
                    "its input schema is 1024 KiB; at most 256 KiB is taken".into(),
                ),
            ],
            more: 2,
        }
    }

    /// The description is what the model reads: any change to it is reviewed as a
    /// diff of `tests/fixtures/describe*.txt`.
    #[test]
    fn description_matches_the_golden_files() {
        let l = Limits::effective(&Scripts::default(), &Default::default());
        crate::golden::check("describe.txt", &describe(&snap(false), &l, 20000));
        crate::golden::check("describe-read-only.txt", &describe(&snap(true), &l, 20000));
        // `scriptgate mcp`'s, whose servers listed tools it cannot offer.
        let not_offered = describe_for(
            &snap(false),
            &l,
            20000,
            NeverCallable::NotOffered,
            &left_out(),
        );
        crate::golden::check("describe-not-offered.txt", &not_offered);
    }

    #[test]
    fn tools_left_out_are_named_last_escaped_with_why() {
        let l = Limits::effective(&Scripts::default(), &Default::default());
        let d = describe_for(
            &snap(false),
            &l,
            20000,
            NeverCallable::OfferedDirectly,
            &left_out(),
        );
        let tail = d
            .split_once("\nNot offered at all")
            .map(|(_, t)| t)
            .unwrap();
        assert_eq!(
            tail,
            ", and not callable from a script (what their server lists of them cannot be used):\n    \
             fs__bad name (its name has white space in it)\n    \
             fs__x\\u202ey (its name has a control, invisible or reordering character (\\u202e))\n    \
             fs__big (its input schema is 1024 KiB; at most 256 KiB is taken)\n    \
             and 2 more\n"
        );
        assert!(!d.contains('\u{202e}'));
        let none = describe(&snap(false), &l, 20000);
        assert!(!none.contains("Not offered at all"));
        // Only named ones: no "and 0 more".
        let named = LeftOut {
            more: 0,
            ..left_out()
        };
        let d = describe_for(
            &snap(false),
            &l,
            20000,
            NeverCallable::OfferedDirectly,
            &named,
        );
        assert!(
            d.ends_with("(its input schema is 1024 KiB; at most 256 KiB is taken)\n"),
            "{d}"
        );
    }

    /// A name a snapshot takes may still hide or reorder text (an engine's
    /// snapshot is not held to the CLI's rules): it is shown escaped.
    #[test]
    fn tool_names_are_shown_escaped() {
        let s = parse_snapshot(
            json!({"workspace": "/w", "permission_mode": "auto", "tools": [
            {"name": "a__r\u{202e}x", "class": "read", "input_schema": {"type": "object"}},
            {"name": "a__w\u{200b}y", "class": "destructive"}]}),
        )
        .unwrap();
        let l = Limits::effective(&Scripts::default(), &Default::default());
        let d = describe(&s, &l, 20000);
        assert!(d.contains("  # a__r\\u202ex\n"), "{d}");
        assert!(d.contains("    a__w\\u200by (destructive"), "{d}");
        assert!(!d.contains('\u{202e}') && !d.contains('\u{200b}'));
    }
}
