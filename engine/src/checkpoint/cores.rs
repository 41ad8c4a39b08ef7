//! Work shared out over the machine's cores.

use std::sync::atomic::{AtomicUsize, Ordering};

/// `f` of every item of `items` on as many threads as the machine runs, each thread taking the
/// next item no thread has taken (so items in order of falling cost share out evenly); the
/// results in the items' order.
pub(crate) fn map_on_cores<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let running: Vec<_> = (0..threads.min(items.len()))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let at = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(at) else {
                            return done;
                        };
                        done.push((at, f(item)));
                    }
                })
            })
            .collect();
        running
            .into_iter()
            .flat_map(|h| h.join().expect("the work does not panic"))
            .collect()
    });
    done.sort_by_key(|(at, _)| *at);
    done.into_iter().map(|(_, r)| r).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_mapped_once_and_in_order() {
        let items: Vec<u64> = (0..1000).collect();
        assert_eq!(
            map_on_cores(&items, |x| x * 3),
            items.iter().map(|x| x * 3).collect::<Vec<_>>()
        );
        assert!(map_on_cores(&[] as &[u8], |x| *x).is_empty());
    }
}
