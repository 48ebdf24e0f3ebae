//! The fit, its predictions under precision and recomputation, refinement, and numbers
//! far beyond any GPU.

use proptest::prelude::*;

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn point(micro_batch: u64, peak_bytes: u64) -> ProfilePoint {
    ProfilePoint {
        micro_batch,
        peak_bytes,
        ran_out: false,
    }
}

fn ran_out(micro_batch: u64, peak_bytes: u64) -> ProfilePoint {
    ProfilePoint {
        ran_out: true,
        ..point(micro_batch, peak_bytes)
    }
}

fn config(micro_batch_size: u64) -> RunConfig {
    RunConfig {
        batch_size: 256,
        micro_batch_size,
        precision: Precision::Fp32,
        recompute_segment_layers: None,
        engine: None,
    }
}

fn model(fixed_bytes: u64, per_sample_bytes: u64) -> CommandMemoryModel {
    CommandMemoryModel {
        fixed_bytes,
        per_sample_bytes,
        precision: Precision::Fp32,
        recompute: false,
    }
}

#[test]
fn two_points_give_the_line_through_them() {
    let fitted = CommandMemoryModel::fit(
        &[
            point(64, GIB + 64 * 35 * MIB),
            point(32, GIB + 32 * 35 * MIB),
        ],
        Precision::Bf16,
        true,
    )
    .unwrap();
    assert_eq!(
        fitted,
        CommandMemoryModel {
            fixed_bytes: GIB,
            per_sample_bytes: 35 * MIB,
            precision: Precision::Bf16,
            recompute: true,
        }
    );
}

#[test]
fn more_points_give_the_least_squares_line() {
    // Slope (129 - 109) / 2 = 10 through the mean (2, 120.33): 100.33 + 10 x micro.
    let fitted = CommandMemoryModel::fit(
        &[point(1, 109), point(2, 123), point(3, 129)],
        Precision::Fp32,
        false,
    )
    .unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (100, 10));
}

#[test]
fn one_point_or_equal_micro_batches_put_everything_per_sample() {
    let fitted = CommandMemoryModel::fit(&[point(8, 801)], Precision::Fp32, false).unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (0, 101));
    let fitted =
        CommandMemoryModel::fit(&[point(4, 400), point(4, 480)], Precision::Fp32, false).unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (0, 120));
    let fitted = CommandMemoryModel::fit(&[point(0, 77)], Precision::Fp32, false).unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (77, 0));
}

#[test]
fn a_line_that_would_go_below_zero_is_clamped_and_covers_the_points() {
    // Memory that shrinks with the batch (noise): all fixed, at the highest peak.
    let fitted =
        CommandMemoryModel::fit(&[point(2, 1000), point(4, 900)], Precision::Fp32, false).unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (1000, 0));
    // A line with a negative intercept: all per sample, enough for every point.
    let fitted =
        CommandMemoryModel::fit(&[point(2, 100), point(4, 1000)], Precision::Fp32, false).unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (0, 250));
}

#[test]
fn a_point_that_ran_out_raises_the_line() {
    // One measured point and a lower bound: the line through both, which never
    // under-predicts a smaller micro-batch.
    let fitted = CommandMemoryModel::fit(
        &[point(32, 1320), ran_out(64, 1768)],
        Precision::Fp32,
        false,
    )
    .unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (872, 14));
    // A lower bound so high the line through both would start below 0: all of it per
    // sample, enough for both.
    let fitted = CommandMemoryModel::fit(
        &[point(32, 1320), ran_out(64, 2920)],
        Precision::Fp32,
        false,
    )
    .unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (0, 46));
    // Two measured micro-batches and a lower bound above their line: it is raised.
    let fitted = CommandMemoryModel::fit(
        &[
            point(32, 1320),
            point(16, 1160),
            ran_out(64, 1000 + 64 * 30),
        ],
        Precision::Fp32,
        false,
    )
    .unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (1000, 30));
    // A lower bound already covered changes nothing.
    let fitted = CommandMemoryModel::fit(
        &[point(32, 1320), point(16, 1160), ran_out(64, 1100)],
        Precision::Fp32,
        false,
    )
    .unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (1000, 10));
    // Only lower bounds: fitted as if measured.
    let fitted =
        CommandMemoryModel::fit(&[ran_out(8, 800), ran_out(4, 500)], Precision::Fp32, false)
            .unwrap();
    assert_eq!((fitted.fixed_bytes, fitted.per_sample_bytes), (200, 75));
}

#[test]
fn nothing_to_fit_names_the_profile() {
    let error = CommandMemoryModel::fit(&[], Precision::Fp32, false).unwrap_err();
    assert_eq!(error.field, "profile");
}

#[test]
fn need_scales_the_per_sample_part_for_precision_and_recomputation() {
    let fp32 = model(1000, 100);
    assert_eq!(fp32.need_bytes(&config(10)), 2000);
    let bf16 = RunConfig {
        precision: Precision::Bf16,
        ..config(10)
    };
    assert_eq!(fp32.need_bytes(&bf16), 1000 + 60 * 10);
    let recomputing = RunConfig {
        recompute_segment_layers: Some(1),
        ..config(10)
    };
    assert_eq!(fp32.need_bytes(&recomputing), 1000 + 50 * 10);
    let both = RunConfig {
        precision: Precision::Fp16,
        ..recomputing
    };
    assert_eq!(fp32.need_bytes(&both), 1000 + 30 * 10);
    // Measured in half precision with recomputation: going back costs more.
    let half = CommandMemoryModel {
        precision: Precision::Fp16,
        recompute: true,
        ..model(1000, 30)
    };
    assert_eq!(half.need_bytes(&config(10)), 1000 + 100 * 10);
    assert_eq!(half.need_bytes(&both), 1000 + 30 * 10);
    // fp16 and bf16 are alike.
    assert_eq!(
        half.need_bytes(&RunConfig {
            precision: Precision::Bf16,
            ..recomputing
        }),
        1300
    );
}

#[test]
fn refinement_raises_the_per_sample_part_and_never_lowers() {
    let fitted = model(1000, 100);
    let refined = fitted.refined(&config(10), 3000);
    assert_eq!(refined.fixed_bytes, 1000);
    assert_eq!(refined.per_sample_bytes, 200);
    assert_eq!(fitted.refined(&config(10), 1500), fitted);
    // Measured at a scaled config: the model's own precision is kept.
    let bf16 = RunConfig {
        precision: Precision::Bf16,
        ..config(10)
    };
    let refined = fitted.refined(&bf16, 1000 + 10 * 90);
    assert_eq!(refined.precision, Precision::Fp32);
    assert_eq!(refined.per_sample_bytes, 150);
    assert!(refined.need_bytes(&bf16) >= 1900);
    // A micro-batch of 0 can only raise the fixed part.
    let refined = fitted.refined(&config(0), 5000);
    assert_eq!((refined.fixed_bytes, refined.per_sample_bytes), (5000, 100));
}

#[test]
fn an_oom_alone_puts_everything_per_sample_at_its_config() {
    let report = OutOfMemory {
        requested: 64 * MIB,
        in_use: 7 * GIB + 960 * MIB,
        limit: 8 * GIB,
        largest_free: 0,
        peak: 7 * GIB + 960 * MIB,
    };
    let current = RunConfig {
        precision: Precision::Bf16,
        recompute_segment_layers: Some(1),
        ..config(64)
    };
    let worst = CommandMemoryModel::from_out_of_memory(&current, &report);
    assert_eq!(
        worst,
        CommandMemoryModel {
            fixed_bytes: 0,
            per_sample_bytes: 128 * MIB,
            precision: Precision::Bf16,
            recompute: true,
        }
    );
    assert_eq!(worst.need_bytes(&current), 8 * GIB);
}

#[test]
fn the_estimate_shows_the_models_numbers() {
    let fitted = model(GIB + 205 * MIB, 35 * MIB);
    let estimate = fitted.estimate(&config(64));
    assert_eq!(estimate.config, config(64));
    assert_eq!(estimate.peak_bytes, fitted.need_bytes(&config(64)));
    assert_eq!(estimate.required_bytes, estimate.peak_bytes);
    assert_eq!(estimate.persistent_bytes, GIB + 205 * MIB);
    assert_eq!(estimate.fragmentation_bytes_at_peak, 0);
    assert_eq!(
        estimate.by_category,
        MemoryCategory::ALL
            .iter()
            .map(|category| (*category, 0))
            .collect::<Vec<_>>()
    );
    assert!(estimate.by_layer.is_empty());
    assert_eq!(
        estimate.peak_during,
        "command: fixed 1.20 GiB + 35 MiB per sample x 64, from the program's memory model"
    );
}

#[test]
fn absurd_numbers_saturate() {
    let huge = model(u64::MAX - 1, u64::MAX / 2);
    assert_eq!(huge.need_bytes(&config(1 << 24)), u64::MAX);
    let half = RunConfig {
        precision: Precision::Fp16,
        ..config(1)
    };
    assert_eq!(huge.refined(&half, u64::MAX).need_bytes(&half), u64::MAX);
    let fitted = CommandMemoryModel::fit(
        &[point(u64::MAX, u64::MAX), point(1, 0), ran_out(2, u64::MAX)],
        Precision::Fp32,
        false,
    )
    .unwrap();
    assert_eq!(fitted.need_bytes(&config(2)), u64::MAX);
}

proptest! {
    #[test]
    fn a_fit_covers_its_lower_bounds_and_predictions_grow_with_the_batch(
        points in prop::collection::vec((0u64..1 << 20, 0u64..1 << 44, any::<bool>()), 1..6),
        larger in 0u64..1 << 20,
        measured in any::<u64>(),
    ) {
        let points: Vec<ProfilePoint> = points
            .into_iter()
            .map(|(micro_batch, peak_bytes, ran_out)| ProfilePoint { micro_batch, peak_bytes, ran_out })
            .collect();
        let fitted = CommandMemoryModel::fit(&points, Precision::Fp32, false).unwrap();
        for point in points.iter().filter(|point| point.ran_out) {
            prop_assert!(fitted.need_bytes(&config(point.micro_batch)) >= point.peak_bytes);
        }
        let smaller = larger / 2;
        prop_assert!(fitted.need_bytes(&config(smaller)) <= fitted.need_bytes(&config(larger)));
        let at = RunConfig { precision: Precision::Bf16, ..config(larger) };
        let refined = fitted.refined(&at, measured);
        prop_assert!(refined.need_bytes(&at) >= measured);
        prop_assert!(refined.need_bytes(&at) >= fitted.need_bytes(&at));
    }
}
