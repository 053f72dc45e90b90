//! Which run a token names: a run id in the scope of whoever signed it (an
//! `[[auth.engine]]` entry, or the shared key and the peer's uid), and the runs
//! revoked, bounded per scope. Pure: the daemon keeps the set, the audit store
//! keeps its rows.

use std::collections::HashMap;

/// Whose run ids a run id is one of. A token names a run by a string the engine
/// chooses; the daemon scopes it by who signed it, so that no string an engine can
/// put in a token names another engine's run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Scope {
    /// An `[[auth.engine]]` entry (its label, `[[auth.engine]] user = "gw"`):
    /// its own key signed the token.
    Entry(String),
    /// `auth.token_key_file`, which every unbound engine may read: scoped further
    /// by the peer's uid (0: root).
    Shared(u32),
    /// Revocations stored before scopes existed (a bare run id): they keep
    /// refusing the run for every peer of `auth.token_key_file`, as they did.
    AnyShared,
}

impl Scope {
    /// As the audit store keeps it (a column of its own, apart from the run id).
    pub fn to_db(&self) -> String {
        match self {
            Scope::Entry(label) => format!("entry:{label}"),
            Scope::Shared(uid) => format!("uid:{uid}"),
            Scope::AnyShared => "shared:*".into(),
        }
    }

    pub fn from_db(s: &str) -> Option<Scope> {
        if let Some(l) = s.strip_prefix("entry:") {
            return Some(Scope::Entry(l.to_string()));
        }
        if let Some(u) = s.strip_prefix("uid:") {
            return u.parse().ok().map(Scope::Shared);
        }
        (s == "shared:*").then_some(Scope::AnyShared)
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Scope::Entry(label) => f.write_str(label),
            Scope::Shared(0) => f.write_str("root (auth.token_key_file)"),
            Scope::Shared(uid) => write!(f, "uid {uid} (auth.token_key_file)"),
            Scope::AnyShared => f.write_str("every peer of auth.token_key_file"),
        }
    }
}

/// A run as revocation and visibility know it: (scope, run id), never one string.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunKey {
    pub scope: Scope,
    pub run_id: String,
}

impl RunKey {
    pub fn new(scope: Scope, run_id: &str) -> RunKey {
        RunKey {
            scope,
            run_id: run_id.to_string(),
        }
    }

    /// A revocation stored before scopes (v2 `revoked_runs`, one string): the
    /// daemon then wrote `<entry label> <run id>` for runs of `[[auth.engine]]`
    /// entries and the bare run id for the shared key. Anything that does not
    /// read as an entry's stays what it meant: the run id for every shared-key peer.
    pub fn from_legacy(s: &str) -> RunKey {
        let entry = ["[[auth.engine]] user = \"", "[[auth.engine]] group = \""]
            .iter()
            .find_map(|p| {
                let rest = s.strip_prefix(p)?;
                // The label's name is Debug-quoted: find its closing quote.
                let mut escaped = false;
                let end = rest.char_indices().find_map(|(i, c)| match c {
                    _ if escaped => {
                        escaped = false;
                        None
                    }
                    '\\' => {
                        escaped = true;
                        None
                    }
                    '"' => Some(i),
                    _ => None,
                })?;
                let run_id = rest[end + 1..].strip_prefix(' ')?;
                (!run_id.is_empty()).then(|| {
                    let label = &s[..p.len() + end + 1];
                    RunKey::new(Scope::Entry(label.to_string()), run_id)
                })
            });
        entry.unwrap_or_else(|| RunKey::new(Scope::AnyShared, s))
    }
}

/// Revocations kept per scope at most: past this many, the oldest of that scope
/// is dropped (and its run may start again). `run.revoke` takes expired tokens
/// and any engine mints its own run ids, so without a bound one engine could grow
/// the daemon's memory and the audit store without end; with it, an engine
/// flooding its own scope only weakens its own revocations (scriptgate-protocol(7),
/// run.revoke). The audit store keeps the same bound (crate::audit).
pub const REVOCATIONS_PER_SCOPE: usize = 10_000;

/// The revoked runs, at most `bound` of each scope, oldest dropped first.
#[derive(Debug)]
pub struct Revocations {
    bound: usize,
    scopes: HashMap<Scope, ScopeRevocations>,
}

/// One scope's revocations: run id -> its sequence number, and the run ids by
/// sequence (oldest first).
#[derive(Debug, Default)]
struct ScopeRevocations {
    by_id: HashMap<String, u64>,
    order: std::collections::BTreeMap<u64, String>,
    next: u64,
    /// Dropped past the bound, in this daemon's lifetime.
    dropped: u64,
}

impl Default for Revocations {
    fn default() -> Self {
        Revocations::with_bound(REVOCATIONS_PER_SCOPE)
    }
}

/// What a revocation past its scope's bound dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct Dropped {
    /// The oldest revocation of the scope, no longer kept.
    pub run: RunKey,
    /// How many of the scope were dropped so far (this daemon's lifetime).
    pub count: u64,
}

impl Revocations {
    pub fn with_bound(bound: usize) -> Revocations {
        Revocations {
            bound: bound.max(1),
            scopes: HashMap::new(),
        }
    }

    /// Revoke `k` (again: it becomes the newest of its scope). Past the scope's
    /// bound, its oldest revocation is dropped and returned.
    pub fn insert(&mut self, k: RunKey) -> Option<Dropped> {
        let s = self.scopes.entry(k.scope.clone()).or_default();
        let seq = s.next;
        s.next += 1;
        if let Some(old) = s.by_id.insert(k.run_id.clone(), seq) {
            s.order.remove(&old);
        }
        s.order.insert(seq, k.run_id);
        if s.by_id.len() <= self.bound {
            return None;
        }
        let (_, oldest) = s.order.pop_first().expect("over the bound: not empty");
        s.by_id.remove(&oldest);
        s.dropped += 1;
        Some(Dropped {
            run: RunKey {
                scope: k.scope,
                run_id: oldest,
            },
            count: s.dropped,
        })
    }

    pub fn contains(&self, k: &RunKey) -> bool {
        let has = |scope: &Scope, id: &str| {
            self.scopes
                .get(scope)
                .is_some_and(|s| s.by_id.contains_key(id))
        };
        has(&k.scope, &k.run_id)
            || matches!(k.scope, Scope::Shared(_)) && has(&Scope::AnyShared, &k.run_id)
    }
}

/// Oldest first (as the audit store lists them): past the bound, the oldest go.
impl FromIterator<RunKey> for Revocations {
    fn from_iter<I: IntoIterator<Item = RunKey>>(it: I) -> Self {
        let mut r = Revocations::default();
        for k in it {
            r.insert(k);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How many revocations of `scope` are kept, and of every scope.
    fn kept(r: &Revocations, scope: &Scope) -> (usize, usize) {
        let len = |s: &ScopeRevocations| {
            assert_eq!(s.by_id.len(), s.order.len(), "the two indexes agree");
            s.by_id.len()
        };
        (
            r.scopes.get(scope).map_or(0, len),
            r.scopes.values().map(len).sum(),
        )
    }

    #[test]
    fn run_keys_of_different_scopes_never_meet() {
        let label = r#"[[auth.engine]] group = "games""#.to_string();
        let b = RunKey::new(Scope::Entry(label.clone()), "run-9");
        // What an unbound engine spelled in the old, one-string form.
        let spelled = RunKey::new(Scope::Shared(1006), &format!("{label} run-9"));
        let mut r = Revocations::default();
        r.insert(spelled.clone());
        assert!(r.contains(&spelled));
        assert!(!r.contains(&b));
        assert!(!r.contains(&RunKey::new(Scope::Shared(1007), &spelled.run_id)));
        assert!(!r.contains(&RunKey::new(Scope::Shared(0), "run-9")));
        // A legacy bare id keeps refusing the run for every shared-key peer only.
        r.insert(RunKey::new(Scope::AnyShared, "run-1"));
        assert!(r.contains(&RunKey::new(Scope::Shared(0), "run-1")));
        assert!(r.contains(&RunKey::new(Scope::Shared(1006), "run-1")));
        assert!(!r.contains(&RunKey::new(Scope::Entry(label.clone()), "run-1")));
        for s in [
            Scope::Entry(label.clone()),
            Scope::Shared(7),
            Scope::AnyShared,
        ] {
            assert_eq!(Scope::from_db(&s.to_db()), Some(s));
        }
        assert_eq!(Scope::from_db("uid:x"), None);
        assert_eq!(Scope::from_db("entry"), None);
        // As messages name a scope.
        assert_eq!(
            [
                Scope::Entry(label.clone()),
                Scope::Shared(0),
                Scope::Shared(1006),
                Scope::AnyShared,
            ]
            .map(|s| s.to_string()),
            [
                label.as_str(),
                "root (auth.token_key_file)",
                "uid 1006 (auth.token_key_file)",
                "every peer of auth.token_key_file",
            ]
        );
    }

    #[test]
    fn revocations_are_bounded_per_scope_oldest_dropped_first() {
        let mut r = Revocations::with_bound(3);
        let a = |id: &str| RunKey::new(Scope::Shared(1006), id);
        let other = RunKey::new(Scope::Shared(1007), "theirs");
        r.insert(other.clone());
        for id in ["r0", "r1", "r2"] {
            assert_eq!(r.insert(a(id)), None);
        }
        // Revoked again: the newest, not dropped next.
        assert_eq!(r.insert(a("r0")), None);
        assert_eq!(
            r.insert(a("r3")),
            Some(Dropped {
                run: a("r1"),
                count: 1
            })
        );
        for i in 4..100 {
            assert!(r.insert(a(&format!("r{i}"))).is_some());
        }
        assert_eq!(
            kept(&r, &Scope::Shared(1006)),
            (3, 4),
            "the scope's bound, and the other scope's one"
        );
        assert!(r.contains(&other), "another scope is untouched");
        for id in ["r97", "r98", "r99"] {
            assert!(r.contains(&a(id)), "the latest are kept");
        }
        for id in ["r0", "r1", "r2", "r3", "r96"] {
            assert!(!r.contains(&a(id)), "{id}: dropped");
        }
        // Loading oldest first keeps the newest.
        let loaded: Revocations = (0..(REVOCATIONS_PER_SCOPE + 5))
            .map(|i| a(&format!("l{i}")))
            .collect();
        assert_eq!(
            kept(&loaded, &Scope::Shared(1006)),
            (REVOCATIONS_PER_SCOPE, REVOCATIONS_PER_SCOPE)
        );
        assert!(loaded.contains(&a(&format!("l{}", REVOCATIONS_PER_SCOPE + 4))));
        assert!(!loaded.contains(&a("l4")));
    }

    #[test]
    fn legacy_revocations_read_as_they_were_meant() {
        let l = r#"[[auth.engine]] user = "gw""#;
        assert_eq!(
            RunKey::from_legacy(&format!("{l} run-42")),
            RunKey::new(Scope::Entry(l.into()), "run-42")
        );
        let g = r#"[[auth.engine]] group = "a\"b""#;
        assert_eq!(
            RunKey::from_legacy(&format!("{g} r 1")),
            RunKey::new(Scope::Entry(g.into()), "r 1")
        );
        for bare in [
            "run-7",
            r#"[[auth.engine]] user = "gw""#,
            "[[auth.engine]] x",
        ] {
            assert_eq!(
                RunKey::from_legacy(bare),
                RunKey::new(Scope::AnyShared, bare)
            );
        }
    }
}
