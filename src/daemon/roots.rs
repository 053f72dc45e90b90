//! The workspace roots (`workspace.roots`) as configured and as canonical
//! paths. The canonical forms are taken when the configuration is loaded and
//! again only when a root changes (one that did not exist appears, or a root's
//! symlink now leads elsewhere): not on every start.

use std::path::{Path, PathBuf};
use std::sync::RwLock;

/// `workspace.roots`, with their canonical paths as last taken.
pub(crate) struct Roots {
    configured: Vec<PathBuf>,
    /// The roots that exist, canonicalized (`std::fs::canonicalize`).
    canonical: RwLock<Vec<PathBuf>>,
}

impl Roots {
    /// The configured roots, canonicalized now.
    pub(crate) fn new(configured: Vec<PathBuf>) -> Roots {
        let canonical = RwLock::new(canonicalize(&configured));
        Roots {
            configured,
            canonical,
        }
    }

    /// As configured, in their order.
    pub(crate) fn configured(&self) -> &[PathBuf] {
        &self.configured
    }

    /// The canonical roots, for a workspace that the daemon opened beneath one
    /// of them (`sys::WorkspaceDir::open`, which follows the root's own
    /// symlinks). A workspace that lies under none of the canonical paths taken
    /// so far means that a root changed since: they are taken again.
    pub(crate) fn canonical_for(&self, workspace: &Path) -> Vec<PathBuf> {
        {
            let known = self.canonical.read().unwrap();
            if known.iter().any(|r| workspace.starts_with(r)) {
                return known.clone();
            }
        }
        let fresh = canonicalize(&self.configured);
        *self.canonical.write().unwrap() = fresh.clone();
        fresh
    }
}

/// The roots that exist, canonicalized; those that do not are left out.
fn canonicalize(roots: &[PathBuf]) -> Vec<PathBuf> {
    roots
        .iter()
        .filter_map(|r| std::fs::canonicalize(r).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::Roots;

    #[test]
    fn canonical_roots_are_taken_once_and_again_when_a_root_appears() {
        let tmp = tempfile::tempdir().unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let (a, b) = (base.join("a"), base.join("b"));
        std::fs::create_dir(&a).unwrap();
        let roots = Roots::new(vec![a.clone(), b.clone()]);
        assert_eq!(roots.configured(), &[a.clone(), b.clone()]);
        // b does not exist yet: only a is canonical.
        assert_eq!(roots.canonical_for(&a.join("ws")), vec![a.clone()]);
        std::fs::create_dir(&b).unwrap();
        // A workspace under a: the roots taken at load still serve.
        assert_eq!(roots.canonical_for(&a.join("ws")), vec![a.clone()]);
        // One under b, which appeared since: taken again.
        assert_eq!(roots.canonical_for(&b.join("ws")), vec![a, b]);
    }
}
