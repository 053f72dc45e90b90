//! Who may use the daemon, and as which engine (scriptgated(8), "Users and
//! groups"): the roles a peer has from its groups, and the `[[auth.engine]]`
//! entries that bind an engine's uid or group to its own token key and
//! workspace directories.
//!
//! The policy (`role`, `matching`, `engine_dir_owner`) is pure; `Engines::load`
//! resolves names and reads keys once, at start-up.

use crate::config::{read_key_file, Auth, ConfigError, EngineAuth};
use std::path::{Path, PathBuf};

/// What a connecting peer may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Root, or a member of `auth.allowed_groups`: every method (admin methods
    /// too when also an administrator).
    Engine { admin: bool },
    /// A member of `auth.admin_groups` only: the admin methods and
    /// `daemon.info`; no scripts, no tokens.
    AdminOnly,
    /// Neither: refused before anything is read.
    Refused,
}

/// The role of a peer, from whether it is root, an engine group member and an
/// admin group member.
pub fn role(root: bool, in_allowed: bool, in_admin: bool) -> Role {
    if root {
        Role::Engine { admin: true }
    } else if in_allowed {
        Role::Engine { admin: in_admin }
    } else if in_admin {
        Role::AdminOnly
    } else {
        Role::Refused
    }
}

/// Whom one entry matches, once names are resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Match {
    Uid(u32),
    Gid(u32),
}

/// The entries a peer (its uid and every gid it has) matches.
pub fn matching(entries: &[Match], uid: u32, gids: &[u32]) -> Vec<usize> {
    entries
        .iter()
        .enumerate()
        .filter(|(_, m)| match m {
            Match::Uid(u) => *u == uid,
            Match::Gid(g) => gids.contains(g),
        })
        .map(|(i, _)| i)
        .collect()
}

/// One resolved `[[auth.engine]]` entry.
#[derive(Debug, Clone)]
pub struct Engine {
    /// How messages name it: `[[auth.engine]] user = "gateway"`.
    pub label: String,
    pub matches: Match,
    pub key: Vec<u8>,
    /// Explicit `workspace_roots`; empty means the peer's per-uid directories.
    pub roots: Vec<PathBuf>,
}

/// Which `[[auth.engine]]` entry a peer is bound to: an index into the entries
/// loaded at start-up, made only by `Engines::for_peer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineId(usize);

/// The `[[auth.engine]]` entries, resolved.
#[derive(Debug, Clone, Default)]
pub struct Engines {
    list: Vec<Engine>,
}

/// A name or a decimal number.
fn numeric(s: &str) -> Option<u32> {
    s.parse().ok()
}

fn resolve(e: &EngineAuth, path: &Path) -> Result<Match, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        path: path.to_path_buf(),
        message,
    };
    if let Some(u) = &e.user {
        if let Some(n) = numeric(u) {
            return Ok(Match::Uid(n));
        }
        return match nix::unistd::User::from_name(u).ok().flatten() {
            Some(user) => Ok(Match::Uid(user.uid.as_raw())),
            None => Err(invalid(format!(
                "{}: no user {u:?} on this host (getent passwd {u}); create it or give the uid as a number",
                e.label()
            ))),
        };
    }
    let g = e.group.as_deref().unwrap_or_default();
    if let Some(n) = numeric(g) {
        return Ok(Match::Gid(n));
    }
    match nix::unistd::Group::from_name(g).ok().flatten() {
        Some(group) => Ok(Match::Gid(group.gid.as_raw())),
        None => Err(invalid(format!(
            "{}: no group {g:?} on this host (getent group {g}); create it or give the gid as a number",
            e.label()
        ))),
    }
}

impl Engines {
    /// Resolve every entry's user or group, read its key (with the checks of
    /// `token_key_file`), and refuse entries that would let one engine act as
    /// another: two entries for the same uid or gid, a user who is a listed
    /// member of another entry's group, or two entries (or an entry and
    /// `auth.token_key_file`) with the same key. `global_key` is the key of
    /// `auth.token_key_file`, if the caller read it.
    pub fn load(
        auth: &Auth,
        global_key: Option<&[u8]>,
        path: &Path,
    ) -> Result<Engines, ConfigError> {
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let mut list: Vec<Engine> = Vec::with_capacity(auth.engines.len());
        for e in &auth.engines {
            let matches = resolve(e, path)?;
            let key = read_key_file(&e.token_key_file)
                .map_err(|err| invalid(format!("{}: {err}", e.label())))?;
            let label = e.label();
            for other in &list {
                if other.matches == matches {
                    return Err(invalid(format!(
                        "{label} and {} match the same peers; a peer must match one entry",
                        other.label
                    )));
                }
                if overlap(matches, other.matches) || overlap(other.matches, matches) {
                    return Err(invalid(format!(
                        "{label} and {} overlap: the user is a member of the group; a peer must match one entry (remove the user from the group, or drop one entry)",
                        other.label
                    )));
                }
                if other.key == key {
                    return Err(invalid(format!(
                        "{label} and {} have the same key, so either engine could act as the other; give each its own key (head -c 32 /dev/urandom > FILE)",
                        other.label
                    )));
                }
            }
            if global_key == Some(key.as_slice()) {
                return Err(invalid(format!(
                    "{label}: its key is the same as auth.token_key_file's, which every member of auth.allowed_groups may read; give it a key of its own"
                )));
            }
            list.push(Engine {
                label,
                matches,
                key,
                roots: e.workspace_roots.clone(),
            });
        }
        Ok(Engines { list })
    }

    /// Every entry, in the config's order.
    pub fn iter(&self) -> impl Iterator<Item = &Engine> {
        self.list.iter()
    }

    /// No `[[auth.engine]]` entry: every engine uses `auth.token_key_file`.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// How many entries there are.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// The entry `id` names.
    pub fn get(&self, id: EngineId) -> Option<&Engine> {
        self.list.get(id.0)
    }

    /// The entry this peer is bound to: None when it matches none (it then uses
    /// `auth.token_key_file`); an error naming the entries when it matches more
    /// than one (possible only through group membership changed since start-up).
    pub fn for_peer(&self, uid: u32, gids: &[u32]) -> Result<Option<EngineId>, String> {
        if self.list.is_empty() {
            return Ok(None);
        }
        let m: Vec<Match> = self.list.iter().map(|e| e.matches).collect();
        match matching(&m, uid, gids).as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(EngineId(*one))),
            many => Err(format!(
                "uid {uid} matches more than one engine entry ({}); a peer must match exactly one: fix its groups or the entries",
                many.iter()
                    .map(|i| self.list[*i].label.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }
}

/// The `[[auth.engine]]` entry a client of this uid and these gids is bound
/// to, resolved from the config alone (the CLI: it reads no one else's key).
pub fn entry_for<'a>(
    auth: &'a Auth,
    uid: u32,
    gids: &[u32],
    path: &Path,
) -> Result<Option<&'a EngineAuth>, ConfigError> {
    let mut m = Vec::with_capacity(auth.engines.len());
    for e in &auth.engines {
        m.push(resolve(e, path)?);
    }
    Ok(matching(&m, uid, gids).first().map(|i| &auth.engines[*i]))
}

/// Does user entry `a` fall inside group entry `b` (as a listed member, or by
/// its primary group)?
fn overlap(a: Match, b: Match) -> bool {
    let (Match::Uid(uid), Match::Gid(gid)) = (a, b) else {
        return false;
    };
    let Some(user) = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
        .ok()
        .flatten()
    else {
        return false;
    };
    if user.gid.as_raw() == gid {
        return true;
    }
    nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
        .ok()
        .flatten()
        .is_some_and(|g| g.mem.contains(&user.name))
}

/// The workspace directories of a peer that is not root: an entry's explicit
/// `workspace_roots`, else its per-uid directory under each workspace root.
pub fn peer_roots(global: &[PathBuf], entry_roots: Option<&[PathBuf]>, uid: u32) -> Vec<PathBuf> {
    match entry_roots {
        Some(r) if !r.is_empty() => r.to_vec(),
        _ => global.iter().map(|r| r.join(uid.to_string())).collect(),
    }
}

/// The uid whose per-uid directory `workspace` lies in, if it lies in one:
/// `<root>/<digits>/…` for one of `roots`.
pub fn engine_dir_owner(workspace: &Path, roots: &[PathBuf]) -> Option<u32> {
    roots.iter().find_map(|r| {
        let rest = workspace.strip_prefix(r).ok()?;
        let first = rest.components().next()?;
        first.as_os_str().to_str()?.parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_from_groups() {
        assert_eq!(role(true, false, false), Role::Engine { admin: true });
        assert_eq!(role(false, true, false), Role::Engine { admin: false });
        assert_eq!(role(false, true, true), Role::Engine { admin: true });
        assert_eq!(role(false, false, true), Role::AdminOnly);
        assert_eq!(role(false, false, false), Role::Refused);
    }

    #[test]
    fn entries_match_by_uid_or_any_gid() {
        let e = [Match::Uid(1000), Match::Gid(60), Match::Gid(61)];
        assert_eq!(matching(&e, 1000, &[1000]), vec![0]);
        assert_eq!(matching(&e, 1001, &[1001, 61]), vec![2]);
        assert_eq!(matching(&e, 1000, &[60]), vec![0, 1]);
        assert!(matching(&e, 7, &[7]).is_empty());
    }

    #[test]
    fn per_uid_directories() {
        let roots = vec![PathBuf::from("/w"), PathBuf::from("/v")];
        assert_eq!(
            peer_roots(&roots, None, 1000),
            vec![PathBuf::from("/w/1000"), PathBuf::from("/v/1000")]
        );
        let own = vec![PathBuf::from("/srv/gw")];
        assert_eq!(peer_roots(&roots, Some(&own), 1000), own);
        // An entry whose `workspace_roots` is empty has the per-uid ones.
        assert_eq!(
            peer_roots(&roots, Some(&[]), 1000),
            vec![PathBuf::from("/w/1000"), PathBuf::from("/v/1000")]
        );
        assert_eq!(
            engine_dir_owner(Path::new("/w/1000/ws"), &roots),
            Some(1000)
        );
        assert_eq!(engine_dir_owner(Path::new("/v/17"), &roots), Some(17));
        assert_eq!(engine_dir_owner(Path::new("/w/run-1/x"), &roots), None);
        assert_eq!(engine_dir_owner(Path::new("/elsewhere/1/x"), &roots), None);
    }

    /// A key file of 32 `byte`s in `dir`, as `read_key_file` takes it.
    fn key_file(dir: &Path, name: &str, byte: u8) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, [byte; 32]).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    }

    fn entry(user: Option<&str>, group: Option<&str>, key: &Path) -> EngineAuth {
        EngineAuth {
            user: user.map(Into::into),
            group: group.map(Into::into),
            token_key_file: key.to_path_buf(),
            workspace_roots: vec![],
        }
    }

    fn load(engines: Vec<EngineAuth>, global: Option<&[u8]>) -> Result<Engines, String> {
        let auth = Auth {
            engines,
            ..Auth::default()
        };
        Engines::load(&auth, global, Path::new("scriptgate.toml")).map_err(|e| e.to_string())
    }

    // Numbers no user or group of a test host has.
    const UID: &str = "4000123";
    const GID: &str = "4000456";

    #[test]
    fn entries_load_with_their_keys_matches_and_roots_in_order() {
        assert!(Engines::default().is_empty());
        assert_eq!(Engines::default().len(), 0);
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let mut gw = entry(Some(UID), None, &key_file(d, "a", 1));
        gw.workspace_roots = vec!["/srv/gw".into()];
        let e = load(
            vec![gw, entry(None, Some(GID), &key_file(d, "b", 2))],
            Some(&[3; 32]),
        )
        .unwrap();
        assert!(!e.is_empty());
        assert_eq!(e.len(), 2);
        let got: Vec<_> = e
            .iter()
            .map(|x| (x.label.clone(), x.matches, x.key.clone(), x.roots.clone()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    format!("[[auth.engine]] user = \"{UID}\""),
                    Match::Uid(4000123),
                    vec![1; 32],
                    vec![PathBuf::from("/srv/gw")]
                ),
                (
                    format!("[[auth.engine]] group = \"{GID}\""),
                    Match::Gid(4000456),
                    vec![2; 32],
                    vec![]
                ),
            ]
        );
    }

    #[test]
    fn entries_that_would_let_one_engine_act_as_another_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        let (a, b) = (key_file(d, "a", 1), key_file(d, "b", 2));
        let refused = |engines: Vec<EngineAuth>, global: Option<&[u8]>, why: &str| {
            let e = load(engines, global).expect_err(why);
            assert!(e.contains(why), "{why}: {e}");
        };
        refused(
            vec![entry(Some(UID), None, &a), entry(Some(UID), None, &b)],
            None,
            "match the same peers",
        );
        refused(
            vec![entry(Some(UID), None, &a), entry(Some("4000124"), None, &a)],
            None,
            "have the same key",
        );
        refused(
            vec![entry(Some(UID), None, &a)],
            Some(&[1; 32]),
            "the same as auth.token_key_file's",
        );
        // root's primary group is 0: the user entry falls inside the group
        // entry, whichever comes first.
        refused(
            vec![entry(Some("0"), None, &a), entry(None, Some("0"), &b)],
            None,
            "overlap",
        );
        refused(
            vec![entry(None, Some("0"), &a), entry(Some("0"), None, &b)],
            None,
            "overlap",
        );
        refused(
            vec![entry(Some("scriptgate-no-such-user"), None, &a)],
            None,
            "no user \"scriptgate-no-such-user\"",
        );
        refused(
            vec![entry(None, Some("scriptgate-no-such-group"), &a)],
            None,
            "no group \"scriptgate-no-such-group\"",
        );
        refused(
            vec![entry(Some(UID), None, &d.join("missing"))],
            None,
            &format!("[[auth.engine]] user = \"{UID}\": token key"),
        );
    }

    #[test]
    fn a_client_finds_its_entry_from_the_config_alone() {
        let auth = Auth {
            engines: vec![
                entry(Some(UID), None, Path::new("/k1")),
                entry(None, Some(GID), Path::new("/k2")),
            ],
            ..Auth::default()
        };
        let found = |uid: u32, gids: &[u32]| {
            entry_for(&auth, uid, gids, Path::new("scriptgate.toml"))
                .unwrap()
                .map(|e| e.token_key_file.clone())
        };
        assert_eq!(found(4000123, &[7]), Some(PathBuf::from("/k1")));
        assert_eq!(found(7, &[7, 4000456]), Some(PathBuf::from("/k2")));
        assert_eq!(found(7, &[7]), None);
    }

    #[test]
    fn a_peer_in_two_entries_is_an_error_naming_both() {
        let key = vec![1u8; 32];
        let mk = |label: &str, m| Engine {
            label: label.into(),
            matches: m,
            key: key.clone(),
            roots: vec![],
        };
        let e = Engines {
            list: vec![mk("A", Match::Gid(60)), mk("B", Match::Gid(61))],
        };
        assert_eq!(e.for_peer(5, &[5]), Ok(None));
        let b = e.for_peer(5, &[5, 61]).unwrap().expect("B");
        assert_eq!(e.get(b).map(|x| x.label.as_str()), Some("B"));
        let err = e.for_peer(5, &[60, 61]).unwrap_err();
        assert!(err.contains("A, B"), "{err}");
    }
}
