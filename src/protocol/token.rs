//! Run tokens (JWT, HS256 only): their signature and their claims.
//!
//! Verification order matters: the header's `alg` is checked before the signature so
//! that `none` and every other algorithm is refused as `algorithm`, never as a
//! generic parse error; claims are checked only after the signature holds.
//!
//! The check comes in steps, so that a caller keeps what each step proved:
//! [`Signed::verify`] (algorithm, signature) → [`Signed::run`] (the run the token
//! names, for auditing a refusal) → [`Signed::claims`] (their shapes) →
//! [`Claims::check_fresh`] (expiry; `run.revoke` skips it) →
//! [`Claims::parse_snapshot`]. [`verify`] does all of them.
//!
//! The snapshot's types live in [`crate::protocol::snapshot`].

use crate::protocol::snapshot::{parse_snapshot, Snapshot};

use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::RpcError;
use crate::time::now_unix;
use base64::Engine as _;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde_json::{json, Map, Value};

/// Claims of a run token whose signature holds. `S` is the snapshot: the raw
/// claim ([`Value`]) until [`Claims::parse_snapshot`], then a [`Snapshot`].
#[derive(Debug, Clone)]
pub struct Claims<S = Snapshot> {
    pub run_id: String,
    pub exp: i64,
    pub iat: i64,
    pub runner: Option<String>,
    pub snapshot: S,
}

/// Verified claims of a run token.
pub type RunClaims = Claims<Snapshot>;

/// The run a signed token names: refusals are audited under it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunRef {
    pub run_id: String,
    pub runner: Option<String>,
}

fn token_error(reason: Reason, message: impl Into<String>) -> Refused {
    Refused::new(reason, message)
}

/// Check signature, algorithm and claims. `check_exp = false` is for `run.revoke`,
/// which must work with a token that has already expired.
pub fn verify(token: &str, key: &[u8], check_exp: bool) -> Result<RunClaims, Refused> {
    let claims = Signed::verify(token, key)?.claims()?;
    if check_exp {
        claims.check_fresh(now_unix())?;
    }
    claims.parse_snapshot()
}

/// A token whose algorithm and signature hold: its claims, not yet checked.
#[derive(Debug, Clone)]
pub struct Signed(Value);

impl Signed {
    /// Check the algorithm, then the signature against `key`.
    pub fn verify(token: &str, key: &[u8]) -> Result<Signed, Refused> {
        verify_signature(token, key).map(Signed)
    }

    /// The run the token names, whatever else is wrong with it (expired, a bad
    /// snapshot, a malformed claim): its signature holds, so the name is the
    /// engine's.
    pub fn run(&self) -> Option<RunRef> {
        let run_id = self.0.get("run_id")?.as_str()?.to_string();
        let runner = self
            .0
            .get("runner")
            .and_then(Value::as_str)
            .map(str::to_string);
        Some(RunRef { run_id, runner })
    }

    /// The claims' presence and shapes; not the expiry, not the snapshot's content.
    pub fn claims(self) -> Result<Claims<Value>, Refused> {
        let Value::Object(mut c) = self.0 else {
            return Err(token_error(
                Reason::Malformed,
                "token claims are not a JSON object",
            ));
        };
        let run_id = match c.remove("run_id") {
            Some(Value::String(s)) if !s.is_empty() => {
                if let Some(why) = run_id_problem(&s) {
                    return Err(claim_error(Reason::Malformed, "run_id", &why));
                }
                s
            }
            Some(_) => {
                return Err(claim_error(
                    Reason::Malformed,
                    "run_id",
                    "claim `run_id` must be a non-empty string",
                ))
            }
            None => {
                return Err(claim_error(
                    Reason::MissingClaim,
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
                    Reason::Malformed,
                    "runner",
                    "claim `runner` must be a string",
                ))
            }
        };
        let snapshot = match c.remove("snapshot") {
            Some(v @ Value::Object(_)) => v,
            Some(_) => {
                return Err(claim_error(
                    Reason::Malformed,
                    "snapshot",
                    "claim `snapshot` must be an object",
                ))
            }
            None => {
                return Err(claim_error(
                    Reason::MissingClaim,
                    "snapshot",
                    "token has no `snapshot` claim",
                ))
            }
        };
        Ok(Claims {
            run_id,
            exp,
            iat,
            runner,
            snapshot,
        })
    }
}

impl<S> Claims<S> {
    /// The run these claims name.
    pub fn run(&self) -> RunRef {
        RunRef {
            run_id: self.run_id.clone(),
            runner: self.runner.clone(),
        }
    }

    /// Is the token still valid at `now` (Unix seconds)? `exp` is exclusive.
    pub fn check_fresh(&self, now: i64) -> Result<(), Refused> {
        if self.exp <= now {
            return Err(token_error(
                Reason::Expired,
                format!("run token of run {} expired", self.run_id),
            ));
        }
        Ok(())
    }
}

impl Claims<Value> {
    /// Parse and check the snapshot claim (after the expiry, so that an expired
    /// token is refused as `expired` whatever its snapshot).
    pub fn parse_snapshot(self) -> Result<RunClaims, Refused> {
        Ok(Claims {
            snapshot: parse_snapshot(self.snapshot)?,
            run_id: self.run_id,
            exp: self.exp,
            iat: self.iat,
            runner: self.runner,
        })
    }
}

fn claim_error(reason: Reason, claim: &str, message: &str) -> Refused {
    Refused::new(reason, message).field(claim)
}

fn numeric_date(c: &mut Map<String, Value>, name: &str) -> Result<i64, Refused> {
    match c.remove(name) {
        Some(Value::Number(n)) => n
            .as_i64()
            .or_else(|| n.as_f64().map(|f| f as i64))
            .ok_or_else(|| claim_error(Reason::Malformed, name, "NumericDate out of range")),
        Some(_) => Err(claim_error(
            Reason::Malformed,
            name,
            &format!("claim `{name}` must be a NumericDate"),
        )),
        None => Err(claim_error(
            Reason::MissingClaim,
            name,
            &format!("token has no `{name}` claim"),
        )),
    }
}

fn verify_signature(token: &str, key: &[u8]) -> Result<Value, Refused> {
    let mut parts = token.split('.');
    let (Some(h), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(token_error(
            Reason::Malformed,
            "a run token is a JWS compact serialization: three base64url parts",
        ));
    };
    let header: Value = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(h.trim_end_matches('='))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .ok_or_else(|| token_error(Reason::Malformed, "token header is not base64url JSON"))?;
    match header.get("alg").and_then(Value::as_str) {
        Some("HS256") => {}
        Some(other) => {
            return Err(token_error(
                Reason::Algorithm,
                format!("token algorithm {other:?} refused; only HS256 is accepted"),
            ))
        }
        None => {
            return Err(token_error(
                Reason::Algorithm,
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
                Reason::Signature,
                "token signature does not match the daemon's key",
            ),
            jsonwebtoken::errors::ErrorKind::InvalidAlgorithm => token_error(
                Reason::Algorithm,
                "token algorithm refused; only HS256 is accepted",
            ),
            _ => token_error(Reason::Malformed, format!("token cannot be decoded: {e}")),
        }),
    }
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

/// The longest run id a token may carry, in bytes (scriptgate-protocol(7)).
pub const MAX_RUN_ID_BYTES: usize = 256;

/// Why a run id is refused: longer than [`MAX_RUN_ID_BYTES`], or holding a
/// control character (it is printed in logs, the journal and `scriptgate ps`).
pub fn run_id_problem(run_id: &str) -> Option<String> {
    if run_id.len() > MAX_RUN_ID_BYTES {
        return Some(format!(
            "claim `run_id` is {} bytes; at most {MAX_RUN_ID_BYTES} are allowed",
            run_id.len()
        ));
    }
    run_id.chars().find(|c| c.is_control()).map(|c| {
        format!(
            "claim `run_id` holds the control character {:?}; a run id is printable text",
            c
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::snapshot::ToolClass;
    use crate::protocol::{code, RpcError};

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
                .map_err(RpcError::from)
                .unwrap_err()
                .reason(),
            Some("signature")
        );
        let expired = mint(KEY, "run-1", None, &snap(), -5).unwrap();
        assert_eq!(
            verify(&expired, KEY, true)
                .map_err(RpcError::from)
                .unwrap_err()
                .reason(),
            Some("expired")
        );
        assert!(verify(&expired, KEY, false).is_ok());
        let none = format!(
            "{}.{}.",
            b64(&json!({"alg": "none", "typ": "JWT"})),
            b64(&json!({"run_id": "x"}))
        );
        assert_eq!(
            verify(&none, KEY, true)
                .map_err(RpcError::from)
                .unwrap_err()
                .reason(),
            Some("algorithm")
        );
        let hs512 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS512),
            &json!({"run_id": "x"}),
            &EncodingKey::from_secret(KEY),
        )
        .unwrap();
        assert_eq!(
            verify(&hs512, KEY, true)
                .map_err(RpcError::from)
                .unwrap_err()
                .reason(),
            Some("algorithm")
        );
        assert_eq!(
            verify("abc", KEY, true)
                .map_err(RpcError::from)
                .unwrap_err()
                .reason(),
            Some("malformed")
        );
        let no_run = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &json!({"exp": now_unix() + 60, "iat": 0, "snapshot": snap()}),
            &EncodingKey::from_secret(KEY),
        )
        .unwrap();
        let e = verify(&no_run, KEY, true)
            .map_err(RpcError::from)
            .unwrap_err();
        assert_eq!(
            (e.reason(), e.data.as_ref().unwrap()["field"].as_str()),
            (Some("missing_claim"), Some("run_id"))
        );
        // An empty run id names no run, as a number does not.
        for run_id in [json!(""), json!(7)] {
            let t = jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &json!({"run_id": run_id, "exp": now_unix() + 60, "iat": 0, "snapshot": snap()}),
                &EncodingKey::from_secret(KEY),
            )
            .unwrap();
            let e = verify(&t, KEY, true).map_err(RpcError::from).unwrap_err();
            assert_eq!(
                (e.reason(), e.data.as_ref().unwrap()["field"].as_str()),
                (Some("malformed"), Some("run_id")),
                "{run_id}"
            );
            assert!(e.message.contains("non-empty string"), "{}", e.message);
        }
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
            verify(&forged, KEY, true)
                .map_err(RpcError::from)
                .unwrap_err()
                .reason(),
            Some("signature")
        );
    }

    #[test]
    fn claims_survive_expiry_and_freshness_is_its_own_check() {
        let expired = mint(KEY, "run-1", Some("r"), &snap(), -5).unwrap();
        let signed = Signed::verify(&expired, KEY).unwrap();
        assert_eq!(
            signed.run(),
            Some(RunRef {
                run_id: "run-1".into(),
                runner: Some("r".into())
            })
        );
        let claims = signed.claims().unwrap();
        assert_eq!(claims.run().run_id, "run-1");
        let e = claims
            .check_fresh(now_unix())
            .map_err(RpcError::from)
            .unwrap_err();
        assert_eq!(
            (e.reason(), e.message.as_str()),
            (Some("expired"), "run token of run run-1 expired")
        );
        assert!(claims.check_fresh(claims.exp - 1).is_ok());
        assert!(claims.check_fresh(claims.exp).is_err(), "exp is exclusive");
        assert!(claims.parse_snapshot().is_ok());
    }

    #[test]
    fn a_signed_token_names_its_run_even_with_a_bad_snapshot() {
        let t = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &json!({"run_id": "run-2", "exp": now_unix() + 60, "iat": 0,
                    "snapshot": {"workspace": "rel", "permission_mode": "auto", "tools": []}}),
            &EncodingKey::from_secret(KEY),
        )
        .unwrap();
        let signed = Signed::verify(&t, KEY).unwrap();
        assert_eq!(signed.run().unwrap().run_id, "run-2");
        let e = signed
            .claims()
            .unwrap()
            .parse_snapshot()
            .map_err(RpcError::from)
            .unwrap_err();
        assert_eq!(e.reason(), Some("not_absolute"));
        assert!(Signed::verify(&t, b"another key another key another k").is_err());
    }

    #[test]
    fn mint_checks_the_snapshot() {
        // No token for a snapshot the daemon refuses.
        let e = mint(
            KEY,
            "r",
            None,
            &json!({"workspace": "/w", "permission_mode": "auto", "tools": [
                {"name": "x", "class": "read"}]}),
            60,
        )
        .unwrap_err();
        assert_eq!(e.reason(), Some("missing_field"));
    }

    #[test]
    fn run_ids_are_bounded_printable_text() {
        assert_eq!(run_id_problem("run-42"), None);
        assert_eq!(run_id_problem(&"r".repeat(MAX_RUN_ID_BYTES)), None);
        assert_eq!(run_id_problem("gw run 9 \u{e9}"), None);
        let long = run_id_problem(&"r".repeat(MAX_RUN_ID_BYTES + 1)).unwrap();
        assert!(long.contains("257 bytes; at most 256"), "{long}");
        for bad in ["a\nb", "a\u{0}", "a\u{1b}[2J", "a\u{85}"] {
            let why = run_id_problem(bad).unwrap();
            assert!(why.contains("control character"), "{why}");
        }
        let t = mint(KEY, "run\n1", None, &snap(), 60).unwrap();
        let e = verify(&t, KEY, true).map_err(RpcError::from).unwrap_err();
        assert_eq!((e.reason(), e.code), (Some("malformed"), code::TOKEN));
    }
}
