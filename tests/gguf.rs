//! The GGUF reader on files written here: every metadata type round-trips; truncated, corrupt and
//! unsupported files are clear errors, never panics.

mod common;

use common::{tiny_model, TinySpec};
use flywheel::kernels::QuantType;
use flywheel::model::gguf::{Gguf, Value};
use flywheel::model::gguf_writer::GgufWriter;

fn open_bytes(bytes: &[u8]) -> Result<Gguf, String> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, bytes).unwrap();
    Gguf::open(&p).map_err(|e| e.to_string())
}

fn all_types() -> Vec<(String, Value)> {
    vec![
        ("u8".into(), Value::U8(200)),
        ("i8".into(), Value::I8(-100)),
        ("u16".into(), Value::U16(60000)),
        ("i16".into(), Value::I16(-30000)),
        ("u32".into(), Value::U32(4_000_000_000)),
        ("i32".into(), Value::I32(-2_000_000_000)),
        ("f32".into(), Value::F32(1.5)),
        ("bool".into(), Value::Bool(true)),
        ("string".into(), Value::String("héllo ✓".into())),
        (
            "array".into(),
            Value::Array(vec![Value::String("a".into()), Value::String("".into())]),
        ),
        (
            "array_i32".into(),
            Value::Array(vec![Value::I32(1), Value::I32(-2)]),
        ),
        ("u64".into(), Value::U64(u64::MAX)),
        ("i64".into(), Value::I64(i64::MIN)),
        ("f64".into(), Value::F64(-2.25)),
        ("general.alignment".into(), Value::U32(64)),
    ]
}

#[test]
fn every_metadata_type_and_tensor_round_trips() {
    let mut w = GgufWriter::new();
    w.alignment = 64;
    for (k, v) in all_types() {
        w.meta(&k, v);
    }
    let a: Vec<u8> = (0..40u8).collect();
    w.tensor("a", &[10], QuantType::F32, a.clone());
    w.tensor("b", &[32, 2], QuantType::Q8_0, vec![7; 68]);
    let g = open_bytes(&w.to_bytes()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 64);
    for (k, v) in all_types() {
        assert_eq!(g.get(&k), Some(&v), "{k}");
    }
    let t = g.tensor("a").unwrap();
    assert_eq!(g.tensor_data(t), &a[..]);
    let b = g.tensor("b").unwrap();
    assert_eq!(
        (b.dims.clone(), b.ty, b.size),
        (vec![32, 2], QuantType::Q8_0, 68)
    );
    assert_eq!(b.offset % 64, 0);
    assert!(g.tensor_data(b).iter().all(|x| *x == 7));
}

#[test]
fn version_2_files_are_read() {
    let mut bytes = tiny_model(&TinySpec::small()).bytes;
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert_eq!(open_bytes(&bytes).unwrap().version, 2);
}

#[test]
fn every_truncation_is_an_error() {
    let mut w = GgufWriter::new();
    for (k, v) in all_types() {
        w.meta(&k, v);
    }
    w.tensor("t", &[32, 3], QuantType::Q4_1, vec![1; 60]);
    let bytes = w.to_bytes();
    for len in 0..bytes.len() {
        let e = open_bytes(&bytes[..len])
            .err()
            .unwrap_or_else(|| panic!("prefix of {len} bytes opened"));
        assert!(
            e.contains("truncated") || e.contains("magic") || e.contains("cannot fit"),
            "len {len}: {e}"
        );
    }
    assert!(open_bytes(&bytes).is_ok());
}

fn header(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

fn s(b: &mut Vec<u8>, x: &str) {
    b.extend_from_slice(&(x.len() as u64).to_le_bytes());
    b.extend_from_slice(x.as_bytes());
}

fn tensor_file(name: &str, dims: &[u64], ty: u32, offset: u64, data: usize) -> Vec<u8> {
    let mut b = header(1, 0);
    s(&mut b, name);
    b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for d in dims {
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&ty.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(std::iter::repeat_n(0u8, data));
    b
}

#[test]
fn corrupt_and_unsupported_files_name_the_problem() {
    let mut bad_magic = header(0, 0);
    bad_magic[0] = b'X';
    let mut v1 = header(0, 0);
    v1[4] = 1;
    let mut unknown_value = header(0, 1);
    s(&mut unknown_value, "k");
    unknown_value.extend_from_slice(&99u32.to_le_bytes());
    unknown_value.extend_from_slice(&[0; 16]);
    let mut huge_string = header(0, 1);
    huge_string.extend_from_slice(&u64::MAX.to_le_bytes());
    huge_string.extend_from_slice(&[0; 16]);
    let mut huge_array = header(0, 1);
    s(&mut huge_array, "arr");
    huge_array.extend_from_slice(&9u32.to_le_bytes());
    huge_array.extend_from_slice(&4u32.to_le_bytes());
    huge_array.extend_from_slice(&(1u64 << 60).to_le_bytes());
    let mut bad_bool = header(0, 1);
    s(&mut bad_bool, "flag");
    bad_bool.extend_from_slice(&7u32.to_le_bytes());
    bad_bool.push(5);
    bad_bool.extend_from_slice(&[0; 16]);
    let mut bad_align = header(0, 1);
    s(&mut bad_align, "general.alignment");
    bad_align.extend_from_slice(&4u32.to_le_bytes());
    bad_align.extend_from_slice(&48u32.to_le_bytes());
    bad_align.extend_from_slice(&[0; 16]);
    let cases: Vec<(Vec<u8>, &[&str])> = vec![
        (bad_magic, &["magic"]),
        (v1, &["version 1"]),
        (header(1 << 40, 0), &["cannot fit"]),
        (unknown_value, &["'k'", "value type 99"]),
        (huge_string, &["truncated", "string"]),
        (huge_array, &["truncated", "arr"]),
        (bad_bool, &["flag", "bool"]),
        (bad_align, &["general.alignment", "power of two"]),
        (
            tensor_file("w", &[256, 2], 16, 0, 200),
            &["'w'", "type 16", "IQ2_XXS"],
        ),
        (tensor_file("w", &[32, 2], 77, 0, 64), &["'w'", "type 77"]),
        (
            tensor_file("w", &[32, 2], 3, 0, 10),
            &["truncated", "'w'", "Q4_1"],
        ),
        (tensor_file("w", &[32, 2], 3, 8, 100), &["'w'", "aligned"]),
        (tensor_file("w", &[31, 2], 3, 0, 64), &["'w'", "multiple"]),
        (
            tensor_file("w", &[1, 1, 1, 1, 1], 0, 0, 64),
            &["'w'", "dimensions"],
        ),
        (
            tensor_file("w", &[u64::MAX, 4], 0, 0, 64),
            &["'w'", "overflow"],
        ),
    ];
    for (bytes, needles) in cases {
        let e = match open_bytes(&bytes) {
            Ok(_) => panic!("opened a bad file expecting {needles:?}"),
            Err(e) => e,
        };
        for n in needles {
            assert!(e.contains(n), "error '{e}' should mention '{n}'");
        }
    }
}

#[test]
fn model_loading_names_missing_and_misshapen_tensors() {
    use flywheel::model::decoder::Decoder;
    let g = open_bytes(&tiny_model(&TinySpec::small()).bytes).unwrap();
    assert!(Decoder::from_gguf(g).is_ok());
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("llama".into()));
    let e = Decoder::from_gguf(open_bytes(&w.to_bytes()).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("llama.embedding_length") && e.contains("missing"),
        "{e}"
    );
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::String("mamba".into()));
    let e = Decoder::from_gguf(open_bytes(&w.to_bytes()).unwrap())
        .err()
        .unwrap()
        .to_string();
    // The error names what is supported.
    assert!(e.contains("mamba"), "{e}");
    for arch in flywheel::model::decoder::SUPPORTED_ARCHITECTURES {
        assert!(e.contains(arch), "{arch}: {e}");
    }
    assert_eq!(
        flywheel::model::decoder::SUPPORTED_ARCHITECTURES,
        ["llama", "qwen2", "qwen3", "qwen3moe", "gemma3", "gemma2"]
    );
    // One family entry per supported architecture, in that order.
    let families: Vec<&str> = flywheel::model::decoder::FAMILIES
        .iter()
        .map(|f| f.arch)
        .collect();
    assert_eq!(families, flywheel::model::decoder::SUPPORTED_ARCHITECTURES);
}

#[test]
fn weights_read_into_huge_pages_equal_the_mapped_file() {
    use flywheel::model::gguf::WeightMemory;
    let mut w = GgufWriter::new();
    w.alignment = 64;
    w.meta("general.alignment", Value::U32(64));
    // More than 2 MB, so that the read spans huge pages.
    let big: Vec<u8> = (0..(3 << 20) + 100).map(|i| (i * 7 % 251) as u8).collect();
    w.tensor(
        "big",
        &[big.len() as u64 / 4],
        QuantType::F32,
        big[..big.len() / 4 * 4].to_vec(),
    );
    w.tensor("b", &[32, 2], QuantType::Q8_0, vec![7; 68]);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, w.to_bytes()).unwrap();
    let mapped = Gguf::open_in(&p, WeightMemory::Mapped).unwrap();
    let huge = Gguf::open_in(&p, WeightMemory::HugePages).unwrap();
    assert!(!mapped.huge_pages());
    assert_eq!(
        mapped.why_mapped(),
        None,
        "a mapping asked for needs no reason"
    );
    let offered = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false);
    assert_eq!(
        huge.huge_pages(),
        offered,
        "huge pages used iff the kernel offers them"
    );
    if !offered {
        eprintln!("skipped the 2 MB pages: transparent huge pages are off here (read mapped)");
        assert!(huge
            .why_mapped()
            .unwrap()
            .contains("no transparent huge pages"));
    } else {
        assert_eq!(huge.why_mapped(), None);
    }
    assert_eq!(huge.bytes(), &std::fs::read(&p).unwrap()[..]);
    assert_eq!(huge.bytes(), mapped.bytes());
    for name in ["big", "b"] {
        let (a, b) = (huge.tensor(name).unwrap(), mapped.tensor(name).unwrap());
        assert_eq!(huge.tensor_data(a), mapped.tensor_data(b), "{name}");
    }
    // Truncated and empty files are the same errors either way.
    let bytes = std::fs::read(&p).unwrap();
    for len in [0, 10, bytes.len() - 1] {
        std::fs::write(&p, &bytes[..len]).unwrap();
        let a = Gguf::open_in(&p, WeightMemory::HugePages)
            .map(|_| ())
            .unwrap_err();
        let b = Gguf::open_in(&p, WeightMemory::Mapped)
            .map(|_| ())
            .unwrap_err();
        assert_eq!(a.to_string(), b.to_string(), "{len} bytes");
    }
}
