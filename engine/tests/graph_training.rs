//! Graph models (residual adds, a concat, a tensor read by several layers) trained end to
//! end on the cpu backend: the measured peak is the estimate at every precision, with
//! recomputation and with accumulation, and the graph's backward agrees with itself when
//! the batch is split or activations are recomputed.

use carve_core::estimator::estimate_job;
use carve_core::spec::Precision;
use carve_core::validate::ValidatedJob;
use carve_engine::trainer::{TrainingOptions, TrainingReport, train};

mod support;
use support::{assert_close, data, job, options_with_config};

const SMALL_RESNET: &str = include_str!("specs/small-resnet.toml");
const SMALL_MOBILENET: &str = include_str!("specs/small-mobilenet.toml");

fn options(job: &ValidatedJob) -> TrainingOptions {
    options_with_config(job, carve_core::plan::RunConfig::from_spec(&job.spec))
}

/// Trains in a slice of exactly the estimate's required bytes and checks the allocator's
/// peak is the estimate's.
fn run_at_estimate(job: &ValidatedJob, mut options: TrainingOptions, what: &str) -> TrainingReport {
    let estimate = estimate_job(job, &options.config).unwrap();
    options.slice_bytes = estimate.required_bytes;
    let report = train(job, &data(job), &options, &mut |_| {}).unwrap();
    assert_eq!(report.peak_bytes, estimate.peak_bytes, "{what}");
    report
}

#[test]
fn a_graph_model_peaks_exactly_at_its_estimate_in_every_configuration() {
    for text in [SMALL_RESNET, SMALL_MOBILENET] {
        peaks_at_estimate_in_every_configuration(&job(text));
    }
}

fn peaks_at_estimate_in_every_configuration(job: &ValidatedJob) {
    let job = job.clone();
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        for micro_batch_size in [16, 4] {
            for recompute in [None, Some(1), Some(3)] {
                let mut options = options(&job);
                options.config.precision = precision;
                options.config.micro_batch_size = micro_batch_size;
                options.config.recompute_segment_layers = recompute;
                let what =
                    format!("{precision} micro-batch {micro_batch_size} recompute {recompute:?}");
                let report = run_at_estimate(&job, options, &what);
                assert!(
                    report
                        .parameters
                        .iter()
                        .all(|tensor| tensor.values.iter().all(|value| value.is_finite())),
                    "{what}"
                );
            }
        }
    }
}

#[test]
fn a_graph_model_trains_the_same_split_or_recomputed() {
    // Batch norm's statistics are per micro-batch, so splitting changes its training.
    let job = job(&SMALL_RESNET.replace("{ batch_norm = {} },", "{ tanh = {} },"));
    let whole = run_at_estimate(&job, options(&job), "whole");
    let mut split = options(&job);
    split.config.micro_batch_size = 4;
    let split = run_at_estimate(&job, split, "split");
    assert_close("accumulation", &whole.parameters, &split.parameters, 1e-4);
    for segment in [1, 2, 5] {
        let mut recompute = options(&job);
        recompute.config.recompute_segment_layers = Some(segment);
        let recomputed = run_at_estimate(&job, recompute, "recompute");
        assert_close(
            "recomputation",
            &whole.parameters,
            &recomputed.parameters,
            1e-6,
        );
    }
}

#[test]
fn a_graph_model_learns() {
    let text = SMALL_RESNET.replace("steps = 6", "steps = 40");
    let job = job(&text);
    let mut losses = Vec::new();
    train(&job, &data(&job), &options(&job), &mut |progress| {
        losses.push(progress.loss)
    })
    .unwrap();
    let early: f64 = losses[..5].iter().sum::<f64>() / 5.0;
    let late: f64 = losses[losses.len() - 5..].iter().sum::<f64>() / 5.0;
    assert!(
        late < early * 0.8,
        "loss went from {early} to {late}: {losses:?}"
    );
}
