//! Named adapters, each an `arc-swap` slot holding its current immutable `AdapterVersion`.
//!
//! Publishing builds the version entirely on the caller's thread (OFT rotations included), then
//! stores it with one atomic swap: the engine never waits for it and never sees it happen. A request
//! pins the version current at its admission (`Pinned`, an `Arc` plus an in-flight count) and its
//! sequences keep that `Arc` to their end, through preemption and recompute; a version is freed
//! when its last user drops it.
//!
//! A name's version numbers only grow, across delete and re-create: the registry remembers the
//! last number of every name it has held. A learning adapter's slot is owned by its lineage (the
//! trainer's id for it): only that owner publishes to it; other publishers get `Learning`.

use super::{AdapterBase, AdapterError, AdapterLimits, AdapterWeights, BaseShape};
use crate::metrics::Metrics;
use arc_swap::{ArcSwap, ArcSwapOption};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Instant;

/// One immutable version of a named adapter.
pub struct AdapterVersion {
    pub name: Arc<str>,
    /// 1, 2, 3, ... from the adapter's first load or creation.
    pub version: u64,
    /// The version this one replaced (None for version 1).
    pub parent: Option<u64>,
    /// Unix seconds.
    pub created: u64,
    /// Unique in the process (never 0, which is the base): the prefix cache's key.
    pub uid: u64,
    pub weights: AdapterWeights,
    in_flight: AtomicUsize,
    alive: Arc<AtomicUsize>,
}

impl AdapterVersion {
    /// Requests pinned to this version and not yet finished.
    pub fn num_in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// "NAME@N": the system fingerprint of its completions.
    pub fn fingerprint(&self) -> String {
        format!("{}@{}", self.name, self.version)
    }
}

impl Drop for AdapterVersion {
    fn drop(&mut self) {
        self.alive.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for AdapterVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AdapterVersion({}@{})", self.name, self.version)
    }
}

/// A request's hold on a version: counts as in flight until dropped.
pub struct Pinned(Arc<AdapterVersion>);

impl Pinned {
    pub fn new(v: Arc<AdapterVersion>) -> Pinned {
        v.in_flight.fetch_add(1, Ordering::AcqRel);
        Pinned(v)
    }

    pub fn version(&self) -> &Arc<AdapterVersion> {
        &self.0
    }
}

impl Clone for Pinned {
    fn clone(&self) -> Pinned {
        Pinned::new(self.0.clone())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::ops::Deref for Pinned {
    type Target = AdapterVersion;
    fn deref(&self) -> &AdapterVersion {
        &self.0
    }
}

/// One named adapter.
pub struct Slot {
    pub name: Arc<str>,
    /// Unix seconds of its first version.
    pub created: u64,
    current: ArcSwap<AdapterVersion>,
    /// Serializes publishers of this name (numbering); readers never take it.
    publish_lock: Mutex<()>,
    /// The lineage that learns into this slot (0: none; anyone may publish).
    owner: AtomicU64,
    /// Every version published, as weak references: the ones still alive upgrade.
    history: Mutex<Vec<Weak<AdapterVersion>>>,
    /// A candidate that takes this fraction of new requests (a canary), if one runs.
    canary: ArcSwapOption<(Arc<AdapterVersion>, f64)>,
}

impl Slot {
    pub fn current(&self) -> Arc<AdapterVersion> {
        self.current.load_full()
    }

    /// The current version's uid (cheaper than `current`: no reference taken).
    pub fn current_uid(&self) -> u64 {
        self.current.load().uid
    }

    /// The version a new request runs on: the current one, or a canary's candidate for its
    /// fraction of requests.
    pub fn pick(&self) -> Arc<AdapterVersion> {
        if let Some(c) = self.canary.load().as_ref() {
            let u = (crate::util::random_u64() >> 11) as f64 / (1u64 << 53) as f64;
            if u < c.1 {
                return c.0.clone();
            }
        }
        self.current()
    }

    /// The canary's candidate and fraction, if one runs.
    pub fn canary(&self) -> Option<(u64, f64)> {
        self.canary.load().as_ref().map(|c| (c.0.version, c.1))
    }

    /// The lineage learning into this slot, if one is.
    pub fn owner(&self) -> Option<u64> {
        Some(self.owner.load(Ordering::Acquire)).filter(|o| *o != 0)
    }

    /// Versions still held by someone (the current one always), oldest first.
    pub fn versions_alive(&self) -> Vec<Arc<AdapterVersion>> {
        let mut h = self.history.lock().unwrap_or_else(|e| e.into_inner());
        h.retain(|w| w.strong_count() > 0);
        h.iter().filter_map(Weak::upgrade).collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("adapter name '{0}': {1}")]
    BadName(String, &'static str),
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    #[error(
        "'{0}' is a learning adapter: its versions come from its trainer (stop learning with \
         DELETE /v1/adapters/{0} first)"
    )]
    Learning(String),
    #[error("the adapter '{0}' is gone, or learns in another lineage")]
    Gone(String),
}

/// Who publishes a version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Publisher {
    /// An operator (files, the admin API): refused on a learning adapter.
    Admin,
    /// The trainer of lineage `id`: creates or takes over the slot, numbering from at least
    /// `min_version`.
    Claim { id: u64, min_version: u64 },
    /// The trainer of lineage `id`, stepping: only to the slot it owns.
    Owner(u64),
}

/// A name an adapter may take: 1–128 letters, digits, `-`, `_`, `.`, `@`, `/` or `:` (the names
/// orchestrators write: `agent-001@3`, `org/model-lora`), not starting with `.` or `/`, no empty
/// path segment. Its files live under `adapter_file_name`, never under the name itself.
pub fn check_adapter_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name.len() > 128 {
        return Err("must have 1 to 128 characters");
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@' | '/' | ':'))
    {
        return Err("may hold only letters, digits, '-', '_', '.', '@', '/' and ':'");
    }
    if name.starts_with(['.', '/']) || name.ends_with('/') || name.contains("//") {
        return Err("must not start with '.' or '/', end with '/' or hold '//'");
    }
    Ok(())
}

/// The one file-name component an adapter's files live under: the name with every character
/// but letters, digits, '-', '_' and '.' written as %XX (so `Qwen/x@3` is `Qwen%2Fx%403`). Names
/// are never joined to a path raw; this is one component, and two names never share one.
pub fn adapter_file_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Every named adapter of the server.
pub struct Registry {
    slots: RwLock<BTreeMap<String, Arc<Slot>>>,
    /// The base's shape: adapters for other dimensions are refused.
    pub model: BaseShape,
    /// What requests and files may make an adapter allocate.
    pub limits: AdapterLimits,
    /// The last version number of every name ever held (kept after removal: never reused).
    last_version: Mutex<BTreeMap<String, u64>>,
    /// Names adapters may not take (the base model's).
    reserved: Vec<String>,
    next_uid: AtomicU64,
    alive: Arc<AtomicUsize>,
    metrics: Arc<Metrics>,
}

impl Registry {
    pub fn new(model: &impl AdapterBase, reserved: Vec<String>, metrics: Arc<Metrics>) -> Registry {
        Registry {
            slots: RwLock::new(BTreeMap::new()),
            model: model.adapter_shape(),
            limits: AdapterLimits::default(),
            last_version: Mutex::new(BTreeMap::new()),
            reserved,
            next_uid: AtomicU64::new(1),
            alive: Arc::new(AtomicUsize::new(0)),
            metrics,
        }
    }

    /// Set the limits (before the registry is shared).
    pub fn with_limits(mut self, limits: AdapterLimits) -> Registry {
        self.limits = limits;
        self
    }

    /// 1–128 characters of letters, digits, `-`, `_`, `.`, `@`, `/`, `:` (as orchestrators write
    /// them: `agent-001@3`, `org/model-lora`), not starting with `.` or `/`; not the base model's
    /// name.
    pub fn check_name(&self, name: &str) -> Result<(), RegistryError> {
        if let Err(why) = check_adapter_name(name) {
            return Err(RegistryError::BadName(name.to_string(), why));
        }
        let bad = |why| Err(RegistryError::BadName(name.to_string(), why));
        if self.reserved.iter().any(|r| r == name) {
            return bad("is the base model's name");
        }
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<Arc<Slot>> {
        self.slots
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// Pin the current version of `name` for a request.
    pub fn pin(&self, name: &str) -> Option<Pinned> {
        self.get(name).map(|s| Pinned::new(s.pick()))
    }

    /// Send a `fraction` of `name`'s new requests to `candidate` (a canary; None ends it).
    pub fn set_canary(
        &self,
        name: &str,
        candidate: Option<(Arc<AdapterVersion>, f64)>,
    ) -> Result<(), RegistryError> {
        let slot = self
            .get(name)
            .ok_or_else(|| RegistryError::Gone(name.to_string()))?;
        slot.canary.store(candidate.map(Arc::new));
        Ok(())
    }

    /// Every adapter, by name.
    pub fn list(&self) -> Vec<Arc<Slot>> {
        self.slots
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Publish `weights` as the next version of `name` (version 1 of a new adapter): one atomic
    /// store; running sequences keep the version they pinned. Returns the new version and whether
    /// the name is new.
    pub fn publish(
        &self,
        name: &str,
        weights: AdapterWeights,
    ) -> Result<(Arc<AdapterVersion>, bool), RegistryError> {
        self.publish_as(name, weights, Publisher::Admin)
    }

    /// The last version number `name` ever had in this process (0: never held).
    pub fn last_version(&self, name: &str) -> u64 {
        let g = self.last_version.lock().unwrap_or_else(|e| e.into_inner());
        g.get(name).copied().unwrap_or(0)
    }

    /// Count `version` as a number `name` had (the next publish takes one above it).
    pub fn note_version(&self, name: &str, version: u64) {
        let mut g = self.last_version.lock().unwrap_or_else(|e| e.into_inner());
        let v = g.entry(name.to_string()).or_default();
        *v = (*v).max(version);
    }

    /// `publish` by `who` (see `Publisher`). Version numbers are the previous one + 1, never
    /// below what the name ever had + 1 (nor below a claim's `min_version`).
    pub fn publish_as(
        &self,
        name: &str,
        weights: AdapterWeights,
        who: Publisher,
    ) -> Result<(Arc<AdapterVersion>, bool), RegistryError> {
        self.check_name(name)?;
        if weights.layout.model != self.model {
            return Err(RegistryError::Adapter(super::config_error(
                "base_model",
                "the adapter was made for a model of other dimensions",
            )));
        }
        let swap_secs: f64;
        let mut old = None;
        let existing = self.get(name);
        let floor = self.last_version(name) + 1;
        let (v, is_new) = match existing {
            Some(slot) => {
                let _g = slot.publish_lock.lock().unwrap_or_else(|e| e.into_inner());
                let mut floor = floor;
                match (who, slot.owner()) {
                    (Publisher::Admin, Some(_)) => {
                        return Err(RegistryError::Learning(name.to_string()))
                    }
                    (Publisher::Admin, None) => {}
                    (Publisher::Owner(id), owner) if owner != Some(id) => {
                        return Err(RegistryError::Gone(name.to_string()))
                    }
                    (Publisher::Owner(_), _) => {}
                    (Publisher::Claim { id, min_version }, owner) => {
                        if owner.is_some_and(|o| o != id) {
                            return Err(RegistryError::Learning(name.to_string()));
                        }
                        slot.owner.store(id, Ordering::Release);
                        floor = floor.max(min_version);
                    }
                }
                let cur = slot.current();
                let v = self.new_version(
                    slot.name.clone(),
                    (cur.version + 1).max(floor),
                    Some(cur.version),
                    weights,
                );
                drop(cur);
                let t0 = Instant::now();
                // The old version is dropped after the timing (freeing it is not the swap).
                old = Some(slot.current.swap(v.clone()));
                swap_secs = t0.elapsed().as_secs_f64();
                slot.history
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Arc::downgrade(&v));
                (v, false)
            }
            None => {
                let (owner, first) = match who {
                    Publisher::Admin => (0, floor),
                    Publisher::Claim { id, min_version } => (id, floor.max(min_version)),
                    Publisher::Owner(_) => return Err(RegistryError::Gone(name.to_string())),
                };
                let mut slots = self.slots.write().unwrap_or_else(|e| e.into_inner());
                if slots.contains_key(name) {
                    // Another publisher created it meanwhile: publish on top of theirs.
                    drop(slots);
                    return self.publish_as(name, weights, who);
                }
                let n: Arc<str> = Arc::from(name);
                let v = self.new_version(n.clone(), first, None, weights);
                let t0 = Instant::now();
                slots.insert(
                    name.to_string(),
                    Arc::new(Slot {
                        name: n,
                        created: v.created,
                        current: ArcSwap::new(v.clone()),
                        publish_lock: Mutex::new(()),
                        owner: AtomicU64::new(owner),
                        history: Mutex::new(vec![Arc::downgrade(&v)]),
                        canary: ArcSwapOption::empty(),
                    }),
                );
                swap_secs = t0.elapsed().as_secs_f64();
                (v, true)
            }
        };
        drop(old);
        self.note_version(name, v.version);
        let m = &self.metrics;
        m.adapter_publishes.inc();
        m.adapter_publish_seconds.observe(swap_secs);
        m.adapter_version
            .with_label_values(&[name])
            .set(v.version as i64);
        m.adapter_versions_alive
            .set(self.alive.load(Ordering::Acquire) as i64);
        Ok((v, is_new))
    }

    /// A new version (counted alive, with a uid of its own).
    fn new_version(
        &self,
        name: Arc<str>,
        version: u64,
        parent: Option<u64>,
        weights: AdapterWeights,
    ) -> Arc<AdapterVersion> {
        self.alive.fetch_add(1, Ordering::AcqRel);
        Arc::new(AdapterVersion {
            name,
            version,
            parent,
            created: crate::util::unix_now(),
            uid: self.next_uid.fetch_add(1, Ordering::AcqRel),
            weights,
            in_flight: AtomicUsize::new(0),
            alive: self.alive.clone(),
        })
    }

    /// A version of `name` numbered `version` (after `parent`) that does not serve yet (a
    /// candidate its trainer evaluates, or holds): requests run on it only by holding it, until
    /// `serve` makes it current. Its number is taken once `serve` or `note_version` says so (a
    /// candidate whose step failed leaves the numbering as it was).
    pub fn candidate(
        &self,
        name: &str,
        version: u64,
        parent: Option<u64>,
        weights: AdapterWeights,
    ) -> Result<Arc<AdapterVersion>, RegistryError> {
        let slot = self
            .get(name)
            .ok_or_else(|| RegistryError::Gone(name.to_string()))?;
        Ok(self.new_version(slot.name.clone(), version, parent, weights))
    }

    /// Serve version `version` of `name` (by its owner, lineage `owner`), a number it had
    /// before: a rollback or a pin. The very version if someone still holds it, else `weights`
    /// under that number (they are its weights, from its checkpoint). Numbers are not reused:
    /// the next publish still takes one above every number the name had.
    pub fn revert(
        &self,
        name: &str,
        version: u64,
        weights: AdapterWeights,
        owner: u64,
    ) -> Result<Arc<AdapterVersion>, RegistryError> {
        let slot = self.owned(name, owner)?;
        let alive = slot
            .versions_alive()
            .into_iter()
            .find(|v| v.version == version);
        let v = match alive {
            Some(v) => v,
            None => self.new_version(slot.name.clone(), version, None, weights),
        };
        self.swap_in(&slot, v.clone(), owner)?;
        Ok(v)
    }

    /// Serve `v` (a `candidate` of `name`, or a version it had) by its owner, lineage `owner`.
    pub fn serve(&self, v: Arc<AdapterVersion>, owner: u64) -> Result<(), RegistryError> {
        let slot = self.owned(&v.name, owner)?;
        self.swap_in(&slot, v, owner)
    }

    /// `name`'s slot, if lineage `owner` learns into it.
    fn owned(&self, name: &str, owner: u64) -> Result<Arc<Slot>, RegistryError> {
        match self.get(name) {
            Some(slot) if slot.owner() == Some(owner) => Ok(slot),
            _ => Err(RegistryError::Gone(name.to_string())),
        }
    }

    /// Make `v` the current version of `slot` (kept in its history), if lineage `owner` still
    /// learns into it.
    fn swap_in(
        &self,
        slot: &Slot,
        v: Arc<AdapterVersion>,
        owner: u64,
    ) -> Result<(), RegistryError> {
        let _g = slot.publish_lock.lock().unwrap_or_else(|e| e.into_inner());
        if slot.owner() != Some(owner) {
            return Err(RegistryError::Gone(slot.name.to_string()));
        }
        {
            let mut h = slot.history.lock().unwrap_or_else(|e| e.into_inner());
            if !h
                .iter()
                .any(|w| w.upgrade().is_some_and(|x| Arc::ptr_eq(&x, &v)))
            {
                h.push(Arc::downgrade(&v));
            }
        }
        let (name, number) = (slot.name.clone(), v.version);
        let t0 = Instant::now();
        let old = slot.current.swap(v);
        let swap_secs = t0.elapsed().as_secs_f64();
        drop(old);
        self.note_version(&name, number);
        let m = &self.metrics;
        m.adapter_publishes.inc();
        m.adapter_publish_seconds.observe(swap_secs);
        m.adapter_version
            .with_label_values(&[&name])
            .set(number as i64);
        m.adapter_versions_alive
            .set(self.alive.load(Ordering::Acquire) as i64);
        Ok(())
    }

    /// Remove `name`: new requests cannot pin it; running ones finish on their pinned version.
    pub fn remove(&self, name: &str) -> bool {
        let removed = self
            .slots
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
            .is_some();
        if removed {
            let _ = self.metrics.adapter_version.remove_label_values(&[name]);
        }
        removed
    }

    /// Adapter versions alive in the process (current ones and those still pinned).
    pub fn num_versions_alive(&self) -> usize {
        let n = self.alive.load(Ordering::Acquire);
        self.metrics.adapter_versions_alive.set(n as i64);
        n
    }
}
