//! ckpt-harness: drives the training engine through train → save → resume phases and checks that
//! resuming changed nothing and memory behaved. This crate also holds the command-line tool.

pub mod bench;
pub mod changes;
pub mod checks;
pub mod checks_spec;
pub mod cli;
pub mod command_phases;
pub mod devices;
pub mod error_text;
pub mod exit_codes;
pub mod host_memory;
pub mod html;
pub mod meeting;
pub mod memory_trace;
pub mod merge;
pub mod phases;
pub mod plan;
pub mod progress;
pub mod record;
pub mod record_fields;
pub mod repeat;
pub mod report;
pub mod report_file;
pub mod run_record;
pub mod saves;
pub mod snapshot;
pub mod suite;
pub mod training_state;
pub mod trends;
pub mod trial;
