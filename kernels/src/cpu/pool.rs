//! A small thread pool for data-parallel kernels, robust when it shares cores with other busy
//! threads (a trainer will): tasks are claimed one at a time from an epoch-tagged counter, so a
//! descheduled worker delays at most the one task it holds; idle workers spin briefly, then sleep
//! on a condvar instead of burning a core; the caller works too and never waits on a worker that
//! has not claimed a task.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = dyn Fn(usize) + Sync;

/// How long one slice of a background job should take (`ThreadPool::run_sliced`).
const BACKGROUND_SLICE: Duration = Duration::from_millis(2);

struct Shared {
    /// (epoch << 32) | next task index. Claiming a task is a CAS that fails once the epoch moves on.
    state: AtomicU64,
    completed: AtomicUsize,
    /// The current job: its epoch, closure and number of tasks, set before its epoch is published
    /// and read by a worker as one (a task count read apart from its epoch could be the next
    /// job's, letting a claim of the old epoch succeed past its end). Valid while its epoch is
    /// current and not all tasks completed.
    job: Mutex<Option<Current>>,
    sleepers: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
    shutdown: AtomicBool,
    /// Set when a task of the current job panicked on a worker; the caller re-raises it.
    panicked: AtomicBool,
    spin: Duration,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);

#[derive(Clone, Copy)]
struct Current {
    epoch: u64,
    job: JobPtr,
    num_tasks: usize,
}
// SAFETY: the pointee is `Sync` and outlives every use (see `ThreadPool::run`).
unsafe impl Send for JobPtr {}

/// A pool of `num_threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    num_threads: usize,
    run_lock: Mutex<()>,
    /// Serving first: background (training) jobs yield to foreground (engine) steps.
    pub gate: super::gate::Gate,
}

impl ThreadPool {
    /// `num_threads` includes the caller; 1 means no worker threads. `spin` is how long an idle
    /// worker polls for new work before it sleeps.
    pub fn new(num_threads: usize, spin: Duration) -> ThreadPool {
        let num_threads = num_threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            completed: AtomicUsize::new(0),
            job: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            shutdown: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
            spin,
        });
        let workers = (1..num_threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("flywheel-kernel-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawn kernel worker")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            num_threads,
            run_lock: Mutex::new(()),
            gate: super::gate::Gate::default(),
        }
    }

    /// One thread per available core, spinning up to 100 µs before sleeping.
    pub fn with_available_cores() -> ThreadPool {
        let n = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        ThreadPool::new(n, Duration::from_micros(100))
    }

    pub fn num_threads(&self) -> usize {
        self.num_threads
    }

    /// The memory's read rate as this pool sees it, in GB/s: `buf` (make it larger than every
    /// cache, in the pages to measure) filled with distinct data — a repeated pattern's pages
    /// could be merged by the host (KSM) and read from the cache — then summed 1 MB per task, the
    /// best of `passes`. Eight independent sums per 64 bytes keep several loads in flight.
    pub fn read_bandwidth(&self, buf: &mut [u8], passes: usize) -> f64 {
        const MB: usize = 1 << 20;
        let mut z = 0x9E37_79B9_7F4A_7C15u64;
        for w in buf.chunks_exact_mut(8) {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            w.copy_from_slice(&z.to_le_bytes());
        }
        let buf = &*buf;
        let chunks = buf.len() / MB;
        let sums: Vec<AtomicU64> = (0..chunks).map(|_| Default::default()).collect();
        let mut best = 0.0f64;
        for _ in 0..passes {
            let t = std::time::Instant::now();
            self.run(chunks, &|c| {
                let mut acc = [0u64; 8];
                for line in buf[c * MB..(c + 1) * MB].chunks_exact(64) {
                    for (a, w) in acc.iter_mut().zip(line.chunks_exact(8)) {
                        *a = a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()));
                    }
                }
                let s = acc.iter().fold(0u64, |s, a| s.wrapping_add(*a));
                sums[c].fetch_add(s, Ordering::Relaxed);
            });
            best = best.max((chunks * MB) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        std::hint::black_box(&sums);
        best
    }

    /// Run `f(i)` for every `i in 0..num_tasks`, spread over the pool; returns when all are done.
    pub fn run(&self, num_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.run_as(false, num_tasks, f)
    }

    /// `run`, as background work when `background` (it yields to foreground steps: `Gate`).
    pub fn run_as(&self, background: bool, num_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if num_tasks == 0 {
            return;
        }
        if background {
            self.run_sliced(num_tasks, f);
        } else {
            self.run_now(false, num_tasks, f);
        }
    }

    /// A background job in slices of its tasks, each admitted by the gate on its own and sized to
    /// take about `BACKGROUND_SLICE`: an engine step that arrives while training runs waits for one
    /// slice, not for the whole kernel (a training matmul over 2,048 rows takes 10 to 40 ms on two
    /// cores). Tasks are independent by `run`'s contract, so running them in slices computes the
    /// same bits.
    fn run_sliced(&self, num_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let threads = self.num_threads;
        let mut slice = threads.min(num_tasks);
        let mut next = 0;
        while next < num_tasks {
            let end = (next + slice).min(num_tasks);
            self.gate.admit_background();
            let t0 = Instant::now();
            self.run_now(true, end - next, &|i| f(next + i));
            let took = t0.elapsed();
            self.gate.charge_background(took);
            // Size the next slice from this one's pace, in whole rounds of the pool's threads.
            let per_round = took.as_secs_f64() * threads as f64 / (end - next) as f64;
            let rounds = (BACKGROUND_SLICE.as_secs_f64() / per_round.max(1e-7)).floor();
            slice = threads * (rounds as usize).clamp(1, 1 << 16);
            next = end;
        }
    }

    fn run_now(&self, background: bool, num_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if self.num_threads == 1 || num_tasks == 1 {
            (0..num_tasks).for_each(f);
            return;
        }
        let _guard = match self.run_lock.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                // Held by the other side (serving's steps are one thread's): a foreground step
                // waiting here waits for a background slice.
                let t0 = Instant::now();
                let g = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
                if !background {
                    self.gate.waited_inside(t0.elapsed());
                }
                g
            }
        };
        let s = &*self.shared;
        // SAFETY: we erase the lifetime; the pointer is only dereferenced by a thread that claimed a
        // task of this epoch, and we do not return before every claimed task has completed.
        let ptr: *const Job =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        let epoch = (s.state.load(Ordering::Relaxed) >> 32) + 1;
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Current {
            epoch,
            job: JobPtr(ptr),
            num_tasks,
        });
        s.completed.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.state.store(epoch << 32, Ordering::Release);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        // Work alongside the workers. A panicking task must not unwind past this frame while
        // workers may still run tasks that borrow `f`: catch it, finish the job, then re-raise.
        let mut done_here = 0;
        let mut caught = None;
        while let Some(i) = claim(s, epoch, num_tasks) {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))) {
                caught.get_or_insert(p);
            }
            done_here += 1;
        }
        s.completed.fetch_add(done_here, Ordering::AcqRel);
        // Wait for tasks claimed by workers: spin briefly, then yield so a descheduled worker can run.
        let start = Instant::now();
        while s.completed.load(Ordering::Acquire) < num_tasks {
            if start.elapsed() < s.spin {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Some(p) = caught {
            std::panic::resume_unwind(p);
        }
        if s.panicked.load(Ordering::Acquire) {
            panic!("a kernel task panicked on a worker thread");
        }
    }
}

/// Claim the next task of `epoch`, or `None` when the job is exhausted or superseded.
fn claim(s: &Shared, epoch: u64, num_tasks: usize) -> Option<usize> {
    let mut cur = s.state.load(Ordering::Acquire);
    loop {
        if cur >> 32 != epoch {
            return None;
        }
        let i = (cur & 0xffff_ffff) as usize;
        if i >= num_tasks {
            return None;
        }
        match s
            .state
            .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(i),
            Err(now) => cur = now,
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = 0u64;
    loop {
        // Wait for a new epoch: spin for a while, then sleep.
        let start = Instant::now();
        let epoch = loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = s.state.load(Ordering::Acquire) >> 32;
            if e != seen {
                break e;
            }
            if start.elapsed() < s.spin {
                std::hint::spin_loop();
                continue;
            }
            let guard = s.wake_lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let e = s.state.load(Ordering::SeqCst) >> 32;
            if e == seen && !s.shutdown.load(Ordering::SeqCst) {
                let _g = s
                    .wake
                    .wait_timeout(guard, Duration::from_millis(50))
                    .unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        };
        seen = epoch;
        // The job of this very epoch, with its own task count; none when a later job is already
        // published (its epoch comes next).
        let cur = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        let Some(Current {
            job: JobPtr(p),
            num_tasks,
            ..
        }) = cur.filter(|c| c.epoch == epoch)
        else {
            continue;
        };
        let mut done_here = 0;
        // A successful claim proves the job of `epoch` is still live (its caller waits for it).
        while let Some(i) = claim(s, epoch, num_tasks) {
            // SAFETY: see `ThreadPool::run`. A panic is recorded and re-raised by the caller; the
            // worker lives on.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { (*p)(i) }));
            if r.is_err() {
                s.panicked.store(true, Ordering::Release);
            }
            done_here += 1;
        }
        if done_here > 0 {
            s.completed.fetch_add(done_here, Ordering::AcqRel);
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _l = self
                .shared
                .wake_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Held by the tests that measure time or load the machine, so that they do not run at once.
    static TIMED: Mutex<()> = Mutex::new(());

    fn timed() -> std::sync::MutexGuard<'static, ()> {
        TIMED.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The probe's pages differ (none could be merged by the host), and it reports a rate.
    #[test]
    fn the_read_bandwidth_probe_reads_distinct_pages() {
        let pool = ThreadPool::new(2, Duration::from_micros(50));
        let mut buf = vec![0u8; 4 << 20];
        let gbps = pool.read_bandwidth(&mut buf, 2);
        assert!(gbps.is_finite() && gbps > 0.0, "{gbps}");
        let pages: std::collections::HashSet<&[u8]> = buf.chunks(4096).collect();
        assert_eq!(pages.len(), buf.len() / 4096, "repeated pages");
    }

    #[test]
    fn runs_every_task_once() {
        let pool = ThreadPool::new(3, Duration::from_micros(50));
        for n in [1usize, 2, 7, 100, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            pool.run(n, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n={n}");
        }
    }

    #[test]
    fn a_panicking_task_is_re_raised_and_the_pool_survives() {
        let pool = ThreadPool::new(2, Duration::from_micros(20));
        for _ in 0..20 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.run(64, &|i| {
                    if i == 37 {
                        panic!("task 37");
                    }
                })
            }));
            assert!(r.is_err());
        }
        let total = AtomicUsize::new(0);
        pool.run(100, &|_| {
            total.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(total.load(Ordering::Relaxed), 100);
    }

    #[test]
    fn a_background_job_runs_in_slices_and_a_foreground_step_waits_for_one() {
        let _timed = timed();
        let pool = Arc::new(ThreadPool::new(2, Duration::from_micros(20)));
        let n = 400;
        let hits: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
        let (p, h) = (pool.clone(), hits.clone());
        // A new gate counts serving as busy for its first `IDLE`: start the job after it.
        std::thread::sleep(Duration::from_millis(30));
        // 400 tasks of 250 µs: about 50 ms of work on two threads, as one background job.
        let bg = std::thread::spawn(move || {
            p.run_as(true, n, &|i| {
                std::thread::sleep(Duration::from_micros(250));
                h[i].fetch_add(1, Ordering::Relaxed);
            })
        });
        std::thread::sleep(Duration::from_millis(5));
        let t0 = Instant::now();
        // The step's own kernel waits for the pool, which the background job holds.
        let waited = pool.gate.foreground(|| {
            pool.run(2, &|_| {});
            t0.elapsed()
        });
        bg.join().unwrap();
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        // Unsliced, the step would wait for the rest of the job (~45 ms); sliced, for one slice
        // of ~2 ms (generous bound for a busy machine).
        assert!(waited < Duration::from_millis(20), "waited {waited:?}");
    }

    /// Training under full serving load: kernels of 10 ms with 3 ms of the trainer's own work
    /// between them, steps of 75 ms. Marked as background work, they get about the share (0.25 of
    /// serving's time); unmarked, the grant is lost to the first gap (one kernel per step: 0.15 seen).
    fn share_with_gaps(marked: bool) -> f64 {
        let pool = Arc::new(ThreadPool::new(2, Duration::from_micros(20)));
        pool.gate.set_share(0.25);
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (pool.clone(), stop.clone());
        let bg = std::thread::spawn(move || {
            let _work = marked.then(|| p.gate.background_work());
            while !s.load(Ordering::Relaxed) {
                p.run_as(true, 20, &|_| std::thread::sleep(Duration::from_millis(1)));
                std::thread::sleep(Duration::from_millis(3));
            }
        });
        for _ in 0..16 {
            let step = || pool.run(2, &|_| std::thread::sleep(Duration::from_millis(75)));
            pool.gate.foreground(step);
        }
        stop.store(true, Ordering::Relaxed);
        bg.join().unwrap();
        let (fg, b) = pool.gate.busy();
        b.as_secs_f64() / fg.as_secs_f64()
    }

    #[test]
    fn background_work_marked_between_its_kernels_gets_its_share() {
        let _timed = timed();
        // A timing measurement on a shared 2-core machine (other tests' threads run beside it):
        // it must hold in one of three tries (CI once saw unmarked 0.175 against marked 0.216,
        // with the other tests of this binary running). Marking that did nothing fails all three.
        let mut tries = Vec::new();
        for _ in 0..3 {
            let marked = share_with_gaps(true);
            let unmarked = share_with_gaps(false);
            if marked > 0.18 && marked < 0.35 && marked > unmarked * 1.3 {
                return;
            }
            tries.push((marked, unmarked));
        }
        panic!("(marked, unmarked) shares in three tries: {tries:?}");
    }

    /// Two callers (serving and training share a pool) run jobs of changing sizes on more
    /// threads than cores, so that workers are descheduled at every point of the hand-off: every
    /// task of every job runs exactly once, and none runs after its job returned. (A worker that
    /// read a job's epoch and then the next job's task count claimed a task past the end of the
    /// old job, ran the new job's task twice and let its caller return early: a kernel then wrote
    /// through the caller's freed stack, a segfault seen once under load.)
    #[test]
    fn every_task_runs_once_and_within_its_job_under_contention() {
        let _timed = timed();
        let pool = Arc::new(ThreadPool::new(4, Duration::from_micros(5)));
        let stop = Instant::now() + Duration::from_secs(3);
        let callers: Vec<_> = (0..2u64)
            .map(|c| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    let mut z = 0x9E37_79B9_7F4A_7C15u64 ^ c;
                    let mut jobs = 0u64;
                    let mut kept: Vec<Arc<Vec<AtomicUsize>>> = Vec::new();
                    while Instant::now() < stop {
                        z ^= z << 13;
                        z ^= z >> 7;
                        z ^= z << 17;
                        let n = 2 + (z % 23) as usize;
                        let hits: Arc<Vec<AtomicUsize>> =
                            Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
                        let done = AtomicBool::new(false);
                        let h = hits.clone();
                        pool.run_as(c == 1, n, &|i| {
                            assert!(!done.load(Ordering::Acquire), "a task ran after its job");
                            h[i].fetch_add(1, Ordering::Relaxed);
                            if i % 5 == 0 {
                                std::thread::yield_now();
                            }
                        });
                        done.store(true, Ordering::Release);
                        for (i, x) in hits.iter().enumerate() {
                            assert_eq!(x.load(Ordering::Relaxed), 1, "job of {n}: task {i}");
                        }
                        kept.push(hits);
                        if kept.len() > 64 {
                            kept.remove(0);
                        }
                        jobs += 1;
                    }
                    // No late runs of finished jobs' tasks either.
                    std::thread::sleep(Duration::from_millis(20));
                    for hits in &kept {
                        assert!(hits.iter().all(|x| x.load(Ordering::Relaxed) == 1));
                    }
                    jobs
                })
            })
            .collect();
        for c in callers {
            assert!(c.join().expect("a caller failed") > 100);
        }
    }

    #[test]
    fn many_small_jobs_in_a_row() {
        let pool = ThreadPool::new(2, Duration::from_micros(20));
        let total = AtomicUsize::new(0);
        for _ in 0..2000 {
            pool.run(4, &|i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 10);
    }
}

/// A pool as one caller uses it: foreground (serving) or background (training) work.
#[derive(Clone, Copy)]
pub struct Tasks<'a> {
    pub pool: &'a ThreadPool,
    pub background: bool,
}

impl Tasks<'_> {
    /// Run `f(i)` for every `i in 0..num_tasks` (see `ThreadPool::run_as`).
    pub fn run(&self, num_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        self.pool.run_as(self.background, num_tasks, f)
    }

    pub fn num_threads(&self) -> usize {
        self.pool.num_threads()
    }
}
