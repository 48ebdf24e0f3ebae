//! The GPUs' side of a pass: free bytes per GPU, indexed for best fit (rule 3), with the
//! reserved GPUs kept apart.

use std::collections::BTreeSet;

use super::GpuState;
use super::image_affinity::{CachedImages, break_best_fit_tie};

/// The schedulable GPUs and their free bytes during the pass.
pub(super) struct GpuPool<'a> {
    /// Every GPU of the problem, sorted by id (then the other fields, for a total order).
    pub(super) gpus: Vec<&'a GpuState>,
    pub(super) free_bytes: Vec<u64>,
    /// `(free bytes, index)` of schedulable, unreserved GPUs: best fit is the first entry
    /// at or above the job's size, and equal free bytes fall to the lower id.
    pub(super) unreserved: BTreeSet<(u64, usize)>,
    /// `(free bytes, index)` of reserved GPUs; nothing is placed on them in the pass.
    pub(super) reserved: BTreeSet<(u64, usize)>,
    /// For each GPU, the index of the job it is reserved for.
    pub(super) reserved_for_job: Vec<Option<usize>>,
    /// The largest usable bytes of a schedulable GPU; `None` when there is none.
    pub(super) largest_usable_bytes: Option<u64>,
}

impl<'a> GpuPool<'a> {
    pub(super) fn new(gpus: &'a [GpuState]) -> Self {
        let mut sorted: Vec<&GpuState> = gpus.iter().collect();
        sorted.sort_unstable_by(|left, right| {
            (
                &left.gpu_id,
                &left.worker_id,
                left.total_bytes,
                left.context_bytes,
                left.allocated_bytes,
                left.schedulable,
            )
                .cmp(&(
                    &right.gpu_id,
                    &right.worker_id,
                    right.total_bytes,
                    right.context_bytes,
                    right.allocated_bytes,
                    right.schedulable,
                ))
        });
        let free_bytes: Vec<u64> = sorted.iter().map(|gpu| gpu.free_bytes()).collect();
        let unreserved = sorted
            .iter()
            .enumerate()
            .filter(|(_, gpu)| gpu.schedulable)
            .map(|(index, _)| (free_bytes[index], index))
            .collect();
        let largest_usable_bytes = sorted
            .iter()
            .filter(|gpu| gpu.schedulable)
            .map(|gpu| gpu.usable_bytes())
            .max();
        GpuPool {
            reserved_for_job: vec![None; sorted.len()],
            gpus: sorted,
            free_bytes,
            unreserved,
            reserved: BTreeSet::new(),
            largest_usable_bytes,
        }
    }

    /// The unreserved GPU with the fewest free bytes that still hold `needs` (the lowest
    /// id among equal free bytes), or, where `image` is known, the first of those equal
    /// ones whose worker holds it (`image_affinity`).
    pub(super) fn best_fit_unreserved_for_image(
        &self,
        needs: u64,
        image: Option<&str>,
        images: &CachedImages,
    ) -> Option<usize> {
        let &(free, first) = self.unreserved.range((needs, 0)..).next()?;
        if image.is_none() {
            return Some(first);
        }
        let ties = self
            .unreserved
            .range((free, 0)..=(free, usize::MAX))
            .map(|&(_, index)| (index, self.gpus[index].worker_id.as_str()));
        break_best_fit_tie(ties, image, images)
    }

    /// The reserved GPU with the fewest free bytes that still hold `needs`, and the job
    /// it is reserved for.
    pub(super) fn best_fit_reserved(&self, needs: u64) -> Option<(usize, usize)> {
        let &(_, index) = self.reserved.range((needs, 0)..).next()?;
        Some((index, self.reserved_for_job[index]?))
    }

    /// The most free bytes of any schedulable GPU, reserved or not.
    pub(super) fn largest_free_bytes(&self) -> u64 {
        let unreserved = self.unreserved.last().map_or(0, |&(free, _)| free);
        let reserved = self.reserved.last().map_or(0, |&(free, _)| free);
        unreserved.max(reserved)
    }

    pub(super) fn allocate(&mut self, index: usize, bytes: u64) {
        let free = self.free_bytes[index];
        self.unreserved.remove(&(free, index));
        self.free_bytes[index] = free - bytes;
        self.unreserved.insert((free - bytes, index));
    }

    pub(super) fn reserve(&mut self, index: usize, job_index: usize) {
        let free = self.free_bytes[index];
        self.unreserved.remove(&(free, index));
        self.reserved.insert((free, index));
        self.reserved_for_job[index] = Some(job_index);
    }
}
