//! The `[model]` checks: the input shape, then shape inference through the layers (each
//! layer family's settings, parameter tensors and output shape), then the loss against
//! the last layer. Windows (convolution, pooling) follow TensorFlow's padding rules.

use super::{
    MAX_ELEMENTS_PER_SAMPLE, MAX_MODEL_LAYERS, SpecWarning, in_unit_interval, non_negative_finite,
    positive_finite,
};
use crate::error::FieldError;
use crate::model::{
    ActivationKind, FeatureShape, LayerNode, LayerOp, ModelGraph, ParameterTensor, TensorSource,
    WindowGeometry,
};
use crate::spec::{
    BatchNormSpec, Conv2dSpec, DenseSpec, DepthwiseConv2dSpec, Dimensions, JobSpec, LayerSpec,
    LossKind, Padding, PaddingMode, PoolSpec, ZeroPadding2dSpec,
};

mod graph;

use graph::{check_every_output_is_read, merged_shape, resolve_layer_inputs};

pub(super) fn infer_model_graph(spec: &JobSpec) -> Result<ModelGraph, FieldError> {
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
    let sources = resolve_layer_inputs(&model.layers)?;
    let mut layers: Vec<LayerNode> = Vec::with_capacity(model.layers.len());
    for ((index, entry), inputs) in model.layers.iter().enumerate().zip(sources) {
        let shapes: Vec<FeatureShape> = inputs
            .iter()
            .map(|source| match source {
                TensorSource::ModelInput => input_shape,
                TensorSource::Layer(producer) => layers[*producer].output_shape,
            })
            .collect();
        let mut node = infer_layer(index, &entry.layer, &shapes, &inputs, &layers)?;
        node.name = entry.name.clone();
        node.inputs = inputs;
        layers.push(node);
    }
    check_every_output_is_read(&layers)?;
    let current = layers
        .last()
        .map(|layer| layer.output_shape)
        .unwrap_or(input_shape);
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

/// A warning when an image shape reads like `[channels, height, width]` (PyTorch's order):
/// a small first dimension and a square, image-sized rest, such as `[3, 32, 32]`. Carve
/// reads `[height, width, channels]`, so such a spec trains on a 3-pixel-high image with 32
/// channels, which is valid but rarely meant.
pub(super) fn channels_first_warning(input_shape: &[u64]) -> Option<SpecWarning> {
    let [first, middle, last] = *input_shape else {
        return None;
    };
    (first <= 4 && last >= 8 && middle == last).then(|| SpecWarning {
        field: "model.input_shape".to_string(),
        message: format!(
            "[{first}, {middle}, {last}] looks channels-first; Carve reads [height, width, channels], so this is a {first}x{middle} image with {last} channels (did you mean [{middle}, {last}, {first}]?)"
        ),
    })
}

/// Resolves padding and checks the window against the input, TensorFlow's rules for "same".
/// `window_field` is the spec's name for the window (`kernel` for a convolution, `size` for a
/// pool), so errors point at the field the person wrote.
fn resolve_window(
    path: &str,
    window_field: &str,
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
            format!("{path}.{window_field}"),
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
                    format!("{pixels} pixels is not smaller than the {window_field} {kernel}"),
                ));
            }
            (pixels, pixels, pixels, pixels)
        }
        Padding::Named(PaddingMode::Same) => {
            let too_large = || {
                FieldError::new(
                    format!("{path}.{window_field}"),
                    format!("{kernel} is too large"),
                )
            };
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
            format!("{path}.{window_field}"),
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

/// Checks one layer against its input shape: its settings, its parameter tensors and its
/// output shape.
fn infer_layer(
    index: usize,
    layer: &LayerSpec,
    input_shapes: &[FeatureShape],
    sources: &[TensorSource],
    earlier: &[LayerNode],
) -> Result<LayerNode, FieldError> {
    let path = format!("model.layers[{index}].{}", layer.kind_name());
    let input = input_shapes[0];
    let (op, output_shape, parameters) = match layer {
        LayerSpec::Add(_) | LayerSpec::Concat(_) => {
            let is_add = matches!(layer, LayerSpec::Add(_));
            let output = merged_shape(&path, is_add, input_shapes, sources, earlier)?;
            let op = if is_add {
                LayerOp::Add
            } else {
                LayerOp::Concat
            };
            (op, output, Vec::new())
        }
        LayerSpec::Conv2d(conv) => infer_conv2d(&path, conv, input)?,
        LayerSpec::MaxPool(pool) => {
            infer_pool(&path, pool, input, |window| LayerOp::MaxPool { window })?
        }
        LayerSpec::AvgPool(pool) => {
            infer_pool(&path, pool, input, |window| LayerOp::AvgPool { window })?
        }
        LayerSpec::GlobalAvgPool(_) => {
            let (_, _, channels) = image_or_error(input, &path)?;
            (
                LayerOp::GlobalAvgPool,
                FeatureShape::Flat { features: channels },
                Vec::new(),
            )
        }
        LayerSpec::Relu(_) => activation(ActivationKind::Relu, input),
        LayerSpec::Relu6(_) => activation(ActivationKind::Relu6, input),
        LayerSpec::DepthwiseConv2d(depthwise) => infer_depthwise_conv2d(&path, depthwise, input)?,
        LayerSpec::ZeroPadding2d(padding) => infer_zero_padding(&path, padding, input)?,
        LayerSpec::Gelu(_) => activation(ActivationKind::Gelu, input),
        LayerSpec::Sigmoid(_) => activation(ActivationKind::Sigmoid, input),
        LayerSpec::Tanh(_) => activation(ActivationKind::Tanh, input),
        LayerSpec::LeakyRelu(leaky) => {
            non_negative_finite(leaky.alpha, &format!("{path}.alpha"))?;
            activation(ActivationKind::LeakyRelu { alpha: leaky.alpha }, input)
        }
        LayerSpec::BatchNorm(batch_norm) => infer_batch_norm(&path, batch_norm, input)?,
        LayerSpec::Dropout(dropout) => {
            in_unit_interval(dropout.rate, &format!("{path}.rate"))?;
            (LayerOp::Dropout { rate: dropout.rate }, input, Vec::new())
        }
        LayerSpec::Flatten(_) => (
            LayerOp::Flatten,
            FeatureShape::Flat {
                features: input.elements(),
            },
            Vec::new(),
        ),
        LayerSpec::Dense(dense) => infer_dense(&path, dense, input)?,
    };
    Ok(LayerNode {
        index,
        kind_name: layer.kind_name(),
        op,
        name: None,
        inputs: Vec::new(),
        input_shape: input,
        output_shape,
        parameters,
    })
}

/// What a layer is once checked: its operation, its output shape, its parameter tensors.
type InferredLayer = (LayerOp, FeatureShape, Vec<ParameterTensor>);

/// An activation keeps its input's shape and has no parameters.
fn activation(kind: ActivationKind, input: FeatureShape) -> InferredLayer {
    (LayerOp::Activation(kind), input, Vec::new())
}

fn infer_conv2d(
    path: &str,
    conv: &Conv2dSpec,
    input: FeatureShape,
) -> Result<InferredLayer, FieldError> {
    let (height, width, channels) = image_or_error(input, path)?;
    if conv.filters == 0 {
        return Err(FieldError::new(
            format!("{path}.filters"),
            "must be at least 1",
        ));
    }
    let (window, output_height, output_width) = resolve_window(
        path,
        "kernel",
        height,
        width,
        conv.kernel,
        conv.stride,
        conv.padding,
    )?;
    checked_elements(
        &[output_height, output_width, conv.filters],
        &format!("{path}.filters"),
    )?;
    let kernel_shape = vec![
        window.kernel_height,
        window.kernel_width,
        channels,
        conv.filters,
    ];
    let kernel_elements = checked_elements(&kernel_shape, &format!("{path}.filters"))?;
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
    Ok((
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
        kernel_and_bias(kernel_shape, kernel_elements, conv.use_bias, conv.filters),
    ))
}

fn infer_depthwise_conv2d(
    path: &str,
    depthwise: &DepthwiseConv2dSpec,
    input: FeatureShape,
) -> Result<InferredLayer, FieldError> {
    let (height, width, channels) = image_or_error(input, path)?;
    if depthwise.depth_multiplier == 0 {
        return Err(FieldError::new(
            format!("{path}.depth_multiplier"),
            "must be at least 1",
        ));
    }
    let (window, output_height, output_width) = resolve_window(
        path,
        "kernel",
        height,
        width,
        depthwise.kernel,
        depthwise.stride,
        depthwise.padding,
    )?;
    let multiplier_field = format!("{path}.depth_multiplier");
    let output_channels =
        checked_elements(&[channels, depthwise.depth_multiplier], &multiplier_field)?;
    checked_elements(
        &[output_height, output_width, output_channels],
        &multiplier_field,
    )?;
    let kernel_shape = vec![
        window.kernel_height,
        window.kernel_width,
        channels,
        depthwise.depth_multiplier,
    ];
    let kernel_elements = checked_elements(&kernel_shape, &multiplier_field)?;
    Ok((
        LayerOp::DepthwiseConv2d {
            multiplier: depthwise.depth_multiplier,
            window,
            use_bias: depthwise.use_bias,
        },
        FeatureShape::Image {
            height: output_height,
            width: output_width,
            channels: output_channels,
        },
        kernel_and_bias(
            kernel_shape,
            kernel_elements,
            depthwise.use_bias,
            output_channels,
        ),
    ))
}

fn infer_zero_padding(
    path: &str,
    padding: &ZeroPadding2dSpec,
    input: FeatureShape,
) -> Result<InferredLayer, FieldError> {
    let (height, width, channels) = image_or_error(input, path)?;
    let [top, bottom, left, right] = padding.padding.sides();
    let field = format!("{path}.padding");
    let too_large = || FieldError::new(field.clone(), "makes the image too large");
    let padded_height = height
        .checked_add(top)
        .and_then(|sum| sum.checked_add(bottom))
        .ok_or_else(too_large)?;
    let padded_width = width
        .checked_add(left)
        .and_then(|sum| sum.checked_add(right))
        .ok_or_else(too_large)?;
    checked_elements(&[padded_height, padded_width, channels], &field)?;
    Ok((
        LayerOp::ZeroPadding2d {
            top,
            bottom,
            left,
            right,
        },
        FeatureShape::Image {
            height: padded_height,
            width: padded_width,
            channels,
        },
        Vec::new(),
    ))
}

/// Max and average pooling share their window and shape rules.
fn infer_pool(
    path: &str,
    pool: &PoolSpec,
    input: FeatureShape,
    pool_op: impl FnOnce(WindowGeometry) -> LayerOp,
) -> Result<InferredLayer, FieldError> {
    let (height, width, channels) = image_or_error(input, path)?;
    let stride = pool.stride.unwrap_or(pool.size);
    let (window, output_height, output_width) =
        resolve_window(path, "size", height, width, pool.size, stride, pool.padding)?;
    // Explicit padding can make the output larger than the input: count it.
    checked_elements(
        &[output_height, output_width, channels],
        &format!("{path}.padding"),
    )?;
    Ok((
        pool_op(window),
        FeatureShape::Image {
            height: output_height,
            width: output_width,
            channels,
        },
        Vec::new(),
    ))
}

fn infer_batch_norm(
    path: &str,
    batch_norm: &BatchNormSpec,
    input: FeatureShape,
) -> Result<InferredLayer, FieldError> {
    in_unit_interval(batch_norm.momentum, &format!("{path}.momentum"))?;
    positive_finite(batch_norm.epsilon, &format!("{path}.epsilon"))?;
    let channels = match input {
        FeatureShape::Image { channels, .. } => channels,
        FeatureShape::Flat { features } => features,
    };
    let mut parameters = vec![
        trainable_vector("gamma", channels),
        trainable_vector("beta", channels),
    ];
    for name in ["running_mean", "running_variance"] {
        parameters.push(ParameterTensor {
            name,
            shape: vec![channels],
            elements: channels,
            trainable: false,
        });
    }
    Ok((
        LayerOp::BatchNorm {
            momentum: batch_norm.momentum,
            epsilon: batch_norm.epsilon,
        },
        input,
        parameters,
    ))
}

fn infer_dense(
    path: &str,
    dense: &DenseSpec,
    input: FeatureShape,
) -> Result<InferredLayer, FieldError> {
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
    let kernel_shape = vec![features, dense.units];
    let kernel_elements = checked_elements(&kernel_shape, &format!("{path}.units"))?;
    Ok((
        LayerOp::Dense {
            units: dense.units,
            use_bias: dense.use_bias,
        },
        FeatureShape::Flat {
            features: dense.units,
        },
        kernel_and_bias(kernel_shape, kernel_elements, dense.use_bias, dense.units),
    ))
}

/// A trainable kernel, and a bias of `bias_elements` when the layer has one.
fn kernel_and_bias(
    kernel_shape: Vec<u64>,
    kernel_elements: u64,
    use_bias: bool,
    bias_elements: u64,
) -> Vec<ParameterTensor> {
    let mut parameters = vec![ParameterTensor {
        name: "kernel",
        shape: kernel_shape,
        elements: kernel_elements,
        trainable: true,
    }];
    if use_bias {
        parameters.push(trainable_vector("bias", bias_elements));
    }
    parameters
}

fn trainable_vector(name: &'static str, elements: u64) -> ParameterTensor {
    ParameterTensor {
        name,
        shape: vec![elements],
        elements,
        trainable: true,
    }
}
