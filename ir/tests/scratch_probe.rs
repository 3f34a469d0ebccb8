mod common;
use common::*;
use pipewright_ir::{import_bytes, ImportOptions};
use std::path::Path;
fn run(m: &ModelBuilder) { let r = std::panic::catch_unwind(|| import_bytes(&m.bytes(), Path::new("."), &ImportOptions::default()).map(|g| pipewright_ir::text::print_graph(&g))); match r { Ok(Ok(t)) => println!("OK\n{t}"), Ok(Err(e)) => println!("ERR {e}"), Err(_) => println!("PANIC") } }
#[test]
fn probe() {
    let big = 1i64 << 32;
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), big.into(), big.into()]).node(node("Flatten","f",&["x"],&["y"]).int("axis",1)).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), big.into(), big.into()]).node(node("Relu","f",&["x"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), big.into(), big.into()]).init(tensor_i64("s",&[1],&[-1])).node(node("Reshape","f",&["x","s"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("st",&[1],&[-100])).init(tensor_i64("en",&[1],&[i64::MIN])).init(tensor_i64("ax",&[1],&[1])).init(tensor_i64("sp",&[1],&[-1])).node(node("Slice","f",&["x","st","en","ax","sp"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 0.into()]).init(tensor_i64("st",&[1],&[-1])).init(tensor_i64("en",&[1],&[i64::MIN])).init(tensor_i64("ax",&[1],&[1])).init(tensor_i64("sp",&[1],&[-1])).node(node("Slice","f",&["x","st","en","ax","sp"],&["y"])).output("y"));
    // Concat axis-0 of batch
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).node(node("Concat","c",&["x","x"],&["y"]).int("axis",0)).output("y"));
    // Squeeze with a negative-extent? ConstantOfShape huge
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("s",&[3],&[big, big, 4])).node(node("ConstantOfShape","c",&["s"],&["y"])).output("y"));
    // Expand with batch literal
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 1.into(), 4.into()]).init(tensor_i64("s",&[3],&[2,3,4])).node(node("Expand","e",&["x","s"],&["y"])).output("y"));
    // Transpose bad perm length
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).node(node("Transpose","t",&["x"],&["y"]).ints("perm",&[0])).output("y"));
    // Gather out of range axis, index negative
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("i",&[],&[-1])).node(node("Gather","g",&["x","i"],&["y"]).int("axis",1)).output("y"));
    // Conv kernel bigger than input
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 2.into(), 2.into()]).init(tensor_f32_zeros("w",&[4,3,3,3])).node(node("Conv","c",&["x","w"],&["y"])).output("y"));
    // conv stride 0
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 8.into(), 8.into()]).init(tensor_f32_zeros("w",&[4,3,3,3])).node(node("Conv","c",&["x","w"],&["y"]).ints("strides",&[0,0])).output("y"));
    // Conv with rank-3 weight but rank4 input
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 8.into()]).init(tensor_f32_zeros("w",&[4,3,3])).node(node("Conv","c",&["x","w"],&["y"]).ints("kernel_shape",&[3,3])).output("y"));
    // Split num outputs 0 / Split on empty
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("s",&[2],&[-1, 4])).node(node("Split","s",&["x","s"],&["a","b"]).int("axis",1)).output("a"));
    // Reshape to zero dims
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 0.into()]).init(tensor_i64("s",&[2],&[-1, 0])).node(node("Reshape","r",&["x","s"],&["y"]).int("allowzero",1)).output("y"));
    // Unsqueeze axes dup/out of range
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("a",&[1],&[5])).node(node("Unsqueeze","u",&["x","a"],&["y"])).output("y"));
    // Pool with stride 0
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 8.into(), 8.into()]).node(node("MaxPool","p",&["x"],&["y"]).ints("kernel_shape",&[2,2]).ints("strides",&[0,0]).string("auto_pad","SAME_UPPER")).output("y"));
    // Range huge
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("a",&[],&[0])).init(tensor_i64("b",&[],&[i64::MAX])).init(tensor_i64("c",&[],&[1])).node(node("Range","r",&["a","b","c"],&["y"])).output("y"));
    // Tile negative
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("r",&[2],&[1, -2])).node(node("Tile","t",&["x","r"],&["y"])).output("y"));
    // Div by zero known ints
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("a",&[1],&[i64::MIN])).init(tensor_i64("b",&[1],&[-1])).node(node("Div","d",&["a","b"],&["q"])).node(node("Reshape","r",&["x","q"],&["y"])).output("y"));
}

#[test]
fn probe2() {
    let m = i64::MAX;
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 8.into(), 8.into()]).init(tensor_f32_zeros("w",&[4,3,3,3])).node(node("Conv","c",&["x","w"],&["y"]).ints("pads",&[m,m,m,m])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 8.into(), 8.into()]).init(tensor_f32_zeros("w",&[3,4,3,3])).node(node("ConvTranspose","c",&["x","w"],&["y"]).ints("strides",&[m,m])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into()]).init(tensor_i64("p",&[4],&[0,m,0,m])).node(node("Pad","p",&["x","p"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("st",&[1],&[1])).init(tensor_i64("en",&[1],&[m])).init(tensor_i64("ax",&[1],&[1])).init(tensor_i64("sp",&[1],&[m])).node(node("Slice","f",&["x","st","en","ax","sp"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("st",&[1],&[1])).init(tensor_i64("en",&[1],&[m])).init(tensor_i64("ax",&[1],&[7])).node(node("Slice","f",&["x","st","en","ax"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("a",&[1],&[m])).init(tensor_i64("b",&[1],&[1])).node(node("Add","d",&["a","b"],&["q"])).node(node("Reshape","r",&["x","q"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("a",&[1],&[i64::MIN])).init(tensor_i64("b",&[1],&[-1])).node(node("Mod","d",&["a","b"],&["q"])).node(node("Reshape","r",&["x","q"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("a",&[1],&[i64::MIN])).node(node("Abs","d",&["a"],&["q"])).node(node("Neg","n",&["a"],&["q2"])).node(node("Reshape","r",&["x","q"],&["y"])).output("y").output("q2"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("a",&[1],&[i64::MIN])).init(tensor_i64("b",&[1],&[1])).node(node("Sub","d",&["a","b"],&["q"])).node(node("Reshape","r",&["x","q"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("a",&[1],&[3])).init(tensor_i64("b",&[1],&[m])).node(node("Pow","d",&["a","b"],&["q"])).node(node("Reshape","r",&["x","q"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("s",&[2],&[m, -1])).node(node("Reshape","r",&["x","s"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("s",&[3],&[m, m, 0])).node(node("Reshape","r",&["x","s"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("s",&[2],&[m, m])).node(node("Expand","r",&["x","s"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Shape","s",&["x"],&["y"]).int("start", i64::MIN).int("end", m)).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Split","s",&["x"],&[])).output("x"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Concat","s",&[],&["y"]).int("axis",0)).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Einsum","e",&["x","x"],&["y"]).string("equation","ij,ij->ji...")).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Einsum","e",&["x"],&["y"]).string("equation","...i...->i")).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("a",&[],&[0])).init(tensor_i64("b",&[],&[10])).init(tensor_i64("c",&[],&[0])).node(node("Range","r",&["a","b","c"],&["y"])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).init(tensor_i64("i",&[1],&[m])).node(node("Gather","g",&["x","i"],&["y"]).int("axis",m)).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Transpose","t",&["x"],&["y"]).ints("perm",&[m, 0])).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Flatten","t",&["x"],&["y"]).int("axis", i64::MIN)).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 10.into()]).node(node("Softmax","t",&["x"],&["y"]).int("axis", m)).output("y"));
    run(&ModelBuilder::new(13).input("x", F32, &[2.into(), 3.into(), 10.into()]).init(tensor_f32_zeros("w",&[3, 3])).node(node("LayerNormalization","t",&["x","w"],&["y"]).int("axis", 1)).output("y"));
}
