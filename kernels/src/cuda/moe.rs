//! A mixture of experts on the GPU for decode graphs (`cuda/moe.cuh`): the router's choices made
//! on the device and each (token, choice)'s expert product row by row, so that a decode step reads
//! nothing back to the host.

use super::int8::{check_int8, I8_ROWS};
use super::launch::grid1;
use super::Q8Acts;
use super::{check, type_name, DeviceMatrix, Gpu, Result};
use crate::quant::QuantType;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

/// The most experts a token uses that `moe_route` takes (`FW_MOE_MAX_USED`).
pub const MOE_MAX_USED: usize = 16;
/// Warps of `fw_matmul_experts`' blocks (`FW_MMW_WARPS`): an output value each.
const EXPERT_WARPS: usize = 4;

/// One projection's experts on the GPU: each expert's matrix address, all of one shape and
/// format. It names the matrices' memory: it lives no longer than they do (its owner keeps both).
pub struct ExpertTable {
    ty: QuantType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ptrs: CudaSlice<u64>,
}

impl Gpu {
    /// The table of `experts` (one or more matrices of one shape and format).
    pub fn expert_table(&self, experts: &[DeviceMatrix]) -> Result<ExpertTable> {
        let first = experts
            .first()
            .ok_or_else(|| super::GpuError("an expert table of no experts".into()))?;
        check(
            experts
                .iter()
                .all(|e| e.ty == first.ty && e.rows == first.rows && e.cols == first.cols),
            || "experts of different shapes or formats".to_string(),
        )?;
        let ptrs: Vec<u64> = experts.iter().map(|e| self.ptr(&e.data)).collect();
        Ok(ExpertTable {
            ty: first.ty,
            rows: first.rows,
            cols: first.cols,
            row_bytes: first.row_bytes,
            ptrs: self.upload(&ptrs)?,
        })
    }

    /// Each of n tokens' k choices from its router logits (n, ne): `expert` and `weight` (n·k, in
    /// the order chosen) and `row_of` (n·k: t·k + s, each choice's row of the experts' outputs).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_route(
        &self,
        logits: &impl DevicePtr<f32>,
        n: usize,
        ne: usize,
        k: usize,
        norm_topk: bool,
        expert: &mut impl DevicePtrMut<u32>,
        weight: &mut impl DevicePtrMut<f32>,
        row_of: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        check(k >= 1 && k <= ne && k <= MOE_MAX_USED, || {
            format!("{k} of {ne} experts a token (the GPU's router takes up to {MOE_MAX_USED})")
        })?;
        super::launch::len_at_least(logits, n * ne, "moe_route logits")?;
        super::launch::len_at_least(expert, n * k, "moe_route expert")?;
        super::launch::len_at_least(weight, n * k, "moe_route weight")?;
        super::launch::len_at_least(row_of, n * k, "moe_route row_of")?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("fw_moe_route")?;
        let (lp, ep, wp, rp) = (
            self.ptr(logits),
            self.ptr_mut(expert),
            self.ptr_mut(weight),
            self.ptr_mut(row_of),
        );
        let (ni, nei, ki, norm) = (n as i32, ne as i32, k as i32, norm_topk as i32);
        self.launch(
            f,
            grid1(n, 64),
            &[&lp, &ni, &nei, &ki, &norm, &ep, &wp, &rp],
        )
    }

    /// y (rows, table's rows) = each row r's expert (`expert[r]`, checked on the device against
    /// the table's size) times x's row r / xdiv (x: (rows / xdiv, cols)), by the products' order
    /// of sums: each row the bits of its expert's `matmul`.
    pub fn matmul_experts(
        &self,
        table: &ExpertTable,
        expert: &impl DevicePtr<u32>,
        rows: usize,
        x: &impl DevicePtr<f32>,
        xdiv: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let out_blocks = table.rows.div_ceil(EXPERT_WARPS);
        check(
            xdiv >= 1 && rows <= i32::MAX as usize && out_blocks <= 65535,
            || {
                format!(
                    "matmul_experts of {rows} rows of {} values, {xdiv} a token",
                    table.rows
                )
            },
        )?;
        super::launch::len_at_least(expert, rows, "matmul_experts expert")?;
        super::launch::len_at_least(x, rows.div_ceil(xdiv) * table.cols, "matmul_experts x")?;
        super::launch::len_at_least(y, rows * table.rows, "matmul_experts y")?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_matmul_experts_{}", type_name(table.ty)))?;
        let cfg = LaunchConfig {
            // Rows along x (up to 2³¹ − 1 of them), each row's outputs along y.
            grid_dim: (rows as u32, out_blocks as u32, 1),
            block_dim: ((EXPERT_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tp, ep, xp, yp) = (
            self.ptr(&table.ptrs),
            self.ptr(expert),
            self.ptr(x),
            self.ptr_mut(y),
        );
        let (ne, out, cols) = (
            table.ptrs.len() as i32,
            table.rows as i32,
            table.cols as i32,
        );
        let (rb, xd) = (table.row_bytes as i64, xdiv as i32);
        self.launch(f, cfg, &[&tp, &ep, &ne, &out, &cols, &rb, &xp, &xd, &yp])
    }

    /// `matmul_experts` in int8: x as `q` holds it (rows / xdiv tokens of the table's width),
    /// each row the bits of its expert's `matmul_int8`.
    pub fn matmul_experts_int8(
        &self,
        table: &ExpertTable,
        expert: &impl DevicePtr<u32>,
        rows: usize,
        q: &Q8Acts,
        xdiv: usize,
        y: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        check_int8(table.ty, table.cols, q)?;
        let out_blocks = table.rows.div_ceil(I8_ROWS);
        check(
            xdiv >= 1 && rows <= i32::MAX as usize && out_blocks <= 65535,
            || format!("int8 expert products of {rows} rows, {xdiv} a token"),
        )?;
        check(rows.div_ceil(xdiv) <= q.n, || {
            format!("{rows} expert rows ({xdiv} a token) from {} tokens", q.n)
        })?;
        super::launch::len_at_least(expert, rows, "matmul_experts_int8 expert")?;
        super::launch::len_at_least(y, rows * table.rows, "matmul_experts_int8 y")?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.function(&format!("fw_matmul_experts_i8_{}", type_name(table.ty)))?;
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, out_blocks as u32, 1),
            block_dim: ((4 * I8_ROWS) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tp, ep, yp) = (self.ptr(&table.ptrs), self.ptr(expert), self.ptr_mut(y));
        let (cp, dp, sp) = (self.ptr(&q.codes), self.ptr(&q.scales), self.ptr(&q.sums));
        let (ne, out, cols) = (
            table.ptrs.len() as i32,
            table.rows as i32,
            table.cols as i32,
        );
        let (rb, xd) = (table.row_bytes as i64, xdiv as i32);
        self.launch(
            f,
            cfg,
            &[&tp, &ep, &ne, &out, &cols, &rb, &cp, &dp, &sp, &xd, &yp],
        )
    }
}
