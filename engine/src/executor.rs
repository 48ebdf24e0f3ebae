//! The plan interpreter: walks a `StepPlan`'s phases, placing every buffer through the
//! slice allocator and running every operation on a backend.
//!
//! The allocator here is the same `SliceAllocator` the estimator replays, driven by the
//! same plan, so the peak measured here is the estimate. When an allocation fails the
//! executor frees everything it holds (the persistent buffers too) before returning the
//! `OutOfMemory` report, so an attempt that runs out of memory leaves the slice empty.

use carve_core::allocator::SliceAllocator;
use carve_core::plan::{BufferId, PlanStep, StepPlan};

use crate::backend::{Backend, OperationContext, OperationResult, PhaseEnd, PhaseKind};
use crate::error::EngineError;

/// Totals of one phase run.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTotals {
    pub loss_sum: f64,
    pub correct: usize,
    pub has_accuracy: bool,
}

impl PhaseTotals {
    fn add(&mut self, result: OperationResult) {
        if let Some(loss_sum) = result.loss_sum {
            self.loss_sum += loss_sum;
        }
        if let Some(correct) = result.correct {
            self.correct += correct;
            self.has_accuracy = true;
        }
    }
}

/// Runs a plan's phases on a backend inside a slice of `limit` bytes.
#[derive(Debug)]
pub struct Executor<B: Backend> {
    allocator: SliceAllocator,
    backend: B,
    /// Offset of every live buffer, by id.
    offsets: Vec<Option<u64>>,
}

impl<B: Backend> Executor<B> {
    pub fn new(plan: &StepPlan, limit: u64, backend: B) -> Self {
        Executor {
            allocator: SliceAllocator::new(limit),
            backend,
            offsets: vec![None; plan.buffers.len()],
        }
    }

    pub fn allocator(&self) -> &SliceAllocator {
        &self.allocator
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Runs one phase (`kind` says which). On `OutOfMemory` everything is released before
    /// returning.
    pub fn run_phase(
        &mut self,
        plan: &StepPlan,
        kind: PhaseKind,
        phase: &[PlanStep],
        context: &mut OperationContext<'_>,
    ) -> Result<PhaseTotals, EngineError> {
        let mut totals = PhaseTotals::default();
        if let Some(result) = self.backend.replay_phase(kind, context)? {
            totals.add(result);
            return Ok(totals);
        }
        // A phase the backend tried to record and could not is walked again, plainly:
        // every phase frees what it allocates, so the allocator is back where it was. Only
        // once: a backend asking again would otherwise never end the phase.
        let mut walked_again = false;
        loop {
            self.backend.begin_phase(kind, context)?;
            let walked = self.walk_phase(plan, phase, context);
            let end = self.backend.end_phase(kind, walked.is_ok());
            let walked = walked?;
            match end? {
                PhaseEnd::Done(held_back) => {
                    let mut totals = walked;
                    if let Some(result) = held_back {
                        totals.add(result);
                    }
                    return Ok(totals);
                }
                PhaseEnd::RunAgain if !walked_again => walked_again = true,
                PhaseEnd::RunAgain => {
                    return Err(EngineError::Backend(format!(
                        "{} backend asked to walk the {kind:?} phase again twice",
                        self.backend.name()
                    )));
                }
            }
        }
    }

    fn walk_phase(
        &mut self,
        plan: &StepPlan,
        phase: &[PlanStep],
        context: &mut OperationContext<'_>,
    ) -> Result<PhaseTotals, EngineError> {
        let mut totals = PhaseTotals::default();
        for step in phase {
            match step {
                PlanStep::Allocate(id) => {
                    if let Err(error) = self.allocate(plan, *id) {
                        self.release_everything();
                        return Err(error);
                    }
                }
                PlanStep::Free(id) => self.free(*id),
                PlanStep::Run(operation) => match self.backend.run(operation, context) {
                    Ok(result) => totals.add(result),
                    Err(error) => {
                        self.release_everything();
                        return Err(error);
                    }
                },
            }
        }
        Ok(totals)
    }

    fn allocate(&mut self, plan: &StepPlan, id: BufferId) -> Result<(), EngineError> {
        let buffer = plan.buffer(id);
        let allocation = self.allocator.allocate(buffer.bytes)?;
        self.offsets[id.0] = Some(allocation.offset);
        self.backend.create_buffer(buffer, allocation.offset)
    }

    fn free(&mut self, id: BufferId) {
        if let Some(offset) = self.offsets[id.0].take() {
            // The offset came from this allocator and is freed once: `take` above.
            let _ = self.allocator.free(offset);
            self.backend.release_buffer(id);
        }
    }

    /// Frees every live buffer: the attempt is over.
    pub fn release_everything(&mut self) {
        for index in 0..self.offsets.len() {
            self.free(BufferId(index));
        }
    }
}
