//! A reload (`systemctl reload scriptgate`, SIGHUP): the configuration file read
//! and checked again, its live keys (`config::LIVE_KEYS`) swapped in for the
//! scripts that start after it, the keys that need a restart named as pending.
//! A running script keeps what it started with: its start took one [`Live`] and
//! holds its own copy of everything it reads of it.

use crate::config::{Config, Reloaded, Source};
use crate::daemon::admission::Rules;
use crate::daemon::live::{Live, Loaded};
use crate::daemon::Daemon;
use crate::protocol::{ConfigState, LastReload};
use crate::time::now_ms;
use std::sync::Arc;

impl Daemon {
    /// The configuration in force now (one start takes it once).
    pub fn live(&self) -> Arc<Live> {
        self.live.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The configuration in force as a [`Live`]: `cfg` with what derives from it.
    pub(crate) fn make_live(&self, cfg: Config) -> Live {
        Live {
            rules: Rules::new(&cfg, &self.preflight),
            settings: crate::script::Settings::new(
                &cfg,
                self.runtime_dir.clone(),
                self.preflight.sandbox.disable_userns,
                self.backend.backend.clone(),
                &self.spawner,
            ),
            cfg,
        }
    }

    /// Where the configuration in force was read (`scriptgated`'s file; an
    /// embedded daemon has none and cannot reload).
    pub fn loaded_from(&self, source: Source) {
        *self.loaded.lock().unwrap_or_else(|p| p.into_inner()) = Some(Loaded {
            source,
            loaded_ms: now_ms(),
            pending: Vec::new(),
            last: None,
        });
    }

    /// Read the configuration file again. On success the live keys are in
    /// force for every script that starts from now on; the answer names them
    /// and the keys that need a restart. A file that does not check (or whose
    /// token key does not) changes nothing: the error says why.
    pub fn reload(&self) -> Result<Reloaded, String> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let Some(l) = loaded.as_mut() else {
            return Err("this daemon was started without a configuration file".into());
        };
        let read = Config::load_with_source(&l.source.path, l.source.explicit).and_then(
            |(file, source)| {
                file.read_key()?;
                let r = self.live().cfg.reloaded(&file, &l.source.path)?;
                Ok((r, source))
            },
        );
        let at_ms = now_ms();
        match read {
            Ok((r, source)) => {
                let live = Arc::new(self.make_live(r.cfg.clone()));
                *self.live.write().unwrap_or_else(|p| p.into_inner()) = live;
                l.source = source;
                l.loaded_ms = at_ms;
                l.pending = r.pending.clone();
                l.last = Some(LastReload { at_ms, error: None });
                Ok(r)
            }
            Err(e) => {
                let e = e.to_string();
                l.last = Some(LastReload {
                    at_ms,
                    error: Some(e.clone()),
                });
                Err(e)
            }
        }
    }

    /// Decide the bound on all scripts together from the configuration in
    /// force and the host (`limits::aggregate`) and set it on the backend: at
    /// start and after each reload (its keys are live; running scripts are
    /// held to it at once). A failure is logged and kept for `daemon.info`;
    /// scripts still run, each within its own limits.
    pub async fn bound_all_scripts(&self) {
        use crate::limits::aggregate;
        let mut a = aggregate::decide(&self.live().cfg.scripts, &aggregate::Host::read());
        let said = aggregate::summary(&a);
        match self.backend.backend.bound_all(&a).await {
            Ok(()) if self.backend.backend.all_scripts_place().is_some() => {
                tracing::info!("all scripts together: {said}")
            }
            Ok(()) => tracing::debug!("all scripts together: not bounded on the rlimit backend"),
            Err(e) => {
                tracing::warn!("all scripts together: the bound is NOT in force ({said}): {e}");
                a.problem = Some(format!("could not be set: {e}"));
            }
        }
        *self.all_scripts.lock().unwrap_or_else(|p| p.into_inner()) = a;
    }

    /// `daemon.info`'s `all_scripts`: the bound as set, read back from its
    /// cgroup, with what all scripts hold now.
    pub(crate) fn all_scripts_info(&self) -> crate::protocol::AllScripts {
        let mut a = self
            .all_scripts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let place = self.backend.backend.all_scripts_place();
        if a.problem.is_some() {
            a.cgroup = place.map(|p| p.dir().display().to_string());
            a.in_force = false;
        } else {
            crate::limits::aggregate::read_back(&mut a, place.as_ref());
        }
        a
    }

    /// `daemon.info`'s `config`: the file, whether the daemon runs with it as
    /// it is on disk now, what a restart would still change, the last reload.
    pub(crate) fn config_state(&self) -> Option<ConfigState> {
        let l = self
            .loaded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()?;
        let on_disk = match Source::digest_now(&l.source.path) {
            Ok(d) if d == l.source.digest => "same".to_string(),
            Ok(None) => "missing".to_string(),
            Ok(Some(_)) => "changed".to_string(),
            Err(e) => format!("unreadable: {e}"),
        };
        let modified_ms = std::fs::metadata(&l.source.path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_millis() as i64);
        Some(ConfigState {
            path: l.source.path.display().to_string(),
            digest: l.source.digest.clone(),
            loaded_ms: l.loaded_ms,
            on_disk,
            modified_ms,
            pending_restart: l.pending.clone(),
            last_reload: l.last.clone(),
        })
    }
}
