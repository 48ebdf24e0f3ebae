//! Streaming micro-batches to the trainer.
//!
//! The batch sequence is endless and made of epochs laid end to end: batch `k` covers
//! positions `[k * B, (k + 1) * B)`, position `p` is sample `order(epoch = p / len)[p % len]`,
//! and a batch may straddle two epochs. Because each epoch's order is a pure function of the
//! seed and the epoch, `start_batch` alone resumes a run exactly where it stopped.
//!
//! A background thread reads ahead through a bounded `sync_channel`, so host memory holds at
//! most `prefetch` batches beyond the one the trainer has, whatever the data set size. The
//! loader owns the thread: dropping it signals the thread, which stops within one sample
//! read, and joins it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use super::order::EpochOrder;
use super::{Batch, Dataset, SampleTarget, TargetKind, Targets};
use crate::error::EngineError;

const LOADER_SOURCE: &str = "batch loader";

type BatchResult = Result<Batch, EngineError>;

/// Streams micro-batches of the global batch sequence from a background thread.
pub struct BatchLoader {
    receiver: Option<Receiver<BatchResult>>,
    stop: Arc<AtomicBool>,
    producer: Option<JoinHandle<()>>,
    /// A problem found before the thread could start, delivered by the first `next_batch`.
    setup_error: Option<EngineError>,
    samples: u64,
    micro_batch_size: usize,
    prefetch: usize,
    next_batch_index: u64,
}

impl BatchLoader {
    /// Starts producing at batch `start_batch` of the sequence for `seed` (the order is the
    /// identity when `shuffle` is off). `prefetch` is how many batches the thread may have
    /// read beyond those already taken (0 is taken as 1). An empty data set or a micro-batch
    /// size of 0 makes `next_batch` return an error.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        micro_batch_size: usize,
        seed: u64,
        shuffle: bool,
        start_batch: u64,
        prefetch: usize,
    ) -> Self {
        let samples = dataset.len();
        let prefetch = prefetch.max(1);
        let mut loader = BatchLoader {
            receiver: None,
            stop: Arc::new(AtomicBool::new(false)),
            producer: None,
            setup_error: None,
            samples,
            micro_batch_size,
            prefetch,
            next_batch_index: start_batch,
        };
        if samples == 0 {
            loader.setup_error = Some(EngineError::data(
                LOADER_SOURCE,
                "the data set has no samples",
            ));
            return loader;
        }
        if micro_batch_size == 0 {
            loader.setup_error = Some(EngineError::data(
                LOADER_SOURCE,
                "micro-batch size must be at least 1",
            ));
            return loader;
        }
        // The thread holds one finished batch while it waits in `send`, so the channel holds
        // one less than `prefetch`: at most `prefetch` batches are ever read ahead.
        let (sender, receiver) = sync_channel(prefetch - 1);
        let producer = Producer {
            dataset,
            micro_batch_size,
            seed,
            shuffle,
            start_batch,
            sender,
            stop: loader.stop.clone(),
        };
        let spawned = std::thread::Builder::new()
            .name("carve-batch-loader".to_string())
            .spawn(move || producer.run());
        match spawned {
            Ok(handle) => {
                loader.receiver = Some(receiver);
                loader.producer = Some(handle);
            }
            Err(error) => {
                loader.setup_error = Some(EngineError::data(
                    LOADER_SOURCE,
                    format!("cannot start the loader thread: {error}"),
                ));
            }
        }
        loader
    }

    /// The next micro-batch, or the error that reading it met. After an error the loader
    /// is finished: later calls return an error too.
    pub fn next_batch(&mut self) -> Result<Batch, EngineError> {
        if let Some(error) = self.setup_error.take() {
            self.receiver = None;
            return Err(error);
        }
        let Some(receiver) = &self.receiver else {
            return Err(EngineError::data(
                LOADER_SOURCE,
                "no more batches: the loader stopped after an earlier error",
            ));
        };
        match receiver.recv() {
            Ok(Ok(batch)) => {
                self.next_batch_index = self.next_batch_index.wrapping_add(1);
                Ok(batch)
            }
            Ok(Err(error)) => {
                // The producer stops after sending an error; drop the channel so later calls
                // say so instead of blocking.
                self.receiver = None;
                Err(error)
            }
            Err(_) => {
                // The thread ended without sending an error: it can only have panicked.
                self.receiver = None;
                let reason = match self.producer.take().map(JoinHandle::join) {
                    Some(Err(panic)) => format!(
                        "the loader thread panicked while reading samples: {}",
                        panic_message(panic.as_ref())
                    ),
                    _ => "the loader thread stopped unexpectedly".to_string(),
                };
                Err(EngineError::data(LOADER_SOURCE, reason))
            }
        }
    }

    /// The index in the global sequence of the batch the next `next_batch` returns.
    pub fn next_batch_index(&self) -> u64 {
        self.next_batch_index
    }
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Dropping the receiver wakes a producer blocked in `send`; the flag stops one that
        // is reading, within one sample.
        self.receiver = None;
        if let Some(producer) = self.producer.take() {
            // A panic in the thread has nowhere to go from a destructor; it was the data
            // set's, and the trainer is already done with this loader.
            let _ = producer.join();
        }
    }
}

impl fmt::Debug for BatchLoader {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("BatchLoader")
            .field("samples", &self.samples)
            .field("micro_batch_size", &self.micro_batch_size)
            .field("prefetch", &self.prefetch)
            .field("next_batch_index", &self.next_batch_index)
            .field("running", &self.receiver.is_some())
            .finish()
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "(no message)".to_string()
    }
}

/// The loader thread's state.
struct Producer {
    dataset: Arc<dyn Dataset>,
    micro_batch_size: usize,
    seed: u64,
    shuffle: bool,
    start_batch: u64,
    sender: SyncSender<BatchResult>,
    stop: Arc<AtomicBool>,
}

impl Producer {
    fn run(self) {
        let samples = self.dataset.len();
        // u128: start_batch * micro_batch_size can exceed u64 for absurd arguments; the
        // epoch then wraps, which still gives a valid permutation.
        let start_position = u128::from(self.start_batch) * self.micro_batch_size as u128;
        let mut epoch = (start_position / u128::from(samples)) as u64;
        let mut position_in_epoch = (start_position % u128::from(samples)) as u64;
        let mut order = EpochOrder::new(samples, self.seed, epoch, self.shuffle);
        let mut indices = Vec::with_capacity(self.micro_batch_size);
        loop {
            indices.clear();
            for _ in 0..self.micro_batch_size {
                indices.push(order.sample_at(position_in_epoch));
                position_in_epoch += 1;
                if position_in_epoch == samples {
                    position_in_epoch = 0;
                    epoch = epoch.wrapping_add(1);
                    // Drop the old table before building the new one.
                    drop(std::mem::replace(&mut order, EpochOrder::Identity));
                    order = EpochOrder::new(samples, self.seed, epoch, self.shuffle);
                }
            }
            let Some(result) = read_batch(self.dataset.as_ref(), &indices, Some(&self.stop)) else {
                return;
            };
            let failed = result.is_err();
            if self.sender.send(result).is_err() || failed {
                return;
            }
        }
    }
}

/// Reads the samples `indices` into one batch. Returns `None` when `stop` was raised
/// meanwhile (checked before every sample, so a slow data set still stops promptly).
fn read_batch(
    dataset: &dyn Dataset,
    indices: &[u64],
    stop: Option<&AtomicBool>,
) -> Option<BatchResult> {
    let input_elements = dataset.input_elements();
    let target_kind = dataset.target_kind();
    let value_elements = target_kind.value_elements();
    let sizes = indices
        .len()
        .checked_mul(input_elements)
        .zip(indices.len().checked_mul(value_elements));
    let Some((input_total, value_total)) = sizes else {
        return Some(Err(EngineError::data(
            LOADER_SOURCE,
            format!(
                "a batch of {} samples of {input_elements} elements does not fit in memory",
                indices.len()
            ),
        )));
    };
    let mut inputs = vec![0f32; input_total];
    let mut targets = match target_kind {
        TargetKind::Classes { .. } => Targets::Classes(Vec::with_capacity(indices.len())),
        TargetKind::Values { .. } => Targets::Values(vec![0f32; value_total]),
    };
    for (slot, index) in indices.iter().enumerate() {
        if stop.is_some_and(|stop| stop.load(Ordering::Relaxed)) {
            return None;
        }
        let input = &mut inputs[slot * input_elements..(slot + 1) * input_elements];
        let outcome = match &mut targets {
            Targets::Classes(classes) => {
                dataset
                    .read_sample(*index, input, &mut [])
                    .and_then(|target| match target {
                        SampleTarget::Class(class) => {
                            classes.push(class);
                            Ok(())
                        }
                        SampleTarget::Values => {
                            Err(inconsistent_target(*index, "values", "a class"))
                        }
                    })
            }
            Targets::Values(values) => {
                let target_values = &mut values[slot * value_elements..(slot + 1) * value_elements];
                dataset
                    .read_sample(*index, input, target_values)
                    .and_then(|target| match target {
                        SampleTarget::Values => Ok(()),
                        SampleTarget::Class(_) => {
                            Err(inconsistent_target(*index, "a class", "values"))
                        }
                    })
            }
        };
        if let Err(error) = outcome {
            return Some(Err(error));
        }
    }
    Some(Ok(Batch {
        samples: indices.len(),
        inputs,
        targets,
    }))
}

fn inconsistent_target(index: u64, returned: &str, expected: &str) -> EngineError {
    EngineError::data(
        LOADER_SOURCE,
        format!(
            "sample {index} returned {returned} where its data set's target kind promises {expected}"
        ),
    )
}

/// The test set once, in order, in batches of `batch_size` (the last one smaller when
/// `batch_size` does not divide the set). Read on the calling thread: evaluation is a single
/// pass, nothing to overlap with. A `batch_size` of 0 yields one error. After an error the
/// iterator ends.
pub fn evaluation_batches(
    dataset: &dyn Dataset,
    batch_size: usize,
) -> impl Iterator<Item = Result<Batch, EngineError>> + '_ {
    EvaluationBatches {
        dataset,
        batch_size,
        next_sample: 0,
        finished: false,
    }
}

struct EvaluationBatches<'a> {
    dataset: &'a dyn Dataset,
    batch_size: usize,
    next_sample: u64,
    finished: bool,
}

impl Iterator for EvaluationBatches<'_> {
    type Item = BatchResult;

    fn next(&mut self) -> Option<BatchResult> {
        if self.finished {
            return None;
        }
        if self.batch_size == 0 {
            self.finished = true;
            return Some(Err(EngineError::data(
                LOADER_SOURCE,
                "evaluation batch size must be at least 1",
            )));
        }
        let samples = self.dataset.len();
        if self.next_sample >= samples {
            self.finished = true;
            return None;
        }
        let end = samples.min(self.next_sample.saturating_add(self.batch_size as u64));
        let indices: Vec<u64> = (self.next_sample..end).collect();
        self.next_sample = end;
        let result = read_batch(self.dataset, &indices, None)?;
        if result.is_err() {
            self.finished = true;
        }
        Some(result)
    }
}
