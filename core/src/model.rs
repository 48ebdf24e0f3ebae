//! The model graph: a job's layer list with every shape worked out and every setting
//! resolved (padding in pixels, default strides filled in), ready for the step plan.
//!
//! The graph is also what the store keeps of a model job after admission (the serde
//! derives here are that stored form's, `workload/stored.rs`, never the wire's), so a
//! stored job is never inferred again.
//!
//! Shapes are per sample. Images are `height x width x channels` (channels last, as the job
//! file writes them); how a backend lays them out in memory is its own business, since the
//! byte counts are the same.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::spec::{LayerSpec, LossKind};

/// The shape of one sample's features between two layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FeatureShape {
    Image {
        height: u64,
        width: u64,
        channels: u64,
    },
    Flat {
        features: u64,
    },
}

impl FeatureShape {
    /// Elements per sample. Shapes are only built through checked arithmetic in shape
    /// inference, so this product is known to fit.
    pub fn elements(&self) -> u64 {
        match *self {
            FeatureShape::Image {
                height,
                width,
                channels,
            } => height * width * channels,
            FeatureShape::Flat { features } => features,
        }
    }
}

impl fmt::Display for FeatureShape {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeatureShape::Image {
                height,
                width,
                channels,
            } => write!(formatter, "{height}x{width}x{channels}"),
            FeatureShape::Flat { features } => write!(formatter, "{features}"),
        }
    }
}

/// A convolution or pooling window with its padding resolved to pixels per side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WindowGeometry {
    pub kernel_height: u64,
    pub kernel_width: u64,
    pub stride_height: u64,
    pub stride_width: u64,
    pub padding_top: u64,
    pub padding_bottom: u64,
    pub padding_left: u64,
    pub padding_right: u64,
}

impl WindowGeometry {
    /// A 1x1, stride-1, unpadded window: a convolution with it multiplies the NHWC input
    /// directly, which is already the im2col matrix, so it needs no workspace.
    pub fn is_pointwise(&self) -> bool {
        self.kernel_height == 1
            && self.kernel_width == 1
            && self.stride_height == 1
            && self.stride_width == 1
            && self.padding_top + self.padding_bottom + self.padding_left + self.padding_right == 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum ActivationKind {
    Relu,
    /// `min(max(x, 0), 6)`, MobileNet's activation (Keras' ReLU(max_value=6)).
    Relu6,
    LeakyRelu {
        alpha: f64,
    },
    Gelu,
    Sigmoid,
    Tanh,
}

/// What a layer computes, with everything resolved.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LayerOp {
    Conv2d {
        filters: u64,
        window: WindowGeometry,
        use_bias: bool,
    },
    MaxPool {
        window: WindowGeometry,
    },
    AvgPool {
        window: WindowGeometry,
    },
    GlobalAvgPool,
    Activation(ActivationKind),
    BatchNorm {
        momentum: f64,
        epsilon: f64,
    },
    Dropout {
        rate: f64,
    },
    Flatten,
    Dense {
        units: u64,
        use_bias: bool,
    },
    /// One `window` filter per input channel and multiplier: `channels * multiplier`
    /// outputs, kernel `[kernel_height, kernel_width, channels, multiplier]`.
    DepthwiseConv2d {
        multiplier: u64,
        window: WindowGeometry,
        use_bias: bool,
    },
    /// Zeros added around the image.
    ZeroPadding2d {
        top: u64,
        bottom: u64,
        left: u64,
        right: u64,
    },
    /// The element-wise sum of its inputs (a residual connection).
    Add,
    /// Its inputs side by side along the last axis (channels of images, features).
    Concat,
}

/// Where a layer's input comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TensorSource {
    ModelInput,
    /// The output of the layer at this index, always an earlier one.
    Layer(usize),
}

/// A name from a fixed list (a layer's kind, a parameter's name). The alias keeps serde
/// from borrowing it from the text it reads: it is read back as the listed name.
pub type KnownName = &'static str;

/// Every name a layer's parameter tensor has.
pub const PARAMETER_NAMES: &[&str] = &[
    "kernel",
    "bias",
    "gamma",
    "beta",
    "running_mean",
    "running_variance",
];

/// The one name of `known` equal to `text`, for the `&'static str` names a graph holds
/// (read back from its stored form); an error lists the known names.
fn known_name<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
    known: &'static [&'static str],
) -> Result<&'static str, D::Error> {
    let text = String::deserialize(deserializer)?;
    known
        .iter()
        .copied()
        .find(|name| *name == text)
        .ok_or_else(|| serde::de::Error::unknown_variant(&text, known))
}

/// A parameter's name in the stored form: one of [`PARAMETER_NAMES`].
mod parameter_name {
    pub fn serialize<S: serde::Serializer>(
        name: &&'static str,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(name)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> Result<&'static str, D::Error> {
        super::known_name(deserializer, super::PARAMETER_NAMES)
    }
}

/// A layer's kind in the stored form: one of [`LayerSpec::KIND_NAMES`].
mod layer_kind_name {
    pub fn serialize<S: serde::Serializer>(
        name: &&'static str,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(name)
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> Result<&'static str, D::Error> {
        super::known_name(deserializer, super::LayerSpec::KIND_NAMES)
    }
}

/// One weight tensor of a layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParameterTensor {
    /// `kernel`, `bias`, `gamma`, `beta`, `running_mean`, `running_variance`
    /// ([`PARAMETER_NAMES`]).
    #[serde(with = "parameter_name")]
    pub name: KnownName,
    pub shape: Vec<u64>,
    pub elements: u64,
    /// Running statistics of batch norm are state, not trained: no gradient, no optimizer state.
    pub trainable: bool,
}

/// One layer of the model with its shapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerNode {
    pub index: usize,
    /// The key it was written under (`conv2d`, `relu`, ...).
    #[serde(with = "layer_kind_name")]
    pub kind_name: KnownName,
    pub op: LayerOp,
    /// The name the spec gave it, if any.
    pub name: Option<String>,
    /// What it reads, in order: one source except for merges (`add`, `concat`).
    pub inputs: Vec<TensorSource>,
    /// The shape of its first input (all of them for `add`).
    pub input_shape: FeatureShape,
    pub output_shape: FeatureShape,
    pub parameters: Vec<ParameterTensor>,
}

impl LayerNode {
    /// `layers[3].conv2d`, the name used in error messages and checkpoints.
    pub fn label(&self) -> String {
        format!("layers[{}].{}", self.index, self.kind_name)
    }

    /// The label with the layer's own name when it has one (`layers[3].conv2d
    /// "block1_conv"`), for breakdowns and messages about graphs.
    pub fn named_label(&self) -> String {
        match &self.name {
            Some(name) => format!("{} \"{name}\"", self.label()),
            None => self.label(),
        }
    }

    /// Whether backward needs this layer's input kept from forward.
    pub fn backward_reads_input(&self) -> bool {
        match self.op {
            LayerOp::Conv2d { .. }
            | LayerOp::DepthwiseConv2d { .. }
            | LayerOp::Dense { .. }
            | LayerOp::MaxPool { .. }
            | LayerOp::BatchNorm { .. } => true,
            LayerOp::Activation(kind) => matches!(
                kind,
                ActivationKind::LeakyRelu { .. } | ActivationKind::Gelu
            ),
            LayerOp::AvgPool { .. }
            | LayerOp::GlobalAvgPool
            | LayerOp::Dropout { .. }
            | LayerOp::Flatten
            | LayerOp::ZeroPadding2d { .. }
            | LayerOp::Add
            | LayerOp::Concat => false,
        }
    }

    /// Whether backward needs this layer's output kept from forward (cuDNN's pooling and
    /// relu/sigmoid/tanh backward read `y`).
    pub fn backward_reads_output(&self) -> bool {
        match self.op {
            LayerOp::MaxPool { .. } => true,
            LayerOp::Activation(kind) => {
                matches!(
                    kind,
                    ActivationKind::Relu
                        | ActivationKind::Relu6
                        | ActivationKind::Sigmoid
                        | ActivationKind::Tanh
                )
            }
            _ => false,
        }
    }

    /// Whether it merges several inputs (`add`, `concat`).
    pub fn is_merge(&self) -> bool {
        matches!(self.op, LayerOp::Add | LayerOp::Concat)
    }

    /// Whether the output is the input under another shape (no memory of its own).
    pub fn is_view(&self) -> bool {
        matches!(self.op, LayerOp::Flatten)
    }

    /// im2col elements one sample needs for this layer (the workspace of an explicit-GEMM
    /// convolution); 0 for layers without a workspace and for 1x1 stride-1 unpadded
    /// convolutions, which multiply the input directly.
    pub fn workspace_elements_per_sample(&self) -> u64 {
        match (self.op, self.input_shape, self.output_shape) {
            (
                LayerOp::Conv2d { window, .. },
                FeatureShape::Image { channels, .. },
                FeatureShape::Image { height, width, .. },
            ) => {
                if window.is_pointwise() {
                    0
                } else {
                    // Bounded by validation: kernel <= padded input, so this is at most the
                    // padded input times the output, both checked there.
                    channels * window.kernel_height * window.kernel_width * height * width
                }
            }
            _ => 0,
        }
    }

    pub fn trainable_parameter_elements(&self) -> u64 {
        self.parameters
            .iter()
            .filter(|parameter| parameter.trainable)
            .map(|parameter| parameter.elements)
            .sum()
    }
}

/// The whole model, shapes inferred.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelGraph {
    pub input_shape: FeatureShape,
    pub layers: Vec<LayerNode>,
    pub loss: LossKind,
}

impl ModelGraph {
    /// The shape of a tensor of the graph.
    pub fn source_shape(&self, source: TensorSource) -> FeatureShape {
        match source {
            TensorSource::ModelInput => self.input_shape,
            TensorSource::Layer(index) => self.layers[index].output_shape,
        }
    }

    /// The shapes of a layer's inputs, in order.
    pub fn input_shapes(&self, layer: &LayerNode) -> Vec<FeatureShape> {
        layer
            .inputs
            .iter()
            .map(|source| self.source_shape(*source))
            .collect()
    }

    /// Whether every layer reads only the one before it (a Keras Sequential model).
    pub fn is_sequential(&self) -> bool {
        self.layers.iter().all(|layer| {
            let previous = match layer.index {
                0 => TensorSource::ModelInput,
                index => TensorSource::Layer(index - 1),
            };
            layer.inputs == [previous]
        })
    }

    /// Layer positions where the model can be cut in two with one tensor crossing: at
    /// `start`, every layer from `start` on reads only tensors made from `start - 1` on
    /// (the model input for 0). Recomputation segments begin only at these, since a
    /// segment is rebuilt from the one tensor kept at its start. Always holds 0.
    pub fn cut_points(&self) -> Vec<usize> {
        // The earliest tensor any layer from `position` on reads, as a layer index
        // (`-1` for the model input), computed from the end.
        let mut earliest_read = vec![i64::MAX; self.layers.len() + 1];
        for (position, layer) in self.layers.iter().enumerate().rev() {
            let earliest_here = layer
                .inputs
                .iter()
                .map(|source| match source {
                    TensorSource::ModelInput => -1,
                    TensorSource::Layer(index) => *index as i64,
                })
                .min()
                .unwrap_or(i64::MAX);
            earliest_read[position] = earliest_read[position + 1].min(earliest_here);
        }
        (0..self.layers.len())
            .filter(|position| earliest_read[*position] >= *position as i64 - 1)
            .collect()
    }

    pub fn output_shape(&self) -> FeatureShape {
        self.layers
            .last()
            .map(|layer| layer.output_shape)
            .unwrap_or(self.input_shape)
    }

    pub fn parameter_elements(&self) -> u64 {
        self.layers
            .iter()
            .flat_map(|layer| &layer.parameters)
            .map(|parameter| parameter.elements)
            .sum()
    }

    pub fn trainable_parameter_elements(&self) -> u64 {
        self.layers
            .iter()
            .map(LayerNode::trainable_parameter_elements)
            .sum()
    }

    /// Bytes of one target per sample: an i32 class index for cross-entropy, the fp32
    /// output tensor for MSE (targets stay fp32 under mixed precision so the loss is exact).
    pub fn target_bytes_per_sample(&self) -> u64 {
        match self.loss {
            LossKind::SoftmaxCrossEntropy => 4,
            LossKind::Mse => self.output_shape().elements() * 4,
        }
    }
}
