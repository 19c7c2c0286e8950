//! The Tinker SDK's protobuf messages (package `tinker_public`) that Flywheel reads and writes:
//! `forward_backward`'s body and its `ForwardBackwardOutput`, and `SampleResponse`. Field numbers and types from the
//! SDK's descriptor (docs/tinker.md); derived with `prost`, no `protoc`. Tensors are
//! little-endian bytes in their dtype; token lists are int32 bytes.

use std::collections::HashMap;

/// `DType`.
pub const DTYPE_FLOAT32: i32 = 1;
pub const DTYPE_INT64: i32 = 2;
pub const DTYPE_INT32: i32 = 3;
pub const DTYPE_BFLOAT16: i32 = 4;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardRequest {
    #[prost(string, tag = "1")]
    pub model_id: String,
    #[prost(int32, tag = "2")]
    pub seq_id: i32,
    #[prost(message, repeated, tag = "3")]
    pub data: Vec<Datum>,
    #[prost(string, tag = "4")]
    pub loss_fn: String,
    #[prost(map = "string, double", tag = "5")]
    pub loss_fn_config: HashMap<String, f64>,
    #[prost(bool, tag = "6")]
    pub forward_only: bool,
    #[prost(map = "string, message", tag = "7")]
    pub loss_fn_config_v2: HashMap<String, LossConfigValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LossConfigValue {
    #[prost(oneof = "loss_config_value::Value", tags = "1, 2")]
    pub value: Option<loss_config_value::Value>,
}

pub mod loss_config_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(double, tag = "1")]
        Number(f64),
        #[prost(string, tag = "2")]
        Text(String),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Datum {
    #[prost(message, repeated, tag = "1")]
    pub model_input: Vec<Chunk>,
    #[prost(map = "string, message", tag = "2")]
    pub loss_fn_inputs: HashMap<String, Tensor>,
    /// Provenance spans (3, 4) are the SDK's bookkeeping for its own tooling; not read.
    #[prost(bytes = "vec", repeated, tag = "3")]
    pub model_input_spans: Vec<Vec<u8>>,
    #[prost(bytes = "vec", repeated, tag = "4")]
    pub loss_fn_input_spans: Vec<Vec<u8>>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Chunk {
    #[prost(oneof = "chunk::Kind", tags = "1, 2, 3")]
    pub chunk: Option<chunk::Kind>,
}

pub mod chunk {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Kind {
        #[prost(message, tag = "1")]
        EncodedText(super::EncodedTextChunk),
        /// Images and DMel audio: this server's models take text only (kept as bytes, refused).
        #[prost(bytes, tag = "2")]
        Image(Vec<u8>),
        #[prost(bytes, tag = "3")]
        Dmel(Vec<u8>),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct EncodedTextChunk {
    /// int32 little-endian.
    #[prost(bytes = "vec", tag = "1")]
    pub tokens: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Tensor {
    #[prost(oneof = "tensor::Encoding", tags = "1, 2")]
    pub encoding: Option<tensor::Encoding>,
    #[prost(int32, tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub shape: Vec<i64>,
}

pub mod tensor {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Encoding {
        #[prost(bytes, tag = "1")]
        Dense(Vec<u8>),
        #[prost(message, tag = "2")]
        SparseCsr(super::SparseCsr),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SparseCsr {
    #[prost(bytes = "vec", tag = "1")]
    pub values: Vec<u8>,
    /// int64.
    #[prost(bytes = "vec", tag = "2")]
    pub crow_indices: Vec<u8>,
    /// int64.
    #[prost(bytes = "vec", tag = "3")]
    pub col_indices: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ForwardBackwardOutput {
    #[prost(string, tag = "1")]
    pub loss_fn_output_type: String,
    #[prost(message, repeated, tag = "2")]
    pub loss_fn_outputs: Vec<ArrayRecord>,
    #[prost(map = "string, double", tag = "3")]
    pub metrics: HashMap<String, f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayRecord {
    #[prost(string, tag = "1")]
    pub type_tag: String,
    #[prost(map = "string, message", tag = "2")]
    pub fields: HashMap<String, BatchedTensor>,
    #[prost(int64, tag = "3")]
    pub num_datums: i64,
}

/// Per-datum tensors of one field, concatenated: `offsets` are the n + 1 byte boundaries (int64).
#[derive(Clone, PartialEq, prost::Message)]
pub struct BatchedTensor {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub offsets: Vec<u8>,
    #[prost(int32, tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub trailing_shape: Vec<i64>,
}

/// `SampleResponse` (the fields Flywheel fills: top-k and target log-probs are refused).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SampleResponse {
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<SampledSequence>,
    /// f32 per prompt token, the first NaN (no context).
    #[prost(bytes = "vec", optional, tag = "2")]
    pub prompt_logprobs: Option<Vec<u8>>,
}

/// One sample: `stop_reason` `StopReason` (0 STOP, 1 LENGTH), int32 tokens, f32 log-probs.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SampledSequence {
    #[prost(int32, tag = "1")]
    pub stop_reason: i32,
    #[prost(bytes = "vec", tag = "2")]
    pub tokens: Vec<u8>,
    #[prost(bytes = "vec", optional, tag = "3")]
    pub logprobs: Option<Vec<u8>>,
}

impl BatchedTensor {
    /// One f32 vector per datum.
    pub fn f32_per_datum(rows: &[Vec<f32>]) -> BatchedTensor {
        let mut data = Vec::new();
        let mut offsets = 0i64.to_le_bytes().to_vec();
        for r in rows {
            data.extend(r.iter().flat_map(|v| v.to_le_bytes()));
            offsets.extend((data.len() as i64).to_le_bytes());
        }
        BatchedTensor {
            data,
            offsets,
            dtype: DTYPE_FLOAT32,
            trailing_shape: Vec::new(),
        }
    }
}

/// Why a tensor could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("its dtype {0} is not float32, int64, int32 or bfloat16")]
    Dtype(i32),
    #[error("its {0} bytes are not a whole number of values")]
    Ragged(usize),
    #[error("its shape {0:?} holds other than its {1} values")]
    Shape(Vec<i64>, usize),
    #[error("a sparse tensor's indices are out of range")]
    Sparse,
    #[error("it has no data")]
    Empty,
}

impl Tensor {
    /// Its values as f64 (dense, or sparse CSR filled out), checked against its shape.
    pub fn values(&self) -> Result<Vec<f64>, TensorError> {
        let dense = match &self.encoding {
            None => return Err(TensorError::Empty),
            Some(tensor::Encoding::Dense(b)) => decode(b, self.dtype)?,
            Some(tensor::Encoding::SparseCsr(c)) => {
                let values = decode(&c.values, self.dtype)?;
                let ints = |b: &[u8]| decode(b, DTYPE_INT64);
                let (crow, col) = (ints(&c.crow_indices)?, ints(&c.col_indices)?);
                let cols = self.shape.last().copied().unwrap_or(0).max(0) as usize;
                let rows = crow.len().saturating_sub(1);
                let mut out = vec![0.0; rows * cols];
                for r in 0..rows {
                    let (a, b) = (crow[r] as usize, crow[r + 1] as usize);
                    if a > b || b > values.len() || b > col.len() {
                        return Err(TensorError::Sparse);
                    }
                    for k in a..b {
                        let c = col[k] as usize;
                        if c >= cols {
                            return Err(TensorError::Sparse);
                        }
                        out[r * cols + c] = values[k];
                    }
                }
                out
            }
        };
        let want: i64 = self.shape.iter().product();
        if !self.shape.is_empty() && (want < 0 || want as usize != dense.len()) {
            return Err(TensorError::Shape(self.shape.clone(), dense.len()));
        }
        Ok(dense)
    }
}

/// Little-endian values of `dtype`, as f64 (int64 token ids are exact below 2^53).
fn decode(b: &[u8], dtype: i32) -> Result<Vec<f64>, TensorError> {
    let size = match dtype {
        DTYPE_FLOAT32 | DTYPE_INT32 => 4,
        DTYPE_INT64 => 8,
        DTYPE_BFLOAT16 => 2,
        d => return Err(TensorError::Dtype(d)),
    };
    if !b.len().is_multiple_of(size) {
        return Err(TensorError::Ragged(b.len()));
    }
    Ok(b.chunks_exact(size)
        .map(|c| match dtype {
            DTYPE_FLOAT32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            DTYPE_INT32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64,
            DTYPE_INT64 => i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64,
            _ => f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16) as f64,
        })
        .collect())
}

/// int32 little-endian token ids.
pub fn tokens_of(b: &[u8]) -> Result<Vec<i64>, TensorError> {
    Ok(decode(b, DTYPE_INT32)?
        .into_iter()
        .map(|v| v as i64)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// A request as the SDK writes it (bytes from its own `SerializeToString` of a datum with
    /// tokens [1, 2], targets [2, 3] as int64 and weights [0, 1] as float32, loss
    /// "cross_entropy", seq_id 1, model "m") decodes to those values; and back.
    #[test]
    fn a_request_round_trips() {
        let mut inputs = HashMap::new();
        inputs.insert(
            "target_tokens".to_string(),
            Tensor {
                encoding: Some(tensor::Encoding::Dense(
                    [2i64, 3].iter().flat_map(|v| v.to_le_bytes()).collect(),
                )),
                dtype: DTYPE_INT64,
                shape: vec![2],
            },
        );
        inputs.insert(
            "weights".to_string(),
            Tensor {
                encoding: Some(tensor::Encoding::SparseCsr(SparseCsr {
                    values: 1.0f32.to_le_bytes().to_vec(),
                    crow_indices: [0i64, 1].iter().flat_map(|v| v.to_le_bytes()).collect(),
                    col_indices: 1i64.to_le_bytes().to_vec(),
                })),
                dtype: DTYPE_FLOAT32,
                shape: vec![1, 2],
            },
        );
        let req = ForwardBackwardRequest {
            model_id: "m".into(),
            seq_id: 1,
            data: vec![Datum {
                model_input: vec![Chunk {
                    chunk: Some(chunk::Kind::EncodedText(EncodedTextChunk {
                        tokens: [1i32, 2].iter().flat_map(|v| v.to_le_bytes()).collect(),
                    })),
                }],
                loss_fn_inputs: inputs,
                ..Default::default()
            }],
            loss_fn: "cross_entropy".into(),
            ..Default::default()
        };
        let back = ForwardBackwardRequest::decode(req.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, req);
        let d = &back.data[0];
        let Some(chunk::Kind::EncodedText(t)) = &d.model_input[0].chunk else {
            panic!("text")
        };
        assert_eq!(tokens_of(&t.tokens).unwrap(), [1, 2]);
        assert_eq!(
            d.loss_fn_inputs["target_tokens"].values().unwrap(),
            [2.0, 3.0]
        );
        assert_eq!(d.loss_fn_inputs["weights"].values().unwrap(), [0.0, 1.0]);
        let bad = Tensor {
            shape: vec![3],
            ..d.loss_fn_inputs["target_tokens"].clone()
        };
        assert!(matches!(bad.values(), Err(TensorError::Shape(..))));
    }

    /// Per-datum outputs are concatenated with byte offsets, as the SDK slices them.
    #[test]
    fn batched_tensors_carry_byte_offsets() {
        let b = BatchedTensor::f32_per_datum(&[vec![1.0, 2.0], vec![], vec![3.0]]);
        let offsets: Vec<i64> = b
            .offsets
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(offsets, [0, 8, 8, 12]);
        assert_eq!(b.data.len(), 12);
    }
}
