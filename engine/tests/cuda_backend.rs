//! The training suite against both backends: every model, precision and optimizer here
//! trains on the cpu backend, and — where `CudaBackend::available()` — on the GPU too,
//! and the two must agree (fp32 within 1e-4 of the largest magnitude of each tensor, half
//! precisions within what their rounding allows).
//!
//! Without CUDA each comparison prints "skipped: CUDA not available: <reason>" and checks
//! only the cpu side, plus that the cuda backend refuses cleanly with that reason: these
//! tests then report that they did not run on CUDA rather than pretending they did.

use carve_core::estimator::estimate_job;
use carve_core::plan::RunConfig;
use carve_core::spec::Precision;
use carve_core::validate::ValidatedJob;
use carve_engine::EngineError;
use carve_engine::cuda::{CudaBackend, CudaOptions, CudaTuning, train_on_cuda_with};
use carve_engine::trainer::{TrainingOptions, train};

mod support;
use support::{assert_close, data, job, options_with_config};

fn options(job: &ValidatedJob, precision: Precision) -> TrainingOptions {
    let config = RunConfig {
        precision,
        ..RunConfig::from_spec(&job.spec)
    };
    options_with_config(job, config)
}

/// `Some(reason)` when the cuda side must be skipped, printing the line the issue asks for.
/// The switches of `CARVE_CUDA_TUNING` (so a GPU check can run the suite with each
/// change on and off), always with the fp32 math that matches the cpu backend.
fn strict() -> CudaTuning {
    CudaTuning::from_environment()
        .expect("CARVE_CUDA_TUNING parses")
        .strict()
}

fn cuda_skipped() -> Option<String> {
    match CudaBackend::available() {
        Ok(()) => None,
        Err(reason) => {
            println!("skipped: CUDA not available: {reason}");
            Some(reason)
        }
    }
}

/// How far the backends may drift after a few steps in each precision: fp32 differs
/// only by summation order; half precisions round each activation to 11 or 8 bits, and a
/// different summation order can flip a rounding.
fn tolerance(precision: Precision) -> f32 {
    match precision {
        Precision::Fp32 => 1e-4,
        Precision::Fp16 => 2e-2,
        Precision::Bf16 => 1e-1,
    }
}

/// Trains on the cpu and, when there is one, on the GPU, and compares.
fn compare_backends(label: &str, text: &str, precision: Precision) {
    let job = job(text);
    let options = options(&job, precision);
    let cpu = train(&job, &data(&job), &options, &mut |_| {})
        .unwrap_or_else(|error| panic!("{label}: cpu training failed: {error}"));
    assert_eq!(cpu.peak_bytes, cpu.estimate.peak_bytes, "{label}");
    assert!(cpu.final_loss.is_finite(), "{label}: cpu loss");
    if cuda_skipped().is_some() {
        return;
    }
    let (gpu, reservation) =
        train_on_cuda_with(&job, &data(&job), &options, 0, strict(), &mut |_| {})
            .unwrap_or_else(|error| panic!("{label}: cuda training failed: {error}"));
    assert_eq!(reservation.reserved_bytes, options.slice_bytes, "{label}");
    assert!(reservation.taken_bytes() >= options.slice_bytes, "{label}");
    // Same plan, same allocator: the peak is the estimate on both backends.
    assert_eq!(gpu.peak_bytes, cpu.peak_bytes, "{label}");
    assert_eq!(gpu.skipped_steps, cpu.skipped_steps, "{label}");
    let loss_tolerance = f64::from(tolerance(precision)) * cpu.final_loss.abs().max(1.0);
    assert!(
        (gpu.final_loss - cpu.final_loss).abs() <= loss_tolerance,
        "{label}: loss cpu {} cuda {}",
        cpu.final_loss,
        gpu.final_loss
    );
    if let (Some(cpu_accuracy), Some(gpu_accuracy)) = (cpu.test_accuracy, gpu.test_accuracy) {
        assert!(
            (cpu_accuracy - gpu_accuracy).abs() <= 0.1,
            "{label}: accuracy"
        );
    }
    assert_close(
        label,
        &cpu.parameters,
        &gpu.parameters,
        tolerance(precision),
    );
}

/// [`compare_backends`] in fp32, fp16 and bf16, labelled `label` and the precision.
fn compare_backends_in_every_precision(label: &str, text: &str) {
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        compare_backends(&format!("{label} {}", precision.name()), text, precision);
    }
}

/// Convolutions with symmetric padding (cuDNN), a stride-2 "same" convolution with
/// asymmetric padding (cuDNN on a padded copy, or the direct kernels without a
/// workspace), pooling of both kinds, batch norm, every activation, dropout, dense
/// layers, cross-entropy with a test set.
///
/// The convolution before batch norm has no bias, as in Keras practice: batch norm
/// subtracts it again, so its true gradient is zero and both backends compute only
/// rounding noise (about 1e-9 on an H200), which Adam then scales up to full-size steps
/// of random sign. Comparing that noise would test nothing; the 1x1 convolution keeps a
/// bias that matters.
const CNN: &str = include_str!("specs/backend-cnn.toml");

#[test]
fn a_cnn_with_every_layer_kind_trains_the_same_on_both_backends() {
    compare_backends_in_every_precision("cnn", CNN);
}

/// With a workspace the stride-2 "same" convolution (asymmetric padding) runs through
/// cuDNN on a padded copy; without one, through the direct kernels. Both must match.
#[test]
fn without_a_workspace_asymmetric_convolutions_run_the_direct_kernels_and_still_match() {
    let text = CNN.replace("seed = 5", "seed = 5\nworkspace_limit = \"0\"");
    let job = job(&text);
    assert_eq!(RunConfig::from_spec(&job.spec).workspace_limit_bytes(), 0);
    for precision in [Precision::Fp32, Precision::Bf16] {
        compare_backends(
            &format!("cnn without workspace {}", precision.name()),
            &text,
            precision,
        );
    }
}

#[test]
fn adam_and_adamw_train_the_same_on_both_backends() {
    for optimizer in [
        "adam = { learning_rate = 0.01 }",
        "adamw = { learning_rate = 0.01, weight_decay = 0.01 }",
    ] {
        let text = CNN.replace(
            "sgd = { learning_rate = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.0005 }",
            optimizer,
        );
        compare_backends(optimizer, &text, Precision::Fp32);
    }
}

#[test]
fn global_pooling_and_mean_squared_error_train_the_same_on_both_backends() {
    let text = include_str!("specs/backend-regression.toml");
    compare_backends_in_every_precision("mse", text);
}

#[test]
fn micro_batches_and_recomputation_match_across_backends() {
    let job_text = CNN.replace("{ dropout = { rate = 0.25 } },", "");
    let job = job(&job_text);
    let mut options = options(&job, Precision::Fp32);
    options.config.micro_batch_size = 4;
    options.config.recompute_segment_layers = Some(3);
    options.slice_bytes = estimate_job(&job, &options.config).unwrap().required_bytes;
    let cpu = train(&job, &data(&job), &options, &mut |_| {}).unwrap();
    assert_eq!(cpu.peak_bytes, cpu.estimate.peak_bytes);
    if cuda_skipped().is_some() {
        return;
    }
    let (gpu, _) =
        train_on_cuda_with(&job, &data(&job), &options, 0, strict(), &mut |_| {}).unwrap();
    assert_eq!(gpu.peak_bytes, cpu.peak_bytes);
    assert_close("micro-batches", &cpu.parameters, &gpu.parameters, 1e-4);
}

#[test]
fn a_slice_too_small_is_out_of_memory_on_both_backends() {
    let job = job(CNN);
    let mut options = options(&job, Precision::Fp32);
    let required = options.slice_bytes;
    options.slice_bytes = required / 2;
    match train(&job, &data(&job), &options, &mut |_| {}) {
        Err(EngineError::OutOfMemory(report)) => assert_eq!(report.limit, required / 2),
        other => panic!("cpu: expected out of memory, got {other:?}"),
    }
    if cuda_skipped().is_some() {
        return;
    }
    match train_on_cuda_with(&job, &data(&job), &options, 0, strict(), &mut |_| {}) {
        Err(EngineError::OutOfMemory(report)) => assert_eq!(report.limit, required / 2),
        other => panic!("cuda: expected out of memory, got {other:?}"),
    }
}

#[test]
fn the_cuda_backend_refuses_with_the_reason_or_reserves_and_verifies_the_slice() {
    let job = job(CNN);
    let slice_bytes = 64 << 20;
    let result = CudaBackend::new(
        CudaOptions {
            device_ordinal: 0,
            slice_bytes,
            workspace_limit_bytes: 1 << 20,
            tuning: strict(),
        },
        &job.graph,
    );
    match (CudaBackend::available(), result) {
        (Err(reason), Err(EngineError::Backend(message))) => {
            println!("skipped: CUDA not available: {reason}");
            assert_eq!(message, format!("CUDA not available: {reason}"));
            assert!(
                reason.contains("not found") || reason.contains("no CUDA"),
                "the reason names what is missing: {reason}"
            );
        }
        (Ok(()), Ok(backend)) => {
            let reservation = backend.reservation();
            assert_eq!(reservation.reserved_bytes, slice_bytes);
            assert!(reservation.taken_bytes() >= slice_bytes, "{reservation}");
        }
        (availability, result) => {
            panic!("availability {availability:?} but construction gave {result:?}")
        }
    }
}

/// Graph models: residual adds (gradients summed in place), a concat, depthwise
/// convolutions with a multiplier, zero padding and relu6, in every precision.
#[test]
fn graph_models_train_the_same_on_both_backends() {
    compare_backends_in_every_precision("small-resnet", include_str!("specs/small-resnet.toml"));
    compare_backends_in_every_precision(
        "small-mobilenet",
        include_str!("specs/small-mobilenet.toml"),
    );
}
