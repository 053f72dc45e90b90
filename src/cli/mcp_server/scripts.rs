//! The scripts this `scriptgate mcp` started. Each runs in a tokio task of its
//! own, owned by no request, so that it can outlive the call that started it
//! (answered with a task, or its client gone) and be found and cancelled by id;
//! what a call, `tasks/get` and `tasks/cancel` know of a script is here.

use super::line::Line;
use super::result;
use super::ui::McpUi;
use crate::cli::exit::Failure;
use crate::cli::run::{CliEngine, EmbeddedDaemon};
use crate::config::Config;
use crate::protocol::snapshot::Snapshot;
use crate::protocol::{StartParams, Status};
use rmcp::model::CallToolResult;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, watch};
use tokio_util::sync::CancellationToken;

/// Finished scripts kept here (their answers at hand for a re-issued call or a
/// `tasks/get`) this long; the records have them after.
const RETAIN: Duration = Duration::from_secs(10 * 60);
/// Finished scripts kept at most; running ones are bounded by the daemon's
/// `max_running`.
const MAX_FINISHED: usize = 256;

/// Who a call came from: the local user over stdio (`local:UID`), or the bearer
/// of `--http`'s token (`http:ID`). Approvals and tasks are bound to it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Principal(String);

impl Principal {
    pub(super) fn new(s: impl Into<String>) -> Principal {
        Principal(s.into())
    }

    /// The user this process runs as, over stdio.
    pub(super) fn local() -> Principal {
        Principal(format!("local:{}", nix::unistd::getuid()))
    }

    pub(super) fn as_str(&self) -> &str {
        &self.0
    }
}

/// A call's identity for re-issues: a digest of its principal and what it asks
/// (`approval::Subject`).
pub(super) type RequestKey = [u8; 32];

/// Where scripts run, chosen once at start.
pub(super) enum Where {
    Embedded(EmbeddedDaemon),
    Socket {
        path: PathBuf,
        system: bool,
        cfg: Box<Config>,
    },
}

/// What is asked of a new script.
pub(super) struct Launch {
    pub(super) workspace: PathBuf,
    pub(super) snap: Snapshot,
    pub(super) params: StartParams,
    pub(super) engine: Arc<CliEngine>,
    pub(super) ui: Arc<McpUi>,
    pub(super) owner: Principal,
    pub(super) key: RequestKey,
    /// The connection of the call that starts it, where that call leaves it
    /// to run on when its client goes.
    pub(super) line: Option<Arc<Line>>,
}

/// Who is waiting for a script's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// The call that started it (or one that adopted it) waits.
    Call,
    /// The call was answered with a task: `tasks/get` reads it.
    Task,
    /// Its call went away unanswered: a re-issue of the same call adopts it.
    Orphan,
    /// Its answer went out.
    Delivered,
}

/// A finished script's answer.
pub(super) struct Done {
    /// Exactly what the call would have answered.
    pub(super) answer: CallToolResult,
    /// Its status; `None` when the daemon went away before the result.
    pub(super) status: Option<Status>,
    pub(super) at: Instant,
}

pub(super) struct Script {
    pub(super) id: String,
    pub(super) workspace: PathBuf,
    pub(super) owner: Principal,
    key: RequestKey,
    ui: Arc<McpUi>,
    done: watch::Receiver<Option<Arc<Done>>>,
    cancel: CancellationToken,
    claim: Mutex<Holder>,
}

/// Who holds a script, and since which claim.
struct Holder {
    claim: Claim,
    /// Counts claims: a call acts on its script at its end only if no other
    /// claim came after its own (`Script::hold`, `Script::release`).
    turn: u64,
    /// The connection of the call that holds it, where that call leaves the
    /// script to run on when its client goes (it declared tasks).
    line: Option<Arc<Line>>,
}

impl Script {
    /// Its answer, once it has finished.
    pub(super) async fn wait(&self) -> Arc<Done> {
        let mut rx = self.done.clone();
        loop {
            if let Some(d) = rx.borrow_and_update().clone() {
                return d;
            }
            if rx.changed().await.is_err() {
                // The task that runs it always sends before it ends.
                if let Some(d) = rx.borrow().clone() {
                    return d;
                }
                return Arc::new(Done {
                    answer: result::lost("the script's supervision ended without a result"),
                    status: None,
                    at: Instant::now(),
                });
            }
        }
    }

    /// Its answer if it has finished.
    pub(super) fn finished(&self) -> Option<Arc<Done>> {
        self.done.borrow().clone()
    }

    /// End it: it finishes `cancelled`, with its record.
    pub(super) fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Its newest progress, as one line.
    pub(super) fn status_line(&self) -> String {
        self.ui.line()
    }

    fn holder(&self) -> std::sync::MutexGuard<'_, Holder> {
        self.claim.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn claim(&self) -> Claim {
        self.holder().claim
    }

    pub(super) fn set_claim(&self, c: Claim) {
        self.claim_as(&mut self.holder(), c);
    }

    fn claim_as(&self, h: &mut Holder, c: Claim) {
        h.claim = c;
        h.turn += 1;
        h.line = None;
        if c != Claim::Call {
            // Nobody reads progress on the call any more.
            self.ui.detach();
        }
    }

    /// A call waits for it now (on `line`, if it leaves the script to run on
    /// when its client goes): the turn to give `release`.
    pub(super) fn hold(&self, line: Option<Arc<Line>>) -> u64 {
        let mut h = self.holder();
        self.claim_as(&mut h, Claim::Call);
        h.line = line;
        h.turn
    }

    /// The call of `turn` answered: the script is claimed `c` now, unless
    /// another claim came after that call's.
    pub(super) fn settle(&self, turn: u64, c: Claim) {
        let mut h = self.holder();
        if h.turn == turn {
            self.claim_as(&mut h, c);
        }
    }

    /// The call of `turn` went away unanswered: the script is an orphan (a
    /// re-issue adopts it) if `keep`, else it is cancelled; nothing if another
    /// claim came after that call's (a re-issue adopted it already).
    pub(super) fn release(&self, turn: u64, keep: bool) {
        let mut h = self.holder();
        if h.turn != turn {
            return;
        }
        let c = if keep {
            Claim::Orphan
        } else {
            Claim::Delivered
        };
        self.claim_as(&mut h, c);
        drop(h);
        if !keep {
            self.cancel();
        }
    }

    /// A re-issue of its call may take it: its call went away unanswered, or
    /// the client of the call that holds it hung up (which that call may not
    /// have learnt yet).
    fn adoptable(&self) -> bool {
        let h = self.holder();
        match h.claim {
            Claim::Orphan => true,
            Claim::Call => h.line.as_ref().is_some_and(|l| l.hung_up()),
            Claim::Task | Claim::Delivered => false,
        }
    }
}

pub(super) struct Scripts {
    runs_in: Where,
    map: Mutex<HashMap<String, Arc<Script>>>,
    /// The id of each script as it finishes (task notifications listen here).
    finished: broadcast::Sender<String>,
    /// Starts under way.
    starting: watch::Sender<usize>,
    /// The process is stopping: a start that ends now is cancelled.
    stopping: std::sync::atomic::AtomicBool,
}

impl Scripts {
    pub(super) fn new(runs_in: Where) -> Scripts {
        Scripts {
            runs_in,
            map: Mutex::default(),
            finished: broadcast::channel(256).0,
            starting: watch::channel(0).0,
            stopping: Default::default(),
        }
    }

    pub(super) fn runs_in(&self) -> &Where {
        &self.runs_in
    }

    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Script>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The ids of scripts as they finish.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<String> {
        self.finished.subscribe()
    }

    pub(super) fn get(&self, id: &str) -> Option<Arc<Script>> {
        self.map().get(id).cloned()
    }

    /// A script of `owner` that `key` asks for again, whose call went away
    /// unanswered (or is going: its client hung up): it is this call's now.
    pub(super) fn adopt_orphan(&self, owner: &Principal, key: &RequestKey) -> Option<Arc<Script>> {
        let map = self.map();
        let s = map
            .values()
            .find(|s| &s.owner == owner && &s.key == key && s.adoptable())
            .cloned()?;
        // Under the map's lock: two re-issues never adopt one script.
        s.set_claim(Claim::Call);
        Some(s)
    }

    /// Start a script: answers once the daemon has started it (recorded and
    /// running; its approval asked on the way), or with why not. It then runs
    /// on in a task of its own until it finishes or is cancelled.
    pub(super) async fn start(self: &Arc<Self>, l: Launch) -> Result<Arc<Script>, Failure> {
        // The start runs in a task of its own: a call dropped meanwhile (its
        // client gone) leaves no recorded script unsupervised, and the exit
        // waits for it (`cancel_all`).
        let (tx, rx) = tokio::sync::oneshot::channel();
        let me = self.clone();
        self.starting.send_modify(|n| *n += 1);
        tokio::spawn(async move {
            let r = me.start_here(l).await;
            if let Ok(s) = &r {
                if me.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                    s.cancel();
                }
            }
            me.starting.send_modify(|n| *n -= 1);
            let _ = tx.send(r);
        });
        rx.await
            .unwrap_or_else(|_| Err(Failure::setup("the script's start was abandoned")))
    }

    async fn start_here(self: &Arc<Self>, l: Launch) -> Result<Arc<Script>, Failure> {
        let Launch {
            workspace,
            snap,
            params,
            engine,
            ui,
            owner,
            key,
            line,
        } = l;
        enum Started {
            Embedded(String),
            Socket(Box<crate::cli::run::SocketScript>),
        }
        let started = match &self.runs_in {
            Where::Embedded(d) => Started::Embedded(d.start_script(snap, params, engine).await?),
            Where::Socket { path, system, cfg } => {
                let c = crate::cli::run::connect(path, *system, cfg).await?;
                Started::Socket(Box::new(
                    crate::cli::run::start_socket(c, cfg, snap, params, engine).await?,
                ))
            }
        };
        let id = match &started {
            Started::Embedded(id) => id.clone(),
            Started::Socket(s) => s.script_id.clone(),
        };
        let (tx, rx) = watch::channel(None);
        let cancel = CancellationToken::new();
        let script = Arc::new(Script {
            id: id.clone(),
            workspace: workspace.clone(),
            owner,
            key,
            ui: ui.clone(),
            done: rx,
            cancel: cancel.clone(),
            claim: Mutex::new(Holder {
                claim: Claim::Call,
                turn: 0,
                line,
            }),
        });
        self.insert(script.clone());
        let me = self.clone();
        tokio::spawn(async move {
            let pacer = tokio::spawn(ui.clone().pace());
            let cancelled = cancel.cancelled();
            let r = match started {
                Started::Embedded(id) => match &me.runs_in {
                    Where::Embedded(d) => d.wait_script(id, cancelled).await,
                    Where::Socket { .. } => unreachable!("started embedded"),
                },
                Started::Socket(s) => s.wait(cancelled).await,
            };
            pacer.abort();
            let _ = pacer.await;
            let done = match r {
                Ok(res) => {
                    ui.finish(&res).await;
                    Done {
                        answer: result::of_script(&res, &workspace, None),
                        status: Some(res.status),
                        at: Instant::now(),
                    }
                }
                Err(f) => Done {
                    answer: result::lost(&f.message),
                    status: None,
                    at: Instant::now(),
                },
            };
            let _ = tx.send(Some(Arc::new(done)));
            let _ = me.finished.send(id);
        });
        Ok(script)
    }

    fn insert(&self, s: Arc<Script>) {
        let mut map = self.map();
        // Finished scripts whose answer went out or was read as a task go after
        // RETAIN, and the oldest finished ones past MAX_FINISHED; an orphan too
        // after RETAIN (its record keeps it).
        let now = Instant::now();
        map.retain(|_, s| match s.finished() {
            Some(d) => now.duration_since(d.at) < RETAIN,
            None => true,
        });
        let mut finished: Vec<(Instant, String)> = map
            .values()
            .filter_map(|s| s.finished().map(|d| (d.at, s.id.clone())))
            .collect();
        if finished.len() >= MAX_FINISHED {
            finished.sort();
            for (_, id) in &finished[..=finished.len() - MAX_FINISHED] {
                map.remove(id);
            }
        }
        map.insert(s.id.clone(), s);
    }

    /// The scripts still running.
    pub(super) fn running(&self) -> Vec<Arc<Script>> {
        self.map()
            .values()
            .filter(|s| s.finished().is_none())
            .cloned()
            .collect()
    }

    /// Cancel every running script and wait until each has finished (its record
    /// written), for at most `limit`. Answers how many were still running then.
    pub(super) async fn cancel_all(&self, limit: Duration) -> usize {
        self.stopping
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let all = async {
            // Starts under way end first (each then cancelled as it ends).
            let mut starting = self.starting.subscribe();
            let _ = starting.wait_for(|n| *n == 0).await;
            let running = self.running();
            for s in &running {
                s.cancel();
            }
            futures::future::join_all(running.iter().map(|s| s.wait())).await;
        };
        let left = match tokio::time::timeout(limit, all).await {
            Ok(()) => 0,
            Err(_) => self.running().len() + *self.starting.borrow(),
        };
        if let Where::Embedded(d) = &self.runs_in {
            d.settled().await;
        }
        left
    }
}
