use super::*;
use serde_json::json;

fn raw(scorer: &str, extra: Value) -> RawEvalItem {
    let mut v = json!({"messages": [{"role": "user", "content": "Capital of France?"}],
                       "scorer": scorer});
    v.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    serde_json::from_value(v).unwrap()
}

fn answer(text: &str) -> Answer {
    Answer {
        text: text.into(),
        tool_calls: vec![],
        completion_tokens: 5,
    }
}

/// Each scorer gives 1 to an answer that meets it and 0 to one that does not.
#[test]
fn each_scorer_tells_a_good_answer_from_a_bad_one() {
    let cases: Vec<(RawEvalItem, Answer, Answer)> = vec![
        (
            raw("exact", json!({"reference": "Paris"})),
            answer(" Paris\n"),
            answer("Paris."),
        ),
        (
            raw(
                "contains",
                json!({"reference": "paris", "ignore_case": true}),
            ),
            answer("It is PARIS."),
            answer("Lyon"),
        ),
        (
            raw("contains", json!({"reference": "paris"})),
            answer("paris!"),
            answer("Paris"),
        ),
        (
            raw("regex", json!({"pattern": "^P[a-z]+s$"})),
            answer("Paris"),
            answer("Paris!"),
        ),
        (
            raw(
                "json_schema",
                json!({"schema": {"type": "object", "required": ["a"]}}),
            ),
            answer("Here:\n```json\n{\"a\": 1}\n```"),
            answer("{\"b\": 1}"),
        ),
        (
            raw("length", json!({"max_tokens": 5})),
            answer("short"),
            Answer {
                completion_tokens: 6,
                ..answer("long")
            },
        ),
        (
            raw(
                "tool_call",
                json!({"name": "weather", "arguments": {"city": "Paris"},
                       "tools": [{"type": "function", "function": {"name": "weather"}}]}),
            ),
            Answer {
                tool_calls: vec![("weather".into(), json!({"city": "Paris", "unit": "c"}))],
                ..answer("")
            },
            Answer {
                tool_calls: vec![("weather".into(), json!({"city": "Lyon"}))],
                ..answer("")
            },
        ),
    ];
    for (r, good, bad) in cases {
        let set = EvalSet::new(vec![r.clone()], 8).unwrap();
        let s = &set.items[0].scorer;
        assert_eq!(score(s, &good), 1.0, "{r:?}");
        assert_eq!(score(s, &bad), 0.0, "{r:?}");
    }
}

#[test]
fn a_judges_first_number_is_its_mark() {
    assert_eq!(judge_mark("Score: 7/10", 10.0), 0.7);
    assert_eq!(judge_mark("8.5 out of 10.", 10.0), 0.85);
    assert_eq!(judge_mark("12", 10.0), 1.0);
    assert_eq!(judge_mark("no idea", 10.0), 0.0);
}

/// Items name what is wrong with them: a missing field, a field of another scorer, an
/// unknown scorer, a bad pattern or schema.
#[test]
fn items_are_validated_with_their_field_named() {
    let bad = [
        (raw("exact", json!({})), "[0].reference"),
        (
            raw("exact", json!({"reference": "a", "pattern": "b"})),
            "[0].pattern",
        ),
        (raw("fuzzy", json!({})), "[0].scorer"),
        (raw("regex", json!({"pattern": "("})), "[0].pattern"),
        (
            raw("json_schema", json!({"schema": {"$ref": "#"}})),
            "[0].schema",
        ),
        (raw("length", json!({})), "[0].min_tokens"),
        (raw("tool_call", json!({"name": "f"})), "[0].tools"),
        (raw("judge", json!({"rubric": "rate it"})), "[0].rubric"),
    ];
    for (r, field) in bad {
        let e = EvalSet::new(vec![r], 8).unwrap_err();
        assert!(e.starts_with(field), "{field}: {e}");
    }
    let e = serde_json::from_value::<RawEvalItem>(json!({"messages": [], "scorer": "exact",
                                                        "referense": "x"}));
    assert!(e.unwrap_err().to_string().contains("referense"));
}

/// A runner that answers from a table: judge items are judged in a second round by the
/// adapter they name, with the rubric filled in.
#[test]
fn judges_read_the_answer_and_score_it() {
    struct Table;
    impl Runner for Table {
        fn run(&self, through: &Through, calls: Vec<ChatCall>) -> Result<Vec<Answer>, String> {
            Ok(calls
                .iter()
                .map(|c| {
                    let q = c.messages[0]["content"].as_str().unwrap().to_string();
                    match through {
                        Through::Base if q == "Capital of France?" => answer("Paris"),
                        Through::Adapter(a)
                            if a == "judge" && q == "Q: Capital of France? A: Paris" =>
                        {
                            answer("9")
                        }
                        _ => answer("1"),
                    }
                })
                .collect())
        }
    }
    let items = vec![
        raw("exact", json!({"reference": "Paris"})),
        raw(
            "judge",
            json!({"rubric": "Q: {prompt} A: {answer}", "judge_adapter": "judge"}),
        ),
        raw("judge", json!({"rubric": "{answer}", "judge_max": 2.0})),
    ];
    let set = EvalSet::new(items, 8).unwrap();
    let s = evaluate(&Table, &set, Through::Base, 7).unwrap();
    assert_eq!(s.items, vec![1.0, 0.9, 0.5]);
    assert!((s.score - 0.8).abs() < 1e-12);
    assert_eq!(s.version, 7);
}
