//! Adapter versions under load over HTTP on a tiny generated model: a swap storm — 1,000 versions
//! published while 16 streams run — with no failed request, one version per response, and seeded
//! answers equal to a rerun on that version alone; replacing or deleting an adapter under a running
//! stream lets it finish on its pinned version.

mod common;

use common::adapters::*;
use common::server::*;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    let chunks = r.sse_chunks();
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

/// The stress loop kept from the segfault hunt: adapters of changing shapes (LoRA r 2..8, OFT)
/// created, replaced and deleted in a loop while 6 streams run through them and the base, with
/// two threads burning the CPU (so that the kernel pool's workers are descheduled at every point
/// of a hand-off). No request fails but by the adapter being gone (404 before it starts), every
/// stream that starts ends with `[DONE]` on one version, and the server lives on.
#[test]
fn adapters_created_replaced_and_deleted_under_streams_and_cpu_load_never_crash() {
    let (_d, s) = start_long(CONFIG);
    let stop = Arc::new(AtomicBool::new(false));
    let burners: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    std::hint::black_box(x);
                }
            })
        })
        .collect();
    let streams: Vec<_> = (0..6u64)
        .map(|i| {
            let (c, stop) = (s.client.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut done = 0;
                let mut seed = i;
                while !stop.load(Ordering::Relaxed) {
                    let model = if i % 3 == 0 { "tiny" } else { "d" };
                    let body = seeded(model, seed, json!({"stream": true, "max_tokens": 24}));
                    seed += 6;
                    let r = c.post("/v1/chat/completions", &body);
                    if r.status == 404 && model == "d" {
                        continue;
                    }
                    assert_eq!(r.status, 200, "{}", r.body_text());
                    let data = r.sse_data();
                    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
                    let versions: std::collections::BTreeSet<String> = data[..data.len() - 1]
                        .iter()
                        .map(|d| {
                            let v: Value = serde_json::from_str(d).unwrap();
                            assert!(v.get("error").is_none(), "stream error: {v}");
                            v["adapter_version"].to_string()
                        })
                        .collect();
                    assert_eq!(versions.len(), 1, "{versions:?}");
                    done += 1;
                }
                done
            })
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(6);
    let mut k = 0u32;
    while Instant::now() < until {
        let body = match k % 5 {
            4 => json!({"name": "d", "kind": "oft", "oft_block_size": 32}),
            r => json!({"name": "d", "kind": "lora", "r": 2 << r}),
        };
        let r = s.post("/v1/adapters", &body);
        assert!(r.status == 201 || r.status == 200, "{}", r.body_text());
        if k % 3 == 2 {
            let r = s
                .try_request("DELETE", "/v1/adapters/d", None, &[])
                .unwrap();
            assert_eq!(r.status, 200, "{}", r.body_text());
        }
        k += 1;
        std::thread::sleep(Duration::from_millis(15));
    }
    stop.store(true, Ordering::Relaxed);
    let served: u32 = streams.into_iter().map(|h| h.join().unwrap()).sum();
    for b in burners {
        b.join().unwrap();
    }
    assert!(served >= 12, "only {served} streams");
    assert!(k >= 50, "only {k} publishes");
    assert_eq!(s.get("/health").status, 200);
}
