//! Adapter versions in object storage (`--adapter-store file:///dir | s3://bucket/prefix`,
//! through the `object_store` crate): the trainer uploads each checkpoint folder under a name
//! never reused (`adapters/NAME/v-VERSION-NONCE/`, create-only puts, the manifest last, before
//! the version's row is committed); serving replicas (and a trainer on a new machine) fetch a
//! version into their data directory, where it is verified against its manifest before it is
//! loaded. The data directory becomes a cache: no shared volume is needed.
//!
//! S3 settings come from the environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_REGION`, `AWS_ENDPOINT`, `AWS_ALLOW_HTTP`, ...) and from `[online.adapter_store_options]`
//! (object_store's keys: `aws_endpoint`, `aws_region`, ...), which win.

use super::checkpoint::{remove_dir, MANIFEST_FILE};
use futures_util::StreamExt;
use object_store::path::{Path as Key, PathPart};
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// An adapter store: an object store, a key prefix in it, and the small runtime its client
/// runs on (the trainer thread blocks on it).
pub struct AdapterStore {
    store: Arc<dyn ObjectStore>,
    prefix: Key,
    url: String,
    rt: Option<tokio::runtime::Runtime>,
}

impl Drop for AdapterStore {
    fn drop(&mut self) {
        // Dropped anywhere, an async context included: never block there.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

fn key_under(prefix: &Key, rel: &str) -> Key {
    rel.split('/')
        .filter(|p| !p.is_empty())
        .fold(prefix.clone(), |k, p| k.join(PathPart::from(p)))
}

impl AdapterStore {
    /// Open `url` (checked by `check_url`); a file:// folder is created if missing.
    pub fn open(url: &str, options: &BTreeMap<String, String>) -> anyhow::Result<AdapterStore> {
        super::config::check_url(url, options)?;
        // A failing store fails a step (retried with backoff) instead of holding the trainer
        // for object_store's default three minutes.
        let retry = object_store::RetryConfig {
            max_retries: 3,
            retry_timeout: Duration::from_secs(20),
            ..Default::default()
        };
        let (store, prefix): (Arc<dyn ObjectStore>, Key) = if let Some(dir) =
            url.strip_prefix("file://")
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("adapter store {url}: cannot create {dir}: {e}"))?;
            // Deleting a version's last file removes its folder too (listed no more).
            let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
                .map_err(|e| anyhow::anyhow!("adapter store {url}: {e}"))?
                .with_automatic_cleanup(true);
            (Arc::new(fs), Key::default())
        } else {
            let rest = &url["s3://".len()..];
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let mut b = object_store::aws::AmazonS3Builder::new()
                .with_bucket_name(bucket)
                .with_retry(retry)
                .with_client_options(
                    object_store::ClientOptions::new()
                        .with_timeout(Duration::from_secs(30))
                        .with_connect_timeout(Duration::from_secs(5)),
                );
            // As `AmazonS3Builder::from_env`, but over these defaults (whose client options
            // would otherwise replace the environment's, AWS_ALLOW_HTTP among them).
            for (k, v) in std::env::vars().filter(|(k, _)| k.starts_with("AWS_")) {
                if let Ok(key) = k.to_ascii_lowercase().parse() {
                    b = b.with_config(key, v);
                }
            }
            for (k, v) in options {
                let key = k.to_ascii_lowercase().parse().expect("checked above");
                b = b.with_config(key, v.clone());
            }
            let s3 = b
                .build()
                .map_err(|e| anyhow::anyhow!("adapter store {url}: {e}"))?;
            (Arc::new(s3), key_under(&Key::default(), prefix))
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .thread_name("flywheel-adapter-store")
            .build()?;
        Ok(AdapterStore {
            store,
            prefix,
            url: url.to_string(),
            rt: Some(rt),
        })
    }

    fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.as_ref().expect("open until dropped").block_on(f)
    }

    fn key(&self, rel: &str) -> Key {
        key_under(&self.prefix, rel)
    }

    /// Upload checkpoint folder `dir` as version folder `rel`: each file with a create-only
    /// put (a name is written once), the manifest last (its presence says the rest is there).
    /// On failure what this call wrote is removed again (no row names it yet); what was there
    /// before (a put refused because the name exists) stays untouched.
    pub fn upload(&self, dir: &Path, rel: &str) -> anyhow::Result<()> {
        let mut names: Vec<String> = std::fs::read_dir(dir)?
            .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
            .filter(|n| n != MANIFEST_FILE)
            .collect();
        names.sort();
        names.push(MANIFEST_FILE.to_string());
        let mut written = Vec::new();
        let mut put = |name: &str| -> anyhow::Result<()> {
            let bytes = std::fs::read(dir.join(name))?;
            let key = self.key(rel).join(PathPart::from(name));
            let opts = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            self.block_on(self.store.put_opts(&key, PutPayload::from(bytes), opts))
                .map_err(|e| anyhow::anyhow!("{}: {e}", self.describe(&key)))?;
            written.push(key);
            Ok(())
        };
        let r = names.iter().try_for_each(|n| put(n));
        if r.is_err() {
            for key in written {
                if let Err(e) = self.block_on(self.store.delete(&key)) {
                    tracing::warn!(key = %self.describe(&key), error = %e, "cannot remove a failed upload");
                }
            }
        }
        r
    }

    fn describe(&self, key: &Key) -> String {
        format!("{} ({key})", self.url)
    }

    /// Fetch `names` (all the manifest lists when empty) of version folder `rel` into `dir`
    /// (replacing what is there): a temporary sibling holding them (fetched concurrently) and
    /// the manifest, renamed into place. Fails when the version has no manifest (not, or not
    /// completely, uploaded) or it does not list a name. Not synced: a cache, which the caller
    /// verifies against the manifest before each use.
    pub fn fetch(&self, rel: &str, dir: &Path, names: &[&str]) -> anyhow::Result<()> {
        let base = self.key(rel);
        let get = async |name: &str| -> anyhow::Result<Vec<u8>> {
            let key = base.clone().join(PathPart::from(name));
            let r = async { self.store.get(&key).await?.bytes().await }.await;
            r.map(|b| b.to_vec())
                .map_err(|e| anyhow::anyhow!("{}: {e}", self.describe(&key)))
        };
        let manifest = self.block_on(get(MANIFEST_FILE))?;
        let m: serde_json::Value = serde_json::from_slice(&manifest)
            .map_err(|e| anyhow::anyhow!("{}: unreadable manifest ({e})", self.describe(&base)))?;
        let listed = m["files"].as_object().ok_or_else(|| {
            anyhow::anyhow!("{}: the manifest lists no files", self.describe(&base))
        })?;
        let wanted: Vec<&str> = match names {
            [] => listed.keys().map(String::as_str).collect(),
            some => some.to_vec(),
        };
        for name in &wanted {
            // Names from the store never become paths beyond the folder.
            anyhow::ensure!(
                listed.contains_key(*name)
                    && !name.is_empty()
                    && !name.contains(['/', '\\'])
                    && !matches!(*name, "." | ".." | MANIFEST_FILE),
                "{}: the manifest does not list a file '{name}'",
                self.describe(&base)
            );
        }
        let bodies = self.block_on(futures_util::future::try_join_all(
            wanted.iter().map(|n| get(n)),
        ))?;
        let parent = dir.parent().expect("a checkpoint path has a parent");
        std::fs::create_dir_all(parent)?;
        let leaf = dir.file_name().expect("named").to_string_lossy();
        let tmp = parent.join(format!(".tmp-fetch-{leaf}"));
        remove_dir(&tmp)?;
        let write = || -> anyhow::Result<()> {
            std::fs::create_dir_all(&tmp)?;
            for (name, body) in wanted.iter().zip(&bodies) {
                std::fs::write(tmp.join(name), body)?;
            }
            std::fs::write(tmp.join(MANIFEST_FILE), &manifest)?;
            remove_dir(dir)?;
            std::fs::rename(&tmp, dir)?;
            Ok(())
        };
        let r = write();
        if r.is_err() {
            let _ = remove_dir(&tmp);
        }
        r
    }

    /// Remove version folder `rel` from the store: its manifest first (a half-removed version
    /// reads as absent), then the rest.
    pub fn delete(&self, rel: &str) -> anyhow::Result<()> {
        let base = self.key(rel);
        self.block_on(async {
            match self
                .store
                .delete(&base.clone().join(PathPart::from(MANIFEST_FILE)))
                .await
            {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
            let keys: Vec<Key> = self
                .store
                .list(Some(&base))
                .map(|m| m.map(|m| m.location))
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<Result<_, _>>()?;
            for k in keys {
                match self.store.delete(&k).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        })
        .map_err(|e| anyhow::anyhow!("{}: {e}", self.describe(&base)))
    }

    /// The version folders under `adapters/NAME` in the store (relative paths).
    pub fn versions(&self, adapter_rel: &str) -> anyhow::Result<Vec<String>> {
        let base = self.key(adapter_rel);
        let listed = self
            .block_on(self.store.list_with_delimiter(Some(&base)))
            .map_err(|e| anyhow::anyhow!("{}: {e}", self.describe(&base)))?;
        let mut out: Vec<String> = listed
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(|f| format!("{adapter_rel}/{f}")))
            .collect();
        out.sort();
        Ok(out)
    }
}
