//! Adapters over HTTP on a tiny generated model: create, load (ours and vLLM's routes), select per
//! request, see which version answered, export, delete; bad adapters refused with the slot
//! untouched; admin routes behind the admin key; and a swap storm — 1,000 versions published while
//! 16 streams run — with no failed request, one version per response, and seeded answers equal to
//! a rerun on that version alone.

mod common;

use common::server::*;
use common::Rng;
use flywheel::adapter::{
    peft, AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method, OftConfig, Target,
};
use flywheel::model::llama::Llama;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A PEFT folder for the test model with random values (written by our saver, which
/// tests/adapters.rs checks against PEFT's own files).
fn random_peft(model_path: &Path, dir: &Path, method: Method, seed: u64) -> PathBuf {
    let model = Llama::open(model_path).unwrap();
    let cfg = AdapterConfig {
        method,
        targets: Target::ALL.to_vec(),
        base_model: "tiny".into(),
    };
    let layout = Arc::new(AdapterLayout::new(cfg, &model.config).unwrap());
    let params = Rng(seed).vec(layout.num_params, 0.15);
    let w = AdapterWeights::new(layout, params).unwrap();
    peft::save(&w, dir).unwrap();
    dir.to_path_buf()
}

fn lora() -> Method {
    Method::Lora(LoraConfig {
        r: 4,
        alpha: 8.0,
        use_rslora: false,
    })
}

fn oft() -> Method {
    Method::Oft(OftConfig {
        block_size: 16,
        ..OftConfig::default()
    })
}

fn seeded(model: &str, seed: u64, extra: Value) -> Value {
    let mut b = chat(
        "tell me about adapters",
        json!({"seed": seed, "temperature": 1.0, "ignore_eos": true, "return_token_ids": true}),
    );
    b["model"] = json!(model);
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn token_ids(v: &Value) -> Value {
    v["choices"][0]["token_ids"].clone()
}

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
        Some("config"),
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

/// Per stream: the versions its chunks reported and its tokens.
struct StreamResult {
    versions: Vec<u64>,
    seed: u64,
    tokens: Vec<u64>,
}

fn stream_once(c: &common::server::Client, model: &str, seed: u64) -> StreamResult {
    let body = seeded(model, seed, json!({"stream": true, "max_tokens": 48}));
    let r = c.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body_text());
    let data = r.sse_data();
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "stream ended early"
    );
    let mut out = StreamResult {
        versions: Vec::new(),
        seed,
        tokens: Vec::new(),
    };
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        assert!(v.get("error").is_none(), "stream error: {v}");
        out.versions.push(v["adapter_version"].as_u64().unwrap());
        if let Some(ids) = v["choices"][0]["token_ids"].as_array() {
            out.tokens.extend(ids.iter().map(|t| t.as_u64().unwrap()));
        }
    }
    out
}

/// Inter-token gaps measured by reading one stream incrementally: (arrival, gap) pairs.
fn timed_stream(c: &common::server::Client, model: &str, seed: u64) -> Vec<(Instant, f64)> {
    use std::io::Read;
    let body = seeded(model, seed, json!({"stream": true, "max_tokens": 64})).to_string();
    let mut sock = c
        .connect("POST", "/v1/chat/completions", Some(&body), &[])
        .unwrap();
    let mut buf = [0u8; 4096];
    let mut arrivals = Vec::new();
    let mut all = Vec::new();
    loop {
        let n = sock.read(&mut buf).unwrap_or(0);
        if n == 0 {
            break;
        }
        arrivals.push(Instant::now());
        all.extend_from_slice(&buf[..n]);
        if all.windows(6).any(|w| w == b"[DONE]") {
            break;
        }
    }
    arrivals
        .windows(2)
        .map(|w| (w[1], (w[1] - w[0]).as_secs_f64()))
        .collect()
}

fn p99(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64) * 0.99) as usize)
        .or(v.last())
        .copied()
        .unwrap_or(0.0)
}

#[test]
fn a_storm_of_1000_versions_under_16_streams_fails_nothing() {
    let (dir, s) = start_long(CONFIG);
    let model_path = dir.path().join("tiny.gguf");
    let tmp = tempfile::tempdir().unwrap();
    // Odd versions carry A's weights, even versions B's.
    let a = random_peft(&model_path, &tmp.path().join("a"), lora(), 11);
    let b = random_peft(&model_path, &tmp.path().join("b"), lora(), 12);
    assert_eq!(
        s.post("/v1/adapters", &json!({"name": "s", "path": a}))
            .status,
        201
    );

    let storming = Arc::new(AtomicBool::new(true));
    let results = Arc::new(Mutex::new(Vec::new()));
    let deadline = Instant::now() + Duration::from_secs(120);
    let workers: Vec<_> = (0..16u64)
        .map(|w| {
            let (c, storming, results) = (s.client.clone(), storming.clone(), results.clone());
            std::thread::spawn(move || {
                let mut k = 0;
                while storming.load(Ordering::Acquire) && Instant::now() < deadline {
                    let r = stream_once(&c, "s", 1000 * w + k);
                    results.lock().unwrap().push(r);
                    k += 1;
                }
            })
        })
        .collect();
    let itl_probe = {
        let (c, storming) = (s.client.clone(), storming.clone());
        std::thread::spawn(move || {
            let mut gaps = Vec::new();
            let mut i = 0;
            while storming.load(Ordering::Acquire) && i < 500 {
                gaps.extend(timed_stream(&c, "s", 5000 + i));
                i += 1;
            }
            gaps
        })
    };
    // One second of the 16 streams alone, then the storm.
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    for v in 2..=1001u32 {
        let path = if v % 2 == 1 { &a } else { &b };
        let r = s.post("/v1/adapters", &json!({"name": "s", "path": path}));
        assert_eq!(r.status, 200, "{}", r.body_text());
        assert_eq!(r.json()["version"], json!(v));
    }
    let t1 = Instant::now();
    let storm_secs = (t1 - t0).as_secs_f64();
    storming.store(false, Ordering::Release);
    for w in workers {
        w.join().expect("a stream failed");
    }
    let gaps = itl_probe.join().unwrap();
    let quiet_itl: Vec<f64> = gaps.iter().filter(|(t, _)| *t < t0).map(|g| g.1).collect();
    let storm_itl: Vec<f64> = gaps
        .iter()
        .filter(|(t, _)| *t >= t0 && *t <= t1)
        .map(|g| g.1)
        .collect();
    let results = std::mem::take(&mut *results.lock().unwrap());
    assert!(results.len() >= 16, "only {} streams ran", results.len());
    let mut seen = std::collections::BTreeSet::new();
    for r in &results {
        let v0 = r.versions[0];
        assert!(
            r.versions.iter().all(|v| *v == v0),
            "a stream mixed versions: {:?}",
            r.versions
        );
        seen.insert(v0);
    }
    assert!(seen.len() > 5, "streams saw only versions {seen:?}");
    eprintln!(
        "storm: 1000 versions in {storm_secs:.2} s while {} streams ran on {} versions; inter-token p99 of a 17th stream: {:.2} ms before the storm, {:.2} ms during it",
        results.len(),
        seen.len(),
        p99(quiet_itl) * 1e3,
        p99(storm_itl) * 1e3
    );
    // A seeded request's tokens equal a rerun on the same weights alone.
    assert_eq!(
        s.post("/v1/adapters", &json!({"name": "check-a", "path": a}))
            .status,
        201
    );
    assert_eq!(
        s.post("/v1/adapters", &json!({"name": "check-b", "path": b}))
            .status,
        201
    );
    for r in results.iter().filter(|r| r.versions[0] > 1).take(12) {
        let name = if r.versions[0] % 2 == 1 {
            "check-a"
        } else {
            "check-b"
        };
        let again = s
            .post(
                "/v1/chat/completions",
                &seeded(name, r.seed, json!({"max_tokens": 48})),
            )
            .json();
        let ids: Vec<u64> = token_ids(&again)
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect();
        assert_eq!(ids, r.tokens, "version {} seed {}", r.versions[0], r.seed);
    }
    // Old versions are freed once nothing holds them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("flywheel_adapter_versions_alive") > 3.0 {
        assert!(Instant::now() < deadline, "old versions still alive");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn deleting_or_replacing_an_adapter_lets_running_requests_finish_on_their_version() {
    let (_d, s) = start_long(CONFIG);
    assert_eq!(
        s.post(
            "/v1/adapters",
            &json!({"name": "d", "kind": "lora", "r": 2})
        )
        .status,
        201
    );
    let body = seeded("d", 3, json!({"stream": true, "max_tokens": 8000})).to_string();
    let sock = s
        .connect("POST", "/v1/chat/completions", Some(&body), &[])
        .unwrap();
    // Wait until the stream has started, then replace and delete the adapter under it.
    let deadline = Instant::now() + Duration::from_secs(30);
    while s.get("/v1/adapters/d").json()["versions"][0]["requests_in_flight"] != 1 {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        s.post(
            "/v1/adapters",
            &json!({"name": "d", "kind": "lora", "r": 4})
        )
        .json()["version"],
        2
    );
    let info = s.get("/v1/adapters/d").json();
    let v: Vec<(Value, Value)> = info["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v["version"].clone(), v["requests_in_flight"].clone()))
        .collect();
    assert_eq!(v, [(json!(1), json!(1)), (json!(2), json!(0))], "{info}");
    assert_eq!(
        s.try_request("DELETE", "/v1/adapters/d", None, &[])
            .unwrap()
            .status,
        200
    );
    assert_error(
        &s.post("/v1/chat/completions", &seeded("d", 1, json!({}))),
        404,
        Some("model"),
    );
    let mut raw = Vec::new();
    use std::io::Read;
    let mut sock = sock;
    sock.read_to_end(&mut raw).unwrap();
    let r = common::server::Response::parse(&raw);
    let data = r.sse_data();
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks
        .iter()
        .all(|c| c["adapter_version"] == 1 && c["adapter"] == "d"));
    let finish = chunks.iter().rev().find_map(|c| {
        c["choices"][0]["finish_reason"]
            .as_str()
            .map(str::to_string)
    });
    assert_eq!(finish.as_deref(), Some("length"));
}
