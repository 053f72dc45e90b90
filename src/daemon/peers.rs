//! Identity: who a connection's peer is, decided once before it is served
//! ([`Peers::identify`]), and what follows from it everywhere later: which key
//! signs its tokens, where its workspaces lie, and in whose scope its runs are
//! named. Also the per-uid workspace directories an engine is given.

use crate::daemon::roots::Roots;
use crate::policy::auth::{EngineId, Engines, Role};
use crate::policy::runs::{RunKey, Scope};
use crate::protocol::refusal::{Reason, Refused};
use crate::sys::Identity;
use std::path::PathBuf;

/// Who is on the other end of a connection (from SO_PEERCRED), as
/// `Peers::identify` decided it: made nowhere else, read by its accessors.
#[derive(Debug, Clone, Copy)]
pub struct Peer {
    uid: u32,
    gid: u32,
    pid: Option<i32>,
    admin: bool,
    engine: Option<EngineId>,
}

impl Peer {
    pub fn uid(&self) -> u32 {
        self.uid
    }

    pub fn gid(&self) -> u32 {
        self.gid
    }

    pub fn pid(&self) -> Option<i32> {
        self.pid
    }

    /// Root or a member of `auth.admin_groups`: may see and cancel any script.
    pub fn admin(&self) -> bool {
        self.admin
    }

    /// The `[[auth.engine]]` entry the peer is bound to; None:
    /// `auth.token_key_file` and `workspace.roots`.
    pub fn engine(&self) -> Option<EngineId> {
        self.engine
    }

    /// A peer as a unit test needs one, without a daemon.
    #[cfg(test)]
    pub(crate) fn for_test(uid: u32, gid: u32) -> Peer {
        Peer {
            uid,
            gid,
            pid: None,
            admin: false,
            engine: None,
        }
    }
}

/// On whose behalf a script is looked up.
#[derive(Debug, Clone, Copy)]
pub enum Access {
    /// A connection (the `[[auth.engine]]` entry its peer is bound to, and its
    /// uid): sees the scripts it started, or those of a run it has a token for
    /// (signed with its key, in its scope: `Peers::run_key`).
    Conn(u64, Option<EngineId>, u32),
    /// An administrator (`admin.*` methods, checked by the caller): sees every script.
    Admin,
}

/// A peer's groups as the gate looked them up (root needs none).
#[derive(Debug, Clone, Copy)]
pub struct PeerGroups<'a> {
    /// In `auth.allowed_groups`: an engine.
    pub in_allowed: bool,
    /// In `auth.admin_groups`: an administrator.
    pub in_admin: bool,
    /// Every gid of the peer, for `[[auth.engine]]` entries.
    pub gids: &'a [u32],
}

/// The engines the daemon knows: the shared key (`auth.token_key_file`), the
/// `[[auth.engine]]` entries with their own keys and roots, and the workspace
/// roots. Fixed when the configuration is loaded.
pub(crate) struct Peers {
    key: Vec<u8>,
    engines: Engines,
    roots: Roots,
    /// `auth.allowed_groups`, for the refusal's words.
    allowed_groups: Vec<String>,
}

impl Peers {
    pub(crate) fn new(
        key: Vec<u8>,
        engines: Engines,
        roots: Roots,
        allowed_groups: Vec<String>,
    ) -> Peers {
        Peers {
            key,
            engines,
            roots,
            allowed_groups,
        }
    }

    /// Are there `[[auth.engine]]` entries?
    pub(crate) fn has_entries(&self) -> bool {
        !self.engines.is_empty()
    }

    /// The workspace roots (`workspace.roots`), configured and canonical.
    pub(crate) fn roots(&self) -> &Roots {
        &self.roots
    }

    /// Who a connection's peer is: its role (root, its groups), its
    /// `[[auth.engine]]` entry, and so which key signs its tokens, where its
    /// workspaces lie and whose runs it sees. `groups` is None for root.
    pub(crate) fn identify(
        &self,
        uid: u32,
        gid: u32,
        pid: Option<i32>,
        groups: Option<PeerGroups<'_>>,
    ) -> Result<(Role, Peer), Refused> {
        let role = crate::policy::auth::role(
            uid == 0,
            groups.is_some_and(|g| g.in_allowed),
            groups.is_some_and(|g| g.in_admin),
        );
        let admin = match role {
            Role::Refused => {
                return Err(Refused::new(
                    Reason::PeerNotAllowed,
                    format!(
                        "uid {uid} may not use scriptgated: not root and not in auth.allowed_groups {:?}",
                        self.allowed_groups
                    ),
                ))
            }
            Role::AdminOnly => true,
            Role::Engine { admin } => admin,
        };
        let engine = match (role, groups) {
            (Role::Engine { .. }, Some(g)) => self
                .engines
                .for_peer(uid, g.gids)
                .map_err(|m| Refused::new(Reason::EngineAmbiguous, m))?,
            _ => None,
        };
        let peer = Peer {
            uid,
            gid,
            pid,
            admin,
            engine,
        };
        Ok((role, peer))
    }

    /// Whose run ids a peer's tokens name: its `[[auth.engine]]` entry's, or for
    /// `auth.token_key_file` (which every unbound engine may read) those of its
    /// uid (0: root).
    fn scope(&self, engine: Option<EngineId>, uid: u32) -> Scope {
        match engine.and_then(|i| self.engines.get(i)) {
            Some(e) => Scope::Entry(e.label.clone()),
            None => Scope::Shared(uid),
        }
    }

    /// A run as revocation and visibility know it: (scope, run id), a pair no
    /// run id can spell, so a token one engine signs for another's run id names a
    /// different run.
    pub(crate) fn run_key(&self, engine: Option<EngineId>, uid: u32, run_id: &str) -> RunKey {
        RunKey::new(self.scope(engine, uid), run_id)
    }

    /// The key the tokens of an engine ([`Peer::engine`]) are signed with.
    pub(crate) fn key_for(&self, engine: Option<EngineId>) -> &[u8] {
        match engine.and_then(|i| self.engines.get(i)) {
            Some(e) => &e.key,
            None => &self.key,
        }
    }

    /// The directories a peer's workspaces must lie under: an engine entry's
    /// `workspace_roots` or per-uid directories, or `workspace.roots`.
    pub(crate) fn roots_for(&self, peer: Peer) -> Vec<PathBuf> {
        let configured = self.roots.configured();
        match peer.engine.and_then(|i| self.engines.get(i)) {
            Some(e) => crate::policy::auth::peer_roots(configured, Some(&e.roots), peer.uid),
            None => configured.to_vec(),
        }
    }

    /// A peer identified and admitted: a non-root engine that uses
    /// `workspace.roots` (no entry, or an entry without `workspace_roots`) gets
    /// its per-uid directories `<root>/<uid>` now, so that it can make workspaces
    /// in them before it starts anything. A daemon that is not root can only
    /// make its own uid's.
    pub(crate) fn connected(&self, role: Role, peer: Peer) {
        if !matches!(role, Role::Engine { .. }) {
            return;
        }
        let explicit = peer
            .engine
            .and_then(|i| self.engines.get(i))
            .is_some_and(|e| !e.roots.is_empty());
        if !explicit {
            self.give_engine_dirs(peer.uid, peer.gid);
        }
    }

    /// At start, the per-uid directories of every `[[auth.engine]]` entry that
    /// uses `workspace.roots`: its user's, or each listed member's of its group,
    /// so that an engine of such an entry finds `<root>/<uid>` even before it
    /// connects (for a daemon that is already running; socket activation starts
    /// one on the first connection, which makes them too).
    pub(crate) fn engine_dirs_at_start(&self) {
        use crate::policy::auth::Match;
        use nix::unistd::{Gid, Group, Uid, User};
        for e in self.engines.iter().filter(|e| e.roots.is_empty()) {
            let who: Vec<(u32, u32)> = match e.matches {
                Match::Uid(uid) => User::from_uid(Uid::from_raw(uid))
                    .ok()
                    .flatten()
                    .map(|u| (uid, u.gid.as_raw()))
                    .into_iter()
                    .collect(),
                Match::Gid(gid) => Group::from_gid(Gid::from_raw(gid))
                    .ok()
                    .flatten()
                    .map(|g| g.mem)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|name| User::from_name(name).ok().flatten())
                    .map(|u| (u.uid.as_raw(), gid))
                    .collect(),
            };
            for (uid, gid) in who {
                self.give_engine_dirs(uid, gid);
            }
        }
    }

    /// `<root>/<uid>` (0700, the engine's) under each workspace root that
    /// exists, for a non-root engine. A daemon that is not root can only make
    /// its own uid's.
    fn give_engine_dirs(&self, uid: u32, gid: u32) {
        let me = nix::unistd::Uid::effective().as_raw();
        if uid == 0 || (me != 0 && me != uid) {
            return;
        }
        for root in self.roots.configured() {
            if !root.is_dir() {
                continue;
            }
            if let Err(e) = crate::sys::ensure_engine_dir(root, Identity { uid, gid }) {
                tracing::warn!(
                    peer_uid = uid,
                    "cannot give uid {uid} its workspace directory: {e}"
                );
            }
        }
    }
}
