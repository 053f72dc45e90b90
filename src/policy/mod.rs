//! Pure policy decisions (protocol §3): what a run may start with and what each call
//! from a script may do. No I/O, no syscalls, no clocks: callers pass everything in.

pub(crate) mod admit;
pub(crate) mod auth;
pub(crate) mod describe;
pub(crate) mod runs;

use crate::config::Scripts;
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::script::ToolErrorCode;
use crate::protocol::snapshot::{
    missing_schema_error, PermissionMode, Snapshot, SnapshotLimits, ToolClass, ToolSpec,
};
use jsonschema::error::ValidationErrorKind;
use serde_json::{Map, Value};
use std::collections::{BTreeSet, HashMap, HashSet};

/// The limits a script runs under: the daemon's, tightened by the snapshot's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub max_calls: u64,
    pub max_concurrency: usize,
    pub timeout_s: u64,
    pub memory_max_bytes: u64,
    pub tasks_max: u64,
}

impl Limits {
    /// Each snapshot value may only tighten; a looser one is ignored (the daemon's
    /// value stands), so a token can never buy more than the sysadmin configured.
    pub fn effective(cfg: &Scripts, snap: &SnapshotLimits) -> Limits {
        fn tighter<T: Ord + Copy>(base: T, asked: Option<T>) -> T {
            asked.map_or(base, |a| a.min(base))
        }
        Limits {
            max_calls: tighter(cfg.max_calls, snap.max_calls),
            max_concurrency: tighter(cfg.max_concurrency, snap.max_concurrency).max(1),
            timeout_s: tighter(cfg.timeout_s, snap.timeout_s).max(1),
            memory_max_bytes: tighter(cfg.memory_max_bytes, snap.memory_max_bytes),
            tasks_max: tighter(cfg.tasks_max, snap.tasks_max).max(1),
        }
    }
}

/// What `script.start` will do once the plan is accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartPlan {
    /// Ask the engine once before the script starts.
    pub needs_approval: bool,
    /// The declared write tools, as `(name, class)`.
    pub declared: Vec<(String, ToolClass)>,
}

/// Why a call from a script is refused before it reaches the engine (the call
/// table, the closed schema, the budget here; revocation, expiry and altered
/// numbers in the broker): the script's `ToolError(code, message)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallRefusal {
    pub code: ToolErrorCode,
    pub message: String,
}

impl CallRefusal {
    pub fn new(code: ToolErrorCode, message: String) -> Self {
        CallRefusal { code, message }
    }
    fn denied(message: String) -> Self {
        CallRefusal::new(ToolErrorCode::Denied, message)
    }
    fn invalid(message: String) -> Self {
        CallRefusal::new(ToolErrorCode::InvalidArguments, message)
    }
}

struct Tool {
    class: ToolClass,
    enabled: bool,
    frozen: Map<String, Value>,
    /// The closed copy of `input_schema`, compiled; `None` only for tools a script
    /// can never call (destructive, long_task, disabled) that came without one.
    schema: Option<jsonschema::Validator>,
    /// The top-level arguments the schema declares, frozen ones left out; named in
    /// the refusal of an undeclared argument.
    arguments: BTreeSet<String>,
}

/// The compiled policy of one script.
pub struct Policy {
    tools: HashMap<String, Tool>,
    declared: BTreeSet<String>,
    read_only: bool,
    /// The snapshot's tools a script can call, for its typed API
    /// (the listing the script's `tools` request is answered with).
    callable_specs: Vec<ToolSpec>,
}

fn tools_error(tool: &str, reason: Reason, message: String) -> Refused {
    Refused::new(reason, message).tool(tool)
}

impl Policy {
    /// Compile the snapshot's schemas and check `script.start`'s `tools`.
    pub fn plan(snap: &Snapshot, declared: &[String]) -> Result<(Policy, StartPlan), Refused> {
        let mut tools = HashMap::new();
        for (i, t) in snap.tools.iter().enumerate() {
            tools.insert(t.name.clone(), Tool::compile(i, t)?);
        }
        let mut plan = StartPlan {
            needs_approval: false,
            declared: Vec::new(),
        };
        let mut names = BTreeSet::new();
        for name in declared {
            let Some(t) = tools.get(name) else {
                return Err(tools_error(
                    name,
                    Reason::Unknown,
                    format!("tool {name} is not in this run's snapshot"),
                ));
            };
            t.check_declarable(name, snap.read_only)?;
            if names.insert(name.clone()) {
                plan.declared.push((name.clone(), t.class));
            }
        }
        let session: BTreeSet<&String> = snap.session_allowed.iter().collect();
        plan.needs_approval = snap.permission_mode == PermissionMode::Approval
            && plan.declared.iter().any(|(n, _)| !session.contains(n));
        Ok((
            Policy {
                tools,
                declared: names,
                read_only: snap.read_only,
                callable_specs: snap
                    .tools
                    .iter()
                    .filter(|t| t.script_callable())
                    .cloned()
                    .collect(),
            },
            plan,
        ))
    }

    /// The snapshot's tools a script can call (enabled `read` and `write`
    /// tools, as the snapshot gives them), for the script's typed API.
    pub fn callable_specs(&self) -> &[ToolSpec] {
        &self.callable_specs
    }

    /// Is `tool` a tool of the snapshot (enabled or not)?
    pub fn knows(&self, tool: &str) -> bool {
        self.tools.contains_key(tool)
    }

    /// Decide one call from the script. On success returns the arguments to send to
    /// the engine: the script's, with the frozen ones merged in, schema-checked.
    pub fn check_call(&self, tool: &str, args: &Value) -> Result<Value, CallRefusal> {
        let t = self.callable(tool)?;
        let Value::Object(given) = args else {
            return Err(CallRefusal::invalid(format!(
                "{tool}: arguments must be a JSON object"
            )));
        };
        if let Some(k) = given.keys().find(|k| t.frozen.contains_key(*k)) {
            return Err(CallRefusal::invalid(format!(
                "{tool}: argument `{k}` is fixed by the run and must not be passed"
            )));
        }
        let Some(schema) = &t.schema else {
            // Not reachable through `plan`, which refuses such a snapshot.
            return Err(CallRefusal::invalid(format!(
                "{tool}: the tool has no input schema, so no arguments can be accepted"
            )));
        };
        let mut merged = given.clone();
        merged.extend(t.frozen.iter().map(|(k, v)| (k.clone(), v.clone())));
        let merged = Value::Object(merged);
        match schema_problems(schema, &merged, &t.frozen) {
            None => Ok(merged),
            Some(problems) => Err(CallRefusal::invalid(format!(
                "{tool}: {}",
                t.explain(&problems)
            ))),
        }
    }

    /// The tool, if this script may call it at all (protocol §3's table).
    fn callable(&self, tool: &str) -> Result<&Tool, CallRefusal> {
        let Some(t) = self
            .tools
            .get(tool)
            .filter(|t| t.enabled && !(self.read_only && t.class == ToolClass::Write))
        else {
            let why = match self.tools.get(tool) {
                Some(t) if !t.enabled => "it is switched off for this run",
                Some(_) => "this run is read-only, so write tools are not provided",
                None => "no tool of that name is provided to this run",
            };
            return Err(CallRefusal::denied(format!(
                "tool {tool} is not available: {why}"
            )));
        };
        match t.class {
            ToolClass::Read => Ok(t),
            ToolClass::Write if self.declared.contains(tool) => Ok(t),
            ToolClass::Write => Err(CallRefusal::denied(format!(
                "tool {tool} is a write tool that this script did not declare; \
                 add it to run_script's `tools` and run the script again"
            ))),
            ToolClass::Destructive => Err(CallRefusal::denied(format!(
                "tool {tool} is destructive and is never callable from a script; \
                 call it directly, where each call is confirmed"
            ))),
            ToolClass::LongTask => Err(CallRefusal::denied(format!(
                "tool {tool} runs as a long task and cannot be called from a script; call it directly"
            ))),
        }
    }
}

/// A tool's input schema compiled as its calls are checked: the author's
/// schema must compile as it is (so that a refusal never blames our rewrite),
/// and then its closed copy (`closed_schema`) is the one used. The CLI admits
/// an MCP tool's schema with this too, so that a schema it offers is one
/// every snapshot that lists it compiles.
pub fn compile_schema(
    s: &Value,
) -> Result<jsonschema::Validator, jsonschema::ValidationError<'static>> {
    jsonschema::draft202012::options().build(s)?;
    jsonschema::draft202012::options()
        .should_validate_formats(true)
        .build(&closed_schema(s))
}

impl Tool {
    /// Compile the `i`th tool of the snapshot.
    fn compile(i: usize, t: &ToolSpec) -> Result<Tool, Refused> {
        let (schema, arguments) = match &t.input_schema {
            Some(s) => {
                let invalid = |e: &dyn std::fmt::Display| {
                    Refused::new(
                        Reason::InvalidSchema,
                        format!(
                            "tool {}: input_schema is not a valid JSON Schema: {e}",
                            t.name
                        ),
                    )
                    .field(format!("tools[{i}].input_schema"))
                };
                let v = compile_schema(s).map_err(|e| invalid(&e))?;
                let mut args = top_level_arguments(s);
                args.retain(|a| !t.frozen.contains_key(a));
                (Some(v), args)
            }
            // parse_snapshot refuses this already; a Snapshot built in code is
            // held to the same rule.
            None if t.script_callable() => return Err(missing_schema_error(i, t)),
            None => (None, BTreeSet::new()),
        };
        Ok(Tool {
            class: t.class,
            enabled: t.enabled,
            frozen: t.frozen.clone(),
            schema,
            arguments,
        })
    }

    /// May `script.start` name this tool in `tools`? Only enabled write tools, and
    /// not in a read-only run.
    fn check_declarable(&self, name: &str, read_only: bool) -> Result<(), Refused> {
        let refuse = |reason: Reason, why: &str| {
            Err(tools_error(
                name,
                reason,
                format!("tool {name} cannot be declared: {why}"),
            ))
        };
        match self.class {
            _ if !self.enabled => refuse(Reason::Disabled, "it is switched off for this run"),
            ToolClass::Read => refuse(
                Reason::NotWrite,
                "it is a read tool; read tools need no declaration",
            ),
            ToolClass::Destructive => refuse(
                Reason::Destructive,
                "destructive tools are never callable from a script; call it directly",
            ),
            ToolClass::LongTask => refuse(
                Reason::LongTask,
                "long-running task tools are never callable from a script; call it directly",
            ),
            ToolClass::Write if read_only => refuse(Reason::ReadOnly, "this run is read-only"),
            ToolClass::Write => Ok(()),
        }
    }

    /// What is wrong with a call's arguments, for the script's `ToolError`.
    fn explain(&self, problems: &Problems) -> String {
        let mut parts = Vec::new();
        for (at, keys) in &problems.undeclared {
            let list = keys
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ");
            let (noun, verb) = if keys.len() == 1 {
                ("argument", "is")
            } else {
                ("arguments", "are")
            };
            if at.is_empty() {
                parts.push(format!(
                    "{noun} {list} {verb} not declared in the tool's schema ({})",
                    self.takes()
                ));
            } else {
                let noun = if keys.len() == 1 { "key" } else { "keys" };
                parts.push(format!(
                    "{noun} {list} at {at} {verb} not declared in the tool's schema"
                ));
            }
        }
        if let Some(other) = &problems.other {
            parts.push(format!("arguments do not match the tool's schema{other}"));
        }
        if parts.is_empty() {
            parts.push("arguments do not match the tool's schema".into());
        }
        parts.join("; ")
    }

    /// The arguments the tool takes, as a refusal names them (at most 20).
    fn takes(&self) -> String {
        if self.arguments.is_empty() {
            return "it takes no arguments".to_string();
        }
        let mut names: Vec<&str> = self.arguments.iter().map(String::as_str).collect();
        if names.len() > 20 {
            names.truncate(20);
            names.push("…");
        }
        format!("its arguments are: {}", names.join(", "))
    }
}

/// What is wrong with a call's (merged) arguments.
struct Problems {
    /// Keys the schema does not declare, by the instance location of their object
    /// (`""` for the top level), sorted.
    undeclared: Vec<(String, Vec<String>)>,
    /// The first other error, as `" at /path: message"` or `": message"`.
    other: Option<String>,
}

/// Validate: `None` when the arguments pass, else the errors sorted into undeclared
/// keys and the rest. Frozen keys count as declared at the top level, even where the
/// schema does not list them (the engine binds them; the script can never pass
/// them): the only errors that do not refuse a call are top-level undeclared-key
/// errors about frozen keys alone.
fn schema_problems(
    schema: &jsonschema::Validator,
    instance: &Value,
    frozen: &Map<String, Value>,
) -> Option<Problems> {
    let mut refused = false;
    let mut undeclared: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
    let mut others = Vec::new();
    for e in schema.iter_errors(instance) {
        let at = e.instance_path().as_str().to_string();
        let keys: Option<Vec<String>> = match e.kind() {
            ValidationErrorKind::AdditionalProperties { unexpected }
            | ValidationErrorKind::UnevaluatedProperties { unexpected } => Some(unexpected.clone()),
            // `additionalProperties: false` next to no `properties` and no
            // `patternProperties` is compiled to a validator that reports only the
            // object: every key of it is undeclared.
            ValidationErrorKind::FalseSchema
                if e.schema_path().as_str().ends_with("/additionalProperties")
                    || e.schema_path().as_str().ends_with("/unevaluatedProperties") =>
            {
                match instance.pointer(&at) {
                    Some(Value::Object(m)) => Some(m.keys().cloned().collect()),
                    _ => None,
                }
            }
            _ => None,
        };
        match keys {
            Some(keys) => {
                let top = at.is_empty();
                let keys: Vec<String> = keys
                    .into_iter()
                    .filter(|k| !(top && frozen.contains_key(k)))
                    .collect();
                refused |= !keys.is_empty();
                undeclared.entry(at).or_default().extend(keys);
            }
            None => {
                refused = true;
                others.push((at, e.to_string()));
            }
        }
    }
    if !refused {
        return None;
    }
    // A declared key whose value is invalid is not "evaluated" either, so the
    // unevaluatedProperties error names it too: it is reported by its own error (at
    // its value, or deeper).
    let located: Vec<String> = others
        .iter()
        .map(|(at, _)| at.clone())
        .chain(undeclared.keys().cloned())
        .collect();
    let undeclared = undeclared
        .iter()
        .map(|(at, keys)| {
            let keys: Vec<String> = keys
                .iter()
                .filter(|k| {
                    let below = format!("{at}/{}", escape_pointer(k));
                    !located
                        .iter()
                        .any(|o| *o == below || o.starts_with(&format!("{below}/")))
                })
                .cloned()
                .collect();
            (at.clone(), keys)
        })
        .filter(|(_, keys)| !keys.is_empty())
        .collect();
    let other = others.into_iter().next().map(|(at, msg)| {
        if at.is_empty() {
            format!(": {msg}")
        } else {
            format!(" at {at}: {msg}")
        }
    });
    Some(Problems { undeclared, other })
}

// ---------------------------------------------------------------------------------
// Closed schemas.
//
// The permission design's failure rule: a call whose arguments hold a key outside
// the tool's schema is refused. JSON Schema is open by default (an object may carry
// any key it does not mention), so the daemon validates against a rewritten copy of
// each schema (the snapshot itself is never changed) in which every object schema
// that says nothing about extra keys gets `unevaluatedProperties: false`:
//
// - the top-level schema, always (the arguments object);
// - every nested schema that applies to a new instance location (a value of
//   `properties`, `patternProperties`, `additionalProperties`, `items`,
//   `prefixItems`, ...) and declares `properties`, itself or through in-place
//   subschemas (`allOf`, `anyOf`, `oneOf`, `then`, `else`, `dependentSchemas`,
//   `$ref`). A nested `{"type": "object"}` without `properties` is a free-form map
//   and stays open.
//
// "Says nothing" means none of `additionalProperties`, `patternProperties`,
// `unevaluatedProperties` on that schema object: an explicit one keeps its standard
// meaning.
//
// Why `unevaluatedProperties` and not `additionalProperties: false`: the latter sees
// only the `properties` of its own schema object, so closing each branch of an
// `allOf` would refuse every key declared by another branch. Draft 2020-12's
// `unevaluatedProperties` sees the keys evaluated by in-place subschemas (`allOf`,
// `$ref`, ...), so it is added only where an instance location begins, never inside
// in-place subschemas: there it would have the same flaw.
//
// Nothing is added under `not`, `if` or `contains`, nor in definitions that are
// referenced from there: a stricter subschema there makes the schema around it
// looser. `$ref`s are followed when they are JSON pointers (`#/...`) or anchors
// (`#name`) within the schema; other references are not followed, so an object
// reached only through one stays as open as its author wrote it.
// ---------------------------------------------------------------------------------

/// How a subschema applies, seen from the schema object that holds it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Applies {
    /// To the same instance, and its evaluated keys count for the holder's
    /// `unevaluatedProperties` (`allOf`, `anyOf`, `oneOf`, `then`, `else`,
    /// `dependentSchemas`).
    InPlace,
    /// To the same instance, with its result inverted or only used to choose
    /// (`not`, `if`); or to array items with a count that may be capped
    /// (`contains`, with `maxContains`).
    Inverted,
    /// To a new instance location: a property value or an array item.
    Entry,
    /// Only where referenced (`$defs`, `definitions`).
    Definition,
    /// To property names (strings, never objects).
    Names,
}

/// The subschemas of a schema object, with their JSON-pointer segments.
fn subschemas(map: &Map<String, Value>) -> Vec<(Vec<String>, &Value, Applies)> {
    let mut out = Vec::new();
    for (k, v) in map {
        let applies = match k.as_str() {
            "allOf" | "anyOf" | "oneOf" | "then" | "else" | "dependentSchemas" => Applies::InPlace,
            "not" | "if" | "contains" => Applies::Inverted,
            "properties"
            | "patternProperties"
            | "additionalProperties"
            | "unevaluatedProperties"
            | "items"
            | "prefixItems"
            | "additionalItems"
            | "unevaluatedItems" => Applies::Entry,
            "$defs" | "definitions" => Applies::Definition,
            "propertyNames" => Applies::Names,
            _ => continue,
        };
        match (k.as_str(), v) {
            ("allOf" | "anyOf" | "oneOf" | "prefixItems" | "items", Value::Array(list)) => {
                for (i, s) in list.iter().enumerate() {
                    out.push((vec![k.clone(), i.to_string()], s, applies));
                }
            }
            (
                "properties" | "patternProperties" | "dependentSchemas" | "$defs" | "definitions",
                Value::Object(m),
            ) => {
                for (name, s) in m {
                    out.push((vec![k.clone(), name.clone()], s, applies));
                }
            }
            (
                "allOf" | "anyOf" | "oneOf" | "prefixItems" | "properties" | "patternProperties"
                | "dependentSchemas" | "$defs" | "definitions",
                _,
            ) => {}
            _ => out.push((vec![k.clone()], v, applies)),
        }
    }
    out
}

/// The schema object `subschemas` names by `segs` (a keyword, or a keyword and
/// the index or name in it), to change it in place.
fn subschema_mut<'a>(map: &'a mut Map<String, Value>, segs: &[String]) -> Option<&'a mut Value> {
    match segs {
        [k] => map.get_mut(k),
        [k, i] => match map.get_mut(k) {
            Some(Value::Array(a)) => i.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
            Some(Value::Object(m)) => m.get_mut(i),
            _ => None,
        },
        _ => None,
    }
}

/// A URI fragment with its `%XX` escapes decoded (a JSON pointer in a `$ref` is
/// percent-encoded); `None` if that is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).and_then(|c| hex(*c)),
            b.get(i + 2).and_then(|c| hex(*c)),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

fn join_pointer(at: &str, segments: &[String]) -> String {
    let mut p = at.to_string();
    for s in segments {
        p.push('/');
        p.push_str(&escape_pointer(s));
    }
    p
}

/// The schema being closed, for resolving `$ref`s (always in the author's version).
struct Doc<'a> {
    root: &'a Value,
    /// `$anchor` name → JSON pointer of its schema object.
    anchors: HashMap<String, String>,
}

impl<'a> Doc<'a> {
    fn new(root: &'a Value) -> Doc<'a> {
        fn walk(v: &Value, at: &str, anchors: &mut HashMap<String, String>) {
            let Value::Object(map) = v else { return };
            if let Some(Value::String(a)) = map.get("$anchor") {
                anchors.entry(a.clone()).or_insert_with(|| at.to_string());
            }
            for (segs, s, _) in subschemas(map) {
                walk(s, &join_pointer(at, &segs), anchors);
            }
        }
        let mut anchors = HashMap::new();
        walk(root, "", &mut anchors);
        Doc { root, anchors }
    }

    /// The JSON pointer (from the document root) that `reference`, found in the
    /// schema object at `at`, points to; `None` for what is not followed.
    fn resolve(&self, at: &str, reference: &str) -> Option<String> {
        let fragment = percent_decode(reference.strip_prefix('#')?)?;
        let fragment = fragment.as_str();
        if fragment.is_empty() || fragment.starts_with('/') {
            // Relative to the nearest enclosing schema resource (`$id`).
            let segments: Vec<&str> = at.split('/').skip(1).collect();
            let mut base = String::new();
            for n in (1..=segments.len()).rev() {
                let p: String = segments[..n].iter().map(|s| format!("/{s}")).collect();
                if self
                    .root
                    .pointer(&p)
                    .and_then(|v| v.get("$id"))
                    .and_then(Value::as_str)
                    .is_some()
                {
                    base = p;
                    break;
                }
            }
            let target = format!("{base}{fragment}");
            self.root.pointer(&target).map(|_| target)
        } else {
            self.anchors.get(fragment).cloned()
        }
    }

    /// The property names declared by the schema object at `at` and its in-place
    /// subschemas (through `$ref`s too); `None` when none of them has `properties`.
    fn declared(&self, at: &str) -> Option<BTreeSet<String>> {
        fn walk(
            doc: &Doc,
            v: &Value,
            at: &str,
            seen: &mut HashSet<String>,
            out: &mut Option<BTreeSet<String>>,
        ) {
            let Value::Object(map) = v else { return };
            if let Some(Value::Object(props)) = map.get("properties") {
                out.get_or_insert_with(BTreeSet::new)
                    .extend(props.keys().cloned());
            }
            for (segs, s, applies) in subschemas(map) {
                // `if` contributes its keys when it holds (an annotation source).
                if applies == Applies::InPlace || segs[0] == "if" {
                    walk(doc, s, &join_pointer(at, &segs), seen, out);
                }
            }
            if let Some(Value::String(r)) = map.get("$ref") {
                if let Some(target) = doc.resolve(at, r) {
                    if seen.insert(target.clone()) {
                        if let Some(t) = doc.root.pointer(&target) {
                            walk(doc, t, &target, seen, out);
                        }
                    }
                }
            }
        }
        let mut out = None;
        let mut seen = HashSet::from([at.to_string()]);
        if let Some(v) = self.root.pointer(at) {
            walk(self, v, at, &mut seen, &mut out);
        }
        out
    }

    /// Pointers of the schema objects referenced from under `not`, `if` or
    /// `contains`, and of everything those reference in turn.
    fn inverted_targets(&self) -> HashSet<String> {
        fn walk(
            doc: &Doc,
            v: &Value,
            at: &str,
            inverted: bool,
            found: &mut HashSet<String>,
            work: &mut Vec<String>,
        ) {
            let Value::Object(map) = v else { return };
            if inverted {
                if let Some(Value::String(r)) = map.get("$ref") {
                    if let Some(t) = doc.resolve(at, r) {
                        if found.insert(t.clone()) {
                            work.push(t);
                        }
                    }
                }
            }
            for (segs, s, applies) in subschemas(map) {
                let inv = inverted || applies == Applies::Inverted;
                walk(doc, s, &join_pointer(at, &segs), inv, found, work);
            }
        }
        let mut found = HashSet::new();
        let mut work = Vec::new();
        walk(self, self.root, "", false, &mut found, &mut work);
        while let Some(p) = work.pop() {
            if let Some(v) = self.root.pointer(&p) {
                walk(self, v, &p, true, &mut found, &mut work);
            }
        }
        found
    }
}

/// Does the schema object say anything about keys it does not list?
fn speaks_of_extra_keys(map: &Map<String, Value>) -> bool {
    [
        "additionalProperties",
        "patternProperties",
        "unevaluatedProperties",
    ]
    .iter()
    .any(|k| map.contains_key(*k))
}

/// The closed copy of a tool's `input_schema` (see the comment above).
pub fn closed_schema(schema: &Value) -> Value {
    /// Close `v` (the copy of the schema object at `at`) and what it holds, in place;
    /// the decisions are taken on the author's schema in `doc`.
    fn rewrite(
        doc: &Doc,
        inverted_targets: &HashSet<String>,
        v: &mut Value,
        at: &str,
        entry: bool,
        inverted: bool,
    ) {
        let Value::Object(map) = v else { return };
        let inverted = inverted
            || inverted_targets
                .iter()
                .any(|t| t.is_empty() || at == t || at.starts_with(&format!("{t}/")));
        let close = entry && !inverted && !speaks_of_extra_keys(map) && doc.declared(at).is_some();
        let children: Vec<(Vec<String>, Applies)> = subschemas(map)
            .into_iter()
            .map(|(segs, _, applies)| (segs, applies))
            .collect();
        for (segs, applies) in children {
            if let Some(slot) = subschema_mut(map, &segs) {
                rewrite(
                    doc,
                    inverted_targets,
                    slot,
                    &join_pointer(at, &segs),
                    applies == Applies::Entry,
                    inverted || applies == Applies::Inverted,
                );
            }
        }
        if close {
            map.insert("unevaluatedProperties".into(), Value::Bool(false));
        }
    }
    // `true` accepts anything, like `{}`; `false` nothing, and stays so.
    let empty = Value::Object(Map::new());
    let schema = if *schema == Value::Bool(true) {
        &empty
    } else {
        schema
    };
    let doc = Doc::new(schema);
    let inverted = doc.inverted_targets();
    let mut out = schema.clone();
    rewrite(&doc, &inverted, &mut out, "", false, false);
    if let Value::Object(map) = &mut out {
        if !speaks_of_extra_keys(map) {
            map.insert("unevaluatedProperties".into(), Value::Bool(false));
        }
    }
    out
}

/// The top-level argument names a schema declares (for messages).
fn top_level_arguments(schema: &Value) -> BTreeSet<String> {
    Doc::new(schema).declared("").unwrap_or_default()
}

/// The call budget of one script: `max_calls` calls reach the engine; the next one
/// and every later one is refused with `limit`.
#[derive(Debug, Clone)]
pub struct Budget {
    max: u64,
    used: u64,
}

impl Budget {
    pub fn new(max: u64) -> Budget {
        Budget { max, used: 0 }
    }
    pub fn take(&mut self, tool: &str) -> Result<(), CallRefusal> {
        if self.used >= self.max {
            return Err(CallRefusal::new(
                ToolErrorCode::Limit,
                format!(
                    "{tool}: call budget of {} calls for this script is used up; \
                     do fewer calls per script (aggregate, or split the work over several scripts)",
                    self.max
                ),
            ));
        }
        self.used += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::snapshot::parse_snapshot;
    use crate::protocol::{code, RpcError};
    use serde_json::json;

    fn snapshot(mode: &str, read_only: bool) -> Snapshot {
        parse_snapshot(json!({
            "workspace": "/w", "read_only": read_only, "permission_mode": mode,
            "session_allowed": ["t__session_write"],
            "tools": [
                {"name": "t__read", "class": "read",
                 "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}},
                                  "required": ["sn"], "additionalProperties": false}},
                {"name": "t__write", "class": "write",
                 "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}, "tenant": {"type": "string"}},
                                  "additionalProperties": false},
                 "frozen": {"tenant": "acme"}},
                {"name": "t__session_write", "class": "write",
                 "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}}}},
                {"name": "t__destroy", "class": "destructive"},
                {"name": "t__long", "class": "long_task"},
                {"name": "t__off", "class": "read", "enabled": false},
                {"name": "t__off_write", "class": "write", "enabled": false}
            ]}))
        .unwrap()
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn start_reason(mode: &str, ro: bool, tools: &[&str]) -> Option<String> {
        Policy::plan(&snapshot(mode, ro), &names(tools))
            .err()
            .map(|e| {
                assert_eq!(e.code(), code::TOOLS);
                assert_eq!(e.named_tool(), Some(tools[0]));
                e.reason().as_str().to_string()
            })
    }

    #[test]
    fn start_refusal_reasons() {
        assert_eq!(
            start_reason("approval", false, &["t__nope"]).as_deref(),
            Some("unknown")
        );
        assert_eq!(
            start_reason("approval", false, &["t__read"]).as_deref(),
            Some("not_write")
        );
        assert_eq!(
            start_reason("approval", false, &["t__destroy"]).as_deref(),
            Some("destructive")
        );
        assert_eq!(
            start_reason("approval", false, &["t__long"]).as_deref(),
            Some("long_task")
        );
        assert_eq!(
            start_reason("approval", false, &["t__off_write"]).as_deref(),
            Some("disabled")
        );
        assert_eq!(
            start_reason("approval", true, &["t__write"]).as_deref(),
            Some("read_only")
        );
        assert_eq!(start_reason("approval", false, &["t__write"]), None);
    }

    #[test]
    fn approval_is_needed_once_unless_session_allowed_or_auto() {
        let plan = |mode, tools: &[&str]| {
            Policy::plan(&snapshot(mode, false), &names(tools))
                .unwrap()
                .1
        };
        assert!(
            !plan("approval", &[]).needs_approval,
            "no write tools, nothing to approve"
        );
        assert!(plan("approval", &["t__write"]).needs_approval);
        assert!(!plan("approval", &["t__session_write"]).needs_approval);
        assert!(plan("approval", &["t__session_write", "t__write"]).needs_approval);
        assert!(!plan("auto", &["t__write"]).needs_approval);
        assert_eq!(
            plan("approval", &["t__write", "t__write"]).declared.len(),
            1
        );
    }

    fn call(ro: bool, declared: &[&str], tool: &str, args: Value) -> Result<Value, CallRefusal> {
        let (p, _) = Policy::plan(&snapshot("auto", ro), &names(declared)).unwrap();
        p.check_call(tool, &args)
    }

    #[test]
    fn every_row_of_the_call_table() {
        // read: callable directly.
        assert_eq!(
            call(false, &[], "t__read", json!({"sn": "A1"})).unwrap(),
            json!({"sn": "A1"})
        );
        // write: only when declared; frozen arguments merged in.
        assert_eq!(
            call(false, &[], "t__write", json!({"sn": "A1"}))
                .unwrap_err()
                .code,
            ToolErrorCode::Denied
        );
        assert_eq!(
            call(false, &["t__write"], "t__write", json!({"sn": "A1"})).unwrap(),
            json!({"sn": "A1", "tenant": "acme"})
        );
        // destructive and long_task: never.
        for t in ["t__destroy", "t__long"] {
            let r = call(false, &[], t, json!({})).unwrap_err();
            assert_eq!(r.code, ToolErrorCode::Denied);
            assert!(r.message.contains("call it directly"), "{}", r.message);
        }
        // disabled tools and unknown tools: not provided.
        for (t, why) in [
            ("t__off", "it is switched off for this run"),
            ("t__nope", "no tool of that name is provided to this run"),
        ] {
            let r = call(false, &[], t, json!({})).unwrap_err();
            assert_eq!(r.code, ToolErrorCode::Denied);
            assert!(r.message.contains("not available"));
            assert!(r.message.ends_with(why), "{}", r.message);
        }
        // write tools in a read-only run: not provided, even if (wrongly) listed.
        let (p, _) = Policy::plan(&snapshot("auto", true), &[]).unwrap();
        let r = p.check_call("t__write", &json!({})).unwrap_err();
        assert!(r.message.contains("read-only"), "{}", r.message);
        assert!(p.check_call("t__read", &json!({"sn": "x"})).is_ok());
    }

    #[test]
    fn the_typed_api_lists_the_enabled_read_and_write_tools_in_snapshot_order() {
        let (p, _) = Policy::plan(&snapshot("auto", false), &[]).unwrap();
        let listed: Vec<&str> = p.callable_specs().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(listed, ["t__read", "t__write", "t__session_write"]);
    }

    #[test]
    fn arguments_are_checked_after_the_frozen_merge() {
        let r = call(false, &[], "t__read", json!({})).unwrap_err();
        assert_eq!(r.code, ToolErrorCode::InvalidArguments);
        assert!(r.message.contains("sn"), "{}", r.message);
        let r = call(false, &[], "t__read", json!({"sn": "A", "extra": 1})).unwrap_err();
        assert_eq!(r.code, ToolErrorCode::InvalidArguments);
        let r = call(false, &[], "t__read", json!({"sn": 5})).unwrap_err();
        assert!(r.message.contains("/sn"), "{}", r.message);
        let r = call(false, &["t__write"], "t__write", json!({"tenant": "evil"})).unwrap_err();
        assert_eq!(r.code, ToolErrorCode::InvalidArguments);
        assert!(r.message.contains("fixed by the run"));
        assert_eq!(
            call(false, &[], "t__read", json!(["A"])).unwrap_err().code,
            ToolErrorCode::InvalidArguments
        );
    }

    /// Check `args` against a read tool with `schema` (and `frozen`).
    fn check(schema: Value, frozen: Value, args: Value) -> Result<Value, CallRefusal> {
        let s = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto",
            "tools": [{"name": "t", "class": "read", "input_schema": schema, "frozen": frozen}]}))
        .unwrap();
        let (p, _) = Policy::plan(&s, &[]).unwrap();
        p.check_call("t", &args)
    }

    /// The refusal message, asserting that it is an `invalid_arguments` refusal.
    fn refused(schema: Value, args: Value) -> String {
        let r = check(schema, json!({}), args.clone()).expect_err(&args.to_string());
        assert_eq!(r.code, ToolErrorCode::InvalidArguments, "{}", r.message);
        r.message
    }

    /// A declared key whose value is wrong is refused by that error alone (at
    /// its value, or deeper), never also as a key the schema does not declare.
    #[test]
    fn a_wrong_value_is_not_also_an_undeclared_key() {
        // Declared in an `allOf` branch, which the wrong value fails: its keys
        // are then not "evaluated" either.
        let schema = json!({"type": "object", "allOf": [{"properties": {
            "n": {"type": "integer"},
            "o": {"type": "object", "properties": {"b": {"type": "integer"}}}}}]});
        for (args, at) in [
            (json!({"n": "x"}), " at /n: "),
            (json!({"o": {"b": "x"}}), " at /o/b: "),
        ] {
            let m = refused(schema.clone(), args);
            assert!(m.contains(at), "{m}");
            assert!(!m.contains("not declared"), "{m}");
        }
    }

    /// A schema object a `not` refers to is left open (closing it would change
    /// what the `not` refuses); the rest is closed as ever.
    #[test]
    fn a_schema_a_not_refers_to_stays_open_the_rest_is_closed() {
        let schema = json!({"type": "object",
            "properties": {
                "p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
                "q": {"type": "object", "properties": {"z": {}}}},
            "not": {"$ref": "#/properties/p"}});
        assert_eq!(
            check(schema.clone(), json!({}), json!({"p": {"x": 1, "y": 2}})).unwrap(),
            json!({"p": {"x": 1, "y": 2}})
        );
        let m = refused(schema.clone(), json!({"p": {"x": 1}, "zz": 1}));
        assert!(m.contains("argument `zz` is not declared"), "{m}");
        let m = refused(schema, json!({"q": {"z": 1, "w": 2}}));
        assert!(m.contains("key `w` at /q is not declared"), "{m}");
    }

    /// An object schema in an array of schemas (`prefixItems`, `allOf`, ...)
    /// is closed where it applies to a new value.
    #[test]
    fn object_schemas_in_arrays_of_schemas_are_closed() {
        let schema = json!({"type": "object", "properties": {"l": {"type": "array",
            "prefixItems": [{"type": "object", "properties": {"x": {}}}]}}});
        let m = refused(schema, json!({"l": [{"x": 1, "y": 2}]}));
        assert!(m.contains("key `y` at /l/0 is not declared"), "{m}");
    }

    #[test]
    fn fragments_are_percent_decoded() {
        assert_eq!(percent_decode("a%2Fb%25c%7e").as_deref(), Some("a/b%c~"));
        assert_eq!(percent_decode("%C3%A9%20x").as_deref(), Some("\u{e9} x"));
        // Not an escape: kept as it is.
        assert_eq!(percent_decode("%zz%4").as_deref(), Some("%zz%4"));
        assert_eq!(percent_decode("%FF"), None, "not UTF-8");
    }

    /// A refusal names at most 20 of the tool's arguments, then "…": 20 are all
    /// named, 21 are cut after the 20th.
    #[test]
    fn a_refusal_names_twenty_arguments_at_most() {
        let with = |n: usize| {
            let props: Map<String, Value> =
                (0..n).map(|i| (format!("a{i:02}"), json!({}))).collect();
            refused(
                json!({"type": "object", "properties": props}),
                json!({"zz": 1}),
            )
        };
        let twenty = with(20);
        assert!(twenty.contains("a19)"), "{twenty}");
        assert!(!twenty.contains('…'), "{twenty}");
        let more = with(21);
        assert!(more.contains("a19, …)"), "{more}");
        assert!(!more.contains("a20"), "{more}");
    }

    /// `knows` is the snapshot's list, enabled or not: what the broker counts a
    /// call under (its own name, or "not in the snapshot").
    #[test]
    fn the_policy_knows_every_tool_of_the_snapshot_and_no_other() {
        let s = parse_snapshot(
            json!({"workspace": "/w", "permission_mode": "auto", "tools": [
            {"name": "on", "class": "read", "input_schema": {"type": "object"}},
            {"name": "off", "class": "read", "enabled": false}]}),
        )
        .unwrap();
        let (p, _) = Policy::plan(&s, &[]).unwrap();
        assert!(p.knows("on") && p.knows("off"));
        assert!(!p.knows("other") && !p.knows(""));
    }

    /// `additionalProperties: false` or `unevaluatedProperties: false` with no
    /// `properties` beside it is one error about the whole object: each of its
    /// keys is reported as undeclared, by name, either way.
    #[test]
    fn a_schema_that_takes_no_keys_names_each_key_given() {
        for schema in [
            json!({"type": "object", "additionalProperties": false}),
            json!({"type": "object", "unevaluatedProperties": false}),
            json!({"type": "object"}),
        ] {
            let m = refused(schema.clone(), json!({"x": 1}));
            assert_eq!(
                m, "t: argument `x` is not declared in the tool's schema (it takes no arguments)",
                "{schema}"
            );
        }
    }

    /// An object whose keys are declared only through an in-place subschema
    /// (each of `allOf`, `anyOf`, `oneOf`, `then`, `else`, `dependentSchemas`,
    /// and `if` as an annotation source) is closed where its value begins: an
    /// undeclared key beside them is refused.
    #[test]
    fn keys_declared_through_each_in_place_keyword_close_the_object() {
        let x = json!({"properties": {"x": {}}});
        for (kw, m) in [
            ("allOf", json!({"allOf": [x]})),
            ("anyOf", json!({"anyOf": [x]})),
            ("oneOf", json!({"oneOf": [x]})),
            ("then", json!({"if": true, "then": x})),
            ("else", json!({"if": false, "else": x})),
            ("dependentSchemas", json!({"dependentSchemas": {"x": x}})),
            ("if", json!({"if": x, "then": true})),
        ] {
            let schema = json!({"type": "object", "properties": {"m": m}});
            let msg = refused(schema.clone(), json!({"m": {"x": 1, "y": 2}}));
            assert!(msg.contains("`y` at /m"), "{kw}: {msg}");
            check(schema, json!({}), json!({"m": {"x": 1}}))
                .unwrap_or_else(|r| panic!("{kw}: {}", r.message));
        }
    }

    /// Definitions reached from under `not` or `contains` stay as open as their
    /// author wrote them, however they are reached there: closing them would make
    /// `not` looser and `contains` stricter.
    #[test]
    fn definitions_under_not_and_contains_stay_open() {
        let defs = json!({"D": {"type": "object",
            "properties": {"inner": {"type": "object", "properties": {"z": {}}}}}});
        let item = json!({"inner": {"z": 1, "extra": 2}});
        // contains: the item matches D as written, extra key and all.
        let contains = json!({"type": "object", "$defs": defs,
            "properties": {"l": {"type": "array", "contains": {"$ref": "#/$defs/D"}}}});
        check(contains, json!({}), json!({"l": [item]})).unwrap();
        // not: the value matches D as written, so `not` refuses it.
        let not = json!({"type": "object", "$defs": defs,
            "properties": {"a": {"not": {"$ref": "#/$defs/D"}}}});
        let msg = refused(not, json!({"a": item}));
        assert!(msg.contains("at /a"), "{msg}");
        // propertyNames holds subschemas too: a definition referenced under a `not`
        // there stays open where a property uses it.
        let names = json!({"type": "object", "$defs": defs,
            "propertyNames": {"anyOf": [{"maxLength": 50}, {"not": {"$ref": "#/$defs/D"}}]},
            "properties": {"p": {"$ref": "#/$defs/D"}}});
        check(names, json!({}), json!({"p": item})).unwrap();
    }

    #[test]
    fn an_open_schema_is_checked_as_a_closed_one() {
        let open = json!({"type": "object", "properties": {"sn": {"type": "string"}}});
        assert_eq!(
            check(open.clone(), json!({}), json!({"sn": "A"})).unwrap(),
            json!({"sn": "A"})
        );
        let m = refused(open.clone(), json!({"sn": "A", "extra": 1}));
        assert_eq!(
            m,
            "t: argument `extra` is not declared in the tool's schema (its arguments are: sn)"
        );
        let m = refused(open.clone(), json!({"x": 1, "y": 2}));
        assert!(m.contains("arguments `x`, `y` are not declared"), "{m}");
        // A declared key with a bad value is reported as such, not as undeclared.
        let m = refused(open.clone(), json!({"sn": 5}));
        assert_eq!(
            m,
            "t: arguments do not match the tool's schema at /sn: 5 is not of type \"string\""
        );
        let m = refused(open, json!({"sn": 5, "extra": 1}));
        assert!(
            m.contains("argument `extra` is not declared") && m.contains("at /sn"),
            "{m}"
        );
        // Top level without `properties`: no arguments at all.
        let m = refused(json!({"type": "object"}), json!({"x": 1}));
        assert!(
            m.contains("`x`") && m.contains("it takes no arguments"),
            "{m}"
        );
        assert!(check(json!({"type": "object"}), json!({}), json!({})).is_ok());
        // `true` accepts anything, so it is closed like `{}`; `false` accepts nothing.
        assert!(refused(json!(true), json!({"x": 1})).contains("`x`"));
        assert!(check(json!(true), json!({}), json!({})).is_ok());
        assert!(check(json!(false), json!({}), json!({})).is_err());
    }

    #[test]
    fn explicit_extra_key_rules_keep_their_meaning() {
        let any = json!({"type": "object", "additionalProperties": true});
        assert!(check(any, json!({}), json!({"a": 1, "b": {"c": 2}})).is_ok());
        let ints = json!({"type": "object", "properties": {"sn": {"type": "string"}},
                          "additionalProperties": {"type": "integer"}});
        assert!(check(ints.clone(), json!({}), json!({"sn": "A", "n": 1})).is_ok());
        assert!(refused(ints, json!({"n": "one"})).contains("at /n"));
        // patternProperties alone does not restrict other keys (standard meaning).
        let pat = json!({"type": "object", "patternProperties": {"^x-": {"type": "string"}}});
        assert!(check(pat.clone(), json!({}), json!({"x-a": "s", "other": 1})).is_ok());
        assert!(refused(pat, json!({"x-a": 1})).contains("/x-a"));
        let unev = json!({"type": "object", "unevaluatedProperties": true});
        assert!(check(unev, json!({}), json!({"a": 1})).is_ok());
        // An explicit `additionalProperties: false` names the key too.
        let m = refused(json!({"additionalProperties": false}), json!({"k": 1}));
        assert!(m.contains("argument `k` is not declared"), "{m}");
        let m = refused(
            json!({"patternProperties": {"^x-": {}}, "additionalProperties": false}),
            json!({"x-a": 1, "k": 1}),
        );
        assert!(m.contains("argument `k` is not declared"), "{m}");
    }

    #[test]
    fn nested_objects_with_properties_are_closed_free_form_maps_are_not() {
        let schema = json!({"type": "object", "properties": {
            "addr": {"type": "object", "properties": {"zip": {"type": "string"}}},
            "meta": {"type": "object"},
            "rows": {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"}}}},
            "open": {"type": "object", "properties": {"a": {}}, "additionalProperties": true}
        }});
        let ok = json!({"addr": {"zip": "1000"}, "meta": {"anything": [1]},
                        "rows": [{"id": 1}], "open": {"a": 1, "b": 2}});
        assert_eq!(check(schema.clone(), json!({}), ok.clone()).unwrap(), ok);
        let m = refused(schema.clone(), json!({"addr": {"zip": "1", "street": "x"}}));
        assert_eq!(
            m,
            "t: key `street` at /addr is not declared in the tool's schema"
        );
        let m = refused(schema, json!({"rows": [{"id": 1}, {"id": 2, "x": 0}]}));
        assert!(m.contains("key `x` at /rows/1"), "{m}");
    }

    #[test]
    fn composition_is_closed_where_the_instance_begins() {
        // allOf: each branch declares some keys; all of them together are allowed.
        let all = json!({"allOf": [
            {"type": "object", "properties": {"a": {"type": "string"}}},
            {"properties": {"b": {"type": "integer"}}}]});
        assert!(check(all.clone(), json!({}), json!({"a": "x", "b": 1})).is_ok());
        assert!(refused(all.clone(), json!({"a": "x", "c": 1})).contains("`c`"));
        assert_eq!(
            top_level_arguments(&all).into_iter().collect::<Vec<_>>(),
            ["a", "b"]
        );
        // anyOf / oneOf at the top.
        let any = json!({"anyOf": [
            {"properties": {"id": {"type": "integer"}}, "required": ["id"]},
            {"properties": {"name": {"type": "string"}}, "required": ["name"]}]});
        assert!(check(any.clone(), json!({}), json!({"id": 1})).is_ok());
        assert!(check(any.clone(), json!({}), json!({"name": "n"})).is_ok());
        assert!(refused(any, json!({"id": 1, "zzz": 1})).contains("`zzz`"));
        let one = json!({"oneOf": [
            {"properties": {"kind": {"const": "a"}, "x": {}}, "required": ["kind"]},
            {"properties": {"kind": {"const": "b"}, "y": {}}, "required": ["kind"]}]});
        assert!(check(one.clone(), json!({}), json!({"kind": "a", "x": 1})).is_ok());
        assert!(refused(one, json!({"kind": "a", "q": 1})).contains("`q`"));
        // $ref into $defs, at the top and nested, pydantic style; and recursion.
        let refs = json!({
            "$defs": {
                "Addr": {"type": "object", "properties": {"zip": {"type": "string"}}},
                "Node": {"type": "object", "properties": {
                    "name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}},
                "Args": {"type": "object", "properties": {
                    "addr": {"$ref": "#/$defs/Addr"},
                    "tree": {"$ref": "#/$defs/Node"},
                    "tags": {"anyOf": [{"$ref": "#/$defs/Addr"}, {"type": "null"}]}}}
            },
            "$ref": "#/$defs/Args"});
        let ok = json!({"addr": {"zip": "1"}, "tree": {"name": "r", "children": [{"name": "c", "children": []}]},
                        "tags": null});
        assert!(check(refs.clone(), json!({}), ok).is_ok());
        assert!(refused(refs.clone(), json!({"nope": 1})).contains("argument `nope`"));
        assert!(refused(refs.clone(), json!({"addr": {"zip": "1", "x": 1}}))
            .contains("key `x` at /addr"));
        let m = refused(
            refs.clone(),
            json!({"tree": {"name": "r", "children": [{"name": "c", "bad": 1}]}}),
        );
        assert!(m.contains("key `bad` at /tree/children/0"), "{m}");
        assert!(refused(refs, json!({"tags": {"zip": "1", "x": 1}})).contains("`x`"));
        // A percent-encoded pointer, and an anchor.
        let refs = json!({"type": "object", "properties": {
                "a": {"$ref": "#/$defs/My%20Addr"},
                "b": {"$ref": "#addr"}},
            "$defs": {"My Addr": {"$anchor": "addr", "properties": {"zip": {}}}}});
        assert!(check(
            refs.clone(),
            json!({}),
            json!({"a": {"zip": 1}, "b": {"zip": 2}})
        )
        .is_ok());
        assert!(refused(refs.clone(), json!({"a": {"x": 1}})).contains("key `x` at /a"));
        assert!(refused(refs, json!({"b": {"x": 1}})).contains("key `x` at /b"));
        // The snapshot's schema itself is never changed: only the compiled copy.
        let s = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto",
            "tools": [{"name": "t", "class": "read", "input_schema": {"type": "object"}}]}))
        .unwrap();
        Policy::plan(&s, &[]).unwrap();
        assert_eq!(s.tools[0].input_schema, Some(json!({"type": "object"})));
    }

    #[test]
    fn the_closed_copy_says_unevaluated_properties_where_a_value_begins() {
        let s = json!({"type": "object",
            "allOf": [{"properties": {"a": {}}}],
            "properties": {
                "o": {"properties": {"b": {}}},
                "m": {"type": "object"},
                "x": {"properties": {}, "additionalProperties": true},
                "l": {"items": {"allOf": [{"properties": {"c": {}}}]}}}});
        assert_eq!(
            closed_schema(&s),
            json!({"type": "object",
                "allOf": [{"properties": {"a": {}}}],
                "properties": {
                    "o": {"properties": {"b": {}}, "unevaluatedProperties": false},
                    "m": {"type": "object"},
                    "x": {"properties": {}, "additionalProperties": true},
                    "l": {"items": {"allOf": [{"properties": {"c": {}}}], "unevaluatedProperties": false}}},
                "unevaluatedProperties": false})
        );
        assert_eq!(
            closed_schema(&json!({"type": "object", "additionalProperties": true})),
            json!({"type": "object", "additionalProperties": true})
        );
    }

    #[test]
    fn nothing_is_closed_under_not_or_if() {
        // Closing `k` inside `not` would make `not` (so the whole schema) looser:
        // {"o": {"k": {"a": 1, "b": 2}}} must stay invalid.
        let schema = json!({"type": "object", "properties": {"o": {
            "not": {"properties": {"k": {"$ref": "#/$defs/K"}}, "required": ["k"]}}},
            "$defs": {"K": {"type": "object", "properties": {"a": {}}, "required": ["a"]}}});
        assert!(check(schema.clone(), json!({}), json!({"o": {"k": {"b": 2}}})).is_ok());
        let r = check(schema, json!({}), json!({"o": {"k": {"a": 1, "b": 2}}})).unwrap_err();
        assert!(!r.message.contains("not declared"), "{}", r.message);
        // The same with `if`: the condition keeps its author's meaning.
        let cond = json!({"type": "object", "properties": {"m": {}, "n": {}},
            "if": {"properties": {"m": {"properties": {"x": {}}}}},
            "then": {"required": ["n"]}});
        assert!(check(
            cond.clone(),
            json!({}),
            json!({"m": {"x": 1, "y": 2}, "n": 0})
        )
        .is_ok());
        assert!(check(cond, json!({}), json!({"m": {"x": 1, "y": 2}})).is_err());
    }

    #[test]
    fn frozen_keys_count_as_declared() {
        // Not listed in the schema at all, open or explicitly closed.
        for schema in [
            json!({"type": "object", "properties": {"sn": {"type": "string"}}}),
            json!({"type": "object", "properties": {"sn": {"type": "string"}}, "additionalProperties": false}),
        ] {
            assert_eq!(
                check(
                    schema.clone(),
                    json!({"tenant": "acme"}),
                    json!({"sn": "A"})
                )
                .unwrap(),
                json!({"sn": "A", "tenant": "acme"})
            );
            let m = check(
                schema.clone(),
                json!({"tenant": "acme"}),
                json!({"sn": "A", "x": 1}),
            )
            .unwrap_err()
            .message;
            assert_eq!(
                m, "t: argument `x` is not declared in the tool's schema (its arguments are: sn)",
                "the frozen key is not named"
            );
        }
        // Only at the top level: a nested `tenant` is not declared by that.
        let nested = json!({"type": "object", "properties": {"o": {"type": "object", "properties": {"a": {}}}}});
        let m = check(
            nested,
            json!({"tenant": "acme"}),
            json!({"o": {"a": 1, "tenant": "x"}}),
        )
        .unwrap_err()
        .message;
        assert!(m.contains("key `tenant` at /o"), "{m}");
    }

    #[test]
    fn every_callable_tool_needs_a_schema() {
        let snap = |tool: Value| {
            parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto",
                "tools": [{"name": "ok", "class": "read", "input_schema": {"type": "object"}}, tool]}))
        };
        for class in ["read", "write"] {
            let e = RpcError::from(snap(json!({"name": "x", "class": class})).unwrap_err());
            assert_eq!(e.code, code::SNAPSHOT);
            assert_eq!(
                e.data,
                Some(json!({"reason": "missing_field", "field": "tools[1].input_schema"}))
            );
            assert!(e.message.contains("additionalProperties"), "{}", e.message);
            // Disabled: never called, so it may go without.
            let s = snap(json!({"name": "x", "class": class, "enabled": false})).unwrap();
            assert!(Policy::plan(&s, &[]).is_ok());
        }
        for class in ["destructive", "long_task"] {
            let s = snap(json!({"name": "x", "class": class})).unwrap();
            let (p, _) = Policy::plan(&s, &[]).unwrap();
            assert_eq!(
                p.check_call("x", &json!({})).unwrap_err().code,
                ToolErrorCode::Denied
            );
        }
        // A Snapshot built in code is held to the same rule by `plan`.
        let mut s = snap(json!({"name": "x", "class": "destructive"})).unwrap();
        s.tools[1].class = ToolClass::Write;
        let e = Policy::plan(&s, &[]).err().unwrap();
        assert_eq!(
            (e.code(), e.reason(), e.named_field()),
            (
                code::SNAPSHOT,
                Reason::MissingField,
                Some("tools[1].input_schema")
            )
        );
    }

    #[test]
    fn invalid_schema_refuses_the_snapshot() {
        let s = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto",
            "tools": [{"name": "x", "class": "read", "input_schema": {"type": 12}}]}))
        .unwrap();
        let e = Policy::plan(&s, &[]).err().unwrap();
        assert_eq!(
            (e.code(), e.reason()),
            (code::SNAPSHOT, Reason::InvalidSchema)
        );
    }

    #[test]
    fn budget_refuses_the_call_after_max() {
        let mut b = Budget::new(2);
        assert!(b.take("t").is_ok());
        assert!(b.take("t").is_ok());
        assert_eq!(b.take("t").unwrap_err().code, ToolErrorCode::Limit);
        assert_eq!(b.take("t").unwrap_err().code, ToolErrorCode::Limit);
    }

    #[test]
    fn snapshot_limits_only_tighten() {
        let cfg = Scripts::default();
        let l = Limits::effective(
            &cfg,
            &SnapshotLimits {
                max_calls: Some(500),
                timeout_s: Some(99999),
                max_concurrency: Some(0),
                ..Default::default()
            },
        );
        assert_eq!(l.max_calls, 500);
        assert_eq!(l.timeout_s, 1800);
        assert_eq!(l.max_concurrency, 1);
        assert_eq!(l.memory_max_bytes, cfg.memory_max_bytes);
    }
}
