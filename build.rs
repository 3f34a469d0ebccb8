// The CLI links tch through the runtime, so it needs the same rpath as the runtime's own
// targets: share the runtime's build script rather than keep a copy.
include!("runtime/build.rs");
