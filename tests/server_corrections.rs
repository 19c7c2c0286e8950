//! Off-policy corrections over HTTP on a tiny generated model: samples drawn with a logit bias
//! (not the policy's distribution) are dropped by a plain learning adapter and train, weighted,
//! on one with a correction; the distribution they were drawn from is what the weight is of.

mod common;

use common::online::*;
use common::write_tiny;
use serde_json::json;

#[test]
fn biased_samples_train_with_a_correction_and_are_dropped_without() {
    let (dir, path) = write_tiny(&common::TinySpec {
        ctx: 256,
        ..common::TinySpec::small()
    });
    let learn = "[[learn]]\nname = \"plain\"\n\
                 [[learn]]\nname = \"tis\"\nloss = \"dapo\"\ncorrection = \"tis\"\ncorrection_cap = 1.5\n\
                 [[learn]]\nname = \"pop\"\ncorrection = \"icepop\"\n";
    let cfg = format!(
        "{}\n{learn}",
        config("reward_min = -1.0\nreward_max = 1.0\nmax_off_policy_steps = 1000")
    );
    let s = start_learning(&path, &dir.path().join("data"), &cfg, &[]);
    // Settings are checked, naming the key.
    for (body, param) in [
        (json!({"correction": "ppo"}), "correction"),
        (
            json!({"correction": "tis", "correction_low": 0.1}),
            "correction_low",
        ),
        (json!({"correction_cap": 2.0}), "correction_cap"),
        (
            json!({"loss": "masked_is", "correction": "mis"}),
            "correction",
        ),
        (
            json!({"correction": "icepop", "correction_level": "sequence"}),
            "correction_level",
        ),
    ] {
        let r = call(&s, "POST", "/v1/adapters/x/train", Some(&body), ADMIN);
        assert_eq!(r.status, 400, "{}", r.body_text());
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body_text());
    }
    for name in ["plain", "tis", "pop"] {
        let body = json!({"model": name, "prompt": "hello", "max_tokens": 6, "n": 2,
                          "temperature": 1.0, "seed": 11, "ignore_eos": true,
                          "logit_bias": {"7": 2.0}});
        let r = call(&s, "POST", "/v1/completions", Some(&body), USER);
        assert_eq!(r.status, 200, "{}", r.body_text());
        let id = r.json()["id"].as_str().unwrap().to_string();
        let rewards = json!([{"id": id, "choice": 0, "reward": 1.0},
                             {"id": id, "choice": 1, "reward": 0.0}]);
        let r = call(&s, "POST", "/v1/feedback", Some(&rewards), USER);
        assert_eq!(r.status, 202, "{}", r.body_text());
    }
    for name in ["tis", "pop"] {
        let st = wait_status(&s, name, 60, |st| st["steps"].as_u64() >= Some(1));
        assert_eq!(st["last"]["sequences"], 2, "{name}: {st}");
        assert!(st["dropped"].get("off_policy_sample").is_none(), "{st}");
        // A token drawn as the bias made it (token 7, e^2 likelier than the policy says) has
        // π/μ below IcePop's band: masked. Truncation masks nothing.
        let masked = st["last"]["masked_fraction"].as_f64().unwrap();
        assert_eq!(masked > 0.0, name == "pop", "{name}: {st}");
    }
    let st = wait_status(&s, "plain", 60, |st| {
        st["dropped"]["off_policy_sample"].as_u64() == Some(2)
    });
    assert_eq!(st["steps"], 0, "{st}");
    let st = status(&s, "tis");
    assert_eq!(
        st["config"]["correction"],
        json!({"rule": {"truncate": {"cap": 1.5}}, "level": "token"}),
        "{st}"
    );
}
