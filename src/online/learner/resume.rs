//! A trainer's learning adapter at start: its lineage resumed from the newest intact checkpoint
//! (or begun with the identity) under the adapter's claim, what serves chosen by the store's
//! decisions (a held candidate or a pin: an older checkpoint serves, training goes on from the
//! newest; a canary not ended runs again), and the decisions read back.

use super::copies::Needed;
use super::train::{adamw, Learner};
use super::{adopt_shape, identity, newest_intact, publish_at_start, Env, ErrorKind, TrainError};
use crate::online::checkpoint::{load_checkpoint, max_version_on_disk};
use crate::online::config::LearnConfig;
use crate::online::store::records::LogError;
use crate::util::now_secs;

/// How long a starting trainer waits for another's claim on its adapter before refusing.
const CLAIM_WAIT_SECS: f64 = 10.0;

impl Learner {
    /// Resume `cfg.name`'s lineage from its newest intact checkpoint, or begin a lineage with the
    /// identity adapter; publish it either way. A broken newest checkpoint is skipped with a
    /// warning. Versions continue above every version the name ever had.
    pub(super) fn start(mut cfg: LearnConfig, env: &Env) -> Result<Learner, TrainError> {
        let name = cfg.name.clone();
        let name = name.as_str();
        let start_err = |e: &dyn std::fmt::Display| TrainError::new(ErrorKind::Start, e);
        let recorded = env.log.max_version(name)?;
        // Folders the store does not know of (it was lost, or replaced): their numbers were
        // served, so the lineage continues above them and never writes over them.
        let on_disk = max_version_on_disk(&env.cfg.data_dir, name);
        if on_disk > recorded {
            tracing::warn!(
                adapter = name,
                recorded,
                on_disk,
                "checkpoint folders above every version the rollout store records (was it lost \
                 or replaced?): versions continue above them, and the folders are left as they are"
            );
        }
        let max_seen = recorded.max(on_disk).max(env.registry.last_version(name));
        // A trainer restarted right after a crash may find the claim still held while the
        // database notices the dead connection: wait a little, then refuse.
        let deadline = now_secs() + CLAIM_WAIT_SECS;
        loop {
            match env.log.claim_trainer(name) {
                Ok(()) => break,
                Err(LogError::Conflict(_)) if now_secs() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(200))
                }
                Err(e) => return Err(start_err(&e)),
            }
        }
        let lineage = env.log.active_lineage(name)?;
        let found = match &lineage {
            Some(l) => Some(newest_intact(env, name, l, Needed::Resume, |dir| {
                load_checkpoint(dir, &env.model.config, &env.registry.limits)
            })?),
            None => None,
        };
        let num_checkpoints = found.as_ref().map_or(0, |f| f.num_checkpoints);
        let resumed = found.and_then(|f| f.resumed);
        let (lineage, weights, opt, min_version, resumed_cp) = match (lineage, resumed) {
            (Some(l), Some((cp, (w, opt), _))) => {
                adopt_shape(&mut cfg, &w);
                // The same number only if no later version was ever seen (then it is the same
                // weights); else a new number for these older weights.
                let v = if cp.version >= max_seen {
                    cp.version
                } else {
                    max_seen + 1
                };
                tracing::info!(
                    adapter = name,
                    checkpoint = cp.version,
                    version = v,
                    step = cp.step,
                    "learning adapter resumed"
                );
                (l, w, opt, v, Some(cp.version))
            }
            (l, _) => {
                let w = identity(&cfg, env).map_err(|e| start_err(&e))?;
                let opt = adamw(&cfg, w.layout.num_params);
                let (l, v) = match l {
                    // Never trained: the identity it started with, under the same number.
                    Some(l) if num_checkpoints == 0 && max_seen <= l.first_version => {
                        (l, l.first_version)
                    }
                    Some(l) => {
                        tracing::warn!(
                            adapter = name,
                            "no intact checkpoint in its lineage: starting again from the identity"
                        );
                        (l, max_seen + 1)
                    }
                    None => (env.log.begin_lineage(name, max_seen + 1)?, max_seen + 1),
                };
                tracing::info!(adapter = name, method = %cfg.method, lineage = l.id, version = v, "learning adapter created");
                (l, w, opt, v, None)
            }
        };
        // Held candidates and a pin (the store's decisions): what serves may be an older
        // checkpoint than the one training goes on from.
        let promo = super::promote::at_start(env, &cfg, &lineage, resumed_cp)?;
        let (served, trainee) = match promo.served {
            // Under its own number (the identity under the lineage's first).
            Some((v, w)) => {
                let number = if v == 0 { lineage.first_version } else { v };
                ((w, number, v), Some((weights, resumed_cp.unwrap_or(0))))
            }
            None => ((weights, min_version, resumed_cp.unwrap_or(0)), None),
        };
        let status = publish_at_start(env, &cfg, &lineage, served.0, served.1, opt.step)?;
        // Numbers continue above every one the name had.
        env.registry.note_version(name, max_seen);
        let trainee = match trainee {
            Some((w, v)) => Some(
                env.registry
                    .candidate(name, v, None, w)
                    .map_err(|e| start_err(&e))?,
            ),
            None => None,
        };
        let mut l = Learner {
            cfg,
            lineage,
            guarded: (Vec::new(), status.version),
            opt,
            status,
            rolled_back: Vec::new(),
            trainee,
            served_checkpoint: served.2,
            pinned: promo.pinned,
            scores: Default::default(),
            canary: None,
        };
        // A canary that had not ended runs again.
        let open = super::promote::decided(env, name, l.lineage.id)?.open_canary;
        if let Some(t) = l.trainee.take_if(|t| open == Some(t.version)) {
            l.begin_canary(env, t, None)?;
        }
        l.status.held_version = l.trainee.as_ref().map(|t| t.version);
        l.status.pinned_version = l.pinned;
        l.read_decisions(env)?;
        Ok(l)
    }
}
