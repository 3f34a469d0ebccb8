//! Protobuf-aware mutation of ONNX files: the bytes are parsed as protobuf wire format into
//! a tree (length-delimited fields that parse as messages become sub-trees), one field is
//! changed, and the tree is written back with every enclosing length recomputed. A byte
//! flip inside a 4 KB model almost always breaks the outer lengths, so the importer only
//! ever sees "truncated"; these mutations reach the importer's own checks: dims, data
//! types, attribute values, field numbers, and lengths that lie at one level only.
//!
//! The ONNX field numbers used to aim the mutations (onnx.proto): ModelProto.graph = 7;
//! GraphProto.node = 1, initializer = 5, input = 11, output = 12, value_info = 13;
//! NodeProto.attribute = 5; AttributeProto.i = 3, t = 5, ints = 8, type = 20;
//! TensorProto.dims = 1, data_type = 2; ValueInfoProto.type = 2; TypeProto.tensor_type = 1;
//! TypeProto.Tensor.elem_type = 1, shape = 2; TensorShapeProto.dim = 1;
//! Dimension.dim_value = 1.

use crate::rng::Rng;

/// Nesting beyond this is kept as bytes (bounds the parse's recursion and cost).
const MAX_DEPTH: u32 = 12;

#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(Vec<u8>),
    Msg(Vec<Field>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Field {
    pub num: u64,
    /// The wire type written in the key; a mutation may make it disagree with `val`.
    pub wire: u8,
    pub val: Val,
    /// Added to the length written for a length-delimited field (a length that lies).
    pub len_adj: i64,
    /// Write the key with a redundant continuation byte (a non-canonical varint).
    pub overlong: bool,
}

fn read_varint(b: &[u8], pos: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..70).step_by(7) {
        let byte = *b.get(*pos)?;
        *pos += 1;
        if shift < 64 {
            v |= u64::from(byte & 0x7f) << shift;
        }
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn write_varint(out: &mut Vec<u8>, mut v: u64, overlong: bool) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            if overlong {
                out.push(byte | 0x80);
                out.push(0);
            } else {
                out.push(byte);
            }
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Parses `b` as a message; `None` when it is not exactly one (every byte consumed).
pub fn parse(b: &[u8]) -> Option<Vec<Field>> {
    parse_at(b, 0)
}

fn parse_at(b: &[u8], depth: u32) -> Option<Vec<Field>> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < b.len() {
        let key = read_varint(b, &mut pos)?;
        let (num, wire) = (key >> 3, (key & 7) as u8);
        if num == 0 {
            return None;
        }
        let val = match wire {
            0 => Val::Varint(read_varint(b, &mut pos)?),
            1 => {
                let s = b.get(pos..pos + 8)?;
                pos += 8;
                Val::Fixed64(s.try_into().ok()?)
            }
            5 => {
                let s = b.get(pos..pos + 4)?;
                pos += 4;
                Val::Fixed32(s.try_into().ok()?)
            }
            2 => {
                let len = usize::try_from(read_varint(b, &mut pos)?).ok()?;
                let end = pos.checked_add(len)?;
                let s = b.get(pos..end)?;
                pos = end;
                // A string or raw_data may happen to parse as a message; it is only taken
                // as one when writing it back gives the same bytes, so an unmutated tree
                // always serialises to its input.
                match (depth < MAX_DEPTH && !s.is_empty()).then(|| parse_at(s, depth + 1)).flatten() {
                    Some(m) if serialize(&m) == s => Val::Msg(m),
                    _ => Val::Bytes(s.to_vec()),
                }
            }
            _ => return None,
        };
        out.push(Field { num, wire, val, len_adj: 0, overlong: false });
    }
    Some(out)
}

pub fn serialize(fields: &[Field]) -> Vec<u8> {
    let mut out = Vec::new();
    write_fields(&mut out, fields);
    out
}

fn write_fields(out: &mut Vec<u8>, fields: &[Field]) {
    for f in fields {
        write_varint(out, (f.num << 3) | u64::from(f.wire & 7), f.overlong);
        match &f.val {
            Val::Varint(v) => write_varint(out, *v, false),
            Val::Fixed64(b) => out.extend_from_slice(b),
            Val::Fixed32(b) => out.extend_from_slice(b),
            Val::Bytes(b) => {
                write_varint(out, (b.len() as i64).wrapping_add(f.len_adj) as u64, false);
                out.extend_from_slice(b);
            }
            Val::Msg(m) => {
                let inner = serialize(m);
                write_varint(out, (inner.len() as i64).wrapping_add(f.len_adj) as u64, false);
                out.extend_from_slice(&inner);
            }
        }
    }
}

/// What a varint field means in ONNX, judged from the field numbers on its path.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Role {
    Dim,
    DataType,
    AttrInt,
    Other,
}

fn role(path: &[u64]) -> Role {
    match path {
        // TensorProto.dims / data_type, under GraphProto.initializer or AttributeProto.t.
        [.., 5, 1] => Role::Dim,
        [.., 5, 2] => Role::DataType,
        // Dimension.dim_value under TensorShapeProto.dim under TypeProto.Tensor.shape
        // under TypeProto.tensor_type.
        [.., 1, 2, 1, 1] => Role::Dim,
        // TypeProto.Tensor.elem_type under TypeProto.tensor_type under ValueInfoProto.type.
        [.., 2, 1, 1] => Role::DataType,
        // AttributeProto.i / ints under NodeProto.attribute.
        [.., 5, 3] | [.., 5, 8] => Role::AttrInt,
        _ => Role::Other,
    }
}

const DIMS: &[i64] = &[0, 1, 2, 3, 7, 64, -1, -2, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 40, 1 << 62, i64::MAX, i64::MIN];
const INTS: &[i64] = &[0, 1, -1, 2, 3, -2, 127, 128, 255, 65535, 1 << 31, (1 << 31) - 1, -(1 << 31), 1 << 32, i64::MAX, i64::MIN];

/// Every field's position: the index at each level, and the field numbers on the way.
fn collect(fields: &[Field], idx: &mut Vec<usize>, nums: &mut Vec<u64>, out: &mut Vec<(Vec<usize>, Vec<u64>)>) {
    for (i, f) in fields.iter().enumerate() {
        idx.push(i);
        nums.push(f.num);
        out.push((idx.clone(), nums.clone()));
        if let Val::Msg(m) = &f.val {
            collect(m, idx, nums, out);
        }
        idx.pop();
        nums.pop();
    }
}

/// The list holding the field at `idx` (all but its last index), and that last index.
fn parent_mut<'a>(root: &'a mut Vec<Field>, idx: &[usize]) -> Option<(&'a mut Vec<Field>, usize)> {
    let (&last, up) = idx.split_last()?;
    let mut list = root;
    for &i in up {
        list = match &mut list.get_mut(i)?.val {
            Val::Msg(m) => m,
            _ => return None,
        };
    }
    (last < list.len()).then_some((list, last))
}

/// Applies one protobuf-level mutation to `data`; `None` when `data` is not a message (the
/// caller falls back to a byte-level mutation).
pub fn mutate(data: &[u8], rng: &mut Rng) -> Option<Vec<u8>> {
    let mut root = parse(data)?;
    let mut all = Vec::new();
    collect(&root, &mut Vec::new(), &mut Vec::new(), &mut all);
    if all.is_empty() {
        return None;
    }
    // Prefer the fields whose meaning is known (dims, data types, attribute values):
    // they are a small part of a model but where the importer's checks are.
    let aimed: Vec<usize> = (0..all.len())
        .filter(|&k| matches!(&field_at(&root, &all[k].0).map(|f| &f.val), Some(Val::Varint(_))) && role(&all[k].1) != Role::Other)
        .collect();
    let k = if !aimed.is_empty() && rng.chance(1, 2) { aimed[rng.below(aimed.len())] } else { rng.below(all.len()) };
    let (idx, nums) = all[k].clone();
    let donor = all[rng.below(all.len())].0.clone();
    let donor_field = field_at(&root, &donor).cloned();
    let (list, i) = parent_mut(&mut root, &idx)?;
    match rng.below(9) {
        0 | 1 => {
            let f = &mut list[i];
            if let Val::Varint(v) = &mut f.val {
                *v = match role(&nums) {
                    Role::Dim => DIMS[rng.below(DIMS.len())] as u64,
                    Role::DataType => {
                        if rng.chance(3, 4) {
                            rng.below(27) as u64
                        } else {
                            INTS[rng.below(INTS.len())] as u64
                        }
                    }
                    Role::AttrInt | Role::Other => INTS[rng.below(INTS.len())] as u64,
                };
            } else {
                f.len_adj = [-1i64, 1, -8, 8, i64::from(i32::MAX), -(1 << 20)][rng.below(6)];
            }
        }
        2 => {
            // Another field number: a neighbour, a small one, or a huge one.
            let f = &mut list[i];
            f.num = match rng.below(3) {
                0 => f.num.saturating_add(1),
                1 => 1 + rng.below(24) as u64,
                _ => (1u64 << 29) - 1,
            };
        }
        3 => list[i].wire = [0u8, 1, 2, 3, 4, 5, 6, 7][rng.below(8)],
        4 => {
            list.remove(i);
        }
        5 => {
            let f = list[i].clone();
            list.insert(i, f);
        }
        6 => {
            // Splice: a copy of another field of this model (a node, a tensor, a dim) put
            // here, where its type may or may not fit.
            if let Some(d) = donor_field {
                list.insert(i, d);
            }
        }
        7 => {
            let f = &mut list[i];
            match &mut f.val {
                Val::Bytes(b) => {
                    let n = rng.below(b.len() + 1);
                    if rng.chance(1, 2) {
                        b.truncate(n);
                    } else {
                        let extra = 1 + rng.below(16);
                        b.extend((0..extra).map(|_| rng.below(256) as u8));
                    }
                }
                Val::Fixed32(b) => b.copy_from_slice(&[0xff, 0xff, 0x7f, 0x7f]),
                Val::Fixed64(b) => b.copy_from_slice(&u64::MAX.to_le_bytes()),
                Val::Varint(v) => *v = v.wrapping_add(1),
                Val::Msg(m) => m.clear(),
            }
        }
        _ => list[i].overlong = true,
    }
    Some(serialize(&root))
}

fn field_at<'a>(root: &'a [Field], idx: &[usize]) -> Option<&'a Field> {
    let (&last, up) = idx.split_last()?;
    let mut list = root;
    for &i in up {
        list = match &list.get(i)?.val {
            Val::Msg(m) => m,
            _ => return None,
        };
    }
    list.get(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_reaches_nested_fields() {
        // graph { initializer { dims: 3 dims: 4 data_type: 1 } }
        let tensor = serialize(&[
            Field { num: 1, wire: 0, val: Val::Varint(3), len_adj: 0, overlong: false },
            Field { num: 1, wire: 0, val: Val::Varint(4), len_adj: 0, overlong: false },
            Field { num: 2, wire: 0, val: Val::Varint(1), len_adj: 0, overlong: false },
        ]);
        let graph = serialize(&[Field { num: 5, wire: 2, val: Val::Bytes(tensor), len_adj: 0, overlong: false }]);
        let model = serialize(&[Field { num: 7, wire: 2, val: Val::Bytes(graph), len_adj: 0, overlong: false }]);
        let tree = parse(&model).unwrap();
        assert_eq!(serialize(&tree), model);
        let mut all = Vec::new();
        collect(&tree, &mut Vec::new(), &mut Vec::new(), &mut all);
        let roles: Vec<Role> = all.iter().map(|(_, n)| role(n)).collect();
        assert_eq!(roles, [Role::Other, Role::Other, Role::Dim, Role::Dim, Role::DataType]);
        let mut rng = Rng::new(7);
        let mut changed = 0;
        for _ in 0..200 {
            let m = mutate(&model, &mut rng).unwrap();
            changed += usize::from(m != model);
        }
        assert!(changed > 150, "only {changed} of 200 protobuf mutations changed the model");
    }

    #[test]
    fn not_a_message_is_refused() {
        assert_eq!(parse(&[0x08]), None);
        assert_eq!(parse(&[0x0a, 0x05, 1]), None);
    }
}
