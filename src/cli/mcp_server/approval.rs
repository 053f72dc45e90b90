//! The one approval of a script's declared write tools, in MCP 2026-07-28, where
//! a server may no longer send requests: the first `tools/call` is answered with
//! an `InputRequiredResult` holding the approval form and a `requestState`
//! sealed by this process (rmcp's codec: HMAC-SHA256 under a key made at start
//! and never stored); the client's retry with the user's answer starts the script.
//!
//! The sealed state binds a digest of what was approved (the code, the declared
//! tools, the description and the permission mode), the client it was asked of,
//! an expiry, and a nonce that is used once: a state presented again never starts
//! a second script; it answers with the script the first one started (a client
//! re-issuing a request whose stream broke gets the same script, not a second
//! run of its writes).

use super::scripts::Principal;
use crate::protocol::snapshot::PermissionMode;
use rmcp::model::{InputRequest, InputRequiredResult, InputResponses};
use rmcp::model::{RequestStateCodec, RequestStateError, SealOptions};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long an approval may wait for the user's answer.
pub(super) const GRANT_TTL: Duration = Duration::from_secs(15 * 60);
/// Used grants remembered at once (each is a script started within
/// `GRANT_TTL`); past it, new answers are refused until old grants expire.
pub(super) const MAX_USED: usize = 4096;
/// The key of the one input request.
const KEY: &str = "approval";

/// What an approval is for: its digest binds the code, the declared tools, the
/// description and the mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Subject([u8; 32]);

impl Subject {
    pub(super) fn of(
        code: &str,
        tools: &[String],
        description: &str,
        mode: PermissionMode,
    ) -> Subject {
        let canonical =
            json!({"code": code, "tools": tools, "description": description, "mode": mode});
        Subject(Sha256::digest(canonical.to_string().as_bytes()).into())
    }

    fn hex(&self) -> String {
        hex(&self.0)
    }

    pub(super) fn bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

/// The sealed part of a `requestState`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Sealed {
    /// The nonce, used once.
    n: String,
    /// The subject's digest.
    s: String,
    /// The client it was asked of.
    p: String,
}

/// Why a retry with a `requestState` starts nothing.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Refusal {
    Forged,
    Expired,
    OtherClient,
    Edited,
    Full,
}

impl Refusal {
    pub(super) fn message(&self) -> String {
        match self {
            Refusal::Forged => "script refused: the approval state (requestState) does not verify: it was altered, made up, or issued by another scriptgate mcp process (one that restarted, say); call run_script again to be asked again".into(),
            Refusal::Expired => format!("script refused: the approval expired (an answer is taken for {} minutes after it is asked); call run_script again to be asked again", GRANT_TTL.as_secs() / 60),
            Refusal::OtherClient => "script refused: this approval was asked of another client; it is valid only for the client it was asked of".into(),
            Refusal::Edited => "script refused: the script, its declared tools, its description or the permission mode differ from what was approved; call run_script again to be asked about this script".into(),
            Refusal::Full => format!("script refused: {MAX_USED} approvals were answered in the last {} minutes, the most this process remembers; try again later", GRANT_TTL.as_secs() / 60),
        }
    }
}

/// A grant whose state verified: its nonce.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Nonce(String);

/// A verified grant's nonce, first or again.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Redeemed {
    /// First use: the answer decides.
    First,
    /// Used before; the script it started, if any yet.
    Again(Option<String>),
}

pub(super) struct Grants {
    codec: RequestStateCodec,
    used: Mutex<HashMap<Nonce, Used>>,
    max_used: usize,
    ttl: Duration,
}

struct Used {
    script: Option<String>,
    until: Instant,
}

/// Why the grants' sealing key could not be made.
#[derive(Debug, thiserror::Error)]
pub(super) enum GrantsError {
    #[error("random key: {0}")]
    Random(getrandom::Error),
    #[error("{0}")]
    Codec(#[from] rmcp::model::RequestStateError),
}

impl Grants {
    pub(super) fn new() -> Result<Grants, GrantsError> {
        let mut key = vec![0u8; 32];
        getrandom::getrandom(&mut key).map_err(GrantsError::Random)?;
        Ok(Grants {
            codec: RequestStateCodec::try_new(key)?,
            used: Mutex::default(),
            max_used: MAX_USED,
            ttl: GRANT_TTL,
        })
    }

    /// The `InputRequiredResult` that asks the user: the form, and the sealed state.
    pub(super) fn ask(
        &self,
        who: &Principal,
        subject: Subject,
        tools: &[(String, String)],
        description: &str,
        code: &str,
    ) -> InputRequiredResult {
        let mut n = [0u8; 16];
        let _ = getrandom::getrandom(&mut n);
        let sealed = Sealed {
            n: hex(&n),
            s: subject.hex(),
            p: who.as_str().to_string(),
        };
        let state = self
            .codec
            .seal_json_with(&sealed, &SealOptions::new().ttl(self.ttl))
            .expect("a grant serializes");
        let request: InputRequest = serde_json::from_value(json!({
            "method": "elicitation/create",
            "params": super::ui::form_value(tools, description, code),
        }))
        .expect("the approval form is an elicitation request");
        InputRequiredResult::new(
            Some([(KEY.to_string(), request)].into_iter().collect()),
            Some(state),
        )
    }

    /// Verify a `requestState` for this client and this subject.
    pub(super) fn open(
        &self,
        state: &str,
        who: &Principal,
        subject: Subject,
    ) -> Result<Nonce, Refusal> {
        let sealed: Sealed = self.codec.open_json(state).map_err(|e| match e {
            RequestStateError::Expired => Refusal::Expired,
            _ => Refusal::Forged,
        })?;
        if sealed.p != who.as_str() {
            return Err(Refusal::OtherClient);
        }
        if sealed.s != subject.hex() {
            return Err(Refusal::Edited);
        }
        Ok(Nonce(sealed.n))
    }

    /// Use a verified grant's nonce: first, or again.
    pub(super) fn redeem(&self, nonce: &Nonce) -> Result<Redeemed, Refusal> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(u) = used.get(nonce) {
            return Ok(Redeemed::Again(u.script.clone()));
        }
        let now = Instant::now();
        used.retain(|_, u| u.until > now);
        if used.len() >= self.max_used {
            return Err(Refusal::Full);
        }
        used.insert(
            nonce.clone(),
            Used {
                script: None,
                until: now + self.ttl,
            },
        );
        Ok(Redeemed::First)
    }

    /// The script a used grant started.
    pub(super) fn bind(&self, nonce: &Nonce, script_id: &str) {
        if let Some(u) = self
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(nonce)
        {
            u.script = Some(script_id.to_string());
        }
    }
}

/// The user's answer in a retry's `inputResponses`: allowed only by
/// `{"action": "accept", "content": {"allow": true}}`, the boolean. `None` when
/// the retry carries no answer (ask again).
pub(super) fn answer(responses: Option<&InputResponses>) -> Option<Result<(), String>> {
    let r = responses?.get(KEY)?;
    let action = r.get("action").and_then(Value::as_str).unwrap_or("");
    let allow = r.get("content").and_then(|c| c.get("allow"));
    Some(match (action, allow) {
        ("accept", Some(Value::Bool(true))) => Ok(()),
        ("accept", Some(Value::Bool(false))) => {
            Err("the user did not allow the write tools".into())
        }
        ("accept", Some(other)) => Err(format!(
            "the answer's allow is {}, not the boolean true",
            crate::text::escape(&clip(&other.to_string()))
        )),
        ("accept", None) => Err("the answer has no allow".into()),
        ("decline", _) => Err("the user declined".into()),
        ("cancel", _) => Err("the user cancelled the approval".into()),
        (a, _) => Err(format!(
            "the answer's action is {:?}, not accept",
            crate::text::escape(&clip(a))
        )),
    })
}

fn clip(s: &str) -> String {
    s.chars().take(40).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subject(code: &str) -> Subject {
        Subject::of(
            code,
            &["srv__reboot".into()],
            "reboot",
            PermissionMode::Approval,
        )
    }

    fn state_of(r: &InputRequiredResult) -> String {
        serde_json::to_value(r).unwrap()["requestState"]
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_grant_opens_for_its_client_and_subject_only_and_is_used_once() {
        let g = Grants::new().unwrap();
        let (me, other) = (Principal::new("local:1000"), Principal::new("http:abc"));
        let tools = [("srv__reboot".to_string(), "write".to_string())];
        let asked = g.ask(&me, subject("x()"), &tools, "reboot", "x()");
        let v = serde_json::to_value(&asked).unwrap();
        assert_eq!(v["resultType"], "input_required");
        assert_eq!(
            v["inputRequests"]["approval"]["method"],
            "elicitation/create"
        );
        let state = state_of(&asked);
        assert_eq!(
            g.open(&state, &other, subject("x()")),
            Err(Refusal::OtherClient)
        );
        assert_eq!(g.open(&state, &me, subject("y()")), Err(Refusal::Edited));
        let mut forged = state.clone();
        forged.replace_range(forged.len() - 3.., "AAA");
        assert_eq!(g.open(&forged, &me, subject("x()")), Err(Refusal::Forged));
        assert_eq!(
            Grants::new().unwrap().open(&state, &me, subject("x()")),
            Err(Refusal::Forged),
            "another process's key"
        );
        let n = g.open(&state, &me, subject("x()")).unwrap();
        assert_eq!(g.redeem(&n), Ok(Redeemed::First));
        assert_eq!(g.redeem(&n), Ok(Redeemed::Again(None)));
        g.bind(&n, "0123456789abcdef");
        assert_eq!(
            g.redeem(&n),
            Ok(Redeemed::Again(Some("0123456789abcdef".into())))
        );
    }

    #[test]
    fn an_expired_grant_is_refused_as_such() {
        let mut g = Grants::new().unwrap();
        g.ttl = Duration::from_millis(1);
        let me = Principal::new("local:1000");
        let tools = [("t".to_string(), "write".to_string())];
        let s = state_of(&g.ask(&me, subject("x()"), &tools, "d", "x()"));
        // The expiry is in whole milliseconds: 3 ms is past it.
        std::thread::sleep(Duration::from_millis(3));
        assert_eq!(g.open(&s, &me, subject("x()")), Err(Refusal::Expired));
    }

    #[test]
    fn the_used_grants_are_bounded() {
        let mut g = Grants::new().unwrap();
        g.max_used = 3;
        let me = Principal::new("local:1000");
        let tools = [("t".to_string(), "write".to_string())];
        let mut nonces = vec![];
        for i in 0..4 {
            let code = format!("x({i})");
            let s = state_of(&g.ask(&me, subject(&code), &tools, "d", &code));
            nonces.push(g.open(&s, &me, subject(&code)).unwrap());
        }
        for n in &nonces[..3] {
            assert_eq!(g.redeem(n), Ok(Redeemed::First));
        }
        assert_eq!(g.redeem(&nonces[3]), Err(Refusal::Full));
        assert_eq!(g.used.lock().unwrap().len(), 3);
    }

    #[test]
    fn only_the_boolean_true_allows() {
        let r =
            |v: Value| -> InputResponses { [("approval".to_string(), v)].into_iter().collect() };
        assert_eq!(answer(None), None);
        assert_eq!(answer(Some(&InputResponses::new())), None);
        assert_eq!(
            answer(Some(&r(
                json!({"action": "accept", "content": {"allow": true}})
            ))),
            Some(Ok(()))
        );
        for bad in [
            json!({"action": "accept", "content": {"allow": "true"}}),
            json!({"action": "accept", "content": {"allow": 1}}),
            json!({"action": "accept", "content": {"allow": false}}),
            json!({"action": "accept", "content": {}}),
            json!({"action": "decline"}),
            json!({"action": "cancel"}),
            json!({"action": "\u{1b}[2J", "content": {"allow": true}}),
        ] {
            let got = answer(Some(&r(bad.clone())));
            assert!(matches!(got, Some(Err(_))), "{bad}: {got:?}");
            assert!(!got.unwrap().unwrap_err().contains('\u{1b}'));
        }
    }
}
