//! Stage module files: round trip and one test per way a file can be wrong. Plain data, no
//! libtorch needed (also runs with `--no-default-features`).

use bytes::Bytes;
use pipewright_ops::op::{BinaryOp, Gemm, UnaryOp};
use pipewright_core::{Recompute, Schedule, UpdateRule};
use pipewright_runtime::module::{
    decode_header, decode_module, decode_module_bytes, encode, read_module, ModuleErrorKind, StageParams, FORMAT_VERSION, HEADER_LEN, MAGIC,
};
use pipewright_runtime::program::{Extent, Instr, Program, SlotId, SlotInfo, Stored};
use pipewright_ops::DType;
use pipewright_ops::Op;

const PARAMS: StageParams = StageParams { stage: 1, depth: 4, schedule: Schedule::TwoBw, recompute: Recompute::Selective };

fn slot(name: &str, elem: DType, shape: &[Extent]) -> SlotInfo {
    SlotInfo { name: name.into(), elem, shape: shape.to_vec(), last_use: None }
}

fn stored(slot: u32, elem: DType, dims: &[i64], bytes: Vec<u8>, trainable: bool) -> Stored {
    Stored { slot: SlotId(slot), elem, dims: dims.to_vec(), bytes: Bytes::from(bytes), trainable, versions: if trainable { 2 } else { 1 }, update: if trainable { UpdateRule::TwoBw } else { UpdateRule::Constant }, sync: Vec::new() }
}

/// y = relu(x @ W^T + b) * scale, where(mask, ., .) with weights of several dtypes.
fn program() -> Program {
    use Extent::*;
    let w: Vec<u8> = (0..12).flat_map(|i| (i as f32 * 0.25 - 1.0).to_le_bytes()).collect();
    let b: Vec<u8> = [0.5f64, -0.5, 1e-300].iter().flat_map(|v| v.to_le_bytes()).collect();
    let scale: Vec<u8> = [0x3c00u16].iter().flat_map(|v| v.to_le_bytes()).collect(); // f16 1.0
    let shape: Vec<u8> = [-1i64, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mask = vec![1u8, 0, 1];
    let bf: Vec<u8> = [0x3f80u16, 0xc000].iter().flat_map(|v| v.to_le_bytes()).collect();
    Program {
        static_inputs: Vec::new(),
        pipeline: String::new(),
        slots: vec![
            slot("x", DType::F32, &[Batch(1), Fixed(4)]),
            slot("fc.weight", DType::F32, &[Fixed(3), Fixed(4)]),
            slot("fc.bias", DType::F64, &[Fixed(3)]),
            slot("h", DType::F32, &[Batch(1), Fixed(3)]),
            slot("r", DType::F32, &[Batch(1), Fixed(3)]),
            slot("scale", DType::F16, &[]),
            slot("shape", DType::I64, &[Fixed(2)]),
            slot("mask", DType::Bool, &[Fixed(3)]),
            slot("y", DType::F32, &[Batch(1), Fixed(3)]),
            slot("bf", DType::Bf16, &[Fixed(2), Fixed(1)]),
        ],
        inputs: vec![SlotId(0)],
        outputs: vec![SlotId(8)],
        stored: vec![
            stored(1, DType::F32, &[3, 4], w, true),
            stored(2, DType::F64, &[3], b, true),
            stored(5, DType::F16, &[], scale, false),
            stored(6, DType::I64, &[2], shape, false),
            stored(7, DType::Bool, &[3], mask, false),
            stored(9, DType::Bf16, &[2, 1], bf, true),
        ],
        instrs: vec![
            Instr {
                name: "fc".into(),
                op: Op::Gemm(Gemm { alpha: 1.0, beta: 0.1, trans_a: false, trans_b: true }),
                inputs: vec![Some(SlotId(0)), Some(SlotId(1)), Some(SlotId(2))],
                outputs: vec![Some(SlotId(3))],
                recompute: false,
            },
            Instr {
                name: "relu".into(),
                op: Op::Unary(UnaryOp::Relu),
                inputs: vec![Some(SlotId(3))],
                outputs: vec![Some(SlotId(4))],
                recompute: false,
            },
            Instr {
                name: "clip".into(),
                op: Op::Clip { min: Some(-0.1), max: None },
                inputs: vec![Some(SlotId(4)), None, None],
                outputs: vec![Some(SlotId(4))],
                recompute: false,
            },
            Instr {
                name: "mul".into(),
                op: Op::Binary(BinaryOp::Mul),
                inputs: vec![Some(SlotId(4)), Some(SlotId(5))],
                outputs: vec![Some(SlotId(8))],
                recompute: false,
            },
        ],
    }
}

fn encoded() -> Vec<u8> {
    encode(&PARAMS, &program()).expect("encode")
}

/// Recomputes the checksum field after a deliberate patch (CRC-32 of the whole file with
/// the field read as zero; see docs/module-format.md).
fn fix_checksum(file: &mut [u8]) {
    let mut h = crc32fast::Hasher::new();
    h.update(&file[..24]);
    h.update(&[0; 4]);
    h.update(&file[28..]);
    let sum = h.finalize();
    file[24..28].copy_from_slice(&sum.to_le_bytes());
}

fn u64_at(file: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(file[at..at + 8].try_into().unwrap())
}

#[test]
fn round_trip() {
    let p = program();
    let file = encoded();
    assert_eq!(&file[..8], &MAGIC);
    let m = decode_module(&file).expect("decode");
    assert_eq!(m.header.version, FORMAT_VERSION);
    assert_eq!(m.header.params, PARAMS);
    assert_eq!(m.header.program.offset, HEADER_LEN as u64);
    assert_eq!(m.header.weights.offset % 8, 0);
    assert_eq!(m.header.weights.offset + m.header.weights.len, file.len() as u64);
    // Program equality includes every stored tensor's bytes.
    assert_eq!(m.program, p);
    for (a, b) in m.program.stored.iter().zip(&p.stored) {
        assert_eq!(a.bytes, b.bytes, "bytes of {}", a.slot);
    }
    assert_eq!(decode_header(&file).unwrap(), m.header);
    // Deterministic: encoding the decoded program gives the same file.
    assert_eq!(encode(&PARAMS, &m.program).unwrap(), file);
}

#[test]
fn decoded_weights_share_the_file_buffer() {
    let file = Bytes::from(encoded());
    let range = file.as_ptr() as usize..file.as_ptr() as usize + file.len();
    let m = decode_module_bytes(file.clone()).unwrap();
    for s in &m.program.stored {
        if !s.bytes.is_empty() {
            assert!(range.contains(&(s.bytes.as_ptr() as usize)), "{} was copied", s.slot);
        }
    }
}

#[test]
fn program_section_is_json_and_weights_are_safetensors() {
    let file = encoded();
    let m = decode_header(&file).unwrap();
    let (po, pl) = (m.program.offset as usize, m.program.len as usize);
    let json: serde_json::Value = serde_json::from_slice(&file[po..po + pl]).unwrap();
    assert_eq!(json["stored"][0], serde_json::json!({"slot": 1, "elem": "f32", "dims": [3, 4], "trainable": true, "versions": 2, "update": "2bw"}));
    assert_eq!(json["instrs"][1]["op"], serde_json::json!({"Unary": "Relu"}));
    let wo = m.weights.offset as usize;
    let st = safetensors::SafeTensors::deserialize(&file[wo..]).unwrap();
    let mut names: Vec<_> = st.names().into_iter().cloned().collect();
    names.sort();
    assert_eq!(names, ["s1", "s2", "s5", "s6", "s7", "s9"]);
    assert_eq!(st.tensor("s7").unwrap().dtype(), safetensors::Dtype::BOOL);
    assert_eq!(st.tensor("s9").unwrap().dtype(), safetensors::Dtype::BF16);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&file[wo..]).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["s1"], "fc.weight");
}

#[test]
fn write_then_read_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stage1.pwm");
    std::fs::write(&path, encoded()).unwrap();
    let m = read_module(&path).unwrap();
    assert_eq!(m.program, program());
}

#[test]
fn corrupt_weights_byte_is_a_checksum_error() {
    let mut file = encoded();
    let last = file.len() - 1; // the last byte of the last tensor's data
    file[last] ^= 0x40;
    let e = decode_module(&file).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::ChecksumMismatch { expected, found } if expected != found), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("checksum mismatch") && msg.contains("corrupt"), "{msg}");
}

#[test]
fn corrupt_file_on_disk_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stage1.pwm");
    let mut file = encoded();
    file[HEADER_LEN + 3] ^= 1; // inside the program JSON
    std::fs::write(&path, &file).unwrap();
    let e = read_module(&path).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::ChecksumMismatch { .. }), "{e}");
    assert_eq!(e.path.as_deref(), Some(path.as_path()));
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

#[test]
fn truncated_section() {
    let file = encoded();
    let cut = &file[..file.len() - 10];
    let e = decode_module(cut).unwrap_err();
    match e.kind {
        ModuleErrorKind::Truncated { what, needed, len } => {
            assert_eq!(what, "weights section");
            assert_eq!(needed, file.len() as u64);
            assert_eq!(len, cut.len() as u64);
        }
        ref other => panic!("expected Truncated, got {other:?}: {e}"),
    }
    assert!(e.to_string().contains("truncated: the weights section needs"), "{e}");

    // Cut inside the program section.
    let e = decode_module(&file[..HEADER_LEN + 5]).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::Truncated { what: "program section", .. }), "{e}");
}

#[test]
fn truncated_header() {
    let file = encoded();
    for n in [0, 5, 10, 20, HEADER_LEN - 1] {
        let e = decode_module(&file[..n]).unwrap_err();
        assert!(
            matches!(e.kind, ModuleErrorKind::Truncated { what: "header", needed: 64, len } if len == n as u64),
            "{n} bytes: {e}"
        );
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}

#[test]
fn future_version_says_version_not_checksum() {
    let mut file = encoded();
    file[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    // Without fixing the checksum: the version check comes first.
    let e = decode_module(&file).unwrap_err();
    assert!(
        matches!(e.kind, ModuleErrorKind::UnsupportedVersion { found, supported } if found == FORMAT_VERSION + 1 && supported == FORMAT_VERSION),
        "{e}"
    );
    let said = format!("unsupported format version {} (this pipewright reads version {FORMAT_VERSION})", FORMAT_VERSION + 1);
    assert!(e.to_string().contains(&said), "{e}");
    // With a fixed checksum, the same.
    fix_checksum(&mut file);
    let e = decode_module(&file).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::UnsupportedVersion { .. }), "{e}");
    // A future version's header may be shorter or longer: still "version".
    let e = decode_module(&file[..12]).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::UnsupportedVersion { .. }), "{e}");
}

#[test]
fn wrong_magic() {
    let mut file = encoded();
    file[..8].copy_from_slice(b"GGUF\x03\0\0\0");
    let e = decode_module(&file).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::NotAModule { ref found } if found == b"GGUF\x03\0\0\0"), "{e}");
    assert!(
        e.to_string().contains(r#"not a pipewright stage module: it does not start with b"PWMODULE""#),
        "{e}"
    );
    // A short file that is not a prefix of the magic is not a module either.
    let e = decode_module(b"{}").unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::NotAModule { .. }), "{e}");
}

#[test]
fn missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-such-stage.pwm");
    let e = read_module(&path).unwrap_err();
    match &e.kind {
        ModuleErrorKind::Io { source, .. } => assert_eq!(source.kind(), std::io::ErrorKind::NotFound),
        other => panic!("expected Io, got {other:?}"),
    }
    assert_eq!(e.path.as_deref(), Some(path.as_path()));
    let msg = e.to_string();
    assert!(msg.starts_with(&format!("stage module {}: cannot read the file", path.display())), "{msg}");
}

#[test]
fn bad_program_json() {
    let mut file = encoded();
    file[HEADER_LEN] = b'['; // the JSON object now opens as an array
    fix_checksum(&mut file);
    let e = decode_module(&file).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::BadProgram(_)), "{e}");
    assert!(e.to_string().contains("bad program section: invalid JSON"), "{e}");
}

#[test]
fn bad_weights_section() {
    let file = encoded();
    let h = decode_header(&file).unwrap();
    let wo = h.weights.offset as usize;
    // A stored slot whose tensor is missing: rename "s9" to "s8" in the safetensors header
    // (same length, so the layout stays valid).
    let mut renamed = file.clone();
    let st_header_len = u64_at(&file, wo) as usize;
    let hdr = &mut renamed[wo + 8..wo + 8 + st_header_len];
    let text = String::from_utf8(hdr.to_vec()).unwrap();
    let patched = text.replacen("\"s9\":{", "\"s8\":{", 1);
    assert_ne!(text, patched);
    hdr.copy_from_slice(patched.as_bytes());
    fix_checksum(&mut renamed);
    let e = decode_module(&renamed).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::BadWeights(_)), "{e}");
    assert!(e.to_string().contains(r#"stored tensor s9 ("bf") has no tensor "s9""#), "{e}");

    // A dtype that disagrees with the program: BF16 -> F16 (same size).
    let mut retyped = file.clone();
    let hdr = &mut retyped[wo + 8..wo + 8 + st_header_len];
    let text = String::from_utf8(hdr.to_vec()).unwrap();
    let patched = text.replacen("\"BF16\"", "\"F16\" ", 1);
    hdr.copy_from_slice(patched.as_bytes());
    fix_checksum(&mut retyped);
    let e = decode_module(&retyped).unwrap_err();
    assert!(e.to_string().contains(r#"stored tensor s9 ("bf") is bf16 in the program but F16"#), "{e}");

    // Garbage instead of safetensors.
    let mut garbage = file.clone();
    garbage[wo..wo + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    fix_checksum(&mut garbage);
    let e = decode_module(&garbage).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::BadWeights(_)), "{e}");
    assert!(e.to_string().contains("not valid safetensors"), "{e}");
}

#[test]
fn encode_rejects_inconsistent_input() {
    let mut p = program();
    p.stored[0].bytes = Bytes::from_static(&[0; 7]);
    let e = encode(&PARAMS, &p).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::BadWeights(_)), "{e}");
    assert!(e.to_string().contains(r#"stored tensor s1 ("fc.weight") has 7 bytes, but f32 [3, 4] needs 48"#), "{e}");

    let bad = StageParams { stage: 4, ..PARAMS };
    let e = encode(&bad, &program()).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::BadHeader(_)), "{e}");

    // JSON has no NaN or infinity: the attribute would silently become null / None.
    let mut p = program();
    p.instrs[2].op = Op::Clip { min: Some(f32::NEG_INFINITY), max: None };
    let e = encode(&PARAMS, &p).unwrap_err();
    assert!(matches!(e.kind, ModuleErrorKind::BadProgram(_)), "{e}");
}
