//! Numbers as a script wrote them (scriptgate-protocol(7), "Numbers").
//!
//! serde_json, as this crate builds it, keeps an integer exactly only within
//! -2^63..=2^64-1 (an `i64` or a `u64`) and reads every other number as the
//! nearest `f64`: `2**64 + 1` would reach the engine as `1.8446744073709552e19`.
//! Its `arbitrary_precision` feature would keep every number as written, but
//! cargo unifies features across the crate's dependencies (rmcp, schemars,
//! jsonschema), and that one changes `Value` everywhere: a number inside
//! serde's untagged or flattened types (rmcp's messages, our own wire enums) is
//! then a map, `1.0` and `1.00` are different values, and a schema's `maximum`
//! compares strings. An engine in JavaScript could not take such integers
//! as numbers anyway. So the daemon keeps serde_json as it is and refuses the
//! call that carries a number it would alter. This module finds those numbers
//! in the request line as the script sent it: every number token outside
//! strings, with where it is. Pure, one pass over the line, memory bounded by
//! the nesting depth plus what it keeps of at most `MAX_BATCH + 1` arguments.
//!
//! A number is exact when the engine will be sent the same decimal value:
//! an integer (no fraction, no exponent) within -2^63..=2^64-1 other than
//! `-0`; any other number when its decimal value is the shortest decimal form
//! of the `f64` nearest to it, which is what Python's `json` writes for every
//! finite float (`repr`), so every float a script passes through `agent_tools`
//! is exact. `NaN` and `Infinity` (Python's `json` writes them for
//! `float("nan")` and `float("inf")`) and numbers beyond `f64`'s range are no
//! JSON numbers at all: serde_json refuses the whole line, so `patch` makes
//! them `0` (padded with spaces to the same length) for the line to parse, and
//! the calls that carry them are refused with the rest.

use super::script::MAX_BATCH;
use std::ops::Range;

/// Bytes of the arguments' JSON text kept for the record of a refused call
/// (the calls.jsonl line keeps as much of any call's arguments).
pub const ARGS_TEXT_MAX_BYTES: usize = 4096;
/// Characters of a number quoted back; a longer one is cut and its length said.
pub const NUMBER_SHOWN_MAX: usize = 40;
/// Bytes of the place of a number (a JSON Pointer) quoted back.
pub const AT_MAX_BYTES: usize = 200;
/// Nesting the scan follows. serde_json reads at most 128 levels, so a line
/// nested deeper is refused whatever this finds; past this depth the scan
/// stops and says so (`Scan::too_deep`), and keeps no more frames.
pub const MAX_DEPTH: usize = 256;

/// Why a number would not reach the engine as the script wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// An integer outside -2^63..=2^64-1: read as the nearest `f64`.
    Wide,
    /// `-0`: read as the float `-0.0`.
    NegativeZero,
    /// A decimal that no `f64` holds (`0.1000000000000000000001`, `1e-400`):
    /// read as the nearest one, which is written as another decimal.
    NotF64,
    /// Beyond `f64`'s range (`1e400`): no `f64` is near it.
    Overflow,
    /// `NaN`, `Infinity` or `-Infinity`: not JSON.
    NotJson,
}

/// The first number of one call's arguments that would be altered, and the
/// arguments as the script sent them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Altered {
    pub problem: Problem,
    /// The number as written, cut to `NUMBER_SHOWN_MAX` characters with its
    /// length said (it is ASCII: digits, sign, point, exponent, or a word).
    pub number: String,
    /// Where it is in the arguments, a JSON Pointer (RFC 6901): "" for the
    /// arguments themselves. Keys are the script's text: unsafe characters
    /// escaped (`text::escape`), cut to `AT_MAX_BYTES`.
    pub at: String,
    /// How many more such numbers the same arguments hold.
    pub more: usize,
    /// The arguments' JSON text as sent, cut to `ARGS_TEXT_MAX_BYTES` at a
    /// character boundary (marked `…`), and its whole length.
    pub text: String,
    pub bytes: usize,
}

/// What `scan` found in one fd-3 request line.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Scan {
    /// In `args`: the arguments of `call`.
    pub args: Option<Altered>,
    /// In `args_list[i]`, by `i` (only `i < MAX_BATCH`: a longer list is
    /// refused whole): the arguments of `call_many`'s items.
    pub items: Vec<(usize, Altered)>,
    /// The line holds tokens that are no JSON number (`NaN`, `1e400`): `patch`
    /// makes it parse.
    pub not_json: bool,
    /// Nested deeper than `MAX_DEPTH`: the scan stopped there.
    pub too_deep: bool,
}

impl Scan {
    /// What the `i`th item of `args_list` holds, if anything.
    pub fn item(&self, i: usize) -> Option<&Altered> {
        self.items.iter().find(|(j, _)| *j == i).map(|(_, a)| a)
    }

    /// Bytes this scan keeps (the arguments' texts), for the request's cost.
    pub fn held_bytes(&self) -> usize {
        let one = |a: &Altered| a.text.len() + a.number.len() + a.at.len() + 128;
        self.args.as_ref().map_or(0, one) + self.items.iter().map(|(_, a)| one(a)).sum::<usize>()
    }
}

/// The refusal a call whose arguments hold `a` gets (`invalid_arguments`):
/// the number as written, where it is, and why it would not reach the engine.
pub fn refusal_message(tool: &str, a: &Altered) -> String {
    let n = &a.number;
    let at = if a.at.is_empty() {
        "as the arguments".to_string()
    } else {
        format!("at {}", a.at)
    };
    let what = match a.problem {
        Problem::Wide => format!(
            "the integer {n} {at} is outside the 64-bit range that reaches the engine exactly \
             (-9223372036854775808 to 18446744073709551615): it would arrive rounded, so the call \
             is refused; send it as a string"
        ),
        Problem::NegativeZero => format!(
            "the integer {n} {at} would reach the engine as the float -0.0, so the call is \
             refused; send 0"
        ),
        Problem::NotF64 => format!(
            "the number {n} {at} is not exactly a 64-bit float: it would arrive rounded, so the \
             call is refused; send a Python float or a string"
        ),
        Problem::Overflow => format!(
            "the number {n} {at} is beyond the range of a 64-bit float, so the call is refused; \
             send it as a string"
        ),
        Problem::NotJson => format!(
            "{n} {at} is not a JSON number (Python's json writes float(\"nan\") and \
             float(\"inf\") so; JSON has no such number), so the call is refused; send None or a string"
        ),
    };
    let more = match a.more {
        0 => String::new(),
        1 => " (and 1 more number like it in these arguments)".to_string(),
        m => format!(" (and {m} more numbers like it in these arguments)"),
    };
    format!("{tool}: {what}{more}")
}

/// Which of a request's arguments a value is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Args,
    Item(usize),
}

/// The top-level key whose value is being read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Top {
    Args,
    ArgsList,
    Other,
}

struct Frame {
    object: bool,
    /// The current key (its token, quotes included), in an object.
    key: Range<usize>,
    /// The current element, in an array.
    index: usize,
    start: usize,
    want_key: bool,
}

/// The first altered number of the unit being read, before its text is known.
struct Open {
    unit: Unit,
    problem: Problem,
    number: String,
    at: String,
    more: usize,
}

struct Walker<'a> {
    line: &'a [u8],
    stack: Vec<Frame>,
    top: Top,
    open: Option<Open>,
    out: Scan,
}

/// Find, in one fd-3 line, the numbers that would not reach the engine as
/// written, by the call whose arguments hold them. Total: any bytes give a
/// `Scan` (a line that is not JSON is refused by the parser afterwards, and
/// then what this found does not matter).
pub fn scan(line: &[u8]) -> Scan {
    let mut w = Walker {
        line,
        stack: Vec::new(),
        top: Top::Other,
        open: None,
        out: Scan::default(),
    };
    w.run();
    w.out
}

/// Overwrite every token that is no JSON number (`NaN`, `Infinity`,
/// `-Infinity`, a number beyond `f64`'s range) outside strings with `0` and
/// spaces, so that the line parses; `scan` first, to know which calls they
/// were in (those calls are refused, so the `0` reaches no engine).
pub fn patch(line: &mut [u8]) {
    let mut i = 0;
    while i < line.len() {
        match line[i] {
            b'"' => i = string_end(line, i),
            b if is_word(b) => {
                let end = word_end(line, i);
                if matches!(
                    number_problem(&line[i..end]),
                    Some(Some(Problem::NotJson | Problem::Overflow))
                ) {
                    line[i] = b'0';
                    line[i + 1..end].fill(b' ');
                }
                i = end;
            }
            _ => i += 1,
        }
    }
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'+' | b'.')
}

fn word_end(line: &[u8], i: usize) -> usize {
    line[i..]
        .iter()
        .position(|&b| !is_word(b))
        .map_or(line.len(), |n| i + n)
}

/// The index after the string token that starts at `i` (its closing quote
/// included), or the line's end.
fn string_end(line: &[u8], i: usize) -> usize {
    let mut j = i + 1;
    while j < line.len() {
        match line[j] {
            b'\\' => j += 2,
            b'"' => return j + 1,
            _ => j += 1,
        }
    }
    line.len()
}

impl Walker<'_> {
    fn run(&mut self) {
        let line = self.line;
        let mut i = 0;
        while i < line.len() {
            match line[i] {
                b'"' => {
                    let end = string_end(line, i);
                    let depth = self.stack.len();
                    match self.stack.last_mut() {
                        Some(f) if f.object && f.want_key => {
                            f.key = i..end;
                            f.want_key = false;
                            if depth == 1 {
                                self.top = top_key(&line[i..end]);
                            }
                        }
                        _ => self.value(i..end, None),
                    }
                    i = end;
                }
                b @ (b'{' | b'[') => {
                    if self.stack.len() >= MAX_DEPTH {
                        self.out.too_deep = true;
                        return;
                    }
                    self.stack.push(Frame {
                        object: b == b'{',
                        key: 0..0,
                        index: 0,
                        start: i,
                        want_key: b == b'{',
                    });
                    i += 1;
                }
                b'}' | b']' => {
                    if let Some(f) = self.stack.pop() {
                        self.value(f.start..i + 1, None);
                    }
                    i += 1;
                }
                b',' => {
                    if let Some(f) = self.stack.last_mut() {
                        if f.object {
                            f.want_key = true;
                        } else {
                            f.index += 1;
                        }
                    }
                    i += 1;
                }
                b if is_word(b) => {
                    let end = word_end(line, i);
                    match number_problem(&line[i..end]) {
                        Some(p) => {
                            if matches!(p, Some(Problem::NotJson | Problem::Overflow)) {
                                self.out.not_json = true;
                            }
                            self.value(i..end, p);
                        }
                        // true, false, null, or garbage the parser refuses.
                        None => self.value(i..end, None),
                    }
                    i = end;
                }
                _ => i += 1,
            }
        }
    }

    /// The unit a value whose parents are `self.stack` is in, and how many of
    /// those parents lie above (and at) the unit's own value.
    fn unit(&self) -> Option<(Unit, usize)> {
        let s = &self.stack;
        if !s.first()?.object {
            return None;
        }
        match self.top {
            Top::Args => Some((Unit::Args, 1)),
            Top::ArgsList if s.len() >= 2 && !s[1].object && s[1].index < MAX_BATCH => {
                Some((Unit::Item(s[1].index), 2))
            }
            _ => None,
        }
    }

    /// A value ended: `span` is its text; `problem` what is wrong with it if
    /// it is an altered number.
    fn value(&mut self, span: Range<usize>, problem: Option<Problem>) {
        let Some((unit, above)) = self.unit() else {
            return;
        };
        if let Some(problem) = problem {
            match &mut self.open {
                Some(o) if o.unit == unit => o.more += 1,
                _ => {
                    self.open = Some(Open {
                        unit,
                        problem,
                        number: shown_number(&self.line[span.clone()]),
                        at: self.pointer(above),
                        more: 0,
                    })
                }
            }
        }
        // The unit's own value: its parents are exactly those above it.
        if self.stack.len() == above {
            if let Some(o) = self.open.take_if(|o| o.unit == unit) {
                let (text, bytes) = args_text(&self.line[span]);
                let a = Altered {
                    problem: o.problem,
                    number: o.number,
                    at: o.at,
                    more: o.more,
                    text,
                    bytes,
                };
                match unit {
                    Unit::Args => self.out.args = Some(a),
                    Unit::Item(i) => {
                        self.out.items.retain(|(j, _)| *j != i);
                        self.out.items.push((i, a));
                    }
                }
            }
        }
    }

    /// The JSON Pointer of the current value below its unit's value.
    fn pointer(&self, above: usize) -> String {
        let mut p = String::new();
        for f in &self.stack[above..] {
            p.push('/');
            if f.object {
                let raw = &self.line[f.key.clone()];
                let key = serde_json::from_slice::<String>(raw)
                    .unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned());
                p.push_str(&key.replace('~', "~0").replace('/', "~1"));
            } else {
                p.push_str(&f.index.to_string());
            }
            if p.len() > AT_MAX_BYTES {
                break;
            }
        }
        super::framing::clip(&crate::text::escape(&p), AT_MAX_BYTES)
    }
}

fn top_key(token: &[u8]) -> Top {
    let key = match token {
        [b'"', inner @ .., b'"'] if !inner.contains(&b'\\') => std::borrow::Cow::Borrowed(inner),
        _ => match serde_json::from_slice::<String>(token) {
            Ok(k) => std::borrow::Cow::Owned(k.into_bytes()),
            Err(_) => return Top::Other,
        },
    };
    match &*key {
        b"args" => Top::Args,
        b"args_list" => Top::ArgsList,
        _ => Top::Other,
    }
}

/// The number as quoted back: ASCII, cut with its length said.
fn shown_number(tok: &[u8]) -> String {
    let s = String::from_utf8_lossy(tok);
    if s.len() <= NUMBER_SHOWN_MAX {
        s.into_owned()
    } else {
        format!("{}… ({} characters)", &s[..NUMBER_SHOWN_MAX], s.len())
    }
}

/// The arguments' text, cut to `ARGS_TEXT_MAX_BYTES` at a character boundary.
fn args_text(span: &[u8]) -> (String, usize) {
    let cut = span.len() > ARGS_TEXT_MAX_BYTES;
    let kept = &span[..span.len().min(ARGS_TEXT_MAX_BYTES)];
    let valid = match std::str::from_utf8(kept) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(&kept[..e.valid_up_to()]).unwrap_or_default(),
    };
    let mut text = String::with_capacity(valid.len() + if cut { '…'.len_utf8() } else { 0 });
    text.push_str(valid);
    if cut {
        text.push('…');
    }
    (text, span.len())
}

/// What is wrong with the word `tok` as a number: `None` when it is no
/// number (`true`, `null`, garbage), `Some(None)` when it is exact.
fn number_problem(tok: &[u8]) -> Option<Option<Problem>> {
    match tok {
        b"NaN" | b"Infinity" | b"-Infinity" => return Some(Some(Problem::NotJson)),
        b"true" | b"false" | b"null" => return None,
        _ => {}
    }
    let n = Grammar::of(tok)?;
    if n.integer {
        let digits = &tok[usize::from(n.neg)..];
        let fits = if n.neg {
            fits_under(digits, b"9223372036854775808")
        } else {
            fits_under(digits, b"18446744073709551615")
        };
        return Some(if n.neg && digits == b"0" {
            Some(Problem::NegativeZero)
        } else if fits {
            None
        } else if digits.len() >= 309 && overflows(tok) {
            Some(Problem::Overflow)
        } else {
            Some(Problem::Wide)
        });
    }
    // What serde_json reads the line's number as: the same code, the same
    // features, so the same f64 (or the same refusal).
    let Ok(f) = serde_json::from_slice::<f64>(tok) else {
        return Some(Some(Problem::Overflow));
    };
    let sent = Decimal::of(tok);
    // Fifteen significant digits or fewer, well inside the normal range: the
    // nearest f64's shortest form is this decimal (DBL_DIG), nothing to write.
    if let Some(d) = &sent {
        let lead = d.exp + d.len as i64 - 1;
        if d.len <= 15 && (-307..=307).contains(&lead) {
            return Some(None);
        }
    }
    let mut buf = Buf::default();
    if serde_json::to_writer(&mut buf, &f).is_err() {
        return Some(Some(Problem::NotF64));
    }
    let written = Decimal::of(&buf.bytes[..buf.len]);
    Some((sent.is_none() || sent != written).then_some(Problem::NotF64))
}

/// Whether the digits (no sign) are at most `max` (same width or fewer).
fn fits_under(digits: &[u8], max: &[u8]) -> bool {
    digits.len() < max.len() || (digits.len() == max.len() && digits <= max)
}

fn overflows(tok: &[u8]) -> bool {
    std::str::from_utf8(tok)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .is_none_or(f64::is_infinite)
}

/// The JSON number grammar: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
struct Grammar {
    neg: bool,
    integer: bool,
}

impl Grammar {
    fn of(tok: &[u8]) -> Option<Grammar> {
        let neg = tok.first() == Some(&b'-');
        let mut i = usize::from(neg);
        let digits = |i: &mut usize| {
            let s = *i;
            while *i < tok.len() && tok[*i].is_ascii_digit() {
                *i += 1;
            }
            *i - s
        };
        let int = digits(&mut i);
        if int == 0 || (int > 1 && tok[i - int] == b'0') {
            return None;
        }
        let mut integer = true;
        if tok.get(i) == Some(&b'.') {
            i += 1;
            if digits(&mut i) == 0 {
                return None;
            }
            integer = false;
        }
        if matches!(tok.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(tok.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if digits(&mut i) == 0 {
                return None;
            }
            integer = false;
        }
        (i == tok.len()).then_some(Grammar { neg, integer })
    }
}

/// A number token's decimal value: sign, significant digits (at most 17, the
/// most an f64's shortest form has; `None` for more), and the exponent of the
/// last one. Zero has no digits and exponent 0.
#[derive(Debug, PartialEq, Eq)]
struct Decimal {
    neg: bool,
    digits: [u8; 17],
    len: usize,
    exp: i64,
}

impl Decimal {
    fn of(tok: &[u8]) -> Option<Decimal> {
        let neg = tok.first() == Some(&b'-');
        let body = &tok[usize::from(neg)..];
        let (mantissa, exp) = match body.iter().position(|b| matches!(b, b'e' | b'E')) {
            Some(e) => (&body[..e], &body[e + 1..]),
            None => (body, &b""[..]),
        };
        let (int, frac) = match mantissa.iter().position(|&b| b == b'.') {
            Some(p) => (&mantissa[..p], &mantissa[p + 1..]),
            None => (mantissa, &b""[..]),
        };
        // Saturating: an exponent past 10^15 is as good as infinite here.
        let (eneg, edigits) = match exp.first() {
            Some(b'-') => (true, &exp[1..]),
            Some(b'+') => (false, &exp[1..]),
            _ => (false, exp),
        };
        let mut e: i64 = 0;
        for &d in edigits {
            e = (e * 10 + i64::from(d - b'0')).min(1_000_000_000_000_000);
        }
        if eneg {
            e = -e;
        }
        let total = int.len() + frac.len();
        let digit = |k: usize| {
            if k < int.len() {
                int[k]
            } else {
                frac[k - int.len()]
            }
        };
        let (Some(first), Some(last)) = (
            (0..total).find(|&k| digit(k) != b'0'),
            (0..total).rev().find(|&k| digit(k) != b'0'),
        ) else {
            return Some(Decimal {
                neg,
                digits: [0; 17],
                len: 0,
                exp: 0,
            });
        };
        let len = last - first + 1;
        if len > 17 {
            return None;
        }
        let mut digits = [0u8; 17];
        for (slot, k) in digits.iter_mut().zip(first..=last) {
            *slot = digit(k);
        }
        // The value is digits[..len] * 10^(e - frac.len() + (total - 1 - last)).
        let exp = e - frac.len() as i64 + (total - 1 - last) as i64;
        Some(Decimal {
            neg,
            digits,
            len,
            exp,
        })
    }
}

/// Room for one f64 as serde_json writes it (its shortest form, by zmij: at most 24 bytes).
#[derive(Default)]
struct Buf {
    bytes: [u8; 32],
    len: usize,
}

impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let n = b.len().min(self.bytes.len() - self.len);
        self.bytes[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(tok: &str) -> Option<Problem> {
        number_problem(tok.as_bytes()).expect("a number")
    }

    #[test]
    fn integers_are_exact_within_64_bits() {
        for ok in [
            "0",
            "9007199254740992",
            "9007199254740993",
            "18446744073709551615",
            "-9223372036854775808",
            "-1",
        ] {
            assert_eq!(problem(ok), None, "{ok}");
        }
        for wide in [
            "18446744073709551616",
            "18446744073709551617",
            "1180591620717411303424",
            "-9223372036854775809",
            "-18446744073709551621",
            "99999999999999999999999999999999999999999",
        ] {
            assert_eq!(problem(wide), Some(Problem::Wide), "{wide}");
        }
        assert_eq!(problem("-0"), Some(Problem::NegativeZero));
        assert_eq!(problem(&"9".repeat(400)), Some(Problem::Overflow));
        // What serde_json does with them, which is why.
        let v: serde_json::Value = serde_json::from_str("18446744073709551617").unwrap();
        assert!(v.is_f64(), "{v}");
        let v: serde_json::Value = serde_json::from_str("-9223372036854775809").unwrap();
        assert!(v.is_f64(), "{v}");
        let v: serde_json::Value = serde_json::from_str("-0").unwrap();
        assert_eq!(v.to_string(), "-0.0");
    }

    #[test]
    fn floats_are_exact_when_an_f64_holds_the_decimal() {
        for ok in [
            "0.1",
            "0.30000000000000004",
            "1.5e300",
            "1e+20",
            "1E20",
            "1.50",
            "-0.0",
            "0e99999999999999999999",
            "2.2250738585072014e-308",
            "5e-324",
            "1.7976931348623157e308",
            "123456789.12345679",
            "1.8446744073709552e+19",
        ] {
            assert_eq!(problem(ok), None, "{ok}");
        }
        for altered in [
            "0.1000000000000000000001",
            "1e-400",
            "9007199254740993.0",
            "0.1000000000000000055511151231257827021181583404541015625",
            "2.4703282292062328e-324",
        ] {
            assert_eq!(problem(altered), Some(Problem::NotF64), "{altered}");
        }
        assert_eq!(problem("1e400"), Some(Problem::Overflow));
        assert_eq!(problem("-1.8e308"), Some(Problem::Overflow));
        for nan in ["NaN", "Infinity", "-Infinity"] {
            assert_eq!(problem(nan), Some(Problem::NotJson), "{nan}");
        }
        for not in ["true", "null", "01", "1.", ".5", "1e", "--1", "Nan", "x"] {
            assert_eq!(number_problem(not.as_bytes()), None, "{not}");
        }
    }

    #[test]
    fn every_python_repr_is_exact() {
        // Python's json writes repr(float): the shortest decimal that reads
        // back as the same f64, the nearest of those, ties to even; serde_json
        // (zmij) writes the same (2.3 million doubles compared, random bits and
        // ties such as 1658206780088562.25, where Rust's `{:e}` rounds up and
        // both of them down). The daemon's suite sends Python's own.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let f = f64::from_bits(x);
            if !f.is_finite() {
                continue;
            }
            let written = serde_json::to_string(&f).unwrap();
            assert_eq!(problem(&written), None, "{written}");
        }
    }

    #[test]
    fn found_by_the_call_they_are_in() {
        let line = br#"{"id": 1, "op": "call", "tool": "t", "args": {"a": 1, "b": {"c~/": [1, 18446744073709551616, -0]}, "s": "18446744073709551616"}}"#;
        let s = scan(line);
        let a = s.args.as_ref().expect("found");
        assert_eq!(a.problem, Problem::Wide);
        assert_eq!(a.number, "18446744073709551616");
        assert_eq!(a.at, "/b/c~0~1/1");
        assert_eq!(a.more, 1, "-0 too; the string is no number");
        assert_eq!(
            a.text,
            r#"{"a": 1, "b": {"c~/": [1, 18446744073709551616, -0]}, "s": "18446744073709551616"}"#
        );
        assert_eq!(a.bytes, a.text.len());
        assert!(s.items.is_empty() && !s.not_json && !s.too_deep);

        let line = br#"{"op": "call_many", "args_list": [{"n": 1}, {"n": 1e-400}, {"n": 2}, {"m": {"x": NaN}}], "id": 2}"#;
        let s = scan(line);
        assert!(s.args.is_none());
        assert_eq!(s.item(0), None);
        assert_eq!(s.item(1).unwrap().problem, Problem::NotF64);
        assert_eq!(s.item(1).unwrap().at, "/n");
        assert_eq!(s.item(2), None);
        let nan = s.item(3).unwrap();
        assert_eq!(
            (nan.problem, nan.number.as_str(), nan.at.as_str()),
            (Problem::NotJson, "NaN", "/m/x")
        );
        assert_eq!(nan.text, r#"{"m": {"x": NaN}}"#);
        assert!(s.not_json);
        let mut patched = line.to_vec();
        patch(&mut patched);
        let v: serde_json::Value = serde_json::from_slice(&patched).unwrap();
        assert_eq!(v["args_list"][3]["m"]["x"], 0);
        assert_eq!(patched.len(), line.len());

        // The arguments themselves, escaped keys, a key that only looks like args.
        let s = scan(br#"{"op": "call", "\u0061rgs": -18446744073709551621, "args_x": 1e999}"#);
        assert_eq!(s.args.as_ref().unwrap().at, "");
        assert_eq!(s.args.as_ref().unwrap().number, "-18446744073709551621");
        // A key with a control character is shown escaped.
        let s = scan(b"{\"args\": {\"a\\u001b[2J\": 18446744073709551616}}");
        assert_eq!(s.args.unwrap().at, "/a\\x1b[2J");
    }

    #[test]
    fn bounded_whatever_the_line() {
        let deep = format!("{{\"args\": {}1{}}}", "[".repeat(300), "]".repeat(300));
        assert!(scan(deep.as_bytes()).too_deep);
        let long = format!(
            "{{\"args\": {{\"k\": \"{}\", \"n\": 18446744073709551616}}}}",
            "é".repeat(5000)
        );
        let a = scan(long.as_bytes()).args.unwrap();
        assert!(a.text.len() <= ARGS_TEXT_MAX_BYTES + "…".len());
        assert!(a.text.ends_with('…'));
        assert_eq!(a.bytes, long.len() - "{\"args\": }".len());
        let big = "1".repeat(100_000);
        let a = scan(format!("{{\"args\": [{big}]}}").as_bytes())
            .args
            .unwrap();
        assert_eq!(a.number, format!("{}… (100000 characters)", &big[..40]));
        // Garbage: no panic, nothing found that a parser would accept.
        for junk in [
            &b"\"\\"[..],
            b"{\"args\":",
            b"]]]}}}",
            b"{\"args\": [\"\\",
            b"-",
            b"{,,:",
        ] {
            let _ = scan(junk);
            let mut j = junk.to_vec();
            patch(&mut j);
        }
    }
}
