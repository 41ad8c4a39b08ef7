//! The collective: how ranks move bytes to each other. It moves data and never adds it: every
//! floating-point sum across ranks is the engine's, in an order the engine fixes
//! ([`crate::ranks`]), so the bits of a step do not depend on the world size. Integer counts are
//! the one thing it sums, where order cannot matter.
//!
//! [`thread_group`] is the in-process implementation CPU ranks use: one thread per rank, a
//! channel for each ordered pair of ranks, so the messages from one rank to another arrive in
//! the order they were sent (as PyTorch's threaded process group serves its own FSDP tests). A
//! rank that stops drops its channels, and every rank waiting on it gets an error instead of
//! waiting for ever.

use crate::error::{EngineError, Result};
use std::sync::mpsc::{channel, Receiver, Sender};

/// One rank's end of a group of ranks.
pub trait Collective: Send {
    /// This rank's index, from 0.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn world_size(&self) -> usize;

    /// Sends `bytes` to rank `to`.
    fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()>;

    /// The next message rank `from` sent to this rank.
    fn recv(&self, from: usize) -> Result<Vec<u8>>;

    /// Rank `root`'s `bytes`, on every rank (the other ranks' `bytes` are not read). They travel
    /// a relay, `root` to `root + 1` and on around the ranks, each rank handing on what it got:
    /// every rank sends the message at most once, where the root sending it to each rank would
    /// send it `N − 1` times.
    fn broadcast(&self, root: usize, bytes: Vec<u8>) -> Result<Vec<u8>> {
        let (rank, world) = (self.rank(), self.world_size());
        let bytes = match rank == root {
            true => bytes,
            false => self.recv((rank + world - 1) % world)?,
        };
        if (rank + 1) % world != root {
            self.send((rank + 1) % world, bytes.clone())?;
        }
        Ok(bytes)
    }

    /// Every rank's `bytes`, in rank order, on every rank.
    fn all_gather(&self, bytes: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        let (rank, world) = (self.rank(), self.world_size());
        for to in (0..world).filter(|&r| r != rank) {
            self.send(to, bytes.clone())?;
        }
        let mut own = Some(bytes);
        (0..world)
            .map(|from| match from == rank {
                true => Ok(own.take().unwrap_or_default()),
                false => self.recv(from),
            })
            .collect()
    }

    /// The sum of every rank's `value` (an integer count: its order cannot matter).
    fn sum_u64(&self, value: u64) -> Result<u64> {
        let all = self.all_gather(value.to_le_bytes().to_vec())?;
        all.iter()
            .map(|b| <[u8; 8]>::try_from(b.as_slice()).map(u64::from_le_bytes))
            .sum::<std::result::Result<u64, _>>()
            .map_err(|_| EngineError::Config("a rank sent a count that is not 8 bytes".into()))
    }

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()> {
        self.all_gather(Vec::new()).map(drop)
    }
}

/// A rank of an in-process group ([`thread_group`]).
pub struct ThreadRank {
    rank: usize,
    to: Vec<Sender<Vec<u8>>>,
    from: Vec<Receiver<Vec<u8>>>,
}

/// A group of `world` ranks in one process, one [`ThreadRank`] per rank in rank order, each to
/// be moved to the thread that runs it.
pub fn thread_group(world: usize) -> Vec<ThreadRank> {
    let mut to: Vec<Vec<Sender<Vec<u8>>>> = (0..world).map(|_| Vec::new()).collect();
    let mut from: Vec<Vec<Receiver<Vec<u8>>>> = (0..world).map(|_| Vec::new()).collect();
    for sender in to.iter_mut() {
        for receiver in from.iter_mut() {
            let (tx, rx) = channel();
            sender.push(tx);
            receiver.push(rx);
        }
    }
    to.into_iter()
        .zip(from)
        .enumerate()
        .map(|(rank, (to, from))| ThreadRank { rank, to, from })
        .collect()
}

/// The error of rank `rank` whose peer `peer` stopped.
fn peer_stopped(rank: usize, peer: usize) -> EngineError {
    EngineError::PeerStopped { rank, peer }
}

impl Collective for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.to.len()
    }

    fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()> {
        self.to[to]
            .send(bytes)
            .map_err(|_| peer_stopped(self.rank, to))
    }

    fn recv(&self, from: usize) -> Result<Vec<u8>> {
        self.from[from]
            .recv()
            .map_err(|_| peer_stopped(self.rank, from))
    }
}

#[cfg(test)]
mod tests {
    use super::super::conformance::{
        assert_a_stopped_rank_fails_its_peers, assert_every_collective_works, run,
    };
    use super::*;

    #[test]
    fn every_collective_moves_each_rank_s_bytes_where_they_belong() {
        assert_every_collective_works(thread_group);
    }

    /// A rank that counts the messages it sends.
    struct Counted {
        inner: ThreadRank,
        sent: std::cell::Cell<usize>,
    }

    impl Collective for Counted {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world_size(&self) -> usize {
            self.inner.world_size()
        }
        fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()> {
            self.sent.set(self.sent.get() + 1);
            self.inner.send(to, bytes)
        }
        fn recv(&self, from: usize) -> Result<Vec<u8>> {
            self.inner.recv(from)
        }
    }

    #[test]
    fn a_broadcast_reaches_every_rank_and_no_rank_sends_it_twice() {
        for world in 1..=5 {
            for root in 0..world {
                let out = run(thread_group(world), |inner| {
                    let c = Counted {
                        inner,
                        sent: 0.into(),
                    };
                    let got = c.broadcast(root, vec![c.rank() as u8; 3]).unwrap();
                    (got, c.sent.get())
                });
                for (got, sent) in &out {
                    assert_eq!(got, &vec![root as u8; 3], "world {world}, root {root}");
                    assert!(*sent <= 1, "world {world}, root {root}: a rank sent {sent}");
                }
                let sent: usize = out.iter().map(|(_, n)| n).sum();
                assert_eq!(sent, world - 1, "world {world}, root {root}");
            }
        }
    }

    #[test]
    fn messages_between_two_ranks_arrive_in_the_order_sent() {
        let out = run(thread_group(2), |c| match c.rank() {
            0 => (0..5u8)
                .map(|i| c.send(1, vec![i]))
                .collect::<Result<Vec<_>>>()
                .map(|_| vec![]),
            _ => (0..5).map(|_| c.recv(0).map(|b| b[0])).collect(),
        });
        assert_eq!(out[1].as_ref().unwrap(), &[0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_rank_that_stops_fails_its_peers_instead_of_hanging_them() {
        assert_a_stopped_rank_fails_its_peers(thread_group);
    }
}
