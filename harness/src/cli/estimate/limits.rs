//! The sizes `estimate` takes. The memory model builds the engine's table of every tensor (a
//! name and a shape each, on the host, with no way to fail but an abort) and counts every
//! tensor's bytes in 64 bits: a run beyond either is refused before it is estimated, naming the
//! flag that set the size (or the configuration's key) and the limit. So is a world size that
//! cannot share the step's micro-batches.

use super::EstimateArgs;
use anyhow::{bail, Result};
use ckpt_engine::TrainConfig;

/// The most decoder blocks: the tables grow with them and the dry run runs each one; 100000
/// take about 10 s and 0.7 GB of host memory on the development machine.
pub const MAX_LAYERS: usize = 100_000;

/// The widest vocabulary, hidden or FFN width, head count or query width (heads × head width):
/// 2^24, at which a `[width, width]` tensor takes 2^50 bytes in f32, where a wider one's bytes
/// may overflow 64 bits.
pub const MAX_WIDTH: usize = 1 << 24;

/// Refuses `run` (what the flags `a` made of a suite, a configuration or a preset) when a size
/// exceeds its limit: the message names the flag when one was given, else the key, its value,
/// the limit and what to write instead.
pub fn check(a: &EstimateArgs, run: &TrainConfig) -> Result<()> {
    let m = &run.model;
    let query_width = m.num_attention_heads.saturating_mul(m.head_dim());
    let sizes = [
        (
            "--layers",
            a.layers,
            "model.num_hidden_layers",
            m.num_hidden_layers,
        ),
        ("--vocab", a.vocab, "model.vocab_size", m.vocab_size),
        ("--hidden", a.hidden, "model.hidden_size", m.hidden_size),
        (
            "--ffn",
            a.ffn,
            "model.intermediate_size",
            m.intermediate_size,
        ),
        (
            "--heads",
            a.heads,
            "model.num_attention_heads",
            m.num_attention_heads,
        ),
        (
            "--kv-heads",
            a.kv_heads,
            "model.num_key_value_heads",
            m.num_key_value_heads,
        ),
        (
            "",
            None,
            "model.num_attention_heads × model.head_dim",
            query_width,
        ),
    ];
    for (flag, given, key, value) in sizes {
        let (limit, why) = match flag {
            "--layers" => (MAX_LAYERS, "the most decoder blocks the memory model takes: it builds a table of every tensor on the host and runs every block, and 100000 blocks take about 10 s and 0.7 GB"),
            _ => (MAX_WIDTH, "the widest the memory model takes (2^24: a wider tensor's bytes may overflow 64 bits)"),
        };
        if value > limit {
            let name = if given.is_some() { flag } else { key };
            bail!("{name} is {value}, more than {limit}, {why}; write at most {limit}");
        }
    }
    ranks(a, run)
}

/// Refuses a world size of 0, or one that does not divide the step's micro-batches (each rank
/// takes an equal run of them), naming the flags that set them (or the keys) and a count to
/// write instead.
fn ranks(a: &EstimateArgs, run: &TrainConfig) -> Result<()> {
    let (world, micro) = (run.parallel.world_size, run.accumulation);
    let name = |flag: &'static str, given: bool, key: &'static str| if given { flag } else { key };
    let w = name(
        "--world-size",
        a.world_size.is_some(),
        "parallel.world_size",
    );
    let acc = name("--accumulation", a.accumulation.is_some(), "accumulation");
    if world == 0 {
        bail!("{w} is 0; write the number of ranks, at least 1");
    }
    if micro >= 1 && !micro.is_multiple_of(world) {
        let (unit, multiple) = (
            if micro == 1 { "" } else { "es" },
            micro.div_ceil(world) * world,
        );
        bail!("{w} is {world}, which does not divide the step's {micro} micro-batch{unit} ({acc}): each rank takes an equal run of them; write {acc} {multiple} (or another multiple of {world}), or a world size that divides {micro}");
    }
    Ok(())
}
