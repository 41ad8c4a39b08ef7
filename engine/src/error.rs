//! The engine's error type: every failure names what went wrong and where.

use crate::memory::OutOfMemory;
use std::path::PathBuf;

/// Anything the engine can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The device could not hold an allocation.
    #[error(transparent)]
    OutOfMemory(#[from] OutOfMemory),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// A file's content is not what it should be.
    #[error("{}: {message}", path.display())]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong, and the fix where there is one.
        message: String,
    },
    /// A value of the run's configuration is impossible: [`Setting`] names its key.
    #[error("invalid configuration: {0}")]
    Setting(#[from] Setting),
    /// The engine cannot run as it is set up: an environment variable, ranks that disagree, a
    /// batch that does not fit the model.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The CUDA backend cannot run here: a library or the device is missing.
    #[error("no GPU: {0}")]
    NoGpu(String),
    /// A CUDA driver, cuBLAS or NVRTC call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The host could not allocate a buffer outside the device's tracker.
    #[error("cannot allocate {} on the host for {what}; reduce the run's sizes", crate::memory::human_bytes(*bytes))]
    HostMemory {
        /// What the buffer was for.
        what: String,
        /// Bytes asked for.
        bytes: u64,
    },
    /// A data-parallel rank stopped before an exchange with this one finished: the stopped
    /// rank's own error is the cause.
    #[error(
        "rank {rank}: rank {peer} stopped before the exchange finished (its own error says why)"
    )]
    PeerStopped {
        /// The rank that was waiting.
        rank: usize,
        /// The rank that stopped.
        peer: usize,
    },
    /// A data-parallel rank waited longer than its transport allows for a peer to meet it: under
    /// rendezvous sends a message waits for the receive that takes it, so ranks that all send
    /// before they receive wait on each other for ever.
    #[error(
        "rank {rank}: waited {seconds} s for rank {peer}, which never met it: each was sending (or receiving) while the other did the same; the message schedule needs sends that return at once, which NCCL's point-to-point does not give without a receive kept posted"
    )]
    Stalled {
        /// The rank that waited.
        rank: usize,
        /// The rank it waited for.
        peer: usize,
        /// How long it waited.
        seconds: f64,
    },
    /// A data-parallel rank could not meet the other ranks over the sockets transport: `message`
    /// says what was missing or wrong, and the fix.
    #[error("rank {rank} could not join the other ranks: {message}")]
    Join {
        /// The rank that tried to join.
        rank: usize,
        /// What went wrong, and the fix.
        message: String,
    },
    /// A data-parallel rank's connection to a peer broke in the middle of a message.
    #[error("rank {rank}: the connection to rank {peer} broke: {message}")]
    Link {
        /// The rank that was receiving.
        rank: usize,
        /// The peer it was receiving from.
        peer: usize,
        /// What the operating system said, or how much of the message came.
        message: String,
    },
    /// A checkpoint could not be saved. `message` says which step, why (the unfinished copy,
    /// already removed, is not named as if it were still there) and what the run's `latest`
    /// names now.
    #[error("{message}")]
    SaveFailed {
        /// The step whose save failed.
        step: u64,
        /// The whole account, as printed.
        message: String,
    },
    /// The thread pool could not be started.
    #[error("could not start {threads} worker threads: {message}")]
    Threads {
        /// Threads asked for.
        threads: usize,
        /// Why not.
        message: String,
    },
}

/// An impossible value of a run's configuration: the key that holds it, as the run's schema
/// spells it (`optimizer.lr`, `optimizer.betas[1]`, `model.head_dim`; a model's own keys
/// without `model.`, as its `config.json` spells them), apart from what is wrong with it and
/// what to write instead. Whoever wrote the configuration finds the key's place by the key,
/// never by reading the message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Setting {
    /// The key's path.
    pub key: String,
    /// What is wrong, and the fix; it names the key too, for people.
    pub message: String,
}

impl Setting {
    /// The value at `key` is wrong as `message` says.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Setting {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The same setting with its key under `parent` (`head_dim` under `model`).
    pub fn under(self, parent: &str) -> Self {
        Setting {
            key: format!("{parent}.{}", self.key),
            ..self
        }
    }
}

impl EngineError {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io {
            path: path.into(),
            source,
        }
    }

    /// A content error in `path`.
    pub fn bad_file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        EngineError::BadFile {
            path: path.into(),
            message: message.into(),
        }
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Requests below this many bytes are not held to the host's available memory: reading it
/// takes seven files of `/proc` and `/sys`, far more than such a request costs (a plan's dry
/// runs made thousands of them a second), and the allocator's own refusal of one is still an
/// error ([`try_vec`]).
const PROBED_FROM: u64 = 1 << 20;

/// Refuses a host buffer of `bytes` for `what` that the host's available memory cannot hold
/// (from 1 MiB on).
pub fn check_host(bytes: u64, what: &str) -> Result<()> {
    if bytes >= PROBED_FROM && bytes > crate::memory::host_available().unwrap_or(u64::MAX) {
        return Err(EngineError::HostMemory {
            what: what.to_string(),
            bytes,
        });
    }
    Ok(())
}

/// A host buffer of `len` copies of `value`, or an error saying what could not be allocated: a
/// request larger than the host's available memory, or one the allocator refuses, is an error,
/// never an abort.
pub fn try_vec<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>> {
    let bytes = len.saturating_mul(std::mem::size_of::<T>()) as u64;
    check_host(bytes, what)?;
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| EngineError::HostMemory {
            what: what.to_string(),
            bytes,
        })?;
    v.resize(len, value);
    Ok(v)
}
