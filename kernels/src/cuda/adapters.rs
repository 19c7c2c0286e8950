//! Adapters applied row by row from a directory on the GPU (`cuda/adapters.cuh`), for decode
//! graphs that serve any adapter versions: `AdapterRows` holds one entry per (slot, module) — an
//! adapter version takes a slot, its modules' tensors are named by device address — and each
//! row's slot for the step. A captured graph reads both at every replay, so a published version is
//! a slot's entries rewritten, never a new capture. Every entry is checked here against its
//! module's shape before it is written (a kernel trusts the addresses it reads).

use super::launch::{grid1, len_at_least, ROW_THREADS};
use super::{check, Gpu, Result};
use cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};

/// Warps of `fw_lora_a_rows`'s blocks (`FW_MMW_WARPS`): a value of A·x each.
const LORA_A_WARPS: usize = 4;

pub const LORA_VAR: &str = "FLYWHEEL_CUDA_LORA";

/// How LoRA's first product (A·x, row by row in decode graphs) is launched
/// (`FLYWHEEL_CUDA_LORA`): the same bits either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoraLayout {
    /// A warp a value, 4 a block (`fw_lora_a_rows`; proven on an H200, 12.5 µs a launch there
    /// in batch-1 decode).
    #[default]
    Warp,
    /// A block of 2 warps a value, thread i slot i (`fw_lora_a_block`). Not yet timed.
    Block,
}

impl LoraLayout {
    pub const ALL: [LoraLayout; 2] = [LoraLayout::Warp, LoraLayout::Block];

    pub fn name(self) -> &'static str {
        match self {
            LoraLayout::Warp => "warp",
            LoraLayout::Block => "block",
        }
    }

    /// The layout `FLYWHEEL_CUDA_LORA` names, the default where unset.
    pub fn from_env() -> Result<LoraLayout> {
        super::products::choose_env(LORA_VAR, &Self::ALL, Self::name)
    }
}

/// One module of one adapter version as the kernels read it (`FwAdapterEntry`): device addresses
/// of OFT's rotations or of LoRA's A (bytes of f32) and Bᵀ, 0 where absent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdapterEntry {
    oft: u64,
    lora_a: u64,
    lora_bt: u64,
    r: i32,
    block: i32,
    scale: f32,
    pad: i32,
}
// SAFETY: plain data with the C layout of `FwAdapterEntry` in cuda/adapters.cuh; all zeros is the
// entry of a module no version adapts.
unsafe impl DeviceRepr for AdapterEntry {}
unsafe impl ValidAsZeroBits for AdapterEntry {}

impl AdapterEntry {
    pub fn lora_rank(&self) -> usize {
        if self.lora_a == 0 {
            0
        } else {
            self.r as usize
        }
    }
}

/// The directory of adapter entries (slots × modules) and the step's slot of each row.
pub struct AdapterRows {
    /// Each module's (inputs, outputs).
    dims: Vec<(usize, usize)>,
    dir: CudaSlice<AdapterEntry>,
    row_slot: CudaSlice<i32>,
    /// Each slot's largest LoRA rank, and the largest of the rows set by the last `set_rows`.
    slot_rank: Vec<usize>,
    rows_rank: usize,
    /// Rows set by the last `set_rows`.
    pub n: usize,
}

impl AdapterRows {
    pub fn slots(&self) -> usize {
        self.slot_rank.len()
    }

    pub fn modules(&self) -> usize {
        self.dims.len()
    }
}

impl Gpu {
    /// A directory of `slots` adapter versions over modules of the given (inputs, outputs), and
    /// the slots of up to `max_rows` rows; every entry empty.
    pub fn adapter_rows(
        &self,
        slots: usize,
        dims: Vec<(usize, usize)>,
        max_rows: usize,
    ) -> Result<AdapterRows> {
        check(slots > 0 && !dims.is_empty(), || {
            format!(
                "an adapter directory of {slots} slots and {} modules",
                dims.len()
            )
        })?;
        Ok(AdapterRows {
            dir: self.zeros(slots * dims.len())?,
            row_slot: self.zeros(max_rows.max(1))?,
            dims,
            slot_rank: vec![0; slots],
            rows_rank: 0,
            n: 0,
        })
    }

    /// The entry of an OFT module of `m`'s shape: its rotations (in/block blocks of block × block,
    /// `rotations` holding exactly those).
    pub fn oft_entry(
        &self,
        rows: &AdapterRows,
        m: usize,
        rotations: &CudaView<f32>,
        block: usize,
    ) -> Result<AdapterEntry> {
        let (inp, _) = self.module_dims(rows, m)?;
        check(
            block > 0 && inp % block == 0 && rotations.len() == inp * block,
            || {
                format!(
                    "OFT blocks of {block} over {inp} inputs in {} values",
                    rotations.len()
                )
            },
        )?;
        Ok(AdapterEntry {
            oft: self.ptr(rotations),
            block: block as i32,
            ..AdapterEntry::default()
        })
    }

    /// The entry of a LoRA module of `m`'s shape: A (r × inputs f32, as bytes), Bᵀ (r × outputs),
    /// its scale.
    pub fn lora_entry(
        &self,
        rows: &AdapterRows,
        m: usize,
        a: &CudaView<u8>,
        bt: &CudaView<f32>,
        r: usize,
        scale: f32,
    ) -> Result<AdapterEntry> {
        let (inp, out) = self.module_dims(rows, m)?;
        // A is read by the products' kernels: rows of whole 32-value units.
        check(
            r > 0 && inp % 32 == 0 && a.len() == r * inp * 4 && bt.len() == r * out,
            || {
                format!(
                    "LoRA of rank {r} for {inp} → {out}: A {} bytes, Bᵀ {} values",
                    a.len(),
                    bt.len()
                )
            },
        )?;
        Ok(AdapterEntry {
            lora_a: self.ptr(a),
            lora_bt: self.ptr(bt),
            r: r as i32,
            scale,
            ..AdapterEntry::default()
        })
    }

    fn module_dims(&self, rows: &AdapterRows, m: usize) -> Result<(usize, usize)> {
        rows.dims
            .get(m)
            .copied()
            .ok_or_else(|| super::GpuError(format!("module {m} of {}", rows.dims.len())))
    }

    /// Write `slot`'s entries, one per module (built by `oft_entry`/`lora_entry`, or default).
    pub fn set_slot(
        &self,
        rows: &mut AdapterRows,
        slot: usize,
        entries: &[AdapterEntry],
    ) -> Result<()> {
        check(
            slot < rows.slots() && entries.len() == rows.dims.len(),
            || {
                format!(
                    "slot {slot} of {} with {} entries for {} modules",
                    rows.slots(),
                    entries.len(),
                    rows.dims.len()
                )
            },
        )?;
        let m = rows.dims.len();
        rows.slot_rank[slot] = entries
            .iter()
            .map(AdapterEntry::lora_rank)
            .max()
            .unwrap_or(0);
        let mut view = rows.dir.slice_mut(slot * m..(slot + 1) * m);
        Ok(self.stream().memcpy_htod(entries, &mut view)?)
    }

    /// The step's slot of each row (-1: no adapter).
    pub fn set_rows(&self, rows: &mut AdapterRows, slots: &[i32]) -> Result<()> {
        check(
            slots.iter().all(|&s| s >= -1 && s < rows.slots() as i32),
            || format!("row slots {slots:?} of a directory of {}", rows.slots()),
        )?;
        self.write(slots, &mut rows.row_slot)?;
        rows.n = slots.len();
        rows.rows_rank = slots
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| rows.slot_rank[s as usize])
            .max()
            .unwrap_or(0);
        Ok(())
    }

    fn rows_args(&self, rows: &AdapterRows, m: usize, n: usize) -> Result<(u64, u64, i32, i32)> {
        check(m < rows.dims.len() && n <= rows.n, || {
            format!(
                "module {m} of {}, {n} rows of {} set",
                rows.dims.len(),
                rows.n
            )
        })?;
        Ok((
            self.ptr(&rows.row_slot),
            self.ptr(&rows.dir),
            rows.dims.len() as i32,
            m as i32,
        ))
    }

    /// out (n, inputs of m) = each row of x through its version's OFT rotation of module m, or
    /// the row itself (`block_matmul`'s sums).
    pub fn oft_rows(
        &self,
        rows: &AdapterRows,
        m: usize,
        x: &impl DevicePtr<f32>,
        n: usize,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (rs, dir, modules, mi) = self.rows_args(rows, m, n)?;
        let d = rows.dims[m].0;
        len_at_least(x, n * d, "oft_rows x")?;
        len_at_least(out, n * d, "oft_rows out")?;
        if n * d == 0 {
            return Ok(());
        }
        let f = self.function("fw_oft_rows")?;
        let (xp, op, ni, di) = (self.ptr(x), self.ptr_mut(out), n as i32, d as i32);
        self.launch(
            f,
            grid1(n * d, ROW_THREADS),
            &[&xp, &rs, &dir, &modules, &mi, &ni, &di, &op],
        )
    }

    /// y (n, outputs of m) += s·B(A x) for the rows whose version has LoRA on module m (A·x in
    /// `matmul`'s order of sums into h, n rows of `r_max` values; then `block_matmul`'s and
    /// `axpy`'s arithmetic). `r_max`: at least every such row's rank (the caller's to know).
    #[allow(clippy::too_many_arguments)]
    pub fn lora_rows(
        &self,
        rows: &AdapterRows,
        m: usize,
        x: &impl DevicePtr<f32>,
        n: usize,
        r_max: usize,
        h: &mut impl DevicePtrMut<f32>,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (rs, dir, modules, mi) = self.rows_args(rows, m, n)?;
        let (inp, out) = rows.dims[m];
        len_at_least(x, n * inp, "lora_rows x")?;
        len_at_least(h, n * r_max, "lora_rows h")?;
        len_at_least(y, n * out, "lora_rows y")?;
        check(n <= 65535 && r_max >= rows.rows_rank, || {
            format!(
                "lora_rows over {n} rows of rank up to {} with r_max {r_max}",
                rows.rows_rank
            )
        })?;
        if n == 0 || r_max == 0 {
            return Ok(());
        }
        let (xp, hp, yp) = (self.ptr(x), self.ptr_mut(h), self.ptr_mut(y));
        let (ni, ii, oi, hs) = (n as i32, inp as i32, out as i32, r_max as i32);
        let (name, grid_x, threads) = match self.lora_layout {
            LoraLayout::Warp => (
                "fw_lora_a_rows",
                r_max.div_ceil(LORA_A_WARPS),
                LORA_A_WARPS * 32,
            ),
            LoraLayout::Block => ("fw_lora_a_block", r_max, 64), // FW_MM_WARPS warps a value
        };
        let cfg = LaunchConfig {
            grid_dim: (grid_x as u32, n as u32, 1),
            block_dim: (threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let fa = self.function(name)?;
        self.launch(fa, cfg, &[&xp, &rs, &dir, &modules, &mi, &ii, &hs, &hp])?;
        let fb = self.function("fw_lora_b_rows")?;
        self.launch(
            fb,
            grid1(n * out, ROW_THREADS),
            &[&hp, &hs, &rs, &dir, &modules, &mi, &ni, &oi, &yp],
        )
    }
}
