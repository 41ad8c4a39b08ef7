//! What a run tells people and later runs: the summary table, `summary.json` and JUnit XML
//! ([`summary`]), the page ([`html`]), what changed against a baseline ([`trends`], the
//! changes as a summary holds them in [`changes`]), the benchmarks' figures a run carries
//! ([`bench`](mod@bench)), and the summaries of a run split over machines put together
//! ([`merge`]). [`median`] is a leaf the page and the trends share.

pub mod bench;
pub mod changes;
pub mod html;
pub mod median;
pub mod merge;
pub mod summary;
pub mod trends;
