//! What every transport's group of ranks must do, for each transport's tests to assert: the
//! collective's operations move each rank's bytes where they belong, ranks may send before they
//! receive, and a rank that stops fails its peers instead of hanging them.

use super::collective::Collective;
use crate::error::{EngineError, Result};

/// Runs `f` on each rank of `group`, a thread each, and returns what each gave, in rank order.
pub fn run<C: Collective, R: Send>(group: Vec<C>, f: impl Fn(C) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = group.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two ranks that each send twice before they receive: the ring's order on two ranks.
pub fn sends_before_receives(c: &dyn Collective) -> Result<Vec<u8>> {
    let peer = 1 - c.rank();
    c.send(peer, vec![c.rank() as u8, 0])?;
    c.send(peer, vec![c.rank() as u8, 1])?;
    let first = c.recv(peer)?;
    let second = c.recv(peer)?;
    Ok([first, second].concat())
}

/// Asserts that the groups `group` makes let two ranks send before they receive, and that at
/// world sizes 1 to 4 a gather, a broadcast, a count and a barrier give every rank what they
/// should.
pub fn assert_every_collective_works<C: Collective>(group: impl Fn(usize) -> Vec<C>) {
    let out = run(group(2), |c| sends_before_receives(&c));
    assert_eq!(out[0].as_ref().unwrap(), &[1, 0, 1, 1]);
    assert_eq!(out[1].as_ref().unwrap(), &[0, 0, 0, 1]);
    for world in 1..=4 {
        let out = run(group(world), |c| {
            let r = c.rank() as u8;
            let gathered = c.all_gather(vec![r; r as usize + 1])?;
            let root = c.broadcast(world - 1, vec![r, 7])?;
            let sum = c.sum_u64(10 + c.rank() as u64)?;
            c.barrier()?;
            Ok::<_, EngineError>((gathered, root, sum))
        });
        for result in out {
            let (gathered, root, sum) = result.unwrap();
            let want: Vec<Vec<u8>> = (0..world as u8).map(|r| vec![r; r as usize + 1]).collect();
            assert_eq!(gathered, want);
            assert_eq!(root, vec![world as u8 - 1, 7]);
            assert_eq!(sum, (0..world as u64).map(|r| 10 + r).sum::<u64>());
        }
    }
}

/// Asserts that in a group of three from `group`, when rank 1 stops with an error, ranks 0
/// and 2, gathering large messages from every rank, get [`EngineError::PeerStopped`] instead
/// of waiting for ever, and rank 1 its own error. The stopped peer a rank names can be rank 1
/// or a rank that stopped because of it, whichever it was waiting on: where sends wait for
/// their peer, rank 0 stops at its send to rank 1, before rank 2 has its message.
pub fn assert_a_stopped_rank_fails_its_peers<C: Collective>(group: impl Fn(usize) -> Vec<C>) {
    let out = run(group(3), |c| match c.rank() {
        1 => Err(EngineError::Config("rank 1 broke".into())),
        _ => c.all_gather(vec![1; 1 << 16]).map(drop),
    });
    for waiting in [0, 2] {
        assert!(
            matches!(out[waiting], Err(EngineError::PeerStopped { peer, .. }) if peer != waiting),
            "{:?}",
            out[waiting]
        );
    }
    assert!(
        matches!(out[1], Err(EngineError::Config(_))),
        "{:?}",
        out[1]
    );
}
