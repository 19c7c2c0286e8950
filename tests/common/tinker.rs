//! The Tinker API's calls as tests make them by hand: `forward_backward` in protobuf, results
//! polled through futures, tensors and datums built, outputs read.

use super::server::{Response, Server};
use flywheel::api::tinker::proto;
use prost::Message;
use serde_json::json;

/// `forward_backward` as the SDK sends it: a protobuf `ForwardBackwardRequest`.
pub fn fb_request(s: &Server, req: &proto::ForwardBackwardRequest, content_type: &str) -> Response {
    fb_request_as(s, req, content_type, "")
}

/// `fb_request` with `key` in `X-API-Key` (none when empty).
pub fn fb_request_as(
    s: &Server,
    req: &proto::ForwardBackwardRequest,
    content_type: &str,
    key: &str,
) -> Response {
    let body = req.encode_to_vec();
    let key = match key {
        "" => String::new(),
        k => format!("X-API-Key: {k}\r\n"),
    };
    let mut raw = format!(
        "POST /api/v1/forward_backward HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{key}\
         Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    raw.extend(body);
    s.raw(&raw).unwrap()
}

/// The result of the call that answered `r` (polled while it runs).
pub fn result_of(s: &Server, r: &Response) -> Response {
    result_as(s, r, "")
}

/// `result_of` with `key` in `X-API-Key` (none when empty).
pub fn result_as(s: &Server, r: &Response, key: &str) -> Response {
    assert_eq!(r.status, 200, "{r:?}");
    let id = r.json()["request_id"].clone();
    let body = json!({"request_id": id}).to_string();
    let headers: &[(&str, &str)] = match key {
        "" => &[],
        k => &[("X-API-Key", k)],
    };
    for _ in 0..100 {
        let got = s
            .try_request("POST", "/api/v1/retrieve_future", Some(&body), headers)
            .unwrap();
        if got.header("content-type") == Some("application/x-protobuf")
            || got.json()["type"] != "try_again"
        {
            return got;
        }
    }
    panic!("no result for {id}");
}

pub fn tensor_f32(v: &[f32]) -> proto::Tensor {
    proto::Tensor {
        encoding: Some(proto::tensor::Encoding::Dense(
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )),
        dtype: proto::DTYPE_FLOAT32,
        shape: vec![v.len() as i64],
    }
}

pub fn tensor_i64(v: &[i64]) -> proto::Tensor {
    proto::Tensor {
        encoding: Some(proto::tensor::Encoding::Dense(
            v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        )),
        dtype: proto::DTYPE_INT64,
        shape: vec![v.len() as i64],
    }
}

/// A datum of `input` tokens scored against `targets`, with `inputs` besides.
pub fn datum(input: &[i32], targets: &[i64], inputs: &[(&str, proto::Tensor)]) -> proto::Datum {
    let mut loss_fn_inputs: std::collections::HashMap<String, proto::Tensor> = inputs
        .iter()
        .map(|(k, t)| (k.to_string(), t.clone()))
        .collect();
    loss_fn_inputs.insert("target_tokens".into(), tensor_i64(targets));
    proto::Datum {
        model_input: vec![proto::Chunk {
            chunk: Some(proto::chunk::Kind::EncodedText(proto::EncodedTextChunk {
                tokens: input.iter().flat_map(|x| x.to_le_bytes()).collect(),
            })),
        }],
        loss_fn_inputs,
        ..Default::default()
    }
}

/// Per datum, the f32 values of output field `name`.
pub fn output(o: &proto::ForwardBackwardOutput, name: &str) -> Vec<Vec<f32>> {
    let b = &o.loss_fn_outputs[0].fields[name];
    let offsets: Vec<usize> = b
        .offsets
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as usize)
        .collect();
    offsets
        .windows(2)
        .map(|w| {
            b.data[w[0]..w[1]]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        })
        .collect()
}
