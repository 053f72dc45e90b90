//! The secrets `scriptgate mcp` keeps in the user's state directory across
//! restarts: the key that seals task ids, and `--http`'s bearer token. Each is a
//! file of the user's own, mode 0600, made at first use; one that another user
//! could read or change is refused, never used.

use crate::cli::exit::Failure;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The secret in `path`, made (`len` random bytes, as `encode` writes them) if
/// there is none.
pub(super) fn load_or_make(
    path: &Path,
    len: usize,
    encode: fn(&[u8]) -> Vec<u8>,
) -> Result<Vec<u8>, Failure> {
    let fail = |what: String| Failure::setup(format!("{}: {what}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| fail(format!("cannot create its directory: {e}")))?;
    }
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(path)
    };
    let cannot_read = |e: std::io::Error| fail(format!("cannot read (a symlink is refused): {e}"));
    // One that is there is read (its directory need not be writable); only
    // where there is none is one made.
    let f = match open() {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut raw = vec![0u8; len];
            getrandom::getrandom(&mut raw).map_err(|e| fail(format!("random bytes: {e}")))?;
            let bytes = encode(&raw);
            if place(path, &bytes).map_err(fail)? {
                return Ok(bytes);
            }
            open().map_err(cannot_read)?
        }
        Err(e) => return Err(cannot_read(e)),
    };
    let meta = f
        .metadata()
        .map_err(|e| fail(format!("cannot read: {e}")))?;
    let me = nix::unistd::geteuid().as_raw();
    if !meta.file_type().is_file() {
        return Err(fail("not a regular file".into()));
    }
    if meta.uid() != me {
        return Err(fail(format!(
            "owned by uid {}, not by uid {me}: refused (remove it to make a new one)",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(fail(format!(
            "mode {:04o} lets others read or change it: refused (chmod 0600 it, or remove it to make a new one)",
            meta.mode() & 0o7777
        )));
    }
    let mut bytes = Vec::new();
    f.take(4096)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot read: {e}")))?;
    if bytes.len() < len {
        return Err(fail(format!(
            "{} bytes, fewer than the {len} it needs (remove it to make a new one)",
            bytes.len()
        )));
    }
    Ok(bytes)
}

/// Writes `bytes` whole under a name of its own beside `path`, then links it
/// into place: a process that starts at the same moment finds either no secret
/// or a complete one, never one being written. False when another process's
/// got there first (the link finds it), to be read like any other.
fn place(path: &Path, bytes: &[u8]) -> Result<bool, String> {
    let mut tag = [0u8; 8];
    getrandom::getrandom(&mut tag).map_err(|e| format!("random bytes: {e}"))?;
    let draft = path.with_file_name(format!(
        ".{}.{:016x}.new",
        path.file_name()
            .map_or_else(Default::default, |n| n.to_string_lossy()),
        u64::from_ne_bytes(tag)
    ));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&draft)
        .and_then(|mut f| f.write_all(bytes).and_then(|()| f.sync_all()))
        .map_err(|e| {
            let _ = std::fs::remove_file(&draft);
            format!(
                "cannot write a new one beside it ({}): {e}",
                draft.display()
            )
        })?;
    let linked = std::fs::hard_link(&draft, path);
    let _ = std::fs::remove_file(&draft);
    match linked {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(format!("cannot link the new one into place: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn made_once_then_read_and_a_loose_one_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/key");
        let a = load_or_make(&p, 32, |b| b.to_vec()).unwrap();
        assert_eq!(a.len(), 32);
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::metadata(p.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        let dir_mtime = || {
            std::fs::metadata(p.parent().unwrap())
                .unwrap()
                .modified()
                .unwrap()
        };
        let before = dir_mtime();
        assert_eq!(
            load_or_make(&p, 32, |b| b.to_vec()).unwrap(),
            a,
            "read back"
        );
        assert_eq!(dir_mtime(), before, "reading one makes nothing beside it");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = load_or_make(&p, 32, |b| b.to_vec()).unwrap_err();
        assert!(e.message.contains("mode 0644"), "{}", e.message);
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&p, &link).unwrap();
        assert!(load_or_make(&link, 32, |b| b.to_vec()).is_err());
    }

    #[test]
    fn processes_starting_together_all_get_the_one_complete_secret() {
        // Two `scriptgate mcp` started at once in one state directory: the
        // second used to read the first's key while it was still empty.
        for round in 0..300 {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join(format!("key{round}"));
            let start = std::sync::Barrier::new(8);
            let got: Vec<_> = std::thread::scope(|s| {
                let ts: Vec<_> = (0..8)
                    .map(|_| {
                        s.spawn(|| {
                            start.wait();
                            load_or_make(&p, 32, |b| b.to_vec())
                        })
                    })
                    .collect();
                ts.into_iter().map(|t| t.join().unwrap()).collect()
            });
            let first = got[0].as_ref().map_err(|e| e.message.clone()).unwrap();
            for g in &got {
                assert_eq!(g.as_ref().map_err(|e| e.message.clone()).unwrap(), first);
            }
            let names: Vec<_> = std::fs::read_dir(d.path()).unwrap().collect();
            assert_eq!(names.len(), 1, "no draft is left behind");
        }
    }
}
