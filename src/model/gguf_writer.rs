//! A minimal GGUF v3 writer: metadata and tensors already in their block format. Used by tests to
//! build tiny models, and later to export.

use super::gguf::Value;
use flywheel_kernels::QuantType;
use std::io::Write;

#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, QuantType, Vec<u8>)>,
    pub alignment: u64,
}

impl GgufWriter {
    pub fn new() -> GgufWriter {
        GgufWriter {
            alignment: 32,
            ..Default::default()
        }
    }

    pub fn meta(&mut self, key: &str, v: Value) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    /// Add a tensor with `dims` (innermost first) and its bytes in format `ty`.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: QuantType, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        b.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_str(&mut b, k);
            b.extend_from_slice(&type_id(v).to_le_bytes());
            write_value(&mut b, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            write_str(&mut b, name);
            b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend_from_slice(&d.to_le_bytes());
            }
            b.extend_from_slice(&ty.ggml_id().to_le_bytes());
            b.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        let pad = |b: &mut Vec<u8>, a: u64| {
            while !(b.len() as u64).is_multiple_of(a) {
                b.push(0);
            }
        };
        pad(&mut b, self.alignment);
        let start = b.len() as u64;
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            while (b.len() as u64) < start + off {
                b.push(0);
            }
            b.extend_from_slice(data);
        }
        b
    }

    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        f.write_all(&self.to_bytes())?;
        f.sync_all()
    }
}

fn write_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn write_value(b: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => b.push(*x),
        Value::I8(x) => b.push(*x as u8),
        Value::U16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => b.push(*x as u8),
        Value::String(s) => write_str(b, s),
        Value::Array(a) => {
            let et = a.first().map(type_id).unwrap_or(4);
            b.extend_from_slice(&et.to_le_bytes());
            b.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for x in a {
                write_value(b, x);
            }
        }
        Value::U64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => b.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => b.extend_from_slice(&x.to_le_bytes()),
    }
}
