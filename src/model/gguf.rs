//! GGUF reader (v2 and v3): the file read once into 2 MB pages or memory-mapped (`WeightMemory`),
//! every metadata type, tensor infos, alignment, and zero-copy access to each tensor's bytes.
//! Every read is bounds-checked: a truncated, corrupt or unsupported file is an error that names
//! the offset, the key or tensor, and the type.

use flywheel_kernels::QuantType;
use memmap2::Mmap;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use super::weight_memory;
pub use super::weight_memory::WeightMemory;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic is {0:02x?}, expected 47 47 55 46 (\"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated at offset {offset} while reading {what}")]
    Truncated { what: String, offset: u64 },
    #[error("corrupt GGUF at offset {offset}: {msg}")]
    Corrupt { offset: u64, msg: String },
    #[error(
        "tensor '{name}' has unsupported ggml type {type_id} ({type_name}) at info offset {offset}"
    )]
    UnsupportedType {
        name: String,
        type_id: u32,
        type_name: &'static str,
        offset: u64,
    },
    #[error("tensor '{name}': {msg}")]
    BadTensor { name: String, msg: String },
    #[error("metadata key '{key}': {msg}")]
    BadMetadata { key: String, msg: String },
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// Integer value of any integer type (and bool), if it fits in i64.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            Value::U8(v) => v as i64,
            Value::I8(v) => v as i64,
            Value::U16(v) => v as i64,
            Value::I16(v) => v as i64,
            Value::U32(v) => v as i64,
            Value::I32(v) => v as i64,
            Value::U64(v) => i64::try_from(v).ok()?,
            Value::I64(v) => v,
            Value::Bool(v) => v as i64,
            _ => return None,
        })
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }
}

/// Where a tensor lives and what it holds. `dims[0]` is the contiguous (innermost) dimension.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: QuantType,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Size in bytes.
    pub size: usize,
}

impl TensorInfo {
    pub fn num_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

pub struct Gguf {
    mmap: Mmap,
    /// The file's length (an empty file's anonymous map has one byte more).
    len: usize,
    huge_pages: bool,
    why_mapped: Option<String>,
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    /// Keys in file order.
    pub metadata_keys: Vec<String>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    pub alignment: u64,
    pub data_offset: u64,
}

const GGML_MAX_DIMS: u32 = 4;
/// Names of ggml type ids we recognise but cannot compute with, for error messages.
fn ggml_type_name(id: u32) -> &'static str {
    match id {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        _ => "unknown",
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if self.buf.len() - self.pos < n {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(
            self.take(4, what)?.try_into().unwrap_or([0; 4]),
        ))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(
            self.take(8, what)?.try_into().unwrap_or([0; 8]),
        ))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let at = self.pos as u64;
        let len = self.u64(what)?;
        if len > (self.buf.len() - self.pos) as u64 {
            return Err(GgufError::Truncated {
                what: format!("{} (string of {len} bytes)", what()),
                offset: at,
            });
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::Corrupt {
            offset: at,
            msg: format!("{} is not valid UTF-8", what()),
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, GgufError> {
        let w = || format!("value of '{key}'");
        let at = self.pos as u64;
        Ok(match ty {
            0 => Value::U8(self.take(1, &w)?[0]),
            1 => Value::I8(self.take(1, &w)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(
                self.take(2, &w)?.try_into().unwrap_or([0; 2]),
            )),
            3 => Value::I16(i16::from_le_bytes(
                self.take(2, &w)?.try_into().unwrap_or([0; 2]),
            )),
            4 => Value::U32(self.u32(&w)?),
            5 => Value::I32(self.u32(&w)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(&w)?)),
            7 => match self.take(1, &w)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    return Err(GgufError::Corrupt {
                        offset: at,
                        msg: format!("'{key}': bool byte {b} is not 0 or 1"),
                    })
                }
            },
            8 => Value::String(self.string(&w)?),
            9 => {
                if depth > 0 {
                    return Err(GgufError::Corrupt {
                        offset: at,
                        msg: format!("'{key}': nested arrays are not supported"),
                    });
                }
                let et = self.u32(&w)?;
                let len = self.u64(&w)?;
                let min_size: u64 = match et {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => {
                        return Err(GgufError::Corrupt {
                            offset: at,
                            msg: format!("'{key}': unknown array element type {et}"),
                        })
                    }
                };
                let remaining = (self.buf.len() - self.pos) as u64;
                if len.saturating_mul(min_size) > remaining {
                    return Err(GgufError::Truncated {
                        what: format!("array '{key}' of {len} elements"),
                        offset: at,
                    });
                }
                let mut v = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    v.push(self.value(et, key, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64(&w)?),
            11 => Value::I64(self.u64(&w)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(&w)?)),
            t => {
                return Err(GgufError::Corrupt {
                    offset: at,
                    msg: format!("'{key}': unknown metadata value type {t}"),
                })
            }
        })
    }
}

impl Gguf {
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf, GgufError> {
        Gguf::open_in(path, WeightMemory::default())
    }

    /// Opens `path` with its bytes in `memory` (`HugePages` falls back to a mapping where the
    /// kernel offers no huge pages or the file would take more than half the available memory:
    /// [`Gguf::huge_pages`] and [`Gguf::why_mapped`] say which was used and why).
    pub fn open_in(path: impl AsRef<Path>, memory: WeightMemory) -> Result<Gguf, GgufError> {
        let path = path.as_ref();
        let io = |e| GgufError::Io {
            path: path.display().to_string(),
            source: e,
        };
        let mut file = File::open(path).map_err(io)?;
        let placed = weight_memory::place(&mut file, memory).map_err(io)?;
        let mut g = Gguf::parse(placed.bytes, placed.len)?;
        (g.huge_pages, g.why_mapped) = (placed.huge_pages, placed.why_mapped);
        Ok(g)
    }

    /// Why 2 MB pages were asked for and the file is mapped instead (None otherwise).
    pub fn why_mapped(&self) -> Option<&str> {
        self.why_mapped.as_deref()
    }

    /// Whether the bytes were read into memory in 2 MB pages (else the file is mapped).
    pub fn huge_pages(&self) -> bool {
        self.huge_pages
    }

    fn parse(mmap: Mmap, len: usize) -> Result<Gguf, GgufError> {
        let buf: &[u8] = &mmap[..len];
        let mut c = Cursor { buf, pos: 0 };
        let magic: [u8; 4] = c.take(4, &|| "magic".into())?.try_into().unwrap_or([0; 4]);
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32(&|| "version".into())?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = c.u64(&|| "tensor count".into())?;
        let n_kv = c.u64(&|| "metadata count".into())?;
        // Each metadata entry takes at least 12 bytes, each tensor info at least 24.
        let rest = (buf.len() - c.pos) as u64;
        if n_kv.saturating_mul(12) > rest || n_tensors.saturating_mul(24) > rest {
            return Err(GgufError::Corrupt {
                offset: 8,
                msg: format!(
                    "{n_tensors} tensors and {n_kv} metadata entries cannot fit in {rest} bytes"
                ),
            });
        }
        let mut metadata = HashMap::new();
        let mut metadata_keys = Vec::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("key of metadata entry {i}"))?;
            let ty = c.u32(&|| format!("type of '{key}'"))?;
            let v = c.value(ty, &key, 0)?;
            metadata_keys.push(key.clone());
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
                _ => {
                    return Err(GgufError::BadMetadata {
                        key: "general.alignment".into(),
                        msg: format!("must be a positive power of two, got {v:?}"),
                    })
                }
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut by_name = HashMap::new();
        for i in 0..n_tensors {
            let info_at = c.pos as u64;
            let name = c.string(&|| format!("name of tensor {i}"))?;
            let w = || format!("info of tensor '{name}'");
            let n_dims = c.u32(&w)?;
            if n_dims == 0 || n_dims > GGML_MAX_DIMS {
                return Err(GgufError::BadTensor {
                    name,
                    msg: format!("{n_dims} dimensions (1 to 4 allowed)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64(&w)?);
            }
            let type_id = c.u32(&w)?;
            let offset = c.u64(&w)?;
            let ty =
                QuantType::from_ggml_id(type_id).ok_or_else(|| GgufError::UnsupportedType {
                    name: name.clone(),
                    type_id,
                    type_name: ggml_type_name(type_id),
                    offset: info_at,
                })?;
            let n = dims.iter().try_fold(1u64, |a, d| a.checked_mul(*d));
            let Some(n) = n.filter(|n| *n <= (1u64 << 40)) else {
                return Err(GgufError::BadTensor {
                    name,
                    msg: format!("dimensions {dims:?} overflow"),
                });
            };
            if dims[0] % ty.block_size() as u64 != 0 {
                return Err(GgufError::BadTensor {
                    name,
                    msg: format!(
                        "row length {} is not a multiple of the {} block size {}",
                        dims[0],
                        ty.name(),
                        ty.block_size()
                    ),
                });
            }
            if offset % alignment != 0 {
                return Err(GgufError::BadTensor {
                    name,
                    msg: format!("data offset {offset} is not aligned to {alignment}"),
                });
            }
            let size = (n / ty.block_size() as u64 * ty.block_bytes() as u64) as usize;
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::BadTensor {
                    name,
                    msg: "appears twice".into(),
                });
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                size,
            });
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let data_len = (buf.len() as u64).saturating_sub(data_offset);
        for t in &tensors {
            let end = t.offset.checked_add(t.size as u64);
            if end.is_none_or(|e| e > data_len) {
                return Err(GgufError::Truncated {
                    what: format!(
                        "data of tensor '{}' ({} bytes of {} at data offset {})",
                        t.name,
                        t.size,
                        t.ty.name(),
                        t.offset
                    ),
                    offset: data_offset + t.offset,
                });
            }
        }
        Ok(Gguf {
            mmap,
            len,
            huge_pages: false,
            why_mapped: None,
            version,
            metadata,
            metadata_keys,
            tensors,
            by_name,
            alignment,
            data_offset,
        })
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        &self.mmap[..self.len]
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor (zero-copy into the map; bounds checked at open).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.mmap[start..start + t.size]
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// A required integer key.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::BadMetadata {
            key: key.into(),
            msg: "missing".into(),
        })?;
        v.as_i64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| GgufError::BadMetadata {
                key: key.into(),
                msg: format!("expected an unsigned integer, got {}", v.type_name()),
            })
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::BadMetadata {
            key: key.into(),
            msg: "missing".into(),
        })?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| GgufError::BadMetadata {
                key: key.into(),
                msg: format!("expected a number, got {}", v.type_name()),
            })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.get(key).ok_or_else(|| GgufError::BadMetadata {
            key: key.into(),
            msg: "missing".into(),
        })?;
        v.as_str().ok_or_else(|| GgufError::BadMetadata {
            key: key.into(),
            msg: format!("expected a string, got {}", v.type_name()),
        })
    }
}
