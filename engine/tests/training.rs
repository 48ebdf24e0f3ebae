//! End-to-end training on the cpu backend: the measured peak is the estimate, splitting a
//! batch into micro-batches keeps the training, resuming is exact, a model learns, and a
//! job that runs out of memory is unwound cleanly and then fits with the planner's config.

use carve_core::estimator::estimate_job;
use carve_core::plan::{RunConfig, compile_step_plan};
use carve_core::shrink::{OomObservation, plan_shrink};
use carve_core::spec::{DataFormat, Precision};
use carve_core::validate::{ValidatedJob, parse_job_spec_toml, validate_job_spec};
use carve_engine::EngineError;
use carve_engine::backend::{OperationContext, PhaseKind};
use carve_engine::cpu::CpuBackend;
use carve_engine::executor::Executor;
use carve_engine::kernels::optimizer::LossScaler;
use carve_engine::trainer::{TrainingOptions, TrainingReport, train};
use carve_testing::examples::example_spec_files;

mod support;
use support::{assert_close, data, job, options_with_config};

fn options(job: &ValidatedJob) -> TrainingOptions {
    options_with_config(job, RunConfig::from_spec(&job.spec))
}

fn run(job: &ValidatedJob, options: &TrainingOptions) -> Result<TrainingReport, EngineError> {
    train(job, &data(job), options, &mut |_| {})
}

const SMALL_CNN: &str = include_str!("specs/small-cnn.toml");

#[test]
fn accumulating_four_micro_batches_gives_the_same_weights_as_one_batch() {
    let job = job(SMALL_CNN);
    let whole = run(&job, &options(&job)).unwrap();
    let mut split_options = options(&job);
    split_options.config.micro_batch_size = 16;
    let split = run(&job, &split_options).unwrap();
    assert_close("accumulation", &whole.parameters, &split.parameters, 1e-5);
    assert!(split.peak_bytes < whole.peak_bytes);
}

#[test]
fn recomputation_gives_the_same_weights() {
    let job = job(SMALL_CNN);
    let plain = run(&job, &options(&job)).unwrap();
    let mut recompute_options = options(&job);
    recompute_options.config.recompute_segment_layers = Some(3);
    recompute_options.slice_bytes = estimate_job(&job, &recompute_options.config)
        .unwrap()
        .required_bytes;
    let recomputed = run(&job, &recompute_options).unwrap();
    assert_close(
        "recomputation",
        &plain.parameters,
        &recomputed.parameters,
        1e-6,
    );
}

#[test]
fn resuming_from_a_checkpoint_is_exact() {
    let text = SMALL_CNN
        .replace("steps = 6", "steps = 20")
        .replace(
            "{ tanh = {} },",
            "{ tanh = {} }, { dropout = { rate = 0.2 } },",
        )
        .replace(
            "sgd = { learning_rate = 0.05, momentum = 0.9 }",
            "adam = { learning_rate = 0.01 }",
        );
    let job = job(&text);
    let straight = run(&job, &options(&job)).unwrap();
    let directory = tempfile::tempdir().unwrap();
    let checkpoint = directory.path().join("run.ckpt");
    let mut first_half = options(&job);
    first_half.checkpoint_path = Some(checkpoint.clone());
    first_half.stop_after_steps = Some(10);
    let first = run(&job, &first_half).unwrap();
    assert_eq!(first.steps, 10);
    let mut second_half = options(&job);
    second_half.resume_from = Some(checkpoint);
    let resumed = run(&job, &second_half).unwrap();
    assert_eq!(resumed.steps, 20);
    for (a, b) in straight.parameters.iter().zip(&resumed.parameters) {
        assert_eq!(a.name, b.name);
        assert_eq!(a.values, b.values, "{} differs after resume", a.name);
    }
}

#[test]
fn a_small_model_learns_well_above_chance() {
    let text = include_str!("specs/learns.toml");
    let job = job(text);
    let mut losses = Vec::new();
    let report = train(&job, &data(&job), &options(&job), &mut |progress| {
        losses.push(progress.loss)
    })
    .unwrap();
    let early: f64 = losses[..5].iter().sum::<f64>() / 5.0;
    let late: f64 = losses[losses.len() - 5..].iter().sum::<f64>() / 5.0;
    assert!(late < early * 0.5, "loss went from {early} to {late}");
    let accuracy = report.test_accuracy.unwrap();
    assert!(accuracy > 0.7, "test accuracy {accuracy} (chance is 0.25)");
    assert!(report.test_loss.unwrap().is_finite());
}

#[test]
fn mixed_precision_trains_and_peaks_at_the_estimate() {
    for precision in [Precision::Fp16, Precision::Bf16] {
        let job = job(&SMALL_CNN.replace("steps = 6", "steps = 30"));
        let mut options = options(&job);
        options.config.precision = precision;
        options.slice_bytes = estimate_job(&job, &options.config).unwrap().required_bytes;
        let mut losses = Vec::new();
        let report = train(&job, &data(&job), &options, &mut |progress| {
            losses.push(progress.loss)
        })
        .unwrap();
        assert_eq!(report.peak_bytes, report.estimate.peak_bytes, "{precision}");
        assert!(
            losses.iter().all(|loss| loss.is_finite()),
            "{precision}: {losses:?}"
        );
        assert!(
            losses[losses.len() - 1] < losses[0],
            "{precision}: {losses:?}"
        );
    }
}

/// Every example, every precision: one real step's allocator peak equals the estimate.
/// Batches are cut to 2 and data made synthetic so the 1024x1024 cases run on a laptop;
/// the plan (and so the equality) is the same whatever the batch.
#[test]
fn every_example_peaks_exactly_at_its_estimate() {
    let examples = example_spec_files();
    assert!(examples.len() >= 6);
    for example in examples {
        let mut spec = parse_job_spec_toml(&std::fs::read_to_string(&example).unwrap()).unwrap();
        spec.training.batch_size = 2;
        spec.training.accumulation_steps = 1;
        spec.training.steps = Some(1);
        spec.training.epochs = None;
        spec.oom.min_micro_batch = 1;
        spec.data.format = DataFormat::Synthetic;
        spec.data.samples = Some(4);
        spec.data.test_samples = Some(2);
        spec.data.train = None;
        spec.data.test = None;
        let job = validate_job_spec(spec).unwrap();
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            let mut options = options(&job);
            options.config.precision = precision;
            let estimate = estimate_job(&job, &options.config).unwrap();
            options.slice_bytes = estimate.required_bytes;
            let report = run(&job, &options).unwrap();
            assert_eq!(
                report.peak_bytes,
                estimate.peak_bytes,
                "{} {precision}",
                example.display()
            );
        }
    }
}

#[test]
fn a_job_that_does_not_fit_runs_out_cleanly_then_fits_with_the_planners_config() {
    let job = job(&SMALL_CNN.replace("batch_size = 64", "batch_size = 128"));
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).unwrap();
    // A slice a third smaller than the step needs.
    let slice = estimate.required_bytes * 2 / 3;
    let mut options = options(&job);
    options.slice_bytes = slice;
    let report = match run(&job, &options) {
        Err(EngineError::OutOfMemory(report)) => report,
        other => panic!("expected an out-of-memory, got {other:?}"),
    };
    assert_eq!(report.limit, slice);
    assert!(report.in_use + report.requested > slice || report.largest_free < report.requested);

    // The executor itself leaves nothing behind.
    let plan = compile_step_plan(&job, &config).unwrap();
    let mut executor = Executor::new(&plan, slice, CpuBackend::new());
    let mut scaler = LossScaler::disabled();
    let mut apply = true;
    let mut context = OperationContext {
        plan: &plan,
        graph: &job.graph,
        optimizer: &job.spec.training.optimizer,
        seed: 0,
        step: 0,
        micro_batch: 0,
        samples: 128,
        loss_gradient_scale: 1.0,
        optimizer_update_number: 1,
        loss_scaler: &mut scaler,
        apply_update: &mut apply,
    };
    executor
        .run_phase(&plan, PhaseKind::Setup, &plan.setup, &mut context)
        .unwrap();
    assert!(matches!(
        executor.run_phase(
            &plan,
            PhaseKind::MicroBatch,
            &plan.micro_batch,
            &mut context
        ),
        Err(EngineError::OutOfMemory(_))
    ));
    assert_eq!(executor.allocator().in_use(), 0);
    assert_eq!(executor.allocator().live_allocations(), 0);

    let observation = OomObservation {
        report,
        estimated_required_bytes: estimate.required_bytes,
    };
    let decision = plan_shrink(&job, &config, Some(&observation), slice).unwrap();
    assert_eq!(decision.config.batch_size, 128);
    options.config = decision.config;
    let finished = run(&job, &options).unwrap();
    assert_eq!(finished.steps, 6);
    assert!(finished.peak_bytes <= slice);
}
