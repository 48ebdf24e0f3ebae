//! Integration tests of the data layer: real IDX, CIFAR-10 and NPY files written into a
//! temporary directory and opened through `open_data_sets` with jobs parsed from TOML;
//! every bad-file error; synthetic data that is deterministic and learnable; and the batch
//! loader's order (determinism, resume, per-epoch permutations, batches straddling epochs),
//! its prefetch bound, its error delivery and its prompt shutdown.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use carve_core::model::FeatureShape;
use carve_core::validate::{ValidatedJob, load_job_spec_toml};
use carve_engine::EngineError;
use carve_engine::data::cifar::Cifar10Dataset;
use carve_engine::data::{
    Batch, BatchLoader, DataSets, Dataset, SampleTarget, TargetKind, Targets, evaluation_batches,
    open_data_sets, steps_for_epochs,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------

/// A valid job around the given model and `[data]` section.
fn job(input_shape: &str, layers: &[&str], loss: &str, data_section: &str) -> ValidatedJob {
    let layers: String = layers.iter().map(|layer| format!("  {layer},\n")).collect();
    let text = format!(
        r#"name = "data-test"
[model]
input_shape = {input_shape}
loss = "{loss}"
layers = [
{layers}]
[training]
batch_size = 4
steps = 10
optimizer = {{ sgd = {{ learning_rate = 0.1 }} }}
seed = 11
[data]
{data_section}
"#
    );
    match load_job_spec_toml(&text) {
        Ok(job) => job,
        Err(error) => panic!("test job should be valid, got `{error}`:\n{text}"),
    }
}

/// A classifier with `classes` outputs on `input_shape`.
fn classifier_job(input_shape: &str, classes: u64, data_section: &str) -> ValidatedJob {
    let dense = format!("{{ dense = {{ units = {classes} }} }}");
    job(
        input_shape,
        &["{ flatten = {} }", &dense],
        "softmax_cross_entropy",
        data_section,
    )
}

/// A linear regression from `input_features` to `outputs`.
fn regression_job(input_features: u64, outputs: u64, data_section: &str) -> ValidatedJob {
    let dense = format!("{{ dense = {{ units = {outputs} }} }}");
    job(
        &format!("[{input_features}]"),
        &[&dense],
        "mse",
        data_section,
    )
}

fn open(job: &ValidatedJob, directory: &Path) -> DataSets {
    match open_data_sets(job, directory) {
        Ok(data_sets) => data_sets,
        Err(error) => panic!("data should open, got `{error}`"),
    }
}

/// The `(path, reason)` of the data error opening `job` gives.
#[track_caller]
fn open_error(job: &ValidatedJob, directory: &Path) -> (String, String) {
    match open_data_sets(job, directory) {
        Ok(_) => panic!("data should be rejected"),
        Err(EngineError::Data { path, reason }) => (path, reason),
        Err(other) => panic!("expected a data error, got `{other}`"),
    }
}

/// Asserts the error names the file (by its final component) and has every fragment.
#[track_caller]
fn assert_data_error(error: (String, String), file_name: &str, fragments: &[&str]) {
    let (path, reason) = error;
    assert!(
        path.ends_with(file_name),
        "error should name {file_name}, names {path} ({reason})"
    );
    assert!(
        !reason.starts_with(|character: char| character.is_uppercase()),
        "reasons start in lowercase: {reason}"
    );
    for fragment in fragments {
        assert!(
            reason.contains(fragment),
            "reason `{reason}` should contain `{fragment}`"
        );
    }
}

/// Sample `index`: its inputs and its target.
fn read(dataset: &dyn Dataset, index: u64) -> (Vec<f32>, SampleTarget, Vec<f32>) {
    let mut input = vec![0.0; dataset.input_elements()];
    let mut target_values = vec![0.0; dataset.target_kind().value_elements()];
    let target = dataset
        .read_sample(index, &mut input, &mut target_values)
        .unwrap();
    (input, target, target_values)
}

fn class_of(target: SampleTarget) -> i32 {
    match target {
        SampleTarget::Class(class) => class,
        SampleTarget::Values => panic!("expected a class label"),
    }
}

// ---------------------------------------------------------------------------------------
// IDX
// ---------------------------------------------------------------------------------------

/// A bad pair of files (images and labels, or inputs and targets), the file the error must
/// name and fragments of its reason.
type BadFilePair = (Vec<u8>, Vec<u8>, &'static str, Vec<&'static str>);

fn idx_file(magic: u32, dimensions: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut bytes = magic.to_be_bytes().to_vec();
    for dimension in dimensions {
        bytes.extend_from_slice(&dimension.to_be_bytes());
    }
    bytes.extend_from_slice(payload);
    bytes
}

/// A pixel that differs per image and per position, covering 0 and 255.
fn idx_pixel(image: usize, position: usize) -> u8 {
    ((image * 37 + position * 11) % 256) as u8
}

/// Writes `count` images of `height x width` and their labels under `prefix`.
fn write_idx(directory: &Path, prefix: &str, count: u32, height: u32, width: u32, labels: &[u8]) {
    let mut pixels = Vec::new();
    for image in 0..count as usize {
        for position in 0..(height * width) as usize {
            pixels.push(idx_pixel(image, position));
        }
    }
    std::fs::write(
        directory.join(format!("{prefix}-images")),
        idx_file(0x0803, &[count, height, width], &pixels),
    )
    .unwrap();
    std::fs::write(
        directory.join(format!("{prefix}-labels")),
        idx_file(0x0801, &[labels.len() as u32], labels),
    )
    .unwrap();
}

const IDX_DATA: &str = r#"format = "idx"
train = { images = "train-images", labels = "train-labels" }
test = { images = "test-images", labels = "test-labels" }"#;

#[test]
fn idx_files_round_trip_with_pixels_scaled_exactly_by_255() {
    let directory = tempfile::tempdir().unwrap();
    write_idx(directory.path(), "train", 5, 4, 4, &[3, 0, 9, 1, 7]);
    write_idx(directory.path(), "test", 2, 4, 4, &[5, 6]);
    for input_shape in ["[4, 4, 1]", "[16]"] {
        let job = classifier_job(input_shape, 10, IDX_DATA);
        let data = open(&job, directory.path());
        assert_eq!(data.train.len(), 5);
        assert_eq!(data.train.input_elements(), 16);
        assert_eq!(
            data.train.target_kind(),
            TargetKind::Classes { classes: 10 }
        );
        for (index, label) in [3, 0, 9, 1, 7].into_iter().enumerate() {
            let (input, target, _) = read(data.train.as_ref(), index as u64);
            assert_eq!(class_of(target), label);
            let expected: Vec<f32> = (0..16)
                .map(|position| f32::from(idx_pixel(index, position)) / 255.0)
                .collect();
            assert_eq!(input, expected, "image {index}");
        }
        let test = data.test.expect("the job names a test split");
        assert_eq!(test.len(), 2);
        assert_eq!(class_of(read(test.as_ref(), 1).1), 6);
    }
}

#[test]
fn relative_paths_resolve_against_the_job_directory_and_absolute_ones_stay() {
    let directory = tempfile::tempdir().unwrap();
    std::fs::create_dir(directory.path().join("mnist")).unwrap();
    write_idx(
        &directory.path().join("mnist"),
        "train",
        3,
        2,
        2,
        &[0, 1, 2],
    );
    let relative = classifier_job(
        "[2, 2, 1]",
        3,
        "format = \"idx\"\ntrain = { images = \"mnist/train-images\", labels = \"mnist/train-labels\" }",
    );
    assert_eq!(open(&relative, directory.path()).train.len(), 3);
    let absolute_images = directory.path().join("mnist/train-images");
    let absolute = classifier_job(
        "[2, 2, 1]",
        3,
        &format!(
            "format = \"idx\"\ntrain = {{ images = {:?}, labels = \"mnist/train-labels\" }}",
            absolute_images.display().to_string()
        ),
    );
    let elsewhere = tempfile::tempdir().unwrap();
    // The labels resolve against `elsewhere` and are missing there; the images are found.
    assert_data_error(
        open_error(&absolute, elsewhere.path()),
        "mnist/train-labels",
        &["cannot open", "no such file"],
    );
}

#[test]
fn bad_idx_files_are_errors_naming_the_file_and_the_reason() {
    let job = classifier_job("[4, 4, 1]", 10, IDX_DATA);
    let write_train = |directory: &Path, images: Vec<u8>, labels: Vec<u8>| {
        std::fs::write(directory.join("train-images"), images).unwrap();
        std::fs::write(directory.join("train-labels"), labels).unwrap();
        write_idx(directory, "test", 1, 4, 4, &[0]);
    };
    let good_images = || idx_file(0x0803, &[5, 4, 4], &[0; 80]);
    let good_labels = || idx_file(0x0801, &[5], &[0; 5]);
    let cases: Vec<BadFilePair> = vec![
        (
            idx_file(0x0802, &[5, 4, 4], &[0; 80]),
            good_labels(),
            "train-images",
            vec!["bad magic 0x00000802, expected 0x00000803 (idx images)"],
        ),
        (
            good_images(),
            idx_file(0x0803, &[5], &[0; 5]),
            "train-labels",
            vec!["bad magic 0x00000803, expected 0x00000801 (idx labels)"],
        ),
        (
            idx_file(0x0803, &[5, 4, 4], &[0; 79]),
            good_labels(),
            "train-images",
            vec!["file is 95 bytes, expected 96 for 5 images of 4x4"],
        ),
        (
            vec![0, 0, 8],
            good_labels(),
            "train-images",
            vec!["file is 3 bytes, shorter than the 16-byte idx images header"],
        ),
        (
            idx_file(0x0803, &[u32::MAX, u32::MAX, u32::MAX], &[]),
            good_labels(),
            "train-images",
            vec!["more bytes than a file can hold"],
        ),
        (
            idx_file(0x0803, &[0, 4, 4], &[]),
            idx_file(0x0801, &[0], &[]),
            "train-images",
            vec!["has no images"],
        ),
        (
            idx_file(0x0803, &[5, 5, 5], &[0; 125]),
            good_labels(),
            "train-images",
            vec![
                "images are 5x5",
                "model.input_shape is [4, 4, 1]",
                "[5, 5, 1] or [25]",
            ],
        ),
        (
            good_images(),
            idx_file(0x0801, &[6], &[0; 6]),
            "train-labels",
            vec!["has 6 labels but 5 images"],
        ),
        (
            good_images(),
            idx_file(0x0801, &[5], &[0; 4]),
            "train-labels",
            vec!["file is 12 bytes, expected 13 for 5 labels"],
        ),
        (
            good_images(),
            idx_file(0x0801, &[5], &[0, 1, 2, 12, 4]),
            "train-labels",
            vec!["label 12 at index 3 is outside 0..10"],
        ),
    ];
    for (images, labels, file_name, fragments) in cases {
        let directory = tempfile::tempdir().unwrap();
        write_train(directory.path(), images, labels);
        assert_data_error(open_error(&job, directory.path()), file_name, &fragments);
    }

    // The test split is checked as well.
    let directory = tempfile::tempdir().unwrap();
    write_idx(directory.path(), "train", 2, 4, 4, &[0, 1]);
    write_idx(directory.path(), "test", 2, 4, 4, &[1, 10]);
    assert_data_error(
        open_error(&job, directory.path()),
        "test-labels",
        &["label 10 at index 1 is outside 0..10"],
    );

    // A model with three channels cannot read one-channel images.
    let directory = tempfile::tempdir().unwrap();
    write_idx(directory.path(), "train", 2, 4, 4, &[0, 1]);
    write_idx(directory.path(), "test", 2, 4, 4, &[1, 0]);
    assert_data_error(
        open_error(&classifier_job("[4, 4, 3]", 10, IDX_DATA), directory.path()),
        "train-images",
        &["images are 4x4 with 1 channel", "[4, 4, 3]"],
    );

    // A missing file.
    let empty = tempfile::tempdir().unwrap();
    assert_data_error(
        open_error(&job, empty.path()),
        "train-images",
        &["cannot open: no such file or directory"],
    );
}

#[test]
fn reading_outside_the_set_or_into_wrong_buffers_is_an_error_not_a_panic() {
    let directory = tempfile::tempdir().unwrap();
    write_idx(directory.path(), "train", 2, 4, 4, &[0, 1]);
    write_idx(directory.path(), "test", 1, 4, 4, &[0]);
    let data = open(&classifier_job("[4, 4, 1]", 10, IDX_DATA), directory.path());
    let mut input = vec![0.0; 16];
    let error = data.train.read_sample(2, &mut input, &mut []).unwrap_err();
    assert!(
        error.to_string().contains("sample index 2 is outside 0..2"),
        "{error}"
    );
    let mut short = vec![0.0; 15];
    assert!(data.train.read_sample(0, &mut short, &mut []).is_err());
    let mut targets = vec![0.0; 1];
    assert!(data.train.read_sample(0, &mut input, &mut targets).is_err());

    // A file truncated after it was opened.
    std::fs::write(
        directory.path().join("train-images"),
        idx_file(0x0803, &[2, 4, 4], &[0; 20]),
    )
    .unwrap();
    let error = data.train.read_sample(1, &mut input, &mut []).unwrap_err();
    assert!(error.to_string().contains("truncated"), "{error}");
}

// ---------------------------------------------------------------------------------------
// CIFAR-10
// ---------------------------------------------------------------------------------------

/// The planar byte of `record`, `channel`, `pixel` in the files the tests write.
fn cifar_byte(record: usize, channel: usize, pixel: usize) -> u8 {
    ((record * 31 + channel * 101 + pixel * 7) % 256) as u8
}

fn cifar_records(first_record: usize, labels: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for (offset, label) in labels.iter().enumerate() {
        bytes.push(*label);
        for channel in 0..3 {
            for pixel in 0..1024 {
                bytes.push(cifar_byte(first_record + offset, channel, pixel));
            }
        }
    }
    bytes
}

const CIFAR_DATA: &str = r#"format = "cifar10"
train = { files = ["data_batch_1.bin", "data_batch_2.bin"] }
test = { files = ["test_batch.bin"] }"#;

#[test]
fn cifar_records_become_height_width_channels_across_files() {
    let directory = tempfile::tempdir().unwrap();
    std::fs::write(
        directory.path().join("data_batch_1.bin"),
        cifar_records(0, &[6, 9]),
    )
    .unwrap();
    std::fs::write(
        directory.path().join("data_batch_2.bin"),
        cifar_records(2, &[4, 1, 0]),
    )
    .unwrap();
    std::fs::write(
        directory.path().join("test_batch.bin"),
        cifar_records(0, &[3]),
    )
    .unwrap();
    let job = classifier_job("[32, 32, 3]", 10, CIFAR_DATA);
    let data = open(&job, directory.path());
    assert_eq!(data.train.len(), 5);
    assert_eq!(data.train.input_elements(), 3072);
    assert_eq!(data.test.as_ref().unwrap().len(), 1);
    for (record, label) in [6, 9, 4, 1, 0].into_iter().enumerate() {
        let (input, target, _) = read(data.train.as_ref(), record as u64);
        assert_eq!(class_of(target), label);
        for row in 0..32 {
            for column in 0..32 {
                for channel in 0..3 {
                    let pixel = row * 32 + column;
                    assert_eq!(
                        input[(row * 32 + column) * 3 + channel],
                        f32::from(cifar_byte(record, channel, pixel)) / 255.0,
                        "record {record} row {row} column {column} channel {channel}"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_cifar_files_are_errors_naming_the_file_and_the_reason() {
    let job = classifier_job("[32, 32, 3]", 10, CIFAR_DATA);
    let cases: Vec<(Vec<u8>, &str, Vec<&str>)> = vec![
        (
            vec![0; 3000],
            "data_batch_2.bin",
            vec!["file is 3000 bytes, not a multiple of the 3073-byte cifar-10 record"],
        ),
        (Vec::new(), "data_batch_2.bin", vec!["file is empty"]),
        (
            cifar_records(0, &[1, 10, 2]),
            "data_batch_2.bin",
            vec!["label 10 at index 1 is outside 0..10"],
        ),
    ];
    for (second_file, file_name, fragments) in cases {
        let directory = tempfile::tempdir().unwrap();
        std::fs::write(
            directory.path().join("data_batch_1.bin"),
            cifar_records(0, &[1]),
        )
        .unwrap();
        std::fs::write(directory.path().join("data_batch_2.bin"), second_file).unwrap();
        std::fs::write(
            directory.path().join("test_batch.bin"),
            cifar_records(0, &[1]),
        )
        .unwrap();
        assert_data_error(open_error(&job, directory.path()), file_name, &fragments);
    }

    // The validator already refuses other input shapes; the reader checks on its own too.
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("data_batch_1.bin");
    std::fs::write(&path, cifar_records(0, &[1])).unwrap();
    let error = Cifar10Dataset::open(
        &[path],
        FeatureShape::Image {
            height: 32,
            width: 32,
            channels: 1,
        },
        10,
    )
    .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("cifar-10 images are [32, 32, 3], but model.input_shape is [32, 32, 1]"),
        "{error}"
    );
}

// ---------------------------------------------------------------------------------------
// NPY
// ---------------------------------------------------------------------------------------

/// An `.npy` file as NumPy writes it: the header dict padded with spaces and a newline so
/// the data starts at a multiple of 64.
fn npy_file(major: u8, descr: &str, fortran_order: bool, shape: &[u64], data: &[u8]) -> Vec<u8> {
    let shape_text = match shape {
        [single] => format!("({single},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let fortran = if fortran_order { "True" } else { "False" };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape_text}, }}");
    let preamble = if major == 1 { 10 } else { 12 };
    while (preamble + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY".to_vec();
    bytes.extend_from_slice(&[major, 0]);
    if major == 1 {
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn f64_bytes(values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn i64_bytes(values: &[i64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

fn i32_bytes(values: &[i32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

const NPY_DATA: &str = r#"format = "npy"
train = { inputs = "x.npy", targets = "y.npy" }"#;

fn write_npy_pair(directory: &Path, inputs: Vec<u8>, targets: Vec<u8>) {
    std::fs::write(directory.join("x.npy"), inputs).unwrap();
    std::fs::write(directory.join("y.npy"), targets).unwrap();
}

#[test]
fn npy_inputs_of_every_supported_type_are_read_as_f32_without_scaling() {
    let directory = tempfile::tempdir().unwrap();
    let job = classifier_job("[2, 3, 1]", 4, NPY_DATA);
    let values: Vec<f64> = (0..18).map(|value| value as f64 * 1.5 - 4.0).collect();

    // f32 inputs (3 samples of 2x3x1), i64 labels, version 1.0.
    let as_f32: Vec<f32> = values.iter().map(|value| *value as f32).collect();
    write_npy_pair(
        directory.path(),
        npy_file(1, "<f4", false, &[3, 2, 3, 1], &f32_bytes(&as_f32)),
        npy_file(1, "<i8", false, &[3], &i64_bytes(&[3, 0, 2])),
    );
    let data = open(&job, directory.path());
    assert_eq!(data.train.len(), 3);
    assert!(data.test.is_none());
    for sample in 0..3 {
        let (input, target, _) = read(data.train.as_ref(), sample as u64);
        assert_eq!(input, &as_f32[sample * 6..(sample + 1) * 6]);
        assert_eq!(class_of(target), [3, 0, 2][sample]);
    }

    // f64 inputs flattened as [3, 6], u8 labels, version 2.0.
    write_npy_pair(
        directory.path(),
        npy_file(2, "<f8", false, &[3, 6], &f64_bytes(&values)),
        npy_file(2, "|u1", false, &[3], &[1, 2, 3]),
    );
    let data = open(&job, directory.path());
    let (input, target, _) = read(data.train.as_ref(), 2);
    assert_eq!(input, &as_f32[12..18]);
    assert_eq!(class_of(target), 3);

    // u8 inputs are not scaled; i32 labels of shape (N, 1), as Keras code often saves them.
    let bytes: Vec<u8> = (0..18).map(|value| (value * 14) as u8).collect();
    write_npy_pair(
        directory.path(),
        npy_file(1, "|u1", false, &[3, 2, 3], &bytes),
        npy_file(1, "<i4", false, &[3, 1], &i32_bytes(&[2, 2, 1])),
    );
    let data = open(&job, directory.path());
    let (input, target, _) = read(data.train.as_ref(), 1);
    let expected: Vec<f32> = bytes[6..12].iter().map(|byte| f32::from(*byte)).collect();
    assert_eq!(input, expected);
    assert_eq!(class_of(target), 2);

    // '<u1' is the same as '|u1'; a big-endian array is read correctly.
    let big_endian: Vec<u8> = as_f32
        .iter()
        .flat_map(|value| value.to_be_bytes())
        .collect();
    write_npy_pair(
        directory.path(),
        npy_file(1, ">f4", false, &[3, 6], &big_endian),
        npy_file(1, "<u1", false, &[3], &[0, 1, 2]),
    );
    let data = open(&job, directory.path());
    assert_eq!(read(data.train.as_ref(), 1).0, &as_f32[6..12]);
}

#[test]
fn npy_value_targets_feed_mse_models() {
    let directory = tempfile::tempdir().unwrap();
    let job = regression_job(4, 3, NPY_DATA);
    let inputs: Vec<f32> = (0..8).map(|value| value as f32).collect();
    let targets: Vec<f32> = (0..6).map(|value| value as f32 * -0.25).collect();
    write_npy_pair(
        directory.path(),
        npy_file(1, "<f4", false, &[2, 4], &f32_bytes(&inputs)),
        npy_file(1, "<f4", false, &[2, 3], &f32_bytes(&targets)),
    );
    let data = open(&job, directory.path());
    assert_eq!(data.train.target_kind(), TargetKind::Values { elements: 3 });
    let (input, target, values) = read(data.train.as_ref(), 1);
    assert_eq!(input, &inputs[4..8]);
    assert_eq!(target, SampleTarget::Values);
    assert_eq!(values, &targets[3..6]);

    let batches: Vec<Batch> = evaluation_batches(data.train.as_ref(), 8)
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].inputs, inputs);
    assert_eq!(batches[0].targets, Targets::Values(targets));
}

#[test]
fn bad_npy_files_are_errors_naming_the_file_and_the_reason() {
    let classifier = classifier_job("[2, 3, 1]", 4, NPY_DATA);
    let regression = regression_job(6, 2, NPY_DATA);
    let good_inputs = || npy_file(1, "<f4", false, &[3, 6], &f32_bytes(&[0.5; 18]));
    let good_labels = || npy_file(1, "<i8", false, &[3], &i64_bytes(&[0, 1, 2]));
    let cases: Vec<(&ValidatedJob, BadFilePair)> = vec![
        (
            &classifier,
            (
                npy_file(1, "<f4", true, &[3, 6], &f32_bytes(&[0.5; 18])),
                good_labels(),
                "x.npy",
                vec!["fortran_order is true", "np.ascontiguousarray"],
            ),
        ),
        (
            &classifier,
            (
                npy_file(1, "<f4", false, &[3, 5], &f32_bytes(&[0.5; 15])),
                good_labels(),
                "x.npy",
                vec!["inputs have shape (3, 5): 5 elements per sample, but the model input has 6"],
            ),
        ),
        (
            &classifier,
            (
                good_inputs(),
                npy_file(1, "<f4", false, &[3], &f32_bytes(&[0.0, 1.0, 2.0])),
                "y.npy",
                vec!["class labels must be integers, got '<f4'"],
            ),
        ),
        (
            &classifier,
            (
                good_inputs(),
                npy_file(1, "<i8", false, &[3], &i64_bytes(&[0, 1, 4])),
                "y.npy",
                vec!["label 4 at index 2 is outside 0..4"],
            ),
        ),
        (
            &classifier,
            (
                good_inputs(),
                npy_file(1, "<i8", false, &[3], &i64_bytes(&[0, -1, 2])),
                "y.npy",
                vec!["label -1 at index 1 is outside 0..4"],
            ),
        ),
        (
            &classifier,
            (
                good_inputs(),
                npy_file(1, "<i8", false, &[3, 2], &i64_bytes(&[0; 6])),
                "y.npy",
                vec!["class labels must have shape (N,) or (N, 1), got (3, 2)"],
            ),
        ),
        (
            &classifier,
            (
                good_inputs(),
                npy_file(1, "<i8", false, &[4], &i64_bytes(&[0; 4])),
                "y.npy",
                vec!["has 4 targets but 3 inputs"],
            ),
        ),
        (
            &classifier,
            (
                b"\x93NUMPZ\x01\x00\x10\x00{}".to_vec(),
                good_labels(),
                "x.npy",
                vec!["bad magic [93 4e 55 4d 50 5a], expected \\x93NUMPY (npy)"],
            ),
        ),
        (
            &classifier,
            (
                b"\x93NUMPY\x01".to_vec(),
                good_labels(),
                "x.npy",
                vec!["file is 7 bytes, shorter than the 10-byte npy preamble"],
            ),
        ),
        (
            &classifier,
            (
                npy_file(1, "<f4", false, &[3, 6], &f32_bytes(&[0.5; 17])),
                good_labels(),
                "x.npy",
                vec!["file is 196 bytes, expected 200 for shape (3, 6) of '<f4'"],
            ),
        ),
        (
            &classifier,
            (
                npy_file(1, "<c8", false, &[3, 6], &[0; 144]),
                good_labels(),
                "x.npy",
                vec!["descr '<c8' is not supported"],
            ),
        ),
        (
            &classifier,
            (
                npy_file(1, "<f4", false, &[u64::MAX, 6], &[]),
                good_labels(),
                "x.npy",
                vec!["more elements than a file can hold"],
            ),
        ),
        (
            &classifier,
            (
                npy_file(1, "<f4", false, &[0, 6], &[]),
                npy_file(1, "<i8", false, &[0], &[]),
                "x.npy",
                vec!["has no samples"],
            ),
        ),
        (
            &classifier,
            (
                {
                    let mut file = good_inputs();
                    file[6] = 4;
                    file
                },
                good_labels(),
                "x.npy",
                vec!["npy format version 4.0 is not supported"],
            ),
        ),
        (
            &classifier,
            (
                {
                    // A header length far past the end of the file.
                    let mut file = good_inputs();
                    file[8] = 0xff;
                    file[9] = 0xff;
                    file
                },
                good_labels(),
                "x.npy",
                vec!["shorter than its 65545-byte header"],
            ),
        ),
        (
            &regression,
            (
                good_inputs(),
                npy_file(1, "<f4", false, &[3, 3], &f32_bytes(&[0.0; 9])),
                "y.npy",
                vec![
                    "targets have shape (3, 3): 3 elements per sample, but the model output has 2",
                ],
            ),
        ),
    ];
    for (job, (inputs, targets, file_name, fragments)) in cases {
        let directory = tempfile::tempdir().unwrap();
        write_npy_pair(directory.path(), inputs, targets);
        assert_data_error(open_error(job, directory.path()), file_name, &fragments);
    }
}

// ---------------------------------------------------------------------------------------
// Synthetic data
// ---------------------------------------------------------------------------------------

const SYNTHETIC_DATA: &str = "format = \"synthetic\"\nsamples = 2000\ntest_samples = 500";

fn synthetic_classifier() -> ValidatedJob {
    classifier_job("[8, 8, 1]", 10, SYNTHETIC_DATA)
}

#[test]
fn synthetic_samples_are_a_pure_function_of_seed_and_index() {
    let job = synthetic_classifier();
    let directory = tempfile::tempdir().unwrap();
    let first = open(&job, directory.path());
    let second = open(&job, directory.path());
    assert_eq!(first.train.len(), 2000);
    assert_eq!(first.test.as_ref().unwrap().len(), 500);
    for index in [0, 1, 999, 1999] {
        assert_eq!(
            read(first.train.as_ref(), index),
            read(second.train.as_ref(), index)
        );
    }
    assert_ne!(
        read(first.train.as_ref(), 0).0,
        read(first.train.as_ref(), 1).0
    );
    // Test samples are new samples, not copies of training ones.
    for index in 0..50 {
        assert_ne!(
            read(first.train.as_ref(), index).0,
            read(first.test.as_ref().unwrap().as_ref(), index).0
        );
    }
    // Another seed is another data set.
    let other_seed = job_with_seed(&job, 12);
    let other = open(&other_seed, directory.path());
    assert_ne!(
        read(first.train.as_ref(), 0).0,
        read(other.train.as_ref(), 0).0
    );
    // No test split unless asked for.
    let without_test = classifier_job("[8, 8, 1]", 10, "format = \"synthetic\"\nsamples = 10");
    assert!(open(&without_test, directory.path()).test.is_none());
}

fn job_with_seed(job: &ValidatedJob, seed: u64) -> ValidatedJob {
    let mut job = job.clone();
    job.spec.training.seed = seed;
    job
}

/// Per-class mean inputs of a data set, and how many samples each class has.
fn class_means(dataset: &dyn Dataset, classes: usize) -> (Vec<Vec<f32>>, Vec<usize>) {
    let elements = dataset.input_elements();
    let mut sums = vec![vec![0.0f32; elements]; classes];
    let mut counts = vec![0usize; classes];
    for index in 0..dataset.len() {
        let (input, target, _) = read(dataset, index);
        let class = class_of(target) as usize;
        counts[class] += 1;
        for (sum, value) in sums[class].iter_mut().zip(&input) {
            *sum += value;
        }
    }
    for (sum, count) in sums.iter_mut().zip(&counts) {
        for value in sum.iter_mut() {
            *value /= (*count).max(1) as f32;
        }
    }
    (sums, counts)
}

fn squared_distance(first: &[f32], second: &[f32]) -> f32 {
    first
        .iter()
        .zip(second)
        .map(|(a, b)| (a - b) * (a - b))
        .sum()
}

#[test]
fn synthetic_classes_are_learnable_by_a_nearest_class_mean_rule() {
    let data = open(&synthetic_classifier(), tempfile::tempdir().unwrap().path());
    let (means, counts) = class_means(data.train.as_ref(), 10);
    // Every class occurs, roughly evenly.
    assert!(
        counts.iter().all(|count| (120..280).contains(count)),
        "{counts:?}"
    );
    // Class-conditional means are far apart.
    for first in 0..10 {
        for second in first + 1..10 {
            assert!(squared_distance(&means[first], &means[second]) > 20.0);
        }
    }
    // Classifying held-out samples by the nearest training mean is far above chance (10%).
    let test = data.test.unwrap();
    let mut correct = 0;
    for index in 0..test.len() {
        let (input, target, _) = read(test.as_ref(), index);
        let predicted = (0..10)
            .min_by(|a, b| {
                squared_distance(&input, &means[*a])
                    .total_cmp(&squared_distance(&input, &means[*b]))
            })
            .unwrap();
        if predicted as i32 == class_of(target) {
            correct += 1;
        }
    }
    let accuracy = correct as f64 / test.len() as f64;
    assert!(accuracy > 0.9, "nearest-mean accuracy {accuracy}");
}

#[test]
fn synthetic_regression_targets_are_a_learnable_linear_map_of_the_inputs() {
    let job = regression_job(
        8,
        2,
        "format = \"synthetic\"\nsamples = 1000\ntest_samples = 200",
    );
    let data = open(&job, tempfile::tempdir().unwrap().path());
    assert_eq!(data.train.target_kind(), TargetKind::Values { elements: 2 });
    let load = |dataset: &dyn Dataset| {
        (0..dataset.len())
            .map(|index| {
                let (input, target, values) = read(dataset, index);
                assert_eq!(target, SampleTarget::Values);
                (input, values)
            })
            .collect::<Vec<_>>()
    };
    let train = load(data.train.as_ref());
    let test = load(data.test.as_ref().unwrap().as_ref());
    let target_variance: f32 = train
        .iter()
        .flat_map(|(_, values)| values.iter().map(|value| value * value))
        .sum::<f32>()
        / (train.len() * 2) as f32;
    assert!(target_variance > 0.3, "{target_variance}");

    // Full-batch gradient descent on a linear model.
    let mut weights = [[0.0f32; 8]; 2];
    let mut biases = [0.0f32; 2];
    for _ in 0..300 {
        let mut weight_gradients = [[0.0f32; 8]; 2];
        let mut bias_gradients = [0.0f32; 2];
        for (input, targets) in &train {
            for output in 0..2 {
                let prediction: f32 = biases[output]
                    + weights[output]
                        .iter()
                        .zip(input)
                        .map(|(w, x)| w * x)
                        .sum::<f32>();
                let error = prediction - targets[output];
                bias_gradients[output] += error;
                for (gradient, x) in weight_gradients[output].iter_mut().zip(input) {
                    *gradient += error * x;
                }
            }
        }
        let scale = 0.1 / train.len() as f32;
        for output in 0..2 {
            biases[output] -= scale * bias_gradients[output];
            for (weight, gradient) in weights[output].iter_mut().zip(&weight_gradients[output]) {
                *weight -= scale * gradient;
            }
        }
    }
    let test_error: f32 = test
        .iter()
        .flat_map(|(input, targets)| {
            (0..2).map(move |output| {
                let prediction: f32 = biases[output]
                    + weights[output]
                        .iter()
                        .zip(input)
                        .map(|(w, x)| w * x)
                        .sum::<f32>();
                (prediction - targets[output]).powi(2)
            })
        })
        .sum::<f32>()
        / (test.len() * 2) as f32;
    assert!(
        test_error < 0.05 * target_variance,
        "test mse {test_error} against target variance {target_variance}"
    );
}

// ---------------------------------------------------------------------------------------
// The batch loader
// ---------------------------------------------------------------------------------------

/// A data set whose sample `i` has input `[i, -i]` and class `i % 7`, counting its reads,
/// optionally slow and optionally failing at one index.
#[derive(Default)]
struct IndexDataset {
    samples: u64,
    reads: AtomicU64,
    delay: Option<Duration>,
    failing_index: Option<u64>,
}

impl IndexDataset {
    fn new(samples: u64) -> Self {
        IndexDataset {
            samples,
            ..IndexDataset::default()
        }
    }
}

impl Dataset for IndexDataset {
    fn len(&self) -> u64 {
        self.samples
    }

    fn input_elements(&self) -> usize {
        2
    }

    fn target_kind(&self) -> TargetKind {
        TargetKind::Classes { classes: 7 }
    }

    fn read_sample(
        &self,
        index: u64,
        input: &mut [f32],
        _target_values: &mut [f32],
    ) -> Result<SampleTarget, EngineError> {
        self.reads.fetch_add(1, Ordering::SeqCst);
        if let Some(delay) = self.delay {
            std::thread::sleep(delay);
        }
        if self.failing_index == Some(index) {
            return Err(EngineError::data(
                "index-dataset",
                format!("cannot read sample {index}"),
            ));
        }
        input[0] = index as f32;
        input[1] = -(index as f32);
        Ok(SampleTarget::Class((index % 7) as i32))
    }
}

/// The sample indices of a batch of an `IndexDataset`, checking inputs and labels agree.
fn indices_of(batch: &Batch) -> Vec<u64> {
    let Targets::Classes(classes) = &batch.targets else {
        panic!("index data sets have class targets");
    };
    assert_eq!(batch.inputs.len(), batch.samples * 2);
    assert_eq!(classes.len(), batch.samples);
    batch
        .inputs
        .chunks(2)
        .zip(classes)
        .map(|(input, class)| {
            let index = input[0] as u64;
            assert_eq!(input[1], -input[0]);
            assert_eq!(*class as u64, index % 7);
            index
        })
        .collect()
}

fn take_batches(loader: &mut BatchLoader, count: usize) -> Vec<Vec<u64>> {
    (0..count)
        .map(|_| indices_of(&loader.next_batch().unwrap()))
        .collect()
}

fn loader(
    samples: u64,
    micro_batch_size: usize,
    seed: u64,
    shuffle: bool,
    start_batch: u64,
) -> BatchLoader {
    BatchLoader::new(
        Arc::new(IndexDataset::new(samples)),
        micro_batch_size,
        seed,
        shuffle,
        start_batch,
        2,
    )
}

#[test]
fn the_same_seed_gives_the_same_batches_and_another_seed_others() {
    let first = take_batches(&mut loader(50, 8, 3, true, 0), 20);
    let second = take_batches(&mut loader(50, 8, 3, true, 0), 20);
    let other = take_batches(&mut loader(50, 8, 4, true, 0), 20);
    assert_eq!(first, second);
    assert_ne!(first, other);
    assert!(first.iter().all(|batch| batch.len() == 8));
}

#[test]
fn a_resumed_loader_continues_exactly_where_a_fresh_one_would_be() {
    let fresh = take_batches(&mut loader(23, 5, 9, true, 0), 30);
    for start in [1u64, 4, 5, 13, 29] {
        let mut resumed = loader(23, 5, 9, true, start);
        assert_eq!(resumed.next_batch_index(), start);
        let continued = take_batches(&mut resumed, 30 - start as usize);
        assert_eq!(
            continued,
            &fresh[start as usize..],
            "resumed at batch {start}"
        );
        assert_eq!(resumed.next_batch_index(), 30);
    }
}

#[test]
fn every_epoch_visits_every_sample_once_in_a_new_order() {
    let samples = 23;
    // 19 batches of 5 are 95 positions: four whole epochs and three positions of a fifth.
    let sequence: Vec<u64> = take_batches(&mut loader(samples, 5, 1, true, 0), 19)
        .into_iter()
        .flatten()
        .collect();
    let epochs: Vec<&[u64]> = sequence.chunks(samples as usize).collect();
    for epoch in &epochs[..4] {
        let mut sorted = epoch.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..samples).collect::<Vec<_>>());
    }
    assert_ne!(epochs[0], epochs[1]);
    assert_ne!(epochs[1], epochs[2]);
    assert_ne!(epochs[0], (0..samples).collect::<Vec<_>>().as_slice());
}

#[test]
fn without_shuffle_batches_walk_the_set_in_order_and_straddle_epochs() {
    let batches = take_batches(&mut loader(10, 4, 1, false, 0), 6);
    assert_eq!(
        batches,
        vec![
            vec![0, 1, 2, 3],
            vec![4, 5, 6, 7],
            vec![8, 9, 0, 1],
            vec![2, 3, 4, 5],
            vec![6, 7, 8, 9],
            vec![0, 1, 2, 3],
        ]
    );
    // With shuffling, a straddling batch ends one epoch's order and starts the next one's.
    let shuffled: Vec<u64> = take_batches(&mut loader(10, 4, 5, true, 0), 5)
        .into_iter()
        .flatten()
        .collect();
    let straddling = indices_of(&loader(10, 4, 5, true, 2).next_batch().unwrap());
    assert_eq!(straddling, &shuffled[8..12]);
    for epoch in shuffled.chunks(10) {
        let mut sorted = epoch.to_vec();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    }
    // Micro-batches larger than the set wrap around several epochs.
    let large = take_batches(&mut loader(3, 7, 1, false, 0), 2);
    assert_eq!(
        large,
        vec![vec![0, 1, 2, 0, 1, 2, 0], vec![1, 2, 0, 1, 2, 0, 1]]
    );
}

/// Waits until `condition` holds, up to a few seconds.
fn eventually(condition: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    condition()
}

#[test]
fn the_loader_reads_at_most_prefetch_batches_ahead() {
    let dataset = Arc::new(IndexDataset::new(1000));
    let micro_batch_size = 4u64;
    for prefetch in [1u64, 3] {
        dataset.reads.store(0, Ordering::SeqCst);
        let mut batch_loader = BatchLoader::new(
            dataset.clone(),
            micro_batch_size as usize,
            1,
            true,
            0,
            prefetch as usize,
        );
        for taken in 0..4u64 {
            let limit = (taken + prefetch) * micro_batch_size;
            assert!(
                eventually(|| dataset.reads.load(Ordering::SeqCst) == limit),
                "prefetch {prefetch}: the loader should fill its queue to {limit} reads"
            );
            // Give an unbounded producer time to overshoot.
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(
                dataset.reads.load(Ordering::SeqCst),
                limit,
                "prefetch {prefetch} after {taken} batches taken"
            );
            batch_loader.next_batch().unwrap();
        }
    }
}

#[test]
fn dropping_a_loader_mid_stream_returns_promptly_and_ends_its_thread() {
    let dataset = Arc::new(IndexDataset {
        samples: 10_000,
        delay: Some(Duration::from_millis(5)),
        ..IndexDataset::default()
    });
    // A batch takes about 2.5 s to read; dropping must not wait for it.
    let mut batch_loader = BatchLoader::new(dataset.clone(), 500, 1, true, 0, 4);
    assert!(eventually(|| dataset.reads.load(Ordering::SeqCst) > 0));
    let started = Instant::now();
    drop(batch_loader);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "drop took {:?}",
        started.elapsed()
    );
    // The thread held the only other reference to the data set.
    assert_eq!(Arc::strong_count(&dataset), 1);

    // Dropping a loader whose queue is full (its thread blocked in send) is prompt too.
    let fast = Arc::new(IndexDataset::new(100));
    batch_loader = BatchLoader::new(fast.clone(), 4, 1, true, 0, 2);
    batch_loader.next_batch().unwrap();
    assert!(eventually(|| fast.reads.load(Ordering::SeqCst) == 12));
    let started = Instant::now();
    drop(batch_loader);
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(Arc::strong_count(&fast), 1);
}

#[test]
fn read_errors_arrive_in_order_and_end_the_stream() {
    let dataset = Arc::new(IndexDataset {
        samples: 40,
        failing_index: Some(13),
        ..IndexDataset::default()
    });
    let mut batch_loader = BatchLoader::new(dataset, 4, 1, false, 0, 3);
    for expected_first in [0u64, 4, 8] {
        let batch = batch_loader.next_batch().unwrap();
        assert_eq!(indices_of(&batch)[0], expected_first);
    }
    let error = batch_loader.next_batch().unwrap_err();
    assert!(
        error.to_string().contains("cannot read sample 13"),
        "{error}"
    );
    let after = batch_loader.next_batch().unwrap_err();
    assert!(
        after.to_string().contains("stopped after an earlier error"),
        "{after}"
    );
}

#[test]
fn impossible_loaders_report_errors_instead_of_panicking() {
    let mut empty = BatchLoader::new(Arc::new(IndexDataset::new(0)), 4, 1, true, 0, 2);
    assert!(
        empty
            .next_batch()
            .unwrap_err()
            .to_string()
            .contains("no samples")
    );
    assert!(empty.next_batch().is_err());
    let mut zero = BatchLoader::new(Arc::new(IndexDataset::new(5)), 0, 1, true, 0, 2);
    assert!(
        zero.next_batch()
            .unwrap_err()
            .to_string()
            .contains("micro-batch size must be at least 1")
    );
    // A prefetch of 0 still streams.
    let mut no_prefetch = BatchLoader::new(Arc::new(IndexDataset::new(5)), 2, 1, false, 0, 0);
    assert_eq!(indices_of(&no_prefetch.next_batch().unwrap()), vec![0, 1]);
    assert!(format!("{no_prefetch:?}").contains("BatchLoader"));
}

/// A data set that panics, standing in for a bug in a reader.
struct PanickingDataset;

impl Dataset for PanickingDataset {
    fn len(&self) -> u64 {
        10
    }
    fn input_elements(&self) -> usize {
        1
    }
    fn target_kind(&self) -> TargetKind {
        TargetKind::Classes { classes: 2 }
    }
    fn read_sample(
        &self,
        _: u64,
        _: &mut [f32],
        _: &mut [f32],
    ) -> Result<SampleTarget, EngineError> {
        panic!("reader bug")
    }
}

#[test]
fn a_panic_in_the_loader_thread_is_an_error_for_the_trainer() {
    let mut batch_loader = BatchLoader::new(Arc::new(PanickingDataset), 2, 1, true, 0, 2);
    let error = batch_loader.next_batch().unwrap_err().to_string();
    assert!(
        error.contains("panicked") && error.contains("reader bug"),
        "{error}"
    );
}

#[test]
fn the_loader_streams_value_targets_of_synthetic_regression() {
    let job = regression_job(8, 3, "format = \"synthetic\"\nsamples = 10");
    let data = open(&job, tempfile::tempdir().unwrap().path());
    let mut batch_loader = BatchLoader::new(data.train.clone(), 4, 11, false, 0, 2);
    let batch = batch_loader.next_batch().unwrap();
    assert_eq!(batch.samples, 4);
    assert_eq!(batch.inputs.len(), 32);
    let Targets::Values(values) = &batch.targets else {
        panic!("mse targets are values");
    };
    assert_eq!(values.len(), 12);
    let (input, _, target) = read(data.train.as_ref(), 2);
    assert_eq!(&batch.inputs[16..24], input.as_slice());
    assert_eq!(&values[6..9], target.as_slice());
}

#[test]
fn evaluation_covers_the_test_set_once_in_order_with_a_smaller_last_batch() {
    let dataset = IndexDataset::new(10);
    let batches: Vec<Batch> = evaluation_batches(&dataset, 4)
        .collect::<Result<_, _>>()
        .unwrap();
    let sizes: Vec<usize> = batches.iter().map(|batch| batch.samples).collect();
    assert_eq!(sizes, vec![4, 4, 2]);
    let indices: Vec<u64> = batches.iter().flat_map(indices_of).collect();
    assert_eq!(indices, (0..10).collect::<Vec<_>>());

    let whole: Vec<Batch> = evaluation_batches(&dataset, 64)
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(whole.len(), 1);
    assert_eq!(whole[0].samples, 10);

    let mut zero = evaluation_batches(&dataset, 0);
    assert!(zero.next().unwrap().is_err());
    assert!(zero.next().is_none());

    let failing = IndexDataset {
        samples: 10,
        failing_index: Some(5),
        ..IndexDataset::default()
    };
    let results: Vec<bool> = evaluation_batches(&failing, 4)
        .map(|batch| batch.is_ok())
        .collect();
    assert_eq!(results, vec![true, false]);

    // Real data: the IDX test split of the round-trip test.
    let directory = tempfile::tempdir().unwrap();
    write_idx(directory.path(), "train", 5, 4, 4, &[3, 0, 9, 1, 7]);
    write_idx(directory.path(), "test", 3, 4, 4, &[5, 6, 2]);
    let data = open(&classifier_job("[4, 4, 1]", 10, IDX_DATA), directory.path());
    let test_batches: Vec<Batch> = evaluation_batches(data.test.as_ref().unwrap().as_ref(), 2)
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(test_batches.len(), 2);
    assert_eq!(test_batches[0].targets, Targets::Classes(vec![5, 6]));
    assert_eq!(test_batches[1].targets, Targets::Classes(vec![2]));
    assert_eq!(test_batches[1].inputs.len(), 16);
}

#[test]
fn epochs_become_steps_by_rounding_up() {
    assert_eq!(steps_for_epochs(60_000, 128, 2), 938);
    assert_eq!(steps_for_epochs(10, 4, 1), 3);
    assert_eq!(steps_for_epochs(8, 4, 1), 2);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Whatever the sizes, each epoch is a permutation and resuming anywhere gives the same
    /// continuation as a fresh run.
    #[test]
    fn epochs_are_permutations_and_resume_is_exact(
        samples in 1u64..60,
        micro_batch_size in 1usize..12,
        seed in any::<u64>(),
        start in 0u64..20,
    ) {
        let batches = 3 * samples as usize / micro_batch_size + 21;
        let fresh = take_batches(&mut loader(samples, micro_batch_size, seed, true, 0), batches);
        let sequence: Vec<u64> = fresh.iter().flatten().copied().collect();
        for epoch in sequence.chunks_exact(samples as usize) {
            let mut sorted = epoch.to_vec();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..samples).collect::<Vec<_>>());
        }
        let resumed = take_batches(
            &mut loader(samples, micro_batch_size, seed, true, start),
            batches - start as usize,
        );
        prop_assert_eq!(resumed.as_slice(), &fresh[start as usize..]);
    }
}
