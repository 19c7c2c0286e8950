//! Bounds a request's grammar must keep before it is compiled: its size and its depth (nesting,
//! `$ref` chains, rule chains). The grammar library compiles (and its lexer later differentiates)
//! by recursion as deep as the grammar, so an unbounded grammar overflows a thread's stack and
//! takes the process down; within these bounds compiling and masking fit with room to spare on
//! the threads that run them (`COMPILE_STACK`, and the engine's mask threads).
//!
//! The checks themselves recurse at most `MAX_DEPTH` deep and visit at most `MAX_VISITS` nodes.

use super::grammar_error::GrammarError;
use serde_json::Value;
use std::collections::HashMap;

/// The largest grammar text (Lark, regex, all choices together) or serialized JSON Schema.
pub const MAX_GRAMMAR_BYTES: usize = 128 << 10;
/// The deepest nesting: JSON levels of a schema (each `$ref` followed counts one more),
/// brackets of a Lark grammar or a regex, a chain of Lark rules each naming the next.
pub const MAX_DEPTH: usize = 128;
/// How many schema nodes (or rules) the depth check may visit: a schema whose references fan out
/// exponentially is refused rather than walked for ever.
pub const MAX_VISITS: usize = 1 << 20;
/// The stack of the thread that compiles grammars (and of the engine's mask threads): a grammar
/// at the bounds above needs a few MB; the rest is margin.
pub const COMPILE_STACK: usize = 64 << 20;

/// A regular expression: its size and group nesting.
pub fn check_regex(rx: &str) -> Result<(), GrammarError> {
    size(rx.len())?;
    nesting(rx, Syntax::Regex)
}

/// A choice of strings: their size together.
pub fn check_choice(list: &[String]) -> Result<(), GrammarError> {
    size(list.iter().map(|s| s.len() + 1).sum())
}

fn size(n: usize) -> Result<(), GrammarError> {
    if n > MAX_GRAMMAR_BYTES {
        return Err(GrammarError::TooLarge {
            bytes: n,
            max: MAX_GRAMMAR_BYTES,
        });
    }
    Ok(())
}

fn too_deep(what: &'static str) -> GrammarError {
    GrammarError::TooDeep {
        what,
        max: MAX_DEPTH,
    }
}

/// A JSON Schema: its size, and its depth with every local `$ref` followed.
pub fn check_schema(schema: &Value) -> Result<(), GrammarError> {
    size(serde_json::to_string(schema).map(|s| s.len()).unwrap_or(0))?;
    let mut walk = SchemaWalk {
        root: schema,
        visits: 0,
        on_path: Vec::new(),
    };
    walk.visit(schema, 1)
}

struct SchemaWalk<'a> {
    root: &'a Value,
    visits: usize,
    /// The `$ref`s being followed (a reference back to one of them is recursion, which the
    /// grammar library compiles lazily, not deeper).
    on_path: Vec<&'a str>,
}

impl<'a> SchemaWalk<'a> {
    fn visit(&mut self, v: &'a Value, depth: usize) -> Result<(), GrammarError> {
        if depth > MAX_DEPTH {
            return Err(too_deep("the JSON Schema (with its $refs followed)"));
        }
        self.visits += 1;
        if self.visits > MAX_VISITS {
            return Err(GrammarError::SchemaTooWide { max: MAX_VISITS });
        }
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    if let Some(target) = self.resolve(r) {
                        if !self.on_path.contains(&r.as_str()) {
                            self.on_path.push(r);
                            let x = self.visit(target, depth + 1);
                            self.on_path.pop();
                            x?;
                        }
                    }
                }
                for x in o.values() {
                    self.visit(x, depth + 1)?;
                }
            }
            Value::Array(a) => {
                for x in a {
                    self.visit(x, depth + 1)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A local reference (`#`, `#/$defs/x`, `#/definitions/x/properties/y`); others are the
    /// library's to refuse.
    fn resolve(&self, r: &str) -> Option<&'a Value> {
        let p = r.strip_prefix('#')?;
        if p.is_empty() {
            return Some(self.root);
        }
        let p = percent_decode(p);
        self.root.pointer(&p)
    }
}

/// `%25`-style escapes in a JSON pointer inside a URI fragment.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(x) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(x);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Clone, Copy, PartialEq)]
enum Syntax {
    Regex,
    Lark,
}

/// Bracket nesting (`(`, `[`, `{`) outside string literals, regex literals (Lark) and escapes.
fn nesting(text: &str, syntax: Syntax) -> Result<(), GrammarError> {
    let what = match syntax {
        Syntax::Regex => "the regular expression",
        Syntax::Lark => "the grammar",
    };
    let mut depth = 0usize;
    let mut chars = text.chars().peekable();
    let mut in_class = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            _ if syntax == Syntax::Regex && in_class => in_class = c != ']',
            '[' if syntax == Syntax::Regex => in_class = true,
            '"' | '\'' if syntax == Syntax::Lark => skip_literal(&mut chars, c),
            '/' if syntax == Syntax::Lark => {
                if chars.peek() == Some(&'/') {
                    // A comment, to the end of the line.
                    for c in chars.by_ref() {
                        if c == '\n' {
                            break;
                        }
                    }
                } else {
                    // A regex literal: its own nesting is the regex's.
                    let mut rx = String::new();
                    while let Some(c) = chars.next() {
                        match c {
                            '\\' => {
                                rx.push(c);
                                if let Some(n) = chars.next() {
                                    rx.push(n);
                                }
                            }
                            '/' | '\n' => break,
                            _ => rx.push(c),
                        }
                    }
                    nesting(&rx, Syntax::Regex)?;
                }
            }
            '(' | '[' | '{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(too_deep(what));
                }
            }
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

fn skip_literal(chars: &mut std::iter::Peekable<std::str::Chars>, quote: char) {
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '\n' => return,
            _ if c == quote => return,
            _ => {}
        }
    }
}

/// A Lark grammar: its size, bracket nesting, the longest chain of rules each naming the next
/// (a rule named again on its own chain is recursion, compiled lazily), and every embedded
/// `%json` schema.
pub fn check_lark(g: &str) -> Result<(), GrammarError> {
    size(g.len())?;
    nesting(g, Syntax::Lark)?;
    for schema in embedded_json(g) {
        check_schema(&schema)?;
    }
    let rules = lark_rules(g);
    let mut memo: HashMap<&str, usize> = HashMap::new();
    let mut on_path: Vec<&str> = Vec::new();
    let mut visits = 0usize;
    for name in rules.keys() {
        chain(name, &rules, &mut memo, &mut on_path, &mut visits, 1)?;
    }
    Ok(())
}

/// The longest chain below `name` (memoized once complete; a rule on the path ends the chain).
fn chain<'a>(
    name: &'a str,
    rules: &HashMap<&'a str, Vec<&'a str>>,
    memo: &mut HashMap<&'a str, usize>,
    on_path: &mut Vec<&'a str>,
    visits: &mut usize,
    depth: usize,
) -> Result<usize, GrammarError> {
    if depth > MAX_DEPTH {
        return Err(too_deep("a chain of the grammar's rules"));
    }
    if let Some(&d) = memo.get(name) {
        if depth + d > MAX_DEPTH {
            return Err(too_deep("a chain of the grammar's rules"));
        }
        return Ok(d);
    }
    *visits += 1;
    if *visits > MAX_VISITS {
        return Err(GrammarError::RulesTooWide { max: MAX_VISITS });
    }
    on_path.push(name);
    let mut below = 0;
    for &r in rules.get(name).map(|v| v.as_slice()).unwrap_or(&[]) {
        if on_path.contains(&r) || !rules.contains_key(r) {
            continue;
        }
        below = below.max(1 + chain(r, rules, memo, on_path, visits, depth + 1)?);
    }
    on_path.pop();
    memo.insert(name, below);
    Ok(below)
}

/// Each rule or terminal definition's name with the names its body uses (identifiers outside
/// literals, regexes and comments). A definition starts a line: `name`, `?name`, `!name`, an
/// optional `.priority` or `{params}`, then `:`; other lines continue the one before.
fn lark_rules(g: &str) -> HashMap<&str, Vec<&str>> {
    let mut rules: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut current: Option<&str> = None;
    for line in g.lines() {
        let t = line.trim_start();
        if t.starts_with('%') {
            current = None;
            continue;
        }
        let mut body = t;
        if let Some((name, rest)) = definition(t) {
            rules.entry(name).or_default();
            current = Some(name);
            body = rest;
        }
        if let Some(name) = current {
            let refs = identifiers(body);
            rules.entry(name).or_default().extend(refs);
        }
    }
    rules
}

fn definition(t: &str) -> Option<(&str, &str)> {
    let s = t.trim_start_matches(['?', '!']);
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    let (name, mut rest) = s.split_at(end);
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    rest = rest.trim_start();
    if let Some(r) = rest.strip_prefix('.') {
        rest = r.trim_start_matches(|c: char| c == '-' || c.is_ascii_digit());
    } else if rest.starts_with('{') {
        rest = &rest[rest.find('}')? + 1..];
    }
    rest = rest.trim_start();
    let body = rest.strip_prefix(':')?;
    Some((name, body))
}

fn identifiers(body: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            q @ (b'"' | b'\'' | b'/') => {
                if q == b'/' && b.get(i + 1) == Some(&b'/') {
                    break;
                }
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                out.push(&body[start..i]);
            }
            _ => i += 1,
        }
    }
    out
}

/// The schemas written after `%json` in a Lark grammar (those that parse; the library refuses the
/// rest).
fn embedded_json(g: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut rest = g;
    while let Some(i) = rest.find("%json") {
        rest = &rest[i + 5..];
        let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        if let Some(Ok(v)) = it.next() {
            out.push(v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let next = if i + 1 < n {
                json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/d{}", i + 1)}}})
            } else {
                json!({"type": "string"})
            };
            defs.insert(format!("d{i}"), next);
        }
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn a_schema_whose_refs_chain_deep_is_refused_and_a_shallow_one_passes() {
        assert!(check_schema(&ref_chain(10)).is_ok());
        let e = check_schema(&ref_chain(700)).unwrap_err().to_string();
        assert!(e.contains("128"), "{e}");
    }

    #[test]
    fn recursive_and_shared_refs_are_not_depth() {
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"});
        assert!(check_schema(&tree).is_ok());
        let mut props = serde_json::Map::new();
        for i in 0..50 {
            props.insert(format!("p{i}"), json!({"$ref": "#/$defs/addr"}));
        }
        let shared = json!({"$defs": {"addr": {"type": "object", "properties": {
            "street": {"type": "string"}}}}, "type": "object", "properties": props});
        assert!(check_schema(&shared).is_ok());
    }

    #[test]
    fn exponential_fan_out_is_refused() {
        let mut defs = serde_json::Map::new();
        for i in 0..40 {
            defs.insert(
                format!("d{i}"),
                json!({"anyOf": [{"$ref": format!("#/$defs/d{}", i + 1)},
                                 {"$ref": format!("#/$defs/d{}", i + 1)}]}),
            );
        }
        defs.insert("d40".into(), json!({"type": "null"}));
        let e = check_schema(&json!({"$defs": defs, "$ref": "#/$defs/d0"}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("simplify"), "{e}");
    }

    #[test]
    fn lark_rule_chains_and_brackets_are_bounded() {
        let chain = |n: usize| {
            let mut g = String::from("start: r0\n");
            for i in 0..n {
                g += &format!("r{i}: \"a\" r{}\n", i + 1);
            }
            g + &format!("r{n}: \"b\"\n")
        };
        assert!(check_lark(&chain(50)).is_ok());
        let e = check_lark(&chain(700)).unwrap_err().to_string();
        assert!(e.contains("rules"), "{e}");
        // Recursion is not depth.
        let rec = "start: expr\nexpr: term | expr \"+\" term\nterm: \"1\" | \"(\" expr \")\"\n";
        assert!(check_lark(rec).is_ok());
        let parens = format!("start: {}\"a\"{}\n", "(".repeat(300), ")".repeat(300));
        assert!(check_lark(&parens).is_err());
        // Brackets inside literals and regexes' own nesting.
        let lit = format!("start: \"{}\"\n", "(".repeat(300));
        assert!(check_lark(&lit).is_ok());
        let rx = format!("start: /{}a{}/\n", "(".repeat(300), ")".repeat(300));
        assert!(check_lark(&rx).is_err());
        let json = format!(
            "start: %json {}\n",
            serde_json::to_string(&ref_chain(300)).unwrap()
        );
        assert!(check_lark(&json).is_err());
    }

    #[test]
    fn terminal_chains_and_priorities_are_rules_too() {
        let mut g = String::from("start: T0\n");
        for i in 0..200 {
            g += &format!("T{i}.2: \"a\" T{}\n", i + 1);
        }
        g += "T200: \"b\"\n";
        assert!(check_lark(&g).is_err());
    }

    #[test]
    fn regexes_and_sizes_are_bounded() {
        let deep = format!("{}a{}", "(".repeat(200), ")".repeat(200));
        assert!(check_regex(&deep).is_err());
        assert!(check_regex(&"[(((((((]+".repeat(100)).is_ok());
        let big = "a".repeat(MAX_GRAMMAR_BYTES + 1);
        assert!(check_regex(&big).unwrap_err().to_string().contains("bytes"));
        assert!(check_choice(&["x".repeat(MAX_GRAMMAR_BYTES)]).is_err());
    }
}
