//! The commands of the `ckpt-harness` tool, one file each: what a command does with its parsed
//! arguments. The binary (`main.rs`) parses the command line and hands each command here; the
//! runner, the checks and the reports they drive are the library modules beside this one.

pub mod estimate;
pub mod eval;
pub mod judge;
pub mod run;
pub mod train;
