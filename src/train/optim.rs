//! AdamW over a flat parameter vector (the adapter's layout), with global gradient-norm clipping,
//! decoupled weight decay and learning-rate schedules. Its state (m, v, step) saves next to the
//! adapter as safetensors + JSON and loads back exactly: N steps, save, load, M steps equals N + M
//! steps to the bit.

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const STATE_FILE: &str = "optimizer.safetensors";
pub const CONFIG_FILE: &str = "optimizer.json";

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Schedule {
    Constant,
    /// Linear from 0 to the peak over `warmup` steps, then constant.
    Warmup {
        warmup: u64,
    },
    /// Linear warm-up, then cosine from the peak to `min_ratio`·peak at `total` steps.
    Cosine {
        warmup: u64,
        total: u64,
        min_ratio: f32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (None: no clipping).
    pub max_grad_norm: Option<f32>,
    pub schedule: Schedule,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
            schedule: Schedule::Constant,
        }
    }
}

impl AdamWConfig {
    /// The learning rate of step `t` (1-based).
    pub fn lr_at(&self, t: u64) -> f32 {
        let peak = self.lr as f64;
        let lr = match self.schedule {
            Schedule::Constant => peak,
            Schedule::Warmup { warmup } => {
                if t <= warmup && warmup > 0 {
                    peak * t as f64 / warmup as f64
                } else {
                    peak
                }
            }
            Schedule::Cosine {
                warmup,
                total,
                min_ratio,
            } => {
                if t <= warmup && warmup > 0 {
                    peak * t as f64 / warmup as f64
                } else {
                    let span = total.saturating_sub(warmup).max(1) as f64;
                    let p = ((t - warmup) as f64 / span).min(1.0);
                    let m = min_ratio as f64;
                    peak * (m + (1.0 - m) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()))
                }
            }
        };
        lr as f32
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub config: AdamWConfig,
    pub step: u64,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f32,
}

#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
    #[error("optimizer state: {0}")]
    State(String),
}

fn io(path: &Path, e: impl std::fmt::Display) -> OptimError {
    OptimError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    }
}

#[derive(Serialize, Deserialize)]
struct Saved {
    step: u64,
    num_params: usize,
    config: AdamWConfig,
}

impl AdamW {
    pub fn new(config: AdamWConfig, num_params: usize) -> AdamW {
        AdamW {
            config,
            step: 0,
            m: vec![0.0; num_params],
            v: vec![0.0; num_params],
        }
    }

    /// One step: clip `grad` to the global norm (in place), update the moments, move `params`.
    pub fn step(&mut self, params: &mut [f32], grad: &mut [f32]) -> StepStats {
        assert_eq!(params.len(), self.m.len());
        assert_eq!(grad.len(), self.m.len());
        let c = self.config;
        let norm = grad
            .iter()
            .map(|g| (*g as f64) * (*g as f64))
            .sum::<f64>()
            .sqrt();
        if let Some(max) = c.max_grad_norm {
            if norm > max as f64 && norm.is_finite() {
                let s = (max as f64 / (norm + 1e-6)) as f32;
                for g in grad.iter_mut() {
                    *g *= s;
                }
            }
        }
        self.step += 1;
        let t = self.step;
        let lr = c.lr_at(t);
        let bc1 = 1.0 - (c.beta1 as f64).powi(t as i32);
        let bc2 = 1.0 - (c.beta2 as f64).powi(t as i32);
        let (step_size, bc2_sqrt) = ((lr as f64 / bc1) as f32, bc2.sqrt() as f32);
        let decay = 1.0 - lr * c.weight_decay;
        for i in 0..params.len() {
            let g = grad[i];
            let m = c.beta1 * self.m[i] + (1.0 - c.beta1) * g;
            let v = c.beta2 * self.v[i] + (1.0 - c.beta2) * g * g;
            self.m[i] = m;
            self.v[i] = v;
            // Decoupled decay, then θ −= lr·m̂/(√v̂ + ε) (PyTorch's AdamW arithmetic).
            let p = params[i] * decay;
            params[i] = p - step_size * m / (v.sqrt() / bc2_sqrt + c.eps);
        }
        StepStats {
            grad_norm: norm,
            lr,
        }
    }

    /// Write `optimizer.safetensors` (m, v) and `optimizer.json` (step, config) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), OptimError> {
        let bytes = crate::util::f32_le_bytes;
        let (mb, vb) = (bytes(&self.m), bytes(&self.v));
        let n = self.m.len();
        let views = vec![
            ("exp_avg", TensorView::new(Dtype::F32, vec![n], &mb)),
            ("exp_avg_sq", TensorView::new(Dtype::F32, vec![n], &vb)),
        ];
        let views: Vec<(&str, TensorView)> = views
            .into_iter()
            .map(|(k, v)| v.map(|v| (k, v)))
            .collect::<Result<_, _>>()
            .map_err(|e| OptimError::State(e.to_string()))?;
        let st =
            safetensors::serialize(views, None).map_err(|e| OptimError::State(e.to_string()))?;
        let p = dir.join(STATE_FILE);
        crate::util::write_synced(&p, &st).map_err(|e| io(&p, e))?;
        let j = serde_json::to_vec_pretty(&Saved {
            step: self.step,
            num_params: n,
            config: self.config,
        })
        .map_err(|e| OptimError::State(e.to_string()))?;
        let p = dir.join(CONFIG_FILE);
        crate::util::write_synced(&p, &j).map_err(|e| io(&p, e))
    }

    pub fn load(dir: &Path) -> Result<AdamW, OptimError> {
        let p = dir.join(CONFIG_FILE);
        let text = std::fs::read(&p).map_err(|e| io(&p, e))?;
        let saved: Saved = serde_json::from_slice(&text).map_err(|e| io(&p, e))?;
        let p = dir.join(STATE_FILE);
        let bytes = std::fs::read(&p).map_err(|e| io(&p, e))?;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| io(&p, e))?;
        let read = |name: &str| -> Result<Vec<f32>, OptimError> {
            let t = st
                .tensor(name)
                .map_err(|_| OptimError::State(format!("{name} missing")))?;
            if t.dtype() != Dtype::F32 || t.shape() != [saved.num_params] {
                return Err(OptimError::State(format!(
                    "{name}: {:?} {:?}, expected F32 [{}]",
                    t.dtype(),
                    t.shape(),
                    saved.num_params
                )));
            }
            Ok(t.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        Ok(AdamW {
            config: saved.config,
            step: saved.step,
            m: read("exp_avg")?,
            v: read("exp_avg_sq")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grad_of(params: &[f32], t: u64) -> Vec<f32> {
        // A quadratic bowl with a step-dependent tilt: ∇ = 2(θ − c_t).
        params
            .iter()
            .enumerate()
            .map(|(i, p)| 2.0 * (p - ((i as f32 * 0.37 + t as f32 * 0.11).sin())))
            .collect()
    }

    #[test]
    fn matches_adamw_written_out_in_f64() {
        let cfg = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            max_grad_norm: None,
            ..Default::default()
        };
        let mut p = vec![0.5f32, -0.25, 1.0];
        let mut opt = AdamW::new(cfg, 3);
        let (mut q, mut m, mut v) = (vec![0.5f64, -0.25, 1.0], [0.0f64; 3], [0.0f64; 3]);
        for t in 1..=5u64 {
            let mut g = grad_of(&p, t);
            let g64: Vec<f64> = g.iter().map(|x| *x as f64).collect();
            opt.step(&mut p, &mut g);
            for i in 0..3 {
                m[i] = 0.9 * m[i] + 0.1 * g64[i];
                v[i] = 0.999 * v[i] + 0.001 * g64[i] * g64[i];
                let (mh, vh) = (
                    m[i] / (1.0 - 0.9f64.powi(t as i32)),
                    v[i] / (1.0 - 0.999f64.powi(t as i32)),
                );
                q[i] = q[i] * (1.0 - 0.01 * 0.1) - 0.01 * mh / (vh.sqrt() + 1e-8);
            }
            for i in 0..3 {
                assert!(
                    (p[i] as f64 - q[i]).abs() < 1e-5,
                    "step {t}: {} vs {}",
                    p[i],
                    q[i]
                );
            }
        }
    }

    #[test]
    fn clipping_scales_the_global_norm() {
        let mut opt = AdamW::new(
            AdamWConfig {
                max_grad_norm: Some(1.0),
                ..Default::default()
            },
            2,
        );
        let mut g = vec![3.0f32, 4.0];
        let s = opt.step(&mut [0.0, 0.0], &mut g);
        assert!((s.grad_norm - 5.0).abs() < 1e-9);
        let n = (g[0] * g[0] + g[1] * g[1]).sqrt();
        assert!((n - 1.0).abs() < 1e-5, "{n}");
    }

    #[test]
    fn schedules_warm_up_and_decay() {
        let c = AdamWConfig {
            lr: 1.0,
            schedule: Schedule::Cosine {
                warmup: 4,
                total: 14,
                min_ratio: 0.1,
            },
            ..Default::default()
        };
        assert_eq!(c.lr_at(1), 0.25);
        assert_eq!(c.lr_at(4), 1.0);
        assert!((c.lr_at(9) - 0.55).abs() < 1e-6);
        assert!((c.lr_at(14) - 0.1).abs() < 1e-6 && (c.lr_at(100) - 0.1).abs() < 1e-6);
        let w = AdamWConfig {
            lr: 2.0,
            schedule: Schedule::Warmup { warmup: 2 },
            ..Default::default()
        };
        assert_eq!((w.lr_at(1), w.lr_at(2), w.lr_at(50)), (1.0, 2.0, 2.0));
    }

    #[test]
    fn save_and_load_resume_to_the_bit() {
        let cfg = AdamWConfig {
            lr: 0.05,
            weight_decay: 0.01,
            schedule: Schedule::Cosine {
                warmup: 2,
                total: 10,
                min_ratio: 0.0,
            },
            ..Default::default()
        };
        let n = 257;
        let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).cos()).collect();
        let run = |opt: &mut AdamW, p: &mut Vec<f32>, steps: std::ops::Range<u64>| {
            for t in steps {
                let mut g = grad_of(p, t);
                opt.step(p, &mut g);
            }
        };
        let (mut a, mut pa) = (AdamW::new(cfg, n), init.clone());
        run(&mut a, &mut pa, 1..8);
        let (mut b, mut pb) = (AdamW::new(cfg, n), init);
        run(&mut b, &mut pb, 1..4);
        let dir = tempfile::tempdir().unwrap();
        b.save(dir.path()).unwrap();
        let mut b2 = AdamW::load(dir.path()).unwrap();
        assert_eq!(b2, b);
        run(&mut b2, &mut pb, 4..8);
        assert_eq!(b2, a);
        assert!(pa.iter().zip(&pb).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}
