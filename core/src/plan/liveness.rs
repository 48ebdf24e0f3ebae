//! Placing a phase's buffers by liveness: each allocated just before its first use and
//! freed just after its last, so a phase's peak is what its operations really need.

use super::{BufferId, Operation, PlanStep};

/// Turns a list of operations into plan steps: each phase-local buffer is allocated just
/// before the first operation that touches it and freed just after the last. Buffers
/// with ids below `persistent_count` belong to setup and are never freed here.
///
/// Linear in the operations' buffer references: buffer ids are dense indices into the
/// plan's buffer table, so the first and last uses live in vectors indexed by id.
pub(super) fn place_by_liveness(
    operations: Vec<Operation>,
    persistent_count: usize,
) -> Vec<PlanStep> {
    let buffer_count = operations
        .iter()
        .flat_map(buffers_in_order)
        .map(|id| id.0 + 1)
        .max()
        .unwrap_or(0);
    let mut last_use: Vec<Option<usize>> = vec![None; buffer_count];
    for (position, operation) in operations.iter().enumerate() {
        for id in buffers_in_order(operation) {
            if id.0 >= persistent_count {
                last_use[id.0] = Some(position);
            }
        }
    }
    let mut allocated = vec![false; buffer_count];
    // A buffer listed twice in its last operation is freed once.
    let mut freed = vec![false; buffer_count];
    let mut steps = Vec::with_capacity(operations.len() * 3);
    for (position, operation) in operations.into_iter().enumerate() {
        // Outputs before scratch: the workspace goes on top, where freeing it right after
        // leaves one hole that the next buffer of similar size fills.
        for id in buffers_in_order(&operation) {
            if id.0 >= persistent_count && !allocated[id.0] {
                allocated[id.0] = true;
                steps.push(PlanStep::Allocate(*id));
            }
        }
        let mut frees = Vec::new();
        for id in operation
            .scratch
            .iter()
            .chain(&operation.reads)
            .chain(&operation.writes)
        {
            if id.0 >= persistent_count && last_use[id.0] == Some(position) && !freed[id.0] {
                freed[id.0] = true;
                frees.push(PlanStep::Free(*id));
            }
        }
        steps.push(PlanStep::Run(operation));
        steps.extend(frees);
    }
    steps
}

/// Every buffer an operation touches: reads, then writes, then scratch (the order
/// buffers are allocated in).
fn buffers_in_order(operation: &Operation) -> impl Iterator<Item = &BufferId> {
    operation
        .reads
        .iter()
        .chain(&operation.writes)
        .chain(&operation.scratch)
}
