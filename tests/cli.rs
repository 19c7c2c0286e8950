//! The `flywheel` command end to end on a tiny generated model: generate (text and JSON),
//! tokenize, and errors.

mod common;

use common::{write_tiny, TinySpec};
use std::io::Write;
use std::process::{Command, Stdio};

fn flywheel(args: &[&str], stdin: Option<&str>) -> (bool, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flywheel"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn generate_json_has_the_promised_shape_and_is_seeded() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let args = [
        "generate",
        "--model",
        p,
        "--chat",
        "hello",
        "--max-tokens",
        "12",
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--top-logprobs",
        "3",
        "--json",
    ];
    let (ok, out, err) = flywheel(&args, None);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let prompt: Vec<u64> = v["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(&prompt[..1], &[1], "chat prompt starts with <|im_start|>");
    let toks = v["token_ids"].as_array().unwrap();
    let reason = v["finish_reason"].as_str().unwrap();
    assert!(
        reason == "length" && toks.len() == 12 || reason == "stop" && toks.len() < 12,
        "{reason} {}",
        toks.len()
    );
    let lps = v["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), toks.len());
    for (lp, t) in lps.iter().zip(toks) {
        assert_eq!(&lp["token_id"], t);
        let x = lp["logprob"].as_f64().unwrap();
        assert!(x <= 0.0 && x.is_finite());
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let tops: Vec<f64> = top.iter().map(|e| e["logprob"].as_f64().unwrap()).collect();
        assert!(
            tops.windows(2).all(|w| w[0] >= w[1]),
            "top log-probs sorted"
        );
        assert!(x <= tops[0] + 1e-6);
    }
    assert!(v["timings"]["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(v["text"].is_string());
    // Same seed, same tokens; another seed, (almost surely) others.
    let (_, again, _) = flywheel(&args, None);
    let w: serde_json::Value = serde_json::from_str(again.trim()).unwrap();
    assert_eq!(v["token_ids"], w["token_ids"]);
    let mut other = args.to_vec();
    other[10] = "8";
    let (_, o, _) = flywheel(&other, None);
    let o: serde_json::Value = serde_json::from_str(o.trim()).unwrap();
    assert_ne!(v["token_ids"], o["token_ids"]);
}

/// `generate --json` of 16 greedy tokens after "the hello world" on `model`, with `extra` flags.
fn generate16(model: &str, extra: &[&str]) -> (bool, String, String) {
    let mut a = vec![
        "generate",
        "--model",
        model,
        "--prompt",
        "the hello world",
        "--max-tokens",
        "16",
        "--json",
    ];
    a.extend_from_slice(extra);
    flywheel(&a, None)
}

#[test]
fn greedy_generation_agrees_with_reference_kernels() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let (ok, fast, err) = generate16(p, &[]);
    assert!(ok, "{err}");
    let (ok, refr, err) = generate16(p, &["--reference-kernels"]);
    assert!(ok, "{err}");
    let (a, b): (serde_json::Value, serde_json::Value) = (
        serde_json::from_str(&fast).unwrap(),
        serde_json::from_str(&refr).unwrap(),
    );
    assert_eq!(a["token_ids"], b["token_ids"]);
    for (x, y) in a["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(b["logprobs"].as_array().unwrap())
    {
        assert!((x["logprob"].as_f64().unwrap() - y["logprob"].as_f64().unwrap()).abs() < 1e-4);
    }
}

/// `--precision bf16` and `int8` end to end: the fast kernels agree with the reference emulating
/// the same products, and differ from exact f32; a CPU without what the path needs refuses it
/// by name. The default is `auto`: bf16 where the CPU has it, else exact, to the bit.
#[test]
fn low_precision_generation_agrees_with_the_emulated_reference() {
    use flywheel::kernels::cpu::Precision;
    let (_dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let run = |extra: &[&str]| generate16(p, extra);
    let (ok, exact, err) = run(&["--precision", "exact"]);
    assert!(ok, "{err}");
    let (ok, default, err) = run(&[]);
    assert!(ok, "{err}");
    let (ok, auto, err) = run(&["--precision", "auto"]);
    assert!(ok, "{err}");
    // The output without its timings.
    let body = |s: &str| {
        let mut v: serde_json::Value = serde_json::from_str(s).unwrap();
        v.as_object_mut().unwrap().remove("timings");
        v
    };
    assert_eq!(body(&default), body(&auto), "the default is auto");
    if !Precision::Bf16.supported(flywheel::kernels::Isa::detect()) {
        assert_eq!(
            body(&auto),
            body(&exact),
            "auto is exact without AVX512_BF16"
        );
    }
    for precision in [Precision::Bf16, Precision::Int8] {
        let name = precision.name();
        let (ok, fast, err) = run(&["--precision", name]);
        if !precision.supported(flywheel::kernels::Isa::detect()) {
            assert!(!ok && err.contains(precision.needs()), "{err}");
            eprintln!("{name} path skipped: this CPU lacks {}", precision.needs());
            continue;
        }
        if precision == Precision::Bf16 {
            assert_eq!(body(&auto), body(&fast), "auto is bf16 with AVX512_BF16");
        }
        assert!(ok, "{err}");
        let (ok, refr, err) = run(&["--precision", name, "--reference-kernels"]);
        assert!(ok, "{err}");
        let v = |s: &str| serde_json::from_str::<serde_json::Value>(s).unwrap();
        let (a, b, e) = (v(&fast), v(&refr), v(&exact));
        assert_eq!(a["token_ids"], b["token_ids"], "{name}");
        let lps = |x: &serde_json::Value| -> Vec<f64> {
            x["logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["logprob"].as_f64().unwrap())
                .collect()
        };
        for (x, y) in lps(&a).iter().zip(lps(&b)) {
            assert!((x - y).abs() < 1e-4, "{name}: {x} vs {y}");
        }
        assert_ne!(lps(&a), lps(&e), "{name} products changed nothing");
    }
}

#[test]
fn tokenize_applies_merges_digits_and_control_tokens() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let (ok, out, err) = flywheel(
        &["tokenize", "--model", p, "--json"],
        Some("<|im_start|>hello 42<|im_end|>"),
    );
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let ids: Vec<u64> = v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    // Ids: 3 control tokens, then byte b at 3 + (its index in the byte table), then merges
    // he=259, ll=260, Ġt=261, hell=262. "hello" -> "hell" "o"; " 42" -> "Ġ" "4" "2" (digits alone).
    let byte = |c: char| 3 + common::byte_chars().iter().position(|x| *x == c).unwrap() as u64;
    assert_eq!(
        ids,
        vec![1, 262, byte('o'), byte('Ġ'), byte('4'), byte('2'), 2]
    );
}

/// `bench --decode-context`: the decode rows run after prompts of that many tokens (the context
/// their attention reads), and the report says so; a context of 0 is refused.
#[test]
fn bench_decodes_after_the_context_asked_for() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let args = [
        "bench",
        "--model",
        p,
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "3",
        "--batch",
        "1,2",
        "--runs",
        "1",
        "--decode-context",
        "40",
    ];
    let (ok, out, err) = flywheel(&args, None);
    assert!(ok, "{err}");
    assert!(out.contains("decode context: 40"), "{out}");
    let json = out.lines().rfind(|l| l.starts_with('{')).unwrap();
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["decode_context"], 40);
    let tg: Vec<u64> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["test"] == "tg3")
        .map(|r| r["batch"].as_u64().unwrap())
        .collect();
    assert_eq!(tg, [1, 2]);
    let mut zero = args;
    zero[12] = "0";
    let (ok, _, err) = flywheel(&zero, None);
    assert!(!ok && err.contains("--decode-context"), "{err}");
}

#[test]
fn bad_arguments_and_missing_files_are_clear_errors() {
    let (ok, _, err) = flywheel(
        &[
            "generate",
            "--model",
            "/nonexistent/m.gguf",
            "--prompt",
            "x",
        ],
        None,
    );
    assert!(!ok && err.contains("/nonexistent/m.gguf"), "{err}");
    let (_dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let (ok, _, err) = flywheel(
        &["generate", "--model", p, "--prompt", "x", "--top-p", "0"],
        None,
    );
    assert!(!ok && err.contains("top-p"), "{err}");
    let (ok, _, err) = flywheel(&["generate", "--model", p, "--messages", "{not json"], None);
    assert!(!ok && err.contains("--messages"), "{err}");
    let (ok, _, err) = flywheel(
        &["generate", "--model", p, "--prompt", "x", "--chat", "y"],
        None,
    );
    assert!(!ok && err.contains("cannot be used with"), "{err}");
}

#[test]
fn train_writes_a_peft_adapter_and_optimizer_state_and_resumes() {
    let (dir, path) = write_tiny(&TinySpec::small());
    let p = path.to_str().unwrap();
    let data = dir.path().join("data.jsonl");
    std::fs::write(
        &data,
        "{\"prompt_token_ids\": [5, 6], \"completion_token_ids\": [40, 41, 42], \"reward\": 1, \"group\": \"a\"}\n\
         {\"prompt_token_ids\": [5, 6], \"completion_token_ids\": [70, 71], \"reward\": 0, \"group\": \"a\"}\n",
    )
    .unwrap();
    let (d, out1, out2) = (
        data.to_str().unwrap(),
        dir.path().join("o1"),
        dir.path().join("o2"),
    );
    let (ok, out, err) = flywheel(
        &[
            "train",
            "--model",
            p,
            "--new",
            "oft",
            "--data",
            d,
            "--out",
            out1.to_str().unwrap(),
            "--loss",
            "grpo",
            "--steps",
            "3",
            "--lr",
            "0.01",
        ],
        None,
    );
    assert!(ok, "{err}");
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[2]["step"], 3);
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.json",
        "optimizer.safetensors",
    ] {
        assert!(out1.join(f).exists(), "{f}");
    }
    // Resume: the optimizer continues counting from the saved state.
    let (ok, out, err) = flywheel(
        &[
            "train",
            "--model",
            p,
            "--adapter",
            out1.to_str().unwrap(),
            "--data",
            d,
            "--out",
            out2.to_str().unwrap(),
            "--steps",
            "2",
            "--lr",
            "0.01",
        ],
        None,
    );
    assert!(ok, "{err}");
    assert_eq!(
        out.lines()
            .last()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].clone()),
        Some(serde_json::json!(5))
    );
    let (ok, _, err) = flywheel(
        &[
            "train",
            "--model",
            p,
            "--new",
            "oft",
            "--data",
            d,
            "--out",
            out2.to_str().unwrap(),
        ],
        None,
    );
    assert!(!ok && err.contains("already exists"), "{err}");
    // An optimizer state that is unreadable, or made for another adapter, is refused (not
    // silently replaced by a new one, nor a panic).
    let resume_from = |dir: &std::path::Path, out: &str| {
        flywheel(
            &[
                "train",
                "--model",
                p,
                "--adapter",
                dir.to_str().unwrap(),
                "--data",
                d,
                "--out",
                dir.with_file_name(out).to_str().unwrap(),
            ],
            None,
        )
    };
    let broken = dir.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.json",
    ] {
        std::fs::copy(out1.join(f), broken.join(f)).unwrap();
    }
    std::fs::write(broken.join("optimizer.safetensors"), b"truncated").unwrap();
    let (ok, _, err) = resume_from(&broken, "o3");
    assert!(!ok && err.contains("optimizer state"), "{err}");
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(out1.join(f), other.join(f)).unwrap();
    }
    let (ok, _, err) = flywheel(
        &[
            "train",
            "--model",
            p,
            "--new",
            "lora",
            "--data",
            d,
            "--out",
            dir.path().join("lora").to_str().unwrap(),
            "--steps",
            "1",
        ],
        None,
    );
    assert!(ok, "{err}");
    for f in ["optimizer.json", "optimizer.safetensors"] {
        std::fs::copy(dir.path().join("lora").join(f), other.join(f)).unwrap();
    }
    let (ok, _, err) = resume_from(&other, "o4");
    assert!(!ok && err.contains("parameters"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `flywheel train` on every family: GRPO steps from token ids write a PEFT folder that loads
/// back onto that model (a MoE's adapter on its attention only), and the log-prob of the
/// rewarded completion rises.
#[test]
fn train_runs_on_every_family() {
    use flywheel::adapter::{peft, AdapterBase};
    use flywheel::model::decoder::Decoder;
    for spec in TinySpec::families() {
        let (dir, path) = write_tiny(&spec);
        let data = dir.path().join("data.jsonl");
        std::fs::write(
            &data,
            "{\"prompt_token_ids\": [5, 6, 7], \"completion_token_ids\": [40, 41, 42], \"reward\": 1, \"group\": \"a\"}\n\
             {\"prompt_token_ids\": [5, 6, 7], \"completion_token_ids\": [70, 71], \"reward\": 0, \"group\": \"a\"}\n",
        )
        .unwrap();
        let out = dir.path().join("out");
        let (ok, stdout, err) = flywheel(
            &[
                "train",
                "--model",
                path.to_str().unwrap(),
                "--new",
                "lora",
                "--data",
                data.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--loss",
                "grpo",
                "--steps",
                "4",
                "--lr",
                "0.02",
            ],
            None,
        );
        assert!(ok, "{}: {err}", spec.arch);
        assert_eq!(stdout.lines().count(), 4, "{}: {stdout}", spec.arch);
        let model = Decoder::open(&path).unwrap();
        let w = peft::load(&out, &model.config).unwrap();
        assert_eq!(
            w.layout.config.targets,
            model.config.adapter_shape().default_targets(),
            "{}",
            spec.arch
        );
        let seq = [flywheel::model::decoder::TrainSeq::whole(
            &[5, 6, 7, 40, 41, 42],
            3,
        )];
        let cpu = flywheel::kernels::Cpu::detect();
        let before: f32 = model.logprobs(&cpu, &seq, None, 1.0).unwrap()[0]
            .iter()
            .sum();
        let after: f32 = model.logprobs(&cpu, &seq, Some(&w), 1.0).unwrap()[0]
            .iter()
            .sum();
        eprintln!(
            "{}: rewarded completion log-prob {before:.3} -> {after:.3}",
            spec.arch
        );
        assert!(after > before, "{}: {before} -> {after}", spec.arch);
    }
}
