//! The Responses API over HTTP on the tiny model: a turn through a learning adapter is logged
//! under the response's id and rewarded like a chat turn; stored responses are seen only with the
//! key that made them; the fields it does not take are 400s naming them.

mod common;

use common::online::*;
use common::write_tiny;
use serde_json::{json, Value};

#[test]
fn responses_through_a_learning_adapter_are_rewardable_and_kept_per_key() {
    let (dir, path) = write_tiny(&common::server::spec());
    let data = dir.path().join("data");
    let s = start_learning(&path, &data, &learning_config(), &["l"]);
    let ask = |body: Value, key: &str| call(&s, "POST", "/v1/responses", Some(&body), key);
    let r = ask(
        json!({"model": "l", "input": "hi", "max_output_tokens": 4, "temperature": 1.0}),
        USER,
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    let v = r.json();
    let id = v["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"), "{v}");
    assert_eq!(v["object"], "response");
    // Sampled at temperature 1 without a seed: the turn may end early (the tiny model's EOS);
    // cut at the limit, it says so.
    let n = v["usage"]["output_tokens"].as_u64().unwrap();
    assert!(n <= 4, "{v}");
    if v["status"] == "incomplete" {
        assert_eq!(n, 4, "{v}");
        assert_eq!(
            v["incomplete_details"]["reason"], "max_output_tokens",
            "{v}"
        );
    }
    assert_eq!(v["output"][0]["type"], "message");
    // The turn is in the rollout log under the response's id: a reward lands (202) and is seen.
    reward(&s, &id, 1, 202);
    let fb = call(&s, "GET", &format!("/v1/feedback/{id}"), None, USER);
    assert_eq!(fb.status, 200, "{}", fb.body_text());
    // Stored: readable and continuable with its key only.
    let got = call(&s, "GET", &format!("/v1/responses/{id}"), None, USER);
    assert_eq!(got.status, 200);
    assert_eq!(got.json()["output"], v["output"]);
    assert_eq!(
        call(&s, "GET", &format!("/v1/responses/{id}"), None, ADMIN).status,
        404
    );
    let next = json!({"model": "l", "input": "and?", "max_output_tokens": 2,
                      "previous_response_id": id});
    let r = ask(next.clone(), ADMIN);
    assert_eq!(r.status, 400, "{}", r.body_text());
    assert_eq!(r.json()["error"]["param"], "previous_response_id");
    let r = ask(next, USER);
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(r.json()["usage"]["input_tokens"].as_u64() > v["usage"]["input_tokens"].as_u64());
    // store: false keeps nothing.
    let r = ask(
        json!({"model": "l", "input": "hi", "max_output_tokens": 2, "store": false}),
        USER,
    );
    let id2 = r.json()["id"].as_str().unwrap().to_string();
    assert_eq!(
        call(&s, "GET", &format!("/v1/responses/{id2}"), None, USER).status,
        404
    );
}

#[test]
fn fields_the_server_does_not_take_are_400s_naming_them() {
    let (_d, s) = common::server::start(common::server::CONFIG, &[]);
    for (extra, param) in [
        (json!({"background": true}), "background"),
        (json!({"truncation": "auto"}), "truncation"),
        (
            json!({"include": ["reasoning.encrypted_content"]}),
            "include",
        ),
        (json!({"reasoning": {"effort": "high"}}), "reasoning"),
        (json!({"tools": [{"type": "web_search"}]}), "tools[0]"),
        (
            json!({"input": [{"type": "image_generation_call"}]}),
            "input[0]",
        ),
        (json!({"input": []}), "input"),
        (json!({"max_output_tokens": -1}), "max_output_tokens"),
        (json!({"text": {"format": {"type": "yaml"}}}), "text.format"),
    ] {
        let mut b = json!({"model": "tiny", "input": "hi", "max_output_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = s.post("/v1/responses", &b);
        common::server::assert_error(&r, 400, Some(param));
    }
    // Neutral values are fine.
    let r = s.post(
        "/v1/responses",
        &json!({"model": "tiny", "input": "hi", "max_output_tokens": 2, "background": false,
                "truncation": "disabled", "include": [], "reasoning": {"effort": null}}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
}
