//! The rendezvous transport: ranks in one process whose every send waits until its peer takes
//! the message, as NCCL's point-to-point does (a send completes once the matching receive is
//! posted, and one peer's messages are taken in the order sent). CPU ranks run on it
//! (`parallel: {transport: rendezvous}`) show that the engine's message schedules need no more
//! of a transport than NCCL gives, once the receiving ends are kept open ([`super::buffered`]):
//! the same bits as over channels, at every stage and world size.
//!
//! Each ordered pair of ranks has a `Slot` holding at most one message. A send puts its
//! message in and waits until it is taken, at most [`SEND_LIMIT`]: a message nobody takes in
//! that time means every rank is sending and none receiving, which is reported, not waited on
//! for ever.

use super::buffered::{buffered, BufferedRank, Inbox, Outbox};
use crate::error::{EngineError, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

/// How long a send waits for its message to be taken. A buffered peer's thread takes it as soon
/// as it is scheduled; only ranks that wait on each other's receives come near it.
pub const SEND_LIMIT: Duration = Duration::from_secs(60);

/// What a slot holds: the message on its way, and whether either end has gone.
#[derive(Default)]
struct Held {
    message: Option<Vec<u8>>,
    sender_gone: bool,
    receiver_gone: bool,
}

/// The one-message meeting place of a sending rank and a receiving rank.
#[derive(Default)]
struct Slot {
    held: Mutex<Held>,
    changed: Condvar,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Puts `bytes` in for `to` (from `rank`) and waits until they are taken, at most `limit`.
    fn send(&self, (rank, to): (usize, usize), bytes: Vec<u8>, limit: Duration) -> Result<()> {
        let gone = EngineError::PeerStopped { rank, peer: to };
        let mut held = self.lock();
        if held.receiver_gone {
            return Err(gone);
        }
        held.message = Some(bytes);
        self.changed.notify_all();
        let (mut held, _) = self
            .changed
            .wait_timeout_while(held, limit, |h| h.message.is_some() && !h.receiver_gone)
            .unwrap_or_else(PoisonError::into_inner);
        if held.message.is_none() {
            return Ok(());
        }
        held.message = None;
        match held.receiver_gone {
            true => Err(gone),
            false => Err(EngineError::Stalled {
                rank,
                peer: to,
                seconds: limit.as_secs_f64(),
            }),
        }
    }

    /// The next message, waiting for it as long as the sender computes; `None` once the sender
    /// has gone.
    fn recv(&self) -> Option<Vec<u8>> {
        let held = self.lock();
        let mut held = self
            .changed
            .wait_while(held, |h| h.message.is_none() && !h.sender_gone)
            .unwrap_or_else(PoisonError::into_inner);
        let bytes = held.message.take();
        self.changed.notify_all();
        bytes
    }

    fn close(&self, sender: bool) {
        let mut held = self.lock();
        match sender {
            true => held.sender_gone = true,
            false => held.receiver_gone = true,
        }
        self.changed.notify_all();
    }
}

/// A rank's sending ends: the slot to each rank, in rank order.
struct Sends {
    rank: usize,
    to: Vec<Arc<Slot>>,
}

impl Outbox for Sends {
    fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()> {
        self.to[to].send((self.rank, to), bytes, SEND_LIMIT)
    }
}

impl Drop for Sends {
    fn drop(&mut self) {
        self.to.iter().for_each(|slot| slot.close(true));
    }
}

/// A rank's receiving end for one peer: the slot from it.
struct Receives(Arc<Slot>);

impl Inbox for Receives {
    fn recv(&mut self) -> Result<Option<Vec<u8>>> {
        Ok(self.0.recv())
    }
}

impl Drop for Receives {
    fn drop(&mut self) {
        self.0.close(false);
    }
}

/// The slots of a group of `world` ranks: `slots[from][to]`.
fn slots(world: usize) -> Vec<Vec<Arc<Slot>>> {
    (0..world)
        .map(|_| (0..world).map(|_| Arc::default()).collect())
        .collect()
}

/// A group of `world` ranks over rendezvous sends, each with its receiving ends kept open, one
/// per rank in rank order, each to be moved to the thread that runs it.
pub fn group(world: usize) -> Result<Vec<BufferedRank>> {
    let slots = slots(world);
    (0..world)
        .map(|rank| {
            let sends = Sends {
                rank,
                to: slots[rank].clone(),
            };
            let inboxes = (0..world)
                .map(|from| {
                    (from != rank)
                        .then(|| Box::new(Receives(slots[from][rank].clone())) as Box<dyn Inbox>)
                })
                .collect();
            buffered(rank, Box::new(sends), inboxes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::collective::Collective;
    use super::super::conformance::{
        assert_a_stopped_rank_fails_its_peers, assert_every_collective_works, run,
        sends_before_receives,
    };
    use super::*;

    /// A rank over bare rendezvous sends, its receives taken only when it asks for them, each
    /// send waiting at most `limit`: what a transport without kept-open receiving ends gives.
    struct Bare {
        rank: usize,
        to: Vec<Arc<Slot>>,
        from: Vec<Arc<Slot>>,
        limit: Duration,
    }

    impl Collective for Bare {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.to.len()
        }
        fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()> {
            self.to[to].send((self.rank, to), bytes, self.limit)
        }
        fn recv(&self, from: usize) -> Result<Vec<u8>> {
            self.from[from].recv().ok_or(EngineError::PeerStopped {
                rank: self.rank,
                peer: from,
            })
        }
    }

    fn bare_group(world: usize, limit: Duration) -> Vec<Bare> {
        let slots = slots(world);
        (0..world)
            .map(|rank| Bare {
                rank,
                to: slots[rank].clone(),
                from: slots.iter().map(|row| row[rank].clone()).collect(),
                limit,
            })
            .collect()
    }

    #[test]
    fn bare_rendezvous_ranks_that_send_before_they_receive_are_reported_not_hung() {
        let out = run(bare_group(2, Duration::from_millis(200)), |c| {
            sends_before_receives(&c)
        });
        for (rank, result) in out.into_iter().enumerate() {
            let e = result.unwrap_err();
            assert!(
                matches!(e, EngineError::Stalled { rank: r, peer, .. } if r == rank && peer == 1 - rank),
                "{e}"
            );
            assert!(e.to_string().contains("never met it"), "{e}");
        }
    }

    #[test]
    fn kept_open_receiving_ends_let_ranks_send_before_they_receive() {
        assert_every_collective_works(|world| group(world).unwrap());
    }

    #[test]
    fn a_rank_that_stops_fails_its_peers_instead_of_hanging_them() {
        assert_a_stopped_rank_fails_its_peers(|world| group(world).unwrap());
    }
}
