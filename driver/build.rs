// The driver links tch (with its `torch` feature), so its test binaries need the runtime's
// rpath: share the runtime's build script.
include!("../runtime/build.rs");
