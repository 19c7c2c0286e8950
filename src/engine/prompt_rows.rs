//! What the engine does with a chunk's other rows: an embedding request's hidden states, summed
//! and finished into its vector, and a scored prompt's log-probs.

use super::scheduler::Chunk;
use super::sequence::SeqId;
use super::{sampler, Engine, EngineEvent};

impl Engine {
    /// Add the hidden states of chunk `c`'s prompt positions not added before.
    pub(super) fn embed_rows(&mut self, c: &Chunk, rows: &[f32]) {
        let Some(out) = self.outputs.get_mut(&c.seq) else {
            return;
        };
        let width = self.model.config.hidden;
        if out.embed_sum.is_empty() {
            out.embed_sum = vec![0.0; width];
        }
        for i in 0..c.len {
            if c.start + i < out.embed_count {
                continue;
            }
            for (s, &x) in out
                .embed_sum
                .iter_mut()
                .zip(&rows[i * width..(i + 1) * width])
            {
                *s += x as f64;
            }
            out.embed_count += 1;
        }
    }

    /// The prompt is through: its mean hidden state, L2-normalised, and the request's end.
    pub(super) fn finish_embedding(&mut self, id: SeqId) {
        let Some(out) = self.outputs.remove(&id) else {
            return;
        };
        let n = out.embed_count.max(1) as f64;
        let mean: Vec<f64> = out.embed_sum.iter().map(|s| s / n).collect();
        let norm = mean.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        let v = mean.iter().map(|x| (x / norm) as f32).collect();
        let _ = out.req.tx.send(EngineEvent::Embedding(v));
        out.finish_without_tokens(0, &self.metrics);
        self.sched.remove(id);
    }

    /// Score the prompt positions of chunk `c` (rows = its logits, one per token) that were not
    /// scored before (a preempted sequence recomputes its prompt).
    pub(super) fn score_prompt_rows(&mut self, c: &Chunk, rows: &[f32]) {
        let vocab = self.model.config.vocab_size;
        let Some(s) = self.sched.get(c.seq) else {
            return;
        };
        let Some(out) = self.outputs.get_mut(&c.seq) else {
            return;
        };
        let r = &out.req.req;
        let (k, t) = (r.prompt_logprobs.unwrap_or(0), r.sampling.temperature);
        let mut row = vec![0.0f32; vocab];
        for i in 0..c.len {
            let pos = c.start + i;
            // Row `pos` predicts token pos + 1.
            if pos + 1 >= s.prompt_len || pos < out.prompt_scores.len() {
                continue;
            }
            row.copy_from_slice(&rows[i * vocab..(i + 1) * vocab]);
            let score = sampler::score_row(&self.cpu, &mut row, t, s.tokens[pos + 1], k);
            out.prompt_scores.push(score);
        }
    }
}
