//! Adapters on the frozen quantized base: OFT and LoRA against an independent f64 implementation
//! and against PEFT itself (fixtures written by scripts/peft_fixture.py), identity adapters equal to
//! the base to the bit, the PEFT format round trip, mixed batches (base, adapters, versions) that
//! keep every row's logits bit-identical, and malformed adapters refused by name.

mod common;

use common::naive::{matvec, naive_logprobs_with};
use common::{write_tiny, Rng, TinySpec};
use flywheel::adapter::{
    peft, AdapterConfig, AdapterLayout, AdapterWeights, LoraConfig, Method, OftConfig, Target,
};
use flywheel::kernels::{Cpu, Isa, ThreadPool};
use flywheel::model::decoder::{BatchSeq, Decoder, Logits};
use flywheel::model::kv_cache::KvCache;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

fn cpu(isa: Isa) -> Cpu {
    Cpu::new(isa, ThreadPool::new(2, Duration::from_micros(50)))
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/peft_tiny")
}

fn oft(b: usize, targets: &[Target]) -> AdapterConfig {
    AdapterConfig {
        method: Method::Oft(OftConfig {
            block_size: b,
            ..OftConfig::default()
        }),
        targets: targets.to_vec(),
        base_model: "tiny".into(),
    }
}

fn lora(r: usize, alpha: f32, targets: &[Target]) -> AdapterConfig {
    AdapterConfig {
        method: Method::Lora(LoraConfig {
            r,
            alpha,
            use_rslora: false,
        }),
        targets: targets.to_vec(),
        base_model: "tiny".into(),
    }
}

/// An adapter of `config` with every parameter uniform in ±scale.
fn random_adapter(model: &Decoder, config: AdapterConfig, seed: u64, scale: f32) -> AdapterWeights {
    let layout = Arc::new(AdapterLayout::new(config, &model.config).unwrap());
    let params = Rng(seed).vec(layout.num_params, scale);
    AdapterWeights::new(layout, params).unwrap()
}

fn run(
    model: &Decoder,
    cpu: &Cpu,
    tokens: &[u32],
    adapter: Option<&AdapterWeights>,
) -> Vec<Vec<f32>> {
    common::logprobs_all(model, cpu, tokens, adapter)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (*p as f64 - q).abs()))
        .fold(0.0, f64::max)
}

fn to_f64(a: &[Vec<f32>]) -> Vec<Vec<f64>> {
    a.iter()
        .map(|r| r.iter().map(|v| *v as f64).collect())
        .collect()
}

/// OFT's R for one block, written independently: Q from the strict upper triangle (row-major),
/// R = I + 2Q + 2Q² + 2Q³ + Q⁴ in f64.
#[allow(clippy::needless_range_loop)]
fn naive_rotation(theta: &[f32], b: usize) -> Vec<Vec<f64>> {
    let mut q = vec![vec![0.0f64; b]; b];
    let mut p = 0;
    for i in 0..b {
        for j in i + 1..b {
            q[i][j] = theta[p] as f64;
            q[j][i] = -(theta[p] as f64);
            p += 1;
        }
    }
    let mul = |x: &Vec<Vec<f64>>, y: &Vec<Vec<f64>>| -> Vec<Vec<f64>> {
        (0..b)
            .map(|i| {
                (0..b)
                    .map(|j| (0..b).map(|k| x[i][k] * y[k][j]).sum())
                    .collect()
            })
            .collect()
    };
    let q2 = mul(&q, &q);
    let q3 = mul(&q2, &q);
    let q4 = mul(&q3, &q);
    (0..b)
        .map(|i| {
            (0..b)
                .map(|j| {
                    (if i == j { 1.0 } else { 0.0 })
                        + 2.0 * (q[i][j] + q2[i][j] + q3[i][j])
                        + q4[i][j]
                })
                .collect()
        })
        .collect()
}

/// The adapted projection the obvious way: OFT rotates the input blocks, LoRA adds s·B(A x).
fn naive_project(w: &AdapterWeights, l: usize, t: usize, wm: &[Vec<f64>], x: &[f64]) -> Vec<f64> {
    let target = Target::ALL.get(t).copied().unwrap_or(Target::Head);
    let Some(m) = w.layout.module(l, target) else {
        return matvec(wm, x);
    };
    match &w.layout.config.method {
        Method::Oft(o) => {
            let b = o.block_size;
            let np = b * (b - 1) / 2;
            let theta = w.tensor(&m.tensors[0]);
            let mut xr = vec![0.0; x.len()];
            for k in 0..x.len() / b {
                let r = naive_rotation(&theta[k * np..(k + 1) * np], b);
                for j in 0..b {
                    xr[k * b + j] = (0..b).map(|i| x[k * b + i] * r[i][j]).sum();
                }
            }
            matvec(wm, &xr)
        }
        Method::Lora(c) => {
            let (a, bm) = (w.tensor(&m.tensors[0]), w.tensor(&m.tensors[1]));
            let s = c.alpha as f64 / c.r as f64;
            let h: Vec<f64> = (0..c.r)
                .map(|i| {
                    (0..m.in_dim)
                        .map(|j| a[i * m.in_dim + j] as f64 * x[j])
                        .sum()
                })
                .collect();
            let mut y = matvec(wm, x);
            for (o, yo) in y.iter_mut().enumerate() {
                *yo += s * (0..c.r).map(|i| bm[o * c.r + i] as f64 * h[i]).sum::<f64>();
            }
            y
        }
    }
}

#[test]
fn oft_and_lora_match_the_independent_implementation() {
    let spec = TinySpec::small();
    let (_dir, path) = write_tiny(&spec);
    let model = Decoder::open(&path).unwrap();
    let tokens: Vec<u32> = (0..17).map(|i| (i * 41 + 7) % 250 + 3).collect();
    let cases = [
        ("oft b=16 all", oft(16, &Target::ALL), 0.2),
        (
            "oft b=32 q,o,down",
            oft(32, &[Target::Q, Target::O, Target::Down]),
            0.2,
        ),
        ("lora r=4 all", lora(4, 8.0, &Target::ALL), 0.3),
        (
            "lora r=3 k,gate",
            lora(3, 5.0, &[Target::K, Target::Gate]),
            0.3,
        ),
        (
            "lora r=4 v,lm_head",
            lora(4, 8.0, &[Target::V, Target::Head]),
            0.3,
        ),
    ];
    let base = to_f64(&run(&model, &cpu(Isa::Reference), &tokens, None));
    for (i, (name, cfg, scale)) in cases.into_iter().enumerate() {
        let w = random_adapter(&model, cfg, 100 + i as u64, scale);
        let want = naive_logprobs_with(&path, &tokens, &|l, t, wm, x| {
            naive_project(&w, l, t, wm, x)
        });
        let moved = max_diff(&run(&model, &cpu(Isa::Reference), &tokens, Some(&w)), &base);
        for isa in Isa::available() {
            let got = run(&model, &cpu(isa), &tokens, Some(&w));
            let d = max_diff(&got, &want);
            eprintln!(
                "{name} {isa:?}: max |Δ log-prob| {d:.2e} (the adapter moves it by {moved:.2})"
            );
            assert!(d < 2e-4, "{name} {isa:?}: {d}");
        }
        assert!(
            moved > 0.05,
            "{name}: the adapter hardly changes the model ({moved})"
        );
    }
}

#[test]
fn identity_adapters_give_the_base_logits_bitwise() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let tokens: Vec<u32> = (0..21).map(|i| (i * 13 + 2) % 250 + 3).collect();
    for isa in Isa::available() {
        let c = cpu(isa);
        let base = run(&model, &c, &tokens, None);
        for cfg in [
            oft(32, &Target::ALL),
            oft(16, &[Target::V]),
            lora(8, 16.0, &Target::ALL),
        ] {
            let layout = Arc::new(AdapterLayout::new(cfg, &model.config).unwrap());
            let w = AdapterWeights::identity(layout, 5);
            let got = run(&model, &c, &tokens, Some(&w));
            for (g, b) in got.iter().flatten().zip(base.iter().flatten()) {
                assert_eq!(
                    g.to_bits(),
                    b.to_bits(),
                    "{isa:?} {:?}",
                    w.layout.config.method
                );
            }
        }
    }
}

#[test]
fn peft_fixture_loads_and_gives_pefts_log_probs() {
    let dir = fixtures();
    let model = Decoder::open(dir.join("tiny.gguf")).unwrap();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = expected["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let rows = |k: &str| -> Vec<Vec<f64>> {
        expected[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_f64().unwrap())
                    .collect()
            })
            .collect()
    };
    let c = cpu(Isa::detect());
    let base = rows("base");
    let d = max_diff(&run(&model, &c, &tokens, None), &base);
    assert!(d < 1e-4, "base vs PyTorch: {d}");
    for name in ["lora", "lora_rs", "oft", "oft_exact"] {
        let w = peft::load(&dir.join(name), &model.config).unwrap();
        let want = rows(name);
        let got = run(&model, &c, &tokens, Some(&w));
        let d = max_diff(&got, &want);
        let moved = max_diff(&got, &base);
        eprintln!("{name}: max |Δ log-prob| vs PEFT {d:.2e} (vs the base {moved:.2})");
        assert!(d < 2e-4, "{name}: {d} from PEFT");
        assert!(
            moved > 0.05,
            "{name}: the adapter hardly changes the model ({moved})"
        );
    }
}

#[test]
fn saving_writes_pefts_format_and_loads_back_to_the_bit() {
    let dir = fixtures();
    let model = Decoder::open(dir.join("tiny.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let c = cpu(Isa::detect());
    let tokens = [3u32, 9, 27, 81, 50, 7];
    for name in ["lora", "lora_rs", "oft", "oft_exact"] {
        let src = dir.join(name);
        let w = peft::load(&src, &model.config).unwrap();
        let out = tmp.path().join(name);
        peft::save(&w, &out).unwrap();
        // Same config keys and values as PEFT wrote (target order aside), same tensors and bytes.
        let read = |p: &Path| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(p.join(peft::CONFIG_FILE)).unwrap())
                .unwrap()
        };
        let (mut ours, mut theirs) = (read(&out), read(&src));
        for v in [&mut ours, &mut theirs] {
            let mut t: Vec<String> = serde_json::from_value(v["target_modules"].take()).unwrap();
            t.sort();
            v["target_modules"] = serde_json::json!(t);
            v["base_model_name_or_path"] = serde_json::Value::Null;
        }
        assert_eq!(ours, theirs, "{name}: adapter_config.json");
        let (a, b) = (
            std::fs::read(out.join(peft::WEIGHTS_FILE)).unwrap(),
            std::fs::read(src.join(peft::WEIGHTS_FILE)).unwrap(),
        );
        let (sa, sb) = (
            safetensors::SafeTensors::deserialize(&a).unwrap(),
            safetensors::SafeTensors::deserialize(&b).unwrap(),
        );
        let mut names: Vec<_> = sa.names();
        names.sort();
        let mut names_b: Vec<_> = sb.names();
        names_b.sort();
        assert_eq!(names, names_b, "{name}: tensor names");
        for n in names {
            let (x, y) = (sa.tensor(n).unwrap(), sb.tensor(n).unwrap());
            assert_eq!(x.shape(), y.shape(), "{n}");
            assert_eq!(x.dtype(), y.dtype(), "{n}");
            assert_eq!(x.data(), y.data(), "{n}: values");
        }
        let back = peft::load(&out, &model.config).unwrap();
        assert_eq!(back.params, w.params);
        let (l1, l2) = (
            run(&model, &c, &tokens, Some(&w)),
            run(&model, &c, &tokens, Some(&back)),
        );
        assert!(l1
            .iter()
            .flatten()
            .zip(l2.iter().flatten())
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(
            peft::save(&w, &out).is_err(),
            "an existing folder is not overwritten"
        );
    }
}

/// One engine-style packed batch: every sequence's logits at all positions, in order.
fn run_batch(
    model: &Decoder,
    cpu: &Cpu,
    seqs: &[(&[u32], Option<&AdapterWeights>)],
) -> Vec<Vec<f32>> {
    let bs = 4;
    let mut tables = Vec::new();
    let mut next = 0u32;
    for (t, _) in seqs {
        let n = t.len().div_ceil(bs) as u32;
        tables.push((next..next + n).collect::<Vec<u32>>());
        next += n;
    }
    let mut cache = KvCache::new(
        model.config.num_layers,
        model.config.kv_dim(),
        bs,
        next as usize,
    );
    let batch: Vec<BatchSeq> = seqs
        .iter()
        .zip(&tables)
        .map(|((t, a), table)| BatchSeq {
            tokens: t,
            first_pos: 0,
            block_table: table,
            window_table: &[],
            logits: Logits::All,
            adapter: *a,
        })
        .collect();
    let logits = model.forward(cpu, &mut cache, &batch).unwrap();
    logits
        .chunks(model.config.vocab_size)
        .map(|r| r.to_vec())
        .collect()
}

#[test]
fn mixed_batches_keep_every_row_bitwise() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let oft1 = random_adapter(&model, oft(32, &Target::ALL), 1, 0.1);
    let oft2 = random_adapter(&model, oft(32, &Target::ALL), 2, 0.1);
    let lora1 = random_adapter(&model, lora(8, 16.0, &Target::ALL), 3, 0.2);
    let lora_qv = random_adapter(&model, lora(4, 4.0, &[Target::Q, Target::V]), 4, 0.2);
    let adapters: [Option<&AdapterWeights>; 5] =
        [None, Some(&oft1), Some(&oft2), Some(&lora1), Some(&lora_qv)];
    let prompts: Vec<Vec<u32>> = (0..7)
        .map(|s| {
            (0..(3 + 5 * s))
                .map(|i| (i * 31 + s * 7) % 250 + 3)
                .collect()
        })
        .collect();
    for isa in Isa::available()
        .into_iter()
        .filter(|i| *i != Isa::Reference)
    {
        let c = cpu(isa);
        // Each (prompt, adapter) pair alone is the reference.
        let mut alone = std::collections::HashMap::new();
        for (p, prompt) in prompts.iter().enumerate() {
            for (a, ad) in adapters.iter().enumerate() {
                alone.insert((p, a), run_batch(&model, &c, &[(prompt, *ad)]));
            }
        }
        // Batches mixing the base, two versions of one adapter and LoRA adapters, in several
        // arrangements (12 rows and more take the panel matmul path, fewer the row paths).
        for arrangement in 0..6usize {
            let picks: Vec<(usize, usize)> = (0..2 + arrangement * 2)
                .map(|k| {
                    (
                        (k * 3 + arrangement) % prompts.len(),
                        (k + arrangement) % adapters.len(),
                    )
                })
                .collect();
            let seqs: Vec<(&[u32], Option<&AdapterWeights>)> = picks
                .iter()
                .map(|&(p, a)| (prompts[p].as_slice(), adapters[a]))
                .collect();
            let got = run_batch(&model, &c, &seqs);
            let mut row = 0;
            for &(p, a) in &picks {
                for want in &alone[&(p, a)] {
                    assert!(
                        got[row].iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{isa:?} arrangement {arrangement}: prompt {p} adapter {a} differs in a batch"
                    );
                    row += 1;
                }
            }
        }
    }
}

fn write_adapter(dir: &Path, config: &serde_json::Value, tensors: &[(&str, Vec<usize>, Vec<f32>)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(peft::CONFIG_FILE), config.to_string()).unwrap();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            (
                n.to_string(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    std::fs::write(
        dir.join(peft::WEIGHTS_FILE),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
}

#[test]
fn malformed_adapters_are_refused_by_name() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["v_proj"]});
    let name = |l: usize, s: &str| {
        format!("base_model.model.model.layers.{l}.self_attn.v_proj.{s}.weight")
    };
    let (h, kvd) = (model.config.hidden, model.config.kv_dim());
    let good = |l: usize| {
        vec![
            (name(l, "lora_A"), vec![2, h], vec![0.1f32; 2 * h]),
            (name(l, "lora_B"), vec![kvd, 2], vec![0.1f32; kvd * 2]),
        ]
    };
    let all_good: Vec<_> = (0..2).flat_map(good).collect();
    let case = |label: &str, cfg: &serde_json::Value, ts: Vec<(String, Vec<usize>, Vec<f32>)>| {
        let d = tmp.path().join(label);
        let ts: Vec<(&str, Vec<usize>, Vec<f32>)> = ts
            .iter()
            .map(|(n, s, v)| (n.as_str(), s.clone(), v.clone()))
            .collect();
        write_adapter(&d, cfg, &ts);
        peft::load(&d, &model.config)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert_eq!(case("good", &cfg, all_good.clone()), Ok(()));
    let mut ts = all_good.clone();
    ts[1].1 = vec![kvd + 1, 2];
    ts[1].2 = vec![0.1; (kvd + 1) * 2];
    let e = case("shape", &cfg, ts).unwrap_err();
    assert!(e.contains(&name(0, "lora_B")) && e.contains("shape"), "{e}");
    let e = case("missing", &cfg, all_good[..3].to_vec()).unwrap_err();
    assert!(
        e.contains(&name(1, "lora_B")) && e.contains("missing"),
        "{e}"
    );
    let mut ts = all_good.clone();
    ts.push((name(7, "lora_A"), vec![2, h], vec![0.0; 2 * h]));
    let e = case("unknown", &cfg, ts).unwrap_err();
    assert!(
        e.contains(&name(7, "lora_A")) && e.contains("unknown"),
        "{e}"
    );
    let mut ts = all_good.clone();
    ts[2].2[5] = f32::NAN;
    let e = case("nan", &cfg, ts).unwrap_err();
    assert!(
        e.contains(&name(1, "lora_A")) && e.contains("non-finite"),
        "{e}"
    );
    let mut ts = all_good.clone();
    ts[0].2[0] = f32::INFINITY;
    let e = case("inf", &cfg, ts).unwrap_err();
    assert!(e.contains(&name(0, "lora_A")), "{e}");
    // LoRA on the LM head takes lm_head's tensors (not a layer's); OFT there is refused.
    let e = case(
        "target",
        &serde_json::json!({"peft_type": "LORA", "r": 2, "target_modules": ["lm_head"]}),
        all_good.clone(),
    )
    .unwrap_err();
    assert!(e.contains("v_proj") && e.contains("unknown tensor"), "{e}");
    let vocab = model.config.vocab_size;
    let head = |s: &str| format!("base_model.model.lm_head.{s}.weight");
    case(
        "head",
        &serde_json::json!({"peft_type": "LORA", "r": 2, "target_modules": ["lm_head"]}),
        vec![
            (head("lora_A"), vec![2, h], vec![0.5; 2 * h]),
            (head("lora_B"), vec![vocab, 2], vec![0.25; 2 * vocab]),
        ],
    )
    .expect("LoRA on lm_head loads");
    let e = case(
        "oft-head",
        &serde_json::json!({"peft_type": "OFT", "oft_block_size": 8, "target_modules": ["lm_head"]}),
        vec![],
    )
    .unwrap_err();
    assert!(e.contains("target_modules") && e.contains("lm_head"), "{e}");
    let e = case("block", &serde_json::json!({"peft_type": "OFT", "oft_block_size": 24, "target_modules": ["v_proj"]}), vec![]).unwrap_err();
    assert!(e.contains("oft_block_size"), "{e}");
    // An adapter made for a model of other dimensions (the PEFT fixture's 64-wide model, here 64
    // wide too but with another FFN width) is refused by the tensor that does not fit.
    let other = Decoder::open(fixtures().join("tiny.gguf")).unwrap();
    let e = peft::load(&fixtures().join("oft"), &model.config)
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert_ne!(other.config.ffn, model.config.ffn);
    assert!(
        e.contains("down_proj.oft_R.weight") || e.contains("shape") || e.contains("oft_block_size"),
        "{e}"
    );
}

/// A mixture-of-experts model adapts its attention: an adapter naming an expert projection is
/// refused by name, and the default targets are the four attention projections.
#[test]
fn moe_models_refuse_adapters_on_their_experts() {
    use flywheel::adapter::AdapterBase;
    let (_dir, path) = write_tiny(&TinySpec::qwen3moe());
    let model = Decoder::open(&path).unwrap();
    let shape = model.config.adapter_shape();
    assert_eq!(
        shape.default_targets(),
        vec![Target::Q, Target::K, Target::V, Target::O]
    );
    for t in [Target::Gate, Target::Up, Target::Down] {
        let err = AdapterLayout::new(lora(4, 8.0, &[Target::Q, t]), &model.config)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(t.peft_name()) && err.contains("expert"),
            "{err}"
        );
    }
    // A dense model keeps all seven.
    let (_d, dense) = write_tiny(&TinySpec::qwen3());
    let dense = Decoder::open(&dense).unwrap();
    assert_eq!(dense.config.adapter_shape().default_targets(), Target::ALL);
}
