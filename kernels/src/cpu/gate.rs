//! Foreground/background sharing of the compute pool: serving is the foreground (an engine step
//! runs inside `Gate::foreground`), training the background (kernels run through a `Cpu` made
//! with `Cpu::background`: an explicit input, not a property of the calling thread). A background kernel starts only while no foreground step runs, and while
//! the foreground is busy (a step ended less than `IDLE` ago) only within a budget: each
//! foreground step of duration d grants `share · d` of background kernel time, and the next
//! step waits until a busy background has used it (or stopped asking), for at most that slice
//! plus 2 ms. By construction a step is delayed by at most `share` of the previous step's time,
//! 2 ms and one in-flight background slice (about 2 ms: a background kernel runs in slices of its
//! tasks, `ThreadPool::run_sliced`), and under full serving load the background's share is bounded by `share / (1 + share)` (all
//! of the machine when serving is idle). Measured effect on serving: scripts/itl_while_training.py.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The foreground counts as idle once no step ran for this long.
const IDLE: Duration = Duration::from_millis(20);

pub struct Gate {
    epoch: Instant,
    fg_active: AtomicBool,
    /// Nanoseconds since `epoch` when the last foreground step ended.
    fg_last_end: AtomicU64,
    /// Background kernel time (ns) still allowed before the next foreground step.
    budget: AtomicI64,
    /// Background time granted per unit of foreground time, in millionths.
    share_ppm: AtomicU64,
    /// Background kernels waiting or running, and when the last one ended (ns since `epoch`).
    bg_busy: AtomicU64,
    /// Background work in progress between its kernels (`Gate::background_work`).
    bg_sessions: AtomicU64,
    bg_last_end: AtomicU64,
    /// Time spent in foreground steps and in background kernels since start (ns): the split
    /// between serving and training a user sees (`Gate::busy`).
    fg_total: AtomicU64,
    bg_total: AtomicU64,
    /// Serving's wall time (steps and the waits before them) and the part of it spent waiting
    /// for background work (before a step, and inside it for the pool a background slice held),
    /// ns: `Gate::serving_time`.
    fg_wall: AtomicU64,
    fg_waited: AtomicU64,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate {
            epoch: Instant::now(),
            fg_active: AtomicBool::new(false),
            fg_last_end: AtomicU64::new(0),
            budget: AtomicI64::new(0),
            share_ppm: AtomicU64::new(500_000),
            bg_busy: AtomicU64::new(0),
            bg_sessions: AtomicU64::new(0),
            bg_last_end: AtomicU64::new(0),
            fg_total: AtomicU64::new(0),
            bg_total: AtomicU64::new(0),
            fg_wall: AtomicU64::new(0),
            fg_waited: AtomicU64::new(0),
        }
    }
}

impl Gate {
    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Background time granted per unit of foreground time while serving is busy (0 to 10).
    pub fn set_share(&self, share: f64) {
        let s = (share.clamp(0.0, 10.0) * 1e6) as u64;
        self.share_ppm.store(s, Ordering::Relaxed);
    }

    /// The background share in force (`set_share`).
    pub fn share(&self) -> f64 {
        self.share_ppm.load(Ordering::Relaxed) as f64 / 1e6
    }

    /// Time spent so far in foreground steps and in background kernels.
    pub fn busy(&self) -> (Duration, Duration) {
        (
            Duration::from_nanos(self.fg_total.load(Ordering::Relaxed)),
            Duration::from_nanos(self.bg_total.load(Ordering::Relaxed)),
        )
    }

    /// Serving's wall time and the part of it spent waiting for background work, since start:
    /// over a span, wall / (wall - waited) is how far training stretched serving's steps (the
    /// mean inter-token latency; the cache the two share is not counted).
    pub fn serving_time(&self) -> (Duration, Duration) {
        (
            Duration::from_nanos(self.fg_wall.load(Ordering::Relaxed)),
            Duration::from_nanos(self.fg_waited.load(Ordering::Relaxed)),
        )
    }

    /// A foreground kernel waited this long for the pool (held by a background slice).
    pub fn waited_inside(&self, d: Duration) {
        self.fg_waited
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Run one foreground step (after the background's slice, if it is using it).
    pub fn foreground<R>(&self, f: impl FnOnce() -> R) -> R {
        let t_wait = Instant::now();
        let cap = Duration::from_nanos(self.budget.load(Ordering::SeqCst).max(0) as u64)
            + Duration::from_millis(2);
        loop {
            let recent = self
                .now_ns()
                .saturating_sub(self.bg_last_end.load(Ordering::SeqCst))
                < 1_000_000;
            let wants = self.bg_busy.load(Ordering::SeqCst) > 0
                || self.bg_sessions.load(Ordering::SeqCst) > 0
                || recent;
            if self.budget.load(Ordering::SeqCst) <= 0 || !wants || t_wait.elapsed() > cap {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let waited = t_wait.elapsed().as_nanos() as u64;
        self.fg_active.store(true, Ordering::SeqCst);
        let t0 = Instant::now();
        let r = f();
        let d = t0.elapsed().as_nanos() as i64;
        self.fg_total.fetch_add(d as u64, Ordering::Relaxed);
        self.fg_wall.fetch_add(waited + d as u64, Ordering::Relaxed);
        self.fg_waited.fetch_add(waited, Ordering::Relaxed);
        let grant = d.saturating_mul(self.share_ppm.load(Ordering::Relaxed) as i64) / 1_000_000;
        // One slice per step: unused budget does not pile up.
        self.budget.store(grant, Ordering::SeqCst);
        self.fg_last_end.store(self.now_ns(), Ordering::SeqCst);
        self.fg_active.store(false, Ordering::SeqCst);
        r
    }

    /// Mark background work that runs kernels with work of its own between them (a training
    /// step): while the guard lives, a foreground step waits for the background's slice even when
    /// the background is between kernels (still at most that slice plus 2 ms), so the grant is
    /// not lost to the gaps. Measured without it (16 streams, share 0.25): training got 2.0 s of
    /// kernel time in 40 s (serving 37.8 s); with it, 6.2 s (README, learning under load).
    pub fn background_work(&self) -> BackgroundWork<'_> {
        self.bg_sessions.fetch_add(1, Ordering::SeqCst);
        BackgroundWork(self)
    }

    /// Wait until a background kernel may start.
    pub fn admit_background(&self) {
        self.bg_busy.fetch_add(1, Ordering::SeqCst);
        loop {
            if !self.fg_active.load(Ordering::SeqCst) {
                let idle = self
                    .now_ns()
                    .saturating_sub(self.fg_last_end.load(Ordering::SeqCst))
                    > IDLE.as_nanos() as u64;
                if idle || self.budget.load(Ordering::SeqCst) > 0 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Charge a background kernel's time to the budget.
    pub fn charge_background(&self, took: Duration) {
        self.budget
            .fetch_sub(took.as_nanos() as i64, Ordering::SeqCst);
        self.bg_total
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        self.bg_last_end.store(self.now_ns(), Ordering::SeqCst);
        self.bg_busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// See `Gate::background_work`.
pub struct BackgroundWork<'a>(&'a Gate);

impl Drop for BackgroundWork<'_> {
    fn drop(&mut self) {
        self.0.bg_sessions.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_is_counted_per_side() {
        let g = Gate::default();
        g.set_share(0.25);
        assert_eq!(g.share(), 0.25);
        g.foreground(|| std::thread::sleep(Duration::from_millis(3)));
        g.admit_background();
        g.charge_background(Duration::from_millis(1));
        let (fg, bg) = g.busy();
        assert!(fg >= Duration::from_millis(3), "{fg:?}");
        assert_eq!(bg, Duration::from_millis(1));
    }
}
