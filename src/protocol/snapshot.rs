//! The authorization snapshot a run token carries (protocol §2): its types and
//! the checks that do not depend on the host (field names, tool names, schemas,
//! an absolute workspace). The workspace's existence and roots are checked
//! where it is opened (`sys::WorkspaceDir`).

use crate::protocol::refusal::{Reason, Refused};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::PathBuf;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolClass {
    Read,
    Write,
    Destructive,
    LongTask,
}

impl ToolClass {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolClass::Read => "read",
            ToolClass::Write => "write",
            ToolClass::Destructive => "destructive",
            ToolClass::LongTask => "long_task",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PermissionMode {
    Approval,
    Auto,
}

/// One tool of the snapshot.
///
/// ```json
/// {"name": "fleet__reboot_device", "class": "write", "enabled": true,
///  "input_schema": {"type": "object", "properties": {"sn": {"type": "string"}}},
///  "frozen": {"tenant": "acme"}}
/// ```
///
/// `input_schema` is required for every tool a script can call (enabled `read` and
/// `write` tools; [`parse_snapshot`] refuses a snapshot without it); `destructive`,
/// `long_task` and disabled tools may leave it out. The daemon treats the schema as
/// closed: see `policy::closed_schema`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolSpec {
    pub name: String,
    pub class: ToolClass,
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<Value>,
    #[serde(default)]
    pub frozen: Map<String, Value>,
    /// What the model reads about the tool (`run.describe` gives it, clipped).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

impl ToolSpec {
    /// Can a script ever call this tool? Enabled `read` and `write` tools only (a
    /// `write` tool in a read-only run is still counted: the snapshot's validity
    /// does not depend on `read_only`).
    pub fn script_callable(&self) -> bool {
        self.enabled && matches!(self.class, ToolClass::Read | ToolClass::Write)
    }
}

fn yes() -> bool {
    true
}

/// The snapshot error for a script-callable tool without `input_schema`.
pub fn missing_schema_error(i: usize, tool: &ToolSpec) -> Refused {
    snapshot_error(
        Reason::MissingField,
        &format!("tools[{i}].input_schema"),
        format!(
            "snapshot: tools[{i}].input_schema: {} tool {} has no input_schema; every tool a script can call needs one \
             (to accept any object: {{\"type\": \"object\", \"additionalProperties\": true}})",
            tool.class.as_str(),
            tool.name
        ),
    )
}

/// Optional per-run limits; each can only tighten the daemon's configured value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotLimits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_calls: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrency: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tasks_max: Option<u64>,
}

/// The authorization snapshot (protocol §2).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    pub workspace: PathBuf,
    #[serde(default)]
    pub read_only: bool,
    pub permission_mode: PermissionMode,
    #[serde(default)]
    pub session_allowed: Vec<String>,
    pub tools: Vec<ToolSpec>,
    #[serde(default)]
    pub limits: SnapshotLimits,
}

pub(crate) fn snapshot_error(reason: Reason, field: &str, message: impl Into<String>) -> Refused {
    Refused::new(reason, message).field(field)
}

/// Deserialize the snapshot, naming the offending field on error.
pub fn parse_snapshot(v: Value) -> Result<Snapshot, Refused> {
    let snap: Snapshot = serde_path_to_error::deserialize(v).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.inner().to_string();
        let reason = if inner.starts_with("missing field") {
            Reason::MissingField
        } else if inner.starts_with("unknown field") {
            Reason::UnknownField
        } else {
            Reason::InvalidValue
        };
        // The path of an unknown field already ends with its name; that of a
        // missing one is its parent's.
        let field = match (reason, inner.split('`').nth(1)) {
            (Reason::MissingField | Reason::UnknownField, Some(name)) if field == "." => {
                name.to_string()
            }
            (Reason::MissingField, Some(name)) => format!("{field}.{name}"),
            _ => field,
        };
        snapshot_error(reason, &field, format!("snapshot: {field}: {inner}"))
    })?;
    let mut seen = std::collections::HashSet::new();
    for (i, t) in snap.tools.iter().enumerate() {
        if t.name.is_empty()
            || t.name.len() > 128
            || t.name.chars().any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(snapshot_error(
                Reason::InvalidValue,
                &format!("tools[{i}].name"),
                "tool names must be 1..128 visible characters",
            ));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(snapshot_error(
                Reason::DuplicateTool,
                &format!("tools[{i}].name"),
                format!("tool {} is listed twice", t.name),
            ));
        }
        if t.input_schema.is_none() && t.script_callable() {
            return Err(missing_schema_error(i, t));
        }
    }
    if !snap.workspace.is_absolute() {
        return Err(snapshot_error(
            Reason::NotAbsolute,
            "workspace",
            "workspace must be an absolute path",
        ));
    }
    Ok(snap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{code, RpcError};
    use serde_json::json;

    #[test]
    fn snapshot_errors_name_the_field() {
        let e = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto", "tools": [{"name": "x", "class": "sideways"}]})).map_err(RpcError::from).unwrap_err();
        assert_eq!(e.code, code::SNAPSHOT);
        assert_eq!(e.data.as_ref().unwrap()["field"], "tools[0].class");
        let e = parse_snapshot(json!({"permission_mode": "auto", "tools": []}))
            .map_err(RpcError::from)
            .unwrap_err();
        assert_eq!(
            (e.reason(), e.data.as_ref().unwrap()["field"].as_str()),
            (Some("missing_field"), Some("workspace"))
        );
        let e = parse_snapshot(json!({"workspace": "rel", "permission_mode": "auto", "tools": []}))
            .map_err(RpcError::from)
            .unwrap_err();
        assert_eq!(e.reason(), Some("not_absolute"));
        let e = parse_snapshot(
            json!({"workspace": "/w", "permission_mode": "auto", "tools": [], "root": true}),
        )
        .map_err(RpcError::from)
        .unwrap_err();
        assert_eq!(e.reason(), Some("unknown_field"));
        assert_eq!(e.data.as_ref().unwrap()["field"], "root");
        assert!(
            e.message
                .starts_with("snapshot: root: unknown field `root`"),
            "{}",
            e.message
        );
        for (snap, field) in [
            (
                json!({"workspace": "/w", "permission_mode": "auto", "tools": [
                    {"name": "x", "class": "destructive", "foo": 1}]}),
                "tools[0].foo",
            ),
            (
                json!({"workspace": "/w", "permission_mode": "auto", "tools": [],
                    "limits": {"bogus": 1}}),
                "limits.bogus",
            ),
            (
                json!({"workspace": "/w", "permission_mode": "auto", "tools": [{"class": "destructive"}]}),
                "tools[0].name",
            ),
        ] {
            let e = parse_snapshot(snap).map_err(RpcError::from).unwrap_err();
            assert_eq!(e.data.as_ref().unwrap()["field"], field, "{}", e.message);
            assert!(!e.message.contains(&format!("{field}.")), "{}", e.message);
        }
        let e = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto", "tools": [{"name": "x", "class": "destructive"}, {"name": "x", "class": "destructive"}]})).map_err(RpcError::from).unwrap_err();
        assert_eq!(e.reason(), Some("duplicate_tool"));
    }

    #[test]
    fn callable_tools_need_an_input_schema() {
        let tools = |t: Value| json!({"workspace": "/w", "permission_mode": "auto", "tools": [t]});
        for class in ["read", "write"] {
            for schema in [None, Some(Value::Null)] {
                let mut t = json!({"name": "x", "class": class});
                if let Some(s) = &schema {
                    t["input_schema"] = s.clone();
                }
                let e = parse_snapshot(tools(t))
                    .map_err(RpcError::from)
                    .unwrap_err();
                assert_eq!(e.code, code::SNAPSHOT);
                assert_eq!(
                    e.data,
                    Some(json!({"reason": "missing_field", "field": "tools[0].input_schema"}))
                );
            }
            assert!(parse_snapshot(tools(
                json!({"name": "x", "class": class, "enabled": false})
            ))
            .is_ok());
        }
        for class in ["destructive", "long_task"] {
            assert!(parse_snapshot(tools(json!({"name": "x", "class": class}))).is_ok());
        }
        // A missing schema is not written back as null.
        let s = parse_snapshot(tools(json!({"name": "x", "class": "long_task"}))).unwrap();
        assert_eq!(
            serde_json::to_value(&s.tools[0]).unwrap(),
            json!({"name": "x", "class": "long_task", "enabled": true, "frozen": {}})
        );
    }
}
