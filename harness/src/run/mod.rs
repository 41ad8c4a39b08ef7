//! Running trials: which trials the suites hold ([`plan`]), each one through its phases on a
//! device ([`trial`], [`phases`]; another trainer's phases as commands, [`command_phases`]),
//! repeated ([`repeat`]), saving ([`saver`]), watched ([`progress`], [`memory_trace`]), with its
//! ranks meeting across processes ([`meeting`]) and the host's memory read ([`host_memory`]).
//! What a run produces is a [`crate::record::RunRecord`]; the checks never reach in here.

pub mod command_phases;
pub mod host_memory;
pub mod meeting;
pub mod memory_trace;
pub mod output_tail;
pub mod phases;
pub mod plan;
pub mod progress;
pub mod repeat;
pub mod saver;
pub mod trial;
