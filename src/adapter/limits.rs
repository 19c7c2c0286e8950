//! What a request or a file may make an adapter allocate (rank, block size, parameters, file
//! size), checked before anything large exists.

use super::{config_error, AdapterBase, AdapterConfig, AdapterError, AdapterLayout, Method};

/// Bounds on what a request or a file may make an adapter allocate, checked before allocating.
#[derive(Clone, Copy, Debug)]
pub struct AdapterLimits {
    pub max_lora_rank: usize,
    pub max_oft_block_size: usize,
    /// Parameters of one adapter (f32 each; a learning adapter keeps three vectors this long).
    pub max_params: usize,
    /// Size of an `adapter_model.safetensors` file.
    pub max_file_bytes: u64,
}

impl Default for AdapterLimits {
    fn default() -> AdapterLimits {
        AdapterLimits {
            max_lora_rank: 256,
            max_oft_block_size: 256,
            max_params: 50_000_000,
            max_file_bytes: 1 << 30,
        }
    }
}

impl AdapterLimits {
    /// Refuse a method whose rank or block size is past the limits (before any layout exists).
    pub fn check_method(&self, m: &Method) -> Result<(), AdapterError> {
        match m {
            Method::Lora(l) if l.r > self.max_lora_rank => Err(config_error(
                "r",
                format!(
                    "{} is above this server's limit of {}",
                    l.r, self.max_lora_rank
                ),
            )),
            Method::Oft(o) if o.block_size > self.max_oft_block_size => Err(config_error(
                "oft_block_size",
                format!(
                    "{} is above this server's limit of {}",
                    o.block_size, self.max_oft_block_size
                ),
            )),
            _ => Ok(()),
        }
    }

    /// A layout for `config` on `model` within the limits (nothing large is allocated before).
    pub fn layout(
        &self,
        config: AdapterConfig,
        model: &impl AdapterBase,
    ) -> Result<AdapterLayout, AdapterError> {
        self.check_method(&config.method)?;
        let layout = AdapterLayout::new(config, model)?;
        if layout.num_params > self.max_params {
            return Err(config_error(
                "num_parameters",
                format!(
                    "the adapter would have {} parameters, above this server's limit of {}",
                    layout.num_params, self.max_params
                ),
            ));
        }
        Ok(layout)
    }
}
