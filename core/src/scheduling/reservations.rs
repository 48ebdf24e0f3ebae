//! Rule 4, reservations: each tenant's head job, the holds on its quota when it is
//! blocked, and the GPU each blocked head reserves or queues behind.

use std::cmp::Reverse;

use super::PendingJob;
use super::gpu_pool::GpuPool;
use super::tenants::{TenantLedger, compare_job_rank};

/// A tenant's blocked head job and what it got.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockedHead {
    pub(super) job_index: usize,
    pub(super) slice_bytes: u64,
    pub(super) role: HeadRole,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum HeadRole {
    /// Reserved a GPU.
    Owner,
    /// Found every large-enough GPU reserved; `gpu_index` is the one it would have taken
    /// were nothing reserved, and `owner_job_index` the head that reserved it.
    BehindOwner {
        owner_job_index: usize,
        gpu_index: usize,
    },
}

/// Rule 4 of the module docs: finds each tenant's head job, holds quota for the blocked
/// ones and reserves the GPUs they choose. Runs before anything is placed, on the state at
/// the start of the pass. Returns the owners' `(job index, GPU index)` in their order.
pub(super) fn reserve_for_blocked_heads(
    jobs: &[&PendingJob],
    ledgers: &mut [TenantLedger<'_>],
    pool: &mut GpuPool<'_>,
    largest_usable_bytes: u64,
) -> Vec<(usize, usize)> {
    let largest_free_at_start = pool.largest_free_bytes();
    let mut blocked: Vec<(usize, usize)> = Vec::new();
    for (ledger_index, ledger) in ledgers.iter().enumerate() {
        let head = ledger.jobs.clone().find(|&job_index| {
            let needs = jobs[job_index].slice_bytes;
            needs <= largest_usable_bytes && ledger.quota_reason(job_index, needs).is_none()
        });
        if let Some(job_index) = head
            && jobs[job_index].slice_bytes > largest_free_at_start
        {
            blocked.push((job_index, ledger_index));
        }
    }
    if blocked.is_empty() {
        return Vec::new();
    }
    blocked.sort_unstable_by(|&(left, _), &(right, _)| {
        compare_job_rank(jobs[left], jobs[right]).then_with(|| left.cmp(&right))
    });

    // With the schedulable GPUs in order of free bytes (most first, then lowest index), the
    // GPU a head reserves is the first unreserved one whose usable bytes hold the job: a
    // search down a tree of the largest usable bytes per range, from which a reserved GPU
    // is cleared. A head that finds none queues behind the owner of the GPU it would have
    // taken if nothing were reserved: the first one large enough at all, found by binary
    // search on the running maximum of usable bytes.
    let mut most_free_first: Vec<usize> = (0..pool.gpus.len())
        .filter(|&index| pool.gpus[index].schedulable)
        .collect();
    most_free_first.sort_unstable_by_key(|&index| (Reverse(pool.free_bytes[index]), index));
    let usable_in_order: Vec<u64> = most_free_first
        .iter()
        .map(|&index| pool.gpus[index].usable_bytes())
        .collect();
    let running_largest_usable: Vec<u64> = usable_in_order
        .iter()
        .scan(0u64, |largest, &usable| {
            *largest = (*largest).max(usable);
            Some(*largest)
        })
        .collect();
    let mut unreserved_usable = LargestValueTree::new(&usable_in_order);

    let mut owners = Vec::with_capacity(blocked.len());
    for (job_index, ledger_index) in blocked {
        let slice_bytes = jobs[job_index].slice_bytes;
        let role = if let Some(position) = unreserved_usable.first_at_least(slice_bytes) {
            let gpu_index = most_free_first[position];
            unreserved_usable.clear(position);
            pool.reserve(gpu_index, job_index);
            owners.push((job_index, gpu_index));
            HeadRole::Owner
        } else {
            let position = running_largest_usable.partition_point(|&largest| largest < slice_bytes);
            // The head passed `slice_bytes <= largest_usable_bytes`, so a GPU is large
            // enough, and since none is left unreserved, it has an owner.
            let Some(&gpu_index) = most_free_first.get(position) else {
                continue;
            };
            let Some(owner_job_index) = pool.reserved_for_job[gpu_index] else {
                continue;
            };
            HeadRole::BehindOwner {
                owner_job_index,
                gpu_index,
            }
        };
        ledgers[ledger_index].blocked_head = Some(BlockedHead {
            job_index,
            slice_bytes,
            role,
        });
    }
    owners
}

/// A segment tree over a fixed sequence of values: finds the first position whose value
/// is at least a bound, and clears positions to 0, both in `O(log n)`.
struct LargestValueTree {
    /// Number of leaves: a power of two at least the sequence's length.
    leaves: usize,
    /// `largest[1]` is the root; the children of `i` are `2i` and `2i + 1`; leaves start
    /// at `leaves`. Each node holds the largest value below it.
    largest: Vec<u64>,
}

impl LargestValueTree {
    fn new(values: &[u64]) -> Self {
        let leaves = values.len().next_power_of_two().max(1);
        let mut largest = vec![0; 2 * leaves];
        largest[leaves..leaves + values.len()].copy_from_slice(values);
        for node in (1..leaves).rev() {
            largest[node] = largest[2 * node].max(largest[2 * node + 1]);
        }
        LargestValueTree { leaves, largest }
    }

    fn first_at_least(&self, bound: u64) -> Option<usize> {
        if self.largest[1] < bound {
            return None;
        }
        let mut node = 1;
        while node < self.leaves {
            node = if self.largest[2 * node] >= bound {
                2 * node
            } else {
                2 * node + 1
            };
        }
        Some(node - self.leaves)
    }

    fn clear(&mut self, position: usize) {
        let mut node = self.leaves + position;
        self.largest[node] = 0;
        while node > 1 {
            node /= 2;
            self.largest[node] = self.largest[2 * node].max(self.largest[2 * node + 1]);
        }
    }
}
