//! A recording as the snapshot `torch.cuda.memory._dump_snapshot` writes: a pickled dict of
//! `segments` (the allocator's state at the end) and `device_traces` (every `alloc`,
//! `free_requested`/`free_completed` pair and `oom`, with its size, category, and frames naming
//! the engine's functions that made it, innermost first, then the marker). Each marker (a step
//! beginning) is a `snapshot` entry. PyTorch's memory_viz page and `_memory_viz` read it as they
//! read their own.
//!
//! The engine's tracker counts bytes, not addresses: addresses are given first-fit in one
//! segment, each allocation rounded up to 512 bytes as PyTorch's allocator rounds, while every
//! size is the engine's own. Bytes held before the recording began are blocks of their
//! category, with the frame `held before the phase began`.

use super::recorder::{Entry, What};
use anyhow::{Context, Result};
use ckpt_engine::memory::{AllocationEvent, Breakdown, Category};
use serde::ser::{SerializeSeq, Serializer};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// Where the one segment starts.
const BASE: u64 = 0x7f00_0000_0000;
/// The granule of addresses.
const ALIGN: u64 = 512;
/// The most frames of the engine kept per entry.
const MAX_FRAMES: usize = 24;
/// The category of entries that are not allocations (markers): memory_viz colours by category
/// and expects this one among them.
const UNKNOWN: &str = "unknown";

/// One frame, as PyTorch writes them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Frame {
    /// Source file, relative to the workspace.
    pub filename: String,
    /// Line.
    pub line: u32,
    /// Function.
    pub name: String,
}

/// The frames of one entry: the engine's, then the marker's (none for a free block).
struct Frames<'a> {
    code: &'a [Frame],
    marker: Option<&'a Frame>,
}

impl Serialize for Frames<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut seq =
            s.serialize_seq(Some(self.code.len() + usize::from(self.marker.is_some())))?;
        for f in self.code.iter().chain(self.marker) {
            seq.serialize_element(f)?;
        }
        seq.end()
    }
}

/// One entry of `device_traces`.
#[derive(Serialize)]
struct TraceEntry<'a> {
    action: &'static str,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: u64,
    category: &'static str,
    frames: Frames<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<u64>,
}

/// One block of a segment.
#[derive(Serialize)]
struct Block<'a> {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    frames: Frames<'a>,
}

/// The one segment.
#[derive(Serialize)]
struct Segment<'a> {
    device: u64,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: u64,
    segment_type: &'static str,
    is_expandable: bool,
    frames: Vec<Frame>,
    blocks: Vec<Block<'a>>,
}

/// The pickled dict.
#[derive(Serialize)]
struct Snapshot<'a> {
    segments: Vec<Segment<'a>>,
    device_traces: Vec<Vec<TraceEntry<'a>>>,
}

/// Addresses given first-fit in one growing segment.
#[derive(Default)]
struct AddressSpace {
    /// Free ranges: start → length.
    free: BTreeMap<u64, u64>,
    /// The segment's size so far.
    top: u64,
}

/// `bytes` rounded up to the granule (an empty allocation still takes one).
fn rounded(bytes: u64) -> u64 {
    bytes.div_ceil(ALIGN).max(1) * ALIGN
}

impl AddressSpace {
    fn take(&mut self, bytes: u64) -> u64 {
        let need = rounded(bytes);
        let fit = self
            .free
            .iter()
            .find(|(_, &len)| len >= need)
            .map(|(&start, &len)| (start, len));
        match fit {
            Some((start, len)) => {
                self.free.remove(&start);
                if len > need {
                    self.free.insert(start + need, len - need);
                }
                BASE + start
            }
            None => {
                self.top += need;
                BASE + self.top - need
            }
        }
    }

    fn give(&mut self, addr: u64, bytes: u64) {
        let mut start = addr - BASE;
        let mut len = rounded(bytes);
        if let Some((&prev, &plen)) = self.free.range(..start).next_back() {
            if prev + plen == start {
                self.free.remove(&prev);
                start = prev;
                len += plen;
            }
        }
        if let Some(&next_len) = self.free.get(&(start + len)) {
            self.free.remove(&(start + len));
            len += next_len;
        }
        self.free.insert(start, len);
    }
}

/// `path` relative to the workspace for project files; the file name otherwise.
fn relative(path: &Path) -> String {
    let text = path.to_string_lossy().replace('\\', "/");
    for root in ["engine/", "harness/"] {
        if let Some(i) = text.rfind(&format!("/{root}")) {
            return text[i + 1..].to_string();
        }
        if text.starts_with(root) {
            return text;
        }
    }
    path.file_name()
        .map_or(text.clone(), |n| n.to_string_lossy().into_owned())
}

/// Whether a frame belongs to the project and is not the trace's own plumbing: the engine's
/// tracker, or this folder (wherever it is moved: the folder of this file).
fn kept(frame: &Frame) -> bool {
    let plumbing = Path::new(file!()).parent().unwrap_or(Path::new(file!()));
    let project = frame.filename.starts_with("engine/src/")
        || frame.filename.starts_with("harness/src/")
        || frame.filename.starts_with("harness/tests/");
    project
        && !frame.filename.starts_with("engine/src/memory.rs")
        && !Path::new(&frame.filename).starts_with(plumbing)
}

/// Resolves return addresses to frames, each address once.
#[derive(Default)]
struct Symbols {
    by_ip: HashMap<usize, Vec<Frame>>,
}

impl Symbols {
    /// The project's frames of `stack`, innermost first, up to the harness's first (the phase
    /// that called the engine), at most [`MAX_FRAMES`].
    fn frames(&mut self, stack: &[usize]) -> Vec<Frame> {
        let mut out: Vec<Frame> = Vec::new();
        for &ip in stack {
            if out
                .last()
                .is_some_and(|f| f.filename.starts_with("harness/"))
            {
                break;
            }
            let resolved = self.by_ip.entry(ip).or_insert_with(|| {
                let mut frames = Vec::new();
                backtrace::resolve(ip as *mut std::ffi::c_void, |sym| {
                    let frame = Frame {
                        filename: sym.filename().map(relative).unwrap_or_default(),
                        line: sym.lineno().unwrap_or(0),
                        name: sym.name().map(|n| format!("{n:#}")).unwrap_or_default(),
                    };
                    if kept(&frame) {
                        frames.push(frame);
                    }
                });
                frames
            });
            out.extend(resolved.iter().cloned());
            if out.len() >= MAX_FRAMES {
                out.truncate(MAX_FRAMES);
                break;
            }
        }
        out
    }
}

/// The frame naming a marker.
pub fn marker_frame(label: &str, line: u64) -> Frame {
    Frame {
        filename: "step".into(),
        line: line.min(u32::MAX.into()) as u32,
        name: label.into(),
    }
}

/// Writes the snapshot of `entries` to `file`: `markers` names the markers the entries point
/// at (each a frame), `before` is what the device held when the recording began.
pub fn write(file: &Path, entries: &[Entry], markers: &[Frame], before: &Breakdown) -> Result<()> {
    let held_before = marker_frame("held before the phase began", 0);
    let no_frames: Vec<Frame> = Vec::new();
    let mut symbols = Symbols::default();
    let mut stacks: HashMap<&[usize], usize> = HashMap::new();
    let mut frames: Vec<Vec<Frame>> = Vec::new();
    let mut stack_of = Vec::with_capacity(entries.len());
    for e in entries {
        let next = frames.len();
        let id = *stacks.entry(&e.stack).or_insert(next);
        if id == next {
            frames.push(symbols.frames(&e.stack));
        }
        stack_of.push(id);
    }

    // Leases freed in the recording but allocated before it: placed first, as held at the start.
    let allocated: std::collections::HashSet<u64> = entries
        .iter()
        .filter_map(|e| match e.what {
            What::Memory(AllocationEvent::Alloc { id, .. }) => Some(id),
            _ => None,
        })
        .collect();
    let mut space = AddressSpace::default();
    let mut live: BTreeMap<u64, (u64, u64, Category, usize, usize)> = BTreeMap::new();
    let mut before_left = *before;
    let mut early: HashMap<u64, u64> = HashMap::new();
    for e in entries {
        if let What::Memory(AllocationEvent::Free {
            id,
            bytes,
            category,
        }) = e.what
        {
            if !allocated.contains(&id) {
                early.insert(id, space.take(bytes));
                let left = before_left.get(category).saturating_sub(bytes);
                before_left = set(before_left, category, left);
            }
        }
    }
    // What was held before and never freed: one block per category, at the start.
    let mut kept_before = Vec::new();
    for c in Category::ALL {
        let bytes = before_left.get(c);
        if bytes > 0 {
            kept_before.push((space.take(bytes), bytes, c));
        }
    }

    let marker = |i: usize| markers.get(i).unwrap_or(&held_before);
    let mut trace = Vec::with_capacity(entries.len() * 2);
    for (e, &stack) in entries.iter().zip(&stack_of) {
        let at = |action, addr, size, category: &'static str| TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us: e.micros,
            category,
            frames: Frames {
                code: &frames[stack],
                marker: Some(marker(e.marker)),
            },
            device_free: None,
        };
        match e.what {
            What::Mark => trace.push(at("snapshot", 0, 0, UNKNOWN)),
            What::Memory(AllocationEvent::Alloc {
                id,
                bytes,
                category,
            }) => {
                let addr = space.take(bytes);
                live.insert(id, (addr, bytes, category, stack, e.marker));
                trace.push(at("alloc", addr, bytes, category.name()));
            }
            What::Memory(AllocationEvent::Free {
                id,
                bytes,
                category,
            }) => {
                let addr = match live.remove(&id) {
                    Some((addr, ..)) => addr,
                    None => early.get(&id).copied().unwrap_or(BASE),
                };
                space.give(addr, bytes);
                trace.push(at("free_requested", addr, bytes, category.name()));
                trace.push(at("free_completed", addr, bytes, category.name()));
            }
            What::Memory(AllocationEvent::Refused {
                bytes,
                category,
                allocated,
                capacity,
            }) => trace.push(TraceEntry {
                device_free: Some(capacity.saturating_sub(allocated)),
                ..at("oom", 0, bytes, category.name())
            }),
        }
    }

    // The segment at the end: live blocks and the gaps between them, covering it exactly.
    let mut blocks: Vec<(u64, u64, &'static str, Frames<'_>)> = Vec::new();
    for &(addr, bytes, _) in &kept_before {
        let frames = Frames {
            code: &no_frames,
            marker: Some(&held_before),
        };
        blocks.push((addr, bytes, "active_allocated", frames));
    }
    for &(addr, bytes, _, stack, m) in live.values() {
        let frames = Frames {
            code: &frames[stack],
            marker: Some(marker(m)),
        };
        blocks.push((addr, bytes, "active_allocated", frames));
    }
    blocks.sort_by_key(|b| b.0);
    let mut seg_blocks = Vec::new();
    let mut at = BASE;
    let mut held = 0;
    for (addr, bytes, state, frames) in blocks {
        if addr > at {
            seg_blocks.push(inactive(at, addr - at));
        }
        held += bytes;
        seg_blocks.push(Block {
            address: addr,
            size: rounded(bytes),
            requested_size: bytes,
            state,
            frames,
        });
        at = addr + rounded(bytes);
    }
    if BASE + space.top > at {
        seg_blocks.push(inactive(at, BASE + space.top - at));
    }
    let segments = if space.top == 0 {
        Vec::new()
    } else {
        vec![Segment {
            device: 0,
            address: BASE,
            total_size: space.top,
            allocated_size: held,
            active_size: held,
            requested_size: held,
            stream: 0,
            segment_type: "large",
            is_expandable: false,
            frames: Vec::new(),
            blocks: seg_blocks,
        }]
    };
    let snapshot = Snapshot {
        segments,
        device_traces: vec![trace],
    };
    crate::atomic_file::write_with(file, |mut out| {
        serde_pickle::to_writer(&mut out, &snapshot, serde_pickle::SerOptions::new())
            .context("cannot write the memory snapshot")
    })
}

/// A free block.
fn inactive<'a>(address: u64, size: u64) -> Block<'a> {
    Block {
        address,
        size,
        requested_size: 0,
        state: "inactive",
        frames: Frames {
            code: &[],
            marker: None,
        },
    }
}

/// `b` with `category` set to `bytes`.
fn set(b: Breakdown, category: Category, bytes: u64) -> Breakdown {
    let mut parts = Category::ALL.map(|c| b.get(c));
    parts[Category::ALL
        .iter()
        .position(|&c| c == category)
        .unwrap_or(0)] = bytes;
    Breakdown::from(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_first_fit_and_freed_ranges_merge() {
        let mut s = AddressSpace::default();
        let a = s.take(100);
        let b = s.take(1000);
        let c = s.take(0);
        assert_eq!((a, b, c), (BASE, BASE + 512, BASE + 1536));
        s.give(a, 100);
        s.give(b, 1000);
        assert_eq!(s.free, BTreeMap::from([(0, 1536)]));
        assert_eq!(s.take(1536), BASE);
        assert_eq!(s.top, 2048);
    }

    #[test]
    fn project_files_are_named_from_the_workspace() {
        assert_eq!(
            relative(Path::new("/x/y/engine/src/model/block.rs")),
            "engine/src/model/block.rs"
        );
        assert_eq!(
            relative(Path::new("harness/src/run/phases/mod.rs")),
            "harness/src/run/phases/mod.rs"
        );
        assert_eq!(
            relative(Path::new("/rustc/abc/library/core/src/ops.rs")),
            "ops.rs"
        );
    }

    #[test]
    fn the_trace_s_own_frames_are_left_out_and_the_model_s_kept() {
        let frame = |filename: &str| Frame {
            filename: filename.into(),
            line: 1,
            name: String::new(),
        };
        assert!(!kept(&frame(file!())));
        assert!(!kept(&frame(&format!(
            "{}/recorder.rs",
            Path::new(file!()).parent().unwrap().display()
        ))));
        assert!(!kept(&frame("engine/src/memory.rs")));
        assert!(kept(&frame("engine/src/model/block.rs")));
        assert!(kept(&frame("harness/src/run/phases/mod.rs")));
        assert!(!kept(&frame("ops.rs")));
    }
}
