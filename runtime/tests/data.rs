//! The training data loader (`pipewright_runtime::data`): .npy / .npz / safetensors round
//! trips, the errors for data that does not fit the model, seeded shuffling and synthetic
//! data, and the shipped digits example.

#![cfg(feature = "torch")]

use std::io::Write;
use std::path::{Path, PathBuf};

use pipewright_runtime::data::{encode_npy, parse_npy, DataError, Dataset, InputSpec, IntFill, RawArray, Stop};
use pipewright_ops::DType;
use tch::{Kind, Tensor};

fn spec(name: &str, elem: DType, shape: &[i64]) -> InputSpec {
    InputSpec { name: name.to_string(), elem, per_sample: shape.to_vec() }
}

fn f32_array(shape: &[i64], f: impl Fn(usize) -> f32) -> RawArray {
    let n: i64 = shape.iter().product();
    let data = (0..n as usize).flat_map(|i| f(i).to_le_bytes()).collect();
    RawArray { elem: DType::F32, shape: shape.to_vec(), data }
}

fn i64_array(shape: &[i64], f: impl Fn(usize) -> i64) -> RawArray {
    let n: i64 = shape.iter().product();
    let data = (0..n as usize).flat_map(|i| f(i).to_le_bytes()).collect();
    RawArray { elem: DType::I64, shape: shape.to_vec(), data }
}

fn write_npz(path: &Path, arrays: &[(&str, &RawArray)], deflate: bool) {
    let file = std::fs::File::create(path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    let method = if deflate { zip::CompressionMethod::Deflated } else { zip::CompressionMethod::Stored };
    let opts = zip::write::FileOptions::default().compression_method(method);
    for (name, a) in arrays {
        zip.start_file(format!("{name}.npy"), opts).unwrap();
        zip.write_all(&encode_npy(a).unwrap()).unwrap();
    }
    zip.finish().unwrap();
}

fn to_vec_f32(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

fn to_vec_i64(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.to_kind(Kind::Int64).flatten(0, -1)).unwrap()
}

fn err_of<T>(r: Result<T, DataError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

/// 10 samples: input row i is [i*3, i*3+1, i*3+2], label i is i.
fn toy() -> (RawArray, RawArray) {
    (f32_array(&[10, 3], |i| i as f32), i64_array(&[10], |i| i as i64))
}

#[test]
fn npy_round_trips_every_supported_dtype() {
    let arrays = [
        f32_array(&[2, 3], |i| i as f32 * 0.5 - 1.0),
        RawArray { elem: DType::F64, shape: vec![4], data: [1.5f64, -2.0, 0.0, 1e300].iter().flat_map(|v| v.to_le_bytes()).collect() },
        i64_array(&[3, 1, 2], |i| i as i64 - 3),
        RawArray { elem: DType::I32, shape: vec![2, 2], data: [7i32, -8, 9, i32::MAX].iter().flat_map(|v| v.to_le_bytes()).collect() },
        RawArray { elem: DType::U8, shape: vec![5], data: vec![0, 1, 128, 255, 3] },
        RawArray { elem: DType::Bool, shape: vec![1, 3], data: vec![1, 0, 1] },
        RawArray { elem: DType::F32, shape: vec![0, 4], data: vec![] },
    ];
    for a in &arrays {
        let bytes = encode_npy(a).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        // numpy aligns the data to 64 bytes; so do we.
        assert_eq!((bytes.len() - a.data.len()) % 64, 0, "{a:?}");
        assert_eq!(&parse_npy(&bytes).unwrap(), a);
    }
}

#[test]
fn npy_parses_hand_built_headers() {
    // Version 2.0 (u32 header length), double quotes, no trailing comma, a 1-d shape.
    let header = "{\"descr\": \"<i4\", \"fortran_order\": False, \"shape\": (3,)}\n";
    let mut bytes = b"\x93NUMPY\x02\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in [1i32, -2, 3] {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let a = parse_npy(&bytes).unwrap();
    assert_eq!(a.elem, DType::I32);
    assert_eq!(a.shape, vec![3]);

    // Version 1.0, keys in another order, a scalar shape.
    let header = "{'shape': (), 'fortran_order': False, 'descr': '<f8', }          \n";
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&2.5f64.to_le_bytes());
    let a = parse_npy(&bytes).unwrap();
    assert_eq!((a.elem, a.shape.len()), (DType::F64, 0));
}

fn npy_with_header(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

#[test]
fn npy_rejects_fortran_order_big_endian_and_other_dtypes() {
    let e = format!("{:#}", parse_npy(&npy_with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }\n", &[0; 4])).unwrap_err());
    assert!(e.contains("Fortran"), "{e}");
    let e = format!("{:#}", parse_npy(&npy_with_header("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }\n", &[0; 4])).unwrap_err());
    assert!(e.contains("big-endian") && e.contains(">f4"), "{e}");
    let e = format!("{:#}", parse_npy(&npy_with_header("{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }\n", &[0; 8])).unwrap_err());
    assert!(e.contains("<c8") && e.contains("not supported"), "{e}");
    let e = format!("{:#}", parse_npy(&npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n", &[0; 4])).unwrap_err());
    assert!(e.contains("needs 8"), "{e}");
    let e = format!("{:#}", parse_npy(b"PK\x03\x04 not npy at all").unwrap_err());
    assert!(e.contains("magic"), "{e}");
}

#[test]
fn loads_a_folder_and_files_of_npy() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = toy();
    std::fs::write(dir.path().join("x.npy"), encode_npy(&x).unwrap()).unwrap();
    std::fs::write(dir.path().join("y.npy"), encode_npy(&y).unwrap()).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
    let inputs = [spec("x", DType::F32, &[3])];

    let d = Dataset::from_npy(&[dir.path()], &inputs, Some("y")).unwrap();
    assert_eq!(d.samples(), 10);
    assert_eq!(d.input("x").unwrap().size(), vec![10, 3]);
    assert_eq!(to_vec_f32(&d.input("x").unwrap()), (0..30).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(to_vec_i64(&d.labels().unwrap()), (0..10).collect::<Vec<_>>());

    let files: Vec<PathBuf> = vec![dir.path().join("x.npy"), dir.path().join("y.npy")];
    let d = Dataset::from_npy(&files, &inputs, Some("y")).unwrap();
    assert_eq!(d.labels().unwrap().kind(), Kind::Int64);
    let d = Dataset::open(dir.path(), &inputs, None).unwrap();
    assert!(d.labels().is_none());
}

#[test]
fn loads_npz_stored_and_deflated() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = toy();
    let mask = RawArray { elem: DType::Bool, shape: vec![10, 2], data: (0..20).map(|i| (i % 3 == 0) as u8).collect() };
    let ids = RawArray { elem: DType::I32, shape: vec![10], data: (0..10i32).flat_map(|v| v.to_le_bytes()).collect() };
    for deflate in [false, true] {
        let path = dir.path().join(format!("d{deflate}.npz"));
        write_npz(&path, &[("x", &x), ("y", &y), ("mask", &mask), ("ids", &ids)], deflate);
        let inputs = [spec("x", DType::F32, &[3]), spec("mask", DType::Bool, &[2]), spec("ids", DType::I32, &[])];
        let d = Dataset::open(&path, &inputs, Some("y")).unwrap();
        assert_eq!(d.samples(), 10);
        assert_eq!(d.input_names(), ["x", "mask", "ids"]);
        assert_eq!(to_vec_f32(&d.input("x").unwrap())[29], 29.0);
        assert_eq!(d.input("mask").unwrap().kind(), Kind::Bool);
        assert_eq!(to_vec_i64(&d.input("mask").unwrap()), (0..20).map(|i| (i % 3 == 0) as i64).collect::<Vec<_>>());
        assert_eq!(d.input("ids").unwrap().kind(), Kind::Int);
        assert_eq!(to_vec_i64(&d.labels().unwrap()), (0..10).collect::<Vec<_>>());
    }
}

#[test]
fn loads_safetensors() {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = toy();
    let h: Vec<u8> = (0..10 * 2).flat_map(|i| half_bits(i as f32 * 0.25).to_le_bytes()).collect();
    let tensors = vec![
        ("x", TensorView::new(Dtype::F32, vec![10, 3], &x.data).unwrap()),
        ("y", TensorView::new(Dtype::I64, vec![10], &y.data).unwrap()),
        ("h", TensorView::new(Dtype::F16, vec![10, 2], &h).unwrap()),
    ];
    let bytes = safetensors::tensor::serialize(tensors, &None).unwrap();
    let path = dir.path().join("d.safetensors");
    std::fs::write(&path, bytes).unwrap();

    let inputs = [spec("x", DType::F32, &[3]), spec("h", DType::F16, &[2])];
    let d = Dataset::open(&path, &inputs, Some("y")).unwrap();
    assert_eq!(d.samples(), 10);
    assert_eq!(to_vec_f32(&d.input("x").unwrap()), (0..30).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(d.input("h").unwrap().kind(), Kind::Half);
    assert_eq!(to_vec_f32(&d.input("h").unwrap())[3], 0.75);
    assert_eq!(to_vec_i64(&d.labels().unwrap()), (0..10).collect::<Vec<_>>());

    let e = err_of(Dataset::from_safetensors(&path, &[spec("z", DType::F32, &[3])], None));
    assert!(e.contains("d.safetensors") && e.contains("`z`") && e.contains("(arrays: h, x, y)"), "{e}");
    // The file is mapped: a change under the run stops the next batch, naming it.
    let mut batches = d.batches(2, 2, 0, Stop::Steps(3)).unwrap();
    batches.next().unwrap().expect("the first batch reads");
    std::fs::OpenOptions::new().append(true).open(&path).and_then(|mut f| f.write_all(&[0; 8])).unwrap();
    let e = batches.next().unwrap().expect_err("the grown file is refused").to_string();
    assert!(e.contains("d.safetensors: the data file changed during the run"), "{e}");
}

/// f32 -> IEEE half bits, for the small exact values used above.
fn half_bits(v: f32) -> u16 {
    let b = v.to_bits();
    if v == 0.0 {
        return 0;
    }
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let mant = ((b >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | mant
}

#[test]
fn errors_name_the_file_and_the_array() {
    let dir = tempfile::tempdir().unwrap();
    let (x, y) = toy();
    let short_y = i64_array(&[9], |i| i as i64);
    let path = dir.path().join("bad.npz");
    write_npz(&path, &[("x", &x), ("y", &y), ("short", &short_y)], true);
    let ok = [spec("x", DType::F32, &[3])];

    // A model input with no array.
    let e = err_of(Dataset::from_npz(&path, &[spec("input", DType::F32, &[3])], Some("y")));
    assert!(e.contains("bad.npz") && e.contains("model input `input`") && e.contains("short, x, y"), "{e}");
    // No label array.
    let e = err_of(Dataset::from_npz(&path, &ok, Some("label")));
    assert!(e.contains("bad.npz") && e.contains("label array `label`"), "{e}");
    // Wrong per-sample shape.
    let e = err_of(Dataset::from_npz(&path, &[spec("x", DType::F32, &[4])], None));
    assert!(e.contains("bad.npz") && e.contains("`x`") && e.contains("[3]") && e.contains("[4]"), "{e}");
    let e = err_of(Dataset::from_npz(&path, &[spec("x", DType::F32, &[3, 1])], None));
    assert!(e.contains("per-sample shape [3]"), "{e}");
    // A dynamic dimension matches any size.
    assert_eq!(Dataset::from_npz(&path, &[spec("x", DType::F32, &[-1])], None).unwrap().samples(), 10);
    // Wrong element type.
    let e = err_of(Dataset::from_npz(&path, &[spec("x", DType::I64, &[3])], None));
    assert!(e.contains("bad.npz") && e.contains("`x`") && e.contains("f32") && e.contains("i64"), "{e}");
    // Different sample counts (input vs label).
    let e = err_of(Dataset::from_npz(&path, &ok, Some("short")));
    assert!(e.contains("bad.npz") && e.contains("different sample counts") && e.contains("`x` has 10") && e.contains("`short` has 9"), "{e}");
    // Unsupported dtype inside the archive names the array.
    let big = npy_with_header("{'descr': '>i8', 'fortran_order': False, 'shape': (10,), }\n", &[0; 80]);
    let path2 = dir.path().join("be.npz");
    {
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&path2).unwrap());
        zip.start_file("x.npy", zip::write::FileOptions::default()).unwrap();
        zip.write_all(&encode_npy(&x).unwrap()).unwrap();
        zip.start_file("y.npy", zip::write::FileOptions::default()).unwrap();
        zip.write_all(&big).unwrap();
        zip.finish().unwrap();
    }
    let e = err_of(Dataset::from_npz(&path2, &ok, Some("y")));
    assert!(e.contains("be.npz") && e.contains("`y`") && e.contains("big-endian"), "{e}");
    // Not a zip at all; a missing file.
    std::fs::write(dir.path().join("junk.npz"), b"hello").unwrap();
    let e = err_of(Dataset::from_npz(&dir.path().join("junk.npz"), &ok, None));
    assert!(e.contains("junk.npz"), "{e}");
    let e = err_of(Dataset::open(&dir.path().join("missing.npz"), &ok, None));
    assert!(e.contains("missing.npz: not found"), "{e}");
    // A missing .npy is not found either (it used to read as a folder with no array).
    let e = err_of(Dataset::open(&dir.path().join("nosuch.npy"), &ok, None));
    assert!(e.contains("nosuch.npy: not found (give an .npz, an .npy, a folder of .npy files or a .safetensors file)"), "{e}");
    // Fortran order in a loose .npy names the file.
    let f = dir.path().join("f.npy");
    std::fs::write(&f, npy_with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (10, 3), }\n", &[0; 120])).unwrap();
    let e = err_of(Dataset::from_npy(&[&f], &[spec("f", DType::F32, &[3])], None));
    assert!(e.contains("f.npy") && e.contains("`f`") && e.contains("Fortran"), "{e}");
}

#[test]
fn batches_shuffle_deterministically_and_drop_the_tail() {
    let (x, y) = toy();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("toy.npz");
    write_npz(&path, &[("x", &x), ("y", &y)], true);
    let d = Dataset::from_npz(&path, &[spec("x", DType::F32, &[3])], Some("y")).unwrap();

    // 10 samples, batches of 2 microbatches of 2: 2 per epoch, 2 samples dropped each epoch.
    assert_eq!(d.batches_per_epoch(2, 2), 2);
    let labels_of = |seed: u64, stop: Stop| -> Vec<Vec<Vec<i64>>> {
        d.batches(2, 2, seed, stop)
            .unwrap()
            .map(|batch| {
                let batch = batch.unwrap();
                assert_eq!(batch.len(), 2);
                batch
                    .iter()
                    .map(|(inputs, labels)| {
                        let labels = to_vec_i64(labels.as_ref().unwrap());
                        // Inputs stay aligned with labels: row of sample i starts at 3i.
                        let (name, t) = &inputs[0];
                        assert_eq!(name, "x");
                        assert_eq!(t.size(), vec![2, 3]);
                        let xs = to_vec_f32(t);
                        for (k, l) in labels.iter().enumerate() {
                            assert_eq!(xs[k * 3], (*l * 3) as f32);
                        }
                        labels
                    })
                    .collect()
            })
            .collect()
    };
    let a = labels_of(7, Stop::Epochs(3));
    assert_eq!(a.len(), 6);
    assert_eq!(a, labels_of(7, Stop::Epochs(3)), "same seed, same order");
    assert_ne!(a, labels_of(8, Stop::Epochs(3)), "another seed, another order");
    // Each epoch draws 8 distinct samples, and the epochs differ.
    for epoch in a.chunks(2) {
        let mut seen: Vec<i64> = epoch.iter().flatten().flatten().copied().collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 8);
    }
    assert_ne!(a[0..2], a[2..4]);
    // Steps run across epochs in the same order as epochs.
    let s = labels_of(7, Stop::Steps(5));
    assert_eq!(s[..], a[..5]);
    assert_eq!(d.batches(2, 2, 7, Stop::Steps(5)).unwrap().len(), 5);
    // The per-epoch order is a seeded permutation.
    let mut o = d.epoch_order(7, 0);
    assert_eq!(o, d.epoch_order(7, 0));
    assert_ne!(o, d.epoch_order(7, 1));
    o.sort();
    assert_eq!(o, (0..10).collect::<Vec<_>>());
    // Not even one batch fits; degenerate sizes.
    let e = err_of(d.batches(4, 3, 0, Stop::Epochs(1)));
    assert!(e.contains("10 samples") && e.contains("12"), "{e}");
    assert_eq!(err_of(d.batches(0, 2, 0, Stop::Epochs(1))), "batches: microbatch size and microbatch count must be at least 1 (got 0 x 2)");
    assert_eq!(err_of(d.batches(2, 0, 0, Stop::Epochs(1))), "batches: microbatch size and microbatch count must be at least 1 (got 2 x 0)");
    // Exactly one batch per epoch with b*m == samples: everything is used.
    let all: Vec<i64> = d.batches(5, 2, 1, Stop::Epochs(1)).unwrap().flat_map(Result::unwrap).flat_map(|(_, l)| to_vec_i64(&l.unwrap())).collect();
    let mut sorted = all.clone();
    sorted.sort();
    assert_eq!(sorted, (0..10).collect::<Vec<_>>());
}

#[test]
fn synthetic_data_is_seeded() {
    let inputs = [spec("x", DType::F32, &[4, 5]), spec("ids", DType::I64, &[7]), spec("m", DType::Bool, &[3]), spec("h", DType::F16, &[2])];
    let a = Dataset::synthetic(&inputs, 100, 42).unwrap();
    let b = Dataset::synthetic(&inputs, 100, 42).unwrap();
    let c = Dataset::synthetic(&inputs, 100, 43).unwrap();
    assert_eq!(a.samples(), 100);
    assert_eq!(a.input("x").unwrap().size(), vec![100, 4, 5]);
    assert_eq!(a.input("x").unwrap().kind(), Kind::Float);
    assert_eq!(a.input("ids").unwrap().kind(), Kind::Int64);
    assert_eq!(a.input("m").unwrap().kind(), Kind::Bool);
    assert_eq!(a.input("h").unwrap().kind(), Kind::Half);
    assert_eq!(to_vec_f32(&a.input("x").unwrap()), to_vec_f32(&b.input("x").unwrap()));
    assert_ne!(to_vec_f32(&a.input("x").unwrap()), to_vec_f32(&c.input("x").unwrap()));
    // Standard normal, roughly.
    let xs = to_vec_f32(&a.input("x").unwrap());
    let mean = xs.iter().sum::<f32>() / xs.len() as f32;
    let var = xs.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / xs.len() as f32;
    assert!(mean.abs() < 0.1 && (var - 1.0).abs() < 0.15, "mean {mean} var {var}");
    // Integers default to zeros.
    assert!(to_vec_i64(&a.input("ids").unwrap()).iter().all(|&v| v == 0));

    let u = Dataset::synthetic_with(&inputs, 100, 42, IntFill::Uniform(30)).unwrap();
    let ids = to_vec_i64(&u.input("ids").unwrap());
    assert!(ids.iter().all(|&v| (0..30).contains(&v)));
    assert!(ids.iter().collect::<std::collections::BTreeSet<_>>().len() > 20);
    assert_eq!(ids, to_vec_i64(&Dataset::synthetic_with(&inputs, 100, 42, IntFill::Uniform(30)).unwrap().input("ids").unwrap()));
    let m = to_vec_i64(&u.input("m").unwrap());
    assert!(m.contains(&0) && m.contains(&1));

    let l = a.with_random_labels(10, 5).unwrap();
    let labels = to_vec_i64(&l.labels().unwrap());
    assert_eq!(labels.len(), 100);
    assert!(labels.iter().all(|&v| (0..10).contains(&v)));
    let batches: Vec<_> = l.batches(8, 4, 0, Stop::Steps(7)).unwrap().map(Result::unwrap).collect();
    assert_eq!(batches.len(), 7);
    assert_eq!(batches[0][0].0.len(), 4);

    assert_eq!(
        err_of(Dataset::synthetic(&[spec("x", DType::F32, &[-1])], 4, 0)),
        "synthetic input `x`: per-sample shape [-1] has a dynamic dimension (-1); give a concrete size"
    );
    assert_eq!(err_of(Dataset::synthetic(&inputs, 0, 0)), "synthetic data set: needs at least one sample");
}

#[test]
fn loads_the_digits_example() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/digits/digits.npz");
    let d = Dataset::open(&path, &[spec("input", DType::F32, &[64])], Some("label")).unwrap();
    assert_eq!(d.samples(), 1797);
    let x = d.input("input").unwrap();
    assert_eq!(x.size(), vec![1797, 64]);
    assert_eq!(x.kind(), Kind::Float);
    let xs = to_vec_f32(&x);
    assert!(xs.iter().all(|&v| (0.0..=1.0).contains(&v)));
    assert_eq!(xs.iter().cloned().fold(0.0f32, f32::max), 1.0);
    let labels = d.labels().unwrap();
    assert_eq!(labels.kind(), Kind::Int64);
    let labels = to_vec_i64(&labels);
    let mut counts = [0usize; 10];
    for l in &labels {
        counts[*l as usize] += 1;
    }
    assert!(counts.iter().all(|&c| c > 150), "{counts:?}");
    assert_eq!(&labels[..10], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]);
    // 1797 = 28 batches of 4 x 16 (+ 5 dropped).
    assert_eq!(d.batches(16, 4, 0, Stop::Epochs(1)).unwrap().count(), 28);
}

/// A .npy header whose shape claims more than the file holds (or overflows, or is
/// negative) is refused before anything is allocated for it, saying which.
#[test]
fn npy_headers_claiming_more_than_the_file_holds_are_refused() {
    let npy = |shape: &str, data: &[u8]| {
        let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut b = b"\x93NUMPY\x01\x00".to_vec();
        b.extend_from_slice(&(header.len() as u16).to_le_bytes());
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(data);
        b
    };
    let e = err_of(parse_npy(&npy("(1000000000000,)", &[0; 8])));
    assert!(e.contains("needs 4000000000000 bytes of data, but the file holds 8"), "{e}");
    let e = err_of(parse_npy(&npy("(4611686018427387904, 4611686018427387904)", &[0; 8])));
    assert!(e.contains("more than 2^64") && e.contains("the file holds 8"), "{e}");
    let e = err_of(parse_npy(&npy("(-2, 1)", &[0; 8])));
    assert!(e.contains("bad .npy header") && e.contains("bad shape entry"), "{e}");
    assert_eq!(parse_npy(&npy("(2,)", &[0; 8])).unwrap().shape, vec![2]);
}

/// An .npz that inflates past the cap (a decompression bomb: 64 MiB of zeros compress to
/// about 64 KiB) is an error naming the member and the cap, not an abort; under a cap it
/// fits, it loads.
#[test]
fn npz_decompression_is_capped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bomb.npz");
    let x = f32_array(&[16, 1 << 20], |_| 0.0);
    write_npz(&path, &[("x", &x)], true);
    assert!(std::fs::metadata(&path).unwrap().len() < 1 << 20);
    let inputs = [spec("x", DType::F32, &[1 << 20])];
    let e = err_of(Dataset::open_capped(&path, &inputs, None, 1 << 20));
    assert!(e.contains("bomb.npz: member `x.npy`") && e.contains("more than 1048576 bytes"), "{e}");
    assert_eq!(Dataset::open_capped(&path, &inputs, None, 80 << 20).unwrap().samples(), 16);
}

/// Float labels for cross-entropy must be whole class ids: 1.5 is refused naming the
/// array and the value (it was truncated to class 1); whole floats pass (negative and too-large ids are the loss's to report).
#[test]
fn fractional_class_labels_are_refused() {
    let with = |labels: &[f32]| Dataset::synthetic(&[spec("x", DType::F32, &[3])], 4, 0).unwrap().with_labels(Tensor::from_slice(labels)).unwrap();
    let e = err_of(with(&[0.0, 1.5, 2.0, 1.0]).check_class_labels("label"));
    assert!(e.contains("label array `label` holds 1.5 (element 1)"), "{e}");
    let e = err_of(with(&[0.0, f32::NAN, 2.0, 1.0]).check_class_labels("label"));
    assert!(e.contains("holds NaN"), "{e}");
    with(&[0.0, 1.0, 2.0, 3.0]).check_class_labels("label").unwrap();
    // The ignore index is no class id and passes.
    with(&[0.0, -100.0, 2.0, 3.0]).check_class_labels("label").unwrap();
}

/// A zip64 .npz member that claims 2^40 bytes (its real data is a few hundred bytes)
/// made the loader reserve the claim up front and abort the process; the claim is not
/// trusted now: the load reads the real bytes (or is an error naming the file), and the
/// process lives.
#[test]
fn npz_member_claiming_a_huge_size_does_not_abort() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("claim.npz");
    let (x, _) = toy();
    write_npz(&path, &[("x", &x)], false);
    let b = std::fs::read(&path).unwrap();
    // The central directory entry: its uncompressed size becomes 0xFFFFFFFF with a zip64
    // extra field (id 1) holding 2^40, and the end record's directory size grows by it.
    let cd = b.windows(4).position(|w| w == b"PK\x01\x02").unwrap();
    let eocd = b.windows(4).rposition(|w| w == b"PK\x05\x06").unwrap();
    let name_len = u16::from_le_bytes([b[cd + 28], b[cd + 29]]) as usize;
    let extra_len = u16::from_le_bytes([b[cd + 30], b[cd + 31]]);
    let mut out = b[..cd + 46 + name_len].to_vec();
    out[cd + 24..cd + 28].copy_from_slice(&u32::MAX.to_le_bytes());
    out[cd + 30..cd + 32].copy_from_slice(&(extra_len + 12).to_le_bytes());
    out.extend_from_slice(&[1, 0, 8, 0]);
    out.extend_from_slice(&(1u64 << 40).to_le_bytes());
    out.extend_from_slice(&b[cd + 46 + name_len..]);
    let eocd = eocd + 12;
    let size = u32::from_le_bytes(out[eocd + 12..eocd + 16].try_into().unwrap()) + 12;
    out[eocd + 12..eocd + 16].copy_from_slice(&size.to_le_bytes());
    std::fs::write(&path, &out).unwrap();
    let mut zip = zip::ZipArchive::new(std::fs::File::open(&path).unwrap()).unwrap();
    assert_eq!(zip.by_index(0).unwrap().size(), 1 << 40, "the crafted claim did not take");
    match Dataset::open(&path, &[spec("x", DType::F32, &[3])], None) {
        Ok(d) => assert_eq!(d.samples(), 10),
        Err(e) => assert!(e.to_string().contains("claim.npz"), "{e}"),
    }
}

/// Synthetic data for an absurd sample count is an error naming the input, not an abort
/// (a --microbatch of 100,000,000 made the allocation fail and the process abort).
#[test]
fn absurd_synthetic_data_is_an_error_not_an_abort() {
    let e = err_of(Dataset::synthetic(&[spec("x", DType::F32, &[1024])], 1 << 40, 0));
    assert!(e.contains("synthetic input `x`") && e.contains("cannot be allocated"), "{e}");
    let e = err_of(Dataset::synthetic(&[spec("ids", DType::I64, &[1 << 40])], 1 << 40, 0));
    assert!(e.contains("synthetic input `ids`") && e.contains("cannot be allocated"), "{e}");
}

/// A `.npy` array is mapped, not read: its values are the file's, and a file changed or
/// deleted under a run stops the next batch with a message naming it (a truncated mapping
/// would otherwise fault on access). Bool arrays, whose bytes are checked, are read whole.
#[test]
fn npy_arrays_are_mapped_and_a_changed_file_stops_the_next_batch() {
    let (x, y) = toy();
    let dir = tempfile::tempdir().unwrap();
    let (xp, yp) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    std::fs::write(&xp, encode_npy(&x).unwrap()).unwrap();
    std::fs::write(&yp, encode_npy(&y).unwrap()).unwrap();
    let d = Dataset::from_npy(&[dir.path()], &[spec("x", DType::F32, &[3])], Some("y")).unwrap();
    let want = Tensor::from_slice(&x.data.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>()).view([10, 3]);
    assert!(d.input("x").unwrap().equal(&want), "mapped values are the file's");
    let mut batches = d.batches(2, 2, 0, Stop::Steps(3)).unwrap();
    batches.next().unwrap().expect("the first batch reads");
    std::fs::OpenOptions::new().append(true).open(&xp).and_then(|mut f| f.write_all(&[0; 4])).unwrap();
    let e = batches.next().unwrap().expect_err("the grown file is refused").to_string();
    assert!(e.contains("x.npy: the data file changed during the run (its size went from") && e.contains("--resume"), "{e}");
    assert!(batches.next().is_none(), "nothing after the error");

    let flags = RawArray { elem: DType::Bool, shape: vec![10, 3], data: vec![1; 30] };
    std::fs::write(&xp, encode_npy(&flags).unwrap()).unwrap();
    let d = Dataset::from_npy(&[dir.path()], &[spec("x", DType::Bool, &[3])], Some("y")).unwrap();
    let mut batches = d.batches(2, 2, 0, Stop::Steps(3)).unwrap();
    std::fs::remove_file(&xp).unwrap();
    batches.next().unwrap().expect("a bool array is read whole: its file no longer matters");
}

/// `.npz` members are not read whole: a stored member is a view of the mapped archive,
/// typed where its bytes are aligned for its type and copied row by row per batch where
/// not (the member names below put the data of `ab` and `abc` at offsets of different
/// alignment); a deflated member is inflated into a scratch file and mapped. Every kind
/// gives the file's values in every batch, and a stored archive changed under a run stops
/// the next batch naming it.
#[test]
fn npz_members_are_mapped_whether_aligned_stored_or_deflated() {
    let (x, y) = toy();
    let dir = tempfile::tempdir().unwrap();
    let want = Tensor::from_slice(&x.data.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>()).view([10, 3]);
    let inputs = [spec("ab", DType::F32, &[3]), spec("abc", DType::F32, &[3])];
    let header = (encode_npy(&x).unwrap().len() - x.data.len()) as u64;
    let mut offsets = Vec::new();
    for deflate in [false, true] {
        let path = dir.path().join(format!("d{deflate}.npz"));
        write_npz(&path, &[("ab", &x), ("abc", &x), ("y", &y)], deflate);
        if !deflate {
            let mut zip = zip::ZipArchive::new(std::fs::File::open(&path).unwrap()).unwrap();
            offsets = ["ab.npy", "abc.npy"].iter().map(|m| zip.by_name(m).unwrap().data_start() + header).collect();
        }
        let d = Dataset::open(&path, &inputs, Some("y")).unwrap();
        for name in ["ab", "abc"] {
            assert!(d.input(name).unwrap().equal(&want), "{name} (deflated: {deflate})");
        }
        assert_eq!(to_vec_i64(&d.labels().unwrap()), (0..10).collect::<Vec<_>>());
        for batch in d.batches(2, 2, 7, Stop::Epochs(2)).unwrap() {
            for (mb, labels) in batch.unwrap() {
                let rows = labels.unwrap();
                for (name, t) in &mb {
                    assert!(t.equal(&want.index_select(0, &rows)), "{name}: the batch holds its samples' rows (deflated: {deflate})");
                }
            }
        }
    }
    assert!(offsets[0] % 4 == 0 && offsets[1] % 4 != 0, "one member aligned for f32, one not: {offsets:?}");

    let path = dir.path().join("dfalse.npz");
    let d = Dataset::open(&path, &inputs, Some("y")).unwrap();
    let mut batches = d.batches(2, 2, 0, Stop::Steps(3)).unwrap();
    batches.next().unwrap().expect("the first batch reads");
    std::fs::OpenOptions::new().append(true).open(&path).and_then(|mut f| f.write_all(&[0; 4])).unwrap();
    let e = batches.next().unwrap().expect_err("the grown archive is refused").to_string();
    assert!(e.contains("dfalse.npz: the data file changed during the run") && e.contains("--resume"), "{e}");

    // A deflated archive's members are copies: the archive may change after loading.
    let path = dir.path().join("dtrue.npz");
    let d = Dataset::open(&path, &inputs, Some("y")).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(d.batches(2, 2, 0, Stop::Steps(3)).unwrap().filter(|b| b.is_ok()).count(), 3);
}
