//! Where ranks in processes of their own meet: an address rank 0 listens at (`--meet
//! HOST:PORT`, for ranks on several machines), or a file on this machine (`--meet-file FILE`)
//! that rank 0 writes the address of a port the system gave it into and the other ranks read.
//! With a file nobody chooses a port: a port found free and handed on is a port another program
//! can take first, or worse, the ranks of another job started at the same moment.

use anyhow::{bail, Context, Result};
use ckpt_engine::parallel::sockets::{Meeting, JOIN_LIMIT};
use std::fs::OpenOptions;
use std::io::{ErrorKind, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The longest pause between looks for the meeting file.
const LOOK_AGAIN: Duration = Duration::from_millis(5);

/// Where the ranks of one run meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MeetAt {
    /// Rank 0 listens at this address; the others connect to it.
    Address(SocketAddr),
    /// Rank 0 listens at a port of the loopback the system gives it and writes its address into
    /// this file, which must not exist yet; the others wait for it and connect there.
    File(PathBuf),
}

impl MeetAt {
    /// How rank `rank` meets the others; a rank other than 0 waits at most
    /// [`JOIN_LIMIT`] for rank 0's file.
    pub fn meeting(&self, rank: usize) -> Result<Meeting> {
        self.meeting_within(rank, JOIN_LIMIT)
    }

    /// [`MeetAt::meeting`], a rank other than 0 waiting at most `limit` for rank 0's file.
    pub fn meeting_within(&self, rank: usize, limit: Duration) -> Result<Meeting> {
        match (self, rank) {
            (MeetAt::Address(at), 0) => TcpListener::bind(at).map(Meeting::Host).map_err(|e| {
                anyhow::anyhow!(
                    "--meet {at}: rank 0 cannot listen there for the other ranks ({e}); give an address of this machine with a free port"
                )
            }),
            (MeetAt::Address(at), _) => Ok(Meeting::At(*at)),
            (MeetAt::File(file), 0) => host(file),
            (MeetAt::File(file), _) => Ok(Meeting::At(wait_for(file, limit)?)),
        }
    }
}

/// Rank 0's listener at a port of the loopback the system chose, its address written into
/// `file` (created here, so never one left by an earlier meeting), ended by a newline: a reader
/// takes the address only once its newline is there. Neither synced nor renamed: the file is a
/// message to ranks running now, not a record.
fn host(file: &Path) -> Result<Meeting> {
    let mut out = match OpenOptions::new().write(true).create_new(true).open(file) {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => bail!(
            "--meet-file {}: exists already (left by an earlier meeting?); the other ranks would read it: remove it, or give a path that does not exist yet",
            file.display()
        ),
        opened => opened.with_context(|| format!("--meet-file {}: cannot create", file.display()))?,
    };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .context("rank 0 cannot open a port on 127.0.0.1 for the other ranks")?;
    let at = listener.local_addr()?;
    out.write_all(format!("{at}\n").as_bytes())
        .with_context(|| {
            format!(
                "--meet-file {}: rank 0 cannot write its address",
                file.display()
            )
        })?;
    Ok(Meeting::Host(listener))
}

/// The address rank 0 wrote into `file`, once its line is there whole; an error naming the
/// file after `limit`.
fn wait_for(file: &Path, limit: Duration) -> Result<SocketAddr> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(200);
    loop {
        match std::fs::read_to_string(file) {
            Ok(text) if text.ends_with('\n') => {
                return text.trim().parse().map_err(|e| {
                    anyhow::anyhow!(
                        "--meet-file {}: holds {text:?}, not the address rank 0 writes ({e}); remove it and start the ranks again",
                        file.display()
                    )
                })
            }
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("--meet-file {}: cannot read", file.display()))
            }
        }
        if start.elapsed() >= limit {
            bail!(
                "--meet-file {}: rank 0 wrote no address there within {} s; start rank 0 with the same --meet-file, on this machine",
                file.display(),
                limit.as_secs_f64()
            );
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(LOOK_AGAIN);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn the_ranks_meet_at_the_address_rank_0_writes_into_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let at = MeetAt::File(tmp.path().join("meet"));
        let waiting = {
            let at = at.clone();
            std::thread::spawn(move || at.meeting(1).unwrap())
        };
        std::thread::sleep(Duration::from_millis(20));
        let Meeting::Host(listener) = at.meeting(0).unwrap() else {
            panic!("rank 0 listens")
        };
        let Meeting::At(address) = waiting.join().unwrap() else {
            panic!("rank 1 connects")
        };
        assert_eq!(address, listener.local_addr().unwrap());
        let mut sent = std::net::TcpStream::connect(address).unwrap();
        sent.write_all(b"hello").unwrap();
        let mut got = [0; 5];
        listener.accept().unwrap().0.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hello");
    }

    #[test]
    fn rank_0_refuses_a_meeting_file_that_exists_and_the_others_name_a_missing_one() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("meet");
        std::fs::write(&file, "127.0.0.1:9").unwrap();
        let e = MeetAt::File(file.clone()).meeting(0).err().unwrap();
        assert!(
            format!("{e:#}").contains("exists already") && format!("{e:#}").contains("remove it"),
            "{e:#}"
        );
        let missing = MeetAt::File(tmp.path().join("never"));
        let started = Instant::now();
        let e = missing
            .meeting_within(2, Duration::from_millis(50))
            .err()
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        let e = format!("{e:#}");
        assert!(e.contains("never") && e.contains("wrote no address"), "{e}");
        std::fs::write(&file, "not an address\n").unwrap();
        let e = MeetAt::File(file.clone()).meeting(1).err().unwrap();
        assert!(format!("{e:#}").contains("not the address"), "{e:#}");
        // An address whose line is not whole yet is not taken.
        std::fs::write(&file, "127.0.0.1:4").unwrap();
        let writer = {
            let file = file.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                std::fs::write(&file, "127.0.0.1:4567\n").unwrap();
            })
        };
        let Meeting::At(at) = MeetAt::File(file).meeting(1).unwrap() else {
            panic!("rank 1 connects")
        };
        writer.join().unwrap();
        assert_eq!(at, "127.0.0.1:4567".parse().unwrap());
    }

    #[test]
    fn an_address_is_listened_at_by_rank_0_and_reached_by_the_others() {
        let taken = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let at = MeetAt::Address(taken.local_addr().unwrap());
        assert!(
            matches!(at.meeting(1).unwrap(), Meeting::At(a) if a == taken.local_addr().unwrap())
        );
        let e = at.meeting(0).err().unwrap();
        assert!(format!("{e}").contains("cannot listen there"), "{e}");
    }
}
