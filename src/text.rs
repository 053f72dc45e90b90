//! Text that a script, an engine or an upstream server wrote, made safe to show a
//! person: control characters and the characters that reorder or hide text are
//! replaced by a visible escape (`\x1b`, `\u202e`), so that what is shown is what
//! is there. JSON output stays exact; this is for terminals, forms and
//! descriptions.
//!
//! This is the one implementation: `escape` (one line), `escape_lines` (lines:
//! the newlines kept), `numbered_source` (a script to approve), and `Untrusted`,
//! the type of such text at the place it is printed, whose `Display` escapes
//! and whose `Serialize` (for `--json`) is exact.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` must not reach a person as it is: C0 and C1 controls, DEL, the
/// bidirectional marks, embeddings, overrides and isolates, the zero-width
/// characters, the line and paragraph separators, and the other characters
/// that show as nothing: the soft hyphen, the invisible format characters, the
/// Hangul fillers and the tag characters (which can carry a whole hidden text).
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{00ad}'              // soft hyphen
            | '\u{061c}'            // Arabic letter mark
            | '\u{115f}' | '\u{1160}' | '\u{3164}' | '\u{ffa0}' // Hangul fillers
            | '\u{180e}'            // Mongolian vowel separator (zero-width)
            | '\u{200b}'..='\u{200f}' // zero-width space, non-joiner, joiner; LRM, RLM
            | '\u{2028}' | '\u{2029}' // line and paragraph separators
            | '\u{202a}'..='\u{202e}' // embeddings and overrides
            | '\u{2060}'..='\u{2064}' // word joiner, invisible operators
            | '\u{2066}'..='\u{206f}' // isolates; deprecated format characters
            | '\u{feff}'            // zero-width no-break space
            | '\u{fff9}'..='\u{fffb}' // interlinear annotation
            | '\u{e0000}'..='\u{e007f}' // tags
        )
}

/// One line of untrusted text: every unsafe character escaped, newlines and tabs
/// included.
pub fn escape(s: &str) -> Cow<'_, str> {
    escape_keeping(s, |_| false)
}

/// Lines of untrusted text (a script's output, a result text): its newlines
/// kept, every other unsafe character escaped, carriage returns and tabs
/// included (a carriage return would let a line be written over).
pub fn escape_lines(s: &str) -> Cow<'_, str> {
    escape_keeping(s, |c| c == '\n')
}

fn escape_keeping(s: &str, keep: impl Fn(char) -> bool) -> Cow<'_, str> {
    if !s.chars().any(|c| is_unsafe(c) && !keep(c)) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !is_unsafe(c) || keep(c) {
            out.push(c);
        } else if (c as u32) < 0x100 {
            let _ = write!(out, "\\x{:02x}", c as u32);
        } else {
            let _ = write!(out, "\\u{:04x}", c as u32);
        }
    }
    Cow::Owned(out)
}

/// A script's source for a person to approve: each line numbered, its unsafe
/// characters escaped (carriage returns included), so that no line can hide
/// another or pass for a numbered one. Lines are numbered as Python reads them
/// (`python_lines`): a lone carriage return ends a line for Python, so it ends
/// one here too, shown escaped at the end of the line it ends; otherwise
/// `x = 1  # note\rreboot()` would show as one commented line and run a call.
pub fn numbered_source(code: &str) -> String {
    let mut out = String::with_capacity(code.len() + code.len() / 4 + 8);
    for (i, l) in python_lines(code).enumerate() {
        let _ = writeln!(out, "{:4} | {}", i + 1, escape(l));
    }
    out
}

/// The lines of a Python source as Python's tokenizer splits them: at `\r\n`,
/// `\n` and a lone `\r`. `\r\n` and `\n` are left out of the line; a lone
/// `\r` is kept at its end, so that it is shown. A last line without an end
/// counts; an empty source has no line.
fn python_lines(code: &str) -> impl Iterator<Item = &str> {
    let mut rest = code;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let Some(at) = rest.find(['\r', '\n']) else {
            return Some(std::mem::take(&mut rest));
        };
        let (line, after) = match &rest.as_bytes()[at..] {
            [b'\r', b'\n', ..] => (&rest[..at], &rest[at + 2..]),
            [b'\r', ..] => (&rest[..=at], &rest[at + 1..]),
            _ => (&rest[..at], &rest[at + 1..]),
        };
        rest = after;
        Some(line)
    })
}

/// Text that a script, an engine or an upstream server wrote (a description, a
/// progress message, an output, a tool's name or signature, an error's text),
/// as it is handed to what prints it. `Display` escapes it, as one line
/// (`line`: a table's cell, a field; newlines are escaped too, so that no fake
/// row can follow) or as lines (`lines`: an output, a result text; newlines
/// kept). The text as it was written is for `--json` only, where `Serialize`
/// gives it exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Untrusted<'a> {
    text: &'a str,
    newlines: bool,
}

impl<'a> Untrusted<'a> {
    /// Shown on one line: every unsafe character escaped, newlines included.
    pub fn line(text: &'a str) -> Self {
        Untrusted {
            text,
            newlines: false,
        }
    }

    /// Shown as lines: the newlines kept, every other unsafe character escaped.
    pub fn lines(text: &'a str) -> Self {
        Untrusted {
            text,
            newlines: true,
        }
    }

    /// The text as a person is shown it.
    pub fn escaped(self) -> Cow<'a, str> {
        match self.newlines {
            true => escape_lines(self.text),
            false => escape(self.text),
        }
    }
}

/// Escaped; a width and an alignment (`{:<20}`) apply to the escaped text.
impl std::fmt::Display for Untrusted<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(&self.escaped())
    }
}

/// Exact: JSON escapes what it must itself, and a program reads it.
impl serde::Serialize for Untrusted<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_reordering_characters_are_escaped_visibly() {
        assert_eq!(escape("plain text, ünïcode"), "plain text, ünïcode");
        assert!(matches!(escape("plain"), Cow::Borrowed(_)));
        assert_eq!(escape("a\x1b[2Kb"), "a\\x1b[2Kb");
        assert_eq!(escape("a\rb\nc\td\x7f"), "a\\x0db\\x0ac\\x09d\\x7f");
        assert_eq!(escape("\u{9b}31m"), "\\x9b31m", "C1 CSI");
        assert_eq!(escape("abc\u{202e}fed"), "abc\\u202efed");
        assert_eq!(
            escape("x\u{200b}y\u{2066}z\u{2069}"),
            "x\\u200by\\u2066z\\u2069"
        );
        assert_eq!(escape("l1\u{2028}l2\u{feff}"), "l1\\u2028l2\\ufeff");
    }

    #[test]
    fn invisible_characters_are_escaped_too() {
        assert_eq!(
            escape("a\u{ad}b\u{3164}c\u{206a}d\u{e0041}\u{e007f}e\u{fffb}"),
            "a\\xadb\\u3164c\\u206ad\\ue0041\\ue007fe\\ufffb"
        );
        assert_eq!(escape("é ü ñ 漢字 ❤"), "é ü ñ 漢字 ❤");
    }

    #[test]
    fn a_numbered_source_cannot_fake_a_line() {
        let code = "tools.srv.reboot_all()  # \x1b[2K\x1b[1G   2 | print(1)\nx = 1\r   3 | y";
        let shown = numbered_source(code);
        assert_eq!(
            shown,
            "   1 | tools.srv.reboot_all()  # \\x1b[2K\\x1b[1G   2 | print(1)\n   2 | x = 1\\x0d\n   3 |    3 | y\n"
        );
        assert!(!shown.chars().any(|c| is_unsafe(c) && c != '\n'));
    }

    #[test]
    fn a_numbered_source_has_the_lines_python_reads() {
        // Python ends a line at \r\n, \n and a lone \r: the call on the line
        // after a lone \r runs, so it is shown on a line of its own.
        assert_eq!(
            numbered_source("x = 1  # note\rreboot()\r\ny = 2\n\nz\r"),
            "   1 | x = 1  # note\\x0d\n   2 | reboot()\n   3 | y = 2\n   4 | \n   5 | z\\x0d\n"
        );
        assert_eq!(numbered_source(""), "");
        assert_eq!(numbered_source("a"), "   1 | a\n");
        assert_eq!(numbered_source("a\n"), "   1 | a\n");
        // Other line-like characters are not line ends to Python: escaped in place.
        assert_eq!(
            numbered_source("# a\x0bb\x0cc\u{2028}d\u{85}e"),
            "   1 | # a\\x0bb\\x0cc\\u2028d\\x85e\n"
        );
    }

    #[test]
    fn untrusted_text_prints_escaped_and_serializes_exact() {
        let s = "ok\x1b]0;owned\x07\r\nfake row\u{202e}";
        assert_eq!(
            Untrusted::line(s).to_string(),
            "ok\\x1b]0;owned\\x07\\x0d\\x0afake row\\u202e"
        );
        assert_eq!(
            Untrusted::lines(s).to_string(),
            "ok\\x1b]0;owned\\x07\\x0d\nfake row\\u202e"
        );
        assert_eq!(escape_lines(s), Untrusted::lines(s).to_string());
        assert_eq!(
            serde_json::to_value(Untrusted::line(s)).unwrap(),
            serde_json::Value::from(s)
        );
        // Widths apply to what is shown.
        assert_eq!(format!("[{:<8}]", Untrusted::line("a\x1b")), "[a\\x1b   ]");
    }
}
