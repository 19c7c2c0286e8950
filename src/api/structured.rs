//! Structured outputs: which grammar a request's output must follow, from OpenAI's
//! `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`,
//! `regex`, `choice`, `grammar`, `json_object`) or its older `guided_*` fields. At most one may
//! be given; each bad or unsupported value is a 400 naming its field. Output JSON is compact
//! (see `GrammarSpec::Json`).

use super::error::ApiError;
use super::openai::{type_error, Fields};
use crate::engine::constraint::GrammarSpec;
use serde_json::{json, Value};

/// A request's grammar and the field it came from (named in compile errors).
#[derive(Debug, PartialEq)]
pub struct Structured {
    pub field: String,
    pub spec: GrammarSpec,
}

/// The one grammar a request's output follows: its structured-output field, or its tools'
/// (forced calls, the generic format); both at once is a 400. `ignore_eos` is refused beside a
/// grammar (a grammar that is complete ends the answer).
pub fn output_grammar(
    f: &Fields,
    tools: Option<Structured>,
) -> Result<Option<Structured>, ApiError> {
    let structured = parse_structured(f)?;
    let out = match (structured, tools) {
        (Some(s), Some(t)) => {
            return Err(ApiError::invalid(
                &s.field,
                format!(
                    "'{}' cannot be combined with '{}' here: the tool calls already constrain \
                     the answer",
                    s.field, t.field
                ),
            ))
        }
        (s, t) => s.or(t),
    };
    if out.is_some() && f.bool("ignore_eos")? == Some(true) {
        return Err(ApiError::invalid(
            "ignore_eos",
            "'ignore_eos' cannot be used with constrained output (structured outputs, forced or \
             generic tool calls)",
        ));
    }
    Ok(out)
}

/// The request's structured-output constraint, if any.
pub fn parse_structured(f: &Fields) -> Result<Option<Structured>, ApiError> {
    let mut found: Vec<Structured> = Vec::new();
    if let Some(v) = f.get("response_format") {
        found.extend(response_format(v)?);
    }
    if let Some(v) = f.get("structured_outputs") {
        found.extend(structured_outputs("structured_outputs", v)?);
    }
    // vLLM's older names.
    for (name, key) in [
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ] {
        if let Some(v) = f.get(name) {
            found.push(one(name, key, v)?);
        }
    }
    if let Some(v) = f.get("guided_decoding_backend") {
        match v.as_str() {
            Some("auto" | "guidance" | "llguidance") => {}
            _ => {
                return Err(ApiError::invalid(
                    "guided_decoding_backend",
                    format!(
                        "'guided_decoding_backend' = {v}: this server's one backend is \
                         llguidance ('auto', 'guidance' or 'llguidance')"
                    ),
                ))
            }
        }
    }
    if f.get("guided_whitespace_pattern").is_some() {
        return Err(whitespace_refused("guided_whitespace_pattern"));
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            &found[1].field,
            format!(
                "give one output constraint: '{}' and '{}' are both set",
                found[0].field, found[1].field
            ),
        ));
    }
    Ok(found.pop())
}

fn whitespace_refused(name: &str) -> ApiError {
    ApiError::invalid(
        name,
        format!(
            "'{name}' is not supported: JSON output is always compact (no newlines, one space \
             after ',' and ':')"
        ),
    )
}

/// OpenAI's `response_format`: `text`, `json_object`, or `json_schema` with `{name, schema,
/// strict?, description?}` (the schema is always enforced; `strict` only checked as a boolean).
fn response_format(v: &Value) -> Result<Option<Structured>, ApiError> {
    let field = "response_format";
    let t = v
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| type_error(field, "an object with a 'type'"))?;
    let spec =
        match t {
            "text" => return Ok(None),
            "json_object" => GrammarSpec::Json(json!({"type": "object"})),
            "json_schema" => {
                let js = v
                    .get("json_schema")
                    .filter(|j| j.is_object())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "response_format.json_schema",
                            "'response_format.json_schema' must be an object with 'name' and \
                         'schema'",
                        )
                    })?;
                match js.get("strict") {
                    None | Some(Value::Null | Value::Bool(_)) => {}
                    Some(_) => {
                        return Err(type_error(
                            "response_format.json_schema.strict",
                            "a boolean",
                        ))
                    }
                }
                match js.get("schema") {
                    None | Some(Value::Null) => GrammarSpec::Json(json!({"type": "object"})),
                    Some(s @ Value::Object(_)) => GrammarSpec::Json(s.clone()),
                    Some(_) => {
                        return Err(type_error(
                            "response_format.json_schema.schema",
                            "a JSON Schema object",
                        ))
                    }
                }
            }
            "structural_tag" => return Err(ApiError::invalid(
                field,
                "'response_format' of type 'structural_tag' is not supported; use 'json_schema' \
                 or tools",
            )),
            other => {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "'response_format.type' is '{other}'; it must be 'text', 'json_object' or \
                     'json_schema'"
                    ),
                ))
            }
        };
    Ok(Some(Structured {
        field: field.into(),
        spec,
    }))
}

/// vLLM's `structured_outputs` object: one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`; its options `disable_fallback` (there is no fallback) and
/// `disable_any_whitespace` (JSON is always compact) are accepted as booleans.
fn structured_outputs(name: &str, v: &Value) -> Result<Option<Structured>, ApiError> {
    let o = v.as_object().ok_or_else(|| type_error(name, "an object"))?;
    let mut found = Vec::new();
    for (k, val) in o {
        if val.is_null() {
            continue;
        }
        let field = format!("{name}.{k}");
        match k.as_str() {
            "json" | "regex" | "choice" | "grammar" => found.push(one(&field, k, val)?),
            "json_object" => match val {
                Value::Bool(true) => found.push(Structured {
                    field,
                    spec: GrammarSpec::Json(json!({"type": "object"})),
                }),
                Value::Bool(false) => {}
                _ => return Err(type_error(&field, "a boolean")),
            },
            "disable_fallback" | "disable_any_whitespace" => {
                if !val.is_boolean() {
                    return Err(type_error(&field, "a boolean"));
                }
            }
            "disable_additional_properties" => {
                // Objects with listed properties are closed unless the schema says otherwise
                // (`constraint::close_objects`): true is what this server does; false (the
                // guidance backend's open objects) is not offered.
                if val != &Value::Bool(true) {
                    return Err(ApiError::invalid(
                        &field,
                        format!(
                            "'{field}': only true is supported (an object with properties admits \
                             only those unless its schema says \"additionalProperties\": true \
                             or a schema; write that to allow more)"
                        ),
                    ));
                }
            }
            "whitespace_pattern" => return Err(whitespace_refused(&field)),
            _ => {
                return Err(ApiError::invalid(
                    &field,
                    format!(
                    "'{field}' is not supported (one of json, regex, choice, grammar, json_object)"
                ),
                ))
            }
        }
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            name,
            format!("'{name}' takes one of json, regex, choice, grammar, json_object"),
        ));
    }
    Ok(found.pop())
}

/// One constraint of kind `key` (json: a schema object or its JSON text; regex and grammar:
/// strings; choice: a non-empty list of strings).
fn one(field: &str, key: &str, v: &Value) -> Result<Structured, ApiError> {
    let spec = match key {
        "json" => match v {
            Value::Object(_) => GrammarSpec::Json(v.clone()),
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(o @ Value::Object(_)) => GrammarSpec::Json(o),
                _ => {
                    return Err(type_error(
                        field,
                        "a JSON Schema (an object or its JSON text)",
                    ))
                }
            },
            _ => {
                return Err(type_error(
                    field,
                    "a JSON Schema (an object or its JSON text)",
                ))
            }
        },
        "regex" => GrammarSpec::Regex(
            v.as_str()
                .ok_or_else(|| type_error(field, "a string"))?
                .to_string(),
        ),
        "grammar" => GrammarSpec::Lark(
            v.as_str()
                .ok_or_else(|| type_error(field, "a string (a Lark grammar)"))?
                .to_string(),
        ),
        "choice" => {
            let list = v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|x| x.as_str().map(str::to_string))
                        .collect::<Option<Vec<_>>>()
                })
                .filter(|l| !l.is_empty())
                .ok_or_else(|| type_error(field, "a non-empty list of strings"))?;
            GrammarSpec::Choice(list)
        }
        _ => unreachable!("constraint kinds are listed by the callers"),
    };
    Ok(Structured {
        field: field.into(),
        spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<Option<Structured>, ApiError> {
        parse_structured(&Fields::parse(&v).unwrap())
    }

    #[test]
    fn each_spelling_gives_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
                GrammarSpec::Json(json!({"type": "object"})),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                "response_format",
                GrammarSpec::Json(schema.clone()),
            ),
            (
                json!({"structured_outputs": {"regex": "[0-9]+"}}),
                "structured_outputs.regex",
                GrammarSpec::Regex("[0-9]+".into()),
            ),
            (
                json!({"structured_outputs": {"choice": ["a", "b"]}}),
                "structured_outputs.choice",
                GrammarSpec::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                json!({"structured_outputs": {"json": schema.to_string()}}),
                "structured_outputs.json",
                GrammarSpec::Json(schema.clone()),
            ),
            (
                json!({"guided_json": schema}),
                "guided_json",
                GrammarSpec::Json(schema.clone()),
            ),
            (
                json!({"guided_grammar": "start: \"x\""}),
                "guided_grammar",
                GrammarSpec::Lark("start: \"x\"".into()),
            ),
        ];
        for (body, field, spec) in cases {
            let s = parse(body.clone()).unwrap().unwrap();
            assert_eq!((s.field.as_str(), &s.spec), (field, &spec), "{body}");
        }
        assert_eq!(
            parse(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(parse(json!({})).unwrap(), None);
    }

    #[test]
    fn bad_or_unsupported_values_name_their_field() {
        for (body, field) in [
            (
                json!({"response_format": {"type": "bogus"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"structured_outputs": {"choice": []}}),
                "structured_outputs.choice",
            ),
            (
                json!({"structured_outputs": {"whitespace_pattern": " "}}),
                "structured_outputs.whitespace_pattern",
            ),
            (
                json!({"structured_outputs": {"nope": 1}}),
                "structured_outputs.nope",
            ),
            (json!({"guided_regex": 5}), "guided_regex"),
            (
                json!({"guided_decoding_backend": "outlines"}),
                "guided_decoding_backend",
            ),
            (
                json!({"guided_whitespace_pattern": " "}),
                "guided_whitespace_pattern",
            ),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
        ] {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}");
        }
    }
}
