//! Reading and checking job specs: strict parsing with field paths, then every semantic
//! check and shape inference through the layers.
//!
//! All size arithmetic is checked, so an absurd spec (a 10^12-pixel image, a batch of 2^60)
//! is an error that names the field, never an overflow.

use std::collections::HashSet;

use crate::error::FieldError;
use crate::model::{
    ActivationKind, FeatureShape, LayerNode, LayerOp, ModelGraph, ParameterTensor, WindowGeometry,
};
use crate::spec::{
    DataFiles, DataFormat, Dimensions, JobSpec, LayerSpec, LossKind, OptimizerSpec, Padding,
    PaddingMode, Precision, VramRequest,
};

/// Per-sample elements above this are refused: 2^40 fp32 values is 4 TiB for one sample,
/// far beyond any GPU, and keeping a bound leaves room for batch and byte multiplication.
pub const MAX_ELEMENTS_PER_SAMPLE: u64 = 1 << 40;

/// Models with more layers than this are refused at `model.layers`. Validating,
/// estimating and shrink-planning a job cost time in proportion to its layer count, and a
/// submit pays for them, so the count is bounded. Real models fit with room: ResNet-152 is
/// about 500 layers here (every conv, batch norm and activation counts), large graph
/// models a few thousand. The scheduler may refuse a larger spec early with this same
/// number.
pub const MAX_MODEL_LAYERS: usize = 4096;

/// A spec that passed every check, with its model's shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedJob {
    pub spec: JobSpec,
    pub graph: ModelGraph,
}

/// Reads a job spec from TOML, rejecting unknown fields with their path.
pub fn parse_job_spec_toml(text: &str) -> Result<JobSpec, FieldError> {
    let deserializer = toml::Deserializer::parse(text)
        .map_err(|error| FieldError::new("", error.to_string().trim()))?;
    serde_path_to_error::deserialize(deserializer).map_err(|error| {
        let field = field_path(error.path().to_string(), error.inner().message());
        let reason = with_line_number(text, error.inner());
        FieldError::new(field, reason)
    })
}

/// Reads a job spec from JSON (how it travels over the API).
pub fn parse_job_spec_json(text: &str) -> Result<JobSpec, FieldError> {
    let mut deserializer = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let reason = error.inner().to_string();
        FieldError::new(field_path(error.path().to_string(), &reason), reason)
    })
}

/// Parses and validates in one go.
pub fn load_job_spec_toml(text: &str) -> Result<ValidatedJob, FieldError> {
    validate_job_spec(parse_job_spec_toml(text)?)
}

/// The path serde_path_to_error reports, empty for the document itself; serde reports a
/// missing field at the table that lacks it, so the missing key is added to the path.
fn field_path(path: String, message: &str) -> String {
    let path = if path == "." { String::new() } else { path };
    match message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split_once('`'))
    {
        Some((name, _)) if path.is_empty() => name.to_string(),
        Some((name, _)) => format!("{path}.{name}"),
        None => path,
    }
}

/// The message alone (the path is reported apart), with the line it is on when known.
fn with_line_number(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim();
    match error.span() {
        Some(span) if span.start <= text.len() => {
            let line = text[..span.start].matches('\n').count() + 1;
            format!("{message} (line {line})")
        }
        _ => message.to_string(),
    }
}

/// Every semantic check of a spec; returns the model graph with inferred shapes.
pub fn validate_job_spec(spec: JobSpec) -> Result<ValidatedJob, FieldError> {
    validate_name(&spec.name)?;
    let graph = infer_model_graph(&spec)?;
    validate_training(&spec)?;
    validate_data(&spec, &graph)?;
    validate_resources_and_policy(&spec)?;
    Ok(ValidatedJob { spec, graph })
}

fn validate_name(name: &str) -> Result<(), FieldError> {
    if name.is_empty() {
        return Err(FieldError::new("name", "must not be empty"));
    }
    if name.len() > 128 {
        return Err(FieldError::new(
            "name",
            format!("is {} characters long; the limit is 128", name.len()),
        ));
    }
    if let Some(bad) = name.chars().find(|character| {
        !(character.is_ascii_alphanumeric() || matches!(character, '-' | '_' | '.'))
    }) {
        return Err(FieldError::new(
            "name",
            format!("{bad:?} is not allowed; use letters, digits, '-', '_' and '.'"),
        ));
    }
    Ok(())
}

fn infer_model_graph(spec: &JobSpec) -> Result<ModelGraph, FieldError> {
    let model = &spec.model;
    let input_shape = match model.input_shape.as_slice() {
        [features] => FeatureShape::Flat {
            features: *features,
        },
        [height, width, channels] => FeatureShape::Image {
            height: *height,
            width: *width,
            channels: *channels,
        },
        other => {
            return Err(FieldError::new(
                "model.input_shape",
                format!(
                    "has {} dimensions; expected [height, width, channels] or [features]",
                    other.len()
                ),
            ));
        }
    };
    if model.input_shape.contains(&0) {
        return Err(FieldError::new(
            "model.input_shape",
            "every dimension must be at least 1",
        ));
    }
    checked_elements(&model.input_shape, "model.input_shape")?;
    if model.layers.is_empty() {
        return Err(FieldError::new(
            "model.layers",
            "must have at least one layer",
        ));
    }
    if model.layers.len() > MAX_MODEL_LAYERS {
        return Err(FieldError::new(
            "model.layers",
            format!(
                "has {} layers; the limit is {MAX_MODEL_LAYERS}",
                model.layers.len()
            ),
        ));
    }
    let mut layers = Vec::with_capacity(model.layers.len());
    let mut current = input_shape;
    for (index, layer) in model.layers.iter().enumerate() {
        let node = infer_layer(index, layer, current)?;
        current = node.output_shape;
        layers.push(node);
    }
    match (model.loss, current) {
        (LossKind::SoftmaxCrossEntropy, FeatureShape::Flat { features }) if features >= 2 => {}
        (LossKind::SoftmaxCrossEntropy, FeatureShape::Flat { features }) => {
            return Err(FieldError::new(
                "model.loss",
                format!(
                    "softmax_cross_entropy needs at least 2 classes, the last layer has {features} output"
                ),
            ));
        }
        (LossKind::SoftmaxCrossEntropy, image) => {
            return Err(FieldError::new(
                "model.loss",
                format!(
                    "softmax_cross_entropy needs flat class scores, the last layer gives a {image} image; end with flatten and dense"
                ),
            ));
        }
        (LossKind::Mse, _) => {}
    }
    Ok(ModelGraph {
        input_shape,
        layers,
        loss: model.loss,
    })
}

fn checked_elements(dimensions: &[u64], field: &str) -> Result<u64, FieldError> {
    let elements = dimensions
        .iter()
        .try_fold(1u64, |product, dimension| product.checked_mul(*dimension))
        .filter(|elements| *elements <= MAX_ELEMENTS_PER_SAMPLE)
        .ok_or_else(|| {
            FieldError::new(
                field,
                format!(
                    "{dimensions:?} is more than {MAX_ELEMENTS_PER_SAMPLE} elements per sample"
                ),
            )
        })?;
    Ok(elements)
}

fn image_or_error(shape: FeatureShape, path: &str) -> Result<(u64, u64, u64), FieldError> {
    match shape {
        FeatureShape::Image {
            height,
            width,
            channels,
        } => Ok((height, width, channels)),
        FeatureShape::Flat { features } => Err(FieldError::new(
            path,
            format!(
                "needs an image input [height, width, channels], got {features} flat features (put image layers before flatten)"
            ),
        )),
    }
}

/// Resolves padding and checks the window against the input, TensorFlow's rules for "same".
fn resolve_window(
    path: &str,
    input_height: u64,
    input_width: u64,
    kernel: Dimensions,
    stride: Dimensions,
    padding: Padding,
) -> Result<(WindowGeometry, u64, u64), FieldError> {
    let (kernel_height, kernel_width) = (kernel.height(), kernel.width());
    let (stride_height, stride_width) = (stride.height(), stride.width());
    if kernel_height == 0 || kernel_width == 0 {
        return Err(FieldError::new(
            format!("{path}.kernel"),
            "must be at least 1",
        ));
    }
    if stride_height == 0 || stride_width == 0 {
        return Err(FieldError::new(
            format!("{path}.stride"),
            "must be at least 1",
        ));
    }
    let (padding_top, padding_bottom, padding_left, padding_right) = match padding {
        Padding::Named(PaddingMode::Valid) => (0, 0, 0, 0),
        Padding::Pixels(pixels) => {
            if pixels >= kernel_height.min(kernel_width) {
                return Err(FieldError::new(
                    format!("{path}.padding"),
                    format!("{pixels} pixels is not smaller than the {kernel} kernel"),
                ));
            }
            (pixels, pixels, pixels, pixels)
        }
        Padding::Named(PaddingMode::Same) => {
            let too_large =
                || FieldError::new(format!("{path}.kernel"), format!("{kernel} is too large"));
            let total_height = same_padding_total(input_height, kernel_height, stride_height)
                .ok_or_else(too_large)?;
            let total_width = same_padding_total(input_width, kernel_width, stride_width)
                .ok_or_else(too_large)?;
            (
                total_height / 2,
                total_height - total_height / 2,
                total_width / 2,
                total_width - total_width / 2,
            )
        }
    };
    let padded = |input: u64, before: u64, after: u64| {
        input
            .checked_add(before)
            .and_then(|sum| sum.checked_add(after))
            .ok_or_else(|| {
                FieldError::new(
                    format!("{path}.padding"),
                    "makes the padded input too large",
                )
            })
    };
    let padded_height = padded(input_height, padding_top, padding_bottom)?;
    let padded_width = padded(input_width, padding_left, padding_right)?;
    if kernel_height > padded_height || kernel_width > padded_width {
        return Err(FieldError::new(
            format!("{path}.kernel"),
            format!("{kernel} is larger than the {padded_height}x{padded_width} input"),
        ));
    }
    let output_height = (padded_height - kernel_height) / stride_height + 1;
    let output_width = (padded_width - kernel_width) / stride_width + 1;
    Ok((
        WindowGeometry {
            kernel_height,
            kernel_width,
            stride_height,
            stride_width,
            padding_top,
            padding_bottom,
            padding_left,
            padding_right,
        },
        output_height,
        output_width,
    ))
}

/// None when the kernel is so large that the padded size does not fit in u64.
fn same_padding_total(input: u64, kernel: u64, stride: u64) -> Option<u64> {
    let output = input.div_ceil(stride);
    Some(
        ((output - 1) * stride)
            .checked_add(kernel)?
            .saturating_sub(input),
    )
}

fn infer_layer(
    index: usize,
    layer: &LayerSpec,
    input: FeatureShape,
) -> Result<LayerNode, FieldError> {
    let path = format!("model.layers[{index}].{}", layer.kind_name());
    let mut parameters = Vec::new();
    let (op, output_shape) = match layer {
        LayerSpec::Conv2d(conv) => {
            let (height, width, channels) = image_or_error(input, &path)?;
            if conv.filters == 0 {
                return Err(FieldError::new(
                    format!("{path}.filters"),
                    "must be at least 1",
                ));
            }
            let (window, output_height, output_width) =
                resolve_window(&path, height, width, conv.kernel, conv.stride, conv.padding)?;
            checked_elements(
                &[output_height, output_width, conv.filters],
                &format!("{path}.filters"),
            )?;
            let kernel_elements = checked_elements(
                &[
                    window.kernel_height,
                    window.kernel_width,
                    channels,
                    conv.filters,
                ],
                &format!("{path}.filters"),
            )?;
            // The im2col workspace of one sample must be countable too.
            checked_elements(
                &[
                    channels,
                    window.kernel_height,
                    window.kernel_width,
                    output_height,
                    output_width,
                ],
                &format!("{path}.kernel"),
            )?;
            parameters.push(ParameterTensor {
                name: "kernel",
                shape: vec![
                    window.kernel_height,
                    window.kernel_width,
                    channels,
                    conv.filters,
                ],
                elements: kernel_elements,
                trainable: true,
            });
            if conv.use_bias {
                parameters.push(trainable_vector("bias", conv.filters));
            }
            (
                LayerOp::Conv2d {
                    filters: conv.filters,
                    window,
                    use_bias: conv.use_bias,
                },
                FeatureShape::Image {
                    height: output_height,
                    width: output_width,
                    channels: conv.filters,
                },
            )
        }
        LayerSpec::MaxPool(pool) | LayerSpec::AvgPool(pool) => {
            let (height, width, channels) = image_or_error(input, &path)?;
            let stride = pool.stride.unwrap_or(pool.size);
            let (window, output_height, output_width) =
                resolve_window(&path, height, width, pool.size, stride, pool.padding)?;
            // Explicit padding can make the output larger than the input: count it.
            checked_elements(
                &[output_height, output_width, channels],
                &format!("{path}.padding"),
            )?;
            let op = if matches!(layer, LayerSpec::MaxPool(_)) {
                LayerOp::MaxPool { window }
            } else {
                LayerOp::AvgPool { window }
            };
            (
                op,
                FeatureShape::Image {
                    height: output_height,
                    width: output_width,
                    channels,
                },
            )
        }
        LayerSpec::GlobalAvgPool(_) => {
            let (_, _, channels) = image_or_error(input, &path)?;
            (
                LayerOp::GlobalAvgPool,
                FeatureShape::Flat { features: channels },
            )
        }
        LayerSpec::Relu(_) => (LayerOp::Activation(ActivationKind::Relu), input),
        LayerSpec::Gelu(_) => (LayerOp::Activation(ActivationKind::Gelu), input),
        LayerSpec::Sigmoid(_) => (LayerOp::Activation(ActivationKind::Sigmoid), input),
        LayerSpec::Tanh(_) => (LayerOp::Activation(ActivationKind::Tanh), input),
        LayerSpec::LeakyRelu(leaky) => {
            if !(leaky.alpha.is_finite() && leaky.alpha >= 0.0) {
                return Err(FieldError::new(
                    format!("{path}.alpha"),
                    format!("{} must be a finite number >= 0", leaky.alpha),
                ));
            }
            (
                LayerOp::Activation(ActivationKind::LeakyRelu { alpha: leaky.alpha }),
                input,
            )
        }
        LayerSpec::BatchNorm(batch_norm) => {
            if !(0.0..1.0).contains(&batch_norm.momentum) {
                return Err(FieldError::new(
                    format!("{path}.momentum"),
                    format!("{} must be in [0, 1)", batch_norm.momentum),
                ));
            }
            if !(batch_norm.epsilon.is_finite() && batch_norm.epsilon > 0.0) {
                return Err(FieldError::new(
                    format!("{path}.epsilon"),
                    format!("{} must be a finite number > 0", batch_norm.epsilon),
                ));
            }
            let channels = match input {
                FeatureShape::Image { channels, .. } => channels,
                FeatureShape::Flat { features } => features,
            };
            parameters.push(trainable_vector("gamma", channels));
            parameters.push(trainable_vector("beta", channels));
            for name in ["running_mean", "running_variance"] {
                parameters.push(ParameterTensor {
                    name,
                    shape: vec![channels],
                    elements: channels,
                    trainable: false,
                });
            }
            (
                LayerOp::BatchNorm {
                    momentum: batch_norm.momentum,
                    epsilon: batch_norm.epsilon,
                },
                input,
            )
        }
        LayerSpec::Dropout(dropout) => {
            if !(0.0..1.0).contains(&dropout.rate) {
                return Err(FieldError::new(
                    format!("{path}.rate"),
                    format!("{} must be in [0, 1)", dropout.rate),
                ));
            }
            (LayerOp::Dropout { rate: dropout.rate }, input)
        }
        LayerSpec::Flatten(_) => (
            LayerOp::Flatten,
            FeatureShape::Flat {
                features: input.elements(),
            },
        ),
        LayerSpec::Dense(dense) => {
            let features = match input {
                FeatureShape::Flat { features } => features,
                image => {
                    return Err(FieldError::new(
                        path,
                        format!(
                            "needs a flat input, got a {image} image; add {{ flatten = {{}} }} before it"
                        ),
                    ));
                }
            };
            if dense.units == 0 {
                return Err(FieldError::new(
                    format!("{path}.units"),
                    "must be at least 1",
                ));
            }
            checked_elements(&[dense.units], &format!("{path}.units"))?;
            let kernel_elements =
                checked_elements(&[features, dense.units], &format!("{path}.units"))?;
            parameters.push(ParameterTensor {
                name: "kernel",
                shape: vec![features, dense.units],
                elements: kernel_elements,
                trainable: true,
            });
            if dense.use_bias {
                parameters.push(trainable_vector("bias", dense.units));
            }
            (
                LayerOp::Dense {
                    units: dense.units,
                    use_bias: dense.use_bias,
                },
                FeatureShape::Flat {
                    features: dense.units,
                },
            )
        }
    };
    Ok(LayerNode {
        index,
        kind_name: layer.kind_name(),
        op,
        input_shape: input,
        output_shape,
        parameters,
    })
}

fn trainable_vector(name: &'static str, elements: u64) -> ParameterTensor {
    ParameterTensor {
        name,
        shape: vec![elements],
        elements,
        trainable: true,
    }
}

fn positive_finite(value: f64, field: &str) -> Result<(), FieldError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{value} must be a finite number > 0"),
        ))
    }
}

fn in_unit_interval(value: f64, field: &str) -> Result<(), FieldError> {
    if (0.0..1.0).contains(&value) {
        Ok(())
    } else {
        Err(FieldError::new(field, format!("{value} must be in [0, 1)")))
    }
}

fn non_negative_finite(value: f64, field: &str) -> Result<(), FieldError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(FieldError::new(
            field,
            format!("{value} must be a finite number >= 0"),
        ))
    }
}

fn validate_training(spec: &JobSpec) -> Result<(), FieldError> {
    let training = &spec.training;
    if training.batch_size == 0 {
        return Err(FieldError::new("training.batch_size", "must be at least 1"));
    }
    if training.batch_size > 1 << 24 {
        return Err(FieldError::new(
            "training.batch_size",
            format!(
                "{} is larger than the limit of {}",
                training.batch_size,
                1u64 << 24
            ),
        ));
    }
    match (training.steps, training.epochs) {
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                "training.epochs",
                "give either steps or epochs, not both",
            ));
        }
        (None, None) => {
            return Err(FieldError::new(
                "training.steps",
                "give either steps or epochs",
            ));
        }
        (Some(0), None) => return Err(FieldError::new("training.steps", "must be at least 1")),
        (None, Some(0)) => return Err(FieldError::new("training.epochs", "must be at least 1")),
        _ => {}
    }
    if training.accumulation_steps == 0 {
        return Err(FieldError::new(
            "training.accumulation_steps",
            "must be at least 1",
        ));
    }
    if !training
        .batch_size
        .is_multiple_of(training.accumulation_steps)
    {
        return Err(FieldError::new(
            "training.accumulation_steps",
            format!(
                "{} does not divide batch_size {}",
                training.accumulation_steps, training.batch_size
            ),
        ));
    }
    if let Some(segment) = training.recompute_segment_layers {
        let layer_count = spec.model.layers.len() as u64;
        if segment == 0 || segment > layer_count {
            return Err(FieldError::new(
                "training.recompute_segment_layers",
                format!("{segment} must be between 1 and the {layer_count} layers of the model"),
            ));
        }
    }
    match &training.optimizer {
        OptimizerSpec::Sgd(sgd) => {
            positive_finite(sgd.learning_rate, "training.optimizer.sgd.learning_rate")?;
            in_unit_interval(sgd.momentum, "training.optimizer.sgd.momentum")?;
            non_negative_finite(sgd.weight_decay, "training.optimizer.sgd.weight_decay")?;
            if sgd.nesterov && sgd.momentum == 0.0 {
                return Err(FieldError::new(
                    "training.optimizer.sgd.nesterov",
                    "needs momentum > 0",
                ));
            }
        }
        OptimizerSpec::Adam(adam) | OptimizerSpec::Adamw(adam) => {
            let prefix = format!("training.optimizer.{}", training.optimizer.kind_name());
            positive_finite(adam.learning_rate, &format!("{prefix}.learning_rate"))?;
            in_unit_interval(adam.beta1, &format!("{prefix}.beta1"))?;
            in_unit_interval(adam.beta2, &format!("{prefix}.beta2"))?;
            positive_finite(adam.epsilon, &format!("{prefix}.epsilon"))?;
            non_negative_finite(adam.weight_decay, &format!("{prefix}.weight_decay"))?;
        }
    }
    Ok(())
}

fn validate_data(spec: &JobSpec, graph: &ModelGraph) -> Result<(), FieldError> {
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

fn validate_resources_and_policy(spec: &JobSpec) -> Result<(), FieldError> {
    if spec.resources.gpus != 1 {
        return Err(FieldError::new(
            "resources.gpus",
            format!(
                "{} GPUs asked; a job runs on exactly 1 GPU slice for now",
                spec.resources.gpus
            ),
        ));
    }
    if spec.resources.vram == VramRequest::Bytes(0) {
        return Err(FieldError::new(
            "resources.vram",
            "must be \"auto\" or more than 0 bytes",
        ));
    }
    let policy = &spec.oom;
    let mut seen = HashSet::new();
    for (index, strategy) in policy.strategies.iter().enumerate() {
        if !seen.insert(*strategy) {
            return Err(FieldError::new(
                format!("oom.strategies[{index}]"),
                format!("{} is listed twice", strategy.name()),
            ));
        }
    }
    if policy.min_micro_batch == 0 {
        return Err(FieldError::new("oom.min_micro_batch", "must be at least 1"));
    }
    if policy.min_micro_batch > spec.training.batch_size {
        return Err(FieldError::new(
            "oom.min_micro_batch",
            format!(
                "{} is larger than training.batch_size {}",
                policy.min_micro_batch, spec.training.batch_size
            ),
        ));
    }
    if policy.half_precision == Precision::Fp32 {
        return Err(FieldError::new(
            "oom.half_precision",
            "must be fp16 or bf16",
        ));
    }
    if policy.max_retries > 100 {
        return Err(FieldError::new(
            "oom.max_retries",
            format!("{} is more than the limit of 100", policy.max_retries),
        ));
    }
    Ok(())
}
