//! Pure policy decisions (protocol §3): what a run may start with and what each call
//! from a script may do. No I/O, no syscalls, no clocks: callers pass everything in.

use crate::config::Scripts;
use crate::protocol::{code, RpcError};
use crate::token::{PermissionMode, Snapshot, SnapshotLimits, ToolClass};
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, HashMap};

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

/// Why a call from a script is refused; becomes `ToolError(code, message)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub code: &'static str,
    pub message: String,
}

impl Refusal {
    fn denied(message: String) -> Self {
        Refusal {
            code: "denied",
            message,
        }
    }
    fn invalid(message: String) -> Self {
        Refusal {
            code: "invalid_arguments",
            message,
        }
    }
}

struct Tool {
    class: ToolClass,
    enabled: bool,
    frozen: Map<String, Value>,
    schema: jsonschema::Validator,
}

/// The compiled policy of one script.
pub struct Policy {
    tools: HashMap<String, Tool>,
    declared: BTreeSet<String>,
    read_only: bool,
}

fn tools_error(tool: &str, reason: &str, message: String) -> RpcError {
    RpcError::with_data(
        code::TOOLS,
        message,
        json!({"tool": tool, "reason": reason}),
    )
}

impl Policy {
    /// Compile the snapshot's schemas and check `script.start`'s `tools`.
    pub fn plan(snap: &Snapshot, declared: &[String]) -> Result<(Policy, StartPlan), RpcError> {
        let mut tools = HashMap::new();
        for (i, t) in snap.tools.iter().enumerate() {
            let schema = jsonschema::draft202012::options()
                .should_validate_formats(true)
                .build(&t.input_schema)
                .map_err(|e| {
                    RpcError::with_data(
                        code::SNAPSHOT,
                        format!("tool {}: input_schema is not a valid JSON Schema: {e}", t.name),
                        json!({"reason": "invalid_schema", "field": format!("tools[{i}].input_schema")}),
                    )
                })?;
            tools.insert(
                t.name.clone(),
                Tool {
                    class: t.class,
                    enabled: t.enabled,
                    frozen: t.frozen.clone(),
                    schema,
                },
            );
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
                    "unknown",
                    format!("tool {name} is not in this run's snapshot"),
                ));
            };
            let refuse = |reason: &str, why: &str| {
                Err(tools_error(
                    name,
                    reason,
                    format!("tool {name} cannot be declared: {why}"),
                ))
            };
            match t.class {
                _ if !t.enabled => return refuse("disabled", "it is switched off for this run"),
                ToolClass::Read => {
                    return refuse(
                        "not_write",
                        "it is a read tool; read tools need no declaration",
                    )
                }
                ToolClass::Destructive => {
                    return refuse(
                        "destructive",
                        "destructive tools are never callable from a script; call it directly",
                    )
                }
                ToolClass::LongTask => return refuse(
                    "long_task",
                    "long-running task tools are never callable from a script; call it directly",
                ),
                ToolClass::Write if snap.read_only => {
                    return refuse("read_only", "this run is read-only")
                }
                ToolClass::Write => {}
            }
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
            },
            plan,
        ))
    }

    /// Is `tool` a tool of the snapshot (enabled or not)?
    pub fn knows(&self, tool: &str) -> bool {
        self.tools.contains_key(tool)
    }

    /// Decide one call from the script. On success returns the arguments to send to
    /// the engine: the script's, with the frozen ones merged in, schema-checked.
    pub fn check_call(&self, tool: &str, args: &Value) -> Result<Value, Refusal> {
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
            return Err(Refusal::denied(format!(
                "tool {tool} is not available: {why}"
            )));
        };
        match t.class {
            ToolClass::Read => {}
            ToolClass::Write if self.declared.contains(tool) => {}
            ToolClass::Write => {
                return Err(Refusal::denied(format!(
                    "tool {tool} is a write tool that this script did not declare; \
                     add it to run_script's `tools` and run the script again"
                )))
            }
            ToolClass::Destructive => {
                return Err(Refusal::denied(format!(
                    "tool {tool} is destructive and is never callable from a script; \
                     call it directly, where each call is confirmed"
                )))
            }
            ToolClass::LongTask => {
                return Err(Refusal::denied(format!(
                    "tool {tool} runs as a long task and cannot be called from a script; call it directly"
                )))
            }
        }
        let Value::Object(given) = args else {
            return Err(Refusal::invalid(format!(
                "{tool}: arguments must be a JSON object"
            )));
        };
        if let Some(k) = given.keys().find(|k| t.frozen.contains_key(*k)) {
            return Err(Refusal::invalid(format!(
                "{tool}: argument `{k}` is fixed by the run and must not be passed"
            )));
        }
        let mut merged = given.clone();
        merged.extend(t.frozen.iter().map(|(k, v)| (k.clone(), v.clone())));
        let merged = Value::Object(merged);
        if let Some(e) = t.schema.iter_errors(&merged).next() {
            let at = e.instance_path.to_string();
            let at = if at.is_empty() {
                String::new()
            } else {
                format!(" at {at}")
            };
            return Err(Refusal::invalid(format!(
                "{tool}: arguments do not match the tool's schema{at}: {e}"
            )));
        }
        Ok(merged)
    }
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
    pub fn take(&mut self, tool: &str) -> Result<(), Refusal> {
        if self.used >= self.max {
            return Err(Refusal {
                code: "limit",
                message: format!(
                    "{tool}: call budget of {} calls for this script is used up; \
                     do fewer calls per script (aggregate, or split the work over several scripts)",
                    self.max
                ),
            });
        }
        self.used += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token::parse_snapshot;

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
                {"name": "t__session_write", "class": "write"},
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
                assert_eq!(e.code, code::TOOLS);
                assert_eq!(e.data.as_ref().unwrap()["tool"], tools[0]);
                e.reason().unwrap().to_string()
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

    fn call(ro: bool, declared: &[&str], tool: &str, args: Value) -> Result<Value, Refusal> {
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
            "denied"
        );
        assert_eq!(
            call(false, &["t__write"], "t__write", json!({"sn": "A1"})).unwrap(),
            json!({"sn": "A1", "tenant": "acme"})
        );
        // destructive and long_task: never.
        for t in ["t__destroy", "t__long"] {
            let r = call(false, &[], t, json!({})).unwrap_err();
            assert_eq!(r.code, "denied");
            assert!(r.message.contains("call it directly"), "{}", r.message);
        }
        // disabled tools and unknown tools: not provided.
        for t in ["t__off", "t__nope"] {
            let r = call(false, &[], t, json!({})).unwrap_err();
            assert_eq!(r.code, "denied");
            assert!(r.message.contains("not available"));
        }
        // write tools in a read-only run: not provided, even if (wrongly) listed.
        let (p, _) = Policy::plan(&snapshot("auto", true), &[]).unwrap();
        let r = p.check_call("t__write", &json!({})).unwrap_err();
        assert!(r.message.contains("read-only"), "{}", r.message);
        assert!(p.check_call("t__read", &json!({"sn": "x"})).is_ok());
    }

    #[test]
    fn arguments_are_checked_after_the_frozen_merge() {
        let r = call(false, &[], "t__read", json!({})).unwrap_err();
        assert_eq!(r.code, "invalid_arguments");
        assert!(r.message.contains("sn"), "{}", r.message);
        let r = call(false, &[], "t__read", json!({"sn": "A", "extra": 1})).unwrap_err();
        assert_eq!(r.code, "invalid_arguments");
        let r = call(false, &[], "t__read", json!({"sn": 5})).unwrap_err();
        assert!(r.message.contains("/sn"), "{}", r.message);
        let r = call(false, &["t__write"], "t__write", json!({"tenant": "evil"})).unwrap_err();
        assert_eq!(r.code, "invalid_arguments");
        assert!(r.message.contains("fixed by the run"));
        assert_eq!(
            call(false, &[], "t__read", json!(["A"])).unwrap_err().code,
            "invalid_arguments"
        );
    }

    #[test]
    fn invalid_schema_refuses_the_snapshot() {
        let s = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto",
            "tools": [{"name": "x", "class": "read", "input_schema": {"type": 12}}]}))
        .unwrap();
        let e = Policy::plan(&s, &[]).err().unwrap();
        assert_eq!(
            (e.code, e.reason()),
            (code::SNAPSHOT, Some("invalid_schema"))
        );
    }

    #[test]
    fn budget_refuses_the_call_after_max() {
        let mut b = Budget::new(2);
        assert!(b.take("t").is_ok());
        assert!(b.take("t").is_ok());
        assert_eq!(b.take("t").unwrap_err().code, "limit");
        assert_eq!(b.take("t").unwrap_err().code, "limit");
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
