//! Unmeasured profiles, outliers, the floor and declared sizes: what a memory model may
//! learn and what a slice may be sized at.

use super::*;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const GPU: u64 = 15 * GIB + 390 * MIB;

fn point(micro_batch: u64, peak_bytes: u64) -> ProfilePoint {
    ProfilePoint {
        micro_batch,
        peak_bytes,
        ran_out: false,
    }
}

fn config(micro_batch_size: u64) -> RunConfig {
    RunConfig {
        batch_size: 64,
        micro_batch_size,
        precision: Precision::Fp32,
        recompute_segment_layers: None,
        engine: None,
    }
}

fn measured(fixed_bytes: u64, per_sample_bytes: u64) -> LearnedModel {
    LearnedModel {
        model: CommandMemoryModel {
            fixed_bytes,
            per_sample_bytes,
            precision: Precision::Fp32,
            recompute: false,
        },
        measured: true,
    }
}

#[test]
fn a_profile_of_zeros_is_unmeasured_and_falls_back_to_the_profile_slice() {
    // What a simulated GPU gave: "0 B + 0 B per sample", then a 0-byte slice.
    let assessment = assess_profile(
        &[point(64, 0), point(32, 0)],
        Precision::Fp32,
        false,
        GPU,
        Some(GPU),
        None,
    );
    let ProfileAssessment::Unmeasured { fallback, why } = assessment else {
        panic!("a profile of zeros was taken as a measurement: {assessment:?}");
    };
    assert!(!fallback.measured);
    assert_eq!(fallback.model.fixed_bytes, GPU);
    assert_eq!(fallback.model.per_sample_bytes, 0);
    assert_eq!(fallback.model.need_bytes(&config(64)), GPU);
    assert_eq!(fallback.model.need_bytes(&config(1)), GPU);
    assert!(why.starts_with("unmeasured: "), "{why}");
    assert!(why.contains("the profile's slice 15.38 GiB"), "{why}");
    assert!(why.contains("memory_peak_bytes"), "{why}");
}

#[test]
fn an_unmeasured_profile_of_a_declared_job_falls_back_to_the_declared_size() {
    let ProfileAssessment::Unmeasured { fallback, why } = assess_profile(
        &[point(8, 0)],
        Precision::Fp32,
        false,
        GPU,
        Some(GPU),
        Some(6 * GIB),
    ) else {
        panic!("measured");
    };
    assert_eq!(fallback.model.fixed_bytes, 6 * GIB);
    assert!(why.contains("the declared vram 6 GiB"), "{why}");
}

#[test]
fn a_profile_without_points_is_unmeasured_too() {
    assert!(matches!(
        assess_profile(&[], Precision::Fp32, false, GPU, None, None),
        ProfileAssessment::Unmeasured { .. }
    ));
}

#[test]
fn a_profile_point_of_zero_or_past_the_largest_gpu_is_left_out_of_the_fit() {
    // The program reported a peak past every GPU at micro 64; micro 32 is real.
    let assessment = assess_profile(
        &[point(64, 1 << 50), point(32, 200 * MIB + 32 * 12 * MIB)],
        Precision::Fp32,
        false,
        GPU,
        Some(GPU),
        None,
    );
    let ProfileAssessment::Measured { model, ignored } = assessment else {
        panic!("one real point is a measurement");
    };
    assert_eq!(model.need_bytes(&config(32)), 200 * MIB + 32 * 12 * MIB);
    assert_eq!(ignored.len(), 1);
    assert!(ignored[0].starts_with("micro-batch 64: "), "{ignored:?}");
    assert!(
        ignored[0].contains("more than the largest GPU"),
        "{ignored:?}"
    );
}

#[test]
fn a_measured_profile_fits_the_line_through_its_points() {
    let ProfileAssessment::Measured { model, ignored } = assess_profile(
        &[
            point(64, 200 * MIB + 64 * 12 * MIB),
            point(32, 200 * MIB + 32 * 12 * MIB),
        ],
        Precision::Fp32,
        false,
        GPU,
        Some(GPU),
        None,
    ) else {
        panic!("unmeasured");
    };
    assert_eq!(
        (model.fixed_bytes, model.per_sample_bytes),
        (200 * MIB, 12 * MIB)
    );
    assert!(ignored.is_empty());
}

#[test]
fn a_single_absurd_measurement_does_not_move_a_model() {
    let learned = measured(GIB, 10 * MIB);
    for absurd in [0, GPU + 1, u64::MAX] {
        let refinement =
            refine_learned(&learned, &config(64), Measurement::Peak(absurd), Some(GPU));
        assert!(
            matches!(refinement, Refinement::Rejected(_)),
            "{absurd} B moved the model: {refinement:?}"
        );
    }
}

#[test]
fn a_real_measurement_raises_a_measured_model_and_never_lowers_it() {
    let learned = measured(GIB, 10 * MIB);
    let higher = GIB + 64 * 20 * MIB;
    let Refinement::Changed(raised) =
        refine_learned(&learned, &config(64), Measurement::Peak(higher), Some(GPU))
    else {
        panic!("a higher measurement did not raise the model");
    };
    assert!(raised.measured);
    assert!(raised.model.need_bytes(&config(64)) >= higher);
    assert_eq!(
        refine_learned(&learned, &config(64), Measurement::Peak(GIB), Some(GPU)),
        Refinement::Unchanged
    );
}

#[test]
fn the_first_real_measurement_replaces_an_unmeasured_fallback() {
    let fallback = LearnedModel {
        model: CommandMemoryModel {
            fixed_bytes: GPU,
            per_sample_bytes: 0,
            precision: Precision::Fp32,
            recompute: false,
        },
        measured: false,
    };
    let Refinement::Changed(replaced) = refine_learned(
        &fallback,
        &config(64),
        Measurement::Peak(900 * MIB),
        Some(GPU),
    ) else {
        panic!("an unmeasured fallback was kept over a measurement");
    };
    assert!(replaced.measured);
    assert_eq!(replaced.model.need_bytes(&config(64)), 900 * MIB);
    // Shrinking from there never predicts less than was measured.
    assert_eq!(replaced.model.need_bytes(&config(16)), 900 * MIB);
    // An out-of-memory replaces it all per sample, so a smaller micro-batch can be
    // planned for the retry.
    let Refinement::Changed(from_oom) = refine_learned(
        &fallback,
        &config(64),
        Measurement::OutOfMemory(2 * GIB),
        Some(GPU),
    ) else {
        panic!("an unmeasured fallback was kept over an out-of-memory");
    };
    assert_eq!(from_oom.model.fixed_bytes, 0);
    assert_eq!(from_oom.model.need_bytes(&config(64)), 2 * GIB);
    assert_eq!(from_oom.model.need_bytes(&config(32)), GIB);
    // An outlier replaces nothing either.
    assert!(matches!(
        refine_learned(&fallback, &config(64), Measurement::Peak(0), Some(GPU)),
        Refinement::Rejected(_)
    ));
}

#[test]
fn no_slice_is_sized_below_the_floor_nor_the_floor_past_the_largest_gpu() {
    assert_eq!(
        floored_slice_bytes(0, DEFAULT_SLICE_FLOOR_BYTES, Some(GPU)),
        256 * MIB
    );
    assert_eq!(
        floored_slice_bytes(2, DEFAULT_SLICE_FLOOR_BYTES, None),
        256 * MIB
    );
    assert_eq!(
        floored_slice_bytes(GIB, DEFAULT_SLICE_FLOOR_BYTES, Some(GPU)),
        GIB
    );
    assert_eq!(floored_slice_bytes(MIB, 32 * GIB, Some(GPU)), GPU);
}

#[test]
fn a_declared_size_larger_than_every_gpu_is_refused_naming_vram() {
    let error = check_declared_vram(VramRequest::Bytes(20 * GIB), Some(GPU)).unwrap_err();
    assert_eq!(error.field, "resources.vram");
    assert!(error.reason.contains("20 GiB"), "{}", error.reason);
    assert!(error.reason.contains("15.38 GiB"), "{}", error.reason);
    assert!(check_declared_vram(VramRequest::Bytes(GPU), Some(GPU)).is_ok());
    assert!(check_declared_vram(VramRequest::Auto, Some(GPU)).is_ok());
    // Before any GPU is known nothing is refused: the job waits for one.
    assert!(check_declared_vram(VramRequest::Bytes(20 * GIB), None).is_ok());
}

#[test]
fn a_bare_number_of_bytes_too_small_to_be_a_slice_is_refused_as_a_missing_unit() {
    let error = check_declared_vram_is_a_size(VramRequest::Bytes(2)).unwrap_err();
    assert_eq!(error.field, "resources.vram");
    assert!(
        error.reason.contains("vram = \"2 GiB\""),
        "{}",
        error.reason
    );
    assert!(check_declared_vram_is_a_size(VramRequest::Bytes(MIB)).is_ok());
    assert!(check_declared_vram_is_a_size(VramRequest::Auto).is_ok());
}

#[test]
fn a_runs_peak_is_the_guards_unless_it_saw_nothing_then_the_programs_own() {
    // A real GPU: the guard's count wins over whatever the program says.
    assert_eq!(run_peak_bytes(Some(GIB), Some(10 * GIB)), GIB);
    // A simulated GPU: the guard saw no CUDA call; the program's own accounting counts.
    assert_eq!(run_peak_bytes(Some(0), Some(900 * MIB)), 900 * MIB);
    assert_eq!(run_peak_bytes(None, Some(900 * MIB)), 900 * MIB);
    // Nothing from either: 0, which a profile calls unmeasured.
    assert_eq!(run_peak_bytes(Some(0), None), 0);
    assert_eq!(run_peak_bytes(None, None), 0);
}
