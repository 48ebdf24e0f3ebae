//! Estimator tests against byte counts worked out by hand, and the properties that make
//! the estimate trustworthy: replaying a plan step by step gives the same peak, and the
//! shrink planner's answers really fit.

use carve_core::allocator::SliceAllocator;
use carve_core::estimator::{estimate_job, estimate_plan, try_plan_in_slice};
use carve_core::plan::{
    CONVOLUTION_WORKSPACE_HEADROOM, MemoryCategory, PlanStep, RunConfig, StepPlan,
    compile_step_plan,
};
use carve_core::shrink::{OomObservation, plan_shrink};
use carve_core::spec::{Precision, ShrinkStrategy};
use carve_core::validate::{ValidatedJob, load_job_spec_toml};
use carve_core::{CoreError, allocator::OutOfMemory};

fn job(model: &str, training: &str, extra: &str) -> ValidatedJob {
    let text = format!(
        "name = \"test\"\n[model]\n{model}\n[training]\n{training}\n[data]\nformat = \"synthetic\"\nsamples = 64\nprefetch_batches = 1\n{extra}"
    );
    load_job_spec_toml(&text).unwrap_or_else(|error| panic!("{error}\n{text}"))
}

fn category(estimate: &carve_core::estimator::MemoryEstimate, wanted: MemoryCategory) -> u64 {
    estimate
        .by_category
        .iter()
        .find(|(category, _)| *category == wanted)
        .map(|(_, bytes)| *bytes)
        .unwrap()
}

const DENSE_ONLY: &str =
    "input_shape = [4]\nloss = \"softmax_cross_entropy\"\nlayers = [{ dense = { units = 3 } }]";

#[test]
fn dense_only_sgd_fp32_by_hand() {
    let job = job(
        DENSE_ONLY,
        "batch_size = 2\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1 } }",
        "",
    );
    let estimate = estimate_job(&job, &RunConfig::from_spec(&job.spec)).unwrap();
    // Every buffer is below 256 bytes, so each takes one 256-byte unit.
    // Persistent: kernel, bias, their gradients, one input slot and one target slot.
    assert_eq!(estimate.persistent_bytes, 6 * 256);
    // Loss forward holds the logits, the loss value and the probabilities at once.
    assert_eq!(estimate.peak_bytes, 9 * 256);
    assert_eq!(estimate.required_bytes, 9 * 256);
    assert_eq!(category(&estimate, MemoryCategory::Weights), 512);
    assert_eq!(category(&estimate, MemoryCategory::Gradients), 512);
    assert_eq!(category(&estimate, MemoryCategory::OptimizerState), 0);
    assert_eq!(category(&estimate, MemoryCategory::InputBatches), 512);
    assert_eq!(category(&estimate, MemoryCategory::Activations), 512);
    assert_eq!(category(&estimate, MemoryCategory::Transients), 256);
    assert_eq!(estimate.peak_during, "loss forward");
    let by_category_total: u64 = estimate.by_category.iter().map(|(_, bytes)| bytes).sum();
    let by_layer_total: u64 = estimate.by_layer.iter().map(|layer| layer.bytes).sum();
    assert_eq!(by_category_total, estimate.peak_bytes);
    assert_eq!(by_layer_total, estimate.peak_bytes);
}

#[test]
fn adam_adds_two_fp32_moments_per_parameter() {
    let sgd = job(
        DENSE_ONLY,
        "batch_size = 2\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1 } }",
        "",
    );
    let momentum = job(
        DENSE_ONLY,
        "batch_size = 2\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1, momentum = 0.9 } }",
        "",
    );
    let adam = job(
        DENSE_ONLY,
        "batch_size = 2\nsteps = 1\noptimizer = { adam = { learning_rate = 0.001 } }",
        "",
    );
    let peak = |job: &ValidatedJob| {
        estimate_job(job, &RunConfig::from_spec(&job.spec))
            .unwrap()
            .peak_bytes
    };
    assert_eq!(peak(&momentum) - peak(&sgd), 2 * 256);
    assert_eq!(peak(&adam) - peak(&sgd), 4 * 256);
}

#[test]
fn mixed_precision_keeps_fp32_masters_and_half_weights() {
    for precision in ["fp16", "bf16"] {
        let job = job(
            DENSE_ONLY,
            &format!(
                "batch_size = 2\nsteps = 1\noptimizer = {{ sgd = {{ learning_rate = 0.1 }} }}\nprecision = \"{precision}\""
            ),
            "",
        );
        let estimate = estimate_job(&job, &RunConfig::from_spec(&job.spec)).unwrap();
        // Half kernel and bias, fp32 masters, fp32 gradients, input and target slots.
        assert_eq!(estimate.persistent_bytes, 8 * 256, "{precision}");
        assert_eq!(category(&estimate, MemoryCategory::MasterWeights), 512);
        assert_eq!(estimate.peak_bytes, 11 * 256, "{precision}");
    }
}

#[test]
fn wide_dense_layer_by_hand() {
    let job = job(
        "input_shape = [1024]\nloss = \"softmax_cross_entropy\"\nlayers = [{ dense = { units = 256 } }]",
        "batch_size = 32\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1, momentum = 0.9 } }",
        "",
    );
    let mut config = RunConfig::from_spec(&job.spec);
    config = config.with_prefetch_batches(2);
    let estimate = estimate_job(&job, &config).unwrap();
    let kernel = 1024 * 256 * 4;
    let bias = 256 * 4;
    let input_slot = 32 * 1024 * 4;
    let target_slot = 256; // 32 i32 labels, rounded up
    let persistent = 3 * (kernel + bias) + 2 * (input_slot + target_slot);
    assert_eq!(estimate.persistent_bytes, persistent);
    // Loss forward: logits, probabilities (fp32) and the loss value.
    let logits = 32 * 256 * 4;
    assert_eq!(estimate.peak_bytes, persistent + 2 * logits + 256);
}

const ONE_CONV: &str =
    "input_shape = [8, 8, 3]\nloss = \"mse\"\nlayers = [{ conv2d = { filters = 4, kernel = 3 } }]";

#[test]
fn one_conv_layer_by_hand_with_its_workspace() {
    let job = job(
        ONE_CONV,
        "batch_size = 4\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1 } }",
        "",
    );
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).unwrap();
    // kernel 3*3*3*4 fp32 = 432 -> 512; bias 16 -> 256; same again for gradients;
    // input 4*8*8*3*4 = 3072; mse targets 4*6*6*4*4 = 2304.
    let persistent = 768 + 768 + 3072 + 2304;
    assert_eq!(estimate.persistent_bytes, persistent);
    // im2col of one sample: 3 channels * 3*3 kernel * 6*6 outputs * 4 bytes = 3888 bytes;
    // all 4 samples (15552 bytes) fit the default 256 MiB cap, and the workspace is twice
    // that (the headroom cuDNN's faster algorithms want): 31104 -> 31232.
    assert_eq!(CONVOLUTION_WORKSPACE_HEADROOM, 2);
    let output = 4 * 6 * 6 * 4 * 4;
    assert_eq!(estimate.peak_bytes, persistent + output + 31232);
    assert_eq!(category(&estimate, MemoryCategory::Workspace), 31232);

    // Under a 20000-byte cap the 4 samples' im2col still fits, its headroom only up to
    // the cap: 20000 -> 20224.
    let capped = estimate_job(&job, &config.with_workspace_limit(20000)).unwrap();
    assert_eq!(capped.peak_bytes, persistent + output + 20224);

    // A 4000-byte cap leaves room for one sample's im2col at a time, with 112 bytes of
    // headroom: 4000 -> 4096.
    let capped = estimate_job(&job, &config.with_workspace_limit(4000)).unwrap();
    assert_eq!(capped.peak_bytes, persistent + output + 4096);

    // No workspace at all: the peak moves to the loss backward (output and its gradient).
    let none = estimate_job(&job, &config.with_workspace_limit(0)).unwrap();
    assert_eq!(none.peak_bytes, persistent + 2 * output);
    assert_eq!(none.peak_during, "loss backward");
}

#[test]
fn each_precision_halves_activations_but_not_gradients() {
    let model = "input_shape = [32, 32, 3]\nloss = \"softmax_cross_entropy\"\nlayers = [
        { conv2d = { filters = 16, kernel = 3, padding = \"same\" } }, { relu = {} },
        { max_pool = { size = 2 } }, { flatten = {} }, { dense = { units = 10 } }]";
    let job = job(
        model,
        "batch_size = 64\nsteps = 1\noptimizer = { adam = { learning_rate = 0.001 } }",
        "",
    );
    let base = RunConfig::from_spec(&job.spec);
    let fp32 = estimate_job(&job, &base).unwrap();
    for precision in [Precision::Fp16, Precision::Bf16] {
        let half = estimate_job(&job, &RunConfig { precision, ..base }).unwrap();
        assert!(
            half.peak_bytes < fp32.peak_bytes,
            "{precision}: {} !< {}",
            half.peak_bytes,
            fp32.peak_bytes
        );
        assert_eq!(
            category(&half, MemoryCategory::Gradients),
            category(&fp32, MemoryCategory::Gradients),
            "gradients stay fp32"
        );
        assert!(category(&half, MemoryCategory::MasterWeights) > 0);
    }
}

/// Runs a plan the way the engine will, `accumulation_steps` micro-batches per step, and
/// returns the allocator's peak.
fn execute_plan_bookkeeping(plan: &StepPlan, steps: usize, limit: u64) -> Result<u64, OutOfMemory> {
    let mut allocator = SliceAllocator::new(limit);
    let mut offsets = vec![None; plan.buffers.len()];
    let mut run = |phase: &[PlanStep], allocator: &mut SliceAllocator| -> Result<(), OutOfMemory> {
        for step in phase {
            match step {
                PlanStep::Allocate(id) => {
                    offsets[id.0] = Some(allocator.allocate(plan.buffer(*id).bytes)?.offset);
                }
                PlanStep::Free(id) => {
                    allocator.free(offsets[id.0].take().unwrap()).unwrap();
                }
                PlanStep::Run(_) => {}
            }
        }
        Ok(())
    };
    run(&plan.setup, &mut allocator)?;
    for _ in 0..steps {
        for _ in 0..plan.config.accumulation_steps() {
            run(&plan.micro_batch, &mut allocator)?;
        }
        run(&plan.update, &mut allocator)?;
    }
    Ok(allocator.peak_in_use())
}

fn resnet_style() -> ValidatedJob {
    let model = "input_shape = [32, 32, 3]\nloss = \"softmax_cross_entropy\"\nlayers = [
        { conv2d = { filters = 32, kernel = 3, padding = \"same\" } }, { batch_norm = {} }, { relu = {} },
        { conv2d = { filters = 32, kernel = 3, padding = \"same\" } }, { batch_norm = {} }, { relu = {} },
        { max_pool = { size = 2 } },
        { conv2d = { filters = 64, kernel = 3, padding = \"same\" } }, { batch_norm = {} }, { relu = {} },
        { conv2d = { filters = 64, kernel = 3, padding = \"same\" } }, { batch_norm = {} }, { relu = {} },
        { dropout = { rate = 0.2 } },
        { global_avg_pool = {} }, { dense = { units = 10 } }]";
    job(
        model,
        "batch_size = 64\nsteps = 1\noptimizer = { adamw = { learning_rate = 0.001 } }\naccumulation_steps = 4",
        "",
    )
}

#[test]
fn executing_many_steps_peaks_exactly_at_the_estimate() {
    let job = resnet_style();
    let base = RunConfig::from_spec(&job.spec);
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        for recompute in [None, Some(2), Some(3), Some(5)] {
            let config = RunConfig {
                precision,
                recompute_segment_layers: recompute,
                ..base
            };
            let plan = compile_step_plan(&job, &config).unwrap();
            let estimate = estimate_plan(&plan);
            let executed = execute_plan_bookkeeping(&plan, 3, u64::MAX).unwrap();
            assert_eq!(executed, estimate.peak_bytes, "{config}");
            // The required size really runs it, three whole steps long.
            execute_plan_bookkeeping(&plan, 3, estimate.required_bytes).unwrap();
            assert!(estimate.required_bytes >= estimate.peak_bytes);
        }
    }
}

#[test]
fn recomputation_keeps_fewer_activations() {
    let job = resnet_style();
    // Without workspace, so that activations dominate as they do in deep models.
    let base = RunConfig::from_spec(&job.spec).with_workspace_limit(0);
    let full = estimate_job(&job, &base).unwrap();
    let recomputed = estimate_job(
        &job,
        &RunConfig {
            recompute_segment_layers: Some(4),
            ..base
        },
    )
    .unwrap();
    assert!(
        category(&recomputed, MemoryCategory::Activations)
            < category(&full, MemoryCategory::Activations),
        "{} !< {}",
        category(&recomputed, MemoryCategory::Activations),
        category(&full, MemoryCategory::Activations)
    );
    assert!(recomputed.peak_bytes < full.peak_bytes);
    // Every backward op must still find the buffers it reads: the plan frees nothing early.
    let plan = compile_step_plan(&job, &recomputed.config).unwrap();
    assert_every_read_is_live(&plan);
}

fn assert_every_read_is_live(plan: &StepPlan) {
    let mut live = vec![false; plan.buffers.len()];
    for phase in [
        &plan.setup,
        &plan.micro_batch,
        &plan.update,
        &plan.evaluation,
    ] {
        for step in phase {
            match step {
                PlanStep::Allocate(id) => {
                    assert!(!live[id.0], "buffer {id:?} allocated twice");
                    live[id.0] = true;
                }
                PlanStep::Free(id) => {
                    assert!(live[id.0], "buffer {id:?} freed while not live");
                    live[id.0] = false;
                }
                PlanStep::Run(operation) => {
                    for id in operation
                        .reads
                        .iter()
                        .chain(&operation.writes)
                        .chain(&operation.scratch)
                    {
                        assert!(
                            live[id.0],
                            "{:?} touches {id:?}, which is not live",
                            operation.kind
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn every_plan_touches_only_live_buffers() {
    let job = resnet_style();
    let base = RunConfig::from_spec(&job.spec);
    for precision in [Precision::Fp32, Precision::Fp16] {
        for recompute in [None, Some(1), Some(2), Some(7), Some(16)] {
            let plan = compile_step_plan(
                &job,
                &RunConfig {
                    precision,
                    recompute_segment_layers: recompute,
                    ..base
                },
            )
            .unwrap();
            assert_every_read_is_live(&plan);
        }
    }
}

#[test]
fn micro_batches_shrink_activations_not_persistent_memory() {
    let job = resnet_style();
    let base = RunConfig::from_spec(&job.spec);
    let sixteen = estimate_job(&job, &base).unwrap();
    let four = estimate_job(
        &job,
        &RunConfig {
            micro_batch_size: 4,
            ..base
        },
    )
    .unwrap();
    assert!(four.peak_bytes < sixteen.peak_bytes);
    assert_eq!(
        category(&four, MemoryCategory::Gradients),
        category(&sixteen, MemoryCategory::Gradients)
    );
}

const BIG_IMAGE_CONV: &str =
    "input_shape = [1024, 1024, 3]\nloss = \"softmax_cross_entropy\"\nlayers = [
    { conv2d = { filters = 32, kernel = 3, padding = \"same\" } }, { relu = {} },
    { global_avg_pool = {} }, { dense = { units = 10 } }]";

#[test]
fn the_tensorflow_conv_report_does_not_fit_sixteen_gib_and_is_shrunk_to_fit() {
    let job = job(
        BIG_IMAGE_CONV,
        "batch_size = 256\nsteps = 1\noptimizer = { adam = { learning_rate = 0.001 } }",
        "",
    );
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).unwrap();
    let slice = 16u64 << 30;
    assert!(
        estimate.required_bytes > slice,
        "{}",
        estimate.required_bytes
    );
    // What the engine would report at the moment it ran out.
    let plan = compile_step_plan(&job, &config).unwrap();
    let report = try_plan_in_slice(&plan, slice).unwrap_err();
    assert_eq!(report.limit, slice);
    let observation = OomObservation {
        report,
        estimated_required_bytes: estimate.required_bytes,
    };
    let decision = plan_shrink(&job, &config, Some(&observation), slice).unwrap();
    assert!(decision.estimate.required_bytes <= slice);
    assert_eq!(
        decision.config.batch_size, 256,
        "the effective batch is kept"
    );
    assert_eq!(decision.steps[0].strategy, ShrinkStrategy::MixedPrecision);
    let plan = compile_step_plan(&job, &decision.config).unwrap();
    execute_plan_bookkeeping(&plan, 2, slice).unwrap();
}

#[test]
fn the_planner_picks_the_largest_micro_batch_that_fits() {
    let job = job(
        BIG_IMAGE_CONV,
        "batch_size = 64\nsteps = 1\noptimizer = { sgd = { learning_rate = 0.1 } }",
        "[oom]\nstrategies = [\"accumulate\"]",
    );
    let config = RunConfig::from_spec(&job.spec);
    let slice = 4u64 << 30;
    let decision = plan_shrink(&job, &config, None, slice).unwrap();
    let chosen = decision.config.micro_batch_size;
    assert!(decision.estimate.required_bytes <= slice);
    // The next larger divisor of 64 would not have fit.
    let larger = (chosen + 1..=64).find(|micro| 64 % micro == 0).unwrap();
    let larger_estimate = estimate_job(
        &job,
        &RunConfig {
            micro_batch_size: larger,
            ..config
        },
    )
    .unwrap();
    assert!(larger_estimate.required_bytes > slice);
}

#[test]
fn a_config_that_fits_is_left_alone() {
    let job = resnet_style();
    let config = RunConfig::from_spec(&job.spec);
    let decision = plan_shrink(&job, &config, None, 16 << 30).unwrap();
    assert_eq!(decision.config, config);
    assert!(decision.steps.is_empty());
}

#[test]
fn nothing_fits_gives_the_numbers() {
    let job = job(
        BIG_IMAGE_CONV,
        "batch_size = 256\nsteps = 1\noptimizer = { adam = { learning_rate = 0.001 } }",
        "[oom]\nstrategies = [\"mixed_precision\"]",
    );
    let config = RunConfig::from_spec(&job.spec);
    let error = plan_shrink(&job, &config, None, 1 << 30).unwrap_err();
    match &error {
        CoreError::DoesNotFit {
            available_bytes,
            smallest_required_bytes,
            smallest_config,
            ..
        } => {
            assert_eq!(*available_bytes, 1 << 30);
            assert!(*smallest_required_bytes > 1 << 30);
            assert!(smallest_config.contains("fp16"), "{smallest_config}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn an_oom_the_estimator_missed_leaves_a_margin() {
    let job = resnet_style();
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).unwrap();
    // The attempt died although the estimate fit: 1 MiB was taken by something unseen.
    let slice = estimate.required_bytes + (512 << 10);
    let observation = OomObservation {
        report: OutOfMemory {
            requested: 2 << 20,
            in_use: estimate.required_bytes - (512 << 10),
            limit: slice,
            largest_free: 1 << 20,
            peak: estimate.required_bytes - (512 << 10),
        },
        estimated_required_bytes: estimate.required_bytes,
    };
    assert_eq!(observation.unaccounted_bytes(), (2 << 20) - (512 << 10));
    let decision = plan_shrink(&job, &config, Some(&observation), slice).unwrap();
    assert_eq!(
        decision.budget_bytes,
        slice - observation.unaccounted_bytes()
    );
    assert!(decision.estimate.required_bytes <= decision.budget_bytes);
    assert_ne!(decision.config, config);
}

#[test]
fn an_attempt_that_had_less_than_its_slice_is_shrunk_to_what_it_had() {
    let job = resnet_style();
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).unwrap();
    let slice = estimate.required_bytes;
    // The reservation came up a third short; the step ran out inside what it got.
    let plan = compile_step_plan(&job, &config).unwrap();
    let report = try_plan_in_slice(&plan, slice / 3 * 2).unwrap_err();
    let observation = OomObservation {
        report,
        estimated_required_bytes: estimate.required_bytes,
    };
    let decision = plan_shrink(&job, &config, Some(&observation), slice).unwrap();
    assert_eq!(decision.budget_bytes, slice / 3 * 2);
    assert!(decision.estimate.required_bytes <= slice / 3 * 2);
    assert_ne!(decision.config, config);
}
