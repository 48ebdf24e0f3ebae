//! Helpers shared by the engine's training tests (cpu, and cpu against cuda): a job from
//! its TOML text, its data sets, the training options sized to its estimate, and the
//! comparison of two runs' weights.

use std::path::Path;

use carve_core::estimator::estimate_job;
use carve_core::plan::RunConfig;
use carve_core::validate::{ValidatedJob, load_job_spec_toml};
use carve_engine::checkpoint::NamedTensor;
use carve_engine::data::{DataSets, open_data_sets};
use carve_engine::trainer::TrainingOptions;

/// The job `text` describes; a spec that does not validate fails the test with the text.
pub fn job(text: &str) -> ValidatedJob {
    load_job_spec_toml(text).unwrap_or_else(|error| panic!("{error}\n{text}"))
}

/// The job's data sets, with relative paths from the working directory.
pub fn data(job: &ValidatedJob) -> DataSets {
    open_data_sets(job, Path::new(".")).unwrap()
}

/// Training `job` with `config` in a slice of exactly the estimate's required bytes, no
/// checkpoint, no resume, to the end.
pub fn options_with_config(job: &ValidatedJob, config: RunConfig) -> TrainingOptions {
    TrainingOptions {
        config,
        slice_bytes: estimate_job(job, &config).unwrap().required_bytes,
        checkpoint_path: None,
        resume_from: None,
        stop_after_steps: None,
        stop_requested: None,
    }
}

/// Each tensor's largest difference relative to its largest magnitude: rounding in sums of
/// a different order shows up on tiny elements, not on the tensor. Non-finite values fail.
pub fn assert_close(label: &str, left: &[NamedTensor], right: &[NamedTensor], relative: f32) {
    assert_eq!(left.len(), right.len(), "{label}: tensor count");
    for (a, b) in left.iter().zip(right) {
        assert_eq!(a.name, b.name, "{label}");
        assert!(
            a.values
                .iter()
                .chain(&b.values)
                .all(|value| value.is_finite()),
            "{label}: {} is not finite",
            a.name
        );
        let magnitude = a
            .values
            .iter()
            .chain(&b.values)
            .fold(0f32, |largest, value| largest.max(value.abs()));
        let difference = a
            .values
            .iter()
            .zip(&b.values)
            .fold(0f32, |largest, (x, y)| largest.max((x - y).abs()));
        assert!(
            difference <= relative * magnitude.max(1e-6),
            "{label}: {}: the two runs differ by {difference} against magnitude {magnitude}",
            a.name
        );
    }
}
