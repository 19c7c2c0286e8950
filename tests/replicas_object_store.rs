//! A trainer and serving replicas with no shared directory: versions travel through an
//! S3-compatible object store (moto), the rollout store is a throwaway PostgreSQL (each skipped
//! with a message where it is not installed).

mod common;

use common::replicas::{reward_group, start_role, Shared};

/// The version folders of `l` in a data directory.
fn local_versions(data: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(data.join("adapters/l"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A trainer and serving replicas with no shared directory: versions travel through an
/// S3-compatible object store (moto). The trainer uploads each version (create-only, manifest
/// last) before committing it; replicas fetch, verify and serve it and drop the copy of the one
/// before; a trainer restarted on an empty data directory (a new machine) resumes from the
/// store; a replica never serves an upload it cannot verify (it stays on the version before)
/// and catches up once it can.
#[test]
fn replicas_follow_the_trainer_through_an_object_store() {
    use common::online::*;
    let Some(s3) = common::s3::S3::start() else {
        return;
    };
    let Some(sh) = Shared::new(&s3.online_config("ckpt")) else {
        return;
    };
    let root = tempfile::tempdir().unwrap();
    let own = |n: &str| root.path().join(n);
    // No reward guard: a lineage then keeps its newest two checkpoints (with one, the guard's
    // window + 2), which the retention check below counts on.
    let cfg = sh
        .cfg
        .replace("lora_r = 4\n", "lora_r = 4\nguard_window = 0\n");
    assert_ne!(cfg, sh.cfg);
    let start = |role: &str, data: &str| start_role(&sh.model, &own(data), &cfg, &sh.url, role);
    let trainer = start("train", "t1");
    let (a, b) = (start("serve", "a"), start("serve", "b"));
    reward_group(&a, &b);
    wait_status(&trainer, "l", 60, |st| st["version"] == 2);
    for s in [&a, &b] {
        wait_status(s, "l", 10, |st| st["version"] == 2);
        assert_eq!(sample(s, "l", 1, 2, USER)["adapter_version"], 2);
        assert_eq!(
            s.metric("flywheel_adapter_store_seconds_count{op=\"fetch\"}"),
            1.0
        );
    }
    assert_eq!(
        trainer.metric("flywheel_adapter_store_seconds_count{op=\"upload\"}"),
        1.0
    );
    // Under the URL's prefix: the version's folder, a name of its own, the manifest included.
    let keys = s3.keys();
    let v2: Vec<&String> = keys
        .iter()
        .filter(|k| k.starts_with("ckpt/adapters/l/v-00000002-"))
        .collect();
    assert_eq!(v2.len(), 5, "{keys:?}");
    assert!(v2.iter().any(|k| k.ends_with("/manifest.json")), "{keys:?}");
    let folder = v2[0].rsplit_once('/').unwrap().0.to_string();
    let leaf = folder.rsplit_once('/').unwrap().1.to_string();
    assert_eq!(local_versions(&own("a")), vec![leaf.clone()]);
    // kill -9 of the trainer; it comes back on an empty data directory and resumes from the
    // store (same version, one step taken); the replicas follow its next step and drop their
    // copy of version 2.
    drop(trainer);
    let trainer = start("train", "t2");
    let st = status(&trainer, "l");
    assert_eq!(
        (st["version"].clone(), st["steps"].clone()),
        (2.into(), 1.into())
    );
    reward_group(&b, &a);
    wait_status(&trainer, "l", 60, |st| st["version"] == 3);
    for (s, d) in [(&a, "a"), (&b, "b")] {
        wait_status(s, "l", 10, |st| st["version"] == 3);
        let v = local_versions(&own(d));
        assert!(v.len() == 1 && v[0].starts_with("v-00000003-"), "{v:?}");
    }
    // Version 3's weights altered in the store: a new replica does not serve it; it serves
    // version 2 (verified) and keeps trying; restored, it catches up.
    let keys = s3.keys();
    let weights = keys
        .iter()
        .find(|k| {
            k.starts_with("ckpt/adapters/l/v-00000003-")
                && k.ends_with("/adapter_model.safetensors")
        })
        .unwrap()
        .clone();
    let good = std::fs::read(own("t2").join(weights.strip_prefix("ckpt/").unwrap())).unwrap();
    let mut bad = good.clone();
    bad[good.len() - 1] ^= 1;
    s3.overwrite(&weights, bad);
    let c = start("serve", "c");
    assert_eq!(status(&c, "l")["version"], 2);
    assert_eq!(sample(&c, "l", 1, 2, USER)["adapter_version"], 2);
    let st = wait_status(&c, "l", 20, |st| !st["last_error"].is_null());
    assert!(
        st["last_error"]["message"]
            .as_str()
            .unwrap()
            .contains("SHA-256"),
        "{st}"
    );
    assert_eq!(st["state"], "running", "{st}");
    assert!(c.metric("flywheel_replica_version_lag{adapter=\"l\"}") >= 1.0);
    s3.overwrite(&weights, good);
    wait_status(&c, "l", 30, |st| st["version"] == 3);
    assert_eq!(sample(&c, "l", 1, 2, USER)["adapter_version"], 3);
    // Retention (the newest two versions) applies to the store too, and uploads no version
    // names (a step whose commit failed after its upload) go, in the store and on disk.
    let orphan = "adapters/l/v-00000009-00000000deadbeef";
    s3.overwrite(&format!("ckpt/{orphan}/manifest.json"), b"{}".to_vec());
    std::fs::create_dir_all(own("t2").join(orphan)).unwrap();
    reward_group(&c, &trainer);
    wait_status(&trainer, "l", 60, |st| st["version"] == 4);
    let keys = s3.keys();
    let has = |v: &str| keys.iter().any(|k| k.contains(&format!("/{v}-")));
    assert_eq!(
        (
            has("v-00000002"),
            has("v-00000003"),
            has("v-00000004"),
            has("v-00000009")
        ),
        (false, true, true, false),
        "{keys:?}"
    );
    let local = local_versions(&own("t2"));
    assert!(
        local.len() == 2 && local[0].starts_with("v-00000003-"),
        "{local:?}"
    );
    // The log says which is which: version 2 retired by retention, version 9 a failed upload.
    let log = trainer.stderr();
    let line = |v: &str| {
        log.lines()
            .find(|l| l.contains(" removed ") && l.contains(v))
            .unwrap_or_else(|| panic!("no removal of {v} in the log:\n{log}"))
            .to_string()
    };
    assert!(line("v-00000002-").contains("retention retired"), "{log}");
    assert!(line("v-00000009-").contains("failed commit"), "{log}");
}
