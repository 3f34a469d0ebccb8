//! The mutator: byte-level mutations (bit flips, byte insertions and deletions, splices
//! between corpus files, interesting integers), text-level ones for the formats with
//! JSON or Python-literal headers (numbers, dictionary tokens), and the structure-aware
//! ones: protobuf fields of ONNX files ([`crate::proto`]) and the sections and checksum of
//! stage modules, so a mutated module gets past its CRC to the parser behind it.

use crate::proto;
use crate::rng::Rng;
use crate::targets::Target;

/// Interesting integers, written at random offsets in 1, 2, 4 or 8 bytes, either byte order.
const INTERESTING: &[u64] = &[
    0,
    1,
    0x7f,
    0x80,
    0xff,
    0x100,
    0x7fff,
    0x8000,
    0xffff,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    1 << 40,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX,
];

/// Numbers written over a run of ASCII digits (shapes, offsets, steps, lengths in text).
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "255",
    "256",
    "65535",
    "4294967295",
    "4294967296",
    "1099511627776",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999",
    "1e308",
    "-0",
    "0.5",
];

/// Stage-module layout (runtime/src/module.rs): the CRC32 at 24 covers the whole file with
/// itself zeroed; the program section's offset and length at 32 and 40, the weights'
/// at 48 and 56; the header is 64 bytes.
const MOD_CHECKSUM: usize = 24;
const MOD_PROGRAM: usize = 32;
const MOD_WEIGHTS: usize = 48;
const MOD_HEADER: usize = 64;

/// Makes one new input from `base` (and `other`, another corpus input to splice with):
/// one to four mutations stacked, at most `max_len` bytes.
pub fn mutate(target: Target, base: &[u8], other: &[u8], dict: &[Vec<u8>], max_len: usize, rng: &mut Rng) -> Vec<u8> {
    let mut data = base.to_vec();
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        data = match target {
            Target::Onnx if rng.chance(2, 3) => proto::mutate(&data, rng).unwrap_or_else(|| bytes(data, other, dict, rng)),
            Target::Module if rng.chance(3, 4) => module_sections(&data, other, dict, rng),
            _ => bytes(data, other, dict, rng),
        };
        data.truncate(max_len);
    }
    if target == Target::Module && rng.chance(7, 8) {
        fix_module_checksum(&mut data);
    }
    data
}

/// One byte- or text-level mutation.
pub fn bytes(mut d: Vec<u8>, other: &[u8], dict: &[Vec<u8>], rng: &mut Rng) -> Vec<u8> {
    let len = d.len();
    match rng.below(12) {
        0 if len > 0 => {
            let bits = 1 + rng.below(4);
            for _ in 0..bits {
                let i = rng.below(len);
                d[i] ^= 1 << rng.below(8);
            }
        }
        1 if len > 0 => {
            let i = rng.below(len);
            d[i] = rng.below(256) as u8;
        }
        2 => {
            let i = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let fill: Vec<u8> = if rng.chance(1, 2) { (0..n).map(|_| rng.below(256) as u8).collect() } else { vec![d.get(i).copied().unwrap_or(0); n] };
            d.splice(i..i, fill);
        }
        3 if len > 0 => {
            let i = rng.below(len);
            let n = 1 + rng.below((len - i).min(64));
            d.drain(i..i + n);
        }
        4 if len > 0 => {
            // Duplicate a block (repeated fields, repeated zip entries, repeated keys).
            let i = rng.below(len);
            let n = 1 + rng.below((len - i).min(256));
            let block = d[i..i + n].to_vec();
            let at = rng.below(len + 1);
            d.splice(at..at, block);
        }
        5 if !other.is_empty() => {
            // Splice: a prefix of this input, then a suffix of another.
            let cut = rng.below(len + 1);
            let from = rng.below(other.len());
            d.truncate(cut);
            d.extend_from_slice(&other[from..]);
        }
        6 if len > 0 => {
            let v = INTERESTING[rng.below(INTERESTING.len())];
            let width = [1usize, 2, 4, 8][rng.below(4)];
            // The low `width` bytes: first in little-endian, last in big-endian.
            let (le, be) = (v.to_le_bytes(), v.to_be_bytes());
            let bytes = if rng.chance(1, 2) { &le[..width] } else { &be[8 - width..] };
            let i = rng.below(len);
            let end = (i + width).min(len);
            d[i..end].copy_from_slice(&bytes[..end - i]);
        }
        7 | 8 => {
            if let Some(out) = text_number(&d, rng) {
                d = out;
            }
        }
        9 | 10 if !dict.is_empty() => {
            let word = &dict[rng.below(dict.len())];
            let i = rng.below(len + 1);
            if rng.chance(1, 2) {
                d.splice(i..i, word.iter().copied());
            } else {
                let end = (i + word.len()).min(len);
                d.splice(i..end, word.iter().copied());
            }
        }
        _ if len > 1 => {
            // Truncate: every loader must say "truncated", not read past the end.
            d.truncate(rng.below(len));
        }
        _ => d.push(rng.below(256) as u8),
    }
    d
}

/// Replaces one run of ASCII digits with an interesting number.
fn text_number(d: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let starts: Vec<usize> = (0..d.len()).filter(|&i| d[i].is_ascii_digit() && (i == 0 || !d[i - 1].is_ascii_digit())).collect();
    if starts.is_empty() {
        return None;
    }
    let s = starts[rng.below(starts.len())];
    let e = (s..d.len()).find(|&i| !d[i].is_ascii_digit()).unwrap_or(d.len());
    let mut out = d[..s].to_vec();
    out.extend_from_slice(NUMBERS[rng.below(NUMBERS.len())].as_bytes());
    out.extend_from_slice(&d[e..]);
    Some(out)
}

fn get_u64(d: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(d.get(at..at + 8)?.try_into().ok()?))
}

/// A stage module cut at its declared sections (header, program JSON, weights), one part
/// mutated, and the parts joined again with the header's offsets and lengths rewritten to
/// fit; the checksum is fixed afterwards by [`mutate`]. Anything that does not lie where
/// the header says is mutated as plain bytes.
fn module_sections(d: &[u8], other: &[u8], dict: &[Vec<u8>], rng: &mut Rng) -> Vec<u8> {
    let sections = (|| {
        let (po, pl) = (get_u64(d, MOD_PROGRAM)? as usize, get_u64(d, MOD_PROGRAM + 8)? as usize);
        let (wo, wl) = (get_u64(d, MOD_WEIGHTS)? as usize, get_u64(d, MOD_WEIGHTS + 8)? as usize);
        let program = d.get(po..po.checked_add(pl)?)?;
        let weights = d.get(wo..wo.checked_add(wl)?)?;
        (po >= MOD_HEADER).then(|| (d[..MOD_HEADER].to_vec(), program.to_vec(), weights.to_vec()))
    })();
    let Some((mut header, mut program, mut weights)) = sections else {
        return bytes(d.to_vec(), other, dict, rng);
    };
    match rng.below(5) {
        0 => header = bytes(header, other, dict, rng),
        1 | 2 => program = bytes(program, other, dict, rng),
        _ => weights = bytes(weights, other, dict, rng),
    }
    header.resize(MOD_HEADER, 0);
    let po = MOD_HEADER;
    let pad = (8 - (po + program.len()) % 8) % 8;
    let wo = po + program.len() + pad;
    header[MOD_PROGRAM..MOD_PROGRAM + 8].copy_from_slice(&(po as u64).to_le_bytes());
    header[MOD_PROGRAM + 8..MOD_PROGRAM + 16].copy_from_slice(&(program.len() as u64).to_le_bytes());
    header[MOD_WEIGHTS..MOD_WEIGHTS + 8].copy_from_slice(&(wo as u64).to_le_bytes());
    header[MOD_WEIGHTS + 8..MOD_WEIGHTS + 16].copy_from_slice(&(weights.len() as u64).to_le_bytes());
    let mut out = header;
    out.extend_from_slice(&program);
    out.resize(wo, 0);
    out.extend_from_slice(&weights);
    out
}

/// Rewrites a module's CRC32 (of the file with the checksum field zeroed) to match.
pub fn fix_module_checksum(d: &mut [u8]) {
    if d.len() < MOD_CHECKSUM + 4 {
        return;
    }
    let mut h = crc32fast::Hasher::new();
    h.update(&d[..MOD_CHECKSUM]);
    h.update(&[0; 4]);
    h.update(&d[MOD_CHECKSUM + 4..]);
    let crc = h.finalize();
    d[MOD_CHECKSUM..MOD_CHECKSUM + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Dictionary words taken from the seeds: every quoted string of 2 to 40 bytes (JSON keys
/// and values, .npy header keys and dtypes), with its quotes.
pub fn words_of(seed: &[u8], out: &mut Vec<Vec<u8>>) {
    for quote in [b'"', b'\''] {
        let mut i = 0;
        while let Some(s) = seed[i..].iter().position(|&b| b == quote).map(|p| p + i) {
            match seed[s + 1..].iter().take(41).position(|&b| b == quote) {
                Some(n) if n >= 2 => {
                    let w = seed[s..s + n + 2].to_vec();
                    if w.iter().all(|b| b.is_ascii_graphic() || *b == b' ') && !out.contains(&w) {
                        out.push(w);
                    }
                    i = s + n + 2;
                }
                _ => i = s + 1,
            }
            if i >= seed.len() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn module_sections_keep_a_valid_layout_and_checksum() {
        // A fake module: 64-byte header, 5-byte program at 64, 8-byte weights at 72.
        let mut m = vec![0u8; MOD_HEADER];
        m[..8].copy_from_slice(b"PWMODULE");
        m[MOD_PROGRAM..MOD_PROGRAM + 8].copy_from_slice(&64u64.to_le_bytes());
        m[MOD_PROGRAM + 8..MOD_PROGRAM + 16].copy_from_slice(&5u64.to_le_bytes());
        m[MOD_WEIGHTS..MOD_WEIGHTS + 8].copy_from_slice(&72u64.to_le_bytes());
        m[MOD_WEIGHTS + 8..MOD_WEIGHTS + 16].copy_from_slice(&8u64.to_le_bytes());
        m.extend_from_slice(b"{\"a\":1}"[..5].as_ref());
        m.resize(72, 0);
        m.extend_from_slice(&[1; 8]);
        let mut rng = Rng::new(3);
        for _ in 0..100 {
            let out = module_sections(&m, &[], &[], &mut rng);
            let (po, pl) = (get_u64(&out, MOD_PROGRAM).unwrap(), get_u64(&out, MOD_PROGRAM + 8).unwrap());
            let (wo, wl) = (get_u64(&out, MOD_WEIGHTS).unwrap(), get_u64(&out, MOD_WEIGHTS + 8).unwrap());
            assert_eq!(po, 64);
            assert!(wo >= po + pl && wo % 8 == 0);
            assert_eq!((wo + wl) as usize, out.len());
        }
        let mut fixed = m.clone();
        fix_module_checksum(&mut fixed);
        assert_ne!(fixed[MOD_CHECKSUM..MOD_CHECKSUM + 4], [0; 4]);
    }

    #[test]
    fn byte_mutations_change_the_input_and_respect_the_length_cap() {
        let mut rng = Rng::new(1);
        let base = b"{\"step\": 12, \"stages\": [\"a\"]}".to_vec();
        let mut dict = Vec::new();
        words_of(&base, &mut dict);
        assert!(dict.contains(&b"\"step\"".to_vec()), "{dict:?}");
        let mut changed = 0;
        for _ in 0..500 {
            let out = mutate(Target::Checkpoint, &base, b"other", &dict, 40, &mut rng);
            assert!(out.len() <= 40);
            changed += usize::from(out != base);
        }
        assert!(changed > 450, "{changed} of 500 changed");
    }

    #[test]
    fn text_numbers_replace_a_digit_run() {
        let mut rng = Rng::new(5);
        let outs: Vec<String> = (0..200).map(|_| String::from_utf8(text_number(b"(12, 345)", &mut rng).unwrap()).unwrap()).collect();
        for s in &outs {
            assert!(s.starts_with('(') && s.ends_with(')') && (s.contains("12, ") || s.contains(", 345")), "{s}");
        }
        assert!(outs.iter().any(|s| s == "(18446744073709551615, 345)"));
        assert!(outs.iter().any(|s| s == "(12, -1)"));
        assert_eq!(text_number(b"no digits", &mut rng), None);
    }
}
