//! Property-based tests of the three parsers that take hostile input:
//!
//! * the engine line, `protocol::parse_line` (one JSON-RPC 2.0 message per line);
//! * the script's fd-3 line, `protocol::script::parse_request` (the sandboxed script writes it);
//! * the run token, `token::verify` (JWT, HS256 only).
//!
//! Every property runs `CASES` (100,000) generated inputs. Each input is checked
//! three ways: the parser does not panic; its answer agrees with a small model of
//! the documented contract (written out below, next to each parser's strategies);
//! and the bytes it allocates while parsing stay under a bound linear in the
//! input's size (`alloc` below: a counting global allocator, read per thread).
//!
//! Inputs are arbitrary bytes, arbitrary UTF-8, "token soup" (JSON punctuation,
//! the protocol's own field names and hostile fragments glued at random), and
//! structured messages with the right and wrong field names and types, one field
//! mutated, truncated, with garbage appended, deeply nested, with huge numbers
//! and long strings. `allocation_worst_cases` feeds each parser large instances
//! of the JSON shapes that allocate most per byte, where the slope of the bound
//! (not its constant) is what is tested.
// The test rig forks and execs children (pre_exec, prctl, rusage): each block
// says why it is sound.
#![allow(unsafe_code)]

use base64::Engine as _;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;
use scriptgate::protocol::script::{parse_request, BadRequest, Request, MAX_BATCH, MAX_NAME_BYTES};
use scriptgate::protocol::token::{self, RunClaims};
use scriptgate::protocol::{self, code, parse_line, Incoming, RpcError};
use serde_json::{json, Map, Value};
use std::sync::OnceLock;

/// Cases per property. The whole file costs about 110-120 s of CPU in a debug
/// build (a minute of wall time on two idle cores): most of it is serde_json,
/// jsonwebtoken and HMAC work inside the parsers themselves.
const CASES: u32 = 100_000;

fn config() -> ProptestConfig {
    // A minute of both CPUs: never beside a test that has the machine alone.
    crate::common::shared();
    ProptestConfig {
        cases: CASES,
        // Nothing is written into the tree; a failure prints its minimal input.
        failure_persistence: None,
        // ChaCha (the default) is most of the run time in a debug build: its
        // SIMD intrinsics are not inlined. XorShift is plenty for generating inputs.
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------
// Allocation accounting
// ---------------------------------------------------------------------------

/// A global allocator that forwards to `System` and, while the current thread
/// has tracking switched on, keeps that thread's live and peak bytes. The
/// counters are thread-local, so the tests that cargo runs in parallel do not
/// see each other's allocations, and only the parse call is measured.
mod alloc {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    pub struct Counting;

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    struct Counters {
        tracking: Cell<bool>,
        live: Cell<isize>,
        peak: Cell<isize>,
    }

    thread_local! {
        // A `const` initializer and no destructor: using it from inside the
        // allocator never allocates and never fails, even while a thread exits.
        static COUNTERS: Counters = const {
            Counters { tracking: Cell::new(false), live: Cell::new(0), peak: Cell::new(0) }
        };
    }

    fn note(delta: isize) {
        COUNTERS.with(|c| {
            if c.tracking.get() {
                let live = c.live.get() + delta;
                c.live.set(live);
                c.peak.set(c.peak.get().max(live));
            }
        });
    }

    // SAFETY: every call is forwarded unchanged to `System`; the bookkeeping
    // only touches thread-local cells.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: the caller's layout contract is passed on to System.
            let p = unsafe { System.alloc(layout) };
            if !p.is_null() {
                note(layout.size() as isize);
            }
            p
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: as alloc.
            let p = unsafe { System.alloc_zeroed(layout) };
            if !p.is_null() {
                note(layout.size() as isize);
            }
            p
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: ptr was allocated by System with this layout (above).
            unsafe { System.dealloc(ptr, layout) };
            note(-(layout.size() as isize));
        }
        // Counted as its net change: after a realloc the old block is gone.
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: as dealloc; new_size is the caller's.
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                note(new_size as isize - layout.size() as isize);
            }
            p
        }
    }

    /// Run `f` and return its result and the peak of the bytes that it had
    /// allocated and not yet freed at any moment (the result itself included).
    pub fn peak<R>(f: impl FnOnce() -> R) -> (R, usize) {
        COUNTERS.with(|c| {
            c.live.set(0);
            c.peak.set(0);
            c.tracking.set(true);
        });
        let r = f();
        let peak = COUNTERS.with(|c| {
            c.tracking.set(false);
            c.peak.get()
        });
        (r, peak.max(0) as usize)
    }
}

// The bounds: peak bytes allocated while parsing one input of `len` bytes.
//
// All three parsers read JSON into `serde_json::Value` (this build has neither
// `preserve_order` nor `arbitrary_precision`), and what a `Value` costs per input
// byte is the slope. The dearest shape per byte is a chain of single-entry
// objects, `{"":{"":{"":…}}}`: each level is 5 input bytes and one B-tree leaf of
// `BTreeMap<String, Value>` (11 slots of 24 + 32 bytes plus a parent link: 632
// bytes) = 126.4 bytes per input byte. Every other shape costs less: a chain of
// singleton arrays `[[[…]]]` is 128 bytes (a `Vec<Value>` of capacity 4) per 2
// bytes = 64; a flat `[0,0,…]` at most 32 (32-byte `Value`s, capacity doubling);
// strings about 1. `allocation_worst_cases` measures each of these shapes at
// up to 512 KiB. A parser that allocated from a length or count it read, copied the
// input more than once, or went quadratic would cross these lines at once.

/// Engine and fd-3 lines: 126.4 bytes per byte (above), rounded up. The constant
/// covers error messages and the fixed `Value`s of a small message (measured:
/// under 1 KiB).
const LINE_SLOPE: usize = 128;
const LINE_CONST: usize = 4 << 10;

/// A token that carries a valid MAC: the payload is base64url (4 token bytes =
/// 3 JSON bytes) read twice at once: into a `Value` (126.4 × ¾ = 94.8 per token
/// byte) and, for the registered claims `aud` and `iss`, also by jsonwebtoken
/// into serde's untagged-enum buffer (`Content`: a 4-slot `Vec` of 64-byte pairs
/// per object level, 256 / 5 × ¾ = 38.4). Sum 133.2 plus ¾ for the decoded
/// bytes. Only a holder of the key can make such a token.
const SIGNED_TOKEN_SLOPE: usize = 136;
/// Anything else: only the header (at most the whole token) is decoded before
/// the MAC check, into a `Value` (94.8) and by jsonwebtoken into its `Header`
/// after one more base64 decode (¾): 95.6 per byte of the header part. The
/// payload is never decoded, which `token_forged_never_decodes_the_payload`
/// checks by bounding the peak by the header part's length alone.
const FORGED_TOKEN_SLOPE: usize = 100;
/// jsonwebtoken's `Validation`, the HMAC, error messages, a small snapshot
/// (measured: under 4 KiB for a realistic token).
const TOKEN_CONST: usize = 16 << 10;

fn assert_bounded(what: &str, input: &[u8], peak: usize, slope: usize, constant: usize) {
    let bound = slope * input.len() + constant;
    assert!(
        peak <= bound,
        "{what}: parsing {} bytes allocated {peak} bytes at peak, over the bound {slope} * len + {constant} = {bound}; input: {}",
        input.len(),
        String::from_utf8_lossy(&input[..input.len().min(300)])
    );
}

fn line_measured(line: &[u8]) -> Result<Incoming, (Value, RpcError)> {
    let (r, peak) = alloc::peak(|| parse_line(line));
    assert_bounded("parse_line", line, peak, LINE_SLOPE, LINE_CONST);
    r
}

fn fd3_measured(line: &[u8]) -> Result<Request, BadRequest> {
    let (r, peak) = alloc::peak(|| parse_request(line));
    assert_bounded("parse_request", line, peak, LINE_SLOPE, LINE_CONST);
    r
}

/// `verify`, with the bound for tokens of unknown provenance.
fn verify_measured(t: &str, key: &[u8], check_exp: bool) -> Result<RunClaims, RpcError> {
    let (r, peak) = alloc::peak(|| token::verify(t, key, check_exp));
    assert_bounded(
        "token::verify",
        t.as_bytes(),
        peak,
        SIGNED_TOKEN_SLOPE,
        TOKEN_CONST,
    );
    r.map_err(RpcError::from)
}

/// `verify` of a token without the key's MAC: bounded by its header part alone.
fn verify_forged(t: &str, key: &[u8]) -> RpcError {
    let (r, peak) = alloc::peak(|| token::verify(t, key, true));
    let header = t.split('.').next().unwrap_or("");
    assert_bounded(
        "token::verify (forged)",
        header.as_bytes(),
        peak,
        FORGED_TOKEN_SLOPE,
        TOKEN_CONST,
    );
    match r {
        Ok(c) => panic!(
            "a token without a valid MAC was accepted (run {}): {t}",
            c.run_id
        ),
        Err(e) => e.into(),
    }
}

// ---------------------------------------------------------------------------
// Shared strategies
// ---------------------------------------------------------------------------

/// Cheap random data from a seed. proptest's own recursive and character
/// strategies cost 50-200 µs a value in a debug build, more than 100,000 cases
/// of a dozen properties can afford; this costs a few µs. Shrinking then works
/// on the seed, and a failure still prints its whole input.
struct Gen(u64);

impl Gen {
    fn new(seed: u64) -> Gen {
        Gen((seed ^ 0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// xorshift64*
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize].clone()
    }
    /// Printable ASCII half the time; otherwise what breaks parsers: quotes,
    /// backslashes, controls, NUL, BOM, line separators, non-characters, the
    /// edges of the surrogate gap, multi-byte and astral chars.
    fn char(&mut self) -> char {
        let c = match self.below(16) {
            0..=7 => 0x20 + self.below(95) as u32,
            8 => self.pick(&['"', '\\', '\n', '\t', '\r', '\0', '\u{7f}', '/']) as u32,
            9 => self.below(0x20) as u32,
            10 => self.pick(&[
                'é',
                '…',
                '中',
                '😀',
                '\u{feff}',
                '\u{fffd}',
                '\u{ffff}',
                '\u{d7ff}',
                '\u{e000}',
                '\u{10ffff}',
                '\u{2028}',
                '\u{85}',
            ]) as u32,
            11 | 12 => 0x80 + self.below(0xd800 - 0x80) as u32,
            _ => 0x10000 + self.below(0x10_0000) as u32,
        };
        char::from_u32(c).expect("never a surrogate")
    }
    fn text(&mut self, max: usize) -> String {
        let n = self.below(max as u64 + 1);
        (0..n).map(|_| self.char()).collect()
    }
    fn leaf(&mut self) -> Value {
        match self.below(8) {
            0 => Value::Null,
            1 => Value::Bool(self.below(2) == 0),
            2 => Value::from(self.next() as i64),
            3 => Value::from(self.below(1000)),
            4 => Value::from(self.next()),
            // Any bit pattern; non-finite ones become null.
            5 => Value::from(f64::from_bits(self.next())),
            6 => self.pick(&[
                json!(i64::MIN),
                json!(i64::MAX),
                json!(u64::MAX),
                json!(0.1),
                json!(-0.0),
                json!(1e300),
                json!(5e-324),
                json!(""),
            ]),
            _ => Value::String(self.text(8)),
        }
    }
    /// A JSON value at most `depth` containers deep, containers of 0-3 items.
    fn value(&mut self, depth: u32) -> Value {
        if depth == 0 || self.below(3) == 0 {
            return self.leaf();
        }
        let n = self.below(4);
        if self.below(2) == 0 {
            Value::Array((0..n).map(|_| self.value(depth - 1)).collect())
        } else {
            Value::Object(
                (0..n)
                    .map(|_| (self.text(5), self.value(depth - 1)))
                    .collect(),
            )
        }
    }

    /// Levels of nesting: mostly few, in one case of 20 around and past
    /// serde_json's limit of 128. (Not more often: a parse error 128 levels deep
    /// costs serde_json some 200 µs in a debug build, as each level it unwinds
    /// computes an error position.)
    fn nesting(&mut self) -> usize {
        match self.below(40) {
            0 => 120 + self.below(16) as usize,
            1 => self.below(260) as usize,
            _ => self.below(8) as usize,
        }
    }

    /// JSON text, well-formed or not, that parsers commonly choke on.
    fn hostile(&mut self) -> String {
        match self.below(9) {
            // Nesting past serde_json's recursion limit, balanced or not.
            0 => {
                let d = self.nesting();
                if self.below(2) == 0 {
                    format!("{}0{}", "{\"\":".repeat(d), "}".repeat(d))
                } else {
                    format!("{}{}", "[".repeat(d), "]".repeat(d))
                }
            }
            1 => {
                let d = self.nesting();
                self.pick(&["[", "{\"a\":", "[{\"\":"]).repeat(d)
            }
            // Huge, tiny and odd numbers.
            2 => {
                let pre = self.pick(&["", "-", "0.", "1e", "1e-", "-1E+"]);
                let digits = "9".repeat(1 + self.below(400) as usize);
                let post = self.pick(&["", "e999", "e-999", ".5", "E+400"]);
                format!("{pre}{digits}{post}")
            }
            3 => self
                .pick(&[
                    "1e999",
                    "-1e999",
                    "1e-999",
                    "18446744073709551616",
                    "-9223372036854775809",
                    "-0",
                    "00",
                    "01",
                    "1.",
                    ".5",
                    "+1",
                    "NaN",
                    "Infinity",
                    "0x10",
                    "1_000",
                ])
                .to_string(),
            // Long strings, escaped or not.
            4 => {
                let c = self.char();
                Value::String(c.to_string().repeat(self.below(300) as usize)).to_string()
            }
            5 => {
                let e = self.pick(&["\\u0000", "\\n", "\\\"", "\\\\", "\\ud83d\\ude00", "é"]);
                format!("\"{}\"", e.repeat(self.below(100) as usize))
            }
            // Broken escapes, lone surrogates, unterminated and misspelt tokens.
            6 => self
                .pick(&[
                    "\"\\ud800\"",
                    "\"\\udc00\\ud800\"",
                    "\"\\x41\"",
                    "\"\\uZZZZ\"",
                    "\"\\u12\"",
                    "\"\t\"",
                    "\"\u{0}\"",
                    "\"abc",
                    "'single'",
                    "tru",
                    "nul",
                    "falsey",
                ])
                .to_string(),
            // Many copies of the shapes that allocate most per byte.
            7 => {
                let unit = self.pick(&["{\"\":{\"\":0}}", "[[0]]", "0", "\"\"", "{}", "[]"]);
                format!("[{}]", vec![unit; self.below(120) as usize].join(","))
            }
            _ => self.value(3).to_string(),
        }
    }

    /// Text glued from JSON punctuation, the protocols' field names and values,
    /// and hostile fragments: mostly not JSON, but often close.
    fn soup(&mut self) -> String {
        const PIECES: &[&str] = &[
            "{",
            "}",
            "[",
            "]",
            ":",
            ",",
            " ",
            "\"",
            "\\",
            "\n",
            "\r",
            "\t",
            "\u{feff}",
            "\"jsonrpc\"",
            "\"2.0\"",
            "\"id\"",
            "\"method\"",
            "\"params\"",
            "\"result\"",
            "\"error\"",
            "\"code\"",
            "\"message\"",
            "\"data\"",
            "\"op\"",
            "\"call\"",
            "\"call_many\"",
            "\"progress\"",
            "\"uncaught\"",
            "\"tool\"",
            "\"args\"",
            "\"args_list\"",
            "\"done\"",
            "\"total\"",
            "null",
            "true",
            "false",
            "0",
            "-1",
            "1.5e3",
            "\"x\"",
            "{}",
            "[]",
        ];
        let n = self.below(25);
        (0..n)
            .map(|_| match self.below(6) {
                0 => self.hostile(),
                1 => self.char().to_string(),
                _ => self.pick(PIECES).to_string(),
            })
            .collect()
    }

    /// A JSON value or hostile JSON text, or nothing.
    fn opt_value(&mut self) -> Option<String> {
        match self.below(3) {
            0 => None,
            1 => Some(self.hostile()),
            _ => Some(self.value(3).to_string()),
        }
    }

    /// An integer of any size, a float, or anything else; or nothing.
    fn opt_int(&mut self) -> Option<String> {
        match self.below(5) {
            0 => None,
            1 => Some((self.next() as i64).to_string()),
            2 => Some(self.next().to_string()),
            3 => Some(json!(f64::from_bits(self.next())).to_string()),
            _ => Some(self.value(1).to_string()),
        }
    }

    /// A short string, one of 480-540 bytes (around the 500-byte clip of
    /// progress messages), or anything else; or nothing.
    fn opt_text(&mut self) -> Option<String> {
        match self.below(7) {
            0 => None,
            1..=3 => Some(json!(self.text(40)).to_string()),
            4 | 5 => {
                let c = self.char();
                let n = (480 + self.below(60) as usize) / c.len_utf8();
                Some(json!(c.to_string().repeat(n)).to_string())
            }
            _ => Some(self.value(2).to_string()),
        }
    }

    /// 120-135 bytes: a few ASCII bytes, then one char (often multi-byte)
    /// repeated, so that the 128-byte cut falls inside a char at every offset.
    fn long_name(&mut self) -> String {
        let n = 120 + self.below(16) as usize;
        let c = self.pick(&["é", "…", "中", "😀", "a"]);
        let mut s = "x".repeat(self.below(4) as usize);
        while s.len() < n {
            s.push_str(c);
        }
        s
    }

    /// A `tool` field: a plain name, one near the clip limit, any string, not a
    /// string at all, or absent.
    fn tool(&mut self) -> Option<String> {
        match self.below(11) {
            0..=3 => {
                let name =
                    self.pick(&["fleet__get_device_status", "a", "", "fleet__reboot_device"]);
                Some(json!(name).to_string())
            }
            4..=6 => Some(json!(self.long_name()).to_string()),
            7 | 8 => Some(json!(self.text(200)).to_string()),
            9 => Some(self.value(2).to_string()),
            _ => None,
        }
    }

    /// An `args_list` field: n items with n around `MAX_BATCH`, or not a list.
    fn args_list(&mut self) -> Option<String> {
        match self.below(8) {
            0..=5 => {
                let n = match self.below(3) {
                    0 => self.below(6),
                    1 => MAX_BATCH as u64 - 3 + self.below(7),
                    _ => self.below(120),
                };
                // Any value as the item of short lists; long ones stay cheap.
                let item = match (n <= 6, self.below(3)) {
                    (true, 2) => self.value(2).to_string(),
                    (_, 1) => "{\"sn\":\"A1\"}".to_string(),
                    _ => "{}".to_string(),
                };
                Some(format!("[{}]", vec![item; n as usize].join(",")))
            }
            6 => Some(self.value(2).to_string()),
            _ => None,
        }
    }

    /// An fd-3 request's fields, each present or not, of the right type or not.
    fn fd3_fields(&mut self) -> Fd3Fields {
        let op = match self.below(11) {
            0..=7 => Some(
                json!(self.pick(&["call", "call_many", "progress", "uncaught", "tools"]))
                    .to_string(),
            ),
            8 => Some(json!(self.pick(&["Call", "call ", "", "exec"])).to_string()),
            9 => Some(self.value(2).to_string()),
            _ => None,
        };
        Fd3Fields {
            op,
            id: self.opt_value(),
            tool: self.tool(),
            args: self.opt_value(),
            args_list: self.args_list(),
            done: self.opt_int(),
            total: self.opt_int(),
            message: self.opt_text(),
            code: self.opt_text(),
            extra: (self.below(5) == 0).then(|| (self.text(5), self.value(2).to_string())),
        }
    }

    /// A valid snapshot: 0-3 tools of every class, each with an input schema,
    /// with and without the optional fields.
    fn snapshot(&mut self) -> Value {
        let depth = self.below(4);
        let path: Vec<&str> = (0..depth)
            .map(|_| self.pick(&["srv", "ws", "run-42", "é", "a b"]))
            .collect();
        let n = self.below(4);
        let tools: Vec<Value> = (0..n)
            .map(|i| {
                // 1-11 visible chars, multi-byte included, unique by the suffix.
                let stem: String = (0..1 + self.below(11))
                    .map(|_| self.pick(&['a', 'z', '_', '-', '.', 'é', '…', '中', '😀', 'Z', '9']))
                    .collect();
                let class = self.pick(&["read", "write", "destructive", "long_task"]);
                let mut t =
                    json!({"name": format!("{stem}{i}"), "class": class, "input_schema": schema()});
                match self.below(3) {
                    0 => {}
                    1 => t["enabled"] = json!(true),
                    _ => t["enabled"] = json!(false),
                }
                if self.below(2) == 0 {
                    t["frozen"] = json!({"tenant": "acme"});
                }
                t
            })
            .collect();
        let allowed =
            (n > 0 && self.below(2) == 0).then(|| tools[self.below(n) as usize]["name"].clone());
        let mode = self.pick(&["approval", "auto"]);
        let mut s = json!({"workspace": format!("/{}", path.join("/")), "permission_mode": mode, "tools": tools});
        match self.below(3) {
            0 => {}
            1 => s["read_only"] = json!(true),
            _ => s["read_only"] = json!(false),
        }
        if let Some(name) = allowed {
            s["session_allowed"] = json!([name]);
        }
        if self.below(2) == 0 {
            let mut l = Map::new();
            if self.below(2) == 0 {
                l.insert("max_calls".into(), json!(self.below(1000)));
            }
            if self.below(2) == 0 {
                l.insert("max_concurrency".into(), json!(1 + self.below(15)));
            }
            if self.below(2) == 0 {
                l.insert("timeout_s".into(), json!(1 + self.below(3600)));
            }
            s["limits"] = Value::Object(l);
        }
        s
    }

    /// A snapshot with at most one fault, and the -32011 reason it must give.
    fn snapshot_case(&mut self) -> (Value, Option<&'static str>) {
        let mut s = self.snapshot();
        let has_tool = !s["tools"].as_array().unwrap().is_empty();
        let reason = match self.below(13) {
            1 => {
                s["workspace"] = json!("srv/ws");
                Some("not_absolute")
            }
            2 => {
                s.as_object_mut().unwrap().remove("tools");
                Some("missing_field")
            }
            3 => {
                s.as_object_mut().unwrap().remove("permission_mode");
                Some("missing_field")
            }
            4 => {
                s["root"] = json!(true);
                Some("unknown_field")
            }
            5 => {
                s["permission_mode"] = json!("yolo");
                Some("invalid_value")
            }
            6 => {
                s["limits"] = json!({"max_calls": -1});
                Some("invalid_value")
            }
            7 => {
                s["limits"] = json!({"max_callz": 1});
                Some("unknown_field")
            }
            8 if has_tool => {
                s["tools"][0]["class"] = json!("sideways");
                Some("invalid_value")
            }
            9 if has_tool => {
                let dup = s["tools"][0].clone();
                s["tools"].as_array_mut().unwrap().push(dup);
                Some("duplicate_tool")
            }
            // Empty, with whitespace or a control char, or over 128 bytes.
            10 if has_tool => {
                let junk = self.text(6);
                let bad = [
                    String::new(),
                    format!("a {junk}"),
                    format!("a\u{7}{junk}"),
                    "é".repeat(65),
                ];
                s["tools"][0]["name"] = json!(self.pick(&bad));
                Some("invalid_value")
            }
            11 if has_tool => {
                s["tools"][0]["owner"] = json!(self.text(6));
                Some("unknown_field")
            }
            12 => {
                s["tools"] = json!({"a": 1});
                Some("invalid_value")
            }
            _ => None,
        };
        (s, reason)
    }

    /// Claims for a correctly signed token: each present or not, of the right
    /// type or not; with what `verify` must answer.
    fn claims_case(&mut self) -> ClaimsCase {
        // Expiry never within an hour of now: the model and `verify` read the
        // clock apart, and a failing case is run again while it shrinks.
        let now = scriptgate::time::now_unix();
        let run_id = match self.below(9) {
            0..=5 => {
                let s: String = (0..1 + self.below(40)).map(|_| self.char()).collect();
                Some(json!(s))
            }
            6 => Some(json!("")),
            7 => Some(self.leaf()),
            _ => None,
        };
        let exp = match self.below(11) {
            0..=5 => Some(json!(now + 3600 + self.below(10_000_000) as i64)),
            6 | 7 => Some(json!(now - 3600 - self.below(10_000_000) as i64)),
            8 => Some(self.pick(&[
                json!(i64::MIN),
                json!(i64::MAX),
                json!(u64::MAX),
                json!(1e300),
                json!(-1e300),
                json!(0.5),
                json!(-1),
            ])),
            9 => Some(self.pick(&[json!("9999999999"), json!(true), json!(null)])),
            _ => None,
        };
        let iat = match self.below(8) {
            0..=5 => Some(json!(now)),
            6 => Some(self.value(2)),
            _ => None,
        };
        let runner = match self.below(8) {
            0..=2 => None,
            3..=5 => Some(json!(self.text(10))),
            6 => Some(Value::Null),
            _ => Some(self.value(2)),
        };
        let (snapshot, snap_fault) = match self.below(10) {
            0..=7 => {
                let (s, f) = self.snapshot_case();
                (Some(s), f)
            }
            8 => (Some(self.leaf()), None),
            _ => (None, None),
        };
        // Claims nobody checks. Registered ones only with the types RFC 7519
        // gives them: jsonwebtoken reads `sub`, `iss`, `aud`, `exp`, `nbf` itself.
        let extra = match self.below(10) {
            0 => Some((
                self.pick(&["jti", "foo", "scope"]).to_string(),
                self.value(2),
            )),
            1 => Some((
                self.pick(&["sub", "iss", "aud"]).to_string(),
                json!(self.text(8)),
            )),
            2 => Some(("aud".to_string(), json!(["a", "b"]))),
            _ => None,
        };
        let mut c = Map::new();
        let claims = [
            ("run_id", run_id),
            ("exp", exp),
            ("iat", iat),
            ("runner", runner),
            ("snapshot", snapshot),
        ];
        for (k, v) in claims {
            if let Some(v) = v {
                c.insert(k.to_string(), v);
            }
        }
        if let Some((k, v)) = extra {
            c.insert(k, v);
        }
        // Now and then the claims are not an object at all.
        let claims = match self.below(20) {
            0 => json!([c]),
            1 => json!("claims"),
            _ => Value::Object(c),
        };
        let check_exp = self.below(2) == 0;
        let want = claims_model(&claims, check_exp, now, snap_fault);
        ClaimsCase {
            claims,
            check_exp,
            want,
        }
    }
}

/// Any Unicode string of up to `max` chars.
fn text(max: usize) -> impl Strategy<Value = String> + Clone {
    any::<u64>().prop_map(move |seed| Gen::new(seed).text(max))
}

/// Small JSON values of any shape, up to 3 containers deep.
fn json_value() -> BoxedStrategy<Value> {
    any::<u64>()
        .prop_map(|seed| Gen::new(seed).value(3))
        .boxed()
}

/// A strategy drawing from `Gen` with a seed.
fn seeded<T: std::fmt::Debug>(f: impl Fn(&mut Gen) -> T) -> impl Strategy<Value = T> {
    any::<u64>().prop_map(move |seed| f(&mut Gen::new(seed)))
}

fn nesting() -> impl Strategy<Value = usize> {
    seeded(Gen::nesting)
}

fn hostile_json() -> BoxedStrategy<String> {
    seeded(Gen::hostile).boxed()
}

fn soup() -> BoxedStrategy<String> {
    seeded(Gen::soup).boxed()
}

/// `{"k":v,…}` from already-serialized values, in the given order, keys repeated
/// as they come (serde_json keeps the last of a repeated key).
fn object_text(fields: &[(String, String)]) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{}:{v}", Value::String(k.clone())))
        .collect();
    format!("{{{}}}", body.join(","))
}

/// What serde_json reads from `v`'s text: floats may come back one ULP off
/// (serde_json's default float parsing is not round-trip exact).
fn reparse(v: &Value) -> Value {
    serde_json::from_str(&v.to_string()).expect("a Value's own text is JSON")
}

/// Damage to a well-formed line.
#[derive(Debug, Clone)]
enum Damage {
    None,
    /// Keep a proper prefix of this length (mod the length).
    Truncate(usize),
    /// Append text that cannot follow a JSON value.
    Append(String),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        3 => Just(Damage::None),
        1 => any::<usize>().prop_map(Damage::Truncate),
        1 => (select(vec!["}", "]", ",", "x", "{}", "\"", "0", "\u{0}", "é"]), text(3))
            .prop_map(|(s, t)| Damage::Append(format!("{s}{t}"))),
    ]
}

/// Apply `d`; true when the result is certainly not JSON.
fn apply(d: &Damage, line: &mut String) -> bool {
    match d {
        Damage::None => false,
        Damage::Truncate(n) => {
            // A proper prefix of an object's text never closes its first `{`.
            let mut cut = n % line.len();
            while !line.is_char_boundary(cut) {
                cut -= 1;
            }
            line.truncate(cut);
            true
        }
        Damage::Append(s) => {
            line.push_str(s);
            true
        }
    }
}

// ---------------------------------------------------------------------------
// 1. The engine line: protocol::parse_line
// ---------------------------------------------------------------------------

/// The contract of `parse_line` (its doc comments and PROTOCOL.md §1), applied to
/// what serde_json reads from the line.
#[derive(Debug)]
enum LineWant {
    Request {
        id: Value,
        method: String,
        params: Value,
    },
    Notification {
        method: String,
        params: Value,
    },
    Response {
        id: Value,
        result: Value,
    },
    /// `None`: the error object is not `{code: integer, message: string, data?}`,
    /// which the parser answers as a -32603 error of its own.
    ResponseError {
        id: Value,
        error: Option<RpcError>,
    },
    Refused {
        id: Value,
        code: i64,
    },
}

fn line_model(line: &[u8]) -> LineWant {
    let Ok(v) = serde_json::from_slice::<Value>(line) else {
        return LineWant::Refused {
            id: Value::Null,
            code: code::PARSE_ERROR,
        };
    };
    let Value::Object(m) = v else {
        return LineWant::Refused {
            id: Value::Null,
            code: code::INVALID_REQUEST,
        };
    };
    let id = m.get("id").cloned();
    // JSON-RPC 2.0: every message says so. An answer without it fails the
    // request it answers (when it names one); anything else is refused.
    if m.get("jsonrpc") != Some(&json!("2.0")) {
        let answer =
            !m.contains_key("method") && (m.contains_key("result") || m.contains_key("error"));
        return match id {
            Some(id) if answer && !id.is_null() => LineWant::ResponseError {
                id,
                error: Some(RpcError::new(
                    code::INVALID_REQUEST,
                    "`jsonrpc` must be \"2.0\"",
                )),
            },
            id => LineWant::Refused {
                id: id.unwrap_or(Value::Null),
                code: code::INVALID_REQUEST,
            },
        };
    }
    let params = m.get("params").cloned().unwrap_or(Value::Null);
    match m.get("method") {
        Some(Value::String(method)) => match id {
            Some(id) if !id.is_null() => LineWant::Request {
                id,
                method: method.clone(),
                params,
            },
            _ => LineWant::Notification {
                method: method.clone(),
                params,
            },
        },
        Some(_) => LineWant::Refused {
            id: id.unwrap_or(Value::Null),
            code: code::INVALID_REQUEST,
        },
        None => match (id, m.get("error"), m.get("result")) {
            (None, _, _) => LineWant::Refused {
                id: Value::Null,
                code: code::INVALID_REQUEST,
            },
            (Some(id), Some(e), _) => LineWant::ResponseError {
                id,
                error: error_model(e),
            },
            (Some(id), None, Some(r)) => LineWant::Response {
                id,
                result: r.clone(),
            },
            (Some(id), None, None) => LineWant::Refused {
                id,
                code: code::INVALID_REQUEST,
            },
        },
    }
}

fn error_model(e: &Value) -> Option<RpcError> {
    let (code, message, data) = match e {
        Value::Object(o) => (o.get("code")?, o.get("message")?, o.get("data")),
        // Lenient, not in JSON-RPC: serde's derived `Deserialize` also reads a
        // struct from an array of its fields, so `"error": [code, message, data]`
        // (exactly three) is taken as an error object.
        Value::Array(a) if a.len() == 3 => (&a[0], &a[1], Some(&a[2])),
        _ => return None,
    };
    Some(RpcError {
        code: code.as_i64()?,
        message: message.as_str()?.to_string(),
        data: data.filter(|d| !d.is_null()).cloned(),
    })
}

/// Parse (measured) and compare with the model; returns the parser's answer.
fn check_line(line: &[u8]) -> Result<Incoming, (Value, RpcError)> {
    let got = line_measured(line);
    let want = line_model(line);
    let ok = match (&want, &got) {
        (
            LineWant::Request { id, method, params },
            Ok(Incoming::Request {
                id: i,
                method: m,
                params: p,
            }),
        ) => id == i && method == m && params == p,
        (
            LineWant::Notification { method, params },
            Ok(Incoming::Notification {
                method: m,
                params: p,
            }),
        ) => method == m && params == p,
        (
            LineWant::Response { id, result },
            Ok(Incoming::Response {
                id: i,
                result: Ok(r),
            }),
        ) => id == i && result == r,
        (
            LineWant::ResponseError { id, error },
            Ok(Incoming::Response {
                id: i,
                result: Err(e),
            }),
        ) => {
            id == i
                && match error {
                    Some(want) => want == e,
                    None => e.code == code::INTERNAL,
                }
        }
        (LineWant::Refused { id, code }, Err((i, e))) => {
            id == i && *code == e.code && !e.message.is_empty()
        }
        _ => false,
    };
    assert!(
        ok,
        "parse_line({:?}):\n  got  {got:?}\n  want {want:?}",
        String::from_utf8_lossy(line)
    );
    got
}

fn engine_key() -> BoxedStrategy<String> {
    prop_oneof![
        6 => select(vec!["jsonrpc", "id", "method", "params", "result", "error"]).prop_map(String::from),
        1 => select(vec!["ID", "Method", "jsonRpc", "", "id ", "\u{0}id"]).prop_map(String::from),
        1 => text(4),
    ]
    .boxed()
}

fn rpc_error_text() -> BoxedStrategy<String> {
    let code = prop_oneof![
        any::<i64>().prop_map(|c| c.to_string()),
        Just("-32700".to_string()),
        Just("1.5".to_string()),
        Just("18446744073709551615".to_string()),
        Just("\"-32000\"".to_string()),
        Just("null".to_string()),
    ];
    let field = prop_oneof![
        (Just("code"), code).prop_map(|(k, v)| (k.to_string(), v)),
        (
            Just("message"),
            prop_oneof![
                text(8).prop_map(|s| Value::String(s).to_string()),
                Just("7".to_string())
            ]
        )
            .prop_map(|(k, v)| (k.to_string(), v)),
        (Just("data"), json_value()).prop_map(|(k, v)| (k.to_string(), v.to_string())),
        (text(3), json_value()).prop_map(|(k, v)| (k, v.to_string())),
    ];
    prop_oneof![
        4 => vec(field, 0..5).prop_map(|f| object_text(&f)),
        1 => json_value().prop_map(|v| v.to_string()),
    ]
    .boxed()
}

fn engine_value() -> BoxedStrategy<String> {
    prop_oneof![
        4 => json_value().prop_map(|v| v.to_string()),
        2 => select(vec!["\"2.0\"", "\"script.start\"", "\"\"", "null", "1", "{}", "[]"]).prop_map(String::from),
        2 => rpc_error_text(),
        1 => hostile_json(),
    ]
    .boxed()
}

/// Ids that engines send (numbers, strings) and the rest of JSON, never null.
fn id_value() -> BoxedStrategy<Value> {
    prop_oneof![
        3 => any::<u32>().prop_map(Value::from),
        2 => any::<i64>().prop_map(Value::from),
        2 => text(12).prop_map(Value::String),
        1 => json_value().prop_filter("ids are not null", |v| !v.is_null()),
    ]
    .boxed()
}

/// A well-formed message of each kind, as fields in random order.
#[derive(Debug, Clone)]
enum EngineMsg {
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    Notification {
        id_null: bool,
        method: String,
        params: Option<Value>,
    },
    Response {
        id: Value,
        result: Value,
    },
    Error {
        id: Value,
        error: RpcError,
    },
}

fn engine_msg() -> BoxedStrategy<EngineMsg> {
    let method = prop_oneof![
        select(vec![
            "script.start",
            "script.wait",
            "daemon.info",
            "tool.call",
            ""
        ])
        .prop_map(String::from),
        text(16),
    ];
    let error = (
        any::<i64>(),
        text(10),
        prop::option::of(json_value().prop_filter("data", |d| !d.is_null())),
    )
        .prop_map(|(code, message, data)| RpcError {
            code,
            message,
            data,
        });
    prop_oneof![
        (id_value(), method.clone(), prop::option::of(json_value()))
            .prop_map(|(id, method, params)| EngineMsg::Request { id, method, params }),
        (any::<bool>(), method, prop::option::of(json_value())).prop_map(
            |(id_null, method, params)| EngineMsg::Notification {
                id_null,
                method,
                params
            }
        ),
        (id_value(), json_value()).prop_map(|(id, result)| EngineMsg::Response { id, result }),
        (id_value(), error).prop_map(|(id, error)| EngineMsg::Error { id, error }),
    ]
    .boxed()
}

fn engine_fields(msg: &EngineMsg) -> Vec<(String, String)> {
    let mut f = vec![("jsonrpc".to_string(), "\"2.0\"".to_string())];
    let mut add = |k: &str, v: &Value| f.push((k.to_string(), v.to_string()));
    match msg {
        EngineMsg::Request { id, method, params } => {
            add("id", id);
            add("method", &json!(method));
            if let Some(p) = params {
                add("params", p);
            }
        }
        EngineMsg::Notification {
            id_null,
            method,
            params,
        } => {
            if *id_null {
                add("id", &Value::Null);
            }
            add("method", &json!(method));
            if let Some(p) = params {
                add("params", p);
            }
        }
        EngineMsg::Response { id, result } => {
            add("id", id);
            add("result", result);
        }
        EngineMsg::Error { id, error } => {
            add("id", id);
            add("error", &serde_json::to_value(error).unwrap());
        }
    }
    f
}

/// The well-formed message round-trips: same kind, id, method, params, result.
fn check_engine_round_trip(msg: &EngineMsg, got: &Result<Incoming, (Value, RpcError)>) {
    let ok = match (msg, got) {
        (
            EngineMsg::Request { id, method, params },
            Ok(Incoming::Request {
                id: i,
                method: m,
                params: p,
            }),
        ) => reparse(id) == *i && method == m && params.as_ref().map_or(Value::Null, reparse) == *p,
        (
            EngineMsg::Notification { method, params, .. },
            Ok(Incoming::Notification {
                method: m,
                params: p,
            }),
        ) => method == m && params.as_ref().map_or(Value::Null, reparse) == *p,
        (
            EngineMsg::Response { id, result },
            Ok(Incoming::Response {
                id: i,
                result: Ok(r),
            }),
        ) => reparse(id) == *i && reparse(result) == *r,
        (
            EngineMsg::Error { id, error },
            Ok(Incoming::Response {
                id: i,
                result: Err(e),
            }),
        ) => {
            reparse(id) == *i
                && error.code == e.code
                && error.message == e.message
                && error.data.as_ref().map(reparse) == e.data
        }
        _ => false,
    };
    assert!(ok, "{msg:?} did not round-trip: {got:?}");
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn engine_line_arbitrary_bytes(line in vec(any::<u8>(), 0..256)) {
        let _ = check_line(&line);
    }

    #[test]
    fn engine_line_arbitrary_utf8(s in prop_oneof![text(64), soup()]) {
        let _ = check_line(s.as_bytes());
    }

    /// JSON objects with the protocol's field names (and near misses) bound to
    /// values of the right and wrong types, fields repeated and in any order.
    #[test]
    fn engine_line_generated_objects(fields in vec((engine_key(), engine_value()), 0..7), d in damage()) {
        let mut line = object_text(&fields);
        let broken = apply(&d, &mut line);
        let got = check_line(line.as_bytes());
        if broken {
            // Malformed JSON: -32700, and no id can be known.
            prop_assert!(
                matches!(&got, Err((Value::Null, e)) if e.code == code::PARSE_ERROR),
                "{line:?} gave {got:?}"
            );
        }
    }

    /// Well-formed messages round-trip; the same with one field's value replaced
    /// by any value (model-checked), or truncated (-32700).
    #[test]
    fn engine_line_well_formed_and_mutated(
        msg in engine_msg(),
        order in any::<prop::sample::Index>(),
        mutate in prop::option::weighted(0.3, (any::<prop::sample::Index>(), engine_value())),
        d in damage(),
    ) {
        let mut fields = engine_fields(&msg);
        let n = fields.len();
        fields.rotate_left(order.index(n));
        if let Some((i, v)) = &mutate {
            fields[i.index(n)].1 = v.clone();
        }
        let mut line = object_text(&fields);
        let broken = apply(&d, &mut line);
        let got = check_line(line.as_bytes());
        if broken {
            prop_assert!(
                matches!(&got, Err((Value::Null, e)) if e.code == code::PARSE_ERROR),
                "{line:?} gave {got:?}"
            );
        } else if mutate.is_none() {
            check_engine_round_trip(&msg, &got);
        }
    }

    /// The daemon's own writers produce lines that parse back to what was written.
    #[test]
    fn engine_line_writers_round_trip(
        writer in 0u8..3,
        id in any::<u64>(),
        method in text(20),
        params in json_value(),
        result in prop_oneof![
            json_value().prop_map(Ok),
            (any::<i64>(), text(10), prop::option::of(json_value().prop_filter("data", |d| !d.is_null())))
                .prop_map(|(code, message, data)| Err(RpcError { code, message, data })),
        ],
    ) {
        let (line, msg) = match writer {
            0 => (
                protocol::request_line(id, &method, &params),
                EngineMsg::Request { id: json!(id), method, params: Some(params) },
            ),
            1 => (
                protocol::notification_line(&method, &params),
                EngineMsg::Notification { id_null: false, method, params: Some(params) },
            ),
            _ => (
                protocol::response_line(&json!(id), &result),
                match result {
                    Ok(result) => EngineMsg::Response { id: json!(id), result },
                    Err(error) => EngineMsg::Error { id: json!(id), error },
                },
            ),
        };
        prop_assert!(line.ends_with('\n') && !line[..line.len() - 1].contains('\n'), "{line:?}");
        check_engine_round_trip(&msg, &check_line(line.trim_end().as_bytes()));
    }

    /// Deep nesting, huge numbers and long strings in every position of a request.
    #[test]
    fn engine_line_hostile_values(
        depth in nesting(),
        id in prop_oneof![hostile_json(), Just("1".to_string())],
        method in prop_oneof![hostile_json(), (any::<char>(), 0usize..1000).prop_map(|(c, n)| json!(c.to_string().repeat(n)).to_string())],
        params in hostile_json(),
    ) {
        let nested = format!("{}{params}{}", "[".repeat(depth), "]".repeat(depth));
        let line = object_text(&[
            ("jsonrpc".into(), "\"2.0\"".into()),
            ("id".into(), id.clone()),
            ("method".into(), method),
            ("params".into(), nested),
        ]);
        let got = check_line(line.as_bytes());
        if depth >= 130 {
            // serde_json stops at 128 levels: a parse error, never a stack overflow.
            prop_assert!(matches!(&got, Err((_, e)) if e.code == code::PARSE_ERROR), "{got:?}");
        }
    }
}

// ---------------------------------------------------------------------------
// 2. The fd-3 line: protocol::script::parse_request
// ---------------------------------------------------------------------------

/// `framing::clip`'s contract: the longest prefix of at most `max` bytes that
/// ends on a char boundary, marked with "…" when anything was cut.
fn clip_model(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = 0;
    for (i, c) in s.char_indices() {
        if i + c.len_utf8() > max {
            break;
        }
        end = i + c.len_utf8();
    }
    format!("{}…", &s[..end])
}

/// `clip_name`'s contract: as `clip_model`, with the " …" marker (a space: no
/// snapshot tool name holds one) in place of "…".
fn clip_name_model(s: &str) -> String {
    let c = clip_model(s, MAX_NAME_BYTES);
    match c.strip_suffix('…') {
        Some(kept) if s.len() > MAX_NAME_BYTES => format!("{kept} …"),
        _ => c,
    }
}

/// The contract of `parse_request` (its doc comment and the module's), applied to
/// what serde_json reads. Errors are compared by id and code.
fn fd3_model(read: Option<&Value>) -> Result<Request, (Value, &'static str)> {
    let Some(Value::Object(m)) = read else {
        return Err((Value::Null, "invalid_request"));
    };
    let id = m.get("id").cloned().unwrap_or(Value::Null);
    let string = |k: &str, max: usize| match m.get(k) {
        Some(Value::String(s)) => clip_model(s, max),
        _ => String::new(),
    };
    let int = |k: &str| m.get(k).and_then(Value::as_i64).unwrap_or(0);
    let tool = || match m.get("tool") {
        Some(Value::String(s)) => clip_name_model(s),
        _ => String::new(),
    };
    match m.get("op").and_then(Value::as_str) {
        Some("call") => Ok(Request::Call {
            id,
            tool: tool(),
            args: m.get("args").cloned().unwrap_or_else(|| json!({})),
        }),
        Some("call_many") => match m.get("args_list") {
            Some(Value::Array(a)) if a.len() <= MAX_BATCH => Ok(Request::CallMany {
                id,
                tool: tool(),
                args_list: a.clone(),
            }),
            _ => Err((id, "invalid_arguments")),
        },
        Some("progress") => Ok(Request::Progress(protocol::Progress {
            done: int("done"),
            total: int("total"),
            message: string("message", 500),
        })),
        Some("uncaught") => Ok(Request::Uncaught {
            code: string("code", 32),
        }),
        Some("tools") => Ok(Request::Tools { id }),
        _ => Err((id, "invalid_request")),
    }
}

fn check_fd3(line: &[u8]) -> Result<Request, BadRequest> {
    check_fd3_read(line).0
}

/// `check_fd3`, also returning what serde_json read from the line.
fn check_fd3_read(line: &[u8]) -> (Result<Request, BadRequest>, Option<Value>) {
    let got = fd3_measured(line);
    let read = serde_json::from_slice::<Value>(line).ok();
    let want = fd3_model(read.as_ref());
    let ok = match (&want, &got) {
        (Ok(w), Ok(g)) => w == g,
        (Err((id, code)), Err(b)) => {
            id == &b.id && *code == b.code.as_str() && !b.message.is_empty()
        }
        _ => false,
    };
    assert!(
        ok,
        "parse_request({:?}):\n  got  {got:?}\n  want {want:?}",
        String::from_utf8_lossy(line)
    );
    // What any answer may quote back is bounded, whatever the input.
    const MARK: usize = "…".len();
    const NAME_MARK: usize = " …".len();
    match &got {
        Ok(Request::Call { tool, .. }) => {
            assert!(
                tool.len() <= MAX_NAME_BYTES + NAME_MARK,
                "{} byte tool name",
                tool.len()
            )
        }
        Ok(Request::CallMany {
            tool, args_list, ..
        }) => {
            assert!(
                tool.len() <= MAX_NAME_BYTES + NAME_MARK,
                "{} byte tool name",
                tool.len()
            );
            assert!(args_list.len() <= MAX_BATCH);
        }
        Ok(Request::Progress(p)) => assert!(p.message.len() <= 500 + MARK),
        Ok(Request::Uncaught { code }) => assert!(code.len() <= 32 + MARK),
        Ok(Request::Tools { .. }) => {}
        Err(b) => assert!(["invalid_request", "invalid_arguments"].contains(&b.code.as_str())),
    }
    (got, read)
}

#[derive(Debug, Clone)]
struct Fd3Fields {
    op: Option<String>,
    id: Option<String>,
    tool: Option<String>,
    args: Option<String>,
    args_list: Option<String>,
    done: Option<String>,
    total: Option<String>,
    message: Option<String>,
    code: Option<String>,
    extra: Option<(String, String)>,
}

fn fd3_fields() -> impl Strategy<Value = Fd3Fields> {
    seeded(Gen::fd3_fields)
}

fn fd3_text(f: &Fd3Fields, order: usize) -> String {
    let mut fields: Vec<(String, String)> = [
        ("op", &f.op),
        ("id", &f.id),
        ("tool", &f.tool),
        ("args", &f.args),
        ("args_list", &f.args_list),
        ("done", &f.done),
        ("total", &f.total),
        ("message", &f.message),
        ("code", &f.code),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k.to_string(), v.clone()?)))
    .collect();
    fields.extend(f.extra.clone());
    if !fields.is_empty() {
        let n = fields.len();
        fields.rotate_left(order % n);
    }
    object_text(&fields)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn fd3_arbitrary_bytes(line in vec(any::<u8>(), 0..256)) {
        let _ = check_fd3(&line);
    }

    #[test]
    fn fd3_arbitrary_utf8(s in prop_oneof![text(64), soup()]) {
        let _ = check_fd3(s.as_bytes());
    }

    /// Requests with every field present, absent, of the right or wrong type.
    #[test]
    fn fd3_generated_requests(f in fd3_fields(), order in any::<usize>(), d in damage()) {
        let mut line = fd3_text(&f, order);
        let broken = apply(&d, &mut line);
        let (got, read) = check_fd3_read(line.as_bytes());
        if broken {
            prop_assert!(matches!(&got, Err(b) if b.code.as_str() == "invalid_request" && b.id.is_null()), "{got:?}");
            return Ok(());
        }
        // Two properties spelled out, on what serde_json read.
        let Some(Value::Object(m)) = read else {
            return Ok(());
        };
        let id = m.get("id").cloned().unwrap_or(Value::Null);
        match (m.get("op").and_then(Value::as_str), m.get("tool")) {
            // A call_many with a list of n items is accepted iff n <= MAX_BATCH.
            (Some("call_many"), _) => {
                if let Some(Value::Array(items)) = m.get("args_list") {
                    prop_assert_eq!(got.is_ok(), items.len() <= MAX_BATCH, "{} items: {:?}", items.len(), got);
                }
            }
            // A valid call round-trips its id, tool name and arguments.
            (Some("call"), Some(Value::String(tool))) if tool.len() <= MAX_NAME_BYTES => {
                if let Some(args) = m.get("args") {
                    prop_assert_eq!(got, Ok(Request::Call { id, tool: tool.clone(), args: args.clone() }));
                }
            }
            _ => {}
        }
    }

    /// Whatever the name, what comes back is a prefix of it, whole when it fits
    /// in MAX_NAME_BYTES, else cut at a char boundary with the " …" marker.
    #[test]
    fn fd3_tool_names_are_clipped(name in prop_oneof![text(200), seeded(Gen::long_name)], many in any::<bool>()) {
        let line = if many {
            json!({"id": 1, "op": "call_many", "tool": name, "args_list": [{}]})
        } else {
            json!({"id": 1, "op": "call", "tool": name, "args": {}})
        }
        .to_string();
        let tool = match check_fd3(line.as_bytes()) {
            Ok(Request::Call { tool, .. } | Request::CallMany { tool, .. }) => tool,
            other => panic!("{other:?}"),
        };
        prop_assert!(tool.len() <= MAX_NAME_BYTES + " …".len());
        if name.len() <= MAX_NAME_BYTES {
            prop_assert_eq!(tool, name);
        } else {
            let kept = tool.strip_suffix(" …").expect("a clipped name ends with the marker");
            prop_assert!(name.starts_with(kept));
            // Cut at the last char boundary at or below the limit: a char is at most 4 bytes.
            prop_assert!(kept.len() > MAX_NAME_BYTES - 4);
        }
    }

    /// Deep nesting, huge numbers, long strings as any field of a call.
    #[test]
    fn fd3_hostile_values(
        depth in nesting(),
        op in select(vec!["call", "call_many", "progress", "uncaught", "tools"]),
        key in select(vec!["id", "tool", "args", "args_list", "done", "total", "message", "code"]),
        value in hostile_json(),
    ) {
        let nested = format!("{}{value}{}", "[".repeat(depth), "]".repeat(depth));
        let line = object_text(&[("op".into(), json!(op).to_string()), (key.into(), nested)]);
        let got = check_fd3(line.as_bytes());
        if depth >= 130 {
            prop_assert!(matches!(&got, Err(b) if b.code.as_str() == "invalid_request"), "{got:?}");
        }
    }
}

/// A clipped name matches no tool: when a 4-byte char starts at byte 125, the
/// cut is at 125, and with a plain "…" the clipped name would be 128 bytes, a
/// valid snapshot tool name; the marker holds a space, which no name may.
#[test]
fn fd3_clipped_names_match_no_snapshot_tool() {
    let sent = format!("{}\u{1F600}", "a".repeat(125));
    let line = json!({"id": 1, "op": "call", "tool": sent, "args": {}}).to_string();
    let Ok(Request::Call { tool, .. }) = parse_request(line.as_bytes()) else {
        panic!("not a call")
    };
    assert_ne!(tool, sent);
    let snapshot = json!({"workspace": "/", "permission_mode": "auto", "tools": [
        {"name": tool, "class": "read", "input_schema": {"type": "object"}}]});
    assert!(
        scriptgate::protocol::snapshot::parse_snapshot(snapshot).is_err(),
        "the clipped name {tool:?} ({} bytes) is a valid snapshot tool name",
        tool.len()
    );
}

// ---------------------------------------------------------------------------
// 3. The run token: token::verify
// ---------------------------------------------------------------------------

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";
const OTHER_KEY: &[u8] = b"fedcba9876543210fedcba9876543210";
const B64URL: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn mac(alg: jsonwebtoken::Algorithm, message: &str, key: &[u8]) -> String {
    jsonwebtoken::crypto::sign(
        message.as_bytes(),
        &jsonwebtoken::EncodingKey::from_secret(key),
        alg,
    )
    .unwrap()
}

/// `header.payload.signature` with an HS256 MAC of the first two parts.
fn signed(header: &str, claims: &str, key: &[u8]) -> String {
    let m = format!("{}.{}", b64(header.as_bytes()), b64(claims.as_bytes()));
    let s = mac(jsonwebtoken::Algorithm::HS256, &m, key);
    format!("{m}.{s}")
}

/// A schema as the snapshots of the other branch's rule need it (every tool has one).
fn schema() -> Value {
    json!({"type": "object", "properties": {"sn": {"type": "string"}}})
}

fn valid_snapshot() -> impl Strategy<Value = Value> {
    seeded(Gen::snapshot)
}

/// Claims and what `verify` must answer for them (`Gen::claims_case`).
#[derive(Debug, Clone)]
struct ClaimsCase {
    claims: Value,
    check_exp: bool,
    want: Result<String, (i64, &'static str)>,
}

fn claims_case() -> impl Strategy<Value = ClaimsCase> {
    seeded(Gen::claims_case)
}

/// `verify`'s contract after the signature holds: the claims in this order, then
/// expiry, then the snapshot.
fn claims_model(
    claims: &Value,
    check_exp: bool,
    now: i64,
    snap_fault: Option<&'static str>,
) -> Result<String, (i64, &'static str)> {
    let malformed = Err((code::TOKEN, "malformed"));
    let missing = Err((code::TOKEN, "missing_claim"));
    let Some(c) = claims.as_object() else {
        return malformed;
    };
    let run_id = match c.get("run_id") {
        None => return missing,
        // At most 256 bytes, no control character (scriptgate-protocol(7)).
        Some(Value::String(s))
            if !s.is_empty() && s.len() <= 256 && !s.chars().any(char::is_control) =>
        {
            s.clone()
        }
        Some(_) => return malformed,
    };
    let date = |k: &str| match c.get(k) {
        None => Err((code::TOKEN, "missing_claim")),
        Some(Value::Number(n)) => Ok(n.as_i64().unwrap_or_else(|| n.as_f64().unwrap() as i64)),
        Some(_) => Err((code::TOKEN, "malformed")),
    };
    let exp = date("exp")?;
    date("iat")?;
    if !matches!(
        c.get("runner"),
        None | Some(Value::Null) | Some(Value::String(_))
    ) {
        return malformed;
    }
    match c.get("snapshot") {
        None => return missing,
        Some(Value::Object(_)) => {}
        Some(_) => return malformed,
    }
    if check_exp && exp <= now {
        return Err((code::TOKEN, "expired"));
    }
    match snap_fault {
        Some(reason) => Err((code::SNAPSHOT, reason)),
        None => Ok(run_id),
    }
}

fn reason_of(e: &RpcError) -> (i64, &str) {
    (e.code, e.reason().unwrap_or("<no reason>"))
}

/// Tokens minted once, with several keys and snapshots, for the tampering tests.
fn minted() -> &'static [(Vec<u8>, String)] {
    static MINTED: OnceLock<Vec<(Vec<u8>, String)>> = OnceLock::new();
    MINTED.get_or_init(|| {
        let big_tools: Vec<Value> = (0..6)
            .map(|i| json!({"name": format!("fleet__tool_{i}"), "class": "read", "input_schema": schema()}))
            .collect();
        let snaps = [
            json!({"workspace": "/srv/ws", "permission_mode": "auto", "tools": []}),
            json!({"workspace": "/srv/ws/run-42", "read_only": false, "permission_mode": "approval",
                   "session_allowed": ["fleet__reboot_device"], "tools": [
                {"name": "fleet__get_device_status", "class": "read", "enabled": true, "input_schema": schema(), "frozen": {}},
                {"name": "fleet__reboot_device", "class": "write", "input_schema": schema(), "frozen": {"tenant": "acme"}}],
                   "limits": {"max_calls": 500, "timeout_s": 600}}),
            json!({"workspace": "/", "permission_mode": "auto", "tools": big_tools}),
        ];
        let keys: [&[u8]; 3] = [KEY, &[0xff; 64], b"a key of exactly thirty-two byte"];
        let mut out = Vec::new();
        for (i, s) in snaps.iter().enumerate() {
            for (j, k) in keys.iter().enumerate() {
                let runner = (j % 2 == 0).then_some("runner-é");
                let t = token::mint(k, &format!("run-{i}{j}"), runner, s, 3600).unwrap();
                out.push((k.to_vec(), t));
            }
        }
        out
    })
}

/// Is `a` an HMAC key different from `b`? (HMAC pads keys up to the block size
/// with zeros, so `k` and `k ++ [0]` are one key.)
fn distinct_hmac_keys(a: &[u8], b: &[u8]) -> bool {
    let pad = |k: &[u8]| {
        let mut k = k.to_vec();
        k.resize(64.max(k.len()), 0);
        k
    };
    a.len() > 64 || b.len() > 64 || pad(a) != pad(b)
}

#[derive(Debug, Clone)]
enum Edit {
    /// Replace the char at this position (mod the length) with a base64url char.
    Replace(usize, char),
    /// Replace it with any char.
    ReplaceAny(usize, char),
    Delete(usize),
    Insert(usize, char),
    Truncate(usize),
    Append(String),
}

fn edit() -> impl Strategy<Value = Edit> {
    let b64char = select(B64URL.chars().collect::<Vec<_>>());
    prop_oneof![
        6 => (any::<usize>(), b64char.clone()).prop_map(|(i, c)| Edit::Replace(i, c)),
        1 => (any::<usize>(), any::<char>()).prop_map(|(i, c)| Edit::ReplaceAny(i, c)),
        1 => any::<usize>().prop_map(Edit::Delete),
        1 => (any::<usize>(), prop_oneof![b64char, any::<char>()]).prop_map(|(i, c)| Edit::Insert(i, c)),
        1 => any::<usize>().prop_map(Edit::Truncate),
        1 => prop_oneof![text(4), Just(".".to_string()), Just("=".to_string()), Just("A".to_string())].prop_map(Edit::Append),
    ]
}

/// Apply the edit to an ASCII token; `None` if it changed nothing. Returns the
/// part (0 header, 1 payload, 2 signature) where a char was replaced.
fn edit_token(t: &str, e: &Edit) -> Option<(String, Option<usize>)> {
    let chars: Vec<char> = t.chars().collect();
    let part_of = |i: usize| chars[..i].iter().filter(|c| **c == '.').count();
    let mut out = chars.clone();
    let mut replaced = None;
    match e {
        Edit::Replace(i, c) | Edit::ReplaceAny(i, c) => {
            let i = i % chars.len();
            out[i] = *c;
            if matches!(e, Edit::Replace(..)) && chars[i] != '.' {
                replaced = Some(part_of(i));
            }
        }
        Edit::Delete(i) => {
            out.remove(i % chars.len());
        }
        Edit::Insert(i, c) => out.insert(i % (chars.len() + 1), *c),
        Edit::Truncate(n) => out.truncate(n % chars.len()),
        Edit::Append(s) => out.extend(s.chars()),
    }
    (out != chars).then(|| (out.into_iter().collect(), replaced))
}

/// Header `alg` values: everything that is not exactly "HS256".
fn bad_alg() -> BoxedStrategy<Option<String>> {
    prop_oneof![
        4 => select(vec![
            "none", "None", "NONE", "nOnE", "HS384", "HS512", "RS256", "ES256", "PS256", "EdDSA",
            "hs256", "HS256 ", " HS256", "HS256\u{0}", "HS 256", "", "HS25",
        ])
        .prop_map(|a| Some(json!(a).to_string())),
        1 => text(6).prop_filter("not HS256", |a| a != "HS256").prop_map(|a| Some(json!(a).to_string())),
        1 => json_value().prop_filter("not a string", |v| !v.is_string()).prop_map(|v| Some(v.to_string())),
        1 => Just(None),
    ]
    .boxed()
}

/// Valid claims for a token that would be accepted if its header were honest.
fn good_claims() -> String {
    json!({"run_id": "run-1", "iat": scriptgate::time::now_unix(), "exp": scriptgate::time::now_unix() + 3600,
           "snapshot": {"workspace": "/", "permission_mode": "auto", "tools": []}})
    .to_string()
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary strings, and strings of base64url chars and dots: refused, with
    /// one of the reasons a token can have before its claims are read.
    #[test]
    fn token_arbitrary_strings(t in seeded(|g| {
        const HONEST: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9"; // {"alg":"HS256","typ":"JWT"}
        let b64: Vec<char> = B64URL.chars().collect();
        match g.below(3) {
            0 => g.text(120),
            // base64url chars with dots, padding and the odd other char.
            1 => (0..g.below(300))
                .map(|_| match g.below(12) {
                    0 | 1 => '.',
                    2 => '=',
                    3 => g.char(),
                    _ => g.pick(&b64),
                })
                .collect(),
            // Three parts, the header an honest HS256 one: the signature is what fails.
            _ => {
                let payload = g.text(40).replace('.', "");
                let sig: String = (0..g.below(60)).map(|_| g.pick(&b64)).collect();
                format!("{HONEST}.{payload}.{sig}")
            }
        }
    })) {
        let e = verify_forged(&t, KEY);
        prop_assert_eq!(e.code, code::TOKEN);
        prop_assert!(["malformed", "signature", "algorithm"].contains(&e.reason().unwrap_or("")), "{:?}", e);
        if t.starts_with(&b64(br#"{"alg":"HS256","typ":"JWT"}"#)) && t.matches('.').count() == 2 {
            prop_assert_eq!(e.reason(), Some("signature"));
        }
    }

    /// A token minted with the key verifies, with the same run, runner and
    /// snapshot; expiry counts only when asked to.
    #[test]
    fn token_minted_round_trips(
        key in vec(any::<u8>(), 32..=64),
        // Printable: a run id with a control character is refused (the model
        // of `verify` below covers those).
        run_id in seeded(|g| (0..1 + g.below(40))
            .map(|_| match g.char() { c if c.is_control() => 'x', c => c })
            .collect::<String>()),
        runner in prop::option::of(text(12)),
        snapshot in valid_snapshot(),
        ttl in prop_oneof![60i64..10_000_000, -10_000_000i64..-60],
        check_exp in any::<bool>(),
    ) {
        let before = scriptgate::time::now_unix();
        let t = token::mint(&key, &run_id, runner.as_deref(), &snapshot, ttl).expect("a valid snapshot mints");
        let after = scriptgate::time::now_unix();
        let r = verify_measured(&t, &key, check_exp);
        if check_exp && ttl < 0 {
            prop_assert_eq!(r.map(|_| ()).map_err(|e| reason_of(&e).1.to_string()), Err("expired".to_string()));
            return Ok(());
        }
        let c = r.unwrap_or_else(|e| panic!("minted token refused: {e:?}"));
        prop_assert_eq!(&c.run_id, &run_id);
        prop_assert_eq!(&c.runner, &runner);
        prop_assert!(before <= c.iat && c.iat <= after);
        prop_assert_eq!(c.exp - c.iat, ttl);
        // The snapshot is the one minted, defaults filled in.
        let (got, want) = (&c.snapshot, &snapshot);
        prop_assert_eq!(got.workspace.to_str(), want["workspace"].as_str());
        prop_assert_eq!(got.read_only, want.get("read_only").is_some_and(|r| r == true));
        prop_assert_eq!(json!(got.permission_mode), want["permission_mode"].clone());
        prop_assert_eq!(json!(got.session_allowed), want.get("session_allowed").cloned().unwrap_or(json!([])));
        prop_assert_eq!(json!(got.limits), want.get("limits").cloned().unwrap_or(json!({})));
        let tools = want["tools"].as_array().unwrap();
        prop_assert_eq!(got.tools.len(), tools.len());
        for (g, w) in got.tools.iter().zip(tools) {
            prop_assert_eq!(&g.name, &w["name"]);
            prop_assert_eq!(g.class.as_str(), w["class"].as_str().unwrap());
            prop_assert_eq!(g.enabled, w.get("enabled").is_none_or(|e| e == true));
            prop_assert_eq!(g.input_schema.as_ref(), Some(&w["input_schema"]));
            prop_assert_eq!(json!(g.frozen), w.get("frozen").cloned().unwrap_or(json!({})));
        }
    }

    /// A minted token with one char replaced, removed or added, cut short or
    /// extended, is refused; one base64url char replaced in the payload or the
    /// signature (even where only padding bits change) fails on the signature.
    /// Checked with the wrong key too.
    #[test]
    fn token_tampered_is_refused(which in any::<prop::sample::Index>(), e in edit(), other_key in vec(any::<u8>(), 32..=64)) {
        let (key, t) = &minted()[which.index(minted().len())];
        if let Some((forged, replaced)) = edit_token(t, &e) {
            let err = verify_forged(&forged, key);
            if let Some(1 | 2) = replaced {
                prop_assert_eq!(err.reason(), Some("signature"), "{:?} -> {}", e, forged);
            } else {
                prop_assert!(["malformed", "signature", "algorithm"].contains(&err.reason().unwrap_or("")), "{:?}", err);
            }
        }
        prop_assume!(distinct_hmac_keys(key, &other_key));
        let err = verify_forged(t, &other_key);
        prop_assert_eq!(err.reason(), Some("signature"));
    }

    /// Any `alg` but "HS256" (none, other HMACs, case variants, non-strings, no
    /// alg at all, a header that is not an object) is refused as `algorithm`,
    /// however the token is signed, with the key or without.
    #[test]
    fn token_other_algorithms_are_refused(
        alg in bad_alg(),
        header_kind in 0u8..4,
        typ in prop::option::of(select(vec!["\"JWT\"", "null", "5"])),
        sig_kind in 0u8..5,
    ) {
        let mut fields = Vec::new();
        if let Some(t) = typ {
            fields.push(("typ".to_string(), t.to_string()));
        }
        if let Some(a) = &alg {
            fields.push(("alg".to_string(), a.clone()));
        }
        let header = match header_kind {
            0 | 1 => object_text(&fields),
            // A repeated alg: serde_json keeps the last one, which is not HS256.
            2 => object_text(&[[("alg".to_string(), "\"HS256\"".to_string())].as_slice(), &fields, &[("alg".to_string(), alg.clone().unwrap_or("null".into()))]].concat()),
            _ => format!("[{}]", alg.clone().unwrap_or_default()),
        };
        let m = format!("{}.{}", b64(header.as_bytes()), b64(good_claims().as_bytes()));
        let sig = match sig_kind {
            0 => mac(jsonwebtoken::Algorithm::HS256, &m, KEY),
            1 => mac(jsonwebtoken::Algorithm::HS384, &m, KEY),
            2 => mac(jsonwebtoken::Algorithm::HS512, &m, KEY),
            3 => mac(jsonwebtoken::Algorithm::HS256, &m, OTHER_KEY),
            _ => String::new(),
        };
        let e = verify_forged(&format!("{m}.{sig}"), KEY);
        prop_assert_eq!(reason_of(&e), (code::TOKEN, "algorithm"), "header {}", header);
    }

    /// Correctly signed tokens whose claims are present or not, of the right type
    /// or not, expired or not, with a snapshot that is valid or has one fault:
    /// the answer is the one the claims call for, in the documented order.
    #[test]
    fn token_signed_claims_follow_the_contract(case in claims_case()) {
        let t = signed(r#"{"alg":"HS256","typ":"JWT"}"#, &case.claims.to_string(), KEY);
        let r = verify_measured(&t, KEY, case.check_exp);
        match (&case.want, &r) {
            (Ok(run_id), Ok(c)) => prop_assert_eq!(run_id, &c.run_id),
            (Err(want), Err(e)) => prop_assert_eq!(*want, reason_of(e), "{:?}", e),
            _ => prop_assert!(false, "claims {}\n  got  {:?}\n  want {:?}", case.claims, r.map(|c| c.run_id), case.want),
        }
        // The same token without the key: never accepted, and the payload is not read.
        let e = verify_forged(&t, OTHER_KEY);
        prop_assert_eq!(e.reason(), Some("signature"));
    }

    /// Deep nesting, huge numbers and long strings in the header (unsigned) and
    /// in the claims (signed): no panic, bounded allocation, never accepted
    /// unless the claims are valid.
    #[test]
    fn token_hostile_values(
        in_header in any::<bool>(),
        depth in nesting(),
        key in select(vec!["x", "exp", "iat", "run_id", "runner", "snapshot", "kid", "jti"]),
        value in hostile_json(),
    ) {
        let nested = format!("{}{value}{}", "[".repeat(depth), "]".repeat(depth));
        if in_header {
            let header = object_text(&[("alg".into(), "\"HS256\"".into()), (key.into(), nested)]);
            let m = format!("{}.{}", b64(header.as_bytes()), b64(good_claims().as_bytes()));
            // Without a valid MAC the header alone is read.
            let e = verify_forged(&format!("{m}.AAAA"), KEY);
            prop_assert!(["malformed", "signature"].contains(&e.reason().unwrap_or("")), "{:?}", e);
        } else {
            let claims: Map<String, Value> = serde_json::from_str(&good_claims()).unwrap();
            let mut fields: Vec<(String, String)> = claims
                .into_iter()
                .filter(|(k, _)| k != key)
                .map(|(k, v)| (k, v.to_string()))
                .collect();
            fields.push((key.to_string(), nested));
            let claims = object_text(&fields);
            let t = signed(r#"{"alg":"HS256"}"#, &claims, KEY);
            if let Ok(c) = verify_measured(&t, KEY, true) {
                // A hostile value is never a valid snapshot; elsewhere it may be fine
                // (a long run_id, a far exp), and the other claims are untouched.
                prop_assert!(key != "snapshot", "{} accepted", claims);
                if key != "run_id" {
                    prop_assert_eq!(c.run_id, "run-1");
                }
            }
        }
    }
}

/// Are tokens whose payload is never decoded (no valid MAC) really bounded by
/// their header alone? A forged token with a huge payload allocates about what
/// one with an empty payload does.
#[test]
fn token_forged_never_decodes_the_payload() {
    let header = b64(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = b64(format!("[{}]", vec!["{\"\":{\"\":0}}"; 100_000].join(",")).as_bytes());
    let (small, big) = (
        format!("{header}.e30.AAAA"),
        format!("{header}.{payload}.AAAA"),
    );
    let (_, small) = alloc::peak(|| token::verify(&small, KEY, true));
    let (r, big) = alloc::peak(|| token::verify(&big, KEY, true));
    assert_eq!(
        r.unwrap_err().reason(),
        scriptgate::protocol::refusal::Reason::Signature
    );
    assert!(
        big <= small + 1024,
        "{big} bytes for a forged token with a {} byte payload, {small} with an empty one",
        payload.len()
    );
}

/// Large instances (up to 512 KiB) of the JSON shapes that cost most per byte, in
/// each parser, against the same bounds as the properties: here the slope
/// dominates. `--nocapture` prints the measured bytes per input byte.
#[test]
fn allocation_worst_cases() {
    let chain =
        |open: &str, close: &str, d: usize| format!("{}0{}", open.repeat(d), close.repeat(d));
    let shapes = [
        ("single-entry object chains", chain("{\"\":", "}", 120)),
        ("single-entry objects", "{\"\":0}".to_string()),
        ("singleton array chains", chain("[", "]", 120)),
        ("singleton arrays", "[0]".to_string()),
        ("zeros", "0".to_string()),
        ("empty strings", "\"\"".to_string()),
        ("empty arrays", "[]".to_string()),
        ("short distinct keys", String::new()),
    ];
    for size in [1usize << 12, 1 << 16, 1 << 19] {
        for (name, unit) in &shapes {
            let x = if unit.is_empty() {
                let keys: Vec<String> = (0..size / 8).map(|i| format!("\"{i:x}\":0")).collect();
                format!("{{{}}}", keys.join(","))
            } else {
                format!(
                    "[{}]",
                    vec![unit.as_str(); size / (unit.len() + 1)].join(",")
                )
            };
            let mut report = format!("{size:>8} B {name:<28}");
            let mut ratio = |label: &str, input: &[u8], peak: usize| {
                report += &format!(" {label} {:6.1}", peak as f64 / input.len() as f64);
            };

            let line = format!(r#"{{"jsonrpc":"2.0","id":1,"method":"m","params":{x}}}"#);
            let (r, p) = alloc::peak(|| parse_line(line.as_bytes()));
            assert!(matches!(r, Ok(Incoming::Request { .. })));
            assert_bounded("parse_line", line.as_bytes(), p, LINE_SLOPE, LINE_CONST);
            ratio("line", line.as_bytes(), p);

            let fd3 = format!(r#"{{"id":1,"op":"call","tool":"t","args":{x}}}"#);
            let (r, p) = alloc::peak(|| parse_request(fd3.as_bytes()));
            assert!(matches!(r, Ok(Request::Call { .. })));
            assert_bounded("parse_request", fd3.as_bytes(), p, LINE_SLOPE, LINE_CONST);
            ratio("fd3", fd3.as_bytes(), p);

            // Unsigned: the shape in the header.
            let header = format!(r#"{{"alg":"HS256","x":{x}}}"#);
            let t = format!(
                "{}.{}.AAAA",
                b64(header.as_bytes()),
                b64(good_claims().as_bytes())
            );
            let (r, p) = alloc::peak(|| token::verify(&t, KEY, true));
            assert_eq!(
                r.unwrap_err().reason(),
                scriptgate::protocol::refusal::Reason::Signature
            );
            let h = t.split('.').next().unwrap();
            assert_bounded(
                "verify (forged)",
                h.as_bytes(),
                p,
                FORGED_TOKEN_SLOPE,
                TOKEN_CONST,
            );
            ratio("forged", h.as_bytes(), p);

            // Signed: the shape as `aud` (read twice) and as a tool's input schema.
            for (label, claims) in [
                (
                    "aud",
                    format!(
                        r#"{{"run_id":"r","exp":9999999999,"iat":0,"aud":{x},"snapshot":{{"workspace":"/","permission_mode":"auto","tools":[]}}}}"#
                    ),
                ),
                (
                    "schema",
                    format!(
                        r#"{{"run_id":"r","exp":9999999999,"iat":0,"snapshot":{{"workspace":"/","permission_mode":"auto","tools":[{{"name":"a","class":"read","input_schema":{x}}}]}}}}"#
                    ),
                ),
            ] {
                let t = signed(r#"{"alg":"HS256"}"#, &claims, KEY);
                let (r, p) = alloc::peak(|| token::verify(&t, KEY, true));
                assert!(r.is_ok(), "{:?}", r.err());
                assert_bounded(
                    "verify (signed)",
                    t.as_bytes(),
                    p,
                    SIGNED_TOKEN_SLOPE,
                    TOKEN_CONST,
                );
                ratio(label, t.as_bytes(), p);
            }
            println!("{report}");
        }
    }
}

// ---------------------------------------------------------------------------
// 4. The numbers of an fd-3 line: protocol::numbers::scan
// ---------------------------------------------------------------------------
//
// The oracle is serde_json itself: a number survives when serde_json, reading
// it, writes back the same decimal value (an integer as the same digits, still
// an integer). The scan must flag exactly the calls whose arguments hold a
// number that does not survive, and name the first of them where it is.

/// A JSON document whose numbers are kept as the tokens they were written as.
#[derive(Debug, Clone)]
enum Doc {
    Num(String),
    Str(String),
    Arr(Vec<Doc>),
    Obj(Vec<(String, Doc)>),
}

impl Doc {
    fn text(&self) -> String {
        match self {
            Doc::Num(t) => t.clone(),
            Doc::Str(s) => Value::String(s.clone()).to_string(),
            Doc::Arr(items) => {
                let items: Vec<String> = items.iter().map(Doc::text).collect();
                format!("[{}]", items.join(", "))
            }
            Doc::Obj(fields) => {
                let fields: Vec<String> = fields
                    .iter()
                    .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), v.text()))
                    .collect();
                format!("{{{}}}", fields.join(","))
            }
        }
    }

    /// Every number token, in document order, with its JSON Pointer (raw keys).
    fn numbers(&self, at: &mut Vec<String>, out: &mut Vec<(Vec<String>, String)>) {
        match self {
            Doc::Num(t) => out.push((at.clone(), t.clone())),
            Doc::Str(_) => {}
            Doc::Arr(items) => {
                for (i, d) in items.iter().enumerate() {
                    at.push(i.to_string());
                    d.numbers(at, out);
                    at.pop();
                }
            }
            Doc::Obj(fields) => {
                for (k, d) in fields {
                    at.push(k.clone());
                    d.numbers(at, out);
                    at.pop();
                }
            }
        }
    }
}

const NUMBER_KEYS: &[&str] = &["a", "n", "~", "/", "x/y~z", "é", "\u{1b}[2J", "args", "0"];

impl Gen {
    fn number_token(&mut self) -> String {
        let digits = |g: &mut Gen, n: u64| -> String {
            let mut s = String::new();
            for i in 0..n {
                let d = if i == 0 { 1 + g.below(9) } else { g.below(10) };
                s.push(char::from(b'0' + d as u8));
            }
            s
        };
        let sign = |g: &mut Gen| if g.below(3) == 0 { "-" } else { "" };
        match self.below(7) {
            0 => {
                let n = 1 + self.below(25);
                format!("{}{}", sign(self), digits(self, n))
            }
            1 => self
                .pick(&[
                    "0",
                    "-0",
                    "9007199254740992",
                    "9007199254740993",
                    "-9007199254740993",
                    "9223372036854775807",
                    "9223372036854775808",
                    "-9223372036854775808",
                    "-9223372036854775809",
                    "18446744073709551615",
                    "18446744073709551616",
                    "-18446744073709551615",
                ])
                .to_string(),
            // A float as Python writes it (its repr is serde_json's), with
            // Python's `e+` half the time.
            2 => {
                let f = f64::from_bits(self.next());
                let t = if f.is_finite() {
                    serde_json::to_string(&f).unwrap()
                } else {
                    "1.5".into()
                };
                if self.below(2) == 0 && t.contains('e') && !t.contains(['-', '+']) {
                    t.replace('e', "e+")
                } else {
                    t
                }
            }
            // Any decimal, up to 25 digits, exponents to ±400.
            3 => {
                let n = 1 + self.below(25);
                let mut m = digits(self, n);
                if n > 1 && self.below(2) == 0 {
                    let p = 1 + self.below(n - 1) as usize;
                    m.insert(p, '.');
                }
                let e = if self.below(2) == 0 {
                    format!("e{}", self.below(801) as i64 - 400)
                } else {
                    String::new()
                };
                let t = format!("{}{m}{e}", sign(self));
                if t.contains(['.', 'e']) {
                    t
                } else {
                    t + ".0"
                }
            }
            4 => self.pick(&["NaN", "Infinity", "-Infinity"]).to_string(),
            5 => self
                .pick(&["0.5", "1.25e-3", "-0.0", "100.0", "1E5", "2.50", "0.0"])
                .to_string(),
            _ => format!("{}{}", digits(self, 320), ".5e-1"),
        }
    }

    fn number_doc(&mut self, depth: u32) -> Doc {
        match self.below(if depth == 0 { 2 } else { 6 }) {
            0 => Doc::Num(self.number_token()),
            1 => Doc::Str(self.pick(&["18446744073709551616", "NaN", "x"]).to_string()),
            2 | 3 => Doc::Arr(
                (0..self.below(4))
                    .map(|_| self.number_doc(depth - 1))
                    .collect(),
            ),
            _ => {
                let mut keys: Vec<&str> = Vec::new();
                for _ in 0..self.below(4) {
                    let k = self.pick(NUMBER_KEYS);
                    if !keys.contains(&k) {
                        keys.push(k);
                    }
                }
                Doc::Obj(
                    keys.into_iter()
                        .map(|k| (k.to_string(), self.number_doc(depth - 1)))
                        .collect(),
                )
            }
        }
    }

    /// A call or call_many line, its units (the arguments of each call), and a
    /// decoy field outside them.
    fn number_request(&mut self) -> (String, bool, Vec<Doc>, Doc) {
        let many = self.below(2) == 0;
        let units: Vec<Doc> = (0..if many { self.below(6) } else { 1 })
            .map(|_| self.number_doc(3))
            .collect();
        let decoy = self.number_doc(1);
        let body = if many {
            let items: Vec<String> = units.iter().map(Doc::text).collect();
            format!("\"args_list\": [{}]", items.join(","))
        } else {
            format!("\"args\": {}", units[0].text())
        };
        let op = if many { "call_many" } else { "call" };
        let line = if self.below(2) == 0 {
            format!(
                r#"{{"id": 7, "op": "{op}", "tool": "t", {body}, "args_x": {}}}"#,
                decoy.text()
            )
        } else {
            format!(
                r#"{{"\u0061rgs_y": {}, {body}, "op": "{op}", "id": 7}}"#,
                decoy.text()
            )
        };
        (line, many, units, decoy)
    }
}

/// The oracle: serde_json writes back the decimal value it read.
fn survives(tok: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(tok) else {
        return false;
    };
    if !tok.contains(['.', 'e', 'E']) {
        let written = v.to_string();
        return (v.is_i64() || v.is_u64()) && written == tok;
    }
    v.is_f64() && decimal_value(&v.to_string()) == decimal_value(tok)
}

/// Sign, significant digits, exponent of the last one; zero has no digits.
fn decimal_value(t: &str) -> (bool, String, i128) {
    let (neg, t) = match t.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, t),
    };
    let (m, e) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], t[i + 1..].parse::<i128>().unwrap()),
        None => (t, 0),
    };
    let (a, b) = m.split_once('.').unwrap_or((m, ""));
    let all = format!("{a}{b}");
    let lead = all.trim_start_matches('0');
    let sig = lead.trim_end_matches('0');
    if sig.is_empty() {
        return (neg, String::new(), 0);
    }
    (
        neg,
        sig.to_string(),
        e - b.len() as i128 + (lead.len() - sig.len()) as i128,
    )
}

fn shown_pointer(at: &[String]) -> String {
    at.iter()
        .map(|k| {
            format!(
                "/{}",
                k.replace('~', "~0")
                    .replace('/', "~1")
                    .replace('\u{1b}', "\\x1b")
            )
        })
        .collect()
}

fn check_numbers(line: &str, many: bool, units: &[Doc], decoy: &Doc) -> Result<(), TestCaseError> {
    let (scan, peak) = alloc::peak(|| numbers::scan(line.as_bytes()));
    // What the scan keeps is what it copies of the arguments (at most their
    // text) plus its frames and the names it quotes.
    prop_assert!(
        peak <= 2 * line.len() + (64 << 10),
        "{peak} bytes for a {}-byte line",
        line.len()
    );
    prop_assert!(!scan.too_deep);
    let mut any_not_json = false;
    let mut all = vec![];
    decoy.numbers(&mut vec![], &mut all);
    for (i, unit) in units.iter().enumerate() {
        let mut found = vec![];
        unit.numbers(&mut vec![], &mut found);
        let altered: Vec<&(Vec<String>, String)> =
            found.iter().filter(|(_, t)| !survives(t)).collect();
        let got = if many {
            scan.item(i)
        } else {
            scan.args.as_ref()
        };
        match (altered.first(), got) {
            (None, None) => {}
            (Some((at, tok)), Some(a)) => {
                let shown = if tok.len() <= numbers::NUMBER_SHOWN_MAX {
                    tok.clone()
                } else {
                    format!(
                        "{}… ({} characters)",
                        &tok[..numbers::NUMBER_SHOWN_MAX],
                        tok.len()
                    )
                };
                prop_assert_eq!(&a.number, &shown);
                prop_assert_eq!(&a.at, &shown_pointer(at));
                prop_assert_eq!(a.more, altered.len() - 1);
                let text = unit.text();
                if text.len() <= numbers::ARGS_TEXT_MAX_BYTES {
                    prop_assert_eq!(&a.text, &text);
                }
                prop_assert_eq!(a.bytes, text.len());
            }
            (want, got) => prop_assert!(false, "unit {i}: want {want:?}, got {got:?}\n{line}"),
        }
        all.extend(found);
    }
    prop_assert!(scan.items.iter().all(|(i, _)| *i < units.len()));
    for (_, t) in &all {
        any_not_json |= serde_json::from_str::<Value>(t).is_err();
    }
    prop_assert_eq!(scan.not_json, any_not_json, "{}", line);
    // Patched, the line parses, and every call without an altered number
    // holds each of its numbers as written.
    let mut bytes = line.as_bytes().to_vec();
    numbers::patch(&mut bytes);
    prop_assert_eq!(bytes.len(), line.len());
    let parsed = parse_request(&bytes);
    let args: Vec<Value> = match parsed {
        Ok(Request::Call { args, .. }) => vec![args],
        Ok(Request::CallMany { args_list, .. }) => args_list,
        other => return Err(TestCaseError::fail(format!("{other:?}\n{line}"))),
    };
    prop_assert_eq!(args.len(), units.len());
    for (i, (unit, v)) in units.iter().zip(&args).enumerate() {
        let clean = if many {
            scan.item(i).is_none()
        } else {
            scan.args.is_none()
        };
        if !clean {
            continue;
        }
        let mut found = vec![];
        unit.numbers(&mut vec![], &mut found);
        for (at, tok) in found {
            let pointer: String = at
                .iter()
                .map(|k| format!("/{}", k.replace('~', "~0").replace('/', "~1")))
                .collect();
            let n = v.pointer(&pointer).expect("in the parsed arguments");
            prop_assert_eq!(
                decimal_value(&n.to_string()),
                decimal_value(&tok),
                "{} at {}",
                tok,
                pointer
            );
            prop_assert_eq!(n.is_f64(), tok.contains(['.', 'e', 'E']), "{}", tok);
        }
    }
    Ok(())
}

use scriptgate::protocol::numbers;

proptest! {
    #![proptest_config(config())]

    /// Generated calls whose arguments hold every kind of number: the scan
    /// flags exactly the calls serde_json would alter, naming the first.
    #[test]
    fn numbers_flagged_are_those_serde_alters(req in seeded(Gen::number_request)) {
        let (line, many, units, decoy) = req;
        check_numbers(&line, many, &units, &decoy)?;
    }

    /// Any bytes: no panic, bounded, and a patched line has its length.
    #[test]
    fn numbers_scan_any_bytes(s in prop_oneof![text(64), soup(), hostile_json()], raw in vec(any::<u8>(), 0..128)) {
        for line in [s.as_bytes(), &raw[..]] {
            let (_, peak) = alloc::peak(|| numbers::scan(line));
            prop_assert!(peak <= 2 * line.len() + (64 << 10));
            let mut b = line.to_vec();
            numbers::patch(&mut b);
            prop_assert_eq!(b.len(), line.len());
        }
    }
}

/// The most a scan keeps: 50 items, each altered, each past the text it keeps,
/// and a line as deep as it follows.
#[test]
fn numbers_scan_worst_cases() {
    let item = format!(
        "{{\"s\": \"{}\", \"n\": 18446744073709551616}}",
        "x".repeat(8 << 10)
    );
    let line = format!(
        r#"{{"op":"call_many","args_list":[{}]}}"#,
        vec![item; 50].join(",")
    );
    let (scan, peak) = alloc::peak(|| numbers::scan(line.as_bytes()));
    assert_eq!(scan.items.len(), 50);
    assert!(peak <= 50 * (numbers::ARGS_TEXT_MAX_BYTES + 1024), "{peak}");
    assert!(
        scan.held_bytes() >= peak / 2,
        "held_bytes counts what is kept"
    );
    let deep = format!(
        r#"{{"args":{}18446744073709551616{}}}"#,
        "[".repeat(numbers::MAX_DEPTH - 1),
        "]".repeat(numbers::MAX_DEPTH - 1)
    );
    let (scan, peak) = alloc::peak(|| numbers::scan(deep.as_bytes()));
    assert!(!scan.too_deep);
    assert_eq!(
        scan.args.as_ref().unwrap().at.len(),
        numbers::AT_MAX_BYTES + "…".len()
    );
    assert!(peak <= 64 << 10, "{peak}");
    let deeper = format!("[{deep}]");
    assert!(numbers::scan(deeper.as_bytes()).too_deep);
}
