//! The pipewright runtime: loads stage modules written by codegen and executes them.
//! It depends on neither the IR nor the passes, so a deployed stage binary carries no
//! importer. The tch-backed op layer and the schedulers arrive with their issues.
