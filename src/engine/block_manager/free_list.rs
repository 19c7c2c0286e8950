//! The block manager's free blocks, in the order they are reused.

use super::BlockId;

/// Blocks with no reference, front reused first: a list threaded through two arrays (vLLM's
/// free block queue), so that a prefix hit takes a freed block out of the middle at once — a
/// deque's search for it cost a pass over every free block, a block at a time (a GPU's cache
/// sized by --gpu-memory-utilization holds hundreds of thousands: ~240k blocks of 16 for a 1B
/// Llama's 32 KB a token at 0.9 of an H200's 141 GB).
pub(super) struct FreeList {
    prev: Vec<BlockId>,
    next: Vec<BlockId>,
    head: BlockId,
    tail: BlockId,
    len: usize,
}

/// No neighbour (an end of the list).
const END: BlockId = BlockId::MAX;
/// `prev` of a block not in the list.
const OUT: BlockId = BlockId::MAX - 1;

impl FreeList {
    /// Blocks 0..n, in order.
    pub(super) fn new(n: usize) -> FreeList {
        assert!(n < OUT as usize, "{n} blocks: ids are 32-bit");
        let n32 = n as BlockId;
        FreeList {
            prev: (0..n32).map(|i| i.checked_sub(1).unwrap_or(END)).collect(),
            next: (0..n32)
                .map(|i| if i + 1 < n32 { i + 1 } else { END })
                .collect(),
            head: if n > 0 { 0 } else { END },
            tail: n32.checked_sub(1).unwrap_or(END),
            len: n,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn contains(&self, id: BlockId) -> bool {
        self.prev[id as usize] != OUT
    }

    pub(super) fn pop_front(&mut self) -> Option<BlockId> {
        let id = self.head;
        (id != END).then(|| {
            self.remove(id);
            id
        })
    }

    /// Take `id` (in the list) out.
    pub(super) fn remove(&mut self, id: BlockId) {
        debug_assert!(self.contains(id), "block {id} is not free");
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        match p {
            END => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            END => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.prev[id as usize] = OUT;
        self.next[id as usize] = END;
        self.len -= 1;
    }

    pub(super) fn push_back(&mut self, id: BlockId) {
        debug_assert!(!self.contains(id), "block {id} is free already");
        self.prev[id as usize] = self.tail;
        self.next[id as usize] = END;
        match self.tail {
            END => self.head = id,
            t => self.next[t as usize] = id,
        }
        self.tail = id;
        self.len += 1;
    }

    pub(super) fn push_front(&mut self, id: BlockId) {
        debug_assert!(!self.contains(id), "block {id} is free already");
        self.prev[id as usize] = END;
        self.next[id as usize] = self.head;
        match self.head {
            END => self.tail = id,
            h => self.prev[h as usize] = id,
        }
        self.head = id;
        self.len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The free list against a deque doing the same (random pushes at either end, pops, and
    /// removals from the middle, as prefix hits take them): the same order and length throughout.
    #[test]
    fn the_free_list_keeps_a_deques_order() {
        use std::collections::VecDeque;
        for n in [0usize, 1, 2, 7, 50] {
            let mut list = FreeList::new(n);
            let mut want: VecDeque<BlockId> = (0..n as BlockId).collect();
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
            let mut next = |m: u64| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 33) % m.max(1)
            };
            let mut out: Vec<BlockId> = Vec::new();
            for _ in 0..2000 {
                match next(4) {
                    0 => assert_eq!(list.pop_front(), want.pop_front().inspect(|&b| out.push(b))),
                    1 if !want.is_empty() => {
                        let id = want.remove(next(want.len() as u64) as usize).unwrap();
                        list.remove(id);
                        out.push(id);
                    }
                    2 | 3 if !out.is_empty() => {
                        let id = out.swap_remove(next(out.len() as u64) as usize);
                        if next(2) == 0 {
                            list.push_back(id);
                            want.push_back(id);
                        } else {
                            list.push_front(id);
                            want.push_front(id);
                        }
                    }
                    _ => {}
                }
                assert_eq!(list.len(), want.len());
                assert!(want.iter().all(|&b| list.contains(b)));
                assert!(out.iter().all(|&b| !list.contains(b)));
            }
            let mut rest = Vec::new();
            while let Some(b) = list.pop_front() {
                rest.push(b);
            }
            assert_eq!(rest, Vec::from(want), "{n} blocks");
        }
    }
}
