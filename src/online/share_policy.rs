//! How the two cores are split between serving and training while both have work, as a policy a
//! user sets (`[online]`, `PUT /v1/train/policy`) and sees (`GET /v1/train/policy`, metrics).
//!
//! The lever is the gate's share (kernels' `gate`: training kernel time granted per unit of
//! serving time while serving is busy; all of the machine when it is idle). A policy keeps it fixed
//! (`train_share`, the default), or steers it every `PERIOD_SECS` toward a goal — a number of
//! training steps per minute, or a bound on the fraction of rewarded completions dropped as stale —
//! within a budget on how far waiting for training may stretch serving's steps (the mean
//! inter-token latency, measured by the gate: `Gate::serving_time`). The budget wins over the
//! goals; with a budget and no goal the trainer gets as much as the budget allows while groups
//! wait. Pure: `Steering::tick` takes the counters and the clock, so it is unit-tested.

use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The gate's largest share.
pub const MAX_SHARE: f64 = 10.0;
/// The least share a steered policy keeps (so that a goal can raise it again).
const MIN_SHARE: f64 = 0.01;
/// How often a steered share is reconsidered.
pub const PERIOD_SECS: f64 = 5.0;
/// The span the rates and fractions are measured over.
const WINDOW_SECS: f64 = 60.0;

/// The settings (`[online]` keys `train_share`, `train_target_steps_per_minute`,
/// `train_max_stale_fraction`, `train_itl_budget`; the body of `PUT /v1/train/policy`, where an
/// omitted field takes its default: the policy is replaced as a whole).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharePolicy {
    /// The share to start from (and to keep, when no goal or budget is set).
    #[serde(default = "default_share")]
    pub train_share: f64,
    /// Goal: training steps per minute (all learners) while rewarded groups wait.
    #[serde(default)]
    pub target_steps_per_minute: Option<f64>,
    /// Goal: at most this fraction of the rewarded completions of the last minute dropped as stale.
    #[serde(default)]
    pub max_stale_fraction: Option<f64>,
    /// Bound: serving's steps take at most this many times as long as they would without waiting
    /// for training (mean over `PERIOD_SECS`; 1.5 = half again).
    #[serde(default)]
    pub itl_budget: Option<f64>,
}

fn default_share() -> f64 {
    0.25
}

impl Default for SharePolicy {
    fn default() -> SharePolicy {
        SharePolicy {
            train_share: default_share(),
            target_steps_per_minute: None,
            max_stale_fraction: None,
            itl_budget: None,
        }
    }
}

impl SharePolicy {
    /// The field at fault and why.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let p = self;
        if !(0.0..=MAX_SHARE).contains(&p.train_share) {
            return Err(("train_share", format!("must be in [0, {MAX_SHARE}]")));
        }
        if p.target_steps_per_minute
            .is_some_and(|t| !(t.is_finite() && t > 0.0))
        {
            return Err(("target_steps_per_minute", "must be a number > 0".into()));
        }
        if p.max_stale_fraction
            .is_some_and(|f| !(0.0..1.0).contains(&f))
        {
            return Err(("max_stale_fraction", "must be in [0, 1)".into()));
        }
        if p.itl_budget.is_some_and(|b| !(b.is_finite() && b > 1.0)) {
            return Err((
                "itl_budget",
                "must be a number > 1 (a factor on serving's steps)".into(),
            ));
        }
        Ok(())
    }

    /// Whether the share is steered (else fixed at `train_share`).
    pub fn steered(&self) -> bool {
        self.target_steps_per_minute.is_some()
            || self.max_stale_fraction.is_some()
            || self.itl_budget.is_some()
    }

    /// The highest share the budget allows: the gate delays a step by at most `share` of the
    /// previous one (plus one slice), so a share above `budget - 1` cannot stay within it.
    fn cap(&self) -> f64 {
        self.itl_budget
            .map_or(MAX_SHARE, |b| (b - 1.0).clamp(MIN_SHARE, MAX_SHARE))
    }
}

/// The trainer's counters the policy reads (summed over learners, since the process started).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    pub steps: u64,
    /// Completions trained on.
    pub trained: u64,
    /// Completions dropped as stale, and dropped for any reason (stale included).
    pub stale: u64,
    pub dropped: u64,
    /// Groups waiting (rewarded, not yet trained or dropped).
    pub pending: u64,
}

/// What `GET /v1/train/policy` shows: the settings, the share in force and what was measured.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyView {
    pub object: &'static str,
    pub policy: SharePolicy,
    /// The share in force.
    pub train_share: f64,
    pub steered: bool,
    /// Over the last minute (None until a period has passed).
    pub steps_per_minute: Option<f64>,
    pub stale_fraction: Option<f64>,
    pub trained_fraction: Option<f64>,
    /// Serving's steps with their waits for training over the same steps without them, last
    /// period; None while serving was idle.
    pub itl_stretch: Option<f64>,
    /// The last change of the share and why.
    pub last_change: Option<String>,
}

/// The controller. Its settings and the share in force live in the view it shows.
pub struct Steering {
    /// (time, totals) at each tick over the window; the last is the last tick.
    history: VecDeque<(f64, Totals)>,
    /// Serving's (wall, waited) seconds at the last tick.
    serving: (f64, f64),
    view: PolicyView,
}

impl Steering {
    pub fn new(policy: SharePolicy) -> Steering {
        Steering {
            view: PolicyView {
                object: "train.policy",
                train_share: policy.train_share,
                steered: policy.steered(),
                policy,
                steps_per_minute: None,
                stale_fraction: None,
                trained_fraction: None,
                itl_stretch: None,
                last_change: None,
            },
            history: VecDeque::new(),
            serving: (0.0, 0.0),
        }
    }

    /// Replace the settings (the share restarts from the new `train_share`; the measurements go
    /// on).
    pub fn set_policy(&mut self, policy: SharePolicy) {
        let v = &mut self.view;
        v.train_share = policy.train_share;
        v.steered = policy.steered();
        v.last_change = Some(format!("set to {:.3} by a new policy", v.train_share));
        v.policy = policy;
    }

    pub fn share(&self) -> f64 {
        self.view.train_share
    }

    pub fn view(&self) -> &PolicyView {
        &self.view
    }

    /// Measure and, once a period has passed, reconsider the share: `now` in seconds, `totals` the
    /// trainer's counters, `serving` the gate's (wall, waited) seconds. Returns the new share when
    /// it changed.
    pub fn tick(&mut self, now: f64, totals: Totals, serving: (f64, f64)) -> Option<f64> {
        let Some(&(last, prev)) = self.history.back() else {
            self.history.push_back((now, totals));
            self.serving = serving;
            return None;
        };
        let dt = now - last;
        if dt < PERIOD_SECS {
            return None;
        }
        self.history.push_back((now, totals));
        // Keep one sample at or before the window's start as the base.
        while self.history.len() > 2 && self.history[1].0 <= now - WINDOW_SECS {
            self.history.pop_front();
        }
        let (t0, base) = self.history[0];
        let span = now - t0;
        let rate = totals.steps.saturating_sub(base.steps) as f64 / span * 60.0;
        let seen = totals.trained.saturating_sub(base.trained)
            + totals.dropped.saturating_sub(base.dropped);
        let frac = |n: u64| (seen > 0).then(|| n as f64 / seen as f64);
        let stale = frac(totals.stale.saturating_sub(base.stale));
        let trained = frac(totals.trained.saturating_sub(base.trained));
        let (dwall, dwaited) = (serving.0 - self.serving.0, serving.1 - self.serving.1);
        self.serving = serving;
        // Serving counts as busy when its steps took a tenth of the period or more.
        let stretch = (dwall > 0.1 * dt).then(|| dwall / (dwall - dwaited).max(1e-9));
        let v = &mut self.view;
        v.steps_per_minute = Some(rate);
        v.stale_fraction = stale;
        v.trained_fraction = trained;
        v.itl_stretch = stretch;
        // Fixed, or serving idle (the trainer has the machine: the share does not bind).
        let (p, share) = (&self.view.policy, self.view.train_share);
        let stretch = stretch.filter(|_| p.steered())?;
        let demand = totals.pending > 0 || totals.steps > prev.steps;
        let stale_over = p
            .max_stale_fraction
            .is_some_and(|f| stale.is_some_and(|s| s > f));
        let (new, why) = match (p.itl_budget, p.target_steps_per_minute) {
            (Some(b), _) if stretch > b => (
                share / 1.5,
                format!("lowered: serving's steps stretched {stretch:.2}x, over the budget {b}"),
            ),
            (_, Some(t)) if demand && rate < t => (
                (share * 1.5).max(0.05),
                format!("raised: {rate:.1} steps/min, below the target {t}"),
            ),
            _ if demand && stale_over => (
                (share * 1.5).max(0.05),
                format!(
                    "raised: {:.2} of the completions dropped as stale, over the bound {}",
                    stale.unwrap_or(0.0),
                    p.max_stale_fraction.unwrap_or(0.0)
                ),
            ),
            (Some(b), None) if demand && p.max_stale_fraction.is_none() => (
                (share * 1.5).max(0.05),
                format!("raised: groups wait and serving's steps stretched {stretch:.2}x, within the budget {b}"),
            ),
            (_, Some(t)) if rate > 1.5 * t && !stale_over => (
                share / 1.25,
                format!("lowered: {rate:.1} steps/min, above the target {t}"),
            ),
            _ => return None,
        };
        let new = new.clamp(MIN_SHARE, p.cap());
        if (new - share).abs() < 1e-9 {
            return None;
        }
        self.view.train_share = new;
        self.view.last_change = Some(format!("{why}: share {new:.3}"));
        Some(new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals(steps: u64, trained: u64, stale: u64, pending: u64) -> Totals {
        Totals {
            steps,
            trained,
            stale,
            dropped: stale,
            pending,
        }
    }

    /// Ticks every period with serving busy (`stretch` of its steps spent waiting for training)
    /// and `steps_per_period` steps each; returns the shares in force after each tick.
    fn run(p: SharePolicy, ticks: usize, steps_per_period: u64, stretch: f64) -> Vec<f64> {
        let mut s = Steering::new(p);
        let mut out = vec![];
        let (mut wall, mut waited) = (0.0, 0.0);
        for i in 0..=ticks {
            let t = i as f64 * PERIOD_SECS;
            let steps = i as u64 * steps_per_period;
            s.tick(t, totals(steps, steps * 8, 0, 3), (wall, waited));
            out.push(s.share());
            wall += PERIOD_SECS * 0.8;
            waited += PERIOD_SECS * 0.8 * (1.0 - 1.0 / stretch);
        }
        out
    }

    #[test]
    fn a_fixed_policy_keeps_its_share() {
        let shares = run(SharePolicy::default(), 20, 0, 3.0);
        assert!(shares.iter().all(|&s| s == 0.25));
    }

    #[test]
    fn a_target_raises_the_share_up_to_the_budget() {
        let p = SharePolicy {
            target_steps_per_minute: Some(30.0),
            itl_budget: Some(1.5),
            ..SharePolicy::default()
        };
        // One step per period (12/min) is below 30: raised 0.25 → 0.375 → 0.5 (the cap), no more.
        let shares = run(p, 6, 1, 1.2);
        assert_eq!(shares[1], 0.375);
        assert_eq!(*shares.last().unwrap(), 0.5);
    }

    #[test]
    fn the_budget_wins_over_the_goal() {
        let p = SharePolicy {
            train_share: 0.4,
            target_steps_per_minute: Some(30.0),
            itl_budget: Some(1.5),
            ..SharePolicy::default()
        };
        let shares = run(p, 3, 1, 2.0);
        assert!(shares[1] < 0.4 && shares[3] < shares[2], "{shares:?}");
    }

    #[test]
    fn above_the_target_it_gives_back_and_idle_serving_changes_nothing() {
        let p = SharePolicy {
            target_steps_per_minute: Some(2.0),
            ..SharePolicy::default()
        };
        let shares = run(p.clone(), 3, 2, 1.1);
        assert!(shares[1] < 0.25, "{shares:?}");
        // Serving idle: the stretch is not measured and the share stays.
        let mut s = Steering::new(p);
        for i in 0..5 {
            s.tick(i as f64 * PERIOD_SECS, totals(i, 0, 0, 5), (0.0, 0.0));
        }
        assert_eq!(s.share(), 0.25);
        assert_eq!(s.view().itl_stretch, None);
    }

    #[test]
    fn a_stale_bound_raises_the_share_and_is_shown() {
        let p = SharePolicy {
            max_stale_fraction: Some(0.1),
            ..SharePolicy::default()
        };
        let mut s = Steering::new(p);
        s.tick(0.0, totals(0, 0, 0, 4), (0.0, 0.0));
        // 10 trained, 30 dropped as stale in the period.
        let mut t = totals(1, 10, 30, 4);
        t.dropped = 30;
        assert_eq!(s.tick(PERIOD_SECS, t, (4.0, 1.0)), Some(0.375));
        let v = s.view();
        assert_eq!(v.stale_fraction, Some(0.75));
        assert_eq!(v.trained_fraction, Some(0.25));
        assert!((v.itl_stretch.unwrap() - 4.0 / 3.0).abs() < 1e-9);
        assert!(v.last_change.as_deref().unwrap().contains("stale"));
    }

    #[test]
    fn invalid_settings_name_their_field() {
        let bad = [
            (
                SharePolicy {
                    train_share: 11.0,
                    ..SharePolicy::default()
                },
                "train_share",
            ),
            (
                SharePolicy {
                    itl_budget: Some(1.0),
                    ..SharePolicy::default()
                },
                "itl_budget",
            ),
            (
                SharePolicy {
                    max_stale_fraction: Some(1.0),
                    ..SharePolicy::default()
                },
                "max_stale_fraction",
            ),
            (
                SharePolicy {
                    target_steps_per_minute: Some(0.0),
                    ..SharePolicy::default()
                },
                "target_steps_per_minute",
            ),
        ];
        for (p, field) in bad {
            assert_eq!(p.validate().unwrap_err().0, field);
        }
    }
}
