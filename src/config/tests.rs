//! The settings as read: the file, the flags over it, and every check of `RawConfig::validate`.

use super::*;

#[test]
fn the_example_file_parses_and_cli_flags_win() {
    let text = include_str!("../../configs/serve.toml");
    let raw = RawConfig::from_toml(text).expect("configs/serve.toml parses");
    let cli = CliOverrides {
        port: Some(9999),
        ..Default::default()
    };
    let c = raw.validate(&cli).unwrap();
    assert_eq!(c.port, 9999);
    assert_eq!(c.block_size, 16);
    assert_eq!(c.api_key, None);
    assert_eq!(c.device, crate::engine::device::DeviceChoice::Auto);
    let cli = CliOverrides {
        device: Some("cpu".into()),
        ..Default::default()
    };
    let raw = RawConfig::from_toml(text).unwrap();
    let c = raw.validate(&cli).unwrap();
    assert_eq!(c.device, crate::engine::device::DeviceChoice::Cpu);
}

#[test]
fn typos_and_bad_values_are_rejected_by_name() {
    let e = RawConfig::from_toml("[engine]\nmax_num_seq = 3\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_num_seq"), "{e}");
    let raw = RawConfig::from_toml("[engine]\nblock_size = 12\n").unwrap();
    let e = raw.validate(&CliOverrides::default()).unwrap_err();
    assert!(e.to_string().contains("engine.block_size"), "{e}");
    let raw = RawConfig::from_toml("[engine]\ndevice = \"gpu\"\n").unwrap();
    let e = raw.validate(&CliOverrides::default()).unwrap_err();
    assert!(e.to_string().contains("engine.device"), "{e}");
    let raw = RawConfig::from_toml("[model]\nprecision = \"fp8\"\n").unwrap();
    let e = raw.validate(&CliOverrides::default()).unwrap_err();
    assert!(e.to_string().contains("model.precision"), "{e}");
    let raw = RawConfig::from_toml("[model]\nprecision = \"auto\"\n").unwrap();
    let c = raw.validate(&CliOverrides::default()).unwrap();
    assert_eq!(c.precision, PrecisionChoice::Auto);
    let cli = CliOverrides {
        precision: Some("bf16".into()),
        ..Default::default()
    };
    let raw = RawConfig::from_toml("[model]\nprecision = \"exact\"\n").unwrap();
    assert_eq!(raw.validate(&cli).unwrap().precision, PrecisionChoice::Bf16);
    use crate::model::gguf::WeightMemory;
    let raw = RawConfig::from_toml("[model]\nweights = \"mmap\"\n").unwrap();
    assert_eq!(raw.validate(&cli).unwrap().weights, WeightMemory::Mapped);
    let c = RawConfig::default()
        .validate(&CliOverrides::default())
        .unwrap();
    assert_eq!(c.weights, WeightMemory::HugePages);
    let flag = CliOverrides {
        weights: Some("mmap".into()),
        ..Default::default()
    };
    let raw = RawConfig::from_toml("[model]\nweights = \"huge_pages\"\n").unwrap();
    assert_eq!(raw.validate(&flag).unwrap().weights, WeightMemory::Mapped);
    let raw = RawConfig::from_toml("[model]\nweights = \"hugetlb\"\n").unwrap();
    let e = raw.validate(&CliOverrides::default()).unwrap_err();
    assert!(e.to_string().contains("model.weights"), "{e}");
    for (toml, key) in [
        (
            "[online]\ntrain_itl_budget = 0.9\n",
            "online.train_itl_budget",
        ),
        ("[online]\ntrain_share = 11\n", "online.train_share"),
        (
            "[online]\ntrain_max_stale_fraction = 2\n",
            "online.train_max_stale_fraction",
        ),
    ] {
        let raw = RawConfig::from_toml(toml).unwrap();
        let e = raw.validate(&CliOverrides::default()).unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
    }
}

#[test]
fn the_context_is_fitted_to_the_kv_cache_unless_it_is_set() {
    // f32: 30 layers x 16 tokens x 192 x 2 x 4 bytes = 720 KiB a block: 1 MiB holds 1 block.
    let cfg = |toml: &str, cli: &CliOverrides| {
        RawConfig::from_toml(&toml.replace("[engine]\n", "[engine]\nkv_cache_dtype = \"f32\"\n"))
            .unwrap()
            .validate(cli)
            .unwrap()
    };
    let none = CliOverrides::default();
    let small = cfg("[engine]\nkv_cache_mb = 1\n", &none);
    let f = small.fit_context(30, 192, 8192, None).unwrap();
    assert_eq!((f.max_model_len, f.num_kv_blocks), (16, 1));
    assert!(f.note.unwrap().contains("max_model_len is 16"));
    // Set, it must fit: an error naming the setting and what it needs.
    let set = cfg(
        "[engine]\nkv_cache_mb = 1\n[model]\nmax_model_len = 8192\n",
        &none,
    );
    let e = set
        .fit_context(30, 192, 8192, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("kv_cache_mb") && e.contains("needs 512"), "{e}");
    // The flag wins over the file, and is capped by the model's context with a note.
    let flag = CliOverrides {
        max_model_len: Some(100_000),
        ..CliOverrides::default()
    };
    let big = cfg("[engine]\nkv_cache_mb = 1024\n", &flag);
    let f = big.fit_context(30, 192, 8192, None).unwrap();
    assert_eq!((f.max_model_len, f.num_kv_blocks), (8192, 1456));
    assert!(f.note.is_some());
    // Fits: the model's context, no note.
    let roomy = cfg("[engine]\nkv_cache_mb = 1024\n", &none);
    let f = roomy.fit_context(30, 192, 4096, None).unwrap();
    assert_eq!((f.max_model_len, f.note), (4096, None));
    let tiny = cfg("[engine]\nkv_cache_mb = 1\n", &none);
    assert!(tiny.fit_context(300, 192, 8192, None).is_err());
    // f16 (the default): twice the tokens in the same memory.
    let half = RawConfig::from_toml("[engine]\nkv_cache_mb = 1\n")
        .unwrap()
        .validate(&none)
        .unwrap();
    assert_eq!(half.kv_dtype, KvDtype::F16);
    assert_eq!(
        half.fit_context(30, 192, 8192, None).unwrap().max_model_len,
        32
    );
}

/// Window-sized KV on real Gemma 3 shapes (f16 K/V, 1 GiB, blocks of 16): the sliding-window
/// layers' pool holds what `max_num_seqs` sequences can read of them; the global layers get the
/// rest, where that gains anything.
#[test]
fn sliding_window_layers_take_only_their_windows_memory() {
    let fit = |seqs: usize, layers, kv_dim, sliding, window, ctx| {
        let toml = format!("[engine]\nmax_num_seqs = {seqs}\n");
        let c = RawConfig::from_toml(&toml).unwrap();
        let c = c.validate(&CliOverrides::default()).unwrap();
        let w = WindowLayers {
            layers: sliding,
            window,
        };
        let f = c.fit_context(layers, kv_dim, ctx, Some(w)).unwrap();
        let all = c.fit_context(layers, kv_dim, ctx, None).unwrap();
        (f, all)
    };
    // Gemma 3 1B (26 layers, 22 with a window of 512, one KV head of 256), 64 sequences: the
    // global layers' blocks from 2520 (40k tokens) to 4328 (69k).
    let (f, all) = fit(64, 26, 256, 22, 512, 32768);
    assert_eq!(all.num_kv_blocks, 2520);
    assert_eq!((f.num_kv_blocks, f.num_window_blocks), (4328, Some(2192)));
    assert_eq!(f.max_model_len, 32768);
    // Gemma 3 4B (34 layers, 29 with a window of 1024, 4 KV heads of 256), 128k context: 7.7k
    // tokens fit with every layer global; with 4 sequences 26k, with one 45k.
    let (f, all) = fit(4, 34, 1024, 29, 1024, 131072);
    assert_eq!((all.max_model_len, f.max_model_len), (7696, 26432));
    assert_eq!(f.num_window_blocks, Some(280));
    let (f, _) = fit(1, 34, 1024, 29, 1024, 131072);
    assert_eq!(f.max_model_len, 44816);
    // 8 sequences' windows need more than the global layers' share: no pool.
    let (f, all) = fit(8, 34, 1024, 29, 1024, 131072);
    assert_eq!(
        (f.num_window_blocks, f.num_kv_blocks),
        (None, all.num_kv_blocks)
    );
}

#[test]
fn the_adapter_store_is_checked_and_the_flag_wins() {
    let check = |toml: &str, cli: &CliOverrides| {
        RawConfig::from_toml(toml)
            .unwrap()
            .validate(cli)
            .map(|c| c.online.adapter_store)
            .map_err(|e| e.to_string())
    };
    let none = CliOverrides::default();
    let file = "[online]\nadapter_store = \"file:///srv/adapters\"\n";
    assert_eq!(
        check(file, &none).unwrap().as_deref(),
        Some("file:///srv/adapters")
    );
    let flag = CliOverrides {
        adapter_store: Some("s3://bucket/p".into()),
        ..Default::default()
    };
    assert_eq!(
        check(file, &flag).unwrap().as_deref(),
        Some("s3://bucket/p")
    );
    for (toml, named) in [
        ("[online]\nadapter_store = \"gs://b/p\"\n", "gs://b/p"),
        ("[online]\nadapter_store = \"file://rel\"\n", "file://rel"),
        ("[online.adapter_store_options]\naws_region = \"x\"\n", "aws_region"),
        (
            "[online]\nadapter_store = \"s3://b/p\"\n[online.adapter_store_options]\nregio = \"x\"\n",
            "regio",
        ),
    ] {
        let e = check(toml, &none).unwrap_err();
        assert!(e.contains(named), "{toml}: {e}");
    }
}

/// The `[[learn]]` example in configs/serve.toml, its settings uncommented (promotion, an
/// evaluation set of every scorer), parses and validates.
#[test]
fn the_learn_example_with_its_evaluation_set_validates() {
    let text = include_str!("../../configs/serve.toml");
    let from = text.find("# [[learn]]").expect("the [[learn]] example");
    let setting = |l: &&str| {
        let l = l.trim_start_matches("# ");
        l.starts_with("[[learn")
            || l.split_once(" = ")
                .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
    };
    let toml: String = text[from..]
        .lines()
        .filter(setting)
        .map(|l| format!("{}\n", l.trim_start_matches("# ")))
        .collect();
    let raw = RawConfig::from_toml(&toml).unwrap_or_else(|e| panic!("{e}\n{toml}"));
    let c = raw.validate(&CliOverrides::default()).unwrap();
    let l = &c.learn[0];
    let scorers: Vec<&str> = l.eval.items.iter().map(|i| i.scorer.name()).collect();
    assert_eq!(
        scorers,
        ["contains", "json_schema", "length", "tool_call", "judge"]
    );
    assert_eq!(l.eval_max_tokens, 64);
    assert_eq!(l.promotion.canary.max_secs, Some(3600.0));
    assert_eq!(
        l.stop_on_repetition,
        Some(crate::engine::repetition::RepetitionRule::default())
    );
    assert_eq!(l.repetition_reward, Some(-1.0));
    assert_eq!(
        l.correction.map(|c| c.rule),
        Some(crate::train::correction::Rule::Truncate { cap: 2.0 })
    );
    assert_eq!(
        (l.version_policy, l.version_switch),
        (
            crate::online::config::VersionPolicy::Latest,
            crate::online::config::VersionSwitch::Keep
        )
    );
}

/// `--gpu-memory-utilization` / engine.gpu_memory_utilization: a share in (0, 1], the flag over
/// the file; engine.kv_cache_mb beside it stays the CPU's.
#[test]
fn the_gpu_memory_utilization_is_a_share_and_the_flag_wins() {
    let flag = |u: f64| CliOverrides {
        gpu_memory_utilization: Some(u),
        ..Default::default()
    };
    let raw = || RawConfig::from_toml("[engine]\ngpu_memory_utilization = 0.5\n").unwrap();
    assert_eq!(
        raw()
            .validate(&CliOverrides::default())
            .unwrap()
            .gpu_memory_utilization,
        Some(0.5)
    );
    assert_eq!(
        raw().validate(&flag(0.9)).unwrap().gpu_memory_utilization,
        Some(0.9)
    );
    assert_eq!(
        RawConfig::default()
            .validate(&CliOverrides::default())
            .unwrap()
            .gpu_memory_utilization,
        None
    );
    for bad in [0.0, -0.5, 1.5, f64::NAN] {
        let e = raw().validate(&flag(bad)).unwrap_err().to_string();
        assert!(
            e.contains("engine.gpu_memory_utilization") && e.contains("(0, 1]"),
            "{e}"
        );
    }
    let both = RawConfig::from_toml("[engine]\nkv_cache_mb = 2048\n").unwrap();
    let c = both.validate(&flag(0.9)).unwrap();
    assert_eq!(
        (c.gpu_memory_utilization, c.kv_cache_bytes),
        (Some(0.9), 2048 << 20)
    );
}
