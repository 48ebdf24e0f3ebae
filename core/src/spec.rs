//! The job spec: what a researcher writes in `job.toml` (and what travels as JSON over the
//! API), parsed strictly.
//!
//! This is a user-facing file format, so the serde derives here are the format itself, not a
//! wire format leaking inward. Unknown fields are rejected everywhere, and every parse error
//! names the field path (`model.layers[3].conv2d.kernel`) so a person can fix the file.
//! Semantic checks (shapes, ranges, combinations) live in `validate`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::FieldError;

mod duration;
mod gang;
mod host_limits;
mod sizes;

pub use duration::{format_duration, parse_duration};
pub use gang::{GangPlacementPolicy, MAX_GANG_MEMBERS};
pub(crate) use gang::{check_command_gpus, check_model_gpus};
pub use host_limits::{HostLimitsRequest, MIN_HOST_MEMORY_BYTES, lower_limit};
pub use sizes::{ByteSize, VramRequest};

/// A whole job: the model, how to train it, on what data, with what resources, and what to
/// do when it runs out of memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Higher runs first within one tenant.
    #[serde(default)]
    pub priority: i32,
    pub model: ModelSpec,
    pub training: TrainingSpec,
    pub data: DataSpec,
    #[serde(default)]
    pub resources: ResourcesSpec,
    #[serde(default)]
    pub oom: OomPolicySpec,
}

/// The model as a layer list: Keras-Sequential style by default (each layer reads the one
/// before it), a graph where layers name their `inputs` (residual `add`, channel `concat`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// `[height, width, channels]` for images (channels last, as in Keras), `[features]` for
    /// flat inputs.
    pub input_shape: Vec<u64>,
    pub layers: Vec<LayerEntry>,
    pub loss: LossKind,
}

/// The name `inputs` uses for the model's input.
pub const MODEL_INPUT_NAME: &str = "input";

/// One entry of `model.layers`: the layer, and optionally its name and the layers it
/// reads. In TOML: `{ add = {}, name = "block1_out", inputs = ["block1_bn2", "stem"] }`.
/// Without `inputs` a layer reads the entry before it (the model input for the first).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerEntry {
    pub layer: LayerSpec,
    pub name: Option<String>,
    /// Names of earlier layers, or `"input"` for the model input.
    pub inputs: Option<Vec<String>>,
}

impl From<LayerSpec> for LayerEntry {
    fn from(layer: LayerSpec) -> LayerEntry {
        LayerEntry {
            layer,
            name: None,
            inputs: None,
        }
    }
}

impl Serialize for LayerEntry {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // The layer kind first, then the optional keys, so a sequential entry serializes
        // exactly as before names and inputs existed.
        #[derive(Serialize)]
        struct Written<'a> {
            #[serde(flatten)]
            layer: &'a LayerSpec,
            #[serde(skip_serializing_if = "Option::is_none")]
            name: &'a Option<String>,
            #[serde(skip_serializing_if = "Option::is_none")]
            inputs: &'a Option<Vec<String>>,
        }
        Written {
            layer: &self.layer,
            name: &self.name,
            inputs: &self.inputs,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for LayerEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(LayerEntryVisitor)
    }
}

struct LayerEntryVisitor;

impl<'de> serde::de::Visitor<'de> for LayerEntryVisitor {
    type Value = LayerEntry;

    fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("a layer such as { conv2d = { filters = 32, kernel = 3 } }")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<LayerEntry, A::Error> {
        use serde::de::Error;
        let mut layer: Option<LayerSpec> = None;
        let mut name = None;
        let mut inputs = None;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "name" if name.is_none() => name = Some(map.next_value()?),
                "inputs" if inputs.is_none() => inputs = Some(map.next_value()?),
                "name" | "inputs" => return Err(A::Error::duplicate_field("name or inputs")),
                kind => {
                    if let Some(first) = &layer {
                        return Err(A::Error::custom(format!(
                            "has two layer kinds, `{}` and `{kind}`; write one layer per entry",
                            first.kind_name()
                        )));
                    }
                    if !LayerSpec::KIND_NAMES.contains(&kind) {
                        return Err(A::Error::unknown_variant(kind, LayerSpec::KIND_NAMES));
                    }
                    layer = Some(map.next_value_seed(LayerKindSeed(kind))?);
                }
            }
        }
        let layer = layer.ok_or_else(|| {
            A::Error::custom(format!(
                "names no layer kind; expected one of {}",
                LayerSpec::KIND_NAMES.join(", ")
            ))
        })?;
        Ok(LayerEntry {
            layer,
            name,
            inputs,
        })
    }
}

/// Reads a layer's settings once its kind is known.
struct LayerKindSeed<'k>(&'k str);

impl<'de> serde::de::DeserializeSeed<'de> for LayerKindSeed<'_> {
    type Value = LayerSpec;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<LayerSpec, D::Error> {
        LayerSpec::deserialize_settings(self.0, deserializer)
    }
}

/// Declares the layer enum with, from one list, its kind names and the reading of a
/// kind's settings, so a new layer is one line here.
macro_rules! layer_kinds {
    ($($variant:ident($settings:ty) => $kind:literal,)+) => {
        /// One layer. In TOML: `{ conv2d = { filters = 32, kernel = 3, padding = "same" } }`.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum LayerSpec {
            $($variant($settings),)+
        }

        impl LayerSpec {
            /// Every key a layer may be written under.
            pub const KIND_NAMES: &'static [&'static str] = &[$($kind,)+];

            /// The key the layer is written under, used in field paths.
            pub fn kind_name(&self) -> &'static str {
                match self {
                    $(LayerSpec::$variant(_) => $kind,)+
                }
            }

            fn deserialize_settings<'de, D: Deserializer<'de>>(
                kind: &str,
                deserializer: D,
            ) -> Result<LayerSpec, D::Error> {
                match kind {
                    $($kind => <$settings>::deserialize(deserializer).map(LayerSpec::$variant),)+
                    other => Err(serde::de::Error::unknown_variant(other, Self::KIND_NAMES)),
                }
            }
        }
    };
}

layer_kinds! {
    Conv2d(Conv2dSpec) => "conv2d",
    MaxPool(PoolSpec) => "max_pool",
    AvgPool(PoolSpec) => "avg_pool",
    GlobalAvgPool(NoSettings) => "global_avg_pool",
    Relu(NoSettings) => "relu",
    LeakyRelu(LeakyReluSpec) => "leaky_relu",
    Gelu(NoSettings) => "gelu",
    Sigmoid(NoSettings) => "sigmoid",
    Tanh(NoSettings) => "tanh",
    BatchNorm(BatchNormSpec) => "batch_norm",
    Dropout(DropoutSpec) => "dropout",
    Flatten(NoSettings) => "flatten",
    Dense(DenseSpec) => "dense",
    Add(NoSettings) => "add",
    Concat(NoSettings) => "concat",
    DepthwiseConv2d(DepthwiseConv2dSpec) => "depthwise_conv2d",
    ZeroPadding2d(ZeroPadding2dSpec) => "zero_padding2d",
    Relu6(NoSettings) => "relu6",
}

/// For layers with nothing to set: written `{ relu = {} }`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoSettings {}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conv2dSpec {
    pub filters: u64,
    pub kernel: Dimensions,
    #[serde(default = "Dimensions::one")]
    pub stride: Dimensions,
    #[serde(default)]
    pub padding: Padding,
    #[serde(default = "default_true")]
    pub use_bias: bool,
}

/// One filter per input channel (times `depth_multiplier`), as Keras' DepthwiseConv2D:
/// output channel `c * depth_multiplier + j` is input channel `c` under filter `j`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DepthwiseConv2dSpec {
    pub kernel: Dimensions,
    #[serde(default = "Dimensions::one")]
    pub stride: Dimensions,
    #[serde(default)]
    pub padding: Padding,
    #[serde(default = "default_one")]
    pub depth_multiplier: u64,
    #[serde(default = "default_true")]
    pub use_bias: bool,
}

/// Zeros around an image, as Keras' ZeroPadding2D.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ZeroPadding2dSpec {
    pub padding: ZeroPadding,
}

/// `1` (every side), `[rows, columns]` (top and bottom, left and right) or
/// `[[top, bottom], [left, right]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "pixels, [rows, columns] or [[top, bottom], [left, right]]"
)]
pub enum ZeroPadding {
    Every(u64),
    Symmetric([u64; 2]),
    Sides([[u64; 2]; 2]),
}

impl ZeroPadding {
    /// `[top, bottom, left, right]`.
    pub fn sides(&self) -> [u64; 4] {
        match *self {
            ZeroPadding::Every(pixels) => [pixels; 4],
            ZeroPadding::Symmetric([rows, columns]) => [rows, rows, columns, columns],
            ZeroPadding::Sides([[top, bottom], [left, right]]) => [top, bottom, left, right],
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolSpec {
    pub size: Dimensions,
    /// Defaults to the pool size, as in Keras.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stride: Option<Dimensions>,
    #[serde(default)]
    pub padding: Padding,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeakyReluSpec {
    #[serde(default = "default_leaky_relu_alpha")]
    pub alpha: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchNormSpec {
    /// Running statistics momentum, Keras convention (new = momentum * old + (1 - momentum) * batch).
    #[serde(default = "default_batch_norm_momentum")]
    pub momentum: f64,
    #[serde(default = "default_batch_norm_epsilon")]
    pub epsilon: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DropoutSpec {
    pub rate: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DenseSpec {
    pub units: u64,
    #[serde(default = "default_true")]
    pub use_bias: bool,
}

/// A kernel, stride or pool size: one number for a square, or `[height, width]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged, expecting = "a positive integer or [height, width]")]
pub enum Dimensions {
    Square(u64),
    Rectangle([u64; 2]),
}

impl Dimensions {
    fn one() -> Self {
        Dimensions::Square(1)
    }

    pub fn height(&self) -> u64 {
        match self {
            Dimensions::Square(size) => *size,
            Dimensions::Rectangle([height, _]) => *height,
        }
    }

    pub fn width(&self) -> u64 {
        match self {
            Dimensions::Square(size) => *size,
            Dimensions::Rectangle([_, width]) => *width,
        }
    }
}

impl fmt::Display for Dimensions {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dimensions::Square(size) => write!(formatter, "{size}"),
            Dimensions::Rectangle([height, width]) => write!(formatter, "{height}x{width}"),
        }
    }
}

/// `"valid"` (no padding), `"same"` (output = ceil(input / stride), TensorFlow's rule) or an
/// explicit number of pixels on every side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged, expecting = "\"valid\", \"same\" or a number of pixels")]
pub enum Padding {
    Named(PaddingMode),
    Pixels(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PaddingMode {
    Valid,
    Same,
}

impl Default for Padding {
    fn default() -> Self {
        Padding::Named(PaddingMode::Valid)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// Softmax over the last layer's outputs, then cross-entropy against integer class labels.
    SoftmaxCrossEntropy,
    /// Mean squared error against targets of the output's shape.
    Mse,
}

/// How to train.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingSpec {
    /// The effective batch the optimizer sees per step.
    pub batch_size: u64,
    /// Optimizer steps to run; exactly one of `steps` and `epochs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<u64>,
    pub optimizer: OptimizerSpec,
    #[serde(default)]
    pub precision: Precision,
    /// Micro-batches per step: the batch is split into this many pieces whose gradients are
    /// accumulated, so the optimizer sees the same effective batch. Must divide `batch_size`.
    #[serde(default = "default_one")]
    pub accumulation_steps: u64,
    /// Keep only every N-th layer's input during forward and recompute the rest in backward.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute_segment_layers: Option<u64>,
    /// The most memory one convolution may take as cuDNN workspace (or im2col buffer).
    #[serde(default = "default_workspace_limit")]
    pub workspace_limit: ByteSize,
    /// 0 writes a checkpoint only at the end.
    #[serde(default = "default_checkpoint_every_steps")]
    pub checkpoint_every_steps: u64,
    #[serde(default)]
    pub seed: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerSpec {
    /// Plain SGD; with `momentum > 0` it keeps one velocity buffer per parameter.
    Sgd(SgdSpec),
    Adam(AdamSpec),
    Adamw(AdamSpec),
}

impl OptimizerSpec {
    /// fp32 state tensors kept per parameter tensor (velocity; first and second moments).
    pub fn state_tensors_per_parameter(&self) -> u64 {
        match self {
            OptimizerSpec::Sgd(sgd) if sgd.momentum == 0.0 => 0,
            OptimizerSpec::Sgd(_) => 1,
            OptimizerSpec::Adam(_) | OptimizerSpec::Adamw(_) => 2,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        match self {
            OptimizerSpec::Sgd(_) => "sgd",
            OptimizerSpec::Adam(_) => "adam",
            OptimizerSpec::Adamw(_) => "adamw",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SgdSpec {
    pub learning_rate: f64,
    #[serde(default)]
    pub momentum: f64,
    #[serde(default)]
    pub nesterov: bool,
    #[serde(default)]
    pub weight_decay: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdamSpec {
    pub learning_rate: f64,
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    #[serde(default = "default_adam_epsilon")]
    pub epsilon: f64,
    /// Adam adds it to the gradient (L2); AdamW decays the weights directly (decoupled).
    #[serde(default)]
    pub weight_decay: f64,
}

/// The precision of activations and gradients. `fp16` and `bf16` are mixed precision: fp32
/// master weights, half-precision compute copies, and (for fp16) dynamic loss scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    #[default]
    Fp32,
    Fp16,
    Bf16,
}

impl Precision {
    pub fn element_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
        }
    }

    pub fn is_mixed(self) -> bool {
        self != Precision::Fp32
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    pub fn from_name(name: &str) -> Option<Precision> {
        match name {
            "fp32" => Some(Precision::Fp32),
            "fp16" => Some(Precision::Fp16),
            "bf16" => Some(Precision::Bf16),
            _ => None,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.name())
    }
}

/// Where the training data comes from. Which fields are needed depends on `format`; the
/// validator says which one is missing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    pub format: DataFormat,
    /// Synthetic data: samples in the training set (generated from the training seed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u64>,
    /// Synthetic data: samples in the held-out test set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_samples: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train: Option<DataFiles>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test: Option<DataFiles>,
    #[serde(default = "default_true")]
    pub shuffle: bool,
    /// Batches loaded ahead onto the device while the current one trains.
    #[serde(default = "default_prefetch_batches")]
    pub prefetch_batches: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    Synthetic,
    /// IDX files (the MNIST format): `images` and `labels`.
    Idx,
    /// CIFAR-10 binary batches: `files`.
    Cifar10,
    /// NumPy `.npy` arrays: `inputs` and `targets`.
    Npy,
}

impl DataFormat {
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Synthetic => "synthetic",
            DataFormat::Idx => "idx",
            DataFormat::Cifar10 => "cifar10",
            DataFormat::Npy => "npy",
        }
    }
}

/// Paths of one split (train or test). Relative paths are relative to the job file.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataFiles {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inputs: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub targets: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    /// `"auto"` (the estimator decides) or a slice size such as `"6GiB"`.
    #[serde(default)]
    pub vram: VramRequest,
    /// Slices, each on a distinct GPU, each of `vram` (a *gang* when more than 1; only
    /// command jobs, up to [`MAX_GANG_MEMBERS`]; model jobs keep one slice).
    #[serde(default = "default_one")]
    pub gpus: u64,
    /// Where a gang's members may go (`pack`, `spread`, `one_node`; `pack` by default).
    #[serde(default, skip_serializing_if = "GangPlacementPolicy::is_default")]
    pub placement: GangPlacementPolicy,
    /// The longest one attempt may run, wall clock (`"2h"`, `"90m"`, `"1h30m"`, `"7d"`;
    /// see [`parse_duration`]): the worker stops an attempt that runs past it, or past
    /// its own limit when that is shorter, and the attempt ends FAILED. Each attempt
    /// (a retry, a profile) has the whole of it. `None`: the worker's limit alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_duration: Option<String>,
    /// Host memory for the attempt's container (`"8GiB"`): less than its worker allows,
    /// never more (see [`HostLimitsRequest`]). `None`: the worker's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<String>,
    /// CPUs' worth of time for the container (`2`, `0.5`); only lowers the worker's cap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<f64>,
    /// Processes and threads for the container; only lowers the worker's limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
}

impl Default for ResourcesSpec {
    fn default() -> Self {
        ResourcesSpec {
            vram: VramRequest::Auto,
            gpus: 1,
            placement: GangPlacementPolicy::Pack,
            max_duration: None,
            host_memory: None,
            cpus: None,
            pids: None,
        }
    }
}

impl ResourcesSpec {
    /// `max_duration` read, or why it cannot be (naming `resources.max_duration`); a
    /// validated spec always reads.
    pub fn max_duration_limit(&self) -> Result<Option<Duration>, FieldError> {
        let Some(text) = &self.max_duration else {
            return Ok(None);
        };
        let refused = |reason: String| {
            FieldError::new("resources.max_duration", format!("{text:?}: {reason}"))
        };
        let duration = parse_duration(text).map_err(refused)?;
        if duration.is_zero() {
            return Err(refused("must be longer than 0s".into()));
        }
        Ok(Some(duration))
    }

    /// `host_memory`, `cpus` and `pids` read, or why one cannot be (naming its field); a
    /// validated spec always reads.
    pub fn host_limits(&self) -> Result<HostLimitsRequest, FieldError> {
        HostLimitsRequest::read(self.host_memory.as_deref(), self.cpus, self.pids)
    }
}

/// What the scheduler may do when an attempt runs out of memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OomPolicySpec {
    /// Strategies to try, in order of preference.
    #[serde(default = "ShrinkStrategy::default_order")]
    pub strategies: Vec<ShrinkStrategy>,
    /// The smallest micro-batch `accumulate` may go down to.
    #[serde(default = "default_one")]
    pub min_micro_batch: u64,
    /// Attempts after the first that may be started because of an OOM.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// The half precision `mixed_precision` switches to: fp16 runs everywhere, bf16 needs
    /// Ampere or newer but never overflows.
    #[serde(default = "default_half_precision")]
    pub half_precision: Precision,
}

impl Default for OomPolicySpec {
    fn default() -> Self {
        OomPolicySpec {
            strategies: ShrinkStrategy::default_order(),
            min_micro_batch: 1,
            max_retries: default_max_retries(),
            half_precision: default_half_precision(),
        }
    }
}

/// One way to make a job use less memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShrinkStrategy {
    /// fp16/bf16 activations with fp32 master weights: same training, half the activations.
    MixedPrecision,
    /// Micro-batches with gradient accumulation: same effective batch.
    Accumulate,
    /// Keep fewer activations and recompute them in backward: same math, more compute.
    Recompute,
    /// Convolution algorithms with smaller workspaces: same math, maybe slower.
    Workspace,
    /// A smaller batch: changes the training, so only when the job lists it.
    ShrinkBatch,
}

impl ShrinkStrategy {
    pub fn default_order() -> Vec<ShrinkStrategy> {
        vec![
            ShrinkStrategy::MixedPrecision,
            ShrinkStrategy::Accumulate,
            ShrinkStrategy::Recompute,
            ShrinkStrategy::Workspace,
        ]
    }

    pub fn name(self) -> &'static str {
        match self {
            ShrinkStrategy::MixedPrecision => "mixed_precision",
            ShrinkStrategy::Accumulate => "accumulate",
            ShrinkStrategy::Recompute => "recompute",
            ShrinkStrategy::Workspace => "workspace",
            ShrinkStrategy::ShrinkBatch => "shrink_batch",
        }
    }

    /// Whether the optimizer still sees the same training (up to floating-point rounding).
    pub fn keeps_training_semantics(self) -> bool {
        self != ShrinkStrategy::ShrinkBatch
    }
}

fn default_true() -> bool {
    true
}
fn default_one() -> u64 {
    1
}
fn default_leaky_relu_alpha() -> f64 {
    0.01
}
fn default_batch_norm_momentum() -> f64 {
    0.99
}
fn default_batch_norm_epsilon() -> f64 {
    1e-3
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_adam_epsilon() -> f64 {
    1e-8
}
fn default_workspace_limit() -> ByteSize {
    ByteSize(256 << 20)
}
fn default_checkpoint_every_steps() -> u64 {
    100
}
fn default_prefetch_batches() -> u64 {
    2
}
fn default_max_retries() -> u32 {
    3
}
fn default_half_precision() -> Precision {
    Precision::Fp16
}
