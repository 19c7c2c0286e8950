//! The engine: one thread owns the model, the KV cache, the scheduler and every sequence's output
//! state; `EngineHandle` is the cloneable way in (a channel). Each step: take new requests, drop
//! the ones whose client left, schedule, run one packed forward, sample, send events.

pub mod block_manager;
pub mod constraint;
pub mod device;
mod forks;
pub mod grammar_bounds;
pub mod grammar_error;
mod handle;
pub mod output;
mod prompt_rows;
pub mod repetition;
pub mod sampler;
pub mod scheduler;
mod scoring;
pub mod sequence;

use crate::metrics::Metrics;
use crate::model::decoder::{BatchSeq, Decoder, ForwardBuffers, Logits};
use crate::model::tokenizer::Tokenizer;
use block_manager::BlockManager;
use constraint::{Constraint, GrammarError};
use device::DeviceRow;
use flywheel_kernels::Cpu;
pub use handle::{
    Admission, ClientId, EngineEvent, EngineHandle, FinishReason, Follow, GenerateRequest,
    RequestStream, StopReason, SubmitError,
};
use handle::{AliveGuard, Command, Submission};
use output::{RequestState, SeqOutput};
use scheduler::{Chunk, Scheduler, SchedulerConfig};
use sequence::{SeqId, Sequence};
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub num_kv_blocks: usize,
    /// The sliding-window layers' own pool of blocks (`block_manager::WindowPool`), where the
    /// model has such layers and the CPU serves; None: they take blocks of the global pool.
    pub num_window_blocks: Option<usize>,
    pub block_size: usize,
    pub enable_prefix_caching: bool,
    /// Requests admitted (queued or running) at once; more get `SubmitError::QueueFull`.
    pub max_pending_requests: usize,
    /// Requests one client may have admitted (`SubmitError::ClientFull`).
    pub max_pending_per_client: usize,
}

pub struct Engine {
    model: Arc<Decoder>,
    tokenizer: Arc<Tokenizer>,
    /// Shared with whoever else runs forwards on the same weights (the trainer, later): the pool
    /// serializes parallel regions, so each product keeps the cores for its own duration only.
    cpu: Arc<Cpu>,
    backend: device::Backend,
    bufs: ForwardBuffers,
    sched: Scheduler,
    outputs: HashMap<SeqId, SeqOutput>,
    next_seq: u64,
    metrics: Arc<Metrics>,
    inbox: mpsc::Receiver<Command>,
    last_prefix: (u64, u64),
    /// Training forwards to run between serving steps (`scoring.rs`).
    scoring: std::collections::VecDeque<scoring::Scoring>,
}

impl Engine {
    /// `start_on` the CPU.
    pub fn start(
        model: Arc<Decoder>,
        tokenizer: Arc<Tokenizer>,
        cpu: Arc<Cpu>,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<(EngineHandle, std::thread::JoinHandle<()>)> {
        Engine::start_on(model, tokenizer, cpu, cfg, metrics, device::Device::Cpu)
    }

    /// Start the engine thread and return once it is ready to step: its KV cache allocated and
    /// every page of it touched (readiness means ready: before, /health said ready with 40 MB of a
    /// 768 MB cache touched). It
    /// stops when every handle is dropped and no work is left.
    pub fn start_on(
        model: Arc<Decoder>,
        tokenizer: Arc<Tokenizer>,
        cpu: Arc<Cpu>,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        device: device::Device,
    ) -> std::io::Result<(EngineHandle, std::thread::JoinHandle<()>)> {
        let (tx, inbox) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<(), device::DeviceError>>(1);
        let alive = Arc::new(AtomicBool::new(true));
        let handle = EngineHandle {
            tx,
            pending: Default::default(),
            max_pending: cfg.max_pending_requests,
            max_pending_per_client: cfg.max_pending_per_client,
            alive: alive.clone(),
        };
        // Grammars advance here and are masked on a scoped thread beside the forward: both with
        // the stack a grammar within `grammar_bounds` may need.
        let join = std::thread::Builder::new()
            .name("engine".into())
            .stack_size(grammar_bounds::COMPILE_STACK)
            .spawn(move || {
                let _guard = AliveGuard(alive);
                let backend = match device::backend(&model, &cfg, device, cpu.precision()) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let mut blocks =
                    BlockManager::new(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching);
                if let Some(pool) = device::window_pool(&model, &cfg, &backend) {
                    blocks = blocks.with_window_pool(pool.0, pool.1);
                }
                metrics.kv_blocks_total.set(cfg.num_kv_blocks as i64);
                let window_blocks = blocks.stats().num_window_blocks;
                metrics.kv_window_blocks_total.set(window_blocks as i64);
                let sched = Scheduler::new(
                    SchedulerConfig {
                        max_num_seqs: cfg.max_num_seqs,
                        max_num_batched_tokens: cfg.max_num_batched_tokens,
                    },
                    blocks,
                );
                let mut engine = Engine {
                    model,
                    tokenizer,
                    cpu,
                    backend,
                    bufs: ForwardBuffers::default(),
                    sched,
                    outputs: HashMap::new(),
                    next_seq: 0,
                    metrics,
                    inbox,
                    last_prefix: (0, 0),
                    scoring: Default::default(),
                };
                let _ = ready_tx.send(Ok(()));
                engine.run();
            })?;
        // Err: the thread ended before it was ready (it panicked allocating its cache, or the
        // GPU refused the model).
        match ready_rx.recv() {
            Ok(Ok(())) => Ok((handle, join)),
            Ok(Err(e)) => Err(std::io::Error::other(e)),
            Err(_) => Err(std::io::Error::other(
                "the engine stopped before it was ready (see the log)",
            )),
        }
    }

    fn run(&mut self) {
        loop {
            if self.sched.is_idle() && self.scoring.is_empty() {
                self.update_gauges();
                match self.inbox.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return, // every handle dropped
                }
            }
            while let Ok(cmd) = self.inbox.try_recv() {
                self.handle(cmd);
            }
            self.reap_cancelled();
            // A step is the pool's foreground: background (training) kernels wait for it.
            let cpu = self.cpu.clone();
            // (Not while only a training forward waits: a foreground step waits for the
            // background's slice, and the trainer waiting for it holds one.)
            let worked = !self.sched.is_idle() && cpu.pool.gate.foreground(|| self.step());
            // Then a part of a training forward, if one waits.
            let worked = self.score_turn() || worked;
            self.update_gauges();
            let idle = self.sched.is_idle() && self.scoring.is_empty();
            if !worked && !idle {
                // Nothing could be scheduled (all waiting for blocks held by nobody should not
                // happen; be gentle rather than spin).
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => self.add_request(*sub),
            Command::Score(job) => self.add_scoring(*job),
        }
    }

    fn add_request(&mut self, sub: Submission) {
        let Submission {
            req,
            client,
            request,
            tx,
            arrival,
        } = sub;
        self.metrics.prompt_tokens.inc_by(req.prompt.len() as u64);
        let seed = req.seed.unwrap_or_else(crate::util::random_u64);
        let id = self.new_seq_id();
        let prompt = req.prompt.clone();
        let adapter = req.adapter.clone();
        let n = req.n;
        let score = req.prompt_logprobs.is_some();
        let embed = req.embed;
        let follow = req.follow.clone();
        let state = Rc::new(RequestState::new(
            req,
            tx,
            arrival,
            seed,
            self.tokenizer.eos_id,
            &self.metrics,
        ));
        let mut out = SeqOutput::new(state, 0);
        out.pending_forks = n - 1;
        self.outputs.insert(id, out);
        let table = self.sched.blocks().new_table();
        let mut seq = Sequence::new(id, prompt, table, adapter);
        seq.score_prompt = score;
        seq.embed = embed;
        seq.client = client;
        seq.request = request;
        seq.follow = follow;
        self.sched.add(seq);
    }

    fn new_seq_id(&mut self) -> SeqId {
        self.next_seq += 1;
        SeqId(self.next_seq)
    }

    /// Drop every sequence whose client went away; their blocks are freed here.
    fn reap_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .outputs
            .iter()
            .filter(|(_, o)| o.req.tx.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.outputs.remove(&id);
            self.sched.remove(id);
            self.metrics
                .request_success
                .with_label_values(&["abort"])
                .inc();
        }
    }

    /// Abort the sequences of `ids` with an error event to their clients.
    fn fail(&mut self, ids: &[SeqId], message: &str) {
        for id in ids {
            if let Some(o) = self.outputs.remove(id) {
                let _ = o.req.tx.send(EngineEvent::Error(message.to_string()));
            }
            self.sched.remove(*id);
        }
    }

    /// Partial rollouts: every sequence that follows its adapter and whose slot now serves
    /// another version moves to it here, between two steps (never within one): its K/V are
    /// recomputed under the new version, so every token after the switch is exactly what that
    /// version computes for the whole sequence (train = serve per version), unless its adapter
    /// keeps them (cheaper; the tokens after are then a mix no single version computes).
    fn follow_versions(&mut self) {
        let mut moves = Vec::new();
        for s in self.sched.sequences_mut() {
            let Some(f) = &mut s.follow else { continue };
            if f.slot.current_uid() == f.seen {
                continue;
            }
            let v = f.slot.current();
            f.seen = v.uid;
            if s.adapter.as_ref().is_none_or(|a| a.uid != v.uid) {
                moves.push((s.id, v, f.keep_kv));
            }
        }
        for (id, v, keep) in moves {
            let dropped = self.sched.switch_version(id, v, keep);
            self.metrics.version_switches.inc();
            self.metrics.version_switch_tokens.inc_by(dropped as u64);
        }
    }

    /// One scheduling step and forward pass; false when nothing ran.
    fn step(&mut self) -> bool {
        self.follow_versions();
        let plan = self.sched.schedule();
        let now = Instant::now();
        for c in plan
            .chunks
            .iter()
            .filter(|c| plan.admitted.contains(&c.seq))
        {
            if let Some(o) = self.outputs.get_mut(&c.seq) {
                if o.scheduled_at.is_none() {
                    o.scheduled_at = Some(now);
                    o.num_cached_tokens = c.start;
                    self.metrics
                        .request_queue_time
                        .observe((now - o.req.arrival).as_secs_f64());
                }
            }
        }
        self.metrics
            .num_preemptions
            .inc_by(plan.preempted.len() as u64);
        if plan.chunks.is_empty() {
            return false;
        }
        // Rows whose tokens the device draws (only their tokens come back) or normalizes,
        // decided before the grammar thread takes the constraints.
        let draws =
            device::device_rows(&self.backend, &plan.chunks, &self.sched, &mut self.outputs);
        let batch: Vec<BatchSeq> = plan
            .chunks
            .iter()
            .map(|c| {
                let s = self.sched.get(c.seq).expect("scheduled sequence exists");
                BatchSeq {
                    tokens: &s.tokens[c.start..c.start + c.len],
                    first_pos: c.start,
                    block_table: s.table.ids(),
                    window_table: s.table.window_ids(),
                    logits: if s.embed {
                        Logits::Hidden
                    } else if scores_prompt(s, c) {
                        Logits::All
                    } else if c.wants_logits {
                        Logits::Last
                    } else {
                        Logits::None
                    },
                    adapter: s.adapter.as_deref().map(|a| &a.weights),
                }
            })
            .collect();
        // Chunks whose every row's logits are computed (prompt scoring), or hidden states
        // (embeddings), decided once.
        let all_rows: Vec<bool> = batch
            .iter()
            .map(|b| matches!(b.logits, Logits::All))
            .collect();
        let hidden_rows: Vec<bool> = batch
            .iter()
            .map(|b| matches!(b.logits, Logits::Hidden))
            .collect();
        // Constrained choices about to sample: their masks are computed beside the forward pass
        // (on a scoped thread), off the batch's critical path.
        let ahead: Vec<(SeqId, Arc<[u32]>, Constraint)> = plan
            .chunks
            .iter()
            .filter(|c| c.wants_logits)
            .filter_map(|c| {
                let o = self.outputs.get_mut(&c.seq)?;
                if o.next_mask.is_some() {
                    return None;
                }
                let ends = o.req.end_tokens.clone();
                o.constraint.take().map(|k| (c.seq, ends, k))
            })
            .collect();
        let (model, cpu, backend, bufs) =
            (&self.model, &*self.cpu, &mut self.backend, &mut self.bufs);
        let (result, ahead) = std::thread::scope(|scope| {
            let masks = (!ahead.is_empty()).then(|| {
                let t = std::thread::Builder::new().stack_size(grammar_bounds::COMPILE_STACK);
                t.spawn_scoped(scope, move || {
                    ahead
                        .into_iter()
                        .map(|(id, ends, mut k)| {
                            // A grammar that panics fails its own request (at sampling), no other.
                            let m = std::panic::catch_unwind(AssertUnwindSafe(|| k.mask(&ends)))
                                .unwrap_or_else(|p| Err(GrammarError::Panicked(panic_text(&p))));
                            (id, k, m)
                        })
                        .collect::<Vec<_>>()
                })
                .expect("spawn the grammar mask thread")
            });
            let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                device::forward(backend, model, cpu, &batch, bufs, &draws)
            }));
            // The thread catches its panics, so joining it does not fail.
            let ahead = masks.and_then(|h| h.join().ok()).unwrap_or_default();
            (result, ahead)
        });
        drop(batch);
        for (id, k, m) in ahead {
            if let Some(o) = self.outputs.get_mut(&id) {
                o.constraint = Some(k);
                o.next_mask = Some(m);
            }
        }
        let (mut drawn, mut lse) = match result {
            Ok(Ok(back)) => (back.drawn.into_iter(), back.lse.into_iter()),
            Ok(Err(e)) => {
                let ids: Vec<SeqId> = plan.chunks.iter().map(|c| c.seq).collect();
                self.fail(&ids, &format!("forward pass failed: {e}"));
                return true;
            }
            Err(panic) => {
                let ids: Vec<SeqId> = plan.chunks.iter().map(|c| c.seq).collect();
                self.fail(
                    &ids,
                    &format!("forward pass panicked: {}", panic_text(&panic)),
                );
                return true;
            }
        };
        let mut logits = std::mem::take(&mut self.bufs.logits);
        self.sched.commit(&plan);
        let vocab = self.model.config.vocab_size;
        let mut row = 0;
        let (hidden, mut hrow) = (std::mem::take(&mut self.bufs.hidden), 0);
        let width = self.model.config.hidden;
        for ((c, &all), &embed) in plan.chunks.iter().zip(&all_rows).zip(&hidden_rows) {
            if embed {
                self.embed_rows(c, &hidden[hrow * width..(hrow + c.len) * width]);
                hrow += c.len;
                if c.wants_logits {
                    self.finish_embedding(c.seq);
                }
                continue;
            }
            if all {
                self.score_prompt_rows(c, &logits[row * vocab..(row + c.len) * vocab]);
                row += c.len - 1;
            }
            if !c.wants_logits {
                row += all as usize;
                continue;
            }
            let l = &mut logits[row * vocab..(row + 1) * vocab];
            let next = match draws.get(row) {
                Some(DeviceRow::Drawn(_)) => {
                    Next::Drawn(drawn.next().expect("one drawn token a draw"))
                }
                Some(DeviceRow::Normalized(_)) => {
                    Next::Logits(l, Some(lse.next().expect("one log-sum-exp a row")))
                }
                _ => Next::Logits(l, None),
            };
            row += 1;
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| self.on_logits(c.seq, next)));
            if let Err(panic) = r {
                let msg = format!("sampling panicked: {}", panic_text(&panic));
                self.fail(&[c.seq], &msg);
            }
        }
        self.bufs.logits = logits;
        self.bufs.hidden = hidden;
        true
    }

    /// Sample the next token of `id` (and, on its first token, of its sibling choices), or take
    /// the one the device drew.
    fn on_logits(&mut self, id: SeqId, next: Next<'_>) {
        let Some(out) = self.outputs.get_mut(&id) else {
            return;
        };
        // The first choice's sequence ran the prompt (forked choices share it): it sends them.
        if out.req.req.prompt_logprobs.is_some() && out.choice == 0 && !out.prompt_scores_sent {
            out.prompt_scores_sent = true;
            let scores = std::mem::take(&mut out.prompt_scores);
            let _ = out.req.tx.send(EngineEvent::PromptLogprobs(scores));
        }
        if out.req.req.max_tokens == 0 {
            // Scoring only: every choice ends here, with no token.
            let forks = std::mem::take(&mut out.pending_forks);
            for choice in 0..=forks {
                out.finish_without_tokens(choice, &self.metrics);
            }
            self.outputs.remove(&id);
            self.sched.remove(id);
            return;
        }
        let forks = std::mem::take(&mut out.pending_forks);
        let (req, num_cached) = (out.req.clone(), out.num_cached_tokens);
        // A device draws no row with forks to make (`SeqOutput::device_draw`).
        if let Next::Logits(row, lse) = &next {
            self.fork_choices(id, &req, num_cached, forks, row, *lse);
        }
        let out = self.outputs.get_mut(&id).expect("present");
        let seq = self.sched.get(id).expect("running");
        let sampled = match next {
            Next::Logits(logits, lse) => {
                out.sample(&self.cpu, logits, lse, &seq.tokens[seq.prompt_len..])
            }
            Next::Drawn(s) => Ok(s),
        };
        let s = match sampled {
            Ok(s) => s,
            Err(e) => {
                // Its siblings end with it: one event ends the request.
                if let Some(o) = self.outputs.remove(&id) {
                    let _ = o.req.tx.send(EngineEvent::GrammarFailed(e));
                }
                self.sched.remove(id);
                return;
            }
        };
        let seq = self.sched.get_mut(id).expect("running");
        seq.tokens.push(s.token);
        let (num_generated, at_end) = (
            seq.num_generated(),
            seq.tokens.len() >= self.model.config.context_length,
        );
        let version = (seq.adapter.as_ref().map_or(0, |a| a.version), !seq.mixed_kv);
        if out.emit(
            &self.tokenizer,
            &s,
            num_generated,
            version,
            at_end,
            &self.metrics,
        ) {
            self.outputs.remove(&id);
            self.sched.remove(id);
        }
    }

    fn update_gauges(&mut self) {
        let m = &self.metrics;
        m.num_requests_running.set(self.sched.num_running() as i64);
        m.num_requests_waiting.set(self.sched.num_waiting() as i64);
        let st = self.sched.blocks().stats();
        // The window pool's first: a reader that sees the global pool empty sees it too.
        m.kv_window_blocks_used.set(st.num_window_used as i64);
        m.kv_blocks_used.set(st.num_used as i64);
        m.kv_cache_usage_perc
            .set(st.num_used as f64 / st.num_blocks.max(1) as f64);
        let (q, h) = self.last_prefix;
        m.prefix_cache_queries
            .inc_by(st.num_prefix_queried_tokens - q);
        m.prefix_cache_hits.inc_by(st.num_prefix_hit_tokens - h);
        self.last_prefix = (st.num_prefix_queried_tokens, st.num_prefix_hit_tokens);
    }
}

/// A row's next token: its logits for the host's sampler (with the device's log-sum-exp of
/// them where it normalized the row), or the token the device drew.
enum Next<'a> {
    Logits(&'a mut [f32], Option<f32>),
    Drawn(sampler::Sampled),
}

/// Whether chunk `c` of `s` covers prompt positions whose scores are wanted (its every row's
/// logits are computed).
fn scores_prompt(s: &Sequence, c: &Chunk) -> bool {
    s.score_prompt && c.start + 1 < s.prompt_len
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}
