//! The executor's phase hooks (`Backend::replay_phase`, `begin_phase`, `end_phase`), with
//! which the cuda backend records its phases as CUDA graphs, exercised on the cpu backend
//! so they are tested without a GPU: a phase the backend could not record is walked again
//! with nothing of the failed walk left behind, and a replay's results stand in for the
//! walk the executor then skips.

use std::cell::RefCell;
use std::rc::Rc;

use carve_core::estimator::estimate_plan;
use carve_core::plan::{BufferId, BufferSpec, Operation, PlanStep, RunConfig, compile_step_plan};
use carve_core::validate::ValidatedJob;
use carve_engine::EngineError;
use carve_engine::backend::{Backend, OperationContext, OperationResult, PhaseEnd, PhaseKind};
use carve_engine::cpu::CpuBackend;
use carve_engine::executor::Executor;
use carve_engine::trainer::{TrainingReport, train, train_with};

mod support;
use support::{assert_close, data, job, options_with_config};

const SMALL_CNN: &str = include_str!("specs/small-cnn.toml");

/// What the wrapper does with the micro-batch and update phases from the second step on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// The first walk of each is a failed recording: nothing runs, `end_phase` asks for
    /// the walk again.
    FailEveryRecording,
    /// Each is "replayed": the wrapper runs the phase itself and the executor skips it.
    ReplayEveryPhase,
    /// Every walk is a failed recording: a backend that never lets a phase end.
    FailForever,
}

/// What the hooked backend saw.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    dry_operations: usize,
    walks_again: usize,
    replays: usize,
}

/// The cpu backend behind the phase hooks; the counts are shared so the test reads them
/// after training consumed the executor.
struct Hooked {
    inner: CpuBackend,
    behaviour: Behaviour,
    /// Set between `begin_phase` and `end_phase` of a walk that must not run.
    dry: bool,
    /// Set after a failed recording: the walk again must run.
    walking_again: bool,
    counts: Rc<RefCell<Counts>>,
}

fn recordable(kind: PhaseKind, context: &OperationContext<'_>) -> bool {
    matches!(kind, PhaseKind::MicroBatch | PhaseKind::Update) && context.step >= 1
}

impl Backend for Hooked {
    fn name(&self) -> &'static str {
        "cpu behind phase hooks"
    }

    fn create_buffer(&mut self, buffer: &BufferSpec, offset: u64) -> Result<(), EngineError> {
        self.inner.create_buffer(buffer, offset)
    }

    fn release_buffer(&mut self, id: BufferId) {
        self.inner.release_buffer(id)
    }

    fn run(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        if self.dry {
            self.counts.borrow_mut().dry_operations += 1;
            return Ok(OperationResult::default());
        }
        self.inner.run(operation, context)
    }

    fn write_f32(&mut self, id: BufferId, values: &[f32]) -> Result<(), EngineError> {
        self.inner.write_f32(id, values)
    }

    fn write_i32(&mut self, id: BufferId, values: &[i32]) -> Result<(), EngineError> {
        self.inner.write_i32(id, values)
    }

    fn read_f32(&self, id: BufferId) -> Result<Vec<f32>, EngineError> {
        self.inner.read_f32(id)
    }

    fn replay_phase(
        &mut self,
        kind: PhaseKind,
        context: &OperationContext<'_>,
    ) -> Result<Option<OperationResult>, EngineError> {
        if self.behaviour != Behaviour::ReplayEveryPhase || !recordable(kind, context) {
            return Ok(None);
        }
        // The replay is this phase's work done without the executor: the same buffers
        // (the cpu backend ignores offsets) and operations, with the results summed.
        let plan = context.plan;
        let phase = match kind {
            PhaseKind::MicroBatch => &plan.micro_batch,
            _ => &plan.update,
        };
        let mut context = OperationContext {
            plan,
            graph: context.graph,
            optimizer: context.optimizer,
            seed: context.seed,
            step: context.step,
            micro_batch: context.micro_batch,
            samples: context.samples,
            loss_gradient_scale: context.loss_gradient_scale,
            optimizer_update_number: context.optimizer_update_number,
            loss_scaler: &mut carve_engine::kernels::optimizer::LossScaler::disabled(),
            apply_update: &mut true,
        };
        let mut total = OperationResult::default();
        for step in phase {
            match step {
                PlanStep::Allocate(id) => self.inner.create_buffer(plan.buffer(*id), 0)?,
                PlanStep::Free(id) => self.inner.release_buffer(*id),
                PlanStep::Run(operation) => {
                    let result = self.inner.run(operation, &mut context)?;
                    if let Some(loss) = result.loss_sum {
                        total.loss_sum = Some(total.loss_sum.unwrap_or(0.0) + loss);
                    }
                    if let Some(correct) = result.correct {
                        total.correct = Some(total.correct.unwrap_or(0) + correct);
                    }
                }
            }
        }
        self.counts.borrow_mut().replays += 1;
        Ok(Some(total))
    }

    fn begin_phase(
        &mut self,
        kind: PhaseKind,
        context: &OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let walking_again = std::mem::take(&mut self.walking_again);
        self.dry = recordable(kind, context)
            && match self.behaviour {
                Behaviour::FailEveryRecording => !walking_again,
                Behaviour::FailForever => true,
                Behaviour::ReplayEveryPhase => false,
            };
        Ok(())
    }

    fn end_phase(&mut self, _kind: PhaseKind, completed: bool) -> Result<PhaseEnd, EngineError> {
        if std::mem::take(&mut self.dry) && completed {
            self.counts.borrow_mut().walks_again += 1;
            self.walking_again = true;
            return Ok(PhaseEnd::RunAgain);
        }
        Ok(PhaseEnd::Done(None))
    }
}

/// Trains `job` with `config` through the hooked backend; the report and the counts.
fn train_hooked(
    job: &ValidatedJob,
    config: RunConfig,
    behaviour: Behaviour,
) -> (TrainingReport, Counts) {
    let (report, counts) = try_train_hooked(job, config, behaviour);
    (report.unwrap(), counts)
}

fn try_train_hooked(
    job: &ValidatedJob,
    config: RunConfig,
    behaviour: Behaviour,
) -> (Result<TrainingReport, EngineError>, Counts) {
    let options = options_with_config(job, config);
    let plan = compile_step_plan(job, &options.config).unwrap();
    let estimate = estimate_plan(&plan);
    let counts = Rc::new(RefCell::new(Counts::default()));
    let backend = Hooked {
        inner: CpuBackend::new(),
        behaviour,
        dry: false,
        walking_again: false,
        counts: Rc::clone(&counts),
    };
    let executor = Executor::new(&plan, options.slice_bytes, backend);
    let report = train_with(
        job,
        &data(job),
        &options,
        plan,
        estimate,
        executor,
        &mut |_| {},
    );
    let counts = *counts.borrow();
    (report, counts)
}

fn plain(job: &ValidatedJob, config: RunConfig) -> TrainingReport {
    train(
        job,
        &data(job),
        &options_with_config(job, config),
        &mut |_| {},
    )
    .unwrap()
}

#[test]
fn a_phase_that_could_not_be_recorded_is_walked_again_with_nothing_of_the_failed_walk_left() {
    let job = job(SMALL_CNN);
    let mut config = RunConfig::from_spec(&job.spec);
    config.micro_batch_size = config.batch_size / 2;
    let expected = plain(&job, config);
    let (report, counts) = train_hooked(&job, config, Behaviour::FailEveryRecording);
    assert!(
        counts.dry_operations > 0 && counts.walks_again > 0,
        "{counts:?}"
    );
    assert_eq!(report.peak_bytes, report.estimate.peak_bytes);
    assert_eq!(report.peak_bytes, expected.peak_bytes);
    assert_eq!(report.final_loss, expected.final_loss);
    assert_close(
        "walked again",
        &expected.parameters,
        &report.parameters,
        0.0,
    );
}

#[test]
fn a_replayed_phase_gives_its_results_and_the_executor_does_not_walk_it() {
    let job = job(SMALL_CNN);
    let mut config = RunConfig::from_spec(&job.spec);
    config.micro_batch_size = config.batch_size / 2;
    let expected = plain(&job, config);
    let (report, counts) = train_hooked(&job, config, Behaviour::ReplayEveryPhase);
    // Two micro-batches and an update per step, from the second step on.
    let steps = expected.steps;
    assert_eq!(counts.replays as u64, 3 * (steps - 1), "{counts:?}");
    assert_eq!(counts.walks_again, 0);
    assert_eq!(report.final_loss, expected.final_loss);
    assert_close("replayed", &expected.parameters, &report.parameters, 0.0);
}

#[test]
fn a_backend_that_asks_to_walk_a_phase_again_twice_is_an_error_not_a_hang() {
    let job = job(SMALL_CNN);
    let config = RunConfig::from_spec(&job.spec);
    let (result, counts) = try_train_hooked(&job, config, Behaviour::FailForever);
    let error = result.unwrap_err().to_string();
    assert!(error.contains("again twice"), "{error}");
    assert_eq!(counts.walks_again, 2);
}
