//! The one table renderer of the CLI: columns aligned to their widest cell.

use crate::text::Untrusted;

/// A table with a header line; every column but the last is padded to its
/// widest cell (in characters) plus two spaces, and lines carry no trailing blanks.
/// Every cell is shown as one line of untrusted text (`text::Untrusted::line`):
/// a cell holds what a script, an engine or a server wrote (a description, a
/// progress message, a tool's signature), so its control and reordering
/// characters and its newlines are escaped before the columns are measured: no
/// cell can move the cursor, set a title or start a row of its own.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let escaped: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| Untrusted::line(c).to_string()).collect())
        .collect();
    let rows = &escaped;
    let mut w: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i == w.len() {
                w.push(0);
            }
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: &[&str]| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut out = line(headers);
    for r in rows {
        out.push_str(&line(&r.iter().map(String::as_str).collect::<Vec<_>>()));
    }
    out
}

/// Name–value lines without a header (`status`, `show`).
pub fn pairs(rows: &[Vec<String>]) -> String {
    table(&["", ""], rows)
        .lines()
        .skip(1)
        .map(|l| l.to_string() + "\n")
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let t = table(
            &["A", "LONGER"],
            &[
                vec!["xyz".into(), "1".into()],
                vec!["q".into(), "22".into()],
            ],
        );
        assert_eq!(t, "A    LONGER\nxyz  1\nq    22\n");
        let t = table(&["NAME", "SIG"], &[vec!["é".into(), String::new()]]);
        assert_eq!(
            t, "NAME  SIG\né\n",
            "characters, not bytes; no trailing blanks"
        );
        assert_eq!(
            pairs(&[vec!["k".into(), "v".into()], vec!["key".into(), "w".into()]]),
            "k    v\nkey  w\n"
        );
    }

    #[test]
    fn a_cell_cannot_drive_the_terminal_nor_start_a_row() {
        let t = table(
            &["ID", "PROGRESS", "UNIT"],
            &[vec![
                "a".into(),
                "1/2 \x1b]0;owned\x07\x1b[2J\r\nb  fake\u{202e}".into(),
                "u".into(),
            ]],
        );
        assert_eq!(
            t,
            "ID  PROGRESS                                          UNIT\n\
             a   1/2 \\x1b]0;owned\\x07\\x1b[2J\\x0d\\x0ab  fake\\u202e  u\n"
        );
    }
}
