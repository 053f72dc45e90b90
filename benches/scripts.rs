//! `cargo bench`: figures and ratios for scriptgate's hot paths, through the real
//! daemon, socket, bwrap and Python (the same rig as the tests). Not a pass/fail
//! test: it prints numbers; docs/BENCHMARKS.md records them.
#[path = "../tests/common/mod.rs"]
mod common;
use common::*;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() {
    let rig = Rig::new();
    let e = rig.engine();
    let token = rig.token(&rig.snapshot("auto"));
    let n = 15;

    // 1. Start-to-result of an empty script against a bare Python start.
    let bare = median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                std::process::Command::new("/usr/bin/python3")
                    .args(["-s", "-B", "-c", "pass"])
                    .status()
                    .unwrap();
                t.elapsed()
            })
            .collect(),
    );
    let _ = e.run(&token, "pass", &[]); // warm caches
    let empty = median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                let r = e.run(&token, "pass", &[]);
                assert_eq!(r["status"], "ok");
                t.elapsed()
            })
            .collect(),
    );
    let with_module = median(
        (0..n)
            .map(|_| {
                let t = Instant::now();
                let r = e.run(
                    &token,
                    "import agent_tools\nagent_tools.call('fleet__list_devices', {})",
                    &[],
                );
                assert_eq!(r["status"], "ok");
                t.elapsed()
            })
            .collect(),
    );
    println!("empty script, start to result:     {:7.1} ms  (bare python3 -c pass: {:.1} ms; ratio {:.2}x)", ms(empty), ms(bare), ms(empty) / ms(bare));
    println!(
        "one tool call, start to result:    {:7.1} ms",
        ms(with_module)
    );

    // 2. Broker throughput with an instant engine: 2000 calls through call_many.
    let t = Instant::now();
    let r = e.run(&token, "import agent_tools\nagent_tools.call_many('fleet__get_device_status', [{'sn': f'SN{i}'} for i in range(2000)])", &[]);
    let d = t.elapsed();
    assert_eq!(
        (r["status"].as_str(), r["calls"].as_u64()),
        (Some("ok"), Some(2000))
    );
    println!(
        "2000 calls via call_many:          {:7.1} ms  ({:.0} calls/s end to end)",
        ms(d),
        2000.0 / d.as_secs_f64()
    );

    // 3. Sequential call latency (one round trip script → daemon → engine → back).
    let r = e.run(&token, "import agent_tools, time\nt = time.perf_counter()\nfor i in range(500):\n    agent_tools.call('fleet__list_devices', {})\nprint((time.perf_counter() - t) / 500 * 1e6)", &[]);
    let per_call_us: f64 = r["output"].as_str().unwrap().trim().parse().unwrap();
    println!("sequential agent_tools.call:       {per_call_us:7.0} us per call (measured inside the script)");

    // 4. A slow engine (20 ms per call): 4 in flight against one at a time.
    e.call_delay_ms.store(20, Ordering::Relaxed);
    let t = Instant::now();
    let _ = e.run(
        &token,
        "import agent_tools\nfor i in range(40):\n    agent_tools.call('fleet__list_devices', {})",
        &[],
    );
    let seq = t.elapsed();
    let t = Instant::now();
    let _ = e.run(
        &token,
        "import agent_tools\nagent_tools.call_many('fleet__list_devices', [{}] * 40)",
        &[],
    );
    let par = t.elapsed();
    println!("40 calls, 20 ms engine: sequential {:.0} ms, call_many {:.0} ms (speed-up {:.2}x; max_concurrency 4)", ms(seq), ms(par), ms(seq) / ms(par));
}
