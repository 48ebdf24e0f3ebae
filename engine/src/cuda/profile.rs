//! The `profile` tuning: every plan operation of the cuda backend between two CUDA events,
//! added up by what ran (e.g. "backward layers[3].batch_norm") and printed as a
//! table when the backend is dropped. The first step is left out: it chooses the
//! convolution algorithms. A run on a GPU machine yields a profile without nsys.
//!
//! The events are read only at the end, so timing adds no host synchronization of its
//! own. Each row also has the host's time to enqueue the operation: where it exceeds the
//! GPU time the GPU waits on the host, and the GPU column then shows that wait too.

use std::collections::BTreeMap;

use carve_core::model::ModelGraph;
use carve_core::plan::{Operation, OperationKind};
use cudarc::driver::CudaEvent;

use super::CudaBackend;
use crate::backend::{OperationContext, OperationResult};
use crate::dispatch::run_operation;
use crate::error::EngineError;

/// What one timed operation is counted as.
pub fn operation_label(operation: &Operation, graph: &ModelGraph) -> String {
    let layer_kind = |layer: usize| {
        graph
            .layers
            .get(layer)
            .map_or_else(|| format!("layers[{layer}]"), |node| node.label())
    };
    match operation.kind {
        OperationKind::InitializeParameters => "initialize parameters".into(),
        OperationKind::LayerForward { layer } => format!("forward {}", layer_kind(layer)),
        OperationKind::LayerRecompute { layer } => format!("recompute {}", layer_kind(layer)),
        OperationKind::LayerInference { layer } => format!("inference {}", layer_kind(layer)),
        OperationKind::LayerBackward { layer } => format!("backward {}", layer_kind(layer)),
        OperationKind::LossForward => "loss forward".into(),
        OperationKind::LossEvaluate => "loss evaluate".into(),
        OperationKind::LossBackward => "loss backward".into(),
        OperationKind::AccumulateGradient { .. } => "accumulate gradient".into(),
        OperationKind::CopyGradient { .. } => "copy gradient".into(),
        OperationKind::CheckOverflow => "check overflow".into(),
        OperationKind::OptimizerUpdate { .. } => "optimizer update".into(),
    }
}

/// The events of every timed operation, read when the table is made.
#[derive(Default)]
pub struct OperationProfile {
    /// Label, events around the GPU work, and the host's time to enqueue it.
    timed: Vec<(String, CudaEvent, CudaEvent, std::time::Duration)>,
    /// Operations seen in the untimed first step.
    skipped: usize,
    /// What was chosen along the way (the convolution algorithms), printed after the table.
    notes: Vec<String>,
}

impl std::fmt::Debug for OperationProfile {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("OperationProfile")
            .field("timed", &self.timed.len())
            .finish()
    }
}

impl OperationProfile {
    /// Whether the operation of optimizer step `step` is timed (not the first step's).
    pub fn times(&mut self, step: u64) -> bool {
        if step == 0 {
            self.skipped += 1;
        }
        step > 0
    }

    pub fn add(
        &mut self,
        label: String,
        start: CudaEvent,
        end: CudaEvent,
        host: std::time::Duration,
    ) {
        self.timed.push((label, start, end, host));
    }

    pub fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    /// The table, slowest first: label, calls, total and mean milliseconds, share.
    pub fn table(&self) -> String {
        let mut totals: BTreeMap<&str, (usize, f64, f64)> = BTreeMap::new();
        for (label, start, end, host) in &self.timed {
            // A failed read (an event never completed) counts as no time.
            let milliseconds = f64::from(start.elapsed_ms(end).unwrap_or(0.0));
            let entry = totals.entry(label).or_default();
            entry.0 += 1;
            entry.1 += milliseconds;
            entry.2 += host.as_secs_f64() * 1000.0;
        }
        let sum: f64 = totals.values().map(|(_, total, _)| total).sum();
        let host_sum: f64 = totals.values().map(|(_, _, host)| host).sum();
        let mut rows: Vec<_> = totals.into_iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let mut table = format!(
            "cuda profile ({} operations timed, {} of the first step not): {:.3} ms on the GPU, \
             {:.3} ms on the host enqueueing it\n\
             {:<32} {:>8} {:>11} {:>10} {:>6} {:>12}\n",
            self.timed.len(),
            self.skipped,
            sum,
            host_sum,
            "operation",
            "calls",
            "total ms",
            "mean us",
            "share",
            "host mean us"
        );
        for (label, (calls, total, host)) in rows {
            table.push_str(&format!(
                "{label:<32} {calls:>8} {total:>11.3} {:>10.1} {:>5.1}% {:>12.1}\n",
                1000.0 * total / calls as f64,
                100.0 * total / sum.max(f64::MIN_POSITIVE),
                1000.0 * host / calls as f64,
            ));
        }
        for note in &self.notes {
            table.push_str(note);
            table.push('\n');
        }
        table
    }
}

impl CudaBackend {
    /// Runs an operation between two timing events (after the first step), with the
    /// host's time to enqueue it.
    pub(super) fn run_timed(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        let timed = self
            .profile
            .as_mut()
            .is_some_and(|profile| profile.times(context.step));
        if !timed {
            return run_operation(self, operation, context);
        }
        let start = self
            .device
            .record_timing_event()
            .map_err(|failure| self.fail(failure))?;
        let enqueued = std::time::Instant::now();
        let result = run_operation(self, operation, context)?;
        let host = enqueued.elapsed();
        let end = self
            .device
            .record_timing_event()
            .map_err(|failure| self.fail(failure))?;
        let label = operation_label(operation, context.graph);
        if let Some(profile) = self.profile.as_mut() {
            profile.add(label, start, end, host);
        }
        Ok(result)
    }
}
