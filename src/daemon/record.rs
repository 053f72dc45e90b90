//! Step 4 of a start: the script's record, before anything runs.
//! `.agent/scripts/<id>/` in the workspace with the code and the (empty) logs,
//! owned by the script's uid, then the audit row. A script starts only when its
//! end can be recorded, and a refused start leaves no `script.py` that no audit
//! row names.

use crate::audit::StartRow;
use crate::daemon::admission::Admitted;
use crate::daemon::approval::Approval;
use crate::daemon::{disk, Daemon, Live, Peer};
use crate::protocol::refusal::{Reason, Refused};
use crate::protocol::StartParams;
use crate::sys::{ArtifactDir, SysError, WorkspaceDir};
use crate::time::now_ms;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// A script's record in its workspace, created before anything runs.
pub(crate) struct Record {
    pub(crate) art: ArtifactDir,
    pub(crate) details_dir: String,
    pub(crate) calls_log: File,
    pub(crate) stdout_file: File,
    pub(crate) stderr_file: File,
    /// The code the sandbox runs (`script::Run::new`'s `script_code`).
    pub(crate) script_code: OwnedFd,
    /// Why `scripts.disk_max_bytes` is not in force for this script, if it is not.
    pub(crate) disk_note: Option<String>,
    /// The configuration in force when the start began: the script keeps it
    /// to its end, whatever a reload changes meanwhile.
    pub(crate) live: Arc<Live>,
}

/// The record's three files that stay open: calls.jsonl, output.txt, stderr.txt.
type Logs = (File, File, File);

impl Daemon {
    /// The record of an admitted and approved start. First the code, sealed;
    /// then the state directory's reserve (`state.reserve_bytes`); then the
    /// directory and its files, and the audit row. A record that cannot be made
    /// in full is removed.
    pub(crate) async fn create_record(
        &self,
        live: &Arc<Live>,
        script_id: &str,
        peer: Peer,
        p: &StartParams,
        a: &Admitted,
        approval: Approval,
    ) -> Result<Record, Refused> {
        let disk_note =
            disk::bound(&self.store, &a.workspace, live.cfg.scripts.disk_max_bytes).await;
        let script_code = crate::sys::sealed_copy(c"scriptgate-script", p.code.as_bytes())
            .map_err(|e| Refused::internal(format!("cannot hold the script's code: {e}")))?;
        self.keep_reserve_for_start(&live.cfg.state)?;
        let art = ArtifactDir::create(&a.workspace, script_id, a.identity, peer.uid() == 0)
            .map_err(|e| {
                record_error(
                    "cannot create the script's record directory",
                    &a.workspace,
                    e,
                )
            })?;
        let details_dir = format!(".agent/scripts/{script_id}");
        let made = match write_record_files(&art, &p.code)
            .map_err(|e| record_error("cannot write the script's record", &a.workspace, e))
        {
            Ok(logs) => self
                .insert_row(live, script_id, peer, p, a, approval)
                .await
                .map(|()| logs),
            Err(e) => Err(e),
        };
        let (calls_log, stdout_file, stderr_file) = made.inspect_err(|_| {
            remove_record(&art, script_id);
        })?;
        Ok(Record {
            art,
            details_dir,
            calls_log,
            stdout_file,
            stderr_file,
            script_code,
            disk_note,
            live: live.clone(),
        })
    }

    /// The state directory's reserve set aside: refused only when its
    /// filesystem is full (any other failure is logged, and the start goes on).
    fn keep_reserve_for_start(&self, state: &crate::config::State) -> Result<(), Refused> {
        match self.store.keep_reserve(state.reserve_bytes) {
            Err(e) if is_no_space(&e) => Err(no_space(format!(
                "the filesystem of state.dir {} is full: the {} bytes kept there for \
                 recording scripts' ends (state.reserve_bytes) cannot be set aside ({e}); \
                 free space there, or put workspace roots on a filesystem apart from state.dir",
                state.dir.display(),
                state.reserve_bytes
            ))),
            Err(e) => {
                tracing::warn!("cannot keep the audit store's reserve: {e}");
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// The audit row of a script about to start.
    async fn insert_row(
        &self,
        live: &Live,
        script_id: &str,
        peer: Peer,
        p: &StartParams,
        a: &Admitted,
        approval: Approval,
    ) -> Result<(), Refused> {
        let details_dir = format!(".agent/scripts/{script_id}");
        // Retention's mark: the workspace's (dev, inode) when it may remove it
        // once unused (`prune::vouch`). Only while retention is on (decided by
        // the configuration as loaded); a workspace is marked at its next start
        // once it is turned on.
        let vouched = (live.cfg.workspace.retain_days > 0)
            .then(|| crate::daemon::prune::vouch(&a.workspace.dir, peer.uid(), a.identity.uid))
            .flatten();
        let row = StartRow {
            script_id: script_id.to_string(),
            run_id: a.claims.run_id.clone(),
            runner: a.claims.runner.clone(),
            peer_uid: peer.uid(),
            peer_pid: peer.pid(),
            run_uid: a.identity.uid,
            description: p.description.clone(),
            code: p.code.clone(),
            tools: a.plan.declared.iter().map(|(n, _)| n.clone()).collect(),
            approval: approval.as_str().into(),
            workspace: a.workspace.path.display().to_string(),
            backend: self.backend.kind.as_str().into(),
            unit: self.backend.backend.unit_for(script_id),
            started_at_ms: now_ms(),
            details_dir,
            scope: a.run_key.scope.to_db(),
            vouched,
            trace_id: a.trace.as_ref().map(|t| t.trace_id.clone()),
        };
        self.store.insert_started(row).await.map_err(|e| {
            if e.is_full() {
                no_space(format!(
                    "the filesystem of state.dir {} is full: {e}; free space there",
                    live.cfg.state.dir.display()
                ))
            } else {
                Refused::internal(format!("audit store: {e}"))
            }
        })
    }
}

/// The record's files: `script.py` with the code, and the empty logs.
fn write_record_files(art: &ArtifactDir, code: &str) -> Result<Logs, SysError> {
    let io_err = |op, name: &str| {
        let path = art.path.join(name);
        move |source| SysError::Path { op, path, source }
    };
    let mut f = art.create_file("script.py", 0o600)?;
    std::io::Write::write_all(&mut f, code.as_bytes()).map_err(io_err("write", "script.py"))?;
    Ok((
        art.create_file("calls.jsonl", 0o600)?,
        art.create_file("output.txt", 0o600)?,
        art.create_file("stderr.txt", 0o600)?,
    ))
}

/// Remove a record that could not be made in full (its files, then its
/// directory), by descriptor beneath `.agent`, never following a symlink.
fn remove_record(art: &ArtifactDir, script_id: &str) {
    use nix::fcntl::{openat, OFlag};
    use nix::unistd::{unlinkat, UnlinkatFlags};
    let dir_flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mode = nix::sys::stat::Mode::empty();
    let removed = (|| {
        let scripts = openat(&art.agent, "scripts", dir_flags, mode)?;
        let dir = openat(&scripts, script_id, dir_flags, mode)?;
        for name in ["script.py", "calls.jsonl", "output.txt", "stderr.txt"] {
            match unlinkat(&dir, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(nix::errno::Errno::ENOENT) => {}
                Err(e) => return Err(e),
            }
        }
        unlinkat(&scripts, script_id, UnlinkatFlags::RemoveDir)
    })();
    if let Err(e) = removed {
        tracing::warn!(script_id = %script_id, "cannot remove the record of a refused start, {}: {e}", art.path.display());
    }
}

/// ENOSPC or EDQUOT.
fn is_no_space(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
}

/// A start refused for want of disk space.
fn no_space(message: String) -> Refused {
    Refused::new(Reason::NoSpace, message)
}

/// A record that could not be made: a full filesystem is named as such.
fn record_error(what: &str, workspace: &WorkspaceDir, e: SysError) -> Refused {
    match &e {
        SysError::Path { source, .. } if is_no_space(source) => no_space(format!(
            "{what}: {e}: the filesystem of workspace {} is full; free space there \
             (scripts.file_max_bytes bounds each file a script writes, not their total: \
             a filesystem quota does)",
            workspace.path.display()
        )),
        _ => Refused::internal(format!("{what}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::{is_no_space, record_error, remove_record, write_record_files};
    use crate::protocol::refusal::Reason;
    use crate::sys::{ArtifactDir, Identity, SysError, WorkspaceDir};
    use std::path::PathBuf;

    fn me() -> Identity {
        Identity {
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
        }
    }

    /// A workspace `ws` under a fresh root, opened as the daemon opens it.
    fn workspace() -> (tempfile::TempDir, WorkspaceDir) {
        let tmp = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(tmp.path()).unwrap();
        std::fs::create_dir(root.join("ws")).unwrap();
        let ws = WorkspaceDir::open(&root.join("ws"), &[root]).unwrap();
        (tmp, ws)
    }

    #[test]
    fn a_record_holds_the_code_and_empty_logs_and_a_failed_one_goes_entirely() {
        let (_tmp, ws) = workspace();
        let art = ArtifactDir::create(&ws, "00aa", me(), me().uid == 0).unwrap();
        assert_eq!(art.path, ws.path.join(".agent/scripts/00aa"));
        write_record_files(&art, "print('hi')\n").unwrap();
        assert_eq!(
            std::fs::read_to_string(art.path.join("script.py")).unwrap(),
            "print('hi')\n"
        );
        for log in ["calls.jsonl", "output.txt", "stderr.txt"] {
            assert_eq!(
                std::fs::metadata(art.path.join(log)).unwrap().len(),
                0,
                "{log}"
            );
        }
        // A second write of the same record fails: its files exist (O_EXCL).
        assert!(write_record_files(&art, "again").is_err());
        remove_record(&art, "00aa");
        assert!(!art.path.exists());
        // `.agent/scripts` itself stays.
        assert!(ws.path.join(".agent/scripts").is_dir());
    }

    #[test]
    fn a_record_that_cannot_be_made_names_a_full_filesystem_as_such() {
        let (_tmp, ws) = workspace();
        let err = |errno: i32| SysError::Path {
            op: "write",
            path: PathBuf::from("script.py"),
            source: std::io::Error::from_raw_os_error(errno),
        };
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let r = record_error("cannot write the script's record", &ws, err(errno));
            assert_eq!(r.reason(), Reason::NoSpace);
            assert!(
                r.message().contains(&format!(
                    "the filesystem of workspace {} is full",
                    ws.path.display()
                )),
                "{}",
                r.message()
            );
        }
        let r = record_error("cannot write the script's record", &ws, err(libc::EACCES));
        assert_eq!(r.reason(), Reason::Internal);
        assert!(r
            .message()
            .starts_with("cannot write the script's record: "));
        assert!(is_no_space(&std::io::Error::from_raw_os_error(
            libc::EDQUOT
        )));
        assert!(!is_no_space(&std::io::Error::from_raw_os_error(libc::EIO)));
    }
}
