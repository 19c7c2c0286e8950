//! Grammars a client can build to overflow the compiler's stack, over real HTTP on a tiny model:
//! refused by name before compiling (`src/engine/grammar_bounds.rs`) while other clients are
//! served; grammars at the bounds compile and are followed; random nested ones never take the
//! server down.

mod common;

use common::server::*;
use serde_json::{json, Value};

/// A JSON Schema whose `$ref`s chain `n` deep (each definition names the next).
fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        let d = if i + 1 < n {
            json!({"type": "object", "properties": {"x": {"$ref": format!("#/$defs/d{}", i + 1)}},
                   "required": ["x"], "additionalProperties": false})
        } else {
            json!({"type": "integer", "minimum": 0, "maximum": 9})
        };
        defs.insert(format!("d{i}"), d);
    }
    json!({"$defs": defs, "$ref": "#/$defs/d0"})
}

/// A Lark grammar whose rules chain `n` deep (each rule names the next).
fn rule_chain(n: usize, terminals: bool) -> String {
    let name = |i: usize| {
        if terminals {
            format!("T{i}")
        } else {
            format!("r{i}")
        }
    };
    let mut g = format!("start: {}\n", name(0));
    for i in 0..n {
        g += &format!("{}: \"a\" {}\n", name(i), name(i + 1));
    }
    g + &format!("{}: \"b\"\n", name(n))
}

/// Grammars built to overflow the compiler's stack (a `$ref` chain 700 deep, array items 1000
/// deep, Lark rules and terminals 700 deep, brackets 5000 deep) are refused with a 400 naming the
/// field and the limit, while another client's request is served beside them; grammars at the
/// bounds compile and generate.
#[test]
fn grammars_too_deep_to_compile_are_refused_and_the_server_lives_on() {
    let (_d, s) = start_wide();
    let mut items = json!({"type": "integer"});
    for _ in 0..1000 {
        items = json!({"type": "array", "items": items, "maxItems": 1});
    }
    // Array items nested through $refs (serde_json reads at most 128 levels of literal nesting).
    let mut defs = serde_json::Map::new();
    for i in 0..1000 {
        defs.insert(
            format!("a{i}"),
            json!({"type": "array", "maxItems": 1, "items": {"$ref": format!("#/$defs/a{}", i + 1)}}),
        );
    }
    defs.insert("a1000".into(), json!({"type": "integer"}));
    let array_refs = json!({"$defs": defs, "$ref": "#/$defs/a0"});
    let fmt = |schema: Value| json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}});
    let deep_parens = format!("start: {}\"a\"{}\n", "(".repeat(5000), ")".repeat(5000));
    let cases = [
        (fmt(ref_chain(700)), "response_format"),
        (fmt(array_refs), "response_format"),
        (
            json!({"structured_outputs": {"grammar": rule_chain(700, false)}}),
            "structured_outputs.grammar",
        ),
        (
            json!({"guided_grammar": rule_chain(700, true)}),
            "guided_grammar",
        ),
        (json!({"guided_grammar": deep_parens}), "guided_grammar"),
        (
            json!({"guided_regex": format!("{}a{}", "(".repeat(3000), ")".repeat(3000))}),
            "guided_regex",
        ),
    ];
    // Another client's plain chat runs all along.
    let other = {
        let c = s.client.clone();
        std::thread::spawn(move || {
            for _ in 0..10 {
                let r = c.post(
                    "/v1/chat/completions",
                    &chat("hi", json!({"max_tokens": 4})),
                );
                assert_eq!(r.status, 200, "{}", r.body_text());
            }
        })
    };
    for (extra, param) in cases {
        let r = s.post("/v1/chat/completions", &chat("x", extra));
        let e = assert_error(&r, 400, Some(param));
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains("128") || msg.contains("bytes"), "{msg}");
    }
    // Literal nesting past what the JSON reader takes is refused too (its own limit).
    let r = s.post("/v1/chat/completions", &chat("x", fmt(items)));
    assert!(r.status == 400, "{}", r.body_text());
    other.join().unwrap();
    // At the bounds: compiled and followed.
    for (extra, want) in [
        (fmt(ref_chain(40)), None),
        (
            json!({"guided_grammar": rule_chain(120, false)}),
            Some(format!("{}b", "a".repeat(120))),
        ),
        (
            json!({"guided_grammar": rule_chain(120, true)}),
            Some(format!("{}b", "a".repeat(120))),
        ),
    ] {
        let mut b = chat("x", extra);
        b["max_tokens"] = json!(400);
        let text = content_of(&s, &b);
        match want {
            Some(w) => assert_eq!(text, w),
            None => assert!(text.starts_with("{\"x\": {\"x\": "), "{text}"),
        }
    }
    assert_eq!(s.get("/health").status, 200);
}

/// Random grammars of every kind, nested at random up to past the bounds: each request is
/// answered (200 or a 400 naming its field), and the server never goes down.
#[test]
fn random_nested_grammars_never_take_the_server_down() {
    let (_d, s) = start_wide();
    let mut rng = common::Rng(0x5eed_1234);
    for i in 0..60 {
        let depth = 1 + (rng.next() % 300) as usize;
        let extra = match i % 5 {
            0 => json!({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": ref_chain(depth)}}}),
            1 => json!({"guided_grammar": rule_chain(depth, rng.next().is_multiple_of(2))}),
            2 => {
                json!({"guided_regex": format!("{}[a-c]{}", "(".repeat(depth), ")".repeat(depth))})
            }
            3 => {
                // Mixed brackets, groups and alternatives.
                let mut g = String::from("start: ");
                for k in 0..depth {
                    g += ["(", "[", "(\"x\" | "][k % 3];
                }
                g += "\"z\"";
                for k in (0..depth).rev() {
                    g += [")", "]", ")"][k % 3];
                }
                json!({"guided_grammar": g + "\n"})
            }
            _ => {
                let mut schema = json!({"type": "integer"});
                for _ in 0..depth.min(60) {
                    schema = json!({"anyOf": [{"type": "null"}, {"type": "array", "items": schema, "maxItems": 1}]});
                }
                json!({"structured_outputs": {"json": schema}})
            }
        };
        let mut b = chat("x", extra);
        b["max_tokens"] = json!(16);
        let r = s.post("/v1/chat/completions", &b);
        assert!(
            r.status == 200 || r.status == 400,
            "case {i} (depth {depth}): {} {}",
            r.status,
            r.body_text()
        );
        assert_eq!(s.get("/health").status, 200, "case {i}");
    }
}
