//! ckpt-harness: drives the training engine through train → save → resume phases and checks that
//! resuming changed nothing and memory behaved. This crate also holds the command-line tool.
//!
//! The stages, in the order data flows through them: [`suite`] (a YAML file read and
//! validated), [`forecast`] (every step's batches and predicted memory, before anything runs),
//! [`run`] (the trials planned and driven through their phases), [`record`] (what a
//! trial observed, the only thing the checks read, and its published JSON-lines form),
//! [`checks`] (pure functions over a record), [`report`] (summaries, trends, the page), and
//! [`cli`] (the commands). Leaves every stage may use: [`devices`], [`error_text`],
//! [`atomic_file`].

pub mod atomic_file;
pub mod checks;
pub mod cli;
pub mod devices;
pub mod error_text;
pub mod forecast;
pub mod record;
pub mod report;
pub mod run;
pub mod suite;
