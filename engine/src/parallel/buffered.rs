//! A rank's receiving end kept open: over a transport whose sends wait for the receive that
//! takes them (NCCL's point-to-point, [`super::rendezvous`]), a thread per incoming peer keeps
//! a receive posted and queues what arrives, so that a rank's own sends return as soon as its
//! peer's thread has taken them, whatever the peer itself is doing.
//!
//! The collective's schedules need this: the ring of `shard: gradients` hands a sum on before it
//! receives the next one (docs/PARALLEL.md, NCCL), and `all_gather` sends to every rank before
//! it receives from any. Ranks that only rendezvous would each wait for another to receive.

use super::collective::Collective;
use crate::error::{EngineError, Result};
use std::sync::mpsc::{channel, Receiver};

/// One rank's sending end of a transport.
pub trait Outbox: Send {
    /// Sends `bytes` to rank `to`; returns once `to`'s end has taken them.
    fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()>;
}

/// One rank's receiving end for the messages of one peer, in the order sent.
pub trait Inbox: Send + 'static {
    /// The peer's next message, waiting for it; `None` once the peer has closed its end.
    fn recv(&mut self) -> Result<Option<Vec<u8>>>;
}

/// A rank whose receives are buffered: its sends go straight to the transport, and a thread per
/// peer takes the peer's messages as they come and queues them for [`Collective::recv`].
pub struct BufferedRank {
    rank: usize,
    out: Box<dyn Outbox>,
    /// The queue of each peer's messages (none for the rank itself), fed by its thread.
    queues: Vec<Option<Receiver<Result<Vec<u8>>>>>,
}

/// Rank `rank` over a transport: `out` for its sends and one inbox per rank in rank order
/// (`None` at `rank`), each drained by a thread of its own. A thread ends when its peer closes
/// its end or this rank is dropped and the next message arrives.
pub fn buffered(
    rank: usize,
    out: Box<dyn Outbox>,
    inboxes: Vec<Option<Box<dyn Inbox>>>,
) -> Result<BufferedRank> {
    let queues = inboxes
        .into_iter()
        .enumerate()
        .map(|(peer, inbox)| {
            let Some(mut inbox) = inbox else {
                return Ok(None);
            };
            let (queue, taken) = channel();
            std::thread::Builder::new()
                .name(format!("rank-{rank}-from-{peer}"))
                .spawn(move || loop {
                    let message = match inbox.recv() {
                        Ok(Some(bytes)) => Ok(bytes),
                        Ok(None) => return,
                        Err(e) => Err(e),
                    };
                    let failed = message.is_err();
                    if queue.send(message).is_err() || failed {
                        return;
                    }
                })
                .map(|_| Some(taken))
                .map_err(|e| EngineError::Threads {
                    threads: 1,
                    message: format!("rank {rank}'s receiver for rank {peer}: {e}"),
                })
        })
        .collect::<Result<_>>()?;
    Ok(BufferedRank { rank, out, queues })
}

impl Collective for BufferedRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.queues.len()
    }

    fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()> {
        self.out.send(to, bytes)
    }

    fn recv(&self, from: usize) -> Result<Vec<u8>> {
        let stopped = EngineError::PeerStopped {
            rank: self.rank,
            peer: from,
        };
        match self.queues.get(from).and_then(Option::as_ref) {
            Some(queue) => queue.recv().unwrap_or(Err(stopped)),
            None => Err(stopped),
        }
    }
}
