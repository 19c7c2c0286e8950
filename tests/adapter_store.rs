//! The adapter store (`online::adapter_store`) against a folder (`file://`) and an
//! S3-compatible server (moto, `s3://`; skipped with a message where moto is not installed):
//! a version folder uploads with create-only puts and comes back byte for byte; a name is never
//! written twice (a second upload is refused and leaves the first intact); a version without
//! its manifest (an interrupted upload) is not fetched; deleting removes it.

mod common;

use flywheel::online::adapter_store::AdapterStore;
use std::collections::BTreeMap;
use std::path::Path;

/// A version folder as the trainer writes it: two files and a manifest.
fn version_folder(dir: &Path, tag: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("adapter_model.safetensors"),
        format!("weights {tag}"),
    )
    .unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        format!("{{\"tag\": \"{tag}\"}}"),
    )
    .unwrap();
    let manifest = serde_json::json!({"version": 2, "lineage": 1, "files": {
        "adapter_model.safetensors": "x", "adapter_config.json": "y"}});
    std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// The promises, on `store`; `remove_object(rel, file)` deletes one object behind its back.
fn suite(store: &AdapterStore, remove_object: &dyn Fn(&str, &str)) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    version_folder(&src, "a");
    let rel = "adapters/l/v-00000002-00000000000000aa";
    store.upload(&src, rel).unwrap();
    let dst = tmp.path().join("cache").join(rel);
    store.fetch(rel, &dst, &[]).unwrap();
    assert_eq!(files(&dst), files(&src));
    // Only what is asked for (and the manifest); a name the manifest does not list is refused.
    let part = tmp.path().join("part");
    store.fetch(rel, &part, &["adapter_config.json"]).unwrap();
    let got: Vec<String> = files(&part).into_keys().collect();
    assert_eq!(got, ["adapter_config.json", "manifest.json"]);
    for bad in ["optimizer.safetensors", "../x", "manifest.json"] {
        let e = store.fetch(rel, &part, &[bad]).unwrap_err().to_string();
        assert!(e.contains(bad), "{e}");
    }
    // Written once: a second upload under the name is refused, the first stays as it was.
    let other = tmp.path().join("other");
    version_folder(&other, "b");
    let e = store.upload(&other, rel).unwrap_err().to_string();
    assert!(e.to_lowercase().contains("exist"), "{e}");
    std::fs::remove_dir_all(&dst).unwrap();
    store.fetch(rel, &dst, &[]).unwrap();
    assert_eq!(files(&dst), files(&src));
    // A second version; both listed.
    let rel2 = "adapters/l/v-00000003-00000000000000bb";
    store.upload(&other, rel2).unwrap();
    assert_eq!(store.versions("adapters/l").unwrap(), vec![rel, rel2]);
    // Without its manifest (an upload cut short) a version is not fetched, and the folder it
    // would replace stays.
    remove_object(rel2, "manifest.json");
    let e = store.fetch(rel2, &dst, &[]).unwrap_err().to_string();
    assert!(e.contains("manifest.json"), "{e}");
    assert_eq!(files(&dst), files(&src));
    // Deleted: gone from the listing and not fetched.
    store.delete(rel).unwrap();
    store.delete(rel2).unwrap();
    assert!(store.versions("adapters/l").unwrap().is_empty());
    assert!(store.fetch(rel, &tmp.path().join("gone"), &[]).is_err());
    assert!(!tmp.path().join("gone").exists());
}

#[test]
fn a_folder_store_keeps_its_promises() {
    let root = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store", root.path().display());
    let store = AdapterStore::open(&url, &BTreeMap::new()).unwrap();
    let base = root.path().join("store");
    suite(&store, &|rel, file| {
        std::fs::remove_file(base.join(rel).join(file)).unwrap()
    });
}

#[test]
fn an_s3_store_keeps_its_promises() {
    let Some(s3) = common::s3::S3::start() else {
        return;
    };
    let url = format!("s3://{}/team/ckpt", s3.bucket);
    let store = AdapterStore::open(&url, &s3.options()).unwrap();
    suite(&store, &|rel, file| {
        s3.delete(&format!("team/ckpt/{rel}/{file}"))
    });
    // Every object lives under the URL's prefix.
    store
        .upload(
            &{
                let d = tempfile::tempdir().unwrap().keep();
                version_folder(&d, "c");
                d
            },
            "adapters/m/v-00000001-00000000000000cc",
        )
        .unwrap();
    let keys = s3.keys();
    assert_eq!(keys.len(), 3, "{keys:?}");
    assert!(
        keys.iter()
            .all(|k| k.starts_with("team/ckpt/adapters/m/v-00000001-")),
        "{keys:?}"
    );
    // Settings from the environment (AWS_*, as object_store's own from_env reads them) work
    // alike, AWS_ALLOW_HTTP included. (The other test of this file reads no environment.)
    for (k, v) in s3.options() {
        std::env::set_var(k.to_ascii_uppercase(), v);
    }
    let from_env = AdapterStore::open(&url, &BTreeMap::new()).unwrap();
    for (k, _) in s3.options() {
        std::env::remove_var(k.to_ascii_uppercase());
    }
    let got = tempfile::tempdir().unwrap();
    from_env
        .fetch(
            "adapters/m/v-00000001-00000000000000cc",
            &got.path().join("v"),
            &[],
        )
        .unwrap();
    assert_eq!(
        std::fs::read(got.path().join("v/adapter_config.json")).unwrap(),
        b"{\"tag\": \"c\"}"
    );
    // A store that cannot be reached fails within its bounded retries, naming the URL.
    let mut bad = s3.options();
    bad.insert(
        "aws_endpoint".into(),
        format!("http://127.0.0.1:{}", common::pg::free_port()),
    );
    let dead = AdapterStore::open(&url, &bad).unwrap();
    let t0 = std::time::Instant::now();
    let e = dead.fetch(
        "adapters/m/v-00000001-00000000000000cc",
        &std::env::temp_dir().join("never"),
        &[],
    );
    let e = format!("{:#}", e.unwrap_err());
    assert!(e.contains(&url), "{e}");
    assert!(t0.elapsed().as_secs() < 60, "{:?}", t0.elapsed());
}
