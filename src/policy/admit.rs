//! Which tools of an MCP server's `tools/list` are offered, and what is kept
//! of each (pure). A server is a program the user names, but what it lists is
//! its own: one tool must not be able to disable the others (a name the
//! snapshot refuses, or one that hides or reorders text in the description a
//! model reads), nor to grow the CLI (a schema that parses to far more than it
//! weighs as text).
//!
//! A tool is left out, with the reason, when its name is empty, longer than
//! `MAX_NAME_BYTES` with its server's prefix, has white space in it or a
//! character `crate::text::is_unsafe` names, or was listed already; when its
//! description is not text; when its input schema, once the keywords no
//! validator reads are dropped, is over `MAX_SCHEMA_BYTES` as text or
//! `MAX_SCHEMA_PARSED` parsed. What is kept of one server's list is bounded in
//! total too (`MAX_LIST_BYTES`, `MAX_LIST_PARSED`): a list over it is refused
//! as a whole, since which of its tools to keep would depend on the order of
//! its pages.

use crate::text::{escape, is_unsafe};
use serde_json::Value;
use std::collections::HashSet;

/// The longest full tool name (`server__tool`), in bytes: the snapshot's bound.
pub const MAX_NAME_BYTES: usize = 128;
/// The largest input schema kept for one tool, as compact JSON text, after
/// the keywords no validator reads are dropped.
pub const MAX_SCHEMA_BYTES: usize = 256 << 10;
/// The most one tool's input schema may hold once parsed (`parsed_size`).
pub const MAX_SCHEMA_PARSED: usize = 8 << 20;
/// The most of a tool's description that is kept (the `describe` text shows
/// 500 characters of it; `help()` in a script all that is kept).
pub const MAX_DESCRIPTION_BYTES: usize = 16 << 10;
/// The most kept of one server's list, as text: names, descriptions, schemas.
pub const MAX_LIST_BYTES: usize = 8 << 20;
/// The most kept of one server's list once parsed (`parsed_size`). Schemas
/// as servers write them weigh 9 to 13 times their text parsed
/// (server-filesystem's, server-everything's), so this is some 3 MiB of their
/// text, thousands of tools; the CLI holds a few copies of it at a time (the
/// snapshot of each script it starts, the daemon's policy).
pub const MAX_LIST_PARSED: usize = 32 << 20;
/// Tools left out that are named (in warnings, `scriptgate tools`, the
/// `describe` text), per server; the others are counted.
pub const MAX_LEFT_OUT_NAMED: usize = 32;

/// The tools left out of a list, and why: the first `MAX_LEFT_OUT_NAMED` of
/// each server by name (as the server wrote it, clipped), the rest counted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeftOut {
    /// Full name (`server__tool`, raw: escape it to show it) and reason.
    pub named: Vec<(String, String)>,
    /// Tools left out beyond those named.
    pub more: usize,
}

impl LeftOut {
    fn add(&mut self, name: String, why: String) {
        if self.named.len() < MAX_LEFT_OUT_NAMED {
            self.named.push((name, why));
        } else {
            self.more += 1;
        }
    }

    /// Another server's tools left out, after these (each list is bounded on
    /// its own).
    pub fn append(&mut self, other: LeftOut) {
        self.named.extend(other.named);
        self.more += other.more;
    }

    pub fn is_empty(&self) -> bool {
        self.named.is_empty() && self.more == 0
    }
}

/// Why a full tool name cannot be offered, if it cannot: the snapshot's rules
/// (1 to `MAX_NAME_BYTES` bytes, no white space or control character), and no
/// character that hides or reorders text (a model and a person read the name).
pub fn name_problem(full: &str, tool: &str) -> Option<String> {
    if tool.is_empty() {
        return Some("its name is empty".into());
    }
    if full.len() > MAX_NAME_BYTES {
        return Some(format!(
            "its name is {} bytes long with the server's prefix; at most {MAX_NAME_BYTES}",
            full.len()
        ));
    }
    if let Some(c) = full.chars().find(|&c| is_unsafe(c)) {
        return Some(format!(
            "its name has a control, invisible or reordering character ({})",
            escape(c.encode_utf8(&mut [0; 4]))
        ));
    }
    if full.chars().any(char::is_whitespace) {
        return Some("its name has white space in it".into());
    }
    None
}

/// Keywords of JSON Schema (2020-12, and of the drafts before it that a
/// validator may still read): every other key of a schema object is one no
/// validator reads, nor scriptgate (its closed-schema rewrite, `describe`,
/// the script's typed API).
const KEYWORDS: &[&str] = &[
    // core
    "$schema",
    "$id",
    "$ref",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
    "$vocabulary",
    "$comment",
    "$defs",
    "definitions",
    "id",
    // applicators
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependencies",
    "prefixItems",
    "items",
    "additionalItems",
    "contains",
    "properties",
    "patternProperties",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    // validation
    "type",
    "enum",
    "const",
    "multipleOf",
    "maximum",
    "exclusiveMaximum",
    "minimum",
    "exclusiveMinimum",
    "maxLength",
    "minLength",
    "pattern",
    "maxItems",
    "minItems",
    "uniqueItems",
    "maxContains",
    "minContains",
    "maxProperties",
    "minProperties",
    "required",
    "dependentRequired",
    // meta-data, format, content
    "title",
    "description",
    "default",
    "deprecated",
    "readOnly",
    "writeOnly",
    "examples",
    "format",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
];

/// Keys of the schema that a reference may pass through: `None` when one
/// cannot be followed here (a URI, an anchor), and then nothing is dropped.
fn referenced_keys(schema: &Value) -> Option<HashSet<String>> {
    fn walk(v: &Value, keys: &mut HashSet<String>) -> bool {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    if let ("$ref" | "$dynamicRef" | "$recursiveRef", Value::String(r)) =
                        (k.as_str(), v)
                    {
                        let Some(pointer) = r.strip_prefix('#') else {
                            return false;
                        };
                        let Some(pointer) = super::percent_decode(pointer) else {
                            return false;
                        };
                        if !(pointer.is_empty() || pointer.starts_with('/')) {
                            return false;
                        }
                        keys.extend(
                            pointer
                                .split('/')
                                .skip(1)
                                .map(|s| s.replace("~1", "/").replace("~0", "~")),
                        );
                    }
                    if !walk(v, keys) {
                        return false;
                    }
                }
                true
            }
            Value::Array(a) => a.iter().all(|v| walk(v, keys)),
            _ => true,
        }
    }
    let mut keys = HashSet::new();
    walk(schema, &mut keys).then_some(keys)
}

/// Drop from every schema object of `schema` (the ones JSON Schema's
/// applicators reach, as the closed-schema rewrite finds them: `subschemas`)
/// the keys that are no keyword. Validation is unchanged: a validator ignores
/// them. A key a `$ref` pointer passes through stays, wherever it is; and
/// when a reference is one that is not followed here (to a URI or an anchor),
/// nothing is dropped. What the keywords hold that is no schema (`enum`,
/// `default`, `examples`, ...) is kept as it is.
pub fn drop_unknown_keywords(schema: &mut Value) {
    fn prune(v: &mut Value, keep: &HashSet<String>) {
        let Value::Object(map) = v else { return };
        map.retain(|k, _| KEYWORDS.contains(&k.as_str()) || keep.contains(k));
        let children: Vec<Vec<String>> = super::subschemas(map)
            .into_iter()
            .map(|(segs, _, _)| segs)
            .collect();
        for segs in children {
            if let Some(slot) = super::subschema_mut(map, &segs) {
                prune(slot, keep);
            }
        }
    }
    if let Some(keep) = referenced_keys(schema) {
        prune(schema, &keep);
    }
}

/// The bytes of `v` as compact JSON, counted as it is written (nothing is
/// allocated).
pub fn json_len(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = serde_json::to_writer(&mut c, v);
    c.0
}

/// About what `v` holds on the heap: the bytes of its strings and keys, a
/// `Value` slot per array element (by the array's capacity), and a map node
/// (`MAP_NODE`, serde_json's maps being B-trees) per 6 entries of an object,
/// one for an object of up to 11, none for an empty one. A schema of small
/// objects weighs some 30 times its text: `{"type": "integer"}` is one node.
pub fn parsed_size(v: &Value) -> usize {
    /// A B-tree leaf of 11 (`String`, `Value`) entries and its links.
    const MAP_NODE: usize = 640;
    match v {
        Value::String(s) => s.len(),
        Value::Array(a) => {
            a.capacity() * std::mem::size_of::<Value>() + a.iter().map(parsed_size).sum::<usize>()
        }
        Value::Object(m) => {
            let nodes = match m.len() {
                0 => 0,
                1..=11 => 1,
                n => n.div_ceil(6),
            };
            nodes * MAP_NODE
                + m.iter()
                    .map(|(k, v)| k.len() + parsed_size(v))
                    .sum::<usize>()
        }
        _ => 0,
    }
}

/// One server's list as it is read, tool by tool: each tool is kept or left
/// out (`left_out`), and what is kept is counted against the list's bounds.
pub struct List {
    server: String,
    names: HashSet<String>,
    bytes: usize,
    parsed: usize,
    pub left_out: LeftOut,
}

impl List {
    pub fn new(server: &str) -> List {
        List {
            server: server.to_string(),
            names: HashSet::new(),
            bytes: 0,
            parsed: 0,
            left_out: LeftOut::default(),
        }
    }

    /// Take one listed tool (an MCP `Tool` object): `Ok(Some)` with what is
    /// kept of it (its unknown schema keywords dropped, its description
    /// clipped), `Ok(None)` when it is left out (in `left_out`), `Err` (why)
    /// when what the list keeps goes over its bounds.
    pub fn admit(&mut self, mut tool: Value) -> Result<Option<Value>, String> {
        let Some(t) = tool.as_object_mut() else {
            self.left_out.add(
                format!("{}__?", self.server),
                "it is not a JSON object".into(),
            );
            return Ok(None);
        };
        let name = match t.get("name") {
            Some(Value::String(n)) => n.clone(),
            _ => {
                self.left_out.add(
                    format!("{}__?", self.server),
                    "its name is missing or not text".into(),
                );
                return Ok(None);
            }
        };
        let full = format!("{}__{name}", self.server);
        let mut leave = |why: String| {
            let shown = crate::protocol::framing::clip(&full, MAX_NAME_BYTES + 32);
            self.left_out.add(shown, why);
            Ok(None)
        };
        if let Some(why) = name_problem(&full, &name) {
            return leave(why);
        }
        if self.names.contains(&name) {
            return leave("the server lists it twice (the first is offered)".into());
        }
        match t.get_mut("description") {
            None | Some(Value::Null) => {}
            Some(Value::String(d)) => {
                if d.len() > MAX_DESCRIPTION_BYTES {
                    // A new buffer: a string cut in place keeps its whole one.
                    *d = crate::protocol::framing::clip(d, MAX_DESCRIPTION_BYTES);
                    d.shrink_to_fit();
                }
            }
            Some(_) => return leave("its description is not text".into()),
        }
        if let Some(schema) = t.get_mut("inputSchema") {
            drop_unknown_keywords(schema);
            let (bytes, parsed) = (json_len(schema), parsed_size(schema));
            if bytes > MAX_SCHEMA_BYTES {
                return leave(format!(
                    "its input schema is {} KiB; at most {} KiB is taken",
                    bytes >> 10,
                    MAX_SCHEMA_BYTES >> 10
                ));
            }
            if parsed > MAX_SCHEMA_PARSED {
                return leave(format!(
                    "its input schema takes about {} MiB once parsed; at most {} MiB",
                    parsed >> 20,
                    MAX_SCHEMA_PARSED >> 20
                ));
            }
        }
        let bytes = json_len(&tool);
        let parsed = parsed_size(&tool);
        self.bytes += bytes;
        self.parsed += parsed;
        if self.bytes > MAX_LIST_BYTES || self.parsed > MAX_LIST_PARSED {
            return Err(format!(
                "tools/list: the tools kept come to more than {} MiB of text or {} MiB once parsed; \
                 scriptgate keeps at most that much of one server's list",
                MAX_LIST_BYTES >> 20,
                MAX_LIST_PARSED >> 20
            ));
        }
        self.names.insert(name);
        Ok(Some(tool))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Map};

    #[test]
    fn unusable_names_are_named_with_the_reason() {
        let p = |tool: &str| name_problem(&format!("s__{tool}"), tool);
        assert_eq!(p("get_item"), None);
        assert_eq!(p("über.größe-2"), None, "letters of any script are fine");
        assert_eq!(p("a__b"), None);
        assert_eq!(p("").as_deref(), Some("its name is empty"));
        assert_eq!(
            p("bad name").as_deref(),
            Some("its name has white space in it")
        );
        assert_eq!(
            p("x\u{202e}y").as_deref(),
            Some("its name has a control, invisible or reordering character (\\u202e)")
        );
        assert_eq!(
            p("a\u{200b}b").as_deref(),
            Some("its name has a control, invisible or reordering character (\\u200b)")
        );
        assert_eq!(
            p("tab\there").as_deref(),
            Some("its name has a control, invisible or reordering character (\\x09)")
        );
        assert!(p("no\u{a0}break").is_some());
        assert_eq!(p(&"n".repeat(125)), None, "128 bytes with s__");
        assert!(p(&"n".repeat(126)).unwrap().contains("129 bytes long"));
    }

    /// Whatever name is admitted, the snapshot takes it.
    #[test]
    fn an_admitted_name_passes_the_snapshot() {
        for tool in ["a", "über", "x-y.z", "a__b", &"n".repeat(125)] {
            let full = format!("s__{tool}");
            assert_eq!(name_problem(&full, tool), None);
            let snap = json!({"workspace": "/w", "permission_mode": "auto",
                              "tools": [{"name": full, "class": "destructive"}]});
            assert!(crate::protocol::snapshot::parse_snapshot(snap).is_ok());
        }
        for tool in ["a b", "a\tb", "a\u{85}b", &"n".repeat(126)] {
            let full = format!("s__{tool}");
            let snap = json!({"workspace": "/w", "permission_mode": "auto",
                              "tools": [{"name": full, "class": "destructive"}]});
            assert!(crate::protocol::snapshot::parse_snapshot(snap).is_err());
            assert!(name_problem(&full, tool).is_some(), "{tool:?}");
        }
    }

    #[test]
    fn unknown_keywords_are_dropped_where_schemas_are() {
        let mut s = json!({
            "type": "object", "x-big": [0, 0, 0], "$comment": "kept",
            "properties": {
                "x-big": {"type": "string", "x-vendor": {"a": 1}, "enum": [{"x-data": 1}]},
                "n": {"type": "integer", "default": 3, "examples": [1, 2]}
            },
            "allOf": [{"junk": 1, "required": ["n"]}],
            "$defs": {"d": {"type": "object", "foo": true, "additionalProperties": {"bar": 1}}},
            "not": {"baz": 2}
        });
        drop_unknown_keywords(&mut s);
        assert_eq!(
            s,
            json!({
                "type": "object", "$comment": "kept",
                "properties": {
                    "x-big": {"type": "string", "enum": [{"x-data": 1}]},
                    "n": {"type": "integer", "default": 3, "examples": [1, 2]}
                },
                "allOf": [{"required": ["n"]}],
                "$defs": {"d": {"type": "object", "additionalProperties": {}}},
                "not": {}
            }),
            "property names and data stay; keys that are no keyword go"
        );
    }

    #[test]
    fn keys_a_reference_reaches_through_stay() {
        let mut s = json!({"type": "object", "shapes": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}}},
                           "other": 1, "properties": {"p": {"$ref": "#/shapes/pt"}}});
        drop_unknown_keywords(&mut s);
        assert!(s.get("shapes").is_some() && s.get("other").is_none(), "{s}");
        let v = crate::policy::compile_schema(&s).unwrap();
        assert!(!v.is_valid(&json!({"p": {"x": "no"}})));
        // Percent-encoded and escaped segments are read as a validator reads them.
        let mut s = json!({"a/b": {"type": "string"}, "c d": {"type": "string"}, "e": 1,
                           "anyOf": [{"$ref": "#/a~1b"}, {"$ref": "#/c%20d"}]});
        drop_unknown_keywords(&mut s);
        assert!(s.get("a/b").is_some() && s.get("c d").is_some() && s.get("e").is_none());
        // A reference not followed here: nothing is dropped.
        for r in ["#anchor", "other.json#/x", "https://example.com/s"] {
            let before = json!({"type": "object", "y": 1, "properties": {"p": {"$ref": r}}});
            let mut s = before.clone();
            drop_unknown_keywords(&mut s);
            assert_eq!(s, before, "{r}");
        }
    }

    /// What the closed-schema rewrite and the validator read is the same
    /// before and after: the same calls pass and fail.
    #[test]
    fn dropping_keywords_changes_no_verdict() {
        let s = json!({
            "type": "object", "x-meta": {"properties": {"evil": {}}},
            "properties": {"a": {"type": "object", "x-ui": 1, "properties": {"b": {"type": "string"}}},
                           "n": {"type": "integer", "minimum": 1}},
            "allOf": [{"properties": {"c": {"type": "boolean"}}, "x-c": 0}],
            "required": ["n"]
        });
        let mut pruned = s.clone();
        drop_unknown_keywords(&mut pruned);
        assert_ne!(pruned, s);
        let (v1, v2) = (
            crate::policy::compile_schema(&s).unwrap(),
            crate::policy::compile_schema(&pruned).unwrap(),
        );
        for args in [
            json!({"n": 1}),
            json!({"n": 0}),
            json!({"n": 1, "a": {"b": "x"}}),
            json!({"n": 1, "a": {"b": "x", "z": 1}}),
            json!({"n": 1, "c": true}),
            json!({"n": 1, "evil": 1}),
            json!({"n": 1, "x-meta": 1}),
        ] {
            assert_eq!(v1.is_valid(&args), v2.is_valid(&args), "{args}");
        }
    }

    #[test]
    fn sizes_are_counted_without_copies() {
        let v = json!({"a": "xyz", "b": [1, 2, 3]});
        assert_eq!(json_len(&v), v.to_string().len());
        let zeros: Value =
            serde_json::from_str(&format!("[{}]", vec!["0"; 1000].join(","))).unwrap();
        assert!(parsed_size(&zeros) >= 1000 * 32, "{}", parsed_size(&zeros));
        assert_eq!(parsed_size(&json!({})), 0);
        assert_eq!(parsed_size(&json!({"type": "integer"})), 640 + 4 + 7);
    }

    fn tool(name: &str, schema: Value) -> Value {
        json!({"name": name, "inputSchema": schema, "annotations": {"readOnlyHint": true}})
    }

    #[test]
    fn a_list_keeps_what_it_may_and_names_what_it_leaves_out() {
        let mut l = List::new("s");
        let kept = l
            .admit(tool("ok", json!({"type": "object", "x-pad": [0, 0]})))
            .unwrap()
            .unwrap();
        assert_eq!(kept["inputSchema"], json!({"type": "object"}));
        assert_eq!(l.admit(tool("ok", json!({}))).unwrap(), None);
        assert_eq!(l.admit(tool("bad name", json!({}))).unwrap(), None);
        assert_eq!(l.admit(json!({"inputSchema": {}})).unwrap(), None);
        assert_eq!(l.admit(json!(7)).unwrap(), None);
        assert_eq!(
            l.admit(json!({"name": "d", "description": {"no": 1}}))
                .unwrap(),
            None
        );
        let big = json!({"type": "object", "examples": [vec![0; 200_000]]});
        assert_eq!(l.admit(tool("big", big)).unwrap(), None);
        let wide: Map<String, Value> = (0..13_000)
            .map(|i| (format!("p{i}"), json!({"type": 0})))
            .collect();
        let wide = json!({"type": "object", "properties": wide});
        assert!(json_len(&wide) < MAX_SCHEMA_BYTES);
        assert_eq!(l.admit(tool("wide", wide)).unwrap(), None);
        let long = json!({"name": "long", "description": "é".repeat(MAX_DESCRIPTION_BYTES)});
        let kept = l.admit(long).unwrap().unwrap();
        let d = kept["description"].as_str().unwrap();
        assert!(d.len() <= MAX_DESCRIPTION_BYTES + 3 && d.ends_with('…'));
        let Value::String(d) = &kept["description"] else {
            unreachable!()
        };
        assert!(
            d.capacity() < MAX_DESCRIPTION_BYTES + 8,
            "the buffer goes too"
        );
        let why: Vec<(&str, &str)> = l
            .left_out
            .named
            .iter()
            .map(|(n, w)| (n.as_str(), w.as_str()))
            .collect();
        assert_eq!(
            why,
            [
                ("s__ok", "the server lists it twice (the first is offered)"),
                ("s__bad name", "its name has white space in it"),
                ("s__?", "its name is missing or not text"),
                ("s__?", "it is not a JSON object"),
                ("s__d", "its description is not text"),
                (
                    "s__big",
                    "its input schema is 390 KiB; at most 256 KiB is taken"
                ),
                (
                    "s__wide",
                    "its input schema takes about 9 MiB once parsed; at most 8 MiB"
                ),
            ]
        );
    }

    #[test]
    fn left_out_tools_are_named_up_to_a_bound_and_counted_beyond() {
        let mut l = List::new("s");
        for i in 0..100 {
            assert_eq!(l.admit(tool(&format!("bad {i}"), json!({}))).unwrap(), None);
        }
        assert_eq!(l.left_out.named.len(), MAX_LEFT_OUT_NAMED);
        assert_eq!(l.left_out.more, 100 - MAX_LEFT_OUT_NAMED);
        let long = "n".repeat(10_000);
        let mut l = List::new("s");
        l.admit(tool(&long, json!({}))).unwrap();
        // Shown clipped, a little past the longest name that is taken.
        assert_eq!(
            l.left_out.named[0].0,
            format!("s__{}…", &long[..MAX_NAME_BYTES + 32 - 3])
        );
        // Two servers' lists: the second's after the first's, each bounded
        // on its own, the counts added.
        let left_out = |server: &str, n: usize| {
            let mut l = List::new(server);
            for i in 0..n {
                l.admit(tool(&format!("bad {i}"), json!({}))).unwrap();
            }
            l.left_out
        };
        let mut all = left_out("a", MAX_LEFT_OUT_NAMED + 3);
        all.append(left_out("b", MAX_LEFT_OUT_NAMED + 4));
        assert_eq!(all.named.len(), 2 * MAX_LEFT_OUT_NAMED);
        assert_eq!(all.named[0].0, "a__bad 0");
        assert_eq!(all.named[MAX_LEFT_OUT_NAMED].0, "b__bad 0");
        assert_eq!(all.more, 7);
    }

    #[test]
    fn a_list_over_its_total_is_refused() {
        let mut l = List::new("s");
        let pad = "x".repeat(200 << 10);
        let (n, e) = kept_until_refused(&mut l, &json!({"type": "object", "description": pad}));
        assert_eq!(n, MAX_LIST_BYTES / (200 << 10));
        assert!(
            e.contains("more than 8 MiB of text or 32 MiB once parsed"),
            "{e}"
        );
    }

    /// Tools of `schema` admitted one after another: how many are kept before
    /// the list is refused, and why (at most 1000 are tried).
    fn kept_until_refused(l: &mut List, schema: &Value) -> (usize, String) {
        for n in 0..1000 {
            match l.admit(tool(&format!("t{n}"), schema.clone())) {
                Ok(Some(_)) => {}
                Ok(None) => panic!("left out: {:?}", l.left_out),
                Err(e) => return (n, e),
            }
        }
        panic!("1000 tools kept: the list's bounds were never reached")
    }

    /// An object schema of `n` properties of schema `each`: small as text,
    /// some 30 times that parsed.
    fn wide_of(n: usize, each: &Value) -> Value {
        let props: Map<String, Value> = (0..n).map(|i| (format!("p{i}"), each.clone())).collect();
        json!({"type": "object", "properties": props})
    }

    fn wide(n: usize) -> Value {
        wide_of(n, &json!({"type": "integer"}))
    }

    #[test]
    fn a_list_over_its_parsed_total_is_refused_though_its_text_is_small() {
        let schema = wide(9000);
        assert!(json_len(&schema) <= MAX_SCHEMA_BYTES);
        assert!(parsed_size(&schema) <= MAX_SCHEMA_PARSED);
        let mut l = List::new("s");
        let (n, e) = kept_until_refused(&mut l, &schema);
        assert_eq!(
            n,
            MAX_LIST_PARSED / parsed_size(&tool("t0", schema.clone()))
        );
        assert!(n * json_len(&schema) < MAX_LIST_BYTES / 4, "not its text");
        assert!(e.contains("32 MiB once parsed"), "{e}");
    }

    #[test]
    fn a_schema_at_its_bounds_is_kept_one_past_them_is_left_out() {
        // As text: MAX_SCHEMA_BYTES exactly.
        let text = |len: usize| {
            let mut s = json!({"type": "object", "description": ""});
            let pad = len - json_len(&s);
            s["description"] = json!("x".repeat(pad));
            assert_eq!(json_len(&s), len);
            s
        };
        let mut l = List::new("s");
        assert!(l
            .admit(tool("a", text(MAX_SCHEMA_BYTES)))
            .unwrap()
            .is_some());
        assert_eq!(
            l.admit(tool("b", text(MAX_SCHEMA_BYTES + 1))).unwrap(),
            None
        );
        // Parsed: MAX_SCHEMA_PARSED exactly.
        let parsed = |len: usize| {
            let s = weighing(len);
            assert!(json_len(&s) <= MAX_SCHEMA_BYTES);
            s
        };
        let mut l = List::new("s");
        assert!(l
            .admit(tool("c", parsed(MAX_SCHEMA_PARSED)))
            .unwrap()
            .is_some());
        assert_eq!(
            l.admit(tool("d", parsed(MAX_SCHEMA_PARSED + 1))).unwrap(),
            None
        );
        assert!(
            l.left_out.named[0].1.contains("once parsed"),
            "{:?}",
            l.left_out
        );
    }

    /// A schema that weighs exactly `parsed` (`parsed_size`): properties of
    /// one map node each (`{"not": {}}`, 10 bytes of text), and a description
    /// making up the rest.
    fn weighing(parsed: usize) -> Value {
        let each = json!({"not": {}});
        let of = |n: usize| {
            let mut schema = wide_of(n, &each);
            schema["description"] = json!("");
            schema
        };
        let per = (parsed_size(&of(2000)) - parsed_size(&of(1000))) / 1000;
        let mut n = (parsed - parsed_size(&of(0))) / per;
        let mut schema = of(n);
        while parsed_size(&schema) > parsed {
            n -= (parsed_size(&schema) - parsed).div_ceil(per);
            schema = of(n);
        }
        schema["description"] = json!("x".repeat(parsed - parsed_size(&schema)));
        assert_eq!(parsed_size(&schema), parsed);
        schema
    }

    #[test]
    fn a_list_at_its_totals_is_kept_one_tool_more_is_refused() {
        // Text: 64 tools of MAX_LIST_BYTES / 64 each.
        let per = MAX_LIST_BYTES / 64;
        let sized = |n: usize| {
            let name = format!("t{n:03}");
            let empty = json_len(&tool(&name, json!({"type": "object", "description": ""})));
            let t = tool(
                &name,
                json!({"type": "object", "description": "x".repeat(per - empty)}),
            );
            assert_eq!(json_len(&t), per);
            t
        };
        let mut l = List::new("s");
        for n in 0..64 {
            assert!(l.admit(sized(n)).unwrap().is_some(), "{n}");
        }
        assert!(l.admit(tool("t064", json!({}))).is_err());
        // Parsed: 4 tools of MAX_LIST_PARSED / 4 each.
        let mut l = List::new("s");
        let overhead = parsed_size(&tool("t0", json!({}))) - parsed_size(&json!({}));
        let schema = weighing(MAX_LIST_PARSED / 4 - overhead);
        assert!(json_len(&schema) <= MAX_SCHEMA_BYTES);
        for n in 0..4 {
            let t = tool(&format!("t{n}"), schema.clone());
            assert_eq!(parsed_size(&t), MAX_LIST_PARSED / 4);
            assert!(l.admit(t).unwrap().is_some(), "{n}");
        }
        assert!(l.admit(tool("t4", json!({}))).is_err());
    }
}
