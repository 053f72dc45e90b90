//! `cargo bench`: scriptgate's goals, each figure beside its baseline measured in
//! the same run (a ratio, so that a busy machine matters less), through the real
//! daemon, socket, bwrap and Python (the same rig as the tests). Not a pass/fail
//! test: it prints numbers; docs/BENCHMARKS.md records them.
//!
//! `SCRIPTGATE_BENCH_ROUNDS` (default 3) repeats the goal figures;
//! `SCRIPTGATE_BENCH_DAEMON=/path/to/scriptgated` measures another build (e.g. the
//! one before a change) with the same bench; `SCRIPTGATE_BENCH_SCALE=0` skips the
//! scale table; `SCRIPTGATE_BENCH_POOL=0` the pre-made sandboxes' figures (pool
//! on and off, side by side).
#[path = "support/baselines.rs"]
mod baselines;
#[path = "../tests/common/mod.rs"]
mod common;
#[path = "support/inline.rs"]
mod inline;

use common::*;
use inline::Inline;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn pct(v: &[f64], p: usize) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[(v.len() - 1) * p / 100]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The daemon's resident set (VmRSS) or peak (VmHWM), KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// The daemon's CPU time so far (user + system, all threads), seconds.
fn cpu_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &s[s.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split(' ').collect();
    // Fields 14 and 15 of stat(5); `after` starts at field 3.
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / clk_tck()
}

fn clk_tck() -> f64 {
    let out = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A script that times `n` sequential calls inside the sandbox: p50 and p99, µs.
fn sequential_script(n: usize) -> String {
    format!(
        "import agent_tools, time, json\nts = []\nfor i in range({}):\n    t = time.perf_counter()\n    agent_tools.call('fleet__list_devices', {{}})\n    ts.append(time.perf_counter() - t)\nts = sorted(ts[100:])\nprint(ts[len(ts) // 2] * 1e6, ts[len(ts) * 99 // 100] * 1e6)",
        n + 100
    )
}

/// A script that times one call_many of `n` items inside the sandbox: seconds.
fn call_many_script(n: usize) -> String {
    format!("import agent_tools, time\nagent_tools.call_many('fleet__get_device_status', [{{'sn': 'SN1'}}] * 100)\nt = time.perf_counter()\nr = agent_tools.call_many('fleet__get_device_status', [{{'sn': f'SN{{i}}'}} for i in range({n})])\nd = time.perf_counter() - t\nassert len(r) == {n}\nprint(d)")
}

fn two_floats(r: &Value) -> (f64, f64) {
    assert_eq!(r["status"], "ok", "{r}");
    let v: Vec<f64> = r["output"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    (v[0], *v.get(1).unwrap_or(&0.0))
}

/// `script.cancel` of a script with four calls held at the engine: ms to its
/// answer, and to the first `tool.cancelled` the engine gets.
fn cancel_figures(rig: &Rig, token: &str) -> (f64, f64) {
    let e = rig.engine();
    let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let g = gate.clone();
    e.set_handler(Arc::new(move |_, _| {
        let (m, cv) = &*g;
        let held = m.lock().unwrap();
        let _ = cv.wait_timeout_while(held, Duration::from_secs(60), |open| !*open);
        Ok(serde_json::json!({"text": "late", "is_error": false}))
    }));
    let id = e
        .start(
            token,
            "import agent_tools\nagent_tools.call_many('fleet__list_devices', [{}] * 4)\n",
            &[],
        )
        .unwrap();
    eventually("four calls held", Duration::from_secs(30), || {
        e.seen.lock().unwrap().in_flight == 4
    });
    let t0 = Instant::now();
    let r = e
        .request("script.cancel", serde_json::json!({"script_id": id}))
        .unwrap();
    let answered = ms(t0.elapsed());
    assert_eq!(r["state"], "cancelled", "{r}");
    let told = e
        .notifications("tool.cancelled")
        .first()
        .map(|(_, at)| ms(at.duration_since(t0)))
        .expect("no tool.cancelled");
    *gate.0.lock().unwrap() = true;
    gate.1.notify_all();
    (answered, told)
}

struct Round {
    cancel: (f64, f64),
    hop_p50: f64,
    seq_inline: (f64, f64),
    seq_threaded: (f64, f64),
    many_inline: f64,
    many_inline_e2e: f64,
    many_threaded: f64,
    bare_python: f64,
    bare_bwrap: f64,
    empty: f64,
}

fn round(rig: &Rig, inline: &Inline, threaded: &Engine, token: &str) -> Round {
    const SEQ: usize = 1000;
    const MANY: usize = 5000;
    let pid = rig.daemon.as_ref().unwrap().id();
    let trace = |what: &str| {
        if std::env::var_os("SCRIPTGATE_BENCH_TRACE_RSS").is_some() {
            println!(
                "    daemon RSS after {what}: {} KiB ({} KiB anonymous)",
                status_kib(pid, "VmRSS:"),
                status_kib(pid, "RssAnon:")
            );
        }
    };
    let hop_p50 = baselines::raw_hop(2000).0;
    let seq_inline = two_floats(&inline.run(token, &sequential_script(SEQ)));
    trace("sequential, inline");
    let seq_threaded = two_floats(&threaded.run(token, &sequential_script(SEQ), &[]));
    trace("sequential, threaded");
    let t = Instant::now();
    let r = inline.run(token, &call_many_script(MANY));
    let e2e = t.elapsed();
    let many_inline = MANY as f64 / two_floats(&r).0;
    let many_inline_e2e = (MANY + 100) as f64 / e2e.as_secs_f64();
    trace("call_many, inline");
    let many_threaded =
        MANY as f64 / two_floats(&threaded.run(token, &call_many_script(MANY), &[])).0;
    trace("call_many, threaded");
    // Start to result, interleaved with its baselines so that they see the same load.
    let (mut py, mut bw, mut sg) = (vec![], vec![], vec![]);
    for _ in 0..11 {
        py.push(ms(baselines::bare_python()));
        bw.push(ms(baselines::bare_bwrap(script_uid())));
        let t = Instant::now();
        let r = inline.run(token, "print(1)");
        sg.push(ms(t.elapsed()));
        assert_eq!(
            (r["status"].as_str(), r["output"].as_str()),
            (Some("ok"), Some("1\n"))
        );
    }
    trace("empty scripts");
    let cancel = cancel_figures(rig, token);
    Round {
        cancel,
        hop_p50,
        seq_inline,
        seq_threaded,
        many_inline,
        many_inline_e2e,
        many_threaded,
        bare_python: pct(&py, 50),
        bare_bwrap: pct(&bw, 50),
        empty: pct(&sg, 50),
    }
}

/// Median and range over the rounds of one figure.
fn spread(v: &[f64]) -> String {
    format!("{:.2} ({:.2}–{:.2})", pct(v, 50), pct(v, 0), pct(v, 100))
}

fn spread0(v: &[f64]) -> String {
    format!("{:.0} ({:.0}–{:.0})", pct(v, 50), pct(v, 0), pct(v, 100))
}

fn main() {
    let rounds = env_usize("SCRIPTGATE_BENCH_ROUNDS", 3);
    // Cold starts here (the pre-made sandboxes' rig is `pool_figures`').
    let mut rig = Rig::with_config(
        "[server]\nmax_running = 300\n[scripts]\nmax_calls = 100000\ntasks_max = 4096\n[sandbox]\npool_size = 0\n",
    );
    if let Some(d) = std::env::var_os("SCRIPTGATE_BENCH_DAEMON") {
        // Another build of the daemon, on the same rig.
        rig.stop(nix::sys::signal::Signal::SIGKILL);
        let log = std::fs::File::create(&rig.log).unwrap();
        let _ = std::fs::remove_file(&rig.socket);
        let child = std::process::Command::new(&d)
            .arg("--listen")
            .arg(&rig.socket)
            .arg("--config")
            .arg(&rig.config)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        rig.daemon = Some(child);
        eventually("the daemon listens", Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&rig.socket).is_ok()
        });
        println!("daemon: {}", d.to_string_lossy());
    }
    let pid = rig.daemon.as_ref().unwrap().id();
    let idle_fresh = status_kib(pid, "VmRSS:");
    let anon_fresh = status_kib(pid, "RssAnon:");
    let token = rig.token(&rig.snapshot("auto"));
    let inline = Arc::new(Inline::connect(&rig.socket));
    let threaded = rig.engine();
    for _ in 0..3 {
        inline.run(
            &token,
            "import agent_tools\nagent_tools.call('fleet__list_devices', {})",
        );
    }

    println!(
        "Goal figures, {rounds} rounds; each round measures its baselines beside its figures."
    );
    println!("Per round: raw hop p50 µs | sequential call() p50 µs (hops) inline / thread-per-call engine | call_many calls/s inline (end to end) / thread-per-call | empty script ms vs bare bwrap+python, bare python");
    let mut all = vec![];
    for i in 0..rounds {
        let r = round(&rig, &inline, &threaded, &token);
        println!(
            "  round {}: hop {:.0} | call {:.0} ({:.2} hops) / {:.0} ({:.2} hops) | {:.0} ({:.0}) / {:.0} | {:.1} ms vs {:.1} ms ({:.2}x), {:.1} ms ({:.2}x)",
            i + 1,
            r.hop_p50,
            r.seq_inline.0,
            r.seq_inline.0 / r.hop_p50,
            r.seq_threaded.0,
            r.seq_threaded.0 / r.hop_p50,
            r.many_inline,
            r.many_inline_e2e,
            r.many_threaded,
            r.empty,
            r.bare_bwrap,
            r.empty / r.bare_bwrap,
            r.bare_python,
            r.empty / r.bare_python,
        );
        all.push(r);
    }
    let col = |f: &dyn Fn(&Round) -> f64| all.iter().map(f).collect::<Vec<f64>>();
    let idle = status_kib(pid, "VmRSS:");
    let anon = status_kib(pid, "RssAnon:");
    println!();
    println!("| figure | median (min–max over {rounds} rounds) | goal |");
    println!("|---|---|---|");
    println!(
        "| raw JSON-line pipe hop, Python↔Python, p50 | {} µs | baseline |",
        spread0(&col(&|r| r.hop_p50))
    );
    println!(
        "| sequential `call()` p50, inline engine | {} µs = {} hops | ≤ 2.5 hops |",
        spread0(&col(&|r| r.seq_inline.0)),
        spread(&col(&|r| r.seq_inline.0 / r.hop_p50))
    );
    println!(
        "| sequential `call()` p99, inline engine | {} µs | report |",
        spread0(&col(&|r| r.seq_inline.1))
    );
    println!(
        "| sequential `call()` p50, thread-per-call engine | {} µs = {} hops | report |",
        spread0(&col(&|r| r.seq_threaded.0)),
        spread(&col(&|r| r.seq_threaded.0 / r.hop_p50))
    );
    println!(
        "| `call_many` (5000 items), inline engine, in the script | {} calls/s | ≥ 20,000/s |",
        spread0(&col(&|r| r.many_inline))
    );
    println!(
        "| the same, end to end (start to result, 5100 calls) | {} calls/s | report |",
        spread0(&col(&|r| r.many_inline_e2e))
    );
    println!(
        "| `call_many`, thread-per-call engine, in the script | {} calls/s | report |",
        spread0(&col(&|r| r.many_threaded))
    );
    println!("| empty script (`print(1)`) start to result, {RIG_BACKEND} backend | {} ms = {}x bare bwrap+python ({} ms) | ≤ 1.3x |", spread(&col(&|r| r.empty)), spread(&col(&|r| r.empty / r.bare_bwrap)), spread(&col(&|r| r.bare_bwrap)));
    // The production backends need systemd as PID 1 and a delegated cgroup v2
    // subtree, which this host may not have: tests/vm/run measures the same ratio
    // on all three backends in a booted Debian guest (tests/vm/jobs/bench_backends.py).
    println!("| the same on the systemd and cgroup backends | see `bench` lines of tests/vm/run (target/vm/figures-SUITE.txt) | report |");
    println!(
        "| the same against bare `python3 -c 'print(1)'` | {}x ({} ms) | report |",
        spread(&col(&|r| r.empty / r.bare_python)),
        spread(&col(&|r| r.bare_python))
    );
    println!(
        "| `script.cancel` with 4 calls at the engine → its answer | {} ms | ≤ 500 ms |",
        spread(&col(&|r| r.cancel.0))
    );
    println!(
        "| the same → the engine's first `tool.cancelled` | {} ms | ≤ 200 ms |",
        spread(&col(&|r| r.cancel.1))
    );
    println!(
        "| daemon RSS idle: fresh / after the rounds | {:.1} MiB / {:.1} MiB | ≤ 15 MiB |",
        idle_fresh as f64 / 1024.0,
        idle as f64 / 1024.0
    );
    // The heap and stacks, without the binary's code pages (which grow with the
    // code paths run): what a leak or a cache held for good would grow.
    println!(
        "| the same, anonymous part only (RssAnon) | {:.1} MiB / {:.1} MiB | report |",
        anon_fresh as f64 / 1024.0,
        anon as f64 / 1024.0
    );

    if env_usize("SCRIPTGATE_BENCH_POOL", 1) != 0 {
        pool_figures(&inline, &token, pid);
    }
    if env_usize("SCRIPTGATE_BENCH_SCALE", 1) == 0 {
        return;
    }
    println!();
    println!("Scale: N scripts started at once, each makes one call, waits until all N are running, then M calls; inline engine.");
    println!("| scripts N | calls M | all ok with audit rows | start → running answer p50 / p99 | start → first call p50 / p99 | daemon RSS, all running | daemon CPU per script start | daemon CPU per call | wall, go → all done |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (n, m) in [
        (1, 100),
        (16, 100),
        (64, 100),
        (256, 100),
        (16, 1000),
        (64, 1000),
    ] {
        scale(&rig, &inline, &token, pid, n, m);
    }
    println!();
    println!(
        "daemon peak RSS (VmHWM) over the whole bench: {:.1} MiB",
        status_kib(pid, "VmHWM:") as f64 / 1024.0
    );
}

fn scale(rig: &Rig, inline: &Arc<Inline>, token: &str, pid: u32, n: usize, m: usize) {
    let go = rig.workspace.join("go");
    let _ = std::fs::remove_file(&go);
    let code = format!("import agent_tools, os, time\nagent_tools.call('fleet__list_devices', {{}})\nwhile not os.path.exists('go'):\n    time.sleep(0.05)\nfor i in range({m}):\n    agent_tools.call('fleet__get_device_status', {{'sn': 'SN%d' % i}})\n");
    let cpu0 = cpu_s(pid);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut threads = vec![];
    for _ in 0..n {
        let (inline, token, code, tx) =
            (inline.clone(), token.to_string(), code.clone(), tx.clone());
        threads.push(std::thread::spawn(move || {
            let t0 = Instant::now();
            let id = inline.start(&token, &code);
            let running = t0.elapsed();
            tx.send((id.clone(), t0, running)).unwrap();
            inline.wait(&id)
        }));
    }
    let started: Vec<(String, Instant, Duration)> = (0..n).map(|_| rx.recv().unwrap()).collect();
    let first = |id: &str| inline.first_call.lock().unwrap().get(id).copied();
    eventually(
        "every script made its first call",
        Duration::from_secs(600),
        || started.iter().all(|(id, ..)| first(id).is_some()),
    );
    let rss = status_kib(pid, "VmRSS:");
    let cpu1 = cpu_s(pid);
    let t_go = Instant::now();
    std::fs::write(&go, b"").unwrap();
    let results: Vec<Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let wall = t_go.elapsed();
    let cpu2 = cpu_s(pid);
    let _ = std::fs::remove_file(&go);
    let ok = results
        .iter()
        .all(|r| r["status"] == "ok" && r["calls"].as_u64() == Some(m as u64 + 1));
    // Every script has its audit row, finished, with its calls counted.
    let db = rusqlite::Connection::open_with_flags(
        rig.state.join("scriptgate.db"),
        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
    )
    .unwrap();
    let rows = started
        .iter()
        .filter(|(id, ..)| {
            db.query_row(
                "SELECT status, calls FROM scripts WHERE script_id = ?1 AND ended_at IS NOT NULL",
                [id],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
            )
            .map(|(s, c)| s == "ok" && c == m as i64 + 1)
            .unwrap_or(false)
        })
        .count();
    let running: Vec<f64> = started.iter().map(|s| ms(s.2)).collect();
    let first_call: Vec<f64> = started
        .iter()
        .map(|(id, t0, _)| ms(first(id).unwrap() - *t0))
        .collect();
    println!(
        "| {n} | {m} | {} ({rows}/{n} rows) | {:.0} / {:.0} ms | {:.0} / {:.0} ms | {:.1} MiB | {:.1} ms | {:.1} µs | {:.2} s |",
        if ok && rows == n { "yes" } else { "NO" },
        pct(&running, 50),
        pct(&running, 99),
        pct(&first_call, 50),
        pct(&first_call, 99),
        rss as f64 / 1024.0,
        (cpu1 - cpu0) * 1000.0 / n as f64,
        (cpu2 - cpu1) * 1e6 / (n * m) as f64,
        wall.as_secs_f64(),
    );
}

/// Pre-made sandboxes (`sandbox.pool_size`) against cold starts, interleaved with
/// the bare bwrap+python baseline so that all three see the same load: an empty
/// script start to result, and start to the engine's first `tool.call` (the
/// inline engine's clock). A pooled run waits, outside its timing, for a member
/// to be waiting (a burst larger than the pool starts cold: the scale table).
fn pool_figures(cold: &Inline, token: &str, cold_pid: u32) {
    const N: usize = 31;
    let rig = Rig::with_config(
        "[server]\nmax_running = 300\n[scripts]\nmax_calls = 100000\ntasks_max = 4096\n[sandbox]\npool_size = 4\n",
    );
    let pooled = Inline::connect(&rig.socket);
    let ptoken = rig.token(&rig.snapshot("auto"));
    let info = rig.engine();
    let waiting = || {
        info.request("daemon.info", serde_json::json!({})).unwrap()["pool"]["waiting"]
            .as_u64()
            .unwrap_or(0)
    };
    let member_ready = |n: u64| {
        eventually("a waiting member", Duration::from_secs(60), || {
            waiting() >= n
        })
    };
    let call = "import agent_tools\nagent_tools.call('fleet__list_devices', {})\n";
    let first = |e: &Inline, token: &str| {
        let t0 = Instant::now();
        let id = e.start(token, call);
        let r = e.wait(&id);
        assert_eq!(r["status"], "ok", "{r}");
        let at = e.first_call.lock().unwrap().get(&id).copied().unwrap();
        (ms(at - t0), r)
    };
    let (mut bw, mut c_empty, mut p_empty, mut c_first, mut p_first) =
        (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..N {
        bw.push(ms(baselines::bare_bwrap(script_uid())));
        let t = Instant::now();
        let r = cold.run(token, "print(1)");
        c_empty.push(ms(t.elapsed()));
        assert_eq!(r["output"], "1\n", "{r}");
        member_ready(1);
        let t = Instant::now();
        let r = pooled.run(&ptoken, "print(1)");
        p_empty.push(ms(t.elapsed()));
        assert_eq!(
            (&r["output"], &r["pre_made"]),
            (&Value::from("1\n"), &Value::from(true)),
            "{r}"
        );
        c_first.push(first(cold, token).0);
        member_ready(1);
        let (f, r) = first(&pooled, &ptoken);
        assert_eq!(r["pre_made"], true, "{r}");
        p_first.push(f);
    }
    // What the waiting members hold: every process below the daemon once the
    // pool is full and no script runs (bwrap, the init, Python, the helper).
    member_ready(4);
    let pid = rig.daemon.as_ref().unwrap().id();
    let is_server = |p: &u32| {
        std::fs::read(format!("/proc/{p}/cmdline"))
            .is_ok_and(|c| c.windows(22).any(|w| w == b"--sandbox-mount-server"))
    };
    let (servers, below): (Vec<u32>, Vec<u32>) = descendants(pid).into_iter().partition(is_server);
    let server_pss: u64 = servers.iter().map(|p| smaps_kib(*p, "Pss:")).sum();
    let pss_kib: u64 = below.iter().map(|p| smaps_kib(*p, "Pss:")).sum();
    let rss_kib: u64 = below.iter().map(|p| smaps_kib(*p, "Rss:")).sum();
    println!();
    println!("Pre-made sandboxes (sandbox.pool_size = 4), {N} runs each, interleaved:");
    println!("| figure | pool | cold | ratio | target |");
    println!("|---|---|---|---|---|");
    let p50 = |v: &[f64]| pct(v, 50);
    let bwrap = p50(&bw);
    println!(
        "| `script.start` → the engine's first `tool.call`, p50 / p99 | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.2}x | ≤ 5 ms p50, ≤ 15 ms p99 |",
        p50(&p_first), pct(&p_first, 99), p50(&c_first), pct(&c_first, 99), p50(&p_first) / p50(&c_first)
    );
    println!(
        "| empty script start → result, p50 / p99 | {:.1} / {:.1} ms | {:.1} / {:.1} ms | {:.2}x | |",
        p50(&p_empty), pct(&p_empty, 99), p50(&c_empty), pct(&c_empty, 99), p50(&p_empty) / p50(&c_empty)
    );
    println!(
        "| the same ÷ bare bwrap+python ({bwrap:.1} ms) | {:.2}x | {:.2}x | | pool ≤ 0.5x |",
        p50(&p_empty) / bwrap,
        p50(&c_empty) / bwrap
    );
    println!(
        "| a waiting member (bwrap, init, Python, mount helper): PSS / RSS | {:.1} / {:.1} MiB | | | ≤ 6 MiB |",
        pss_kib as f64 / 4.0 / 1024.0, rss_kib as f64 / 4.0 / 1024.0
    );
    println!(
        "| daemon RSS with the pool full; its mount server's PSS | {:.1} MiB; {:.1} MiB | | | report |",
        status_kib(pid, "VmRSS:") as f64 / 1024.0,
        server_pss as f64 / 1024.0
    );

    // Throughput: C engine threads, each starting its next empty script once
    // its last one ended, 4 × max(C, 8) scripts in all; the two daemons in
    // turn, at each C. A burst of C above the pool's 4 starts the rest cold.
    println!();
    println!("Starts per second, empty scripts, C at a time (pool_size = 4 against cold, in turn at each C):");
    println!("| C | scripts | pool: starts/s | cold: starts/s | ratio | pool: daemon CPU per start | cold | pool: pre-made |");
    println!("|---|---|---|---|---|---|---|---|");
    for c in [1usize, 8, 64] {
        let k = 4 * c.max(8);
        member_ready(4);
        let (p_rate, p_cpu, pre) = throughput(&pooled, &ptoken, pid, c, k);
        let (c_rate, c_cpu, _) = throughput(cold, token, cold_pid, c, k);
        println!(
            "| {c} | {k} | {p_rate:.1} | {c_rate:.1} | {:.2}x | {p_cpu:.2} ms | {c_cpu:.2} ms | {pre}/{k} |",
            p_rate / c_rate
        );
    }
}

/// `k` empty scripts through `e`, `c` at a time: starts per second, the
/// daemon's CPU per start (ms) and how many ran pre-made.
fn throughput(e: &Inline, token: &str, daemon: u32, c: usize, k: usize) -> (f64, f64, usize) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let pre = std::sync::atomic::AtomicUsize::new(0);
    let cpu0 = cpu_s(daemon);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..c {
            s.spawn(|| {
                while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < k {
                    let r = e.run(token, "pass");
                    assert_eq!(r["status"], "ok", "{r}");
                    if r["pre_made"] == true {
                        pre.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_s(daemon) - cpu0;
    (k as f64 / wall, cpu * 1000.0 / k as f64, pre.into_inner())
}

fn smaps_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}
