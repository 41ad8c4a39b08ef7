//! The sockets transport: ranks joined by TCP, one connection for each pair of ranks, each
//! message a frame (its length as 8 bytes little-endian, then its bytes). It is what ranks in
//! processes of their own, or on other machines, can pass their messages over, as gloo's full
//! mesh serves PyTorch's CPU process groups; CPU ranks in one process run on it over the
//! loopback (`parallel: {transport: sockets}`), with the bits of one rank at every stage.
//!
//! Ranks meet through rank 0 ([`join`]): rank 0 listens at an address every rank is given;
//! every other rank connects to it, says who it is (`Hello`: the world size it was started
//! with, its rank, and where it listens itself) and gets back where every rank listens. Then
//! each rank connects to every lower rank but 0 and accepts a connection from every higher one.
//! A rank started with another world size, a rank index given twice or out of range, and a
//! rank nobody meets within the limit are refused with an error naming both sides, never a hang.
//!
//! A socket's sends are buffered by the kernel, and each rank keeps a receive posted for every
//! peer ([`super::buffered`]), so a send returns once the peer's thread has its bytes. A rank
//! whose transport is dropped shuts its connections down: a peer waiting on it learns it
//! stopped ([`EngineError::PeerStopped`]) instead of waiting for ever.

use super::buffered::{buffered, BufferedRank, Inbox, Outbox};
use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

/// How long a rank waits for the others to meet it before it gives up.
pub const JOIN_LIMIT: Duration = Duration::from_secs(60);

/// What a rank says first on every connection it opens.
const MAGIC: &str = "ckpt-harness ranks";

/// The version of the frames and of the meeting; ranks of other versions are refused.
const VERSION: u32 = 1;

/// The largest meeting message taken: a hello or the table of addresses.
const MEETING_FRAME: u64 = 1 << 20;

/// The most bytes set aside for a message before they arrive.
const RESERVED_UP_FRONT: u64 = 256 << 20;

/// Pause between tries to reach rank 0 before it listens, and the longest between looks for a
/// rank's connection.
const RETRY: Duration = Duration::from_millis(20);

/// How long one try to connect waits for an answer.
const CONNECT: Duration = Duration::from_secs(1);

/// The first pause between looks for a rank's connection, doubled at each look up to [`RETRY`]:
/// ranks in one process connect within microseconds.
const FIRST_PAUSE: Duration = Duration::from_micros(50);

/// How long a rank has left to meet the others: the moment it gives up, and the limit it was
/// given (for its messages).
#[derive(Clone, Copy)]
struct Wait {
    until: Instant,
    limit: Duration,
}

impl Wait {
    fn seconds(&self) -> f64 {
        self.limit.as_secs_f64()
    }
}

/// Where a rank meets the others.
pub enum Meeting {
    /// Rank 0: the listener the other ranks reach it at.
    Host(TcpListener),
    /// Any other rank: the address rank 0 listens at.
    At(SocketAddr),
}

impl Meeting {
    /// The same meeting place once more, for a second set of connections: rank 0's listener
    /// shared, or the same address.
    pub fn again(&self) -> std::io::Result<Meeting> {
        Ok(match self {
            Meeting::Host(listener) => Meeting::Host(listener.try_clone()?),
            Meeting::At(at) => Meeting::At(*at),
        })
    }
}

/// What a rank says when it opens a connection: who it is, and (to rank 0) where it listens.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    magic: String,
    version: u32,
    world_size: usize,
    rank: usize,
    listening: Option<SocketAddr>,
}

/// Rank `rank` of `world` ranks, connected to every other rank through `meeting`, each peer's
/// messages taken by a thread of its own. Every rank must be started with the same `world`;
/// a rank that does not meet all the others within `limit` gives up with an error.
pub fn join(rank: usize, world: usize, meeting: Meeting, limit: Duration) -> Result<BufferedRank> {
    let refuse = |message: String| EngineError::Join { rank, message };
    if rank >= world {
        return Err(refuse(format!(
            "there are {world} ranks, numbered from 0; start this rank with a rank below {world}"
        )));
    }
    let wait = Wait {
        until: Instant::now() + limit,
        limit,
    };
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    match meeting {
        Meeting::Host(listener) if rank == 0 => host(&listener, world, wait, &mut peers)?,
        Meeting::At(at) if rank > 0 => {
            let first = connect(at, wait).map_err(|e| {
                refuse(format!(
                    "rank 0 is not listening at {at} ({e}, after {} s); start rank 0 with that address, and every rank within that time",
                    wait.seconds()
                ))
            })?;
            let ip = first.local_addr().map_err(|e| refuse(e.to_string()))?.ip();
            let listener = TcpListener::bind((ip, 0)).map_err(|e| refuse(e.to_string()))?;
            let listening = listener.local_addr().map_err(|e| refuse(e.to_string()))?;
            let table = meet_host(&first, (rank, world), listening, wait)?;
            peers[0] = Some(first);
            for (lower, at) in table.iter().enumerate().take(rank).skip(1) {
                let stream = connect(*at, wait)
                    .map_err(|e| refuse(format!("rank {lower} is not listening at {at}: {e}")))?;
                say_hello(&stream, (rank, world), None).map_err(|e| refuse(e.to_string()))?;
                peers[lower] = Some(stream);
            }
            accept_from(&listener, (rank, world), rank + 1..world, wait, &mut peers)?;
        }
        Meeting::Host(_) => {
            return Err(refuse(
                "only rank 0 listens for the others; give this rank rank 0's address".into(),
            ))
        }
        Meeting::At(_) => {
            return Err(refuse(
                "rank 0 listens for the others; give it a listener, not an address".into(),
            ))
        }
    }
    let mut inboxes: Vec<Option<Box<dyn Inbox>>> = Vec::with_capacity(world);
    for (peer, stream) in peers.iter().enumerate() {
        let Some(stream) = stream else {
            inboxes.push(None);
            continue;
        };
        let reading = stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(None))
            .and_then(|()| stream.try_clone())
            .map_err(|e| refuse(format!("the connection to rank {peer}: {e}")))?;
        inboxes.push(Some(Box::new(Receives {
            rank,
            peer,
            stream: reading,
        })));
    }
    buffered(rank, Box::new(Sends { rank, peers }), inboxes)
}

/// A group of `world` ranks in this process over the loopback, one per rank in rank order,
/// each to be moved to the thread that runs it.
pub fn group(world: usize) -> Result<Vec<BufferedRank>> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(|e| EngineError::Join {
        rank: 0,
        message: format!("cannot listen on the loopback: {e}"),
    })?;
    let at = listener.local_addr().map_err(|e| EngineError::Join {
        rank: 0,
        message: e.to_string(),
    })?;
    let mut meetings = vec![Meeting::Host(listener)];
    meetings.extend((1..world).map(|_| Meeting::At(at)));
    let joined: Vec<Result<BufferedRank>> = std::thread::scope(|s| {
        let handles: Vec<_> = meetings
            .into_iter()
            .enumerate()
            .map(|(rank, meeting)| s.spawn(move || join(rank, world, meeting, JOIN_LIMIT)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(EngineError::Config(
                        "a joining rank's thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    joined.into_iter().collect()
}

/// Rank 0's side of the meeting: takes a hello from every other rank on `listener`, then tells
/// each where every rank listens (rank 0 at `listener`'s own address).
fn host(
    listener: &TcpListener,
    world: usize,
    wait: Wait,
    peers: &mut [Option<TcpStream>],
) -> Result<()> {
    let refuse = |message: String| EngineError::Join { rank: 0, message };
    let own = listener.local_addr().map_err(|e| refuse(e.to_string()))?;
    let listening = accept_from(listener, (0, world), 1..world, wait, peers)?;
    let mut table = vec![own; world];
    for (rank, at) in listening {
        table[rank] = at;
    }
    let table = serde_json::to_vec(&table).map_err(|e| refuse(e.to_string()))?;
    for (peer, stream) in peers.iter().enumerate().skip(1) {
        if let Some(stream) = stream {
            write_frame(stream, &table)
                .map_err(|e| refuse(format!("cannot answer rank {peer}: {e}")))?;
        }
    }
    Ok(())
}

/// Rank `rank`'s side of the meeting with rank 0 over `stream`: says who it is and where it
/// listens, and gets back where every rank listens.
fn meet_host(
    stream: &TcpStream,
    (rank, world): (usize, usize),
    listening: SocketAddr,
    wait: Wait,
) -> Result<Vec<SocketAddr>> {
    let refuse = |message: String| EngineError::Join { rank, message };
    say_hello(stream, (rank, world), Some(listening)).map_err(|e| refuse(e.to_string()))?;
    let answer = read_meeting_frame(stream, wait).map_err(|e| {
        refuse(format!(
            "rank 0 did not say where the ranks listen ({e}); start every rank within {} s of the others, with the same world size",
            wait.seconds()
        ))
    })?;
    let table: Vec<SocketAddr> = serde_json::from_slice(&answer)
        .map_err(|e| refuse(format!("rank 0's table of addresses is unreadable: {e}")))?;
    if table.len() != world {
        return Err(refuse(format!(
            "rank 0 lists {} ranks, this rank was started with a world size of {world}",
            table.len()
        )));
    }
    Ok(table)
}

/// Accepts a connection from each rank of `from` on `listener`, each placed at its rank in
/// `peers` once its hello checks out; returns where each of them listens, if it said.
fn accept_from(
    listener: &TcpListener,
    (rank, world): (usize, usize),
    from: std::ops::Range<usize>,
    wait: Wait,
    peers: &mut [Option<TcpStream>],
) -> Result<Vec<(usize, SocketAddr)>> {
    let refuse = |message: String| EngineError::Join { rank, message };
    let mut listening = Vec::new();
    listener
        .set_nonblocking(true)
        .map_err(|e| refuse(e.to_string()))?;
    let mut missing = from.len();
    let mut pause = FIRST_PAUSE;
    while missing > 0 {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < wait.until => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(RETRY);
                continue;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let waiting: Vec<String> = from
                    .clone()
                    .filter(|&r| peers[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                return Err(refuse(format!(
                    "ranks {} did not join within {} s; start all {world} ranks with the same address and world size",
                    waiting.join(", "),
                    wait.seconds()
                )));
            }
            Err(e) => return Err(refuse(e.to_string())),
        };
        stream
            .set_nonblocking(false)
            .map_err(|e| refuse(e.to_string()))?;
        let hello = read_meeting_frame(&stream, wait)
            .map_err(|e| refuse(format!("a rank connected but did not say who it is: {e}")))?;
        let hello: Hello = serde_json::from_slice(&hello)
            .ok()
            .filter(|h: &Hello| h.magic == MAGIC)
            .ok_or_else(|| {
                refuse(
                    "something that is not a rank connected; give the ranks an address nothing else uses"
                        .into(),
                )
            })?;
        if hello.version != VERSION {
            return Err(refuse(format!(
                "rank {} speaks version {} of the ranks' messages, this rank {VERSION}; run one build on every rank",
                hello.rank, hello.version
            )));
        }
        if hello.world_size != world {
            return Err(refuse(format!(
                "rank {} was started with a world size of {}, this rank with {world}; start every rank with the same world size",
                hello.rank, hello.world_size
            )));
        }
        if !from.contains(&hello.rank) || peers[hello.rank].is_some() {
            return Err(refuse(format!(
                "two ranks, or a rank out of range, say they are rank {} (of {world}); give each rank its own index from 0",
                hello.rank
            )));
        }
        if let Some(at) = hello.listening {
            listening.push((hello.rank, at));
        }
        peers[hello.rank] = Some(stream);
        missing -= 1;
    }
    Ok(listening)
}

/// A connection to `at`, tried again while nothing listens there yet, until `wait` runs out.
fn connect(at: SocketAddr, wait: Wait) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&at, CONNECT) {
            Ok(stream) => return Ok(stream),
            Err(e) if Instant::now() >= wait.until => return Err(e),
            Err(_) => std::thread::sleep(RETRY),
        }
    }
}

/// Says who this rank is on `stream`.
fn say_hello(
    stream: &TcpStream,
    (rank, world_size): (usize, usize),
    listening: Option<SocketAddr>,
) -> std::io::Result<()> {
    let hello = Hello {
        magic: MAGIC.into(),
        version: VERSION,
        world_size,
        rank,
        listening,
    };
    write_frame(stream, &serde_json::to_vec(&hello)?)
}

/// One frame of the meeting from `stream`, waiting at most until `wait` runs out.
fn read_meeting_frame(stream: &TcpStream, wait: Wait) -> std::io::Result<Vec<u8>> {
    let left = wait.until.saturating_duration_since(Instant::now());
    stream.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
    read_frame(stream, MEETING_FRAME)?.ok_or_else(|| ErrorKind::UnexpectedEof.into())
}

/// The next frame from `stream`, of at most `most` bytes; `None` where the stream ends before a
/// frame begins, or is reset anywhere: a reset peer has gone (it closed with bytes of ours
/// unread, or its process ended), and the kernel may have dropped bytes it had sent, so a frame
/// the reset cuts short is its stopping too. A frame that ends short otherwise, or is longer
/// than `most`, is an error saying so.
fn read_frame(stream: &TcpStream, most: u64) -> std::io::Result<Option<Vec<u8>>> {
    let broken = |kind, message: String| std::io::Error::new(kind, message);
    let mut len = [0; 8];
    match read_full(stream, &mut len)? {
        0 => return Ok(None),
        8 => {}
        n => {
            let message = format!("its message's length ended after {n} of 8 bytes");
            return Err(broken(ErrorKind::UnexpectedEof, message));
        }
    }
    let len = u64::from_le_bytes(len);
    if len > most {
        let message = format!("a message of {len} bytes, where at most {most} are taken");
        return Err(broken(ErrorKind::InvalidData, message));
    }
    // Room for the whole message up front, up to a bound: a length no peer would send (a
    // broken one) allocates only as its bytes come.
    let mut bytes = Vec::with_capacity(len.min(RESERVED_UP_FRONT) as usize);
    let n = match Read::take(stream, len).read_to_end(&mut bytes) {
        Ok(n) => n,
        Err(e) if e.kind() == ErrorKind::ConnectionReset => return Ok(None),
        Err(e) => return Err(e),
    };
    if n as u64 != len {
        let message = format!("its message ended after {n} of {len} bytes");
        return Err(broken(ErrorKind::UnexpectedEof, message));
    }
    Ok(Some(bytes))
}

/// Writes `bytes` to `stream` as one frame: its length, then the bytes, in one system call
/// where the socket takes them all.
fn write_frame(mut stream: &TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let len = (bytes.len() as u64).to_le_bytes();
    let mut slices = [IoSlice::new(&len), IoSlice::new(bytes)];
    let mut left = &mut slices[..];
    while !left.is_empty() {
        match stream.write_vectored(left) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut left, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A rank's sending ends: the connection to each peer, in rank order (none to itself).
struct Sends {
    rank: usize,
    peers: Vec<Option<TcpStream>>,
}

impl Outbox for Sends {
    fn send(&self, to: usize, bytes: Vec<u8>) -> Result<()> {
        let stopped = EngineError::PeerStopped {
            rank: self.rank,
            peer: to,
        };
        match self.peers.get(to).and_then(Option::as_ref) {
            Some(stream) => write_frame(stream, &bytes).map_err(|_| stopped),
            None => Err(stopped),
        }
    }
}

impl Drop for Sends {
    /// Shuts every connection down: each peer reads the end of this rank's messages after the
    /// last one sent, and this rank's own receiving threads stop.
    fn drop(&mut self) {
        for stream in self.peers.iter().flatten() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// A rank's receiving end for one peer: the connection to it.
struct Receives {
    rank: usize,
    peer: usize,
    stream: TcpStream,
}

impl Inbox for Receives {
    fn recv(&mut self) -> Result<Option<Vec<u8>>> {
        read_frame(&self.stream, u64::MAX).map_err(|e| EngineError::Link {
            rank: self.rank,
            peer: self.peer,
            message: e.to_string(),
        })
    }
}

/// Reads into `buf` until it is full or the stream ends; the bytes read. A connection reset
/// counts as its end.
fn read_full(mut stream: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match stream.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => break,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::super::collective::Collective;
    use super::super::conformance::{
        assert_a_stopped_rank_fails_its_peers, assert_every_collective_works, run,
    };
    use super::*;

    #[test]
    fn ranks_over_sockets_move_each_rank_s_bytes_where_they_belong() {
        assert_every_collective_works(|world| group(world).unwrap());
    }

    #[test]
    fn a_rank_that_stops_fails_its_peers_instead_of_hanging_them() {
        assert_a_stopped_rank_fails_its_peers(|world| group(world).unwrap());
    }

    #[test]
    fn messages_larger_than_the_sockets_buffers_arrive_whole_both_ways_at_once() {
        let message = |rank: usize| -> Vec<u8> {
            (0..24usize << 20)
                .map(|i| (i % 251) as u8 ^ rank as u8)
                .collect()
        };
        let out = run(group(2).unwrap(), |c| {
            c.send(1 - c.rank(), message(c.rank()))?;
            c.recv(1 - c.rank())
        });
        for (rank, got) in out.into_iter().enumerate() {
            assert!(got.unwrap() == message(1 - rank), "rank {rank}");
        }
    }

    /// A listener on the loopback and its address.
    fn listening() -> (TcpListener, SocketAddr) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let at = listener.local_addr().unwrap();
        (listener, at)
    }

    /// What each of the ranks `(rank, world)` gets joining through one rank 0, waiting at most
    /// two seconds.
    fn join_all(ranks: &[(usize, usize)]) -> Vec<Result<BufferedRank>> {
        let (listener, at) = listening();
        let mut host = Some(listener);
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .iter()
                .map(|&(rank, world)| {
                    let meeting = match rank {
                        0 => Meeting::Host(host.take().unwrap()),
                        _ => Meeting::At(at),
                    };
                    s.spawn(move || join(rank, world, meeting, Duration::from_secs(2)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// The message of a join's error.
    fn refusal(joined: &Result<BufferedRank>) -> String {
        match joined {
            Err(e @ EngineError::Join { .. }) => e.to_string(),
            Err(e) => panic!("not a join error: {e}"),
            Ok(_) => panic!("joined"),
        }
    }

    #[test]
    fn a_rank_started_with_another_world_size_is_refused_naming_both() {
        let out = join_all(&[(0, 2), (1, 3)]);
        let host = refusal(&out[0]);
        assert!(
            host.starts_with("rank 0 could not join the other ranks: rank 1 was started with a world size of 3, this rank with 2; start every rank with the same world size"),
            "{host}"
        );
        assert!(refusal(&out[1]).contains("rank 0 did not say where the ranks listen"));
    }

    #[test]
    fn two_ranks_with_one_index_are_refused() {
        let out = join_all(&[(0, 3), (1, 3), (1, 3)]);
        let host = refusal(&out[0]);
        assert!(
            host.contains("two ranks, or a rank out of range, say they are rank 1 (of 3)"),
            "{host}"
        );
    }

    #[test]
    fn a_rank_index_past_the_world_size_is_refused_before_any_connection() {
        let (_, at) = listening();
        let e = join(3, 3, Meeting::At(at), Duration::from_secs(2))
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "rank 3 could not join the other ranks: there are 3 ranks, numbered from 0; start this rank with a rank below 3"
        );
    }

    #[test]
    fn ranks_nobody_meets_give_up_within_their_limit_naming_who_is_missing() {
        let (listener, at) = listening();
        drop(listener);
        let limit = Duration::from_millis(300);
        let started = Instant::now();
        let alone = join(1, 2, Meeting::At(at), limit)
            .err()
            .unwrap()
            .to_string();
        assert!(
            alone.contains(&format!("rank 0 is not listening at {at}")),
            "{alone}"
        );
        let (listener, _) = listening();
        let host = join(0, 3, Meeting::Host(listener), limit)
            .err()
            .unwrap()
            .to_string();
        assert!(
            host.contains("ranks 1, 2 did not join within 0.3 s; start all 3 ranks with the same address and world size"),
            "{host}"
        );
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn something_that_is_not_a_rank_is_refused() {
        let (listener, at) = listening();
        let stray = std::thread::spawn(move || {
            let stream = TcpStream::connect(at).unwrap();
            write_frame(&stream, b"GET / HTTP/1.1").unwrap();
            stream
        });
        let e = join(0, 2, Meeting::Host(listener), Duration::from_secs(2))
            .err()
            .unwrap();
        drop(stray.join());
        assert!(
            e.to_string()
                .contains("something that is not a rank connected"),
            "{e}"
        );
    }

    /// Rank 0's receiving end for rank 1, and the connection rank 1 writes to it on.
    fn inbox_from_rank_one() -> (Receives, TcpStream) {
        let (listener, at) = listening();
        let sender = TcpStream::connect(at).unwrap();
        let (stream, _) = listener.accept().unwrap();
        let inbox = Receives {
            rank: 0,
            peer: 1,
            stream,
        };
        (inbox, sender)
    }

    #[test]
    fn a_message_cut_short_is_an_error_naming_both_ranks() {
        let (mut inbox, sender) = inbox_from_rank_one();
        let mut writing = &sender;
        writing.write_all(&100u64.to_le_bytes()).unwrap();
        writing.write_all(&[7; 10]).unwrap();
        sender.shutdown(Shutdown::Write).unwrap();
        let e = inbox.recv().unwrap_err();
        assert_eq!(
            e.to_string(),
            "rank 0: the connection to rank 1 broke: its message ended after 10 of 100 bytes"
        );
    }

    #[test]
    fn a_frame_longer_than_its_reader_takes_is_refused_before_its_bytes_are_held() {
        let (inbox, sender) = inbox_from_rank_one();
        write_frame(&sender, &[0; 64]).unwrap();
        let e = read_frame(&inbox.stream, 63).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidData);
        assert_eq!(
            e.to_string(),
            "a message of 64 bytes, where at most 63 are taken"
        );
    }

    #[test]
    fn a_peer_that_closes_between_messages_has_simply_stopped() {
        let (mut inbox, sender) = inbox_from_rank_one();
        write_frame(&sender, &[1, 2, 3]).unwrap();
        sender.shutdown(Shutdown::Write).unwrap();
        assert_eq!(inbox.recv().unwrap(), Some(vec![1, 2, 3]));
        assert_eq!(inbox.recv().unwrap(), None);
    }
}
