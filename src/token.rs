//! Run tokens (JWT, HS256 only) and the authorization snapshot they carry.
//!
//! Verification order matters: the header's `alg` is checked before the signature so
//! that `none` and every other algorithm is refused as `algorithm`, never as a
//! generic parse error; claims are checked only after the signature holds.

use crate::protocol::{code, RpcError};
use base64::Engine as _;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
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
pub fn missing_schema_error(i: usize, tool: &ToolSpec) -> RpcError {
    snapshot_error(
        "missing_field",
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

/// Verified claims of a run token.
#[derive(Debug, Clone)]
pub struct RunClaims {
    pub run_id: String,
    pub exp: i64,
    pub iat: i64,
    pub runner: Option<String>,
    pub snapshot: Snapshot,
}

pub fn now_unix() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn token_error(reason: &str, message: impl Into<String>) -> RpcError {
    RpcError::with_data(code::TOKEN, message, json!({"reason": reason}))
}

fn snapshot_error(reason: &str, field: &str, message: impl Into<String>) -> RpcError {
    RpcError::with_data(
        code::SNAPSHOT,
        message,
        json!({"reason": reason, "field": field}),
    )
}

/// Check signature, algorithm and claims. `check_exp = false` is for `run.revoke`,
/// which must work with a token that has already expired.
pub fn verify(token: &str, key: &[u8], check_exp: bool) -> Result<RunClaims, RpcError> {
    let claims = verify_signature(token, key)?;
    let Value::Object(mut c) = claims else {
        return Err(token_error(
            "malformed",
            "token claims are not a JSON object",
        ));
    };
    let run_id = match c.remove("run_id") {
        Some(Value::String(s)) if !s.is_empty() => s,
        Some(_) => {
            return Err(claim_error(
                "malformed",
                "run_id",
                "claim `run_id` must be a non-empty string",
            ))
        }
        None => {
            return Err(claim_error(
                "missing_claim",
                "run_id",
                "token has no `run_id` claim",
            ))
        }
    };
    let exp = numeric_date(&mut c, "exp")?;
    let iat = numeric_date(&mut c, "iat")?;
    let runner = match c.remove("runner") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(claim_error(
                "malformed",
                "runner",
                "claim `runner` must be a string",
            ))
        }
    };
    let snapshot = match c.remove("snapshot") {
        Some(v @ Value::Object(_)) => v,
        Some(_) => {
            return Err(claim_error(
                "malformed",
                "snapshot",
                "claim `snapshot` must be an object",
            ))
        }
        None => {
            return Err(claim_error(
                "missing_claim",
                "snapshot",
                "token has no `snapshot` claim",
            ))
        }
    };
    if check_exp && exp <= now_unix() {
        return Err(token_error(
            "expired",
            format!("run token of run {run_id} expired"),
        ));
    }
    let snapshot = parse_snapshot(snapshot)?;
    Ok(RunClaims {
        run_id,
        exp,
        iat,
        runner,
        snapshot,
    })
}

/// The run a token names when its signature holds, whatever else is wrong with
/// it (expired, a bad snapshot): refusals are audited under that run.
pub fn signed_run(token: &str, key: &[u8]) -> Option<(String, Option<String>)> {
    let claims = verify_signature(token, key).ok()?;
    let run_id = claims.get("run_id")?.as_str()?.to_string();
    let runner = claims
        .get("runner")
        .and_then(Value::as_str)
        .map(str::to_string);
    Some((run_id, runner))
}

fn claim_error(reason: &str, claim: &str, message: &str) -> RpcError {
    RpcError::with_data(
        code::TOKEN,
        message,
        json!({"reason": reason, "field": claim}),
    )
}

fn numeric_date(c: &mut Map<String, Value>, name: &str) -> Result<i64, RpcError> {
    match c.remove(name) {
        Some(Value::Number(n)) => n
            .as_i64()
            .or_else(|| n.as_f64().map(|f| f as i64))
            .ok_or_else(|| claim_error("malformed", name, "NumericDate out of range")),
        Some(_) => Err(claim_error(
            "malformed",
            name,
            &format!("claim `{name}` must be a NumericDate"),
        )),
        None => Err(claim_error(
            "missing_claim",
            name,
            &format!("token has no `{name}` claim"),
        )),
    }
}

fn verify_signature(token: &str, key: &[u8]) -> Result<Value, RpcError> {
    let mut parts = token.split('.');
    let (Some(h), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(token_error(
            "malformed",
            "a run token is a JWS compact serialization: three base64url parts",
        ));
    };
    let header: Value = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(h.trim_end_matches('='))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| token_error("malformed", "token header is not base64url JSON"))?;
    match header.get("alg").and_then(Value::as_str) {
        Some("HS256") => {}
        Some(other) => {
            return Err(token_error(
                "algorithm",
                format!("token algorithm {other:?} refused; only HS256 is accepted"),
            ))
        }
        None => {
            return Err(token_error(
                "algorithm",
                "token header has no `alg`; only HS256 is accepted",
            ))
        }
    }
    let mut v = Validation::new(Algorithm::HS256);
    v.required_spec_claims.clear();
    v.validate_exp = false;
    v.validate_nbf = false;
    v.validate_aud = false;
    v.leeway = 0;
    match jsonwebtoken::decode::<Value>(token, &DecodingKey::from_secret(key), &v) {
        Ok(data) => Ok(data.claims),
        Err(e) => Err(match e.kind() {
            jsonwebtoken::errors::ErrorKind::InvalidSignature => token_error(
                "signature",
                "token signature does not match the daemon's key",
            ),
            jsonwebtoken::errors::ErrorKind::InvalidAlgorithm => token_error(
                "algorithm",
                "token algorithm refused; only HS256 is accepted",
            ),
            _ => token_error("malformed", format!("token cannot be decoded: {e}")),
        }),
    }
}

/// Deserialize the snapshot, naming the offending field on error.
pub fn parse_snapshot(v: Value) -> Result<Snapshot, RpcError> {
    let snap: Snapshot = serde_path_to_error::deserialize(v).map_err(|e| {
        let field = e.path().to_string();
        let inner = e.inner().to_string();
        let reason = if inner.starts_with("missing field") {
            "missing_field"
        } else if inner.starts_with("unknown field") {
            "unknown_field"
        } else {
            "invalid_value"
        };
        // The path of an unknown field already ends with its name; that of a
        // missing one is its parent's.
        let field = match (reason, inner.split('`').nth(1)) {
            ("missing_field", Some(name)) | ("unknown_field", Some(name)) if field == "." => {
                name.to_string()
            }
            ("missing_field", Some(name)) => format!("{field}.{name}"),
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
                "invalid_value",
                &format!("tools[{i}].name"),
                "tool names must be 1..128 visible characters",
            ));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(snapshot_error(
                "duplicate_tool",
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
            "not_absolute",
            "workspace",
            "workspace must be an absolute path",
        ));
    }
    Ok(snap)
}

/// Mint a token (the reference for engine authors; `scriptgate token mint`).
pub fn mint(
    key: &[u8],
    run_id: &str,
    runner: Option<&str>,
    snapshot: &Value,
    ttl_s: i64,
) -> Result<String, RpcError> {
    parse_snapshot(snapshot.clone())?;
    let now = now_unix();
    let mut claims =
        json!({"run_id": run_id, "iat": now, "exp": now + ttl_s, "snapshot": snapshot});
    if let Some(r) = runner {
        claims["runner"] = json!(r);
    }
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(key),
    )
    .map_err(|e| RpcError::internal(format!("cannot sign token: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    fn snap() -> Value {
        json!({"workspace": "/tmp", "permission_mode": "auto", "tools": [
            {"name": "a__read", "class": "read", "input_schema": {"type": "object"}}]})
    }

    fn b64(v: &Value) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string())
    }

    #[test]
    fn round_trip() {
        let t = mint(KEY, "run-1", Some("r"), &snap(), 60).unwrap();
        let c = verify(&t, KEY, true).unwrap();
        assert_eq!(c.run_id, "run-1");
        assert_eq!(c.runner.as_deref(), Some("r"));
        assert_eq!(c.snapshot.tools[0].class, ToolClass::Read);
        assert!(c.snapshot.tools[0].enabled);
    }

    #[test]
    fn refusals_have_the_protocol_reasons() {
        let t = mint(KEY, "run-1", None, &snap(), 60).unwrap();
        assert_eq!(
            verify(&t, b"another key another key another k", true)
                .unwrap_err()
                .reason(),
            Some("signature")
        );
        let expired = mint(KEY, "run-1", None, &snap(), -5).unwrap();
        assert_eq!(
            verify(&expired, KEY, true).unwrap_err().reason(),
            Some("expired")
        );
        assert!(verify(&expired, KEY, false).is_ok());
        let none = format!(
            "{}.{}.",
            b64(&json!({"alg": "none", "typ": "JWT"})),
            b64(&json!({"run_id": "x"}))
        );
        assert_eq!(
            verify(&none, KEY, true).unwrap_err().reason(),
            Some("algorithm")
        );
        let hs512 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS512),
            &json!({"run_id": "x"}),
            &EncodingKey::from_secret(KEY),
        )
        .unwrap();
        assert_eq!(
            verify(&hs512, KEY, true).unwrap_err().reason(),
            Some("algorithm")
        );
        assert_eq!(
            verify("abc", KEY, true).unwrap_err().reason(),
            Some("malformed")
        );
        let no_run = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &json!({"exp": now_unix() + 60, "iat": 0, "snapshot": snap()}),
            &EncodingKey::from_secret(KEY),
        )
        .unwrap();
        let e = verify(&no_run, KEY, true).unwrap_err();
        assert_eq!(
            (e.reason(), e.data.as_ref().unwrap()["field"].as_str()),
            (Some("missing_claim"), Some("run_id"))
        );
    }

    #[test]
    fn tampered_snapshot_breaks_the_signature() {
        let t = mint(KEY, "run-1", None, &snap(), 60).unwrap();
        let parts: Vec<&str> = t.split('.').collect();
        let mut claims: Value = serde_json::from_slice(
            &base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(parts[1])
                .unwrap(),
        )
        .unwrap();
        claims["snapshot"]["tools"][0]["class"] = json!("write");
        let forged = format!("{}.{}.{}", parts[0], b64(&claims), parts[2]);
        assert_eq!(
            verify(&forged, KEY, true).unwrap_err().reason(),
            Some("signature")
        );
    }

    #[test]
    fn snapshot_errors_name_the_field() {
        let e = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto", "tools": [{"name": "x", "class": "sideways"}]})).unwrap_err();
        assert_eq!(e.code, code::SNAPSHOT);
        assert_eq!(e.data.as_ref().unwrap()["field"], "tools[0].class");
        let e = parse_snapshot(json!({"permission_mode": "auto", "tools": []})).unwrap_err();
        assert_eq!(
            (e.reason(), e.data.as_ref().unwrap()["field"].as_str()),
            (Some("missing_field"), Some("workspace"))
        );
        let e = parse_snapshot(json!({"workspace": "rel", "permission_mode": "auto", "tools": []}))
            .unwrap_err();
        assert_eq!(e.reason(), Some("not_absolute"));
        let e = parse_snapshot(
            json!({"workspace": "/w", "permission_mode": "auto", "tools": [], "root": true}),
        )
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
            let e = parse_snapshot(snap).unwrap_err();
            assert_eq!(e.data.as_ref().unwrap()["field"], field, "{}", e.message);
            assert!(!e.message.contains(&format!("{field}.")), "{}", e.message);
        }
        let e = parse_snapshot(json!({"workspace": "/w", "permission_mode": "auto", "tools": [{"name": "x", "class": "destructive"}, {"name": "x", "class": "destructive"}]})).unwrap_err();
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
                let e = parse_snapshot(tools(t)).unwrap_err();
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
        // mint checks the snapshot too: no token for a snapshot the daemon refuses.
        let e = mint(
            KEY,
            "r",
            None,
            &tools(json!({"name": "x", "class": "read"})),
            60,
        )
        .unwrap_err();
        assert_eq!(e.reason(), Some("missing_field"));
        // A missing schema is not written back as null.
        let s = parse_snapshot(tools(json!({"name": "x", "class": "long_task"}))).unwrap();
        assert_eq!(
            serde_json::to_value(&s.tools[0]).unwrap(),
            json!({"name": "x", "class": "long_task", "enabled": true, "frozen": {}})
        );
    }
}
