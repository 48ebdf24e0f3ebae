//! The slice on the GPU, as bookkeeping: the one reservation an attempt makes, the check
//! that it took effect, the live buffers at their offsets, and the device layout of
//! convolution kernels. Everything here is pure; `device.rs` makes the calls.
//!
//! At attempt start the backend reserves the whole slice with one `cuMemAlloc` and
//! compares `cuMemGetInfo`'s free bytes before and after: the drop must be at least the
//! slice (the driver rounds allocations up to its granularity, so it may be more). Every
//! plan buffer is then `base + offset` with the offset the executor's `SliceAllocator`
//! chose, so nothing else in the process can take the slice's memory and the measured
//! peak is the allocator's.

use std::collections::BTreeMap;

use carve_core::allocator::ALLOCATION_ALIGNMENT;
use carve_core::plan::BufferId;

use crate::cuda::error::SliceNumbers;

/// What the attempt reserved on the GPU, for the trainer's report and the attempt's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceReservation {
    pub device_ordinal: usize,
    pub device_name: String,
    /// The slice: the bytes its allocator hands out.
    pub reserved_bytes: u64,
    /// The one allocation holding it: the slice rounded up to whole driver pages.
    pub allocated_bytes: u64,
    pub device_total_bytes: u64,
    /// `cuMemGetInfo` free bytes just before and just after the reservation.
    pub free_before_bytes: u64,
    pub free_after_bytes: u64,
}

impl SliceReservation {
    /// How much free device memory the reservation took (at least `reserved_bytes`).
    pub fn taken_bytes(&self) -> u64 {
        self.free_before_bytes.saturating_sub(self.free_after_bytes)
    }
}

impl std::fmt::Display for SliceReservation {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "reserved {} bytes ({} allocated) on cuda:{} ({}): free memory went from {} to {} bytes of {}",
            self.reserved_bytes,
            self.allocated_bytes,
            self.device_ordinal,
            self.device_name,
            self.free_before_bytes,
            self.free_after_bytes,
            self.device_total_bytes
        )
    }
}

/// Checks that a reservation took effect: free memory fell by at least the slice.
pub fn verify_reservation(reservation: &SliceReservation) -> Result<(), String> {
    if reservation.taken_bytes() >= reservation.reserved_bytes {
        Ok(())
    } else {
        Err(format!(
            "the slice reservation did not take effect: free device memory fell by {} bytes \
             ({} -> {}), at least {} were reserved",
            reservation.taken_bytes(),
            reservation.free_before_bytes,
            reservation.free_after_bytes,
            reservation.reserved_bytes
        ))
    }
}

/// The live buffers of the slice, by offset: the numbers an `OutOfMemory` report needs
/// when a library allocation fails, and the bounds check of every device pointer.
#[derive(Debug, Clone, Default)]
pub struct LiveBuffers {
    limit: u64,
    /// offset -> (buffer, rounded bytes)
    by_offset: BTreeMap<u64, (BufferId, u64)>,
    /// buffer -> (offset, bytes as asked)
    by_id: BTreeMap<BufferId, (u64, u64)>,
    in_use: u64,
    peak: u64,
}

impl LiveBuffers {
    pub fn new(limit: u64) -> Self {
        LiveBuffers {
            limit,
            ..LiveBuffers::default()
        }
    }

    /// Records a buffer the allocator placed; refuses one that leaves the slice or overlaps
    /// a live one (an allocator bug must not become a wild device write).
    pub fn insert(&mut self, id: BufferId, offset: u64, bytes: u64) -> Result<(), String> {
        // As the allocator: even an empty buffer takes one alignment unit.
        let rounded = bytes
            .max(1)
            .checked_next_multiple_of(ALLOCATION_ALIGNMENT)
            .ok_or_else(|| format!("buffer {} of {bytes} bytes is too large", id.0))?;
        let end = offset
            .checked_add(bytes)
            .filter(|end| *end <= self.limit)
            .ok_or_else(|| {
                format!(
                    "buffer {} at offset {offset} of {bytes} bytes leaves the slice of {}",
                    id.0, self.limit
                )
            })?;
        let overlaps_before = self
            .by_offset
            .range(..offset)
            .next_back()
            .is_some_and(|(start, (_, size))| start + size > offset);
        let overlaps_after = self
            .by_offset
            .range(offset..)
            .next()
            .is_some_and(|(start, _)| *start < end.max(offset + 1));
        if overlaps_before || overlaps_after || self.by_id.contains_key(&id) {
            return Err(format!(
                "buffer {} at offset {offset} overlaps a live buffer",
                id.0
            ));
        }
        self.by_offset
            .insert(offset, (id, rounded.min(self.limit - offset)));
        self.by_id.insert(id, (offset, bytes));
        self.in_use += rounded.min(self.limit - offset);
        self.peak = self.peak.max(self.in_use);
        Ok(())
    }

    pub fn remove(&mut self, id: BufferId) {
        if let Some((offset, _)) = self.by_id.remove(&id)
            && let Some((_, rounded)) = self.by_offset.remove(&offset)
        {
            self.in_use -= rounded;
        }
    }

    /// (offset, bytes) of a live buffer.
    pub fn get(&self, id: BufferId) -> Option<(u64, u64)> {
        self.by_id.get(&id).copied()
    }

    pub fn clear(&mut self) {
        self.by_offset.clear();
        self.by_id.clear();
        self.in_use = 0;
    }

    /// In use, limit, largest hole and peak, as the allocator would report them.
    pub fn numbers(&self) -> SliceNumbers {
        let mut largest_free = 0;
        let mut cursor = 0;
        for (offset, (_, rounded)) in &self.by_offset {
            largest_free = largest_free.max(offset.saturating_sub(cursor));
            cursor = offset + rounded;
        }
        largest_free = largest_free.max(self.limit.saturating_sub(cursor));
        SliceNumbers {
            in_use: self.in_use,
            limit: self.limit,
            largest_free,
            peak: self.peak,
        }
    }
}

/// A convolution kernel's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelDimensions {
    pub height: usize,
    pub width: usize,
    pub input_channels: usize,
    pub filters: usize,
}

impl KernelDimensions {
    pub fn elements(&self) -> usize {
        self.height * self.width * self.input_channels * self.filters
    }
}

/// The engine's conv kernels are `[kh, kw, in, filters]` (HWIO); cuDNN's NHWC filters are
/// `[filters, kh, kw, in]` (KRSC). On the device every tensor of a conv kernel —
/// weights, master, gradient, optimizer state — is kept in KRSC, and values are
/// permuted when they cross to the host, so the elementwise optimizer and casts see the
/// same permutation on all of them and checkpoints keep the engine's layout.
pub fn hwio_to_krsc(values: &[f32], dimensions: KernelDimensions) -> Vec<f32> {
    let mut permuted = vec![0.0; values.len()];
    for_each_kernel_index(dimensions, |hwio, krsc| {
        if let (Some(source), Some(destination)) = (values.get(hwio), permuted.get_mut(krsc)) {
            *destination = *source;
        }
    });
    permuted
}

/// The inverse of [`hwio_to_krsc`].
pub fn krsc_to_hwio(values: &[f32], dimensions: KernelDimensions) -> Vec<f32> {
    let mut permuted = vec![0.0; values.len()];
    for_each_kernel_index(dimensions, |hwio, krsc| {
        if let (Some(source), Some(destination)) = (values.get(krsc), permuted.get_mut(hwio)) {
            *destination = *source;
        }
    });
    permuted
}

/// Calls `visit(hwio, krsc)` with every kernel element's index in both layouts.
fn for_each_kernel_index(dimensions: KernelDimensions, mut visit: impl FnMut(usize, usize)) {
    let KernelDimensions {
        height,
        width,
        input_channels,
        filters,
    } = dimensions;
    for row in 0..height {
        for column in 0..width {
            for channel in 0..input_channels {
                for filter in 0..filters {
                    let hwio =
                        ((row * width + column) * input_channels + channel) * filters + filter;
                    let krsc =
                        ((filter * height + row) * width + column) * input_channels + channel;
                    visit(hwio, krsc);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation(free_before: u64, free_after: u64) -> SliceReservation {
        SliceReservation {
            device_ordinal: 0,
            device_name: "test".into(),
            reserved_bytes: 1 << 30,
            allocated_bytes: 1 << 30,
            device_total_bytes: 80 << 30,
            free_before_bytes: free_before,
            free_after_bytes: free_after,
        }
    }

    #[test]
    fn a_reservation_holds_when_free_memory_fell_by_at_least_the_slice() {
        assert!(verify_reservation(&reservation(10 << 30, 9 << 30)).is_ok());
        // Rounded up to the driver's granularity: more is fine.
        assert!(verify_reservation(&reservation(10 << 30, (9 << 30) - (2 << 20))).is_ok());
        let error = verify_reservation(&reservation(10 << 30, 10 << 30)).unwrap_err();
        assert!(error.contains("did not take effect"), "{error}");
    }

    #[test]
    fn live_buffers_report_in_use_largest_hole_and_peak() {
        let mut live = LiveBuffers::new(4096);
        live.insert(BufferId(0), 0, 1000).unwrap();
        live.insert(BufferId(1), 1024, 256).unwrap();
        live.insert(BufferId(2), 2048, 512).unwrap();
        let numbers = live.numbers();
        assert_eq!(numbers.in_use, 1024 + 256 + 512);
        assert_eq!(numbers.largest_free, 4096 - 2560);
        live.remove(BufferId(2));
        live.remove(BufferId(0));
        let numbers = live.numbers();
        assert_eq!(numbers.in_use, 256);
        assert_eq!(numbers.largest_free, 4096 - 1280);
        assert_eq!(numbers.peak, 1792);
        assert_eq!(live.get(BufferId(1)), Some((1024, 256)));
        assert_eq!(live.get(BufferId(0)), None);
    }

    #[test]
    fn buffers_outside_the_slice_or_overlapping_are_refused() {
        let mut live = LiveBuffers::new(4096);
        assert!(live.insert(BufferId(0), 4000, 200).is_err());
        // An empty buffer still holds its unit, as in the allocator.
        live.insert(BufferId(5), 3840, 0).unwrap();
        assert_eq!(live.numbers().in_use, 256);
        assert!(live.insert(BufferId(6), 3840, 16).is_err());
        live.remove(BufferId(5));
        live.insert(BufferId(0), 0, 1000).unwrap();
        assert!(live.insert(BufferId(1), 512, 256).is_err());
        assert!(live.insert(BufferId(0), 2048, 256).is_err());
        assert!(live.insert(BufferId(1), 1024, 256).is_ok());
    }

    #[test]
    fn kernel_layout_round_trips_and_puts_each_filter_contiguously() {
        let dimensions = KernelDimensions {
            height: 2,
            width: 3,
            input_channels: 4,
            filters: 5,
        };
        let hwio: Vec<f32> = (0..dimensions.elements())
            .map(|value| value as f32)
            .collect();
        let krsc = hwio_to_krsc(&hwio, dimensions);
        assert_eq!(krsc_to_hwio(&krsc, dimensions), hwio);
        // Filter 1, row 0, column 0, channel 2 is HWIO element 2 * 5 + 1.
        assert_eq!(krsc[(2 * 3) * 4 + 2], 11.0);
        assert_ne!(krsc, hwio);
    }
}
