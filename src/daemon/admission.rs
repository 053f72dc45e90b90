//! Step 1 of a start, admission: everything that decides whether a start may
//! go on without asking the engine and without a slot, and the effective
//! limits it gets. Its dependencies are narrow (the peers' keys and roots, the
//! revoked runs, the rules taken from the configuration at load, the stopping
//! flag): no store, no backend, no root needed to test it.

use crate::config::Config;
use crate::daemon::peers::{Peer, Peers};
use crate::policy::runs::RunKey;
use crate::policy::{Limits, Policy, StartPlan};
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::snapshot::Snapshot;
use crate::protocol::token::{RunClaims, Signed};
use crate::protocol::trace::TraceContext;
use crate::protocol::StartParams;
use crate::script::broker::RevokedRuns;
use crate::sys::{resolve_run_as, Identity, WorkspaceDir};
use std::sync::atomic::{AtomicBool, Ordering};

/// What admission decides with from the configuration and the start-up
/// preflight: taken once, when the daemon is made.
pub(crate) struct Rules {
    /// `server.max_message_bytes`: the longest script code.
    max_message_bytes: usize,
    /// `sandbox.run_as`: root engines' scripts' identity.
    run_as: String,
    /// `[scripts]`: the bounds a snapshot's limits may only tighten.
    scripts: crate::config::Scripts,
    /// `server.drain_s`, for a stopping daemon's refusal.
    drain_s: u64,
    /// Why no script may start on this host: limits required in force
    /// (`sandbox.require_enforced_limits`) that the preflight found not.
    unenforced: Option<Refused>,
}

impl Rules {
    pub(crate) fn new(cfg: &Config, preflight: &crate::sandbox::preflight::Preflight) -> Rules {
        Rules {
            max_message_bytes: cfg.server.max_message_bytes,
            run_as: cfg.sandbox.run_as.clone(),
            scripts: cfg.scripts.clone(),
            drain_s: cfg.server.drain_s,
            unenforced: preflight.refuse_unenforced(cfg).err(),
        }
    }
}

/// Admission with what it reads, borrowed from the daemon for one start.
pub(crate) struct Admission<'a> {
    pub(crate) peers: &'a Peers,
    pub(crate) revoked: &'a RevokedRuns,
    pub(crate) rules: &'a Rules,
    /// Set on SIGTERM: no new script starts.
    pub(crate) stopping: &'a AtomicBool,
}

/// A start that passed every check that needs no engine and no slot.
pub(crate) struct Admitted {
    pub(crate) claims: RunClaims,
    /// The run as revocation knows it: scoped to the engine entry whose key signed
    /// it (`Peers::run_key`), so one engine cannot revoke another's run.
    pub(crate) run_key: RunKey,
    pub(crate) workspace: WorkspaceDir,
    pub(crate) policy: Policy,
    pub(crate) plan: StartPlan,
    pub(crate) identity: Identity,
    /// The engine's trace context (`script.start`'s `traceparent`).
    pub(crate) trace: Option<TraceContext>,
    /// The daemon's `[scripts]` bounds, tightened by the snapshot's limits.
    pub(crate) limits: Limits,
}

impl Admission<'_> {
    /// The token's signature, with the key of the peer's engine entry.
    pub(crate) fn verify(&self, peer: Peer, token: &str) -> Result<Signed, Refused> {
        Signed::verify(token, self.peers.key_for(peer.engine()))
    }

    /// Refuse a start once the daemon is stopping. Checked at admission and
    /// again before a slot is reserved (an approval may take long).
    pub(crate) fn check_not_stopping(&self) -> Result<(), Refused> {
        if self.stopping.load(Ordering::SeqCst) {
            return Err(stopping(self.rules.drain_s));
        }
        Ok(())
    }

    /// The checks in their order, the first refusal wins: the stopping daemon;
    /// the token's claims, freshness and snapshot; the trace context; the
    /// revocation; the workspace (opened once, here); the plan; the code's
    /// size; the identity the script runs as, and whether it may reach and
    /// write the workspace; last, the host's limits.
    pub(crate) fn admit(
        &self,
        peer: Peer,
        p: &StartParams,
        signed: Signed,
    ) -> Result<Admitted, Refused> {
        self.check_not_stopping()?;
        let claims = signed.claims()?;
        claims.check_fresh(crate::time::now_unix())?;
        let trace = trace_of(p)?;
        let claims = claims.parse_snapshot()?;
        let run_key = self
            .peers
            .run_key(peer.engine(), peer.uid(), &claims.run_id);
        self.check_revoked(&run_key)?;
        let snap = &claims.snapshot;
        let workspace = self.open_workspace(peer, snap)?;
        let (policy, plan) = Policy::plan(snap, &p.tools)?;
        if p.code.len() > self.rules.max_message_bytes {
            return Err(Refused::invalid_params(
                "code is larger than max_message_bytes",
            ));
        }
        let identity = resolve_run_as(peer.uid(), peer.gid(), &self.rules.run_as)
            .map_err(|e| Refused::new(Reason::Identity, e.to_string()))?;
        self.check_writes(peer, &workspace, identity, snap.read_only)?;
        if let Some(refused) = &self.rules.unenforced {
            return Err(refused.clone());
        }
        let limits = Limits::effective(&self.rules.scripts, &snap.limits);
        Ok(Admitted {
            claims,
            run_key,
            workspace,
            policy,
            plan,
            identity,
            trace,
            limits,
        })
    }

    fn check_revoked(&self, run: &RunKey) -> Result<(), Refused> {
        if self.revoked.read().unwrap().contains(run) {
            return Err(Refused::new(
                Reason::Revoked,
                format!("run {} was revoked", run.run_id),
            ));
        }
        Ok(())
    }

    /// The workspace, opened once beneath the peer's roots, never following
    /// symlinks: everything later (the record, the sandbox's bind mount) uses
    /// this descriptor. Then: not another engine's per-uid directory.
    fn open_workspace(&self, peer: Peer, snap: &Snapshot) -> Result<WorkspaceDir, Refused> {
        let workspace = WorkspaceDir::open(&snap.workspace, &self.peers.roots_for(peer))
            .map_err(|e| Refused::new(workspace_reason(&e), e.to_string()).field("workspace"))?;
        self.check_engine_dir(peer, &workspace)?;
        Ok(workspace)
    }

    /// A per-uid directory `<root>/<uid>` belongs to the engine of that uid:
    /// another non-root engine cannot name a workspace in it, even with a valid
    /// token of the shared key.
    fn check_engine_dir(&self, peer: Peer, workspace: &WorkspaceDir) -> Result<(), Refused> {
        if peer.uid() == 0 || peer.engine().is_some() {
            return Ok(());
        }
        let roots = self.peers.roots().canonical_for(&workspace.path);
        match crate::policy::auth::engine_dir_owner(&workspace.path, &roots) {
            Some(owner) if owner != peer.uid() => Err(Refused::new(
                Reason::OtherEngine,
                format!(
                    "workspace {} lies in the directory of the engine with uid {owner}; uid {} uses its own, {}",
                    workspace.path.display(),
                    peer.uid(),
                    roots
                        .first()
                        .map(|r| r.join(peer.uid().to_string()).display().to_string())
                        .unwrap_or_default()
                ),
            )
            .field("workspace")),
            _ => Ok(()),
        }
    }

    /// May the script's identity reach and write the workspace? A non-root
    /// engine's script (its own uid) must be able to reach it the way a file
    /// system walk would (bwrap's bind by descriptor would not ask). The
    /// workspace is the script's to write (protocol §2), unless read-only; a
    /// read-only run still gets its record, `.agent/scripts/<id>`, which the
    /// daemon makes only where the engine's own uid could have, so a non-root
    /// engine needs the workspace writable, read-only or not. Root engines'
    /// read-only runs are unchanged.
    fn check_writes(
        &self,
        peer: Peer,
        workspace: &WorkspaceDir,
        identity: Identity,
        read_only: bool,
    ) -> Result<(), Refused> {
        if peer.uid() != 0 && !workspace.reachable_by(identity) {
            return Err(Refused::new(
                Reason::NotReachable,
                format!(
                    "workspace {}: uid {} may not search a directory above it (below the root)",
                    workspace.path.display(),
                    identity.uid
                ),
            )
            .field("workspace"));
        }
        let writable = workspace
            .writable_by(identity)
            .map_err(|e| Refused::internal(e.to_string()))?;
        if !writable && (!read_only || peer.uid() != 0) {
            return Err(self.not_writable(workspace, identity, peer, read_only));
        }
        Ok(())
    }

    fn not_writable(
        &self,
        workspace: &WorkspaceDir,
        identity: Identity,
        peer: Peer,
        read_only: bool,
    ) -> Refused {
        if read_only {
            return Refused::new(
                Reason::NotWritable,
                format!(
                    "workspace {} is not writable by uid {} (gid {}), this engine's own uid: even a read_only run \
                     gets its record .agent/scripts/<id> in the workspace, and the daemon makes it only where the \
                     engine could have itself; use a workspace of this uid (under its own directories), or make this one writable for it",
                    workspace.path.display(),
                    identity.uid,
                    identity.gid,
                ),
            )
            .field("workspace");
        }
        Refused::new(
            Reason::NotWritable,
            format!(
                "workspace {} is not writable by uid {} (gid {}), the identity this run's scripts have{}; \
                 chown the directory to that uid (or make it writable for it), or make the run read_only",
                workspace.path.display(),
                identity.uid,
                identity.gid,
                if peer.uid() == 0 {
                    format!(": scripts of root engines run as sandbox.run_as = {:?}", self.rules.run_as)
                } else {
                    ", the engine's own".to_string()
                }
            ),
        )
        .field("workspace")
    }
}

/// The engine's trace context, if it sent one (`traceparent`, and
/// `tracestate` only with it).
fn trace_of(p: &StartParams) -> Result<Option<TraceContext>, Refused> {
    match &p.traceparent {
        Some(tp) => TraceContext::parse(tp, p.tracestate.as_deref())
            .map(Some)
            .map_err(|e| Refused::invalid_params(format!("invalid params: {e}"))),
        None if p.tracestate.is_some() => Err(Refused::invalid_params(
            "invalid params: `tracestate` without `traceparent`",
        )),
        None => Ok(None),
    }
}

/// A `script.start` while the daemon drains for a stop or restart.
fn stopping(drain_s: u64) -> Refused {
    Refused::new(
        Reason::Stopping,
        format!(
            "scriptgated is stopping: it lets running scripts finish (up to server.drain_s = {drain_s} s) and starts no new ones; retry once it is back (socket activation starts it again on the next connection)"
        ),
    )
}

/// The reason of a workspace that cannot be used.
fn workspace_reason(e: &crate::sys::WorkspaceError) -> Reason {
    use crate::sys::WorkspaceError as W;
    match e {
        W::OutsideRoots(_) => Reason::OutsideRoots,
        W::IsRoot(_) => Reason::IsRoot,
        W::Symlink { .. } => Reason::Symlink,
        W::NotDirectory { .. } => Reason::NotDirectory,
        W::Unusable { .. } => Reason::WorkspaceMissing,
    }
}

#[cfg(test)]
mod tests {
    //! Admission on a temporary directory, as any user: one row per refusal
    //! reason, in admission's order, and what an admitted start gets. A test
    //! run as root gives the tree to a non-root uid and starts as that uid.
    use super::{Admission, Admitted, Rules};
    use crate::daemon::peers::{Peer, Peers};
    use crate::daemon::roots::Roots;
    use crate::policy::auth::Engines;
    use crate::policy::runs::{RunKey, Scope};
    use crate::protocol::refusal::{Reason, Refused};
    use crate::protocol::token;
    use crate::protocol::StartParams;
    use crate::script::broker::RevokedRuns;
    use serde_json::{json, Value};
    use std::os::unix::fs::PermissionsExt;
    use std::path::{Path, PathBuf};
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, RwLock};

    const KEY: &[u8] = b"admission-test-key-0123456789abcdef";
    /// The uid a test starts as when run as root.
    const NOBODY: u32 = 65534;

    /// A workspace root with a workspace `ws` in it, and admission's inputs.
    struct Rig {
        _tmp: tempfile::TempDir,
        root: PathBuf,
        peers: Peers,
        revoked: RevokedRuns,
        rules: Rules,
        stopping: AtomicBool,
        /// The peer: this process's uid, or `NOBODY` under root.
        uid: u32,
        gid: u32,
    }

    impl Rig {
        fn new() -> Rig {
            let tmp = tempfile::tempdir().unwrap();
            let root = std::fs::canonicalize(tmp.path()).unwrap().join("root");
            std::fs::create_dir(&root).unwrap();
            std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).unwrap();
            let (uid, gid) = if nix::unistd::geteuid().is_root() {
                (NOBODY, NOBODY)
            } else {
                (
                    nix::unistd::geteuid().as_raw(),
                    nix::unistd::getegid().as_raw(),
                )
            };
            let rig = Rig {
                peers: Peers::new(
                    KEY.to_vec(),
                    Engines::default(),
                    Roots::new(vec![root.clone()]),
                    vec![],
                ),
                revoked: Arc::new(RwLock::new(Default::default())),
                rules: Rules {
                    max_message_bytes: 1000,
                    run_as: "nobody".into(),
                    scripts: crate::config::Scripts::default(),
                    drain_s: 30,
                    unenforced: None,
                },
                stopping: AtomicBool::new(false),
                root,
                uid,
                gid,
                _tmp: tmp,
            };
            rig.dir("ws", 0o700);
            rig
        }

        /// A directory under the root, the peer's, with `mode`.
        fn dir(&self, rel: &str, mode: u32) -> PathBuf {
            let p = self.root.join(rel);
            std::fs::create_dir_all(&p).unwrap();
            self.give(&p);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        }

        fn give(&self, p: &Path) {
            if nix::unistd::geteuid().is_root() {
                std::os::unix::fs::lchown(p, Some(self.uid), Some(self.gid)).unwrap();
            }
        }

        fn admission(&self) -> Admission<'_> {
            Admission {
                peers: &self.peers,
                revoked: &self.revoked,
                rules: &self.rules,
                stopping: &self.stopping,
            }
        }

        fn peer(&self) -> Peer {
            Peer::for_test(self.uid, self.gid)
        }

        /// A snapshot of the workspace `rel` (absolute when it starts with /).
        fn snapshot(&self, rel: &str) -> Value {
            let ws = if rel.starts_with('/') {
                PathBuf::from(rel)
            } else {
                self.root.join(rel)
            };
            json!({"workspace": ws, "permission_mode": "auto", "tools": [
                {"name": "t__read", "class": "read", "input_schema": {"type": "object"}},
                {"name": "t__write", "class": "write", "input_schema": {"type": "object"}}]})
        }

        /// Admit a start of `snapshot` signed with the shared key, as `peer`.
        fn admit_as(
            &self,
            peer: Peer,
            snapshot: &Value,
            p: StartParams,
        ) -> Result<Admitted, Refused> {
            let token = token::mint(KEY, "run-1", None, snapshot, 60).unwrap();
            self.admit_token(peer, &token, p)
        }

        fn admit_token(
            &self,
            peer: Peer,
            token: &str,
            p: StartParams,
        ) -> Result<Admitted, Refused> {
            let a = self.admission();
            let signed = a.verify(peer, token)?;
            a.admit(
                peer,
                &StartParams {
                    token: token.into(),
                    ..p
                },
                signed,
            )
        }

        fn admit(&self, snapshot: &Value) -> Result<Admitted, Refused> {
            self.admit_as(self.peer(), snapshot, params())
        }

        fn reason(&self, snapshot: &Value) -> Reason {
            refused(self.admit(snapshot))
        }
    }

    fn params() -> StartParams {
        StartParams {
            token: String::new(),
            code: "print(1)".into(),
            tools: vec![],
            description: String::new(),
            traceparent: None,
            tracestate: None,
        }
    }

    fn refused(r: Result<Admitted, Refused>) -> Reason {
        match r {
            Ok(_) => panic!("admitted"),
            Err(e) => e.reason(),
        }
    }

    /// A token of claims that `token::mint` would not make.
    fn signed_claims(claims: Value) -> String {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(KEY),
        )
        .unwrap()
    }

    #[test]
    fn an_admitted_start_has_its_workspace_plan_identity_and_limits() {
        let rig = Rig::new();
        let mut snap = rig.snapshot("ws");
        // Tighter values hold; a looser one is ignored.
        snap["limits"] = json!({"timeout_s": 5, "max_calls": 1_000_000_000u64});
        let p = StartParams {
            tools: vec!["t__write".into()],
            ..params()
        };
        let a = rig.admit_as(rig.peer(), &snap, p).unwrap();
        let cfg = crate::config::Scripts::default();
        assert_eq!(a.limits.timeout_s, 5);
        assert_eq!(a.limits.max_calls, cfg.max_calls);
        assert_eq!(a.limits.memory_max_bytes, cfg.memory_max_bytes);
        assert_eq!(a.workspace.path, rig.root.join("ws"));
        assert_eq!((a.identity.uid, a.identity.gid), (rig.uid, rig.gid));
        assert_eq!(a.run_key, RunKey::new(Scope::Shared(rig.uid), "run-1"));
        assert_eq!(a.plan.declared.len(), 1);
        assert!(a.trace.is_none());
    }

    #[test]
    fn a_token_of_another_key_is_refused_as_its_signature() {
        let rig = Rig::new();
        let token = token::mint(b"another key", "run-1", None, &rig.snapshot("ws"), 60).unwrap();
        assert_eq!(
            refused(rig.admit_token(rig.peer(), &token, params())),
            Reason::Signature
        );
    }

    #[test]
    fn a_token_that_is_no_jwt_is_malformed() {
        let rig = Rig::new();
        assert_eq!(
            refused(rig.admit_token(rig.peer(), "not-a-token", params())),
            Reason::Malformed
        );
    }

    #[test]
    fn an_expired_token_is_refused_as_expired() {
        let rig = Rig::new();
        let token = token::mint(KEY, "run-1", None, &rig.snapshot("ws"), -10).unwrap();
        assert_eq!(
            refused(rig.admit_token(rig.peer(), &token, params())),
            Reason::Expired
        );
    }

    #[test]
    fn a_token_without_its_run_id_misses_a_claim() {
        let rig = Rig::new();
        let now = crate::time::now_unix();
        let token =
            signed_claims(json!({"iat": now, "exp": now + 60, "snapshot": rig.snapshot("ws")}));
        assert_eq!(
            refused(rig.admit_token(rig.peer(), &token, params())),
            Reason::MissingClaim
        );
    }

    #[test]
    fn a_snapshot_with_an_unknown_field_is_refused_not_dropped() {
        let rig = Rig::new();
        let mut snap = rig.snapshot("ws");
        snap["extra"] = json!(1);
        let now = crate::time::now_unix();
        let token = signed_claims(
            json!({"run_id": "run-1", "iat": now, "exp": now + 60, "snapshot": snap}),
        );
        assert_eq!(
            refused(rig.admit_token(rig.peer(), &token, params())),
            Reason::UnknownField
        );
    }

    #[test]
    fn a_stopping_daemon_admits_nothing() {
        let rig = Rig::new();
        rig.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let e = rig.admit(&rig.snapshot("ws")).err().unwrap();
        assert_eq!(e.reason(), Reason::Stopping);
        assert!(
            e.message().contains("server.drain_s = 30 s"),
            "{}",
            e.message()
        );
        assert_eq!(
            rig.admission().check_not_stopping().unwrap_err().reason(),
            Reason::Stopping
        );
    }

    #[test]
    fn a_bad_trace_context_is_invalid_params() {
        let rig = Rig::new();
        let snap = rig.snapshot("ws");
        let bad = StartParams {
            traceparent: Some("00-nothex-0000000000000001-01".into()),
            ..params()
        };
        assert_eq!(
            refused(rig.admit_as(rig.peer(), &snap, bad)),
            Reason::InvalidParams
        );
        let alone = StartParams {
            tracestate: Some("k=v".into()),
            ..params()
        };
        let e = rig.admit_as(rig.peer(), &snap, alone).err().unwrap();
        assert_eq!(e.reason(), Reason::InvalidParams);
        assert!(e.message().contains("`tracestate` without `traceparent`"));
        let good = StartParams {
            traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
            ..params()
        };
        let a = rig.admit_as(rig.peer(), &snap, good).unwrap();
        assert_eq!(
            a.trace.unwrap().trace_id,
            "0af7651916cd43dd8448eb211c80319c"
        );
    }

    #[test]
    fn a_revoked_run_is_refused_before_its_workspace_is_looked_at() {
        let rig = Rig::new();
        rig.revoked
            .write()
            .unwrap()
            .insert(RunKey::new(Scope::Shared(rig.uid), "run-1"));
        // Its workspace does not exist either: revocation is checked first.
        assert_eq!(rig.reason(&rig.snapshot("missing")), Reason::Revoked);
        // Another uid's run of the same id is another run.
        let other = Peer::for_test(rig.uid + 1, rig.gid);
        let r = rig.admit_as(other, &rig.snapshot("missing"), params());
        assert_ne!(refused(r), Reason::Revoked);
    }

    #[test]
    fn a_workspace_outside_the_roots_is_refused() {
        let rig = Rig::new();
        let outside = rig.root.parent().unwrap().join("elsewhere");
        std::fs::create_dir(&outside).unwrap();
        assert_eq!(
            rig.reason(&rig.snapshot(outside.to_str().unwrap())),
            Reason::OutsideRoots
        );
        let up = format!("{}/ws/../ws", rig.root.display());
        assert_eq!(rig.reason(&rig.snapshot(&up)), Reason::OutsideRoots);
    }

    #[test]
    fn the_root_itself_is_no_workspace() {
        let rig = Rig::new();
        assert_eq!(
            rig.reason(&rig.snapshot(rig.root.to_str().unwrap())),
            Reason::IsRoot
        );
    }

    #[test]
    fn a_symlink_on_the_way_is_refused_not_followed() {
        let rig = Rig::new();
        std::os::unix::fs::symlink(rig.root.join("ws"), rig.root.join("link")).unwrap();
        assert_eq!(rig.reason(&rig.snapshot("link")), Reason::Symlink);
    }

    #[test]
    fn a_file_is_no_workspace() {
        let rig = Rig::new();
        std::fs::write(rig.root.join("file"), "x").unwrap();
        assert_eq!(rig.reason(&rig.snapshot("file")), Reason::NotDirectory);
    }

    #[test]
    fn a_missing_workspace_is_refused() {
        let rig = Rig::new();
        assert_eq!(
            rig.reason(&rig.snapshot("missing")),
            Reason::WorkspaceMissing
        );
    }

    #[test]
    fn another_engines_per_uid_directory_is_refused_its_own_is_not() {
        let rig = Rig::new();
        let other = rig.uid + 1;
        rig.dir(&format!("{other}/ws"), 0o700);
        let e = rig
            .admit(&rig.snapshot(&format!("{other}/ws")))
            .err()
            .unwrap();
        assert_eq!(e.reason(), Reason::OtherEngine);
        assert!(
            e.message().contains(&format!("uid {other}")),
            "{}",
            e.message()
        );
        rig.dir(&format!("{}/ws", rig.uid), 0o700);
        assert!(rig.admit(&rig.snapshot(&format!("{}/ws", rig.uid))).is_ok());
    }

    #[test]
    fn a_declared_tool_the_snapshot_lacks_is_refused() {
        let rig = Rig::new();
        let p = StartParams {
            tools: vec!["t__nope".into()],
            ..params()
        };
        assert_eq!(
            refused(rig.admit_as(rig.peer(), &rig.snapshot("ws"), p)),
            Reason::Unknown
        );
    }

    #[test]
    fn code_longer_than_a_message_is_refused() {
        let rig = Rig::new();
        let code = |len: usize| StartParams {
            code: "x".repeat(len),
            ..params()
        };
        let e = rig
            .admit_as(rig.peer(), &rig.snapshot("ws"), code(1001))
            .err()
            .unwrap();
        assert_eq!(e.reason(), Reason::InvalidParams);
        assert!(e.message().contains("max_message_bytes"));
        // max_message_bytes (1000) itself is no longer than a message.
        assert!(rig
            .admit_as(rig.peer(), &rig.snapshot("ws"), code(1000))
            .is_ok());
    }

    #[test]
    fn a_root_engines_script_needs_a_run_as_user_that_exists() {
        let mut rig = Rig::new();
        rig.rules.run_as = "scriptgate-no-such-user".into();
        let root = Peer::for_test(0, 0);
        let e = rig
            .admit_as(root, &rig.snapshot("ws"), params())
            .err()
            .unwrap();
        assert_eq!(e.reason(), Reason::Identity);
        assert!(
            e.message().contains("scriptgate-no-such-user"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn a_root_engine_names_any_per_uid_directory_and_needs_writes_only_read_write() {
        let rig = Rig::new();
        let root = Peer::for_test(0, 0);
        // In the rig's uid's per-uid directory, not writable by the script
        // (run_as nobody).
        let ws = format!("{}/ro", rig.uid);
        rig.dir(&ws, 0o500);
        let mut snap = rig.snapshot(&ws);
        snap["read_only"] = json!(true);
        let a = rig.admit_as(root, &snap, params()).unwrap();
        assert_eq!(a.run_key, RunKey::new(Scope::Shared(0), "run-1"));
        // Read-write, its script must be able to write it.
        let e = rig
            .admit_as(root, &rig.snapshot(&ws), params())
            .err()
            .unwrap();
        assert_eq!(e.reason(), Reason::NotWritable);
        assert!(e.message().contains("sandbox.run_as"), "{}", e.message());
    }

    #[test]
    fn a_workspace_the_script_cannot_write_is_refused_read_only_or_not() {
        let rig = Rig::new();
        rig.dir("ro", 0o500);
        let e = rig.admit(&rig.snapshot("ro")).err().unwrap();
        assert_eq!(e.reason(), Reason::NotWritable);
        assert!(
            e.message().contains("or make the run read_only"),
            "{}",
            e.message()
        );
        // A non-root engine's read-only run still gets its record there.
        let mut snap = rig.snapshot("ro");
        snap["read_only"] = json!(true);
        let e = rig.admit(&snap).err().unwrap();
        assert_eq!(e.reason(), Reason::NotWritable);
        assert!(
            e.message().contains("even a read_only run"),
            "{}",
            e.message()
        );
    }

    #[test]
    fn a_workspace_below_a_directory_the_script_cannot_search_is_not_reachable() {
        // Only root can open a directory its script's uid may not search.
        if !nix::unistd::geteuid().is_root() {
            return;
        }
        let rig = Rig::new();
        rig.dir("closed/ws", 0o700);
        let closed = rig.root.join("closed");
        std::os::unix::fs::lchown(&closed, Some(0), Some(0)).unwrap();
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(rig.reason(&rig.snapshot("closed/ws")), Reason::NotReachable);
    }

    #[test]
    fn limits_required_in_force_that_are_not_refuse_every_start_last() {
        let mut rig = Rig::new();
        rig.rules.unenforced = Some(Refused::new(Reason::LimitsNotEnforced, "memory.max"));
        assert_eq!(rig.reason(&rig.snapshot("ws")), Reason::LimitsNotEnforced);
        // Any other refusal comes first.
        assert_eq!(
            rig.reason(&rig.snapshot("missing")),
            Reason::WorkspaceMissing
        );
    }

    #[test]
    fn every_start_admits_again_without_a_store_or_a_slot() {
        // Admission holds nothing: the same start is admitted twice, and the
        // workspace is opened afresh each time.
        let rig = Rig::new();
        let snap = rig.snapshot("ws");
        let a = rig.admit(&snap).unwrap();
        let b = rig.admit(&snap).unwrap();
        assert_eq!(a.workspace.path, b.workspace.path);
        assert!(a.plan.declared.is_empty());
    }
}
