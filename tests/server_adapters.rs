//! Adapters over HTTP on a tiny generated model: create, load (ours and vLLM's routes), select per
//! request, see which version answered, export, delete; bad adapters refused with the slot
//! untouched; admin routes behind the admin key.

mod common;

use common::adapters::*;
use common::server::*;
use serde_json::{json, Value};

#[test]
fn adapters_are_created_loaded_selected_exported_and_deleted() {
    let (dir, s) = start(CONFIG, &[]);
    let model_path = dir.path().join("tiny.gguf");
    let tmp = tempfile::tempdir().unwrap();

    // A new OFT adapter starts as the identity: same answers as the base, reported as its own.
    let r = s.post(
        "/v1/adapters",
        &json!({"name": "o", "kind": "oft", "oft_block_size": 16}),
    );
    assert_eq!(r.status, 201, "{}", r.body_text());
    let info = r.json();
    assert_eq!(info["version"], 1);
    assert_eq!(info["kind"], "oft");
    // Parameters of OFT b=16 on all seven projections of 2 layers: in·(b−1)/2 per module.
    let per_layer = (64 * 5 + 64 + 96) * 15 / 2;
    assert_eq!(info["num_parameters"], json!(2 * per_layer));
    let base = s
        .post("/v1/chat/completions", &seeded("tiny", 7, json!({})))
        .json();
    assert_eq!(base["adapter"], Value::Null);
    assert_eq!(base["adapter_version"], 0);
    assert_eq!(base["system_fingerprint"], "tiny@0");
    let ident = s
        .post("/v1/chat/completions", &seeded("o", 7, json!({})))
        .json();
    assert_eq!(ident["model"], "o");
    assert_eq!(ident["adapter"], "o");
    assert_eq!(ident["adapter_version"], 1);
    assert_eq!(ident["system_fingerprint"], "o@1");
    assert_eq!(token_ids(&ident), token_ids(&base));

    // A loaded adapter changes the answers; `flywheel generate --adapter` agrees with the server.
    let lora_dir = random_peft(&model_path, &tmp.path().join("lora"), lora(), 3);
    let r = s.post("/v1/adapters", &json!({"name": "l", "path": lora_dir}));
    assert_eq!(r.status, 201, "{}", r.body_text());
    let greedy = |m: &str| {
        let mut b = chat(
            "hello",
            json!({"temperature": 0, "return_token_ids": true, "max_tokens": 12}),
        );
        b["model"] = json!(m);
        token_ids(&s.post("/v1/chat/completions", &b).json())
    };
    let (tb, tl) = (greedy("tiny"), greedy("l"));
    assert_ne!(tb, tl, "a random LoRA changes greedy answers");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flywheel"))
        .args(["generate", "--model"])
        .arg(&model_path)
        .args([
            "--chat",
            "hello",
            "--max-tokens",
            "12",
            "--json",
            "--adapter",
        ])
        .arg(&lora_dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    let served: Vec<Value> = tl.as_array().unwrap().clone();
    assert_eq!(
        g["token_ids"].as_array().unwrap()[..],
        served[..g["token_ids"].as_array().unwrap().len()]
    );

    // Streaming: every chunk names the adapter and version.
    let r = s.post(
        "/v1/chat/completions",
        &seeded(
            "l",
            1,
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let data = r.sse_data();
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).unwrap();
        assert_eq!(
            (c["adapter"].clone(), c["adapter_version"].clone()),
            (json!("l"), json!(1)),
            "{c}"
        );
        assert_eq!(c["system_fingerprint"], "l@1");
    }

    // /v1/models lists the base first, then each adapter with the base as parent.
    let m = s.get("/v1/models").json();
    let ids: Vec<&str> = m["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny", "l", "o"]);
    assert_eq!(m["data"][1]["parent"], "tiny");
    assert_eq!(m["data"][1]["adapter_version"], 1);

    // Loading over an existing name publishes its next version; export writes a PEFT folder that
    // loads back to the same answers.
    let r = s.post("/v1/adapters", &json!({"name": "o", "path": lora_dir}));
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(
        (
            r.json()["version"].clone(),
            r.json()["parent_version"].clone()
        ),
        (json!(2), json!(1))
    );
    assert_eq!(greedy("o"), tl);
    let export = tmp.path().join("exported");
    let r = s.post("/v1/adapters/o/export", &json!({"path": export}));
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert!(
        export.join("adapter_config.json").exists()
            && export.join("adapter_model.safetensors").exists()
    );
    assert_error(
        &s.post("/v1/adapters/o/export", &json!({"path": export})),
        409,
        Some("path"),
    );
    let r = s.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "v", "lora_path": export}),
    );
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_eq!(greedy("v"), tl);
    let r = s.get("/v1/adapters/o").json();
    assert_eq!(r["version"], 2);
    assert!(r["versions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|v| v["current"] == true));
    assert_eq!(
        s.get("/v1/adapters").json()["data"]
            .as_array()
            .unwrap()
            .len(),
        3
    );

    // Unload and delete: the name is gone for new requests.
    assert_eq!(
        s.post("/v1/unload_lora_adapter", &json!({"lora_name": "v"}))
            .status,
        200
    );
    assert_error(
        &s.post("/v1/chat/completions", &seeded("v", 1, json!({}))),
        404,
        Some("model"),
    );
    assert_error(
        &s.post("/v1/unload_lora_adapter", &json!({"lora_name": "v"})),
        404,
        Some("lora_name"),
    );
    let r = s
        .try_request("DELETE", "/v1/adapters/o", None, &[])
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body_text());
    assert_error(
        &s.try_request("DELETE", "/v1/adapters/o", None, &[])
            .unwrap(),
        404,
        None,
    );
    assert_error(&s.get("/v1/adapters/o"), 404, None);

    // Metrics.
    assert!(s.metric("flywheel_adapter_publishes_total") >= 4.0);
    assert_eq!(s.metric("flywheel_adapter_version{adapter=\"l\"}"), 1.0);
    assert!(s.metric("flywheel_adapter_requests_total{adapter=\"l\"}") >= 2.0);
    assert!(s.metric("flywheel_adapter_generation_tokens_total{adapter=\"l\"}") > 0.0);
    assert!(s.metric("flywheel_adapter_versions_alive") >= 1.0);
}

#[test]
fn bad_adapters_are_refused_and_leave_the_slot_untouched() {
    let (dir, s) = start(CONFIG, &[]);
    let model_path = dir.path().join("tiny.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let good = random_peft(&model_path, &tmp.path().join("good"), oft(), 1);
    assert_eq!(
        s.post("/v1/adapters", &json!({"name": "a", "path": good}))
            .status,
        201
    );

    // A NaN in one tensor, a wrong shape, a missing folder, an unknown target.
    let nan = tmp.path().join("nan");
    std::fs::create_dir(&nan).unwrap();
    std::fs::copy(
        good.join("adapter_config.json"),
        nan.join("adapter_config.json"),
    )
    .unwrap();
    let bytes = std::fs::read(good.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let victim = "base_model.model.model.layers.1.mlp.up_proj.oft_R.weight";
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.shape().to_vec(), v.data().to_vec()))
        .collect();
    for (n, _, d) in owned.iter_mut() {
        if n == victim {
            d[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = owned
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    std::fs::write(
        nan.join("adapter_model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let e = assert_error(
        &s.post("/v1/adapters", &json!({"name": "a", "path": nan})),
        400,
        Some("path"),
    );
    assert!(
        e["error"]["message"].as_str().unwrap().contains(victim),
        "{e}"
    );
    let e = assert_error(
        &s.post(
            "/v1/load_lora_adapter",
            &json!({"lora_name": "a", "lora_path": nan}),
        ),
        400,
        Some("lora_path"),
    );
    assert!(
        e["error"]["message"].as_str().unwrap().contains(victim),
        "{e}"
    );

    let other = tmp.path().join("other");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(good.join("adapter_config.json")).unwrap())
            .unwrap();
    cfg["oft_block_size"] = json!(32);
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("adapter_config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        good.join("adapter_model.safetensors"),
        other.join("adapter_model.safetensors"),
    )
    .unwrap();
    let e = assert_error(
        &s.post("/v1/adapters", &json!({"name": "a", "path": other})),
        400,
        Some("path"),
    );
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("oft_R.weight"),
        "{e}"
    );
    assert_error(
        &s.post(
            "/v1/adapters",
            &json!({"name": "a", "path": tmp.path().join("nope")}),
        ),
        400,
        Some("path"),
    );
    cfg["oft_block_size"] = json!(16);
    cfg["target_modules"] = json!(["q_proj", "lm_head"]);
    std::fs::write(other.join("adapter_config.json"), cfg.to_string()).unwrap();
    let e = assert_error(
        &s.post("/v1/adapters", &json!({"name": "a", "path": other})),
        400,
        Some("path"),
    );
    assert!(
        e["error"]["message"].as_str().unwrap().contains("lm_head"),
        "{e}"
    );

    // The slot still serves version 1; bad names and kinds are 400s naming the field.
    let r = s.get("/v1/adapters/a").json();
    assert_eq!(r["version"], 1);
    assert_eq!(
        s.post("/v1/chat/completions", &seeded("a", 1, json!({})))
            .json()["adapter_version"],
        1
    );
    assert_error(
        &s.post("/v1/adapters", &json!({"name": "tiny", "kind": "oft"})),
        400,
        Some("name"),
    );
    assert_error(
        &s.post("/v1/adapters", &json!({"name": "a b", "kind": "oft"})),
        400,
        Some("name"),
    );
    assert_error(
        &s.post("/v1/adapters", &json!({"name": "x", "kind": "dora"})),
        400,
        Some("kind"),
    );
    assert_error(
        &s.post(
            "/v1/adapters",
            &json!({"name": "x", "kind": "oft", "oft_block_size": 24}),
        ),
        400,
        Some("oft_block_size"),
    );
    assert_error(
        &s.post(
            "/v1/adapters",
            &json!({"name": "x", "kind": "lora", "targets": ["q", "zz"]}),
        ),
        400,
        Some("targets"),
    );
    assert_error(
        &s.post("/v1/adapters", &json!({"name": "x"})),
        400,
        Some("path"),
    );
    assert_error(
        &s.post(
            "/v1/adapters/zz/export",
            &json!({"path": tmp.path().join("e")}),
        ),
        404,
        None,
    );
    assert_error(
        &s.post("/v1/chat/completions", &seeded("zz", 1, json!({}))),
        404,
        Some("model"),
    );
}

#[test]
fn admin_routes_need_the_admin_key() {
    let (_d, s) = start(CONFIG, &["--api-key", "user", "--admin-key", "root"]);
    let create = json!({"name": "k", "kind": "lora", "r": 2});
    let body = create.to_string();
    for key in [None, Some("user"), Some("wrong")] {
        let h = key.map(|k| format!("Bearer {k}"));
        let headers: Vec<(&str, &str)> = h.iter().map(|v| ("Authorization", v.as_str())).collect();
        let r = s
            .try_request("POST", "/v1/adapters", Some(&body), &headers)
            .unwrap();
        assert_error(&r, 401, None);
        let r = s
            .try_request("POST", "/v1/load_lora_adapter", Some("{}"), &headers)
            .unwrap();
        assert_error(&r, 401, None);
        let r = s
            .try_request("DELETE", "/v1/adapters/k", None, &headers)
            .unwrap();
        assert_error(&r, 401, None);
    }
    let root = [("Authorization", "Bearer root")];
    let r = s
        .try_request("POST", "/v1/adapters", Some(&body), &root)
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.body_text());
    // The API key reads adapters and uses them; the admin key works on the API routes too.
    let user = [("Authorization", "Bearer user")];
    assert_eq!(
        s.try_request("GET", "/v1/adapters/k", None, &user)
            .unwrap()
            .status,
        200
    );
    let req = seeded("k", 1, json!({})).to_string();
    assert_eq!(
        s.try_request("POST", "/v1/chat/completions", Some(&req), &user)
            .unwrap()
            .status,
        200
    );
    assert_eq!(
        s.try_request("POST", "/v1/chat/completions", Some(&req), &root)
            .unwrap()
            .status,
        200
    );
    assert_error(&s.get("/v1/adapters"), 401, None);
}
