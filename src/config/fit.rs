//! The context a server runs with and the KV blocks its cache holds: `Config::fit_context`.

use super::{invalid, Config, ConfigError};

impl Config {
    /// The context served and the KV blocks `kv_cache_bytes` holds (K and V for every layer),
    /// so that one sequence of the full context always fits. A configured `max_model_len` is
    /// capped by the model's and must fit (an error saying how much it needs, as vLLM's);
    /// without one, the model's context is fitted to the cache (as llama-server fits it), with a
    /// note saying so.
    ///
    /// `windows`: the model's sliding-window layers, where the cache may keep them apart. Their
    /// pool holds what `max_num_seqs` sequences can ever read of them (each its window plus two
    /// blocks, plus one step's tokens), and only where that is less than the global pool would
    /// give them: the global layers get the rest, so the context and the number of long
    /// sequences grow, and the window pool never runs out first.
    pub fn fit_context(
        &self,
        num_layers: usize,
        kv_dim: usize,
        model_context: usize,
        windows: Option<WindowLayers>,
    ) -> Result<FittedContext, ConfigError> {
        let layer_block = self.block_size * kv_dim * 2 * self.kv_dtype.bytes();
        let total = self.kv_cache_bytes / layer_block.max(1);
        let full = total / num_layers.max(1);
        let split = windows
            .filter(|w| w.layers > 0 && w.layers < num_layers && w.window > 0)
            .map(|w| {
                let per_seq = w.window.div_ceil(self.block_size) + 2;
                let pool = self.max_num_seqs * per_seq
                    + self.max_num_batched_tokens.div_ceil(self.block_size);
                (w.layers, pool)
            })
            .filter(|&(_, pool)| pool < full);
        let (n, global_layers, window_bytes) = match split {
            Some((layers, pool)) => (
                (total - pool * layers) / (num_layers - layers),
                num_layers - layers,
                pool * layers * layer_block,
            ),
            None => (full, num_layers, 0),
        };
        let per_block = global_layers * layer_block;
        let mib = |blocks: usize| (blocks * per_block + window_bytes).div_ceil(1 << 20);
        let fitted = |max_model_len, note| FittedContext {
            max_model_len,
            num_kv_blocks: n,
            num_window_blocks: split.map(|(_, pool)| pool),
            note,
        };
        if let Some(want) = self.max_model_len {
            let len = want.min(model_context);
            let need = len.div_ceil(self.block_size);
            if n < need {
                return Err(invalid(
                    self.kv_cache_from,
                    format!(
                        "{} MiB holds {n} blocks of {} tokens; one sequence of max_model_len {len} needs {need} ({} MiB): raise {} or lower --max-model-len",
                        self.kv_cache_bytes >> 20,
                        self.block_size,
                        mib(need),
                        self.kv_cache_from
                    ),
                ));
            }
            let note = (want > model_context).then(|| {
                format!("max_model_len {want} is beyond the model's context; serving {len}")
            });
            return Ok(fitted(len, note));
        }
        let need = model_context.div_ceil(self.block_size);
        if n >= need {
            return Ok(fitted(model_context, None));
        }
        if n == 0 {
            return Err(invalid(
                self.kv_cache_from,
                format!(
                    "{} MiB holds no block of {} tokens ({} MiB each)",
                    self.kv_cache_bytes >> 20,
                    self.block_size,
                    mib(1)
                ),
            ));
        }
        let len = n * self.block_size;
        Ok(fitted(
            len,
            Some(format!(
                "the model's context of {model_context} tokens needs {} MiB of KV cache; \
                 {} MiB ({}) hold {len} tokens, so max_model_len is {len} (raise {2}, or set \
                 --max-model-len to choose)",
                mib(need),
                self.kv_cache_bytes >> 20,
                self.kv_cache_from
            )),
        ))
    }
}

/// A model's sliding-window layers, for [`Config::fit_context`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowLayers {
    /// How many layers have a window, and its keys.
    pub layers: usize,
    pub window: usize,
}

/// What [`Config::fit_context`] chose.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FittedContext {
    pub max_model_len: usize,
    pub num_kv_blocks: usize,
    /// The sliding-window layers' own pool (None: they take global blocks).
    pub num_window_blocks: Option<usize>,
    /// Why the context is not the model's, for the start-up log.
    pub note: Option<String>,
}
