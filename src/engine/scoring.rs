//! Training forwards the engine runs between its serving steps (`EngineHandle::logprobs`): a
//! trainer's log-probs from the very kernels that served the completions — on a GPU,
//! `GpuDecoder::logprobs`, so that train = serve there bit for bit (the tokens the host draws
//! beside the GPU with the GPU's log-softmax too: `Gpu::normalize`).
//! A job runs one part (`score_parts`: at most a step's tokens) a turn of the loop, after the
//! turn's serving step, in KV blocks taken from the block manager for that part and given back
//! after it: at most one part between two serving steps (not timed: no GPU has run it yet). On
//! the CPU a job runs whole in one turn (`Decoder::logprobs`, the trainer's own forward).

use super::{device, Engine};
use crate::adapter::AdapterWeights;
use crate::model::decoder::{
    blocks_of, inline_prefixes, part_seqs, prefixes_to_inline, score_parts, TrainSeq,
};
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc};

/// One sequence of a scoring job: `TrainSeq`'s fields, owned.
pub(super) struct ScoreSeq {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub prefix: Option<usize>,
}

pub(super) type ScoreReply = mpsc::SyncSender<Result<Vec<Vec<f32>>, String>>;

pub(super) struct ScoreJob {
    pub seqs: Vec<ScoreSeq>,
    pub adapter: Option<Arc<AdapterWeights>>,
    pub temperature: f32,
    pub tx: ScoreReply,
}

impl ScoreJob {
    fn train_seqs(&self) -> Vec<TrainSeq<'_>> {
        self.seqs
            .iter()
            .map(|s| TrainSeq {
                tokens: &s.tokens,
                prompt_len: s.prompt_len,
                prefix: s.prefix,
            })
            .collect()
    }
}

/// A job in progress: its parts left (indices into its sequences) and the log-probs so far.
pub(super) struct Scoring {
    job: ScoreJob,
    parts: VecDeque<Vec<usize>>,
    out: Vec<Vec<f32>>,
}

impl Engine {
    /// Queue a scoring job, or refuse it now (a sequence no step holds).
    pub(super) fn add_scoring(&mut self, mut job: ScoreJob) {
        let vocab = self.model.config.vocab_size;
        if let Some(t) = job
            .seqs
            .iter()
            .flat_map(|s| &s.tokens)
            .find(|&&t| t as usize >= vocab)
        {
            let _ = job.tx.send(Err(format!(
                "token {t} is not in the model's vocabulary of {vocab}"
            )));
            return;
        }
        if let Some((_, block_size)) = device::score_bounds(&self.backend) {
            // Prefixes of partial blocks of this cache with the sequences continuing them.
            let seqs = job.train_seqs();
            let inlined = prefixes_to_inline(&seqs, block_size);
            let seqs: Vec<ScoreSeq> = inline_prefixes(&seqs, &inlined)
                .into_iter()
                .map(|s| ScoreSeq {
                    tokens: s.tokens.to_vec(),
                    prompt_len: s.prompt_len,
                    prefix: s.prefix,
                })
                .collect();
            job.seqs = seqs;
        }
        let seqs = job.train_seqs();
        let parts = match device::score_bounds(&self.backend) {
            None => Ok(vec![(0..seqs.len()).collect()]),
            Some((max_tokens, block_size)) => {
                let blocks = self.sched.blocks().stats().num_blocks;
                score_parts(&seqs, block_size, max_tokens, blocks)
            }
        };
        let n = seqs.len();
        drop(seqs);
        match parts {
            Ok(parts) if parts.is_empty() => {
                let _ = job.tx.send(Ok(Vec::new()));
            }
            Ok(parts) => self.scoring.push_back(Scoring {
                out: vec![Vec::new(); n],
                parts: parts.into(),
                job,
            }),
            Err(e) => {
                let _ = job.tx.send(Err(e.to_string()));
            }
        }
    }

    /// The first job's next part, where the blocks it needs are free (else it waits for serving
    /// to give some back); true when a part ran or a job ended.
    pub(super) fn score_turn(&mut self) -> bool {
        let Some(w) = self.scoring.front_mut() else {
            return false;
        };
        let all = w.job.train_seqs();
        let part = w.parts.front().expect("a queued job has parts left");
        let seqs = part_seqs(&all, part);
        let mut table = self.sched.blocks().new_table();
        if let Some((_, bs)) = device::score_bounds(&self.backend) {
            let need = blocks_of(&seqs, bs);
            if !table.ensure(need * bs) {
                if !self.sched.is_idle() {
                    return false;
                }
                let free = self.sched.blocks().num_free();
                let e = format!("the training forward needs {need} free KV blocks; {free} are");
                drop((seqs, all));
                let w = self.scoring.pop_front().expect("the job");
                let _ = w.job.tx.send(Err(e));
                return true;
            }
        }
        let adapter = w.job.adapter.as_deref();
        let t = w.job.temperature;
        // A forward that panics fails its own job, no other.
        let got = std::panic::catch_unwind(AssertUnwindSafe(|| {
            device::score(
                &mut self.backend,
                &self.model,
                &self.cpu,
                &seqs,
                table.ids(),
                adapter,
                t,
            )
            .map_err(|e| e.to_string())
        }))
        .unwrap_or_else(|p| Err(format!("the forward panicked: {}", super::panic_text(&p))));
        drop(table);
        drop((seqs, all));
        let part = w.parts.pop_front().expect("the part");
        match got {
            Ok(lps) => {
                for (i, lp) in part.into_iter().zip(lps) {
                    w.out[i] = lp;
                }
                if w.parts.is_empty() {
                    let w = self.scoring.pop_front().expect("the job");
                    let _ = w.job.tx.send(Ok(w.out));
                }
            }
            Err(e) => {
                let w = self.scoring.pop_front().expect("the job");
                let _ = w.job.tx.send(Err(e));
            }
        }
        true
    }
}
