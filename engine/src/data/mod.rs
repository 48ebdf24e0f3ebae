//! The data layer: a job's training and test data as random-access data sets, and the
//! loader that streams them to the trainer in micro-batches.
//!
//! - [`Dataset`] is one split with random access to samples. File-backed sets (IDX, CIFAR-10
//!   binary, NPY) keep only their headers in memory and read every sample on demand with
//!   positioned reads, so host memory stays bounded whatever the size of the files, and a
//!   set can be shared between threads without a lock. Synthetic sets store nothing: a
//!   sample is a pure function of the seed and its index.
//! - [`open_data_sets`] opens what a validated job names and checks that the files match the
//!   model (image dimensions, elements per sample, label range) before any training starts,
//!   so a bad file fails the attempt at once with the file and the reason.
//! - [`BatchLoader`] produces the global batch sequence (epochs of seeded permutations,
//!   batches that may straddle two epochs) on a background thread with a bounded queue;
//!   the order is a pure function of (seed, epoch, position), so a resumed run continues
//!   exactly where it stopped with no state to save.
//! - [`evaluation_batches`] walks a test set once, in order.
//!
//! Inputs are f32, NHWC per sample (`height x width x channels`, or flat features), as the
//! job's `model.input_shape` says; targets are class labels (i32) for
//! `softmax_cross_entropy` and f32 tensors of the model output's shape for `mse`.

pub mod cifar;
mod file;
pub mod idx;
mod loader;
pub mod npy;
mod order;
pub mod synthetic;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use carve_core::FieldError;
use carve_core::model::{FeatureShape, ModelGraph};
use carve_core::spec::{DataFiles, DataFormat, LossKind};
use carve_core::validate::ValidatedJob;

use crate::error::EngineError;

pub use loader::{BatchLoader, evaluation_batches};

/// The targets of one batch, in sample order.
#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    /// One class index per sample (`softmax_cross_entropy`).
    Classes(Vec<i32>),
    /// The model output's elements for every sample, sample after sample (`mse`).
    Values(Vec<f32>),
}

/// A micro-batch: `samples` inputs laid out sample after sample (each NHWC or flat) and
/// their targets.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub samples: usize,
    pub inputs: Vec<f32>,
    pub targets: Targets,
}

/// What the targets of a data set are, so a batch can be laid out before its samples are
/// read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetKind {
    /// Integer labels in `0..classes`.
    Classes { classes: u64 },
    /// `elements` f32 values per sample.
    Values { elements: usize },
}

impl TargetKind {
    /// The f32 elements `read_sample` writes into its target slice: 0 for class labels.
    pub fn value_elements(self) -> usize {
        match self {
            TargetKind::Classes { .. } => 0,
            TargetKind::Values { elements } => elements,
        }
    }
}

/// The target of one sample, as `Dataset::read_sample` returns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleTarget {
    /// The class label.
    Class(i32),
    /// The values were written into the `target_values` slice passed to `read_sample`
    /// (kept out of the return value so reading a sample allocates nothing).
    Values,
}

/// One split of a data set with random access to its samples.
///
/// Implementations must be cheap to share: the loader thread and the trainer read from the
/// same set through an `Arc`, so reading takes `&self` (positioned reads, no cursor).
pub trait Dataset: Send + Sync {
    /// Samples in the set.
    fn len(&self) -> u64;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// f32 input elements per sample.
    fn input_elements(&self) -> usize;

    /// Whether samples carry class labels or value tensors.
    fn target_kind(&self) -> TargetKind;

    /// Reads sample `index` (in `0..len`): writes its `input_elements()` inputs into `input`
    /// and, for value targets, its `target_kind().value_elements()` targets into
    /// `target_values` (empty for class labels). Slices of the wrong length, an index out of
    /// range and unreadable files are errors, never panics.
    fn read_sample(
        &self,
        index: u64,
        input: &mut [f32],
        target_values: &mut [f32],
    ) -> Result<SampleTarget, EngineError>;
}

/// What a data set answers about itself: its size, sample shape and targets.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SampleLayout {
    pub(crate) samples: u64,
    pub(crate) input_elements: usize,
    pub(crate) target_kind: TargetKind,
}

/// One checked read: sample `index` into `input` and, for value targets, `target_values`.
#[derive(Debug)]
pub(crate) struct SampleRequest<'a> {
    pub(crate) index: u64,
    pub(crate) input: &'a mut [f32],
    pub(crate) target_values: &'a mut [f32],
}

/// The data sets of this crate: each says its layout and reads samples, and `Dataset`
/// follows, with every request checked against the layout once, here.
pub(crate) trait SampleSource: Send + Sync {
    /// Named in errors: the file read, or "synthetic".
    fn source(&self) -> &str;
    fn layout(&self) -> SampleLayout;
    /// `Dataset::read_sample` once the index and the buffers' lengths are checked.
    fn read_checked(&self, request: SampleRequest<'_>) -> Result<SampleTarget, EngineError>;
}

impl<S: SampleSource> Dataset for S {
    fn len(&self) -> u64 {
        self.layout().samples
    }

    fn input_elements(&self) -> usize {
        self.layout().input_elements
    }

    fn target_kind(&self) -> TargetKind {
        self.layout().target_kind
    }

    fn read_sample(
        &self,
        index: u64,
        input: &mut [f32],
        target_values: &mut [f32],
    ) -> Result<SampleTarget, EngineError> {
        let layout = self.layout();
        check_sample_request(
            self.source(),
            index,
            layout.samples,
            input,
            layout.input_elements,
            target_values,
            layout.target_kind.value_elements(),
        )?;
        self.read_checked(SampleRequest {
            index,
            input,
            target_values,
        })
    }
}

/// The training set and, when the job has one, the test set.
#[derive(Clone)]
pub struct DataSets {
    pub train: Arc<dyn Dataset>,
    pub test: Option<Arc<dyn Dataset>>,
}

impl fmt::Debug for DataSets {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("DataSets")
            .field("train_samples", &self.train.len())
            .field("test_samples", &self.test.as_ref().map(|test| test.len()))
            .field("input_elements", &self.train.input_elements())
            .field("target_kind", &self.train.target_kind())
            .finish()
    }
}

/// Opens the job's data. Relative paths resolve against `base_directory` (the directory of
/// the job file). Every file is checked against the model before this returns: IDX image
/// dimensions against `input_shape` (`[H, W, 1]` or `[H*W]`), CIFAR-10 against
/// `[32, 32, 3]`, NPY elements per sample against the input and output elements, and every
/// class label against `0..classes` (an out-of-range label names the file and the index).
pub fn open_data_sets(job: &ValidatedJob, base_directory: &Path) -> Result<DataSets, EngineError> {
    let data = &job.spec.data;
    let input_shape = job.graph.input_shape;
    let input_elements = elements_as_usize(input_shape.elements(), "model.input_shape")?;
    let target_kind = target_kind_of(&job.graph)?;
    let resolve = |file: &str| -> PathBuf { base_directory.join(file) };
    match data.format {
        DataFormat::Synthetic => {
            let samples = data.samples.ok_or_else(|| {
                FieldError::new("data.samples", "required when data.format is \"synthetic\"")
            })?;
            let generator = Arc::new(synthetic::SyntheticGenerator::new(
                job.spec.training.seed,
                input_elements,
                target_kind,
            )?);
            let train: Arc<dyn Dataset> = Arc::new(synthetic::SyntheticDataset::new(
                generator.clone(),
                synthetic::SyntheticSplit::Train,
                samples,
            )?);
            // No test set for 0 test samples: an empty evaluation has no mean loss.
            let test = match data.test_samples {
                Some(test_samples) if test_samples > 0 => {
                    Some(Arc::new(synthetic::SyntheticDataset::new(
                        generator,
                        synthetic::SyntheticSplit::Test,
                        test_samples,
                    )?) as Arc<dyn Dataset>)
                }
                _ => None,
            };
            Ok(DataSets { train, test })
        }
        DataFormat::Idx => {
            let classes = classes_for_format(target_kind, DataFormat::Idx)?;
            let open_split =
                |files: &DataFiles, split: &str| -> Result<Arc<dyn Dataset>, EngineError> {
                    let images = required_file(&files.images, split, "images")?;
                    let labels = required_file(&files.labels, split, "labels")?;
                    Ok(Arc::new(idx::IdxDataset::open(
                        &resolve(images),
                        &resolve(labels),
                        input_shape,
                        classes,
                    )?))
                };
            open_file_splits(data.train.as_ref(), data.test.as_ref(), open_split)
        }
        DataFormat::Cifar10 => {
            let classes = classes_for_format(target_kind, DataFormat::Cifar10)?;
            let open_split = |files: &DataFiles,
                              split: &str|
             -> Result<Arc<dyn Dataset>, EngineError> {
                if files.files.is_empty() {
                    return Err(FieldError::new(
                        format!("{split}.files"),
                        "required when data.format is \"cifar10\"",
                    )
                    .into());
                }
                let paths: Vec<PathBuf> = files.files.iter().map(|file| resolve(file)).collect();
                Ok(Arc::new(cifar::Cifar10Dataset::open(
                    &paths,
                    input_shape,
                    classes,
                )?))
            };
            open_file_splits(data.train.as_ref(), data.test.as_ref(), open_split)
        }
        DataFormat::Npy => {
            let open_split =
                |files: &DataFiles, split: &str| -> Result<Arc<dyn Dataset>, EngineError> {
                    let inputs = required_file(&files.inputs, split, "inputs")?;
                    let targets = required_file(&files.targets, split, "targets")?;
                    Ok(Arc::new(npy::NpyDataset::open(
                        &resolve(inputs),
                        &resolve(targets),
                        input_elements,
                        target_kind,
                    )?))
                };
            open_file_splits(data.train.as_ref(), data.test.as_ref(), open_split)
        }
    }
}

/// Micro-batches (of `batch_size` samples) that make `epochs` passes over `samples`
/// samples: the batch sequence runs through the epochs back to back, so this is
/// `ceil(samples * epochs / batch_size)`. Saturates at `u64::MAX`; a batch size of 0 is
/// taken as 1.
pub fn steps_for_epochs(samples: u64, batch_size: u64, epochs: u64) -> u64 {
    let total = u128::from(samples) * u128::from(epochs);
    let steps = total.div_ceil(u128::from(batch_size.max(1)));
    u64::try_from(steps).unwrap_or(u64::MAX)
}

/// The targets the model's loss needs.
fn target_kind_of(graph: &ModelGraph) -> Result<TargetKind, EngineError> {
    match (graph.loss, graph.output_shape()) {
        (LossKind::SoftmaxCrossEntropy, FeatureShape::Flat { features }) => {
            // Labels travel as i32.
            if features > i32::MAX as u64 {
                return Err(FieldError::new(
                    "model.layers",
                    format!("{features} classes do not fit a 32-bit label"),
                )
                .into());
            }
            Ok(TargetKind::Classes { classes: features })
        }
        (LossKind::SoftmaxCrossEntropy, image) => Err(FieldError::new(
            "model.loss",
            format!(
                "softmax_cross_entropy needs flat class scores, the model gives a {image} image"
            ),
        )
        .into()),
        (LossKind::Mse, output) => Ok(TargetKind::Values {
            elements: elements_as_usize(output.elements(), "model.layers")?,
        }),
    }
}

fn classes_for_format(target_kind: TargetKind, format: DataFormat) -> Result<u64, EngineError> {
    match target_kind {
        TargetKind::Classes { classes } => Ok(classes),
        TargetKind::Values { .. } => Err(FieldError::new(
            "model.loss",
            format!(
                "{} data has integer labels; use softmax_cross_entropy",
                format.name()
            ),
        )
        .into()),
    }
}

fn required_file<'a>(
    file: &'a Option<String>,
    split: &str,
    field: &str,
) -> Result<&'a str, EngineError> {
    file.as_deref().ok_or_else(|| {
        FieldError::new(format!("{split}.{field}"), "required for this data format").into()
    })
}

fn open_file_splits(
    train: Option<&DataFiles>,
    test: Option<&DataFiles>,
    open_split: impl Fn(&DataFiles, &str) -> Result<Arc<dyn Dataset>, EngineError>,
) -> Result<DataSets, EngineError> {
    let train_files = train.ok_or_else(|| {
        EngineError::from(FieldError::new(
            "data.train",
            "required for this data format",
        ))
    })?;
    let train = open_split(train_files, "data.train")?;
    let test = test
        .map(|files| open_split(files, "data.test"))
        .transpose()?;
    Ok(DataSets { train, test })
}

fn elements_as_usize(elements: u64, field: &str) -> Result<usize, EngineError> {
    usize::try_from(elements).map_err(|_| {
        FieldError::new(
            field,
            format!("{elements} elements per sample do not fit this machine's address space"),
        )
        .into()
    })
}

/// `[28, 28, 1]` or `[784]`, the way the job file writes an input shape.
pub(crate) fn shape_as_written(shape: FeatureShape) -> String {
    match shape {
        FeatureShape::Image {
            height,
            width,
            channels,
        } => format!("[{height}, {width}, {channels}]"),
        FeatureShape::Flat { features } => format!("[{features}]"),
    }
}

/// The checks every `read_sample` starts with, so a caller's mistake is an error that says
/// what was wrong rather than a slice-index panic deep in a decoder.
pub(crate) fn check_sample_request(
    source: &str,
    index: u64,
    samples: u64,
    input: &[f32],
    input_elements: usize,
    target_values: &[f32],
    target_elements: usize,
) -> Result<(), EngineError> {
    if index >= samples {
        return Err(EngineError::data(
            source,
            format!("sample index {index} is outside 0..{samples}"),
        ));
    }
    if input.len() != input_elements {
        return Err(EngineError::data(
            source,
            format!(
                "input buffer holds {} elements, a sample has {input_elements}",
                input.len()
            ),
        ));
    }
    if target_values.len() != target_elements {
        return Err(EngineError::data(
            source,
            format!(
                "target buffer holds {} elements, a sample has {target_elements}",
                target_values.len()
            ),
        ));
    }
    Ok(())
}

/// The message for a label outside the model's classes.
pub(crate) fn label_out_of_range(label: impl fmt::Display, index: u64, classes: u64) -> String {
    format!("label {label} at index {index} is outside 0..{classes}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_for_epochs_rounds_up_and_saturates() {
        assert_eq!(steps_for_epochs(10, 4, 1), 3);
        assert_eq!(steps_for_epochs(10, 4, 2), 5);
        assert_eq!(steps_for_epochs(12, 4, 3), 9);
        assert_eq!(steps_for_epochs(60_000, 128, 2), 938);
        assert_eq!(steps_for_epochs(0, 4, 3), 0);
        assert_eq!(steps_for_epochs(5, 0, 1), 5);
        assert_eq!(steps_for_epochs(u64::MAX, 1, u64::MAX), u64::MAX);
    }

    #[test]
    fn shapes_are_written_as_in_the_job_file() {
        assert_eq!(
            shape_as_written(FeatureShape::Image {
                height: 28,
                width: 28,
                channels: 1
            }),
            "[28, 28, 1]"
        );
        assert_eq!(
            shape_as_written(FeatureShape::Flat { features: 784 }),
            "[784]"
        );
    }
}
