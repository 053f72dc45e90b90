//! Text that a script, an engine or an upstream server wrote, made safe to show a
//! person: control characters and the characters that reorder or hide text are
//! replaced by a visible escape (`\x1b`, `\u202e`), so that what is shown is what
//! is there. JSON output stays exact; this is for terminals, forms and
//! descriptions.

use std::borrow::Cow;
use std::fmt::Write;

/// Whether `c` must not reach a person as it is: C0 and C1 controls, DEL, the
/// bidirectional marks, embeddings, overrides and isolates, the zero-width
/// characters, and the line and paragraph separators.
pub fn is_unsafe(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}'              // Arabic letter mark
            | '\u{180e}'            // Mongolian vowel separator (zero-width)
            | '\u{200b}'..='\u{200f}' // zero-width space, non-joiner, joiner; LRM, RLM
            | '\u{2028}' | '\u{2029}' // line and paragraph separators
            | '\u{202a}'..='\u{202e}' // embeddings and overrides
            | '\u{2060}'..='\u{2064}' // word joiner, invisible operators
            | '\u{2066}'..='\u{2069}' // isolates
            | '\u{feff}'            // zero-width no-break space
        )
}

/// One line of untrusted text: every unsafe character escaped, newlines and tabs
/// included.
pub fn escape(s: &str) -> Cow<'_, str> {
    escape_keeping(s, |_| false)
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
/// another or pass for a numbered one.
pub fn numbered_source(code: &str) -> String {
    code.lines()
        .enumerate()
        .map(|(i, l)| format!("{:4} | {}\n", i + 1, escape(l)))
        .collect()
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
    fn a_numbered_source_cannot_fake_a_line() {
        let code = "tools.srv.reboot_all()  # \x1b[2K\x1b[1G   2 | print(1)\nx = 1\r   3 | y";
        let shown = numbered_source(code);
        assert_eq!(
            shown,
            "   1 | tools.srv.reboot_all()  # \\x1b[2K\\x1b[1G   2 | print(1)\n   2 | x = 1\\x0d   3 | y\n"
        );
        assert!(!shown.chars().any(|c| is_unsafe(c) && c != '\n'));
    }
}
