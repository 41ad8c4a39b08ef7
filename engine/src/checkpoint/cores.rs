//! Work shared out over the machine's cores.

use std::sync::atomic::{AtomicUsize, Ordering};

/// `f` of every item of `items` on as many threads as the machine runs, the costliest (by
/// `cost`) taken first, each thread taking the next item no thread has taken, so that they share
/// out evenly; the results in the items' order.
pub(crate) fn map_on_cores<T: Sync, R: Send, C: Ord>(
    items: &[T],
    cost: impl Fn(&T) -> C,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(cost(&items[i])));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let next = AtomicUsize::new(0);
    let mut done: Vec<(usize, R)> = std::thread::scope(|scope| {
        let running: Vec<_> = (0..threads.min(items.len()))
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    while let Some(&at) = order.get(next.fetch_add(1, Ordering::Relaxed)) {
                        done.push((at, f(&items[at])));
                    }
                    done
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
        let tripled: Vec<u64> = items.iter().map(|x| x * 3).collect();
        assert_eq!(map_on_cores(&items, |x| *x, |x| x * 3), tripled);
        assert_eq!(map_on_cores(&items, |x| x % 7, |x| x * 3), tripled);
        assert!(map_on_cores(&[] as &[u8], |x| *x, |x| *x).is_empty());
    }
}
