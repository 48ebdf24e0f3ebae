//! The keys measured peaks are kept under: one per "job shape", so that a job admitted
//! later with the same shape gets its estimate corrected by what earlier runs measured
//! (the largest measured / estimated ratio stored under its key).
//!
//! A key is `v2|<kind>|<digest>`: a version, the job's kind, and the first 16 bytes (hex)
//! of the SHA-256 of a text written field by field from an explicit list of what decides
//! the job's memory. Nothing is taken from serde output of a whole struct, so a new spec
//! field changes no key unless it is added to the list here, and adding one to the list
//! (or changing how a field is written) must raise [`PEAK_KEY_VERSION`]. Every struct
//! the key reads is destructured in full or matched exhaustively: a new field of
//! `RunConfig` or a new layer op does not compile until it is written here or
//! deliberately left out.
//!
//! What goes in, and why:
//! - A model job: exactly what the estimator reads. The model graph as validation
//!   resolved it (`ModelGraph`: the input shape, the loss, and per layer its op with the
//!   settings that size buffers, the tensors it reads and its output shape), the
//!   optimizer's state tensors per parameter (the optimizer's kind matters only through
//!   that count), and the run config. Left out: names (of the job, its layers), priority,
//!   description, learning rates and other optimizer numbers, seeds, steps, data files,
//!   resources and the OOM policy, and the settings of a layer that do not change its
//!   buffers (batch norm's momentum and epsilon, dropout's rate, leaky relu's slope).
//!   Two specs that write the same model differently (`padding = "same"` or its pixels,
//!   default strides written out) get the same key, since the graph is resolved.
//! - A command job: its command's shape (what decides the program's memory apart from
//!   the knobs Carve turns: argv and environment with their placeholders, working
//!   directory, the precisions it accepts, the arguments that turn recomputation on) and
//!   the run config. Left out: names, priority, description, `read_only_paths`, steps,
//!   `global_batch` and `micro_batch` (the config carries the batches the run uses), the
//!   profile, resources and the OOM policy.
//!
//! Version 1 was the unversioned digest of serde output (the whole `ModelSpec`, or the
//! command's fields as JSON, with the config as JSON); corrections stored under it are not
//! found under version 2 keys and are measured again by the next runs.

use sha2::{Digest, Sha256};

use crate::command::validate::ValidatedCommandJob;
use crate::model::{ActivationKind, FeatureShape, LayerOp, TensorSource, WindowGeometry};
use crate::plan::{EngineSettings, RunConfig};
use crate::spec::LossKind;
use crate::validate::ValidatedJob;

/// The version every key starts with. Raise it whenever what a key is written from
/// changes.
pub const PEAK_KEY_VERSION: &str = "v2";

/// The key of a model job run with `config`.
pub fn model_peak_key(job: &ValidatedJob, config: &RunConfig) -> String {
    let mut key = KeyText::default();
    let graph = &job.graph;
    key.field("input");
    key.shape(&graph.input_shape);
    key.field("loss");
    key.text(match graph.loss {
        LossKind::SoftmaxCrossEntropy => "softmax_cross_entropy",
        LossKind::Mse => "mse",
    });
    key.field("optimizer_state_tensors");
    key.number(job.spec.training.optimizer.state_tensors_per_parameter());
    key.field("layers");
    key.number(graph.layers.len() as u64);
    for layer in &graph.layers {
        key.field("layer");
        layer_op(&mut key, &layer.op);
        key.field("inputs");
        key.number(layer.inputs.len() as u64);
        for input in &layer.inputs {
            match input {
                TensorSource::ModelInput => key.text("input"),
                TensorSource::Layer(index) => key.number(*index as u64),
            }
        }
        key.field("output");
        key.shape(&layer.output_shape);
    }
    run_config(&mut key, config);
    key.finish("model")
}

/// The key of a command job run with `config`.
pub fn command_peak_key(job: &ValidatedCommandJob, config: &RunConfig) -> String {
    let mut key = KeyText::default();
    let command = &job.spec.command;
    key.field("argv");
    key.texts(&command.argv);
    key.field("env");
    key.number(command.env.len() as u64);
    // A BTreeMap: in name order whatever order the spec wrote.
    for (name, value) in &command.env {
        key.text(name);
        key.text(value);
    }
    key.field("working_directory");
    match &command.working_directory {
        Some(directory) => key.text(directory),
        None => key.text(""),
    }
    key.field("precisions");
    key.number(command.precisions.len() as u64);
    for precision in &command.precisions {
        key.text(precision.name());
    }
    key.field("recompute");
    match &command.recompute {
        Some(recompute) => key.texts(&recompute.argv),
        None => key.text("none"),
    }
    run_config(&mut key, config);
    key.finish("command")
}

/// Every field of the run config decides memory.
fn run_config(key: &mut KeyText, config: &RunConfig) {
    let RunConfig {
        batch_size,
        micro_batch_size,
        precision,
        recompute_segment_layers,
        engine,
    } = *config;
    // A config without the engine's knobs (a command job's) is keyed as 0s, as it was
    // when it carried them as 0s, so no stored key moves.
    let EngineSettings {
        workspace_limit_bytes,
        prefetch_batches,
    } = engine.unwrap_or(EngineSettings {
        workspace_limit_bytes: 0,
        prefetch_batches: 0,
    });
    key.field("batch_size");
    key.number(batch_size);
    key.field("micro_batch_size");
    key.number(micro_batch_size);
    key.field("precision");
    key.text(precision.name());
    key.field("recompute_segment_layers");
    match recompute_segment_layers {
        Some(layers) => key.number(layers),
        None => key.text("none"),
    }
    key.field("workspace_limit_bytes");
    key.number(workspace_limit_bytes);
    key.field("prefetch_batches");
    key.number(prefetch_batches);
}

/// A layer's op: its kind and the settings that size its buffers.
fn layer_op(key: &mut KeyText, op: &LayerOp) {
    match *op {
        LayerOp::Conv2d {
            filters,
            window,
            use_bias,
        } => {
            key.text("conv2d");
            key.number(filters);
            key.window(&window);
            key.flag(use_bias);
        }
        LayerOp::DepthwiseConv2d {
            multiplier,
            window,
            use_bias,
        } => {
            key.text("depthwise_conv2d");
            key.number(multiplier);
            key.window(&window);
            key.flag(use_bias);
        }
        LayerOp::MaxPool { window } => {
            key.text("max_pool");
            key.window(&window);
        }
        LayerOp::AvgPool { window } => {
            key.text("avg_pool");
            key.window(&window);
        }
        LayerOp::GlobalAvgPool => key.text("global_avg_pool"),
        // Which activation decides what backward keeps (its input or its output); the
        // leaky slope does not.
        LayerOp::Activation(kind) => key.text(match kind {
            ActivationKind::Relu => "relu",
            ActivationKind::Relu6 => "relu6",
            ActivationKind::LeakyRelu { alpha: _ } => "leaky_relu",
            ActivationKind::Gelu => "gelu",
            ActivationKind::Sigmoid => "sigmoid",
            ActivationKind::Tanh => "tanh",
        }),
        LayerOp::BatchNorm {
            momentum: _,
            epsilon: _,
        } => key.text("batch_norm"),
        // A one-byte mask per element whatever the rate.
        LayerOp::Dropout { rate: _ } => key.text("dropout"),
        LayerOp::Flatten => key.text("flatten"),
        LayerOp::Dense { units, use_bias } => {
            key.text("dense");
            key.number(units);
            key.flag(use_bias);
        }
        LayerOp::ZeroPadding2d {
            top,
            bottom,
            left,
            right,
        } => {
            key.text("zero_padding2d");
            for side in [top, bottom, left, right] {
                key.number(side);
            }
        }
        LayerOp::Add => key.text("add"),
        LayerOp::Concat => key.text("concat"),
    }
}

/// The text a key is the digest of: each value written so that no two lists of values
/// write the same text (strings with their length, numbers in decimal, each ended).
#[derive(Default)]
struct KeyText(String);

impl KeyText {
    fn field(&mut self, name: &str) {
        self.0.push('#');
        self.0.push_str(name);
        self.0.push('=');
    }

    fn text(&mut self, text: &str) {
        self.0.push_str(&format!("{}:{text};", text.len()));
    }

    fn texts(&mut self, texts: &[String]) {
        self.number(texts.len() as u64);
        for text in texts {
            self.text(text);
        }
    }

    fn number(&mut self, number: u64) {
        self.0.push_str(&format!("{number};"));
    }

    fn flag(&mut self, flag: bool) {
        self.0.push_str(if flag { "true;" } else { "false;" });
    }

    fn shape(&mut self, shape: &FeatureShape) {
        match *shape {
            FeatureShape::Image {
                height,
                width,
                channels,
            } => {
                self.text("image");
                for dimension in [height, width, channels] {
                    self.number(dimension);
                }
            }
            FeatureShape::Flat { features } => {
                self.text("flat");
                self.number(features);
            }
        }
    }

    fn window(&mut self, window: &WindowGeometry) {
        let WindowGeometry {
            kernel_height,
            kernel_width,
            stride_height,
            stride_width,
            padding_top,
            padding_bottom,
            padding_left,
            padding_right,
        } = *window;
        for number in [
            kernel_height,
            kernel_width,
            stride_height,
            stride_width,
            padding_top,
            padding_bottom,
            padding_left,
            padding_right,
        ] {
            self.number(number);
        }
    }

    /// `v2|<kind>|<32 hex digits>`.
    fn finish(self, kind: &str) -> String {
        let digest: String = Sha256::digest(self.0.as_bytes())
            .iter()
            .take(16)
            .map(|byte| format!("{byte:02x}"))
            .collect();
        format!("{PEAK_KEY_VERSION}|{kind}|{digest}")
    }
}
