//! Step 2 of a start: one `approval.request` for all the declared write tools,
//! or why none is needed.

use crate::daemon::admission::Admitted;
use crate::daemon::Daemon;
use crate::policy::StartPlan;
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::snapshot::PermissionMode;
use crate::protocol::{ApprovalRequest, ApprovalTool, StartParams};
use crate::script::engine::{EngineLink, LinkError};
use std::time::Duration;

/// How a start came to be allowed. The audit row keeps it as a string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approval {
    /// The engine answered `allow_once` to `approval.request`.
    AllowOnce,
    /// No write tool was declared: nothing to approve.
    NotNeeded,
    /// `permission_mode: auto` asks nothing.
    Auto,
    /// Every declared write tool is in the snapshot's `session_allowed`.
    SessionAllowed,
}

impl Approval {
    pub fn as_str(self) -> &'static str {
        match self {
            Approval::AllowOnce => "allow_once",
            Approval::NotNeeded => "not_needed",
            Approval::Auto => "auto",
            Approval::SessionAllowed => "session_allowed",
        }
    }

    /// Why a start that needs no `approval.request` is allowed; `None` when it
    /// needs one.
    pub fn without_request(plan: &StartPlan, mode: PermissionMode) -> Option<Approval> {
        if plan.needs_approval {
            None
        } else if plan.declared.is_empty() {
            Some(Approval::NotNeeded)
        } else if mode == PermissionMode::Auto {
            Some(Approval::Auto)
        } else {
            Some(Approval::SessionAllowed)
        }
    }
}

impl Daemon {
    /// Step 2: ask the engine when the plan needs it (counted against the
    /// connection's bound while it waits), else say why no one is asked.
    pub(crate) async fn seek_approval(
        &self,
        live: &crate::daemon::Live,
        engine: &dyn EngineLink,
        script_id: &str,
        a: &Admitted,
        p: &StartParams,
    ) -> Result<Approval, Refused> {
        if let Some(approval) =
            Approval::without_request(&a.plan, a.claims.snapshot.permission_mode)
        {
            return Ok(approval);
        }
        let _waiting = self.registry.await_approval(engine.id())?;
        let request = ApprovalRequest {
            script_id: script_id.to_string(),
            run_id: a.claims.run_id.clone(),
            description: p.description.clone(),
            code: p.code.clone(),
            tools: a
                .plan
                .declared
                .iter()
                .map(|(name, class)| ApprovalTool {
                    name: name.clone(),
                    class: class.as_str().into(),
                })
                .collect(),
            traceparent: a.trace.as_ref().map(|t| t.child_traceparent()),
            tracestate: a.trace.as_ref().and_then(|t| t.state.clone()),
        };
        let timeout = Duration::from_secs(live.cfg.scripts.approval_timeout_s);
        match engine.approval_request(request, timeout).await {
            Ok(true) => Ok(Approval::AllowOnce),
            Ok(false) => Err(approval_error(
                Reason::Denied,
                "the engine denied approval for the script's write tools",
            )),
            Err(LinkError::Timeout) => Err(approval_error(
                Reason::Timeout,
                &format!(
                    "approval was not answered within approval_timeout_s = {}",
                    timeout.as_secs()
                ),
            )),
            Err(e) => Err(approval_error(
                Reason::Denied,
                &format!("approval failed: {e}"),
            )),
        }
    }
}

fn approval_error(reason: Reason, message: &str) -> Refused {
    Refused::new(reason, message)
}

#[cfg(test)]
mod tests {
    use super::Approval;
    use crate::policy::StartPlan;
    use crate::protocol::snapshot::{PermissionMode, ToolClass};

    #[test]
    fn approval_says_why_a_start_may_run_as_the_audit_spells_it() {
        let plan = |needs_approval, declared: &[&str]| StartPlan {
            needs_approval,
            declared: declared
                .iter()
                .map(|n| (n.to_string(), ToolClass::Write))
                .collect(),
        };
        let cases = [
            (plan(true, &["w"]), PermissionMode::Approval, None),
            (
                plan(false, &[]),
                PermissionMode::Approval,
                Some("not_needed"),
            ),
            (plan(false, &[]), PermissionMode::Auto, Some("not_needed")),
            (plan(false, &["w"]), PermissionMode::Auto, Some("auto")),
            (
                plan(false, &["w"]),
                PermissionMode::Approval,
                Some("session_allowed"),
            ),
        ];
        for (plan, mode, want) in cases {
            assert_eq!(
                Approval::without_request(&plan, mode).map(Approval::as_str),
                want,
                "{plan:?} {mode:?}"
            );
        }
        assert_eq!(Approval::AllowOnce.as_str(), "allow_once");
    }
}
