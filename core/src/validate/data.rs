//! The `[data]` checks: the format's files, prefetching, and what the data set asks of
//! the model (CIFAR-10's shape and classes, IDX's integer labels).

use crate::error::FieldError;
use crate::model::{FeatureShape, ModelGraph};
use crate::spec::{DataFiles, DataFormat, JobSpec, LossKind};

pub(super) fn validate_data(spec: &JobSpec, graph: &ModelGraph) -> Result<(), FieldError> {
    let data = &spec.data;
    if data.prefetch_batches == 0 || data.prefetch_batches > 16 {
        return Err(FieldError::new(
            "data.prefetch_batches",
            format!("{} must be between 1 and 16", data.prefetch_batches),
        ));
    }
    let format_name = data.format.name();
    let not_used = |field: &str| {
        FieldError::new(
            format!("data.{field}"),
            format!("is not used by format \"{format_name}\""),
        )
    };
    if data.format == DataFormat::Synthetic {
        match data.samples {
            None => {
                return Err(FieldError::new(
                    "data.samples",
                    "required when data.format is \"synthetic\"",
                ));
            }
            Some(0) => return Err(FieldError::new("data.samples", "must be at least 1")),
            Some(_) => {}
        }
        if data.train.is_some() {
            return Err(not_used("train"));
        }
        if data.test.is_some() {
            return Err(not_used("test"));
        }
        return Ok(());
    }
    if data.samples.is_some() {
        return Err(not_used("samples"));
    }
    if data.test_samples.is_some() {
        return Err(not_used("test_samples"));
    }
    let train = data.train.as_ref().ok_or_else(|| {
        FieldError::new(
            "data.train",
            format!("required when data.format is \"{format_name}\""),
        )
    })?;
    check_split_files(data.format, "data.train", train)?;
    if let Some(test) = &data.test {
        check_split_files(data.format, "data.test", test)?;
    }
    let classes = match graph.output_shape() {
        FeatureShape::Flat { features } => Some(features),
        FeatureShape::Image { .. } => None,
    };
    match data.format {
        DataFormat::Idx if graph.loss != LossKind::SoftmaxCrossEntropy => Err(FieldError::new(
            "model.loss",
            "IDX data has integer labels; use softmax_cross_entropy",
        )),
        DataFormat::Cifar10 => {
            if spec.model.input_shape != [32, 32, 3] {
                return Err(FieldError::new(
                    "model.input_shape",
                    format!(
                        "CIFAR-10 images are [32, 32, 3], not {:?}",
                        spec.model.input_shape
                    ),
                ));
            }
            if graph.loss != LossKind::SoftmaxCrossEntropy || classes != Some(10) {
                return Err(FieldError::new(
                    "model.loss",
                    "CIFAR-10 has 10 classes: end with a 10-unit dense layer and softmax_cross_entropy",
                ));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn check_split_files(format: DataFormat, path: &str, files: &DataFiles) -> Result<(), FieldError> {
    let format_name = format.name();
    let required = |field: &str, present: bool| {
        if present {
            Ok(())
        } else {
            Err(FieldError::new(
                format!("{path}.{field}"),
                format!("required when data.format is \"{format_name}\""),
            ))
        }
    };
    let unused = |field: &str, present: bool| {
        if present {
            Err(FieldError::new(
                format!("{path}.{field}"),
                format!("is not used by format \"{format_name}\""),
            ))
        } else {
            Ok(())
        }
    };
    let empty_path = [&files.images, &files.labels, &files.inputs, &files.targets]
        .into_iter()
        .flatten()
        .chain(&files.files)
        .any(|file| file.trim().is_empty());
    if empty_path {
        return Err(FieldError::new(path, "file paths must not be empty"));
    }
    match format {
        DataFormat::Idx => {
            required("images", files.images.is_some())?;
            required("labels", files.labels.is_some())?;
            unused("files", !files.files.is_empty())?;
            unused("inputs", files.inputs.is_some())?;
            unused("targets", files.targets.is_some())
        }
        DataFormat::Cifar10 => {
            required("files", !files.files.is_empty())?;
            unused("images", files.images.is_some())?;
            unused("labels", files.labels.is_some())?;
            unused("inputs", files.inputs.is_some())?;
            unused("targets", files.targets.is_some())
        }
        DataFormat::Npy => {
            required("inputs", files.inputs.is_some())?;
            required("targets", files.targets.is_some())?;
            unused("images", files.images.is_some())?;
            unused("labels", files.labels.is_some())?;
            unused("files", !files.files.is_empty())
        }
        DataFormat::Synthetic => Ok(()),
    }
}

/// Refuses a relative data path, for a job that a worker runs: the worker would read it
/// from its own directory, which has nothing to do with the job file's. `carve run` reads
/// relative paths against the job file and does not ask this; `carve submit` makes them
/// absolute before sending, so only a spec written by another client meets it.
pub fn require_absolute_data_paths(spec: &JobSpec) -> Result<(), FieldError> {
    let splits = [
        ("data.train", &spec.data.train),
        ("data.test", &spec.data.test),
    ];
    for (split, files) in splits {
        let Some(files) = files else { continue };
        let named = [
            ("images", &files.images),
            ("labels", &files.labels),
            ("inputs", &files.inputs),
            ("targets", &files.targets),
        ]
        .into_iter()
        .filter_map(|(field, path)| Some((field.to_string(), path.as_ref()?)));
        let listed = files
            .files
            .iter()
            .enumerate()
            .map(|(index, path)| (format!("files[{index}]"), path));
        for (field, path) in named.chain(listed) {
            if !std::path::Path::new(path).is_absolute() {
                return Err(FieldError::new(
                    format!("{split}.{field}"),
                    format!(
                        "\"{path}\" is a relative path, which a worker would read from its own \
                         directory, not the job file's: give an absolute path (carve submit \
                         makes a job file's relative paths absolute)"
                    ),
                ));
            }
        }
    }
    Ok(())
}
