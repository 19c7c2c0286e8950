//! JSON-Schema validity for the `json_schema` scorer: the keywords schemas for structured outputs
//! use (draft 2020-12's validation vocabulary without references), checked when the evaluation set
//! is configured (`check`: any other keyword is refused, naming it) and applied to an answer
//! (`valid`). Ours rather than a crate's: no dependency does this without pulling an HTTP client
//! for remote references, and constrained decoding's grammar (llguidance) fixes whitespace and
//! closes objects, which would judge a model's plain JSON answer by rules that are not the schema's.

use serde_json::{Map, Value};

/// The keywords understood; annotations (`title`, `description`, `default`, `examples`,
/// `$schema`, `$id`, `format`) are allowed and ignored.
const KEYWORDS: &[&str] = &[
    "type",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "enum",
    "const",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
];
const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "format",
];

/// Check that `schema` uses only keywords `valid` applies (and that its patterns compile); the
/// error names the first that does not, with its path.
pub fn check(schema: &Value) -> Result<(), String> {
    check_at(schema, "$")
}

fn check_at(s: &Value, at: &str) -> Result<(), String> {
    let o = match s {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        _ => return Err(format!("{at} is not a schema (an object or a boolean)")),
    };
    for (k, v) in o {
        if ANNOTATIONS.contains(&k.as_str()) {
            continue;
        }
        if !KEYWORDS.contains(&k.as_str()) {
            return Err(format!(
                "{at}.{k}: this keyword is not supported by the json_schema scorer (supported: {})",
                KEYWORDS.join(", ")
            ));
        }
        let sub = format!("{at}.{k}");
        match k.as_str() {
            "properties" => {
                for (p, ps) in v.as_object().ok_or(format!("{sub} is not an object"))? {
                    check_at(ps, &format!("{sub}.{p}"))?;
                }
            }
            "additionalProperties" | "items" | "not" => check_at(v, &sub)?,
            "anyOf" | "oneOf" | "allOf" => {
                for (i, x) in v
                    .as_array()
                    .ok_or(format!("{sub} is not an array"))?
                    .iter()
                    .enumerate()
                {
                    check_at(x, &format!("{sub}[{i}]"))?;
                }
            }
            "pattern" => {
                let p = v.as_str().ok_or(format!("{sub} is not a string"))?;
                regex::Regex::new(p).map_err(|e| format!("{sub}: {e}"))?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Whether `x` is valid under `schema` (checked by `check`).
pub fn valid(schema: &Value, x: &Value) -> bool {
    let o = match schema {
        Value::Bool(b) => return *b,
        Value::Object(o) => o,
        _ => return false,
    };
    o.iter().all(|(k, v)| keyword(k, v, o, x))
}

fn keyword(k: &str, v: &Value, o: &Map<String, Value>, x: &Value) -> bool {
    let num = |v: &Value| v.as_f64();
    match k {
        "type" => match v {
            Value::String(t) => is_type(t, x),
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).any(|t| is_type(t, x)),
            _ => false,
        },
        "properties" => match (v.as_object(), x.as_object()) {
            (Some(ps), Some(xo)) => ps
                .iter()
                .all(|(p, s)| xo.get(p).is_none_or(|xv| valid(s, xv))),
            _ => true,
        },
        "required" => match x.as_object() {
            Some(xo) => v
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .all(|p| xo.contains_key(p)),
            None => true,
        },
        "additionalProperties" => match x.as_object() {
            Some(xo) => {
                let known = o.get("properties").and_then(Value::as_object);
                xo.iter()
                    .filter(|(p, _)| !known.is_some_and(|k| k.contains_key(*p)))
                    .all(|(_, xv)| valid(v, xv))
            }
            None => true,
        },
        "items" => match x.as_array() {
            Some(a) => a.iter().all(|xv| valid(v, xv)),
            None => true,
        },
        "enum" => v.as_array().is_some_and(|a| a.iter().any(|e| same(e, x))),
        "const" => same(v, x),
        "minimum" => x.as_f64().is_none_or(|n| num(v).is_some_and(|m| n >= m)),
        "maximum" => x.as_f64().is_none_or(|n| num(v).is_some_and(|m| n <= m)),
        "exclusiveMinimum" => x.as_f64().is_none_or(|n| num(v).is_some_and(|m| n > m)),
        "exclusiveMaximum" => x.as_f64().is_none_or(|n| num(v).is_some_and(|m| n < m)),
        "minLength" => x
            .as_str()
            .is_none_or(|s| v.as_u64().is_some_and(|m| s.chars().count() as u64 >= m)),
        "maxLength" => x
            .as_str()
            .is_none_or(|s| v.as_u64().is_some_and(|m| s.chars().count() as u64 <= m)),
        "pattern" => x.as_str().is_none_or(|s| {
            v.as_str()
                .and_then(|p| regex::Regex::new(p).ok())
                .is_some_and(|r| r.is_match(s))
        }),
        "minItems" => x
            .as_array()
            .is_none_or(|a| v.as_u64().is_some_and(|m| a.len() as u64 >= m)),
        "maxItems" => x
            .as_array()
            .is_none_or(|a| v.as_u64().is_some_and(|m| a.len() as u64 <= m)),
        "anyOf" => v.as_array().is_some_and(|a| a.iter().any(|s| valid(s, x))),
        "oneOf" => v
            .as_array()
            .is_some_and(|a| a.iter().filter(|s| valid(s, x)).count() == 1),
        "allOf" => v.as_array().is_some_and(|a| a.iter().all(|s| valid(s, x))),
        "not" => !valid(v, x),
        // Annotations.
        _ => true,
    }
}

fn is_type(t: &str, x: &Value) -> bool {
    match t {
        "object" => x.is_object(),
        "array" => x.is_array(),
        "string" => x.is_string(),
        "boolean" => x.is_boolean(),
        "null" => x.is_null(),
        "number" => x.is_number(),
        // 1.0 is an integer in JSON Schema.
        "integer" => x.as_f64().is_some_and(|n| n.fract() == 0.0),
        _ => false,
    }
}

/// JSON equality with numbers compared by value (1 == 1.0).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The schema of an ordinary tool or structured output: types, required and closed
    /// properties, enums, bounds, patterns and unions, each able to fail.
    #[test]
    fn answers_are_judged_by_the_schema() {
        let s = json!({"type": "object", "properties": {
            "city": {"type": "string", "minLength": 2, "pattern": "^[A-Z]"},
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["city"], "additionalProperties": false});
        check(&s).unwrap();
        let ok = json!({"city": "Paris", "unit": "c", "days": 3.0, "tags": ["a"], "note": null});
        assert!(valid(&s, &ok));
        for bad in [
            json!({"unit": "c"}),
            json!({"city": "paris"}),
            json!({"city": "P"}),
            json!({"city": "Paris", "unit": "k"}),
            json!({"city": "Paris", "days": 8}),
            json!({"city": "Paris", "days": 2.5}),
            json!({"city": "Paris", "tags": ["a", "b", "c"]}),
            json!({"city": "Paris", "tags": [1]}),
            json!({"city": "Paris", "note": 3}),
            json!({"city": "Paris", "extra": 1}),
            json!(["Paris"]),
        ] {
            assert!(!valid(&s, &bad), "{bad}");
        }
        assert!(valid(
            &json!({"oneOf": [{"type": "integer"}, {"type": "string"}]}),
            &json!(1)
        ));
        assert!(!valid(
            &json!({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
            &json!(1)
        ));
        assert!(valid(&json!({"not": {"const": 1}}), &json!(2)));
        assert!(!valid(&json!(false), &json!(2)));
    }

    #[test]
    fn unsupported_keywords_and_bad_patterns_are_named() {
        let e = check(&json!({"properties": {"a": {"$ref": "#/x"}}})).unwrap_err();
        assert!(e.starts_with("$.properties.a.$ref"), "{e}");
        let e = check(&json!({"pattern": "("})).unwrap_err();
        assert!(e.starts_with("$.pattern"), "{e}");
        assert!(check(&json!({"title": "t", "format": "date", "type": "string"})).is_ok());
    }
}
