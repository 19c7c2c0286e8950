//! The layouts the GPU's weight products can run in (`cuda/products.cuh`), and how each is
//! launched. Every layout gives the same bits: a (row, token)'s sum runs in one order whatever the
//! layout and the batch (the header says which), so a row's logits do not depend on its batch, on
//! a graph's padding or on this choice, and the choice is one of speed alone, which the speed run
//! on a GPU makes (`scripts/gpu_proof.sh layouts`). `FLYWHEEL_CUDA_DECODE` and
//! `FLYWHEEL_CUDA_BATCH` pick them; an unknown value stops `Gpu::open` with the choices.

use super::{GpuError, Result};

/// The product for one token (decode at batch 1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DecodeProduct {
    /// A block of 2 warps a row, thread i slot i (`fw_matmul1`): the layout first proven on an
    /// H200, and the faster there (the 1B shape's batch-1 decode 455 tok/s against `Warp`'s 379,
    /// 2026-11-27).
    #[default]
    Block,
    /// A warp a row, 4 rows a block, lane l slots l and l + 32 (`fw_matmulw`): no block barrier,
    /// and x read through the cache rather than staged by every row's block.
    Warp,
    /// The batch tile for one token: a block of 2 warps for 4 rows (`fw_matmul_t4x1`), thread i
    /// slot i of each: the 4 rows' bytes staged together (4 times the loads in flight a block),
    /// each value of x read once (through the cache) for the 4 rows, no barrier but the
    /// stage's. Not yet timed.
    Tile4,
    /// The same for 2 rows (`fw_matmul_t2x1`).
    Tile2,
}

/// The product for batches of tokens (prefill, and decode at batch 2 or more).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BatchProduct {
    /// A block a row, 16 tokens a pass, x staged per token between two barriers (`fw_matmul`).
    Row,
    /// A block for 4 rows × 8 tokens, the rows' weights decoded once for the 8 tokens
    /// (`fw_matmul_t4x8`). The default: on an H200 (2026-11-27, the 1B shape, `scripts/gpu_proof.sh
    /// next`) prefill 2099 → 2896 tok/s, decode at batch 8 958 → 1225, at batch 64 1161 → 1610
    /// against `Row`; `Tile2x16` was slower than both.
    #[default]
    Tile4x8,
    /// A block for 2 rows × 16 tokens (`fw_matmul_t2x16`): fewer registers, x read twice as
    /// often.
    Tile2x16,
}

pub const DECODE_VAR: &str = "FLYWHEEL_CUDA_DECODE";
pub const BATCH_VAR: &str = "FLYWHEEL_CUDA_BATCH";

/// The layouts a `Gpu` launches its products in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Products {
    pub decode: DecodeProduct,
    pub batch: BatchProduct,
}

/// A product's launch: the kernel's name before `_<format>`, its grid and its threads a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub kernel: &'static str,
    pub grid: (u32, u32),
    pub threads: u32,
}

impl DecodeProduct {
    pub const ALL: [DecodeProduct; 4] = [
        DecodeProduct::Block,
        DecodeProduct::Warp,
        DecodeProduct::Tile4,
        DecodeProduct::Tile2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DecodeProduct::Block => "block",
            DecodeProduct::Warp => "warp",
            DecodeProduct::Tile4 => "tile4",
            DecodeProduct::Tile2 => "tile2",
        }
    }
}

impl BatchProduct {
    pub const ALL: [BatchProduct; 3] = [
        BatchProduct::Row,
        BatchProduct::Tile4x8,
        BatchProduct::Tile2x16,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BatchProduct::Row => "row",
            BatchProduct::Tile4x8 => "tile4x8",
            BatchProduct::Tile2x16 => "tile2x16",
        }
    }
}

/// The value of `var` among `all` by name (None: the variable is unset or empty).
pub(super) fn choose<T: Copy>(
    var: &str,
    value: Option<&str>,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<Option<T>> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    all.iter()
        .copied()
        .find(|&c| name(c) == v)
        .map(Some)
        .ok_or_else(|| {
            let names: Vec<_> = all.iter().map(|&c| name(c)).collect();
            GpuError(format!("{var}={v}: choose one of {}", names.join(", ")))
        })
}

/// The value of the environment variable `var` among `all` by name, the default where it is
/// unset or empty (`choose`).
pub(super) fn choose_env<T: Copy + Default>(
    var: &str,
    all: &[T],
    name: fn(T) -> &'static str,
) -> Result<T> {
    let v = std::env::var(var).ok();
    Ok(choose(var, v.as_deref(), all, name)?.unwrap_or_default())
}

impl Products {
    /// The layouts `FLYWHEEL_CUDA_DECODE` and `FLYWHEEL_CUDA_BATCH` name, the defaults where unset.
    pub fn from_env() -> Result<Products> {
        let get = |var: &str| std::env::var(var).ok();
        Products::from_values(get(DECODE_VAR).as_deref(), get(BATCH_VAR).as_deref())
    }

    fn from_values(decode: Option<&str>, batch: Option<&str>) -> Result<Products> {
        let d = Products::default();
        Ok(Products {
            decode: choose(DECODE_VAR, decode, &DecodeProduct::ALL, DecodeProduct::name)?
                .unwrap_or(d.decode),
            batch: choose(BATCH_VAR, batch, &BatchProduct::ALL, BatchProduct::name)?
                .unwrap_or(d.batch),
        })
    }

    /// "decode warp, batch tile4x8".
    pub fn describe(&self) -> String {
        format!(
            "products: decode {}, batch {}",
            self.decode.name(),
            self.batch.name()
        )
    }

    /// The launch of y (n, rows) = x (n, cols) · Wᵀ (n ≥ 1), or why it cannot be launched.
    pub(super) fn plan(&self, rows: usize, n: usize) -> Result<Plan> {
        // (kernel, rows a block, tokens a block, threads a block), as products.cuh has them.
        let (kernel, r, t, threads) = if n == 1 {
            match self.decode {
                DecodeProduct::Block => ("fw_matmul1", 1, 1, 64),
                DecodeProduct::Warp => ("fw_matmulw", 4, 1, 128),
                DecodeProduct::Tile4 => ("fw_matmul_t4x1", 4, 1, 64),
                DecodeProduct::Tile2 => ("fw_matmul_t2x1", 2, 1, 64),
            }
        } else {
            match self.batch {
                BatchProduct::Row => ("fw_matmul", 1, 16, 64),
                BatchProduct::Tile4x8 => ("fw_matmul_t4x8", 4, 8, 64),
                BatchProduct::Tile2x16 => ("fw_matmul_t2x16", 2, 16, 64),
            }
        };
        let (gx, gy) = (rows.div_ceil(r), n.div_ceil(t));
        if rows > i32::MAX as usize || gx > i32::MAX as usize || gy > 65535 {
            return Err(GpuError(format!(
                "a matmul of {rows} rows and {n} tokens (a launch's grid is smaller)"
            )));
        }
        Ok(Plan {
            kernel,
            grid: (gx as u32, gy as u32),
            threads,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_by_name_and_an_unknown_one_names_the_choices() {
        assert_eq!(
            Products::from_values(None, Some("")).unwrap(),
            Products::default()
        );
        let p = Products::from_values(Some("warp"), Some(" tile2x16 ")).unwrap();
        assert_eq!(p.decode, DecodeProduct::Warp);
        assert_eq!(p.batch, BatchProduct::Tile2x16);
        assert_eq!(p.describe(), "products: decode warp, batch tile2x16");
        let e = Products::from_values(Some("warps"), None).unwrap_err().0;
        assert!(
            e.contains("FLYWHEEL_CUDA_DECODE=warps") && e.contains("block, warp, tile4, tile2"),
            "{e}"
        );
        let e = Products::from_values(None, Some("tile")).unwrap_err().0;
        assert!(e.contains("row, tile4x8, tile2x16"), "{e}");
    }

    #[test]
    fn every_layout_launches_a_block_for_every_row_and_token() {
        for decode in DecodeProduct::ALL {
            for batch in BatchProduct::ALL {
                let p = Products { decode, batch };
                for (rows, n) in [(1, 1), (67, 1), (2048, 1), (67, 2), (67, 13), (4097, 512)] {
                    let plan = p.plan(rows, n).unwrap();
                    let (r, t) = match plan.kernel {
                        "fw_matmul1" => (1, 1),
                        "fw_matmulw" => (4, 1),
                        "fw_matmul" => (1, 16),
                        "fw_matmul_t4x8" => (4, 8),
                        "fw_matmul_t4x1" => (4, 1),
                        "fw_matmul_t2x1" => (2, 1),
                        "fw_matmul_t2x16" => (2, 16),
                        k => panic!("{k}"),
                    };
                    assert_eq!(n == 1, t == 1, "{p:?}: {plan:?} for {n} tokens");
                    // Every (row, token) in exactly one block; no block wholly past the ends.
                    assert!(
                        plan.grid.0 as usize * r >= rows && (plan.grid.0 as usize - 1) * r < rows
                    );
                    assert!(plan.grid.1 as usize * t >= n && (plan.grid.1 as usize - 1) * t < n);
                    assert_eq!(plan.threads % 32, 0);
                }
                assert!(p.plan(10, 2 * 65536 * 16).is_err());
            }
        }
    }
}
