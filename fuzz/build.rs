// The fuzzer links tch through the runtime, so its binary and tests need the runtime's
// libtorch rpath: share the runtime's build script rather than keep a copy.
include!("../runtime/build.rs");
