//! ckpt-harness: drives the training engine through train → save → resume phases and checks that
//! resuming changed nothing and memory behaved. This crate also holds the command-line tool.

pub mod bench;
pub mod checks;
pub mod command_phases;
pub mod devices;
pub mod error_text;
pub mod eval;
pub mod exit_codes;
pub mod host_memory;
pub mod html;
pub mod judge_cmd;
pub mod memory_trace;
pub mod merge;
pub mod phases;
pub mod plan;
pub mod progress;
pub mod rank_record;
pub mod record;
pub mod record_fields;
pub mod repeat;
pub mod report;
pub mod report_file;
pub mod run_cmd;
pub mod saves;
pub mod snapshot;
pub mod suite;
pub mod train_cmd;
pub mod training_state;
pub mod trends;
pub mod trial;
