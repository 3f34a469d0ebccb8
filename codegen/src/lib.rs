//! Code generation of per-stage modules from a partitioned graph. The stage module
//! format and its writer arrive with the compile issue; the crate exists now so the
//! dependency direction ir <- passes <- codegen is fixed from the start.
