//! The CUDA backend (feature `cuda`): `Gpu` runs the model's forward ops on an NVIDIA GPU from
//! GGUF blocks as stored, beside `Cpu` with the same meanings (each op here has its CPU twin,
//! `tests/cuda.rs` compares them on a GPU). The kernels are `cuda/kernels.cu`, compiled by
//! build.rs into one fatbin for sm_80 and sm_90 (and sm_80's PTX for later chips).
//!
//! The driver is loaded at run time: a build with the feature starts on a machine with no GPU
//! and no CUDA library, where `Gpu::open` says why it cannot run.

mod adapters;
mod attention;
mod backward;
mod draw;
mod int8;
mod launch;
mod moe;
mod paged;
mod products;

pub use adapters::{AdapterEntry, AdapterRows, LoraLayout, LORA_VAR};
pub use attention::{
    att_chunks, AttentionKernel, ChunkLaunch, ATTENTION_VAR, ATT_SPLITS, SPLIT_PAIRS,
};
pub use draw::{
    DrawBuffers, DrawSpec, Drawn, NormSpec, ScoreSpec, Truncate, DRAW_CANDIDATES, DRAW_TOP,
};
pub use int8::{Int8Layout, Q8Acts, INT8_VAR};
pub use launch::ATT_MAX_HEAD_DIM;
pub use moe::{ExpertTable, MOE_MAX_USED};
pub use paged::Tokens;
pub use products::{BatchProduct, DecodeProduct, Products};

use crate::quant::QuantType;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr};
use std::collections::HashMap;
use std::sync::Arc;

/// The device buffers and graphs the ops take, for callers without cudarc of their own.
pub use cudarc::driver::sys;
pub use cudarc::driver::{CudaGraph, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

/// The kernels for sm_80 and sm_90, as nvcc wrote them.
pub const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/flywheel.fatbin"));
/// ptxas's report for every kernel and architecture: registers, spills, shared memory.
pub const PTXAS_REPORT: &str = include_str!(concat!(env!("OUT_DIR"), "/ptxas.txt"));
/// Integer-to-float conversions in each kernel's SASS ("name arch count" lines, from cuobjdump;
/// "unavailable: why" where build.rs found none), for `tests/cuda.rs`.
pub const SASS_CONVERSIONS: &str = include_str!(concat!(env!("OUT_DIR"), "/conversions.txt"));
/// The host twin of the kernels' shared helpers (`cuda/twin.cu`), for `tests/cuda_twin.rs`.
pub const TWIN: &str = concat!(env!("OUT_DIR"), "/fw_twin");

/// The kernels compiled once per storage format, named `<prefix>_<format>` (`type_name`): the
/// products in each layout (`Products`) and the embedding's rows.
const PER_FORMAT: &[&str] = &[
    "fw_matmul",
    "fw_matmul1",
    "fw_matmulw",
    "fw_matmul_t4x8",
    "fw_matmul_t4x1",
    "fw_matmul_t2x1",
    "fw_matmul_t2x16",
    "fw_matmul_experts",
    "fw_embed",
];

/// The other kernels of the fatbin.
const OTHERS: &[&str] = &[
    "fw_rmsnorm",
    "fw_add_rmsnorm",
    "fw_rope",
    "fw_rope_qk",
    "fw_swiglu",
    "fw_geglu",
    "fw_residual_add",
    "fw_kv_write_f32",
    "fw_kv_write_f16",
    "fw_attention_f32",
    "fw_attention_f16",
    "fw_attention_chunks_f32_64",
    "fw_attention_chunks_f32_128",
    "fw_attention_chunks_f32_256",
    "fw_attention_chunks_f16_64",
    "fw_attention_chunks_f16_128",
    "fw_attention_chunks_f16_256",
    "fw_attention_groups_f32_64",
    "fw_attention_groups_f32_128",
    "fw_attention_groups_f32_256",
    "fw_attention_groups_f16_64",
    "fw_attention_groups_f16_128",
    "fw_attention_groups_f16_256",
    "fw_log_softmax",
    "fw_argmax",
    "fw_draw",
    "fw_score",
    "fw_normalize",
    "fw_linear_backward",
    "fw_rmsnorm_backward",
    "fw_swiglu_backward",
    "fw_geglu_backward",
    "fw_rope_backward",
    "fw_attention_backward_q",
    "fw_attention_backward_kv",
    "fw_scale",
    "fw_axpy",
    "fw_add_bias",
    "fw_gather_rows",
    "fw_block_matmul",
    "fw_moe_combine",
    "fw_oft_rows",
    "fw_lora_a_rows",
    "fw_lora_a_block",
    "fw_lora_b_rows",
    "fw_moe_route",
    "fw_quantize_q8",
];

/// Every kernel in the fatbin, by name: the tests check each was compiled for each architecture.
pub fn kernels() -> Vec<String> {
    PER_FORMAT
        .iter()
        .flat_map(|p| QuantType::ALL.map(|ty| format!("{p}_{}", type_name(ty))))
        .chain(
            int8::INT8_KERNELS
                .iter()
                .flat_map(|p| int8::INT8_FORMATS.map(|ty| format!("{p}_{}", type_name(ty)))),
        )
        .chain(OTHERS.iter().map(|k| k.to_string()))
        .collect()
}

/// The kernels' number for a storage format (`FwType` in `cuda/common.cuh`).
pub fn type_code(ty: QuantType) -> i32 {
    match ty {
        QuantType::F32 => 0,
        QuantType::F16 => 1,
        QuantType::BF16 => 2,
        QuantType::Q4_0 => 3,
        QuantType::Q4_1 => 4,
        QuantType::Q8_0 => 5,
        QuantType::Q4K => 6,
        QuantType::Q6K => 7,
        QuantType::Q5_0 => 8,
        QuantType::Q5_1 => 9,
        QuantType::Q2K => 10,
        QuantType::Q3K => 11,
        QuantType::Q5K => 12,
        QuantType::IQ4NL => 13,
        QuantType::IQ4XS => 14,
    }
}

/// The kernels' name for a storage format (`fw_matmul_<name>`).
fn type_name(ty: QuantType) -> &'static str {
    match ty {
        QuantType::F32 => "f32",
        QuantType::F16 => "f16",
        QuantType::BF16 => "bf16",
        QuantType::Q4_0 => "q4_0",
        QuantType::Q4_1 => "q4_1",
        QuantType::Q8_0 => "q8_0",
        QuantType::Q4K => "q4_k",
        QuantType::Q6K => "q6_k",
        QuantType::Q5_0 => "q5_0",
        QuantType::Q5_1 => "q5_1",
        QuantType::Q2K => "q2_k",
        QuantType::Q3K => "q3_k",
        QuantType::Q5K => "q5_k",
        QuantType::IQ4NL => "iq4_nl",
        QuantType::IQ4XS => "iq4_xs",
    }
}

/// What went wrong on the GPU, or why there is none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuError(pub String);

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for GpuError {}

impl From<cudarc::driver::DriverError> for GpuError {
    fn from(e: cudarc::driver::DriverError) -> GpuError {
        GpuError(format!("CUDA: {e}"))
    }
}

pub type Result<T> = std::result::Result<T, GpuError>;

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(GpuError(what()))
    }
}

/// An element of the KV cache on the GPU: f32, or an IEEE half's bits.
pub trait GpuKv: DeviceRepr + cudarc::driver::ValidAsZeroBits + Copy + Default + 'static {
    const NAME: &'static str;
}
impl GpuKv for f32 {
    const NAME: &'static str = "f32";
}
impl GpuKv for u16 {
    const NAME: &'static str = "f16";
}

/// A weight matrix on the GPU in its stored format: `rows` rows of `cols` values.
pub struct DeviceMatrix {
    pub ty: QuantType,
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    pub(crate) data: CudaSlice<u8>,
}

impl DeviceMatrix {
    pub fn bytes(&self) -> usize {
        self.row_bytes * self.rows
    }
}

/// One GPU: its context, the stream every op runs on (in order), and the loaded kernels.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    _module: Arc<CudaModule>,
    /// Every kernel of `kernels()`, looked up once (a lookup inside a graph capture is avoided).
    functions: HashMap<String, CudaFunction>,
    /// The layouts the products launch in.
    products: Products,
    /// The attention kernel `attention` launches, and the chunks kernel's scratch.
    attention_kernel: AttentionKernel,
    att_scratch: Box<attention::AttnScratch>,
    /// The layout of the dense int8 products.
    int8_layout: Int8Layout,
    /// The layout of LoRA's first product row by row.
    lora_layout: LoraLayout,
    name: String,
    capability: (i32, i32),
    memory: usize,
}

impl Gpu {
    /// GPU `ordinal`, or why it cannot be used (no driver library, no device, a driver older than
    /// CUDA 13.0, a chip before sm_80).
    pub fn open(ordinal: usize) -> Result<Gpu> {
        // SAFETY: only looks the library up (cudarc's check before any driver call, which would
        // otherwise panic where there is no library).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError(
                "no CUDA driver library (libcuda.so) on this machine".into(),
            ));
        }
        let count = CudaContext::device_count()
            .map_err(|e| GpuError(format!("the CUDA driver cannot list devices: {e}")))?;
        check(ordinal < count.max(0) as usize, || {
            format!("no CUDA device {ordinal} (this machine has {count})")
        })?;
        let products = Products::from_env()?;
        let attention_kernel = AttentionKernel::from_env()?;
        let int8_layout = Int8Layout::from_env()?;
        let lora_layout = LoraLayout::from_env()?;
        let ctx = CudaContext::new(ordinal)?;
        let capability = ctx.compute_capability()?;
        check(capability.0 >= 8, || {
            format!(
                "the kernels need sm_80 or later; device {ordinal} is sm_{}{}",
                capability.0, capability.1
            )
        })?;
        // One stream, used in order: cudarc's per-slice event tracking is not needed, and its
        // events would be captured into CUDA graphs.
        // SAFETY: set before any slice of this context exists.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy NULL stream cannot be captured into a graph.
        let stream = ctx.new_stream()?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(FATBIN.to_vec()))
            .map_err(|e| GpuError(format!("loading the kernels: {e}")))?;
        let att_scratch = Box::new(attention::AttnScratch::new(&stream)?);
        let mut functions = HashMap::new();
        for name in kernels() {
            let f = module
                .load_function(&name)
                .map_err(|e| GpuError(format!("kernel {name}: {e}")))?;
            functions.insert(name, f);
        }
        Ok(Gpu {
            name: ctx.name()?,
            memory: ctx.total_mem()?,
            ctx,
            stream,
            _module: module,
            functions,
            capability,
            products,
            attention_kernel,
            att_scratch,
            int8_layout,
            lora_layout,
        })
    }

    /// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB; products: decode block, batch row; attention
    /// rows; int8 lanes)".
    pub fn describe(&self) -> String {
        format!(
            "{} (sm_{}{}, {:.1} GiB; {}; attention {}; int8 {})",
            self.name,
            self.capability.0,
            self.capability.1,
            self.memory as f64 / (1u64 << 30) as f64,
            self.products.describe(),
            self.attention_kernel.name(),
            self.int8_layout.name()
        )
    }

    /// The layout of the dense int8 products (`FLYWHEEL_CUDA_INT8`).
    pub fn int8_layout(&self) -> Int8Layout {
        self.int8_layout
    }

    /// Launch later int8 products in another layout (the same bits).
    pub fn set_int8_layout(&mut self, layout: Int8Layout) {
        self.int8_layout = layout;
    }

    /// Launch LoRA's later row-by-row first products in another layout (the same bits).
    pub fn set_lora_layout(&mut self, layout: LoraLayout) {
        self.lora_layout = layout;
    }

    /// The layouts the products launch in (`FLYWHEEL_CUDA_DECODE`, `FLYWHEEL_CUDA_BATCH`).
    pub fn products(&self) -> Products {
        self.products
    }

    /// Launch later products in other layouts (the same bits; `Products`).
    pub fn set_products(&mut self, products: Products) {
        self.products = products;
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| GpuError(format!("no kernel {name}")))
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Overwrite `dev` (at least as long as `host`) from the host.
    pub fn write<T: DeviceRepr>(&self, host: &[T], dev: &mut CudaSlice<T>) -> Result<()> {
        check(dev.len() >= host.len(), || {
            format!("writing {} values into {}", host.len(), dev.len())
        })?;
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dev.slice_mut(..host.len());
        Ok(self.stream.memcpy_htod(host, &mut view)?)
    }

    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// host = the first host.len() values of `dev`, after everything queued before.
    pub fn read_into<T: DeviceRepr>(&self, dev: &impl DevicePtr<T>, host: &mut [T]) -> Result<()> {
        check(dev.len() >= host.len(), || {
            format!("reading {} values from {}", host.len(), dev.len())
        })?;
        if host.is_empty() {
            return Ok(());
        }
        self.stream.memcpy_dtoh(dev, host)?;
        Ok(self.stream.synchronize()?)
    }

    /// dst[..n] = src[..n] on the device.
    pub fn copy<T: DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
        n: usize,
    ) -> Result<()> {
        check(src.len() >= n && dst.len() >= n, || {
            format!("copying {n} values from {} into {}", src.len(), dst.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let (s, _) = src.device_ptr(&self.stream);
        let (d, _) = dst.device_ptr_mut(&self.stream);
        let bytes = n * std::mem::size_of::<T>();
        // SAFETY: both ranges checked above; the stream orders the copy after earlier writes.
        unsafe { cudarc::driver::result::memcpy_dtod_async(d, s, bytes, self.stream.cu_stream()) }?;
        Ok(())
    }

    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }

    /// A weight matrix copied to the GPU as stored (`bytes`: `rows` rows of `cols` values in
    /// `ty`, cols a multiple of 32 — every GGUF matrix of the families served).
    pub fn matrix(
        &self,
        ty: QuantType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<DeviceMatrix> {
        check(
            cols.is_multiple_of(32) && cols.is_multiple_of(ty.block_size()),
            || {
                format!("a {} matrix of {cols} columns (the kernels need a multiple of 32 and of the block)", ty.name())
            },
        )?;
        let row_bytes = ty.row_bytes(cols).unwrap();
        check(bytes.len() == rows * row_bytes, || {
            format!("{} bytes for {rows}×{cols} {}", bytes.len(), ty.name())
        })?;
        // Padded to 16 bytes past a multiple of 16: the products load whole aligned words and
        // may read up to 5 bytes past the last block (`cuda/units.cuh`).
        let mut data = self.zeros::<u8>(bytes.len().next_multiple_of(16) + 16)?;
        self.write(bytes, &mut data)?;
        Ok(DeviceMatrix {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// Wait for everything queued so far.
    /// The device's free and total memory in bytes (`cuMemGetInfo`): what other processes and
    /// this one's allocations leave.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }
}
