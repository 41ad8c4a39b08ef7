//! Accounted device memory: every tensor allocation takes a [`Lease`] from a [`MemoryTracker`]
//! under a [`Category`], and gives its bytes back when dropped.
//!
//! The figures mirror what `torch.cuda.memory_stats` users read: allocated and reserved bytes,
//! current and peak, per category, allocation and OOM counts. An allocation past the configured
//! capacity is an [`OutOfMemory`] value, never an abort. An [`AllocationObserver`], off by
//! default, sees every allocation, free and refusal in the order the tracker counts them.

mod kept;
mod spares;

pub(crate) use kept::{Chunk, Kept};
#[cfg(test)]
pub(crate) use kept::{KEPT_FROM, KEPT_UP_TO};
use serde::{Deserialize, Serialize};
pub(crate) use spares::{Mapping, Spares, HUGE_PAGE};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

/// What an allocation holds; memory reports break bytes down by these.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    /// Model weights used by the forward pass.
    Params,
    /// Parameter gradients.
    Grads,
    /// Optimizer state: AdamW moments and fp32 master weights.
    Optimizer,
    /// Activations saved between forward and backward, and activation gradients.
    Activations,
    /// Short-lived scratch inside one operation.
    Workspace,
    /// Staging buffers of checkpoint and data input/output.
    Io,
}

impl Category {
    /// Every category, in report order.
    pub const ALL: [Category; 6] = [
        Category::Params,
        Category::Grads,
        Category::Optimizer,
        Category::Activations,
        Category::Workspace,
        Category::Io,
    ];

    /// The lower-case name used in reports and configuration.
    pub fn name(self) -> &'static str {
        match self {
            Category::Params => "params",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::Workspace => "workspace",
            Category::Io => "io",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Current and peak bytes of one category (or of the whole device).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Bytes held now.
    pub current: u64,
    /// Most bytes held at once since the last [`MemoryTracker::reset_peak`].
    pub peak: u64,
}

impl Usage {
    fn add(&mut self, bytes: u64) {
        self.current += bytes;
        self.peak = self.peak.max(self.current);
    }
}

/// Bytes held per category at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breakdown {
    /// Model weights.
    pub params: u64,
    /// Parameter gradients.
    pub grads: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Saved activations and activation gradients.
    pub activations: u64,
    /// Operation scratch.
    pub workspace: u64,
    /// Input/output staging.
    pub io: u64,
}

impl From<[u64; 6]> for Breakdown {
    /// Bytes per category in [`Category::ALL`] order.
    fn from([params, grads, optimizer, activations, workspace, io]: [u64; 6]) -> Self {
        Breakdown {
            params,
            grads,
            optimizer,
            activations,
            workspace,
            io,
        }
    }
}

impl Breakdown {
    /// The bytes of one category.
    pub fn get(&self, category: Category) -> u64 {
        match category {
            Category::Params => self.params,
            Category::Grads => self.grads,
            Category::Optimizer => self.optimizer,
            Category::Activations => self.activations,
            Category::Workspace => self.workspace,
            Category::Io => self.io,
        }
    }

    fn set(&mut self, category: Category, bytes: u64) {
        let slot = match category {
            Category::Params => &mut self.params,
            Category::Grads => &mut self.grads,
            Category::Optimizer => &mut self.optimizer,
            Category::Activations => &mut self.activations,
            Category::Workspace => &mut self.workspace,
            Category::Io => &mut self.io,
        };
        *slot = bytes;
    }

    /// All categories added up.
    pub fn total(&self) -> u64 {
        Category::ALL.iter().map(|&c| self.get(c)).sum()
    }

    /// The category holding the most bytes.
    pub fn largest(&self) -> Category {
        Category::ALL
            .into_iter()
            .max_by_key(|&c| (self.get(c), std::cmp::Reverse(c)))
            .unwrap_or(Category::Params)
    }
}

impl fmt::Display for Breakdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = Category::ALL
            .iter()
            .map(|&c| format!("{c} {}", human_bytes(self.get(c))))
            .collect();
        f.write_str(&parts.join(", "))
    }
}

/// A snapshot of a tracker's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// Bytes held by live allocations.
    pub allocated: Usage,
    /// Bytes the device has set aside (on the CPU equal to `allocated`: the freed large buffers
    /// its tracker keeps for reuse, never more than its peak less what is live, are not counted).
    pub reserved: Usage,
    /// Bytes held per category now.
    pub current: Breakdown,
    /// Each category's own peak.
    pub peak_by_category: Breakdown,
    /// Bytes per category at the instant of the overall peak.
    pub at_peak: Breakdown,
    /// The capacity allocations are checked against.
    pub capacity: u64,
    /// Successful allocations so far.
    pub alloc_count: u64,
    /// Allocations refused for lack of capacity.
    pub oom_count: u64,
}

/// The tracker refused an allocation: it would exceed the device's capacity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "out of memory: tried to allocate {} for {category} with {} of {} allocated ({by_category})",
    human_bytes(*requested), human_bytes(*allocated), human_bytes(*capacity)
)]
pub struct OutOfMemory {
    /// Bytes asked for.
    pub requested: u64,
    /// The category asked for.
    pub category: Category,
    /// The device's capacity.
    pub capacity: u64,
    /// Bytes held at the time.
    pub allocated: u64,
    /// Bytes reserved at the time.
    pub reserved: u64,
    /// Bytes held per category at the time.
    pub by_category: Breakdown,
}

/// One change to a tracker's bytes, as an [`AllocationObserver`] sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocationEvent {
    /// `bytes` were taken under `category`; `id` names the lease until it is freed.
    Alloc {
        /// The lease's number, unique within its tracker.
        id: u64,
        /// Bytes taken.
        bytes: u64,
        /// Their category.
        category: Category,
    },
    /// The lease `id` gave its bytes back.
    Free {
        /// The lease's number.
        id: u64,
        /// Bytes given back.
        bytes: u64,
        /// Their category.
        category: Category,
    },
    /// An allocation was refused.
    Refused {
        /// Bytes asked for.
        bytes: u64,
        /// Their category.
        category: Category,
        /// Bytes held when they were asked for.
        allocated: u64,
        /// The capacity they were checked against.
        capacity: u64,
    },
}

/// Sees every allocation, free and refusal of a tracker (see [`MemoryTracker::observe`]). It is
/// called with the tracker's lock held, so events arrive in the order the tracker counts them;
/// it must not call the tracker.
pub trait AllocationObserver: Send + Sync + fmt::Debug {
    /// One event.
    fn event(&self, event: AllocationEvent);
}

#[derive(Debug)]
struct State {
    capacity: u64,
    allocated: Usage,
    by_category: [Usage; 6],
    at_peak: [u64; 6],
    alloc_count: u64,
    oom_count: u64,
    observer: Option<Arc<dyn AllocationObserver>>,
}

impl State {
    fn tell(&self, event: AllocationEvent) {
        if let Some(o) = &self.observer {
            o.event(event);
        }
    }

    fn refuse(&mut self, bytes: u64, category: Category) -> OutOfMemory {
        self.oom_count += 1;
        self.tell(AllocationEvent::Refused {
            bytes,
            category,
            allocated: self.allocated.current,
            capacity: self.capacity,
        });
        OutOfMemory {
            requested: bytes,
            category,
            capacity: self.capacity,
            allocated: self.allocated.current,
            reserved: self.allocated.current,
            by_category: self.breakdown(|u| u.current),
        }
    }

    fn breakdown(&self, pick: impl Fn(&Usage) -> u64) -> Breakdown {
        let mut b = Breakdown::default();
        for c in Category::ALL {
            b.set(c, pick(&self.by_category[c.index()]));
        }
        b
    }
}

/// Counts every byte a device hands out. Cloning shares the same counters.
#[derive(Clone, Debug)]
pub struct MemoryTracker {
    state: Arc<Mutex<State>>,
    spares: Arc<Spares>,
    kept: Arc<Kept>,
}

impl MemoryTracker {
    /// A tracker refusing allocations that would take more than `capacity` bytes in all.
    pub fn new(capacity: u64) -> Self {
        MemoryTracker {
            state: Arc::new(Mutex::new(State {
                capacity,
                allocated: Usage::default(),
                by_category: [Usage::default(); 6],
                at_peak: [0; 6],
                alloc_count: 0,
                oom_count: 0,
                observer: None,
            })),
            spares: Arc::default(),
            kept: Arc::default(),
        }
    }

    /// A tracker with no practical capacity limit.
    pub fn unlimited() -> Self {
        Self::new(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the counters half-updated: every update is
        // a few integer additions. So a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes `bytes` under `category`, or refuses if the capacity would be exceeded.
    pub fn allocate(&self, bytes: u64, category: Category) -> Result<Lease, OutOfMemory> {
        let mut s = self.lock();
        if s.allocated.current.saturating_add(bytes) > s.capacity {
            return Err(s.refuse(bytes, category));
        }
        s.alloc_count += 1;
        s.allocated.add(bytes);
        s.by_category[category.index()].add(bytes);
        if s.allocated.current == s.allocated.peak {
            let now: Vec<u64> = s.by_category.iter().map(|u| u.current).collect();
            s.at_peak.copy_from_slice(&now);
        }
        let id = s.alloc_count;
        s.tell(AllocationEvent::Alloc {
            id,
            bytes,
            category,
        });
        Ok(Lease {
            tracker: self.clone(),
            id,
            bytes,
            category,
        })
    }

    /// Tells `observer` of every allocation, free and refusal from now on (`None`: stops
    /// telling). Off by default; while off, nothing is recorded.
    pub fn observe(&self, observer: Option<Arc<dyn AllocationObserver>>) {
        self.lock().observer = observer;
    }

    /// Counts a refused allocation of `bytes` under `category` (one the memory behind the
    /// tracker could not hold although the capacity allowed it) and describes it.
    pub fn refuse(&self, bytes: u64, category: Category) -> OutOfMemory {
        self.lock().refuse(bytes, category)
    }

    fn release(&self, id: u64, bytes: u64, category: Category) {
        let mut s = self.lock();
        s.allocated.current -= bytes;
        s.by_category[category.index()].current -= bytes;
        s.tell(AllocationEvent::Free {
            id,
            bytes,
            category,
        });
    }

    /// The figures now.
    pub fn stats(&self) -> MemoryStats {
        let s = self.lock();
        let mut at_peak = Breakdown::default();
        for c in Category::ALL {
            at_peak.set(c, s.at_peak[c.index()]);
        }
        MemoryStats {
            allocated: s.allocated,
            reserved: s.allocated,
            current: s.breakdown(|u| u.current),
            peak_by_category: s.breakdown(|u| u.peak),
            at_peak,
            capacity: s.capacity,
            alloc_count: s.alloc_count,
            oom_count: s.oom_count,
        }
    }

    /// Bytes held now.
    pub fn allocated(&self) -> u64 {
        self.lock().allocated.current
    }

    /// Starts a new peak window: every peak becomes the current figure.
    pub fn reset_peak(&self) {
        let mut s = self.lock();
        s.allocated.peak = s.allocated.current;
        for u in s.by_category.iter_mut() {
            u.peak = u.current;
        }
        let now: Vec<u64> = s.by_category.iter().map(|u| u.current).collect();
        s.at_peak.copy_from_slice(&now);
    }

    /// The host buffers of freed tensors kept for the next tensors of the same size.
    pub(crate) fn spares(&self) -> &Spares {
        &self.spares
    }

    /// Where mid-sized tensors kept for the run are carved from.
    pub(crate) fn kept(&self) -> &Kept {
        &self.kept
    }

    /// Bytes held now and the peak of the current window.
    pub(crate) fn current_and_peak(&self) -> (u64, u64) {
        let s = self.lock();
        (s.allocated.current, s.allocated.peak)
    }

    /// The capacity allocations are checked against.
    pub fn capacity(&self) -> u64 {
        self.lock().capacity
    }
}

/// Bytes held under a tracker; dropping it gives them back.
#[derive(Debug)]
pub struct Lease {
    tracker: MemoryTracker,
    id: u64,
    bytes: u64,
    category: Category,
}

impl Lease {
    /// The tracker the bytes are counted by.
    pub(crate) fn tracker(&self) -> &MemoryTracker {
        &self.tracker
    }

    /// The bytes this lease holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The category the bytes are counted under.
    pub fn category(&self) -> Category {
        self.category
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.tracker.release(self.id, self.bytes, self.category);
    }
}

/// The host memory this process may still allocate, in bytes, where the platform reports it:
/// the machine's available memory, bounded by the process's cgroup limit and its address-space
/// and data limits ([`crate::host_memory`]).
pub fn host_available() -> Option<u64> {
    crate::host_memory::available()
}

/// `1536` → `1.5 KiB`: bytes for people.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocation_past_capacity_is_an_error_with_the_breakdown() {
        let t = MemoryTracker::new(1000);
        let _a = t.allocate(600, Category::Params).unwrap();
        let err = t.allocate(500, Category::Activations).unwrap_err();
        assert_eq!(err.requested, 500);
        assert_eq!(err.capacity, 1000);
        assert_eq!(err.allocated, 600);
        assert_eq!(err.by_category.params, 600);
        assert_eq!(t.stats().oom_count, 1);
        assert_eq!(t.allocated(), 600);
        let msg = err.to_string();
        assert!(msg.contains("500 B for activations"), "{msg}");
        assert!(msg.contains("params 600 B"), "{msg}");
    }

    #[test]
    fn reset_peak_starts_a_new_window() {
        let t = MemoryTracker::unlimited();
        let a = t.allocate(100, Category::Workspace).unwrap();
        drop(a);
        assert_eq!(t.stats().allocated.peak, 100);
        t.reset_peak();
        assert_eq!(t.stats().allocated.peak, 0);
        assert_eq!(t.stats().peak_by_category.workspace, 0);
    }

    /// Records what it is told.
    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<AllocationEvent>>);

    impl AllocationObserver for Log {
        fn event(&self, event: AllocationEvent) {
            self.0.lock().unwrap().push(event);
        }
    }

    #[test]
    fn an_observer_sees_every_allocation_free_and_refusal_while_it_observes() {
        let t = MemoryTracker::new(1000);
        let before = t.allocate(10, Category::Io).unwrap();
        let log = Arc::new(Log::default());
        t.observe(Some(log.clone()));
        let a = t.allocate(600, Category::Params).unwrap();
        assert!(t.allocate(500, Category::Activations).is_err());
        drop(before);
        drop(a);
        t.observe(None);
        drop(t.allocate(1, Category::Grads).unwrap());
        use AllocationEvent::*;
        assert_eq!(
            *log.0.lock().unwrap(),
            [
                Alloc {
                    id: 2,
                    bytes: 600,
                    category: Category::Params
                },
                Refused {
                    bytes: 500,
                    category: Category::Activations,
                    allocated: 610,
                    capacity: 1000
                },
                Free {
                    id: 1,
                    bytes: 10,
                    category: Category::Io
                },
                Free {
                    id: 2,
                    bytes: 600,
                    category: Category::Params
                },
            ]
        );
    }

    proptest! {
        /// The peak equals the largest sum of live allocations over any sequence of allocations
        /// and frees; every byte comes back once all leases are dropped.
        #[test]
        fn peak_is_the_largest_live_sum(ops in proptest::collection::vec((0u64..10_000, 0usize..6, any::<bool>()), 1..60)) {
            let t = MemoryTracker::unlimited();
            let mut live: Vec<Lease> = Vec::new();
            let mut expected_peak = 0u64;
            let mut expected_cat_peak = [0u64; 6];
            for (bytes, cat, free) in ops {
                if free && !live.is_empty() {
                    live.remove(bytes as usize % live.len());
                } else {
                    live.push(t.allocate(bytes, Category::ALL[cat]).unwrap());
                }
                let sum: u64 = live.iter().map(|l| l.bytes()).sum();
                expected_peak = expected_peak.max(sum);
                for c in Category::ALL {
                    let s: u64 = live.iter().filter(|l| l.category() == c).map(|l| l.bytes()).sum();
                    expected_cat_peak[c.index()] = expected_cat_peak[c.index()].max(s);
                }
                prop_assert_eq!(t.allocated(), sum);
            }
            let stats = t.stats();
            prop_assert_eq!(stats.allocated.peak, expected_peak);
            prop_assert_eq!(stats.at_peak.total(), expected_peak);
            for c in Category::ALL {
                prop_assert_eq!(stats.peak_by_category.get(c), expected_cat_peak[c.index()]);
            }
            drop(live);
            prop_assert_eq!(t.allocated(), 0);
        }
    }
}
