//! Why a start is refused, as a type. One [`Reason`] per `data.reason` of
//! scriptgate-protocol(7) that the daemon refuses a start or a connection with,
//! each with the JSON-RPC code it comes with; a [`Refused`] carries one with
//! its message and what it names (a field, a claim, a tool). The daemon keeps
//! the type up to its edge: the audit row, the journal and the refusal limiter
//! read the variant, and only the answer on the wire is JSON.

use crate::protocol::{code, RpcError};
use serde_json::{Map, Value};

macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident = $wire:literal, $code:ident;)*) => {
        /// A refusal's reason: its `data.reason` on the wire and its code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
            /// Malformed parameters (-32602): no `data.reason` on the wire.
            InvalidParams,
            /// The daemon failed (-32603): no `data.reason` on the wire.
            Internal,
        }

        impl Reason {
            /// Every reason that the wire names, in the man page's order.
            pub const NAMED: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The JSON-RPC error code it comes with.
            pub const fn code(self) -> i64 {
                match self {
                    $(Reason::$variant => code::$code,)*
                    Reason::InvalidParams => code::INVALID_PARAMS,
                    Reason::Internal => code::INTERNAL,
                }
            }

            /// Its `data.reason`, when the wire names it.
            pub const fn wire(self) -> Option<&'static str> {
                match self {
                    $(Reason::$variant => Some($wire),)*
                    Reason::InvalidParams | Reason::Internal => None,
                }
            }
        }
    };
}

reasons! {
    // -32010: the token.
    Malformed = "malformed", TOKEN;
    Signature = "signature", TOKEN;
    Algorithm = "algorithm", TOKEN;
    Expired = "expired", TOKEN;
    Revoked = "revoked", TOKEN;
    MissingClaim = "missing_claim", TOKEN;
    // -32011: the snapshot and its workspace.
    MissingField = "missing_field", SNAPSHOT;
    UnknownField = "unknown_field", SNAPSHOT;
    InvalidValue = "invalid_value", SNAPSHOT;
    DuplicateTool = "duplicate_tool", SNAPSHOT;
    NotAbsolute = "not_absolute", SNAPSHOT;
    WorkspaceMissing = "workspace_missing", SNAPSHOT;
    NotDirectory = "not_directory", SNAPSHOT;
    OutsideRoots = "outside_roots", SNAPSHOT;
    IsRoot = "is_root", SNAPSHOT;
    Symlink = "symlink", SNAPSHOT;
    NotWritable = "not_writable", SNAPSHOT;
    InvalidSchema = "invalid_schema", SNAPSHOT;
    OtherEngine = "other_engine", SNAPSHOT;
    NotReachable = "not_reachable", SNAPSHOT;
    // -32012: a declared tool.
    Unknown = "unknown", TOOLS;
    NotWrite = "not_write", TOOLS;
    Destructive = "destructive", TOOLS;
    LongTask = "long_task", TOOLS;
    Disabled = "disabled", TOOLS;
    ReadOnly = "read_only", TOOLS;
    // -32013: the approval.
    Denied = "denied", APPROVAL;
    /// No answer within `scripts.approval_timeout_s`.
    Timeout = "timeout", APPROVAL;
    // -32015: no room now.
    Busy = "busy", BUSY;
    ApprovalsPending = "approvals_pending", BUSY;
    Stopping = "stopping", BUSY;
    TooManyConnections = "too_many_connections", BUSY;
    // -32001: the peer.
    PeerNotAllowed = "peer_not_allowed", PEER_NOT_ALLOWED;
    AdminOnly = "admin_only", PEER_NOT_ALLOWED;
    EngineAmbiguous = "engine_ambiguous", PEER_NOT_ALLOWED;
    // -32603 with a reason: the host.
    LimitsNotEnforced = "limits_not_enforced", INTERNAL;
    NoSpace = "no_space", INTERNAL;
    Identity = "identity", INTERNAL;
    /// The sandbox could not be spawned; `data.script_id` names the script,
    /// which has its result and audit record.
    Spawn = "spawn", INTERNAL;
    /// The daemon was started by this connection and cannot run (its config,
    /// key or state directory); the queued connections are told so.
    DaemonCannotStart = "daemon_cannot_start", INTERNAL;
}

impl Reason {
    /// How the audit store and the refusal counts name it: its wire name, or
    /// `invalid_params` / `internal`.
    pub const fn as_str(self) -> &'static str {
        match (self, self.wire()) {
            (_, Some(w)) => w,
            (Reason::InvalidParams, None) => "invalid_params",
            (_, None) => "internal",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A refused start (or connection): why, in words and as a [`Reason`], and what
/// it names.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Refused {
    reason: Reason,
    message: String,
    /// `data.field` (a snapshot field, or a token claim).
    field: Option<String>,
    /// `data.tool` (a declared tool).
    tool: Option<String>,
    /// `data.script_id` (a script that started and failed).
    script_id: Option<String>,
}

impl Refused {
    pub fn new(reason: Reason, message: impl Into<String>) -> Self {
        Refused {
            reason,
            message: message.into(),
            field: None,
            tool: None,
            script_id: None,
        }
    }
    /// Naming the snapshot field or token claim at fault (`data.field`).
    pub fn field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }
    /// Naming the declared tool at fault (`data.tool`).
    pub fn tool(mut self, tool: impl Into<String>) -> Self {
        self.tool = Some(tool.into());
        self
    }
    /// Naming the script that was made and failed to start (`data.script_id`).
    pub fn script(mut self, script_id: impl Into<String>) -> Self {
        self.script_id = Some(script_id.into());
        self
    }
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(Reason::InvalidParams, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Reason::Internal, message)
    }
    pub fn reason(&self) -> Reason {
        self.reason
    }
    pub fn code(&self) -> i64 {
        self.reason.code()
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    pub fn named_field(&self) -> Option<&str> {
        self.field.as_deref()
    }
    pub fn named_tool(&self) -> Option<&str> {
        self.tool.as_deref()
    }
}

impl From<Refused> for RpcError {
    fn from(r: Refused) -> RpcError {
        let code = r.code();
        let Some(reason) = r.reason.wire() else {
            return RpcError::new(code, r.message);
        };
        let mut data = Map::new();
        data.insert("reason".into(), reason.into());
        if let Some(f) = r.field {
            data.insert("field".into(), f.into());
        }
        if let Some(t) = r.tool {
            data.insert("tool".into(), t.into());
        }
        if let Some(id) = r.script_id {
            data.insert("script_id".into(), id.into());
        }
        RpcError::with_data(code, r.message, Value::Object(data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_wire_shape_has_the_reason_and_what_it_names() {
        let e = RpcError::from(
            Refused::new(Reason::MissingField, "snapshot: tools[2].input_schema: …")
                .field("tools[2].input_schema"),
        );
        assert_eq!(e.code, code::SNAPSHOT);
        assert_eq!(
            e.data,
            Some(json!({"reason": "missing_field", "field": "tools[2].input_schema"}))
        );
        let e = RpcError::from(Refused::new(Reason::ReadOnly, "m").tool("fleet__reboot"));
        assert_eq!(
            (e.code, e.data),
            (
                code::TOOLS,
                Some(json!({"reason": "read_only", "tool": "fleet__reboot"}))
            )
        );
        let e = RpcError::from(Refused::invalid_params("code is larger"));
        assert_eq!((e.code, e.data), (code::INVALID_PARAMS, None));
        assert_eq!(Reason::InvalidParams.as_str(), "invalid_params");
        assert_eq!(Reason::Internal.as_str(), "internal");
    }

    /// The man page is the contract: every reason the daemon can send is named
    /// in scriptgate-protocol(7), and each under the code it comes with.
    #[test]
    fn every_reason_is_in_the_man_page() {
        let man = include_str!("../../man/scriptgate-protocol.7");
        for r in Reason::NAMED {
            let w = r.wire().unwrap();
            // Named in bold (`.B`, `.BR`, `.RB`), as the man page names a
            // value, as a whole word (`timeout` is not `approval_timeout_s`).
            let word = |l: &str| {
                l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .any(|t| t == w)
            };
            assert!(
                man.lines()
                    .any(|l| (l.starts_with(".B") || l.starts_with(".RB")) && word(l)),
                "scriptgate-protocol(7) does not name {w}"
            );
        }
        let mut seen = std::collections::HashSet::new();
        for r in Reason::NAMED {
            assert!(seen.insert(r.wire()), "{r} named twice");
        }
    }
}
