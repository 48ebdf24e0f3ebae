//! Integration tests of the job-spec parser and validator: strict parsing with field paths,
//! shape inference and parameter counts, round trips through TOML and JSON, every
//! rejection naming its field, checked arithmetic on absurd sizes, and property tests over
//! random layer stacks.

use carve_core::FieldError;
use carve_core::model::{FeatureShape, LayerNode, LayerOp, ModelGraph, WindowGeometry};
use carve_core::spec::{
    BatchNormSpec, ByteSize, Conv2dSpec, DataFormat, DenseSpec, Dimensions, DropoutSpec, JobSpec,
    LayerEntry, LayerSpec, LeakyReluSpec, LossKind, NoSettings, OptimizerSpec, Padding,
    PaddingMode, PoolSpec, Precision, ShrinkStrategy, VramRequest,
};
use carve_core::validate::{
    MAX_ELEMENTS_PER_SAMPLE, MAX_MODEL_LAYERS, ValidatedJob, load_job_spec_toml,
    parse_job_spec_json, parse_job_spec_toml, validate_job_spec,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// The example spec of the format, every section written out.
const FULL_SPEC: &str = r#"
name = "mnist-cnn"
[model]
input_shape = [28, 28, 1]
loss = "softmax_cross_entropy"
layers = [
  { conv2d = { filters = 32, kernel = 3, padding = "same" } },
  { relu = {} },
  { max_pool = { size = 2 } },
  { batch_norm = {} },
  { dropout = { rate = 0.25 } },
  { flatten = {} },
  { dense = { units = 10 } },
]
[training]
batch_size = 64
steps = 200
optimizer = { adam = { learning_rate = 0.001 } }
precision = "fp32"
accumulation_steps = 1
seed = 7
[data]
format = "synthetic"
samples = 1024
[resources]
vram = "auto"
[oom]
strategies = ["mixed_precision", "accumulate", "recompute", "workspace"]
min_micro_batch = 8
max_retries = 3
"#;

/// A complete, valid spec around the given model: `input_shape` and `loss` as TOML values,
/// one TOML inline table per layer.
fn spec_with(input_shape: &str, loss: &str, layers: &[&str]) -> String {
    let layers: String = layers.iter().map(|layer| format!("  {layer},\n")).collect();
    format!(
        r#"name = "test-job"
[model]
input_shape = {input_shape}
loss = "{loss}"
layers = [
{layers}]
[training]
batch_size = 64
steps = 200
optimizer = {{ adam = {{ learning_rate = 0.001 }} }}
[data]
format = "synthetic"
samples = 1024
[resources]
vram = "auto"
[oom]
min_micro_batch = 8
"#
    )
}

/// A 28x28x1 classifier ending in a 10-way softmax, with `layers` in front of the head.
fn classifier_with(layers: &[&str]) -> String {
    let mut all: Vec<&str> = layers.to_vec();
    all.extend(["{ flatten = {} }", "{ dense = { units = 10 } }"]);
    spec_with("[28, 28, 1]", "softmax_cross_entropy", &all)
}

/// The simplest valid spec: one small CNN.
fn base_spec() -> String {
    classifier_with(&["{ conv2d = { filters = 4, kernel = 3 } }", "{ relu = {} }"])
}

/// Replaces exactly one occurrence of `from`, so a test cannot silently run against an
/// unedited spec.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "`{from}` must occur exactly once in the spec:\n{text}"
    );
    text.replacen(from, to, 1)
}

/// `text` with its synthetic data section replaced by `data`: a `format = ...` line and
/// what that format needs.
fn with_data(text: &str, data: &str) -> String {
    edit(text, "format = \"synthetic\"\nsamples = 1024", data)
}

fn load(text: &str) -> ValidatedJob {
    match load_job_spec_toml(text) {
        Ok(job) => job,
        Err(error) => panic!("spec should be valid, got `{error}`:\n{text}"),
    }
}

fn load_error(text: &str) -> FieldError {
    match load_job_spec_toml(text) {
        Ok(_) => panic!("spec should be rejected:\n{text}"),
        Err(error) => error,
    }
}

/// Asserts the spec is rejected with exactly `field` and a reason containing every fragment
/// (case-insensitive); also checks the Display form.
#[track_caller]
fn assert_rejected(text: &str, field: &str, reason_fragments: &[&str]) -> FieldError {
    let error = load_error(text);
    assert_eq!(error.field, field, "wrong field in {error:?}");
    assert!(!error.reason.trim().is_empty(), "empty reason in {error:?}");
    for fragment in reason_fragments {
        assert!(
            error
                .reason
                .to_lowercase()
                .contains(&fragment.to_lowercase()),
            "reason of {error:?} should mention `{fragment}`"
        );
    }
    assert_eq!(
        error.to_string(),
        format!("{}: {}", error.field, error.reason)
    );
    error
}

/// Asserts the base spec with one edit is rejected, as [`assert_rejected`] does.
#[track_caller]
fn assert_edit_rejected(
    from: &str,
    to: &str,
    field: &str,
    reason_fragments: &[&str],
) -> FieldError {
    assert_rejected(&edit(&base_spec(), from, to), field, reason_fragments)
}

fn image(height: u64, width: u64, channels: u64) -> FeatureShape {
    FeatureShape::Image {
        height,
        width,
        channels,
    }
}

fn flat(features: u64) -> FeatureShape {
    FeatureShape::Flat { features }
}

fn window_of(node: &LayerNode) -> WindowGeometry {
    match node.op {
        LayerOp::Conv2d { window, .. }
        | LayerOp::MaxPool { window }
        | LayerOp::AvgPool { window } => window,
        other => panic!("layer {} has no window: {other:?}", node.label()),
    }
}

/// A window's padding as (top, bottom, left, right).
fn padding_of(window: &WindowGeometry) -> (u64, u64, u64, u64) {
    (
        window.padding_top,
        window.padding_bottom,
        window.padding_left,
        window.padding_right,
    )
}

/// (name, shape, elements, trainable) of every parameter tensor of a layer.
fn parameters_of(node: &LayerNode) -> Vec<(&'static str, Vec<u64>, u64, bool)> {
    node.parameters
        .iter()
        .map(|parameter| {
            (
                parameter.name,
                parameter.shape.clone(),
                parameter.elements,
                parameter.trainable,
            )
        })
        .collect()
}

/// The graph of the base spec with one layer in front of the head; returns that layer.
fn first_layer(layer: &str, input_shape: &str) -> LayerNode {
    let text = spec_with(input_shape, "mse", &[layer]);
    load(&text).graph.layers[0].clone()
}

// ---------------------------------------------------------------------------------------
// Valid specs, shapes and parameters
// ---------------------------------------------------------------------------------------

#[test]
fn full_example_spec_parses_with_every_setting() {
    let spec = parse_job_spec_toml(FULL_SPEC).expect("the example spec parses");
    assert_eq!(spec.name, "mnist-cnn");
    assert_eq!(spec.description, None);
    assert_eq!(spec.priority, 0);
    assert_eq!(spec.model.input_shape, vec![28, 28, 1]);
    assert_eq!(spec.model.loss, LossKind::SoftmaxCrossEntropy);
    assert_eq!(spec.model.layers.len(), 7);
    assert_eq!(
        spec.model.layers[0].layer,
        LayerSpec::Conv2d(Conv2dSpec {
            filters: 32,
            kernel: Dimensions::Square(3),
            stride: Dimensions::Square(1),
            padding: Padding::Named(PaddingMode::Same),
            use_bias: true,
        })
    );
    assert_eq!(
        spec.model.layers[2].layer,
        LayerSpec::MaxPool(PoolSpec {
            size: Dimensions::Square(2),
            stride: None,
            padding: Padding::Named(PaddingMode::Valid),
        })
    );
    assert_eq!(
        spec.model.layers[3].layer,
        LayerSpec::BatchNorm(BatchNormSpec {
            momentum: 0.99,
            epsilon: 1e-3
        })
    );
    assert_eq!(
        spec.model.layers[4].layer,
        LayerSpec::Dropout(DropoutSpec { rate: 0.25 })
    );
    assert_eq!(
        spec.model.layers[6].layer,
        LayerSpec::Dense(DenseSpec {
            units: 10,
            use_bias: true
        })
    );
    let kinds: Vec<&str> = spec
        .model
        .layers
        .iter()
        .map(|entry| entry.layer.kind_name())
        .collect();
    assert_eq!(
        kinds,
        [
            "conv2d",
            "relu",
            "max_pool",
            "batch_norm",
            "dropout",
            "flatten",
            "dense"
        ]
    );

    let training = &spec.training;
    assert_eq!(training.batch_size, 64);
    assert_eq!(training.steps, Some(200));
    assert_eq!(training.epochs, None);
    match &training.optimizer {
        OptimizerSpec::Adam(adam) => {
            assert_eq!(adam.learning_rate, 0.001);
            assert_eq!(
                (adam.beta1, adam.beta2, adam.epsilon, adam.weight_decay),
                (0.9, 0.999, 1e-8, 0.0)
            );
        }
        other => panic!("expected adam, got {other:?}"),
    }
    assert_eq!(training.optimizer.state_tensors_per_parameter(), 2);
    assert_eq!(training.precision, Precision::Fp32);
    assert_eq!(training.accumulation_steps, 1);
    assert_eq!(training.recompute_segment_layers, None);
    assert_eq!(training.workspace_limit, ByteSize(256 << 20));
    assert_eq!(training.checkpoint_every_steps, 100);
    assert_eq!(training.seed, 7);

    assert_eq!(spec.data.format, DataFormat::Synthetic);
    assert_eq!(spec.data.samples, Some(1024));
    assert!(spec.data.shuffle);
    assert_eq!(spec.data.prefetch_batches, 2);
    assert_eq!(spec.resources.vram, VramRequest::Auto);
    assert_eq!(spec.resources.gpus, 1);
    assert_eq!(spec.oom.strategies, ShrinkStrategy::default_order());
    assert_eq!(spec.oom.min_micro_batch, 8);
    assert_eq!(spec.oom.max_retries, 3);
    assert_eq!(spec.oom.half_precision, Precision::Fp16);

    let job = validate_job_spec(spec.clone()).expect("the example spec is valid");
    assert_eq!(job.spec, spec);
    assert_eq!(load_job_spec_toml(FULL_SPEC), Ok(job));
}

#[test]
fn full_example_spec_infers_shapes_and_parameters() {
    let graph: ModelGraph = load(FULL_SPEC).graph;
    assert_eq!(graph.input_shape, image(28, 28, 1));
    assert_eq!(graph.loss, LossKind::SoftmaxCrossEntropy);
    let shapes: Vec<(FeatureShape, FeatureShape)> = graph
        .layers
        .iter()
        .map(|layer| (layer.input_shape, layer.output_shape))
        .collect();
    assert_eq!(
        shapes,
        vec![
            (image(28, 28, 1), image(28, 28, 32)), // conv "same" stride 1 keeps 28x28
            (image(28, 28, 32), image(28, 28, 32)), // relu
            (image(28, 28, 32), image(14, 14, 32)), // max_pool 2 halves
            (image(14, 14, 32), image(14, 14, 32)), // batch_norm
            (image(14, 14, 32), image(14, 14, 32)), // dropout
            (image(14, 14, 32), flat(14 * 14 * 32)), // flatten
            (flat(6272), flat(10)),                // dense
        ]
    );
    assert_eq!(graph.output_shape(), flat(10));
    for (index, layer) in graph.layers.iter().enumerate() {
        assert_eq!(layer.index, index);
    }
    assert_eq!(graph.layers[0].label(), "layers[0].conv2d");
    assert_eq!(graph.layers[6].label(), "layers[6].dense");

    // conv: 3*3*1*32 kernel + 32 bias.
    assert_eq!(
        parameters_of(&graph.layers[0]),
        vec![
            ("kernel", vec![3, 3, 1, 32], 288, true),
            ("bias", vec![32], 32, true)
        ]
    );
    assert_eq!(graph.layers[0].trainable_parameter_elements(), 320);
    for index in [1, 2, 4, 5] {
        assert!(
            graph.layers[index].parameters.is_empty(),
            "layer {index} has no weights"
        );
    }
    // batch_norm: gamma and beta train, running statistics do not.
    assert_eq!(
        parameters_of(&graph.layers[3]),
        vec![
            ("gamma", vec![32], 32, true),
            ("beta", vec![32], 32, true),
            ("running_mean", vec![32], 32, false),
            ("running_variance", vec![32], 32, false),
        ]
    );
    assert_eq!(graph.layers[3].trainable_parameter_elements(), 64);
    // dense: 6272*10 kernel + 10 bias.
    assert_eq!(
        parameters_of(&graph.layers[6]),
        vec![
            ("kernel", vec![6272, 10], 62_720, true),
            ("bias", vec![10], 10, true)
        ]
    );
    assert_eq!(graph.trainable_parameter_elements(), 320 + 64 + 62_730);
    assert_eq!(graph.parameter_elements(), 320 + 128 + 62_730);
    assert_eq!(graph.target_bytes_per_sample(), 4);

    let window = window_of(&graph.layers[0]);
    assert_eq!(padding_of(&window), (1, 1, 1, 1));
    let pool = window_of(&graph.layers[2]);
    assert_eq!(
        (pool.kernel_height, pool.stride_height, pool.stride_width),
        (2, 2, 2)
    );
}

#[test]
fn convolution_output_sizes_follow_padding_and_stride() {
    // (kernel, stride, padding, expected height/width) on a 28x28x3 input.
    let cases = [
        ("3", "1", "\"same\"", 28),
        ("3", "1", "\"valid\"", 26),
        ("5", "1", "\"valid\"", 24),
        ("3", "2", "\"same\"", 14),
        ("3", "2", "\"valid\"", 13),
        ("5", "3", "\"same\"", 10),
        ("1", "1", "\"valid\"", 28),
        ("5", "1", "2", 28),
        ("3", "1", "2", 30),
        ("28", "1", "\"valid\"", 1),
        ("7", "7", "\"valid\"", 4),
    ];
    for (kernel, stride, padding, expected) in cases {
        let layer = format!(
            "{{ conv2d = {{ filters = 8, kernel = {kernel}, stride = {stride}, padding = {padding} }} }}"
        );
        let node = first_layer(&layer, "[28, 28, 3]");
        assert_eq!(node.input_shape, image(28, 28, 3), "{layer}");
        assert_eq!(node.output_shape, image(expected, expected, 8), "{layer}");
    }
    // The default padding is "valid" and the default stride 1.
    let node = first_layer("{ conv2d = { filters = 8, kernel = 3 } }", "[28, 28, 3]");
    assert_eq!(node.output_shape, image(26, 26, 8));
    let window = window_of(&node);
    assert_eq!((window.stride_height, window.stride_width), (1, 1));
    assert_eq!(padding_of(&window), (0, 0, 0, 0));
    // Explicit pixels pad every side.
    let window = window_of(&first_layer(
        "{ conv2d = { filters = 8, kernel = 5, padding = 2 } }",
        "[28, 28, 3]",
    ));
    assert_eq!(padding_of(&window), (2, 2, 2, 2));
}

#[test]
fn same_padding_gives_ceil_of_input_over_stride_on_odd_sizes() {
    for input in 1..=17u64 {
        for stride in 1..=4u64 {
            for kernel in 1..=5u64 {
                let layer = format!(
                    "{{ conv2d = {{ filters = 2, kernel = {kernel}, stride = {stride}, padding = \"same\" }} }}"
                );
                let node = first_layer(&layer, &format!("[{input}, {input}, 1]"));
                let expected = input.div_ceil(stride);
                assert_eq!(
                    node.output_shape,
                    image(expected, expected, 2),
                    "{layer} on {input}"
                );
                // TensorFlow: total = max((out - 1) * stride + kernel - in, 0), top = total / 2.
                let total = ((expected - 1) * stride + kernel).saturating_sub(input);
                let window = window_of(&node);
                assert_eq!(
                    (window.padding_top, window.padding_bottom),
                    (total / 2, total - total / 2),
                    "{layer} on {input}"
                );
            }
        }
    }
}

#[test]
fn pooling_shapes() {
    // max_pool 2: stride defaults to the size, so it halves.
    let node = first_layer("{ max_pool = { size = 2 } }", "[28, 28, 16]");
    assert_eq!(node.output_shape, image(14, 14, 16));
    assert!(matches!(node.op, LayerOp::MaxPool { .. }));
    assert!(node.parameters.is_empty());
    let window = window_of(&node);
    assert_eq!((window.stride_height, window.stride_width), (2, 2));
    // Odd input: valid drops the last row, same keeps it.
    assert_eq!(
        first_layer("{ max_pool = { size = 2 } }", "[7, 7, 4]").output_shape,
        image(3, 3, 4)
    );
    assert_eq!(
        first_layer(
            "{ max_pool = { size = 2, padding = \"same\" } }",
            "[7, 7, 4]"
        )
        .output_shape,
        image(4, 4, 4)
    );
    // An explicit stride overrides the default.
    let node = first_layer("{ avg_pool = { size = 3, stride = 1 } }", "[28, 28, 4]");
    assert_eq!(node.output_shape, image(26, 26, 4));
    assert!(matches!(node.op, LayerOp::AvgPool { .. }));
    assert_eq!(
        first_layer(
            "{ avg_pool = { size = 3, stride = 2, padding = 1 } }",
            "[28, 28, 4]"
        )
        .output_shape,
        image(14, 14, 4)
    );
    // Rectangular pool.
    assert_eq!(
        first_layer("{ max_pool = { size = [2, 4] } }", "[28, 28, 4]").output_shape,
        image(14, 7, 4)
    );
    // Global average pooling gives one feature per channel.
    let node = first_layer("{ global_avg_pool = {} }", "[7, 5, 64]");
    assert_eq!(node.output_shape, flat(64));
    assert_eq!(node.op, LayerOp::GlobalAvgPool);
}

#[test]
fn global_avg_pool_head_classifies() {
    let text = spec_with(
        "[32, 32, 3]",
        "softmax_cross_entropy",
        &[
            "{ conv2d = { filters = 16, kernel = 3, padding = \"same\" } }",
            "{ global_avg_pool = {} }",
            "{ dense = { units = 10 } }",
        ],
    );
    let graph = load(&text).graph;
    assert_eq!(graph.layers[1].output_shape, flat(16));
    assert_eq!(graph.layers[2].input_shape, flat(16));
    assert_eq!(graph.output_shape(), flat(10));
    assert_eq!(graph.layers[2].trainable_parameter_elements(), 16 * 10 + 10);
}

#[test]
fn flatten_dense_and_activations() {
    let node = first_layer("{ flatten = {} }", "[5, 6, 7]");
    assert_eq!(node.output_shape, flat(5 * 6 * 7));
    assert!(node.is_view());
    assert!(node.parameters.is_empty());
    // Flatten of something already flat is the identity.
    assert_eq!(
        first_layer("{ flatten = {} }", "[12]").output_shape,
        flat(12)
    );

    let node = first_layer("{ dense = { units = 3 } }", "[20]");
    assert_eq!(node.output_shape, flat(3));
    assert_eq!(
        node.op,
        LayerOp::Dense {
            units: 3,
            use_bias: true
        }
    );

    for activation in [
        "{ relu = {} }",
        "{ gelu = {} }",
        "{ sigmoid = {} }",
        "{ tanh = {} }",
        "{ leaky_relu = {} }",
        "{ leaky_relu = { alpha = 0.2 } }",
        "{ dropout = { rate = 0.0 } }",
        "{ dropout = { rate = 0.5 } }",
        "{ batch_norm = { momentum = 0.9, epsilon = 1e-5 } }",
    ] {
        for (shape_text, shape) in [("[9, 8, 3]", image(9, 8, 3)), ("[17]", flat(17))] {
            let node = first_layer(activation, shape_text);
            assert_eq!(node.input_shape, shape, "{activation}");
            assert_eq!(node.output_shape, shape, "{activation} keeps the shape");
        }
    }
}

#[test]
fn parameter_counts() {
    // conv: kernel kh*kw*cin*filters plus a bias per filter.
    let node = first_layer("{ conv2d = { filters = 16, kernel = 3 } }", "[10, 10, 3]");
    assert_eq!(node.trainable_parameter_elements(), 3 * 3 * 3 * 16 + 16);
    let node = first_layer(
        "{ conv2d = { filters = 16, kernel = 3, use_bias = false } }",
        "[10, 10, 3]",
    );
    assert_eq!(
        parameters_of(&node),
        vec![("kernel", vec![3, 3, 3, 16], 432, true)]
    );
    assert_eq!(
        node.op,
        LayerOp::Conv2d {
            filters: 16,
            window: window_of(&node),
            use_bias: false
        }
    );
    // dense: in*out plus a bias per unit.
    let node = first_layer("{ dense = { units = 7 } }", "[30]");
    assert_eq!(
        parameters_of(&node),
        vec![
            ("kernel", vec![30, 7], 210, true),
            ("bias", vec![7], 7, true)
        ]
    );
    let node = first_layer("{ dense = { units = 7, use_bias = false } }", "[30]");
    assert_eq!(
        parameters_of(&node),
        vec![("kernel", vec![30, 7], 210, true)]
    );
    // batch_norm over flat features: one of each per feature.
    let node = first_layer("{ batch_norm = {} }", "[30]");
    assert_eq!(node.trainable_parameter_elements(), 60);
    assert_eq!(
        node.parameters
            .iter()
            .map(|parameter| parameter.elements)
            .sum::<u64>(),
        120
    );
    assert_eq!(
        node.parameters
            .iter()
            .filter(|parameter| !parameter.trainable)
            .count(),
        2
    );
    // Whole model: trainable excludes running statistics, the total includes them.
    let text = spec_with(
        "[8, 8, 2]",
        "mse",
        &[
            "{ conv2d = { filters = 4, kernel = 3 } }", // 3*3*2*4 + 4 = 76, out 6x6x4
            "{ batch_norm = {} }",                      // 8 trainable + 8 state
            "{ flatten = {} }",                         // 144
            "{ dense = { units = 5, use_bias = false } }", // 720
        ],
    );
    let graph = load(&text).graph;
    assert_eq!(graph.trainable_parameter_elements(), 76 + 8 + 720);
    assert_eq!(graph.parameter_elements(), 76 + 16 + 720);
    assert_eq!(
        graph.target_bytes_per_sample(),
        5 * 4,
        "mse targets are fp32 outputs"
    );
}

#[test]
fn rectangular_kernel_and_stride() {
    let node = first_layer(
        "{ conv2d = { filters = 6, kernel = [3, 5] } }",
        "[28, 28, 2]",
    );
    assert_eq!(node.output_shape, image(26, 24, 6));
    assert_eq!(node.parameters[0].shape, vec![3, 5, 2, 6]);
    assert_eq!(node.parameters[0].elements, 3 * 5 * 2 * 6);
    let window = window_of(&node);
    assert_eq!((window.kernel_height, window.kernel_width), (3, 5));

    let node = first_layer(
        "{ conv2d = { filters = 6, kernel = [3, 5], stride = [1, 2], padding = \"same\" } }",
        "[28, 28, 2]",
    );
    assert_eq!(node.output_shape, image(28, 14, 6));
    let window = window_of(&node);
    assert_eq!((window.stride_height, window.stride_width), (1, 2));
    // Height: total (28-1)*1+3-28 = 2 -> 1/1; width: (14-1)*2+5-28 = 3 -> 1/2.
    assert_eq!(padding_of(&window), (1, 1, 1, 2));

    let node = first_layer(
        "{ conv2d = { filters = 1, kernel = 3, stride = [2, 3] } }",
        "[11, 11, 1]",
    );
    assert_eq!(node.output_shape, image(5, 3, 1));
}

#[test]
fn even_kernel_same_padding_puts_the_extra_pixel_bottom_right() {
    // kernel 4, stride 1 on 28: total padding 3, TensorFlow puts 1 on top/left and 2 below/right.
    let node = first_layer(
        "{ conv2d = { filters = 2, kernel = 4, padding = \"same\" } }",
        "[28, 28, 1]",
    );
    assert_eq!(node.output_shape, image(28, 28, 2));
    let window = window_of(&node);
    assert_eq!(padding_of(&window), (1, 2, 1, 2));
    // kernel [2, 4]: height total 1 -> 0/1, width total 3 -> 1/2.
    let window = window_of(&first_layer(
        "{ conv2d = { filters = 2, kernel = [2, 4], padding = \"same\" } }",
        "[10, 10, 1]",
    ));
    assert_eq!(padding_of(&window), (0, 1, 1, 2));
    // kernel 3, stride 2 on 28: output 14, total (14-1)*2+3-28 = 1 -> 0/1.
    let window = window_of(&first_layer(
        "{ conv2d = { filters = 2, kernel = 3, stride = 2, padding = \"same\" } }",
        "[28, 28, 1]",
    ));
    assert_eq!(padding_of(&window), (0, 1, 0, 1));
    // Pooling follows the same rule: size 2 stride 2 on 7 -> 4, total 1 -> 0/1.
    let window = window_of(&first_layer(
        "{ max_pool = { size = 2, padding = \"same\" } }",
        "[7, 7, 1]",
    ));
    assert_eq!(padding_of(&window), (0, 1, 0, 1));
}

#[test]
fn flat_input_models_and_other_settings_validate() {
    let text = spec_with(
        "[20]",
        "mse",
        &[
            "{ dense = { units = 16 } }",
            "{ tanh = {} }",
            "{ dense = { units = 1 } }",
        ],
    );
    let text = edit(
        &text,
        "optimizer = { adam = { learning_rate = 0.001 } }",
        "epochs = 3\noptimizer = { sgd = { learning_rate = 0.1, momentum = 0.9, nesterov = true, weight_decay = 1e-4 } }\nprecision = \"bf16\"\naccumulation_steps = 4\nrecompute_segment_layers = 3\nworkspace_limit = \"64MiB\"",
    );
    let text = edit(&text, "steps = 200\n", "");
    let text = edit(&text, "vram = \"auto\"", "vram = \"6GiB\"\ngpus = 1");
    let text = edit(
        &text,
        "min_micro_batch = 8",
        "min_micro_batch = 2\nstrategies = [\"shrink_batch\", \"accumulate\"]\nhalf_precision = \"bf16\"\nmax_retries = 100",
    );
    let job = load(&text);
    assert_eq!(job.graph.output_shape(), flat(1));
    let training = &job.spec.training;
    assert_eq!((training.steps, training.epochs), (None, Some(3)));
    assert_eq!(training.precision, Precision::Bf16);
    assert_eq!(training.accumulation_steps, 4);
    assert_eq!(training.recompute_segment_layers, Some(3));
    assert_eq!(training.workspace_limit, ByteSize(64 << 20));
    assert_eq!(training.optimizer.kind_name(), "sgd");
    assert_eq!(training.optimizer.state_tensors_per_parameter(), 1);
    assert_eq!(job.spec.resources.vram, VramRequest::Bytes(6 << 30));
    assert_eq!(
        job.spec.oom.strategies,
        vec![ShrinkStrategy::ShrinkBatch, ShrinkStrategy::Accumulate]
    );
    assert_eq!(job.spec.oom.half_precision, Precision::Bf16);

    // An mse model may end in an image (e.g. a denoiser).
    let text = spec_with(
        "[16, 16, 3]",
        "mse",
        &[
            "{ conv2d = { filters = 3, kernel = 3, padding = \"same\" } }",
            "{ sigmoid = {} }",
        ],
    );
    let graph = load(&text).graph;
    assert_eq!(graph.output_shape(), image(16, 16, 3));
    assert_eq!(graph.target_bytes_per_sample(), 16 * 16 * 3 * 4);
}

#[test]
fn real_data_formats_validate() {
    let idx = with_data(
        &base_spec(),
        "format = \"idx\"\ntrain = { images = \"train-images.idx3-ubyte\", labels = \"train-labels.idx1-ubyte\" }\ntest = { images = \"t10k-images.idx3-ubyte\", labels = \"t10k-labels.idx1-ubyte\" }",
    );
    let job = load(&idx);
    assert_eq!(job.spec.data.format, DataFormat::Idx);
    let train = job.spec.data.train.as_ref().expect("train split");
    assert_eq!(train.images.as_deref(), Some("train-images.idx3-ubyte"));
    assert_eq!(train.labels.as_deref(), Some("train-labels.idx1-ubyte"));
    assert!(job.spec.data.test.is_some());

    let cifar = with_data(
        &spec_with(
            "[32, 32, 3]",
            "softmax_cross_entropy",
            &[
                "{ conv2d = { filters = 8, kernel = 3 } }",
                "{ flatten = {} }",
                "{ dense = { units = 10 } }",
            ],
        ),
        "format = \"cifar10\"\ntrain = { files = [\"data_batch_1.bin\", \"data_batch_2.bin\"] }",
    );
    let job = load(&cifar);
    assert_eq!(
        job.spec.data.train.as_ref().map(|files| files.files.len()),
        Some(2)
    );

    let npy = with_data(
        &spec_with("[20]", "mse", &["{ dense = { units = 3 } }"]),
        "format = \"npy\"\ntrain = { inputs = \"x.npy\", targets = \"y.npy\" }",
    );
    assert_eq!(load(&npy).spec.data.format, DataFormat::Npy);
}

// ---------------------------------------------------------------------------------------
// Round trips
// ---------------------------------------------------------------------------------------

fn assert_round_trips(spec: &JobSpec) {
    let json = serde_json::to_string(spec).expect("serializes to JSON");
    let from_json = parse_job_spec_json(&json).unwrap_or_else(|error| panic!("{error}\n{json}"));
    assert_eq!(&from_json, spec, "JSON round trip of\n{json}");
    let pretty = serde_json::to_string_pretty(spec).expect("serializes to JSON");
    assert_eq!(
        &parse_job_spec_json(&pretty).expect("pretty JSON parses"),
        spec
    );

    let toml_text = toml::to_string(spec).expect("serializes to TOML");
    let from_toml =
        parse_job_spec_toml(&toml_text).unwrap_or_else(|error| panic!("{error}\n{toml_text}"));
    assert_eq!(&from_toml, spec, "TOML round trip of\n{toml_text}");
}

#[test]
fn full_spec_round_trips_through_json_and_toml() {
    let spec = parse_job_spec_toml(FULL_SPEC).expect("parses");
    assert_round_trips(&spec);
    // And the round-tripped spec validates to the same graph.
    let json = serde_json::to_string(&spec).expect("serializes");
    let again = validate_job_spec(parse_job_spec_json(&json).expect("parses")).expect("validates");
    assert_eq!(again, load(FULL_SPEC));
}

#[test]
fn every_setting_round_trips() {
    let text = r#"
name = "everything.v2_final-3"
description = "all the knobs"
priority = -5
[model]
input_shape = [32, 32, 3]
loss = "softmax_cross_entropy"
layers = [
  { conv2d = { filters = 8, kernel = [3, 5], stride = [1, 2], padding = "same", use_bias = false } },
  { batch_norm = { momentum = 0.9, epsilon = 1e-5 } },
  { leaky_relu = { alpha = 0.2 } },
  { conv2d = { filters = 8, kernel = 3, padding = 1 } },
  { gelu = {} },
  { avg_pool = { size = [2, 2], stride = 1, padding = "valid" } },
  { max_pool = { size = 2, padding = "same" } },
  { sigmoid = {} },
  { tanh = {} },
  { dropout = { rate = 0.5 } },
  { flatten = {} },
  { dense = { units = 32, use_bias = false } },
  { relu = {} },
  { dense = { units = 10 } },
]
[training]
batch_size = 128
epochs = 12
optimizer = { adamw = { learning_rate = 3e-4, beta1 = 0.8, beta2 = 0.95, epsilon = 1e-6, weight_decay = 0.01 } }
precision = "fp16"
accumulation_steps = 4
recompute_segment_layers = 2
workspace_limit = "64MiB"
checkpoint_every_steps = 0
seed = 123456789
[data]
format = "cifar10"
train = { files = ["a.bin", "b.bin"] }
test = { files = ["t.bin"] }
shuffle = false
prefetch_batches = 4
[resources]
vram = "6GiB"
gpus = 1
[oom]
strategies = ["workspace", "shrink_batch", "recompute"]
min_micro_batch = 16
max_retries = 7
half_precision = "bf16"
"#;
    let job = load(text);
    assert_eq!(job.spec.priority, -5);
    assert_eq!(job.spec.description.as_deref(), Some("all the knobs"));
    assert_eq!(job.graph.output_shape(), flat(10));
    assert_round_trips(&job.spec);

    // SGD and plain adam too.
    for optimizer in [
        "{ sgd = { learning_rate = 0.1 } }",
        "{ sgd = { learning_rate = 0.05, momentum = 0.9, nesterov = true, weight_decay = 0.0005 } }",
        "{ adam = { learning_rate = 0.001, weight_decay = 0.1 } }",
    ] {
        let text = edit(
            &base_spec(),
            "optimizer = { adam = { learning_rate = 0.001 } }",
            &format!("optimizer = {optimizer}"),
        );
        assert_round_trips(&load(&text).spec);
    }
    // Real data formats.
    let npy = with_data(
        &spec_with("[20]", "mse", &["{ dense = { units = 3 } }"]),
        "format = \"npy\"\ntrain = { inputs = \"x.npy\", targets = \"y.npy\" }\ntest = { inputs = \"tx.npy\", targets = \"ty.npy\" }",
    );
    assert_round_trips(&load(&npy).spec);
    let synthetic = edit(
        &base_spec(),
        "samples = 1024",
        "samples = 1024\ntest_samples = 100",
    );
    assert_round_trips(&load(&synthetic).spec);
}

#[test]
fn vram_sizes_round_trip_to_the_same_bytes() {
    for (written, bytes, serialized) in [
        ("\"6GiB\"", 6u64 << 30, "6GiB"),
        ("\"6 GiB\"", 6 << 30, "6GiB"),
        ("\"512MiB\"", 512 << 20, "512MiB"),
        ("\"1.5GiB\"", 1_610_612_736, "1536MiB"),
        ("\"2GB\"", 2_000_000_000, "1953125KiB"),
        ("\"1TiB\"", 1 << 40, "1TiB"),
        ("123456789", 123_456_789, "123456789B"),
        ("\"4096\"", 4096, "4KiB"),
    ] {
        let text = edit(
            &base_spec(),
            "vram = \"auto\"",
            &format!("vram = {written}"),
        );
        let spec = load(&text).spec;
        assert_eq!(spec.resources.vram, VramRequest::Bytes(bytes), "{written}");
        let json = serde_json::to_string(&spec).expect("serializes");
        assert!(
            json.contains(&format!("\"vram\":\"{serialized}\"")),
            "{written} should serialize as {serialized}: {json}"
        );
        assert_round_trips(&spec);
    }
    for auto in ["\"auto\"", "\"AUTO\"", "\" auto \""] {
        let text = edit(&base_spec(), "vram = \"auto\"", &format!("vram = {auto}"));
        assert_eq!(load(&text).spec.resources.vram, VramRequest::Auto, "{auto}");
    }
}

#[test]
fn max_duration_is_read_and_round_trips_for_both_kinds_of_job() {
    use std::time::Duration;

    let text = edit(
        &base_spec(),
        "vram = \"auto\"",
        "vram = \"auto\"\nmax_duration = \"1h30m\"",
    );
    let spec = load(&text).spec;
    assert_eq!(spec.resources.max_duration.as_deref(), Some("1h30m"));
    assert_eq!(
        spec.resources.max_duration_limit(),
        Ok(Some(Duration::from_secs(5_400)))
    );
    assert_round_trips(&spec);
    // Without it, the worker's limit alone: nothing is written back either.
    let spec = load(&base_spec()).spec;
    assert_eq!(spec.resources.max_duration_limit(), Ok(None));
    let json = serde_json::to_string(&spec).unwrap();
    assert!(!json.contains("max_duration"), "{json}");

    // A command job shares [resources], and its checks.
    let command = |max_duration: &str| {
        format!(
            "name = \"sleeper\"\n[command]\nargv = [\"sleep\", \"600\"]\n\
             global_batch = 1\n[resources]\nvram = \"1GiB\"\nmax_duration = {max_duration}\n"
        )
    };
    let job = carve_core::command::validate::load_spec_toml(&command("\"2s\"")).unwrap();
    assert_eq!(
        job.resources().max_duration_limit(),
        Ok(Some(Duration::from_secs(2)))
    );
    let error = carve_core::command::validate::load_spec_toml(&command("\"2 weeks\""))
        .expect_err("an unknown unit");
    assert_eq!(error.field, "resources.max_duration");
    assert!(error.reason.contains("unknown unit 'w'"), "{error:?}");
}

#[test]
fn a_bad_max_duration_is_rejected_with_its_reason() {
    let with = |written: &str| {
        edit(
            &base_spec(),
            "vram = \"auto\"",
            &format!("vram = \"auto\"\nmax_duration = {written}"),
        )
    };
    let field = "resources.max_duration";
    assert_rejected(&with("\"0s\""), field, &["\"0s\"", "longer than 0s"]);
    assert_rejected(&with("\"0h0m\""), field, &["longer than 0s"]);
    assert_rejected(&with("\"90\""), field, &["90 has no unit", "90m"]);
    assert_rejected(&with("\"1.5h\""), field, &["unknown unit '.'"]);
    assert_rejected(&with("\"30m2h\""), field, &["longest unit first"]);
    assert_rejected(&with("\"\""), field, &["is empty"]);
    assert_rejected(&with("\"99999999999999999999d\""), field, &["too long"]);
    // Not a string at all: the parser names the field.
    let error = load_error(&with("7200"));
    assert_eq!(error.field, field, "{error:?}");
    // Over the API (JSON) the same check names the same field.
    let spec = parse_job_spec_toml(&with("\"2h\"")).unwrap();
    let json = serde_json::to_string(&spec).unwrap().replacen(
        "\"max_duration\":\"2h\"",
        "\"max_duration\":\"2 hours\"",
        1,
    );
    let error = validate_job_spec(parse_job_spec_json(&json).unwrap()).expect_err("bad unit");
    assert_eq!(error.field, field, "{error:?}");
    assert!(error.reason.contains("\"2 hours\""), "{error:?}");
}

#[test]
fn workspace_limit_round_trips() {
    for (written, bytes) in [
        ("\"64MiB\"", 64u64 << 20),
        ("\"1GiB\"", 1 << 30),
        ("\"1000000\"", 1_000_000),
        ("1000000", 1_000_000),
        ("0", 0),
        ("\"1.25MiB\"", 1_310_720),
    ] {
        let text = edit(
            &base_spec(),
            "batch_size = 64",
            &format!("batch_size = 64\nworkspace_limit = {written}"),
        );
        let spec = load(&text).spec;
        assert_eq!(spec.training.workspace_limit, ByteSize(bytes), "{written}");
        assert_round_trips(&spec);
    }
    let text = edit(
        &base_spec(),
        "batch_size = 64",
        "batch_size = 64\nworkspace_limit = \"lots\"",
    );
    let error = load_error(&text);
    assert_eq!(error.field, "training.workspace_limit");
}

#[test]
fn json_parse_errors_name_the_field() {
    let spec = parse_job_spec_toml(&base_spec()).expect("parses");
    let json = serde_json::to_string(&spec).expect("serializes");

    let with_typo = json.replacen("\"kernel\":3", "\"kernal\":3", 1);
    assert_ne!(with_typo, json);
    let error = parse_job_spec_json(&with_typo).expect_err("unknown field");
    assert_eq!(error.field, "model.layers[0].conv2d.kernal");
    assert!(error.reason.contains("unknown field `kernal`"), "{error:?}");

    let bad_vram = json.replacen("\"vram\":\"auto\"", "\"vram\":\"6 parsecs\"", 1);
    assert_ne!(bad_vram, json);
    let error = parse_job_spec_json(&bad_vram).expect_err("bad size");
    assert_eq!(error.field, "resources.vram");
    assert!(error.reason.contains("parsecs"), "{error:?}");

    let error = parse_job_spec_json("this is not json").expect_err("syntax error");
    assert_eq!(error.field, "");
    assert!(!error.reason.is_empty());
    assert_eq!(error.to_string(), error.reason);

    let error = parse_job_spec_json(&json.replacen("\"batch_size\":64", "\"batch_size\":-1", 1))
        .expect_err("negative batch");
    assert_eq!(error.field, "training.batch_size");
}

// ---------------------------------------------------------------------------------------
// Rejections: parse errors
// ---------------------------------------------------------------------------------------

#[test]
fn unknown_top_level_field_is_named() {
    let text = format!("colour = \"blue\"\n{}", base_spec());
    let error = assert_rejected(&text, "colour", &["unknown field `colour`"]);
    assert!(error.reason.contains("line 1"), "{error:?}");
    assert_edit_rejected(
        "samples = 1024",
        "samples = 1024\nsample_count = 5",
        "data.sample_count",
        &["unknown field"],
    );
}

#[test]
fn unknown_field_inside_a_layer_names_its_path() {
    let text = classifier_with(&[
        "{ conv2d = { filters = 4, kernel = 3 } }",
        "{ relu = {} }",
        "{ conv2d = { filters = 4, kernal = 3 } }",
    ]);
    let error = assert_rejected(
        &text,
        "model.layers[2].conv2d.kernal",
        &["unknown field `kernal`"],
    );
    assert!(error.field.contains("layers[2]"));
    assert!(
        error
            .to_string()
            .starts_with("model.layers[2].conv2d.kernal: ")
    );

    let text = classifier_with(&["{ relu = { alpha = 1 } }"]);
    assert_rejected(&text, "model.layers[0].relu.alpha", &["unknown field"]);
    assert_edit_rejected(
        "optimizer = { adam = { learning_rate = 0.001 } }",
        "optimizer = { adam = { learning_rate = 0.001, momentum = 0.9 } }",
        "training.optimizer.adam.momentum",
        &["unknown field"],
    );
}

#[test]
fn unknown_layer_kind_is_named() {
    let text = classifier_with(&[
        "{ relu = {} }",
        "{ convolution = { filters = 4, kernel = 3 } }",
    ]);
    assert_rejected(
        &text,
        "model.layers[1]",
        &["unknown variant `convolution`", "conv2d"],
    );
    // Two kinds in one entry.
    let text = classifier_with(&["{ relu = {}, tanh = {} }"]);
    let error = load_error(&text);
    assert_eq!(error.field, "model.layers[0]");
}

#[test]
fn malformed_values_name_their_field() {
    let cases = [
        (
            "{ conv2d = { filters = 4, kernel = [3] } }",
            "model.layers[0].conv2d.kernel",
        ),
        (
            "{ conv2d = { filters = 4, kernel = [3, 3, 3] } }",
            "model.layers[0].conv2d.kernel",
        ),
        (
            "{ conv2d = { filters = 4, kernel = -3 } }",
            "model.layers[0].conv2d.kernel",
        ),
        (
            "{ conv2d = { filters = 4, kernel = 3, padding = \"sane\" } }",
            "model.layers[0].conv2d.padding",
        ),
        (
            "{ conv2d = { filters = 4.5, kernel = 3 } }",
            "model.layers[0].conv2d.filters",
        ),
        (
            "{ conv2d = { kernel = 3 } }",
            "model.layers[0].conv2d.filters",
        ),
        (
            "{ dropout = { rate = \"half\" } }",
            "model.layers[0].dropout.rate",
        ),
    ];
    for (layer, field) in cases {
        let text = classifier_with(&[layer]);
        let error = load_error(&text);
        assert_eq!(error.field, field, "{layer}: {error:?}");
        assert!(!error.reason.is_empty());
    }
    assert_edit_rejected(
        "loss = \"softmax_cross_entropy\"",
        "loss = \"hinge\"",
        "model.loss",
        &["unknown variant `hinge`"],
    );
    assert_edit_rejected(
        "batch_size = 64",
        "batch_size = 64\nprecision = \"fp8\"",
        "training.precision",
        &["fp8"],
    );
    assert_edit_rejected(
        "format = \"synthetic\"",
        "format = \"parquet\"",
        "data.format",
        &["parquet"],
    );
    assert_edit_rejected(
        "min_micro_batch = 8",
        "min_micro_batch = 8\nstrategies = [\"mixed_precision\", \"pray\"]",
        "oom.strategies[1]",
        &["pray"],
    );
}

#[test]
fn missing_required_fields_are_named() {
    let cases = [
        (edit(&base_spec(), "name = \"test-job\"\n", ""), "name"),
        (
            edit(&base_spec(), "loss = \"softmax_cross_entropy\"\n", ""),
            "model.loss",
        ),
        (
            edit(&base_spec(), "input_shape = [28, 28, 1]\n", ""),
            "model.input_shape",
        ),
        (
            edit(&base_spec(), "batch_size = 64\n", ""),
            "training.batch_size",
        ),
        (
            edit(
                &base_spec(),
                "optimizer = { adam = { learning_rate = 0.001 } }\n",
                "",
            ),
            "training.optimizer",
        ),
        (
            edit(
                &base_spec(),
                "optimizer = { adam = { learning_rate = 0.001 } }",
                "optimizer = { adam = { beta1 = 0.9 } }",
            ),
            "training.optimizer.adam.learning_rate",
        ),
        (
            edit(&base_spec(), "format = \"synthetic\"\n", ""),
            "data.format",
        ),
        (
            edit(&base_spec(), "kernel = 3", "stride = 1"),
            "model.layers[0].conv2d.kernel",
        ),
        (
            classifier_with(&["{ dropout = {} }"]),
            "model.layers[0].dropout.rate",
        ),
    ];
    for (text, field) in cases {
        let error = load_error(&text);
        assert_eq!(error.field, field, "{error:?}");
        assert!(error.reason.contains("missing field"), "{error:?}");
        assert_eq!(
            error.to_string(),
            format!("{}: {}", error.field, error.reason)
        );
    }
    // A whole missing table.
    let text = base_spec();
    let without_data = edit(
        &text,
        "[data]\nformat = \"synthetic\"\nsamples = 1024\n",
        "",
    );
    assert_rejected(&without_data, "data", &["missing field `data`"]);
    // JSON too.
    let spec = parse_job_spec_toml(&base_spec()).expect("parses");
    let json = serde_json::to_string(&spec).expect("serializes");
    let without_name = json.replacen("\"name\":\"test-job\",", "", 1);
    assert_ne!(without_name, json);
    let error = parse_job_spec_json(&without_name).expect_err("missing name");
    assert_eq!(error.field, "name");
    let without_units = json.replacen("\"units\":10,", "", 1);
    assert_ne!(without_units, json);
    let error = parse_job_spec_json(&without_units).expect_err("missing units");
    assert_eq!(error.field, "model.layers[3].dense.units");
}

#[test]
fn toml_syntax_error_has_an_empty_field_and_a_reason() {
    for broken in [
        edit(&base_spec(), "[data]", "[data"),
        edit(&base_spec(), "batch_size = 64", "batch_size = = 64"),
        edit(&base_spec(), "name = \"test-job\"", "name = \"test-job"),
        "this is not toml".to_string(),
    ] {
        let error = load_error(&broken);
        assert_eq!(error.field, "", "{error:?}");
        assert!(!error.reason.trim().is_empty(), "{error:?}");
        assert_eq!(error.to_string(), error.reason);
    }
}

/// The warnings of a valid dense classifier on `input_shape`.
fn warnings_for(input_shape: &str) -> Vec<String> {
    let text = spec_with(
        input_shape,
        "softmax_cross_entropy",
        &["{ flatten = {} }", "{ dense = { units = 10 } }"],
    );
    load(&text)
        .warnings()
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn channels_first_input_shapes_are_accepted_with_a_warning() {
    for (shape, suggestion) in [
        ("[3, 32, 32]", "[32, 32, 3]"),
        ("[1, 28, 28]", "[28, 28, 1]"),
    ] {
        let warnings = warnings_for(shape);
        assert_eq!(warnings.len(), 1, "{shape}: {warnings:?}");
        for fragment in [
            "model.input_shape: ",
            "channels-first",
            "[height, width, channels]",
            suggestion,
        ] {
            assert!(warnings[0].contains(fragment), "{shape}: {warnings:?}");
        }
    }
}

#[test]
fn channels_last_and_other_shapes_have_no_warning() {
    // Channels last, as Carve reads them; a small image; a first dimension too large for
    // channels; a non-square rest; a flat input.
    for shape in [
        "[32, 32, 3]",
        "[28, 28, 1]",
        "[4, 4, 4]",
        "[3, 7, 7]",
        "[5, 32, 32]",
        "[3, 32, 16]",
        "[784]",
    ] {
        assert_eq!(warnings_for(shape), Vec::<String>::new(), "{shape}");
    }
    assert!(load(FULL_SPEC).warnings().is_empty());
}

// ---------------------------------------------------------------------------------------
// Rejections: the model
// ---------------------------------------------------------------------------------------

#[test]
fn kernel_larger_than_the_input_is_named_with_its_size() {
    // The issue's example: a 5x5 kernel on a 4x4 input.
    let text = spec_with(
        "[8, 8, 1]",
        "softmax_cross_entropy",
        &[
            "{ max_pool = { size = 2 } }",
            "{ conv2d = { filters = 4, kernel = 5 } }",
            "{ flatten = {} }",
            "{ dense = { units = 10 } }",
        ],
    );
    let error = assert_rejected(
        &text,
        "model.layers[1].conv2d.kernel",
        &["larger than the 4x4 input"],
    );
    assert_eq!(
        error.to_string(),
        "model.layers[1].conv2d.kernel: 5 is larger than the 4x4 input"
    );

    let text = spec_with(
        "[4, 4, 1]",
        "mse",
        &["{ conv2d = { filters = 4, kernel = 5 } }"],
    );
    assert_rejected(
        &text,
        "model.layers[0].conv2d.kernel",
        &["larger than the 4x4 input"],
    );
    // Rectangles: only the width is too large.
    let text = spec_with(
        "[6, 4, 1]",
        "mse",
        &["{ conv2d = { filters = 1, kernel = [3, 5] } }"],
    );
    assert_rejected(
        &text,
        "model.layers[0].conv2d.kernel",
        &["3x5", "larger than the 6x4 input"],
    );
    // Explicit padding counts: 5 on 3 + 2*1 = 5 fits, on 2 + 2*1 = 4 does not.
    let text = spec_with(
        "[3, 3, 1]",
        "mse",
        &["{ conv2d = { filters = 1, kernel = 5, padding = 1 } }"],
    );
    assert_eq!(load(&text).graph.output_shape(), image(1, 1, 1));
    let text = spec_with(
        "[2, 2, 1]",
        "mse",
        &["{ conv2d = { filters = 1, kernel = 5, padding = 1 } }"],
    );
    assert_rejected(
        &text,
        "model.layers[0].conv2d.kernel",
        &["larger than the 4x4 input"],
    );
    // Pools too.
    let text = spec_with("[3, 3, 1]", "mse", &["{ max_pool = { size = 4 } }"]);
    assert_rejected(
        &text,
        "model.layers[0].max_pool.size",
        &["larger than the 3x3 input"],
    );
}

#[test]
fn pool_window_errors_name_the_size_field() {
    // A pool's window is written `size`, not `kernel` as a convolution's is.
    let error = assert_edit_rejected(
        "{ conv2d = { filters = 4, kernel = 3 } }",
        "{ max_pool = { size = 29 } }",
        "model.layers[0].max_pool.size",
        &["29 is larger than the 28x28 input"],
    );
    assert!(!error.to_string().contains("kernel"), "{error}");
    assert_edit_rejected(
        "{ conv2d = { filters = 4, kernel = 3 } }",
        "{ avg_pool = { size = [2, 30] } }",
        "model.layers[0].avg_pool.size",
        &["larger than the 28x28 input"],
    );
    assert_edit_rejected(
        "{ conv2d = { filters = 4, kernel = 3 } }",
        "{ avg_pool = { size = 18446744073709551615, stride = 1, padding = \"same\" } }",
        "model.layers[0].avg_pool.size",
        &["too large"],
    );
    let error = assert_edit_rejected(
        "{ conv2d = { filters = 4, kernel = 3 } }",
        "{ max_pool = { size = 2, padding = 2 } }",
        "model.layers[0].max_pool.padding",
        &["not smaller than the size 2"],
    );
    assert!(!error.reason.contains("kernel"), "{error}");
}

#[test]
fn window_settings_out_of_range() {
    let cases = [
        (
            "{ conv2d = { filters = 0, kernel = 3 } }",
            "model.layers[0].conv2d.filters",
        ),
        (
            "{ conv2d = { filters = 2, kernel = 0 } }",
            "model.layers[0].conv2d.kernel",
        ),
        (
            "{ conv2d = { filters = 2, kernel = [3, 0] } }",
            "model.layers[0].conv2d.kernel",
        ),
        (
            "{ conv2d = { filters = 2, kernel = 3, stride = 0 } }",
            "model.layers[0].conv2d.stride",
        ),
        (
            "{ conv2d = { filters = 2, kernel = 3, stride = [0, 1] } }",
            "model.layers[0].conv2d.stride",
        ),
        (
            "{ conv2d = { filters = 2, kernel = 3, padding = 3 } }",
            "model.layers[0].conv2d.padding",
        ),
        (
            "{ max_pool = { size = 0 } }",
            "model.layers[0].max_pool.size",
        ),
        (
            "{ avg_pool = { size = 2, stride = 0 } }",
            "model.layers[0].avg_pool.stride",
        ),
        (
            "{ avg_pool = { size = 2, padding = 2 } }",
            "model.layers[0].avg_pool.padding",
        ),
        ("{ dense = { units = 0 } }", "model.layers[0].dense.units"),
        (
            "{ leaky_relu = { alpha = -0.1 } }",
            "model.layers[0].leaky_relu.alpha",
        ),
        (
            "{ leaky_relu = { alpha = nan } }",
            "model.layers[0].leaky_relu.alpha",
        ),
        (
            "{ leaky_relu = { alpha = inf } }",
            "model.layers[0].leaky_relu.alpha",
        ),
        (
            "{ batch_norm = { momentum = 1.0 } }",
            "model.layers[0].batch_norm.momentum",
        ),
        (
            "{ batch_norm = { momentum = -0.5 } }",
            "model.layers[0].batch_norm.momentum",
        ),
        (
            "{ batch_norm = { epsilon = 0.0 } }",
            "model.layers[0].batch_norm.epsilon",
        ),
        (
            "{ batch_norm = { epsilon = nan } }",
            "model.layers[0].batch_norm.epsilon",
        ),
    ];
    for (layer, field) in cases {
        let input = if layer.contains("dense") {
            "[10]"
        } else {
            "[8, 8, 2]"
        };
        let text = spec_with(input, "mse", &[layer]);
        let error = load_error(&text);
        assert_eq!(error.field, field, "{layer}: {error:?}");
        assert!(!error.reason.is_empty());
    }
}

#[test]
fn dropout_rate_must_be_below_one() {
    for rate in ["1.0", "1.5", "-0.1", "nan"] {
        let text = classifier_with(&[
            "{ relu = {} }",
            &format!("{{ dropout = {{ rate = {rate} }} }}"),
        ]);
        assert_rejected(&text, "model.layers[1].dropout.rate", &["[0, 1)"]);
    }
}

#[test]
fn dense_on_an_image_asks_for_flatten() {
    let text = spec_with(
        "[28, 28, 1]",
        "softmax_cross_entropy",
        &[
            "{ conv2d = { filters = 4, kernel = 3 } }",
            "{ relu = {} }",
            "{ dense = { units = 10 } }",
        ],
    );
    assert_rejected(&text, "model.layers[2].dense", &["flatten", "26x26x4"]);
    let text = spec_with(
        "[28, 28, 1]",
        "softmax_cross_entropy",
        &["{ dense = { units = 10 } }"],
    );
    assert_rejected(&text, "model.layers[0].dense", &["flatten"]);
}

#[test]
fn image_layers_after_flatten_are_rejected() {
    for (layer, kind) in [
        ("{ conv2d = { filters = 4, kernel = 3 } }", "conv2d"),
        ("{ max_pool = { size = 2 } }", "max_pool"),
        ("{ avg_pool = { size = 2 } }", "avg_pool"),
        ("{ global_avg_pool = {} }", "global_avg_pool"),
    ] {
        let text = spec_with(
            "[28, 28, 1]",
            "softmax_cross_entropy",
            &["{ flatten = {} }", layer, "{ dense = { units = 10 } }"],
        );
        assert_rejected(
            &text,
            &format!("model.layers[1].{kind}"),
            &["image", "784 flat features", "flatten"],
        );
    }
    // A flat input is just as flat.
    let text = spec_with(
        "[100]",
        "mse",
        &["{ conv2d = { filters = 4, kernel = 3 } }"],
    );
    assert_rejected(&text, "model.layers[0].conv2d", &["100 flat features"]);
}

#[test]
fn softmax_cross_entropy_needs_flat_class_scores() {
    let text = spec_with(
        "[28, 28, 1]",
        "softmax_cross_entropy",
        &["{ conv2d = { filters = 4, kernel = 3 } }"],
    );
    assert_rejected(
        &text,
        "model.loss",
        &["softmax_cross_entropy", "26x26x4", "flatten"],
    );
    let text = spec_with(
        "[28, 28, 1]",
        "softmax_cross_entropy",
        &["{ flatten = {} }", "{ dense = { units = 1 } }"],
    );
    assert_rejected(&text, "model.loss", &["at least 2 classes"]);
    // The same models are fine under mse.
    let text = spec_with(
        "[28, 28, 1]",
        "mse",
        &["{ flatten = {} }", "{ dense = { units = 1 } }"],
    );
    load(&text);
}

#[test]
fn input_shape_rank_and_size() {
    for (shape, dimensions) in [("[28, 28]", "2"), ("[]", "0"), ("[1, 2, 3, 4]", "4")] {
        let text = spec_with(shape, "mse", &["{ relu = {} }"]);
        assert_rejected(
            &text,
            "model.input_shape",
            &[&format!("has {dimensions} dimensions")],
        );
    }
    let text = spec_with("[28, 0, 1]", "mse", &["{ relu = {} }"]);
    assert_rejected(&text, "model.input_shape", &["at least 1"]);
    let text = spec_with("[0]", "mse", &["{ relu = {} }"]);
    assert_rejected(&text, "model.input_shape", &["at least 1"]);
    let text = spec_with("[28, 28, 1]", "mse", &[]);
    assert_rejected(&text, "model.layers", &["at least one layer"]);
}

/// `count` dense layers of 8 units on 8 features, an MSE model (any layer count is valid).
fn deep_dense_spec(count: usize) -> String {
    let layers = vec!["{ dense = { units = 8 } }"; count];
    spec_with("[8]", "mse", &layers)
}

#[test]
fn a_model_at_the_layer_limit_is_accepted_and_one_more_layer_is_refused() {
    let job = load(&deep_dense_spec(MAX_MODEL_LAYERS));
    assert_eq!(job.graph.layers.len(), MAX_MODEL_LAYERS);
    let error = assert_rejected(
        &deep_dense_spec(MAX_MODEL_LAYERS + 1),
        "model.layers",
        &[
            &format!("has {} layers", MAX_MODEL_LAYERS + 1),
            &format!("the limit is {MAX_MODEL_LAYERS}"),
        ],
    );
    assert_eq!(
        error.to_string(),
        format!(
            "model.layers: has {} layers; the limit is {MAX_MODEL_LAYERS}",
            MAX_MODEL_LAYERS + 1
        )
    );
    // The same limit over the API's JSON.
    let too_deep = parse_job_spec_toml(&deep_dense_spec(MAX_MODEL_LAYERS + 1)).unwrap();
    let json = serde_json::to_string(&too_deep).unwrap();
    let error = validate_job_spec(parse_job_spec_json(&json).unwrap()).unwrap_err();
    assert_eq!(error.field, "model.layers");
}

// ---------------------------------------------------------------------------------------
// Rejections: training, data, resources, policy, name
// ---------------------------------------------------------------------------------------

#[test]
fn steps_and_epochs_exactly_one() {
    assert_edit_rejected(
        "steps = 200",
        "steps = 200\nepochs = 3",
        "training.epochs",
        &["not both"],
    );
    assert_edit_rejected("steps = 200\n", "", "training.steps", &["steps or epochs"]);
    assert_edit_rejected(
        "steps = 200",
        "steps = 0",
        "training.steps",
        &["at least 1"],
    );
    assert_edit_rejected(
        "steps = 200",
        "epochs = 0",
        "training.epochs",
        &["at least 1"],
    );
    let epochs = edit(&base_spec(), "steps = 200", "epochs = 2");
    assert_eq!(load(&epochs).spec.training.epochs, Some(2));
}

#[test]
fn batch_size_and_accumulation() {
    let text = edit(&base_spec(), "batch_size = 64", "batch_size = 0");
    // min_micro_batch 8 would also be wrong, but batch_size is checked first.
    assert_rejected(&text, "training.batch_size", &["at least 1"]);
    assert_edit_rejected(
        "batch_size = 64",
        "batch_size = 100000000",
        "training.batch_size",
        &["limit"],
    );
    assert_edit_rejected(
        "batch_size = 64",
        "batch_size = 64\naccumulation_steps = 3",
        "training.accumulation_steps",
        &["3 does not divide batch_size 64"],
    );
    assert_edit_rejected(
        "batch_size = 64",
        "batch_size = 64\naccumulation_steps = 0",
        "training.accumulation_steps",
        &["at least 1"],
    );
    let text = edit(
        &base_spec(),
        "batch_size = 64",
        "batch_size = 64\naccumulation_steps = 64",
    );
    assert_eq!(load(&text).spec.training.accumulation_steps, 64);
}

#[test]
fn learning_rate_must_be_positive_and_finite() {
    for (optimizer, field) in [
        ("adam", "training.optimizer.adam.learning_rate"),
        ("adamw", "training.optimizer.adamw.learning_rate"),
        ("sgd", "training.optimizer.sgd.learning_rate"),
    ] {
        for value in ["0.0", "-0.001", "nan", "inf", "-inf"] {
            assert_edit_rejected(
                "optimizer = { adam = { learning_rate = 0.001 } }",
                &format!("optimizer = {{ {optimizer} = {{ learning_rate = {value} }} }}"),
                field,
                &["must be a finite number > 0"],
            );
        }
    }
    let cases = [
        (
            "{ adam = { learning_rate = 0.001, beta1 = 1.0 } }",
            "training.optimizer.adam.beta1",
        ),
        (
            "{ adam = { learning_rate = 0.001, beta2 = -0.1 } }",
            "training.optimizer.adam.beta2",
        ),
        (
            "{ adamw = { learning_rate = 0.001, epsilon = 0.0 } }",
            "training.optimizer.adamw.epsilon",
        ),
        (
            "{ adamw = { learning_rate = 0.001, weight_decay = -1.0 } }",
            "training.optimizer.adamw.weight_decay",
        ),
        (
            "{ sgd = { learning_rate = 0.1, momentum = 1.0 } }",
            "training.optimizer.sgd.momentum",
        ),
        (
            "{ sgd = { learning_rate = 0.1, nesterov = true } }",
            "training.optimizer.sgd.nesterov",
        ),
        (
            "{ sgd = { learning_rate = 0.1, weight_decay = nan } }",
            "training.optimizer.sgd.weight_decay",
        ),
    ];
    for (optimizer, field) in cases {
        let text = edit(
            &base_spec(),
            "optimizer = { adam = { learning_rate = 0.001 } }",
            &format!("optimizer = {optimizer}"),
        );
        let error = load_error(&text);
        assert_eq!(error.field, field, "{optimizer}: {error:?}");
    }
}

#[test]
fn recompute_segment_layers_within_the_model() {
    // base_spec has 4 layers.
    for (segment, ok) in [(0, false), (1, true), (4, true), (5, false), (1000, false)] {
        let text = edit(
            &base_spec(),
            "batch_size = 64",
            &format!("batch_size = 64\nrecompute_segment_layers = {segment}"),
        );
        if ok {
            assert_eq!(
                load(&text).spec.training.recompute_segment_layers,
                Some(segment)
            );
        } else {
            assert_rejected(
                &text,
                "training.recompute_segment_layers",
                &[&format!("{segment} must be between 1 and the 4 layers")],
            );
        }
    }
}

#[test]
fn vram_must_be_a_size_and_not_zero() {
    let error = assert_edit_rejected(
        "vram = \"auto\"",
        "vram = \"6 parsecs\"",
        "resources.vram",
        &["unknown unit `parsecs`"],
    );
    assert!(error.to_string().starts_with("resources.vram: "));
    for zero in ["\"0\"", "0", "\"0GiB\""] {
        assert_edit_rejected(
            "vram = \"auto\"",
            &format!("vram = {zero}"),
            "resources.vram",
            &["more than 0 bytes"],
        );
    }
    for bad in [
        "\"\"",
        "\"six GiB\"",
        "\"1.5B\"",
        "\"99999999999TiB\"",
        "-5",
        "true",
    ] {
        let text = edit(&base_spec(), "vram = \"auto\"", &format!("vram = {bad}"));
        let error = load_error(&text);
        assert_eq!(error.field, "resources.vram", "{bad}: {error:?}");
        assert!(!error.reason.is_empty());
    }
}

#[test]
fn a_model_job_keeps_one_slice() {
    assert_edit_rejected(
        "vram = \"auto\"",
        "vram = \"auto\"\ngpus = 2",
        "resources.gpus",
        &["2 GPUs", "model jobs keep one slice"],
    );
    assert_edit_rejected(
        "vram = \"auto\"",
        "vram = \"auto\"\ngpus = 0",
        "resources.gpus",
        &[],
    );
}

#[test]
fn oom_policy_checks() {
    assert_edit_rejected(
        "min_micro_batch = 8",
        "min_micro_batch = 8\nstrategies = [\"accumulate\", \"recompute\", \"accumulate\"]",
        "oom.strategies[2]",
        &["accumulate is listed twice"],
    );
    assert_edit_rejected(
        "min_micro_batch = 8",
        "min_micro_batch = 65",
        "oom.min_micro_batch",
        &["65 is larger than training.batch_size 64"],
    );
    let text = edit(&base_spec(), "min_micro_batch = 8", "min_micro_batch = 64");
    assert_eq!(load(&text).spec.oom.min_micro_batch, 64);
    assert_edit_rejected(
        "min_micro_batch = 8",
        "min_micro_batch = 0",
        "oom.min_micro_batch",
        &["at least 1"],
    );
    assert_edit_rejected(
        "min_micro_batch = 8",
        "min_micro_batch = 8\nhalf_precision = \"fp32\"",
        "oom.half_precision",
        &["fp16 or bf16"],
    );
    assert_edit_rejected(
        "min_micro_batch = 8",
        "min_micro_batch = 8\nmax_retries = 101",
        "oom.max_retries",
        &["101"],
    );
    // An empty strategy list is allowed: no shrinking at all.
    let text = edit(
        &base_spec(),
        "min_micro_batch = 8",
        "min_micro_batch = 8\nstrategies = []",
    );
    assert!(load(&text).spec.oom.strategies.is_empty());
}

#[test]
fn data_source_checks() {
    let idx_missing_labels = with_data(
        &base_spec(),
        "format = \"idx\"\ntrain = { images = \"train-images.idx3-ubyte\" }",
    );
    assert_rejected(
        &idx_missing_labels,
        "data.train.labels",
        &["required", "idx"],
    );
    let idx_test_missing_images = with_data(
        &base_spec(),
        "format = \"idx\"\ntrain = { images = \"i\", labels = \"l\" }\ntest = { labels = \"l\" }",
    );
    assert_rejected(&idx_test_missing_images, "data.test.images", &["required"]);
    let idx_without_train = with_data(&base_spec(), "format = \"idx\"");
    assert_rejected(&idx_without_train, "data.train", &["required"]);
    assert_edit_rejected(
        "format = \"synthetic\"",
        "format = \"idx\"\ntrain = { images = \"i\", labels = \"l\" }",
        "data.samples",
        &["not used", "idx"],
    );
    let idx_with_files = with_data(
        &base_spec(),
        "format = \"idx\"\ntrain = { images = \"i\", labels = \"l\", files = [\"f\"] }",
    );
    assert_rejected(&idx_with_files, "data.train.files", &["not used"]);
    let idx_empty_path = with_data(
        &base_spec(),
        "format = \"idx\"\ntrain = { images = \" \", labels = \"l\" }",
    );
    assert_rejected(&idx_empty_path, "data.train", &["must not be empty"]);
    let idx_mse = with_data(
        &spec_with(
            "[28, 28, 1]",
            "mse",
            &["{ flatten = {} }", "{ dense = { units = 10 } }"],
        ),
        "format = \"idx\"\ntrain = { images = \"i\", labels = \"l\" }",
    );
    assert_rejected(&idx_mse, "model.loss", &["softmax_cross_entropy"]);

    let cifar_wrong_shape = with_data(
        &base_spec(),
        "format = \"cifar10\"\ntrain = { files = [\"data_batch_1.bin\"] }",
    );
    assert_rejected(
        &cifar_wrong_shape,
        "model.input_shape",
        &["[32, 32, 3]", "[28, 28, 1]"],
    );
    let cifar_five_classes = with_data(
        &spec_with(
            "[32, 32, 3]",
            "softmax_cross_entropy",
            &["{ flatten = {} }", "{ dense = { units = 5 } }"],
        ),
        "format = \"cifar10\"\ntrain = { files = [\"data_batch_1.bin\"] }",
    );
    assert_rejected(&cifar_five_classes, "model.loss", &["10 classes"]);
    let cifar_no_files = with_data(
        &spec_with(
            "[32, 32, 3]",
            "softmax_cross_entropy",
            &["{ flatten = {} }", "{ dense = { units = 10 } }"],
        ),
        "format = \"cifar10\"\ntrain = { files = [] }",
    );
    assert_rejected(&cifar_no_files, "data.train.files", &["required"]);

    let npy_missing_targets = with_data(
        &spec_with("[20]", "mse", &["{ dense = { units = 3 } }"]),
        "format = \"npy\"\ntrain = { inputs = \"x.npy\" }",
    );
    assert_rejected(
        &npy_missing_targets,
        "data.train.targets",
        &["required", "npy"],
    );

    assert_edit_rejected(
        "samples = 1024\n",
        "",
        "data.samples",
        &["required", "synthetic"],
    );
    assert_edit_rejected(
        "samples = 1024",
        "samples = 0",
        "data.samples",
        &["at least 1"],
    );
    assert_edit_rejected(
        "samples = 1024",
        "samples = 1024\ntrain = { images = \"i\" }",
        "data.train",
        &["not used", "synthetic"],
    );
    assert_edit_rejected(
        "samples = 1024",
        "samples = 1024\nprefetch_batches = 0",
        "data.prefetch_batches",
        &["between 1 and 16"],
    );
    assert_edit_rejected(
        "samples = 1024",
        "samples = 1024\nprefetch_batches = 17",
        "data.prefetch_batches",
        &["between 1 and 16"],
    );
}

#[test]
fn job_name_characters() {
    for bad in ["my job", "job/1", "job!", "naïve", "a\tb"] {
        assert_edit_rejected(
            "name = \"test-job\"",
            &format!("name = {bad:?}"),
            "name",
            &["is not allowed"],
        );
    }
    assert_edit_rejected(
        "name = \"test-job\"",
        "name = \"\"",
        "name",
        &["must not be empty"],
    );
    let long = "x".repeat(129);
    assert_edit_rejected(
        "name = \"test-job\"",
        &format!("name = \"{long}\""),
        "name",
        &["129 characters", "128"],
    );
    for good in ["a", "mnist-cnn_v1.2", "ABC", &"y".repeat(128)] {
        let text = edit(
            &base_spec(),
            "name = \"test-job\"",
            &format!("name = \"{good}\""),
        );
        assert_eq!(load(&text).spec.name, good);
    }
}

#[test]
fn field_error_display() {
    let error = FieldError::new(
        "model.layers[3].conv2d.kernel",
        "5 is larger than the 4x4 input",
    );
    assert_eq!(
        error.to_string(),
        "model.layers[3].conv2d.kernel: 5 is larger than the 4x4 input"
    );
    let error = FieldError::new("", "expected `]`");
    assert_eq!(error.to_string(), "expected `]`");
}

// ---------------------------------------------------------------------------------------
// Checked arithmetic: absurd sizes are errors, never panics
// ---------------------------------------------------------------------------------------

#[track_caller]
fn assert_rejected_under(text: &str, field_prefix: &str) -> FieldError {
    let error = load_error(text);
    assert!(
        error.field.starts_with(field_prefix),
        "field of {error:?} should start with `{field_prefix}`"
    );
    assert!(!error.reason.is_empty());
    error
}

#[test]
fn absurd_input_shape_is_rejected() {
    let text = spec_with("[1000000, 1000000, 1000000]", "mse", &["{ relu = {} }"]);
    assert_rejected(&text, "model.input_shape", &["elements per sample"]);
    // The product overflows u64 outright.
    let text = spec_with(
        "[9223372036854775807, 9223372036854775807, 9223372036854775807]",
        "mse",
        &["{ relu = {} }"],
    );
    assert_rejected(&text, "model.input_shape", &["elements per sample"]);
    let text = spec_with("[9223372036854775807]", "mse", &["{ relu = {} }"]);
    assert_rejected(&text, "model.input_shape", &[]);
    // Exactly at the limit is fine.
    let text = spec_with(
        &format!("[{}]", MAX_ELEMENTS_PER_SAMPLE),
        "mse",
        &["{ relu = {} }"],
    );
    load(&text);
}

#[test]
fn absurd_dense_layers_are_rejected() {
    let text = spec_with(
        "[28, 28, 1]",
        "softmax_cross_entropy",
        &[
            "{ flatten = {} }",
            &format!("{{ dense = {{ units = {} }} }}", 1u64 << 62),
        ],
    );
    assert_rejected(&text, "model.layers[1].dense.units", &[]);
    // Each factor is fine, the kernel product overflows u64.
    let text = spec_with(
        &format!("[{}]", 1u64 << 39),
        "mse",
        &[&format!("{{ dense = {{ units = {} }} }}", 1u64 << 30)],
    );
    assert_rejected(&text, "model.layers[0].dense.units", &[]);
    let text = spec_with(
        "[20]",
        "mse",
        &["{ dense = { units = 9223372036854775807 } }"],
    );
    assert_rejected(&text, "model.layers[0].dense.units", &[]);
}

#[test]
fn absurd_convolutions_are_rejected() {
    let text = spec_with(
        "[28, 28, 1]",
        "mse",
        &[&format!(
            "{{ conv2d = {{ filters = {}, kernel = 3 }} }}",
            1u64 << 40
        )],
    );
    assert_rejected_under(&text, "model.layers[0].conv2d");
    let text = spec_with(
        "[28, 28, 1]",
        "mse",
        &["{ conv2d = { filters = 9223372036854775807, kernel = 3, padding = \"same\" } }"],
    );
    assert_rejected_under(&text, "model.layers[0].conv2d");
    // A kernel product that overflows while the output is small.
    let text = spec_with(
        "[1, 1, 1000000]",
        "mse",
        &["{ conv2d = { filters = 100000000, kernel = 1 } }"],
    );
    assert_rejected_under(&text, "model.layers[0].conv2d");
    // A huge kernel with "same" padding.
    let text = spec_with(
        "[28, 28, 1]",
        "mse",
        &["{ conv2d = { filters = 1, kernel = 9223372036854775807, padding = \"same\" } }"],
    );
    assert_rejected_under(&text, "model.layers[0].conv2d");
    // Huge strides are fine: the output is 1x1.
    let text = spec_with(
        "[28, 28, 1]",
        "mse",
        &["{ conv2d = { filters = 1, kernel = 3, stride = 9223372036854775807 } }"],
    );
    assert_eq!(load(&text).graph.output_shape(), image(1, 1, 1));
}

#[test]
fn huge_explicit_padding_is_an_error_not_an_overflow() {
    // input + 2 * padding overflows u64 unless checked.
    for kind in [
        "conv2d = { filters = 1, kernel",
        "max_pool = { size",
        "avg_pool = { size",
    ] {
        let layer = format!("{{ {kind} = 9223372036854775807, padding = 9223372036854775806 }} }}");
        let text = spec_with("[28, 28, 1]", "mse", &[&layer]);
        let name = kind.split(' ').next().unwrap_or_default();
        assert_rejected(
            &text,
            &format!("model.layers[0].{name}.padding"),
            &["too large"],
        );
    }
}

#[test]
fn huge_pooled_output_is_an_error_not_an_overflow() {
    // Padding just below the window makes the pooled output (h + k - 1) per side: with
    // k = 2^33 the output has 2^66 elements, which must be refused before anything
    // multiplies it out (flatten, the dense kernel, the memory plan); with k = 2^21 it has
    // 2^42, which fits in u64 but is over the per-sample limit.
    for size in [1u64 << 33, 1 << 21] {
        for pool in ["max_pool", "avg_pool"] {
            let layer = format!(
                "{{ {pool} = {{ size = {size}, stride = 1, padding = {} }} }}",
                size - 1
            );
            let field = format!("model.layers[0].{pool}.padding");
            let text = spec_with(
                "[1, 1, 1]",
                "mse",
                &[&layer, "{ flatten = {} }", "{ dense = { units = 2 } }"],
            );
            assert_rejected(&text, &field, &["elements per sample"]);
            // Also when it is the last layer (an mse model ending in the image).
            let text = spec_with("[1, 1, 1]", "mse", &[&layer]);
            assert_rejected(&text, &field, &["elements per sample"]);
        }
    }
    // Under the limit is fine: 2^19 x 2^19 x 1.
    let size = 1u64 << 19;
    let layer = format!(
        "{{ max_pool = {{ size = {size}, stride = 1, padding = {} }} }}",
        size - 1
    );
    let text = spec_with("[1, 1, 1]", "mse", &[&layer]);
    assert_eq!(load(&text).graph.output_shape(), image(size, size, 1));
}

#[test]
fn json_only_sizes_beyond_i64_are_errors_not_overflows() {
    // JSON carries full u64 values that TOML cannot.
    let spec = parse_job_spec_toml(&spec_with(
        "[28, 28, 1]",
        "mse",
        &["{ conv2d = { filters = 1, kernel = 3, padding = \"same\" } }"],
    ))
    .expect("parses");
    let json = serde_json::to_string(&spec).expect("serializes");
    for replacement in [
        "\"kernel\":18446744073709551615",
        "\"kernel\":[18446744073709551615,3]",
        "\"kernel\":[3,18446744073709551615]",
    ] {
        let text = json.replacen("\"kernel\":3", replacement, 1);
        assert_ne!(text, json);
        let parsed = parse_job_spec_json(&text).expect("parses");
        let error = validate_job_spec(parsed).expect_err("huge kernel");
        assert_eq!(error.field, "model.layers[0].conv2d.kernel", "{error:?}");
        assert!(error.reason.contains("too large"), "{error:?}");
    }
    let text = json
        .replacen("\"kernel\":3", "\"kernel\":18446744073709551615", 1)
        .replacen(
            "\"padding\":\"same\"",
            "\"padding\":18446744073709551614",
            1,
        );
    let error =
        validate_job_spec(parse_job_spec_json(&text).expect("parses")).expect_err("huge padding");
    assert_eq!(error.field, "model.layers[0].conv2d.padding", "{error:?}");
    let text = json.replacen("\"filters\":1", "\"filters\":18446744073709551615", 1);
    let error =
        validate_job_spec(parse_job_spec_json(&text).expect("parses")).expect_err("huge filters");
    assert!(
        error.field.starts_with("model.layers[0].conv2d"),
        "{error:?}"
    );
    let text = json.replacen(
        "\"batch_size\":64",
        "\"batch_size\":18446744073709551615",
        1,
    );
    let error =
        validate_job_spec(parse_job_spec_json(&text).expect("parses")).expect_err("huge batch");
    assert_eq!(error.field, "training.batch_size");
}

// ---------------------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------------------

fn small_dimensions(max: u64) -> impl Strategy<Value = Dimensions> {
    prop_oneof![
        3 => (1..=max).prop_map(Dimensions::Square),
        1 => (1..=max, 1..=max).prop_map(|(height, width)| Dimensions::Rectangle([height, width])),
    ]
}

fn small_padding() -> impl Strategy<Value = Padding> {
    prop_oneof![
        Just(Padding::Named(PaddingMode::Valid)),
        Just(Padding::Named(PaddingMode::Same)),
        (0u64..4).prop_map(Padding::Pixels),
    ]
}

fn small_layer() -> impl Strategy<Value = LayerSpec> {
    prop_oneof![
        3 => (1u64..=8, small_dimensions(5), small_dimensions(3), small_padding(), any::<bool>()).prop_map(
            |(filters, kernel, stride, padding, use_bias)| {
                LayerSpec::Conv2d(Conv2dSpec {
                    filters,
                    kernel,
                    stride,
                    padding,
                    use_bias,
                })
            }
        ),
        1 => (small_dimensions(3), proptest::option::of(small_dimensions(3)), small_padding())
            .prop_map(|(size, stride, padding)| LayerSpec::MaxPool(PoolSpec { size, stride, padding })),
        1 => (small_dimensions(3), proptest::option::of(small_dimensions(3)), small_padding())
            .prop_map(|(size, stride, padding)| LayerSpec::AvgPool(PoolSpec { size, stride, padding })),
        1 => Just(LayerSpec::GlobalAvgPool(NoSettings {})),
        1 => Just(LayerSpec::Relu(NoSettings {})),
        1 => (0u32..=30).prop_map(|alpha| LayerSpec::LeakyRelu(LeakyReluSpec { alpha: f64::from(alpha) / 100.0 })),
        1 => Just(LayerSpec::Gelu(NoSettings {})),
        1 => Just(LayerSpec::Sigmoid(NoSettings {})),
        1 => Just(LayerSpec::Tanh(NoSettings {})),
        1 => Just(LayerSpec::BatchNorm(BatchNormSpec { momentum: 0.99, epsilon: 1e-3 })),
        1 => (0u32..=90).prop_map(|rate| LayerSpec::Dropout(DropoutSpec { rate: f64::from(rate) / 100.0 })),
        2 => Just(LayerSpec::Flatten(NoSettings {})),
        2 => (1u64..=16, any::<bool>()).prop_map(|(units, use_bias)| LayerSpec::Dense(DenseSpec { units, use_bias })),
    ]
}

/// A size that is sometimes sensible and sometimes absurd.
fn wild_size() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..8,
        2 => (0u32..64).prop_map(|shift| 1u64 << shift),
        1 => Just(u64::MAX),
        1 => Just(u64::MAX - 1),
        1 => Just(i64::MAX as u64),
        1 => any::<u64>(),
    ]
}

fn wild_dimensions() -> impl Strategy<Value = Dimensions> {
    prop_oneof![
        wild_size().prop_map(Dimensions::Square),
        (wild_size(), wild_size())
            .prop_map(|(height, width)| Dimensions::Rectangle([height, width])),
    ]
}

fn wild_padding() -> impl Strategy<Value = Padding> {
    prop_oneof![
        Just(Padding::Named(PaddingMode::Valid)),
        Just(Padding::Named(PaddingMode::Same)),
        wild_size().prop_map(Padding::Pixels),
    ]
}

fn wild_layer() -> impl Strategy<Value = LayerSpec> {
    prop_oneof![
        3 => (wild_size(), wild_dimensions(), wild_dimensions(), wild_padding()).prop_map(
            |(filters, kernel, stride, padding)| {
                LayerSpec::Conv2d(Conv2dSpec {
                    filters,
                    kernel,
                    stride,
                    padding,
                    use_bias: true,
                })
            }
        ),
        2 => (wild_dimensions(), proptest::option::of(wild_dimensions()), wild_padding())
            .prop_map(|(size, stride, padding)| LayerSpec::MaxPool(PoolSpec { size, stride, padding })),
        1 => (wild_dimensions(), proptest::option::of(wild_dimensions()), wild_padding())
            .prop_map(|(size, stride, padding)| LayerSpec::AvgPool(PoolSpec { size, stride, padding })),
        1 => Just(LayerSpec::GlobalAvgPool(NoSettings {})),
        1 => Just(LayerSpec::Relu(NoSettings {})),
        1 => Just(LayerSpec::BatchNorm(BatchNormSpec { momentum: 0.99, epsilon: 1e-3 })),
        2 => Just(LayerSpec::Flatten(NoSettings {})),
        2 => wild_size().prop_map(|units| LayerSpec::Dense(DenseSpec { units, use_bias: true })),
    ]
}

/// The base spec with its model replaced.
fn spec_with_model(input_shape: Vec<u64>, layers: Vec<LayerSpec>, loss: LossKind) -> JobSpec {
    let mut spec = parse_job_spec_toml(&base_spec()).expect("base spec parses");
    spec.model.input_shape = input_shape;
    spec.model.layers = layers.into_iter().map(LayerEntry::from).collect();
    spec.model.loss = loss;
    spec.training.recompute_segment_layers = None;
    spec
}

fn checked_elements(shape: FeatureShape) -> Option<u64> {
    match shape {
        FeatureShape::Image {
            height,
            width,
            channels,
        } => height.checked_mul(width)?.checked_mul(channels),
        FeatureShape::Flat { features } => Some(features),
    }
}

/// Everything a validated graph must satisfy, whatever the layers.
fn check_graph(spec: &JobSpec, graph: &ModelGraph) -> Result<(), TestCaseError> {
    let expected_input = match spec.model.input_shape.as_slice() {
        [features] => flat(*features),
        [height, width, channels] => image(*height, *width, *channels),
        other => {
            return Err(TestCaseError::fail(format!(
                "validated a rank-{} input",
                other.len()
            )));
        }
    };
    prop_assert_eq!(graph.input_shape, expected_input);
    prop_assert_eq!(graph.layers.len(), spec.model.layers.len());
    prop_assert_eq!(graph.loss, spec.model.loss);
    let mut previous = graph.input_shape;
    for (index, (node, entry)) in graph.layers.iter().zip(&spec.model.layers).enumerate() {
        let layer = &entry.layer;
        prop_assert_eq!(node.index, index);
        prop_assert_eq!(node.kind_name, layer.kind_name());
        prop_assert_eq!(
            node.input_shape,
            previous,
            "layer {} input is the previous output",
            index
        );
        let elements = checked_elements(node.output_shape);
        prop_assert!(
            elements.is_some_and(|elements| (1..=MAX_ELEMENTS_PER_SAMPLE).contains(&elements)),
            "layer {} output {:?} must have 1..=2^40 elements",
            index,
            node.output_shape
        );
        for parameter in &node.parameters {
            let product = parameter
                .shape
                .iter()
                .try_fold(1u64, |product, dimension| product.checked_mul(*dimension));
            prop_assert_eq!(product, Some(parameter.elements));
        }
        match (layer, node.input_shape, node.output_shape) {
            (
                LayerSpec::Conv2d(conv),
                FeatureShape::Image {
                    height,
                    width,
                    channels,
                },
                FeatureShape::Image {
                    height: out_height,
                    width: out_width,
                    channels: out_channels,
                },
            ) => {
                let window = window_of(node);
                prop_assert_eq!(out_channels, conv.filters);
                prop_assert_eq!(
                    (window.kernel_height, window.kernel_width),
                    (conv.kernel.height(), conv.kernel.width())
                );
                prop_assert_eq!(
                    (window.stride_height, window.stride_width),
                    (conv.stride.height(), conv.stride.width())
                );
                check_window(&window, conv.padding, height, width, out_height, out_width)?;
                let expected = window.kernel_height * window.kernel_width * channels * conv.filters
                    + if conv.use_bias { conv.filters } else { 0 };
                prop_assert_eq!(node.trainable_parameter_elements(), expected);
            }
            (
                LayerSpec::MaxPool(pool) | LayerSpec::AvgPool(pool),
                FeatureShape::Image {
                    height,
                    width,
                    channels,
                },
                FeatureShape::Image {
                    height: out_height,
                    width: out_width,
                    channels: out_channels,
                },
            ) => {
                let window = window_of(node);
                let stride = pool.stride.unwrap_or(pool.size);
                prop_assert_eq!(out_channels, channels);
                prop_assert_eq!(
                    (window.stride_height, window.stride_width),
                    (stride.height(), stride.width())
                );
                check_window(&window, pool.padding, height, width, out_height, out_width)?;
                prop_assert!(node.parameters.is_empty());
            }
            (LayerSpec::GlobalAvgPool(_), FeatureShape::Image { channels, .. }, output) => {
                prop_assert_eq!(output, flat(channels));
            }
            (LayerSpec::Flatten(_), input, output) => {
                prop_assert_eq!(output, flat(input.elements()));
            }
            (LayerSpec::Dense(dense), FeatureShape::Flat { features }, output) => {
                prop_assert_eq!(output, flat(dense.units));
                prop_assert_eq!(
                    node.trainable_parameter_elements(),
                    features * dense.units + if dense.use_bias { dense.units } else { 0 }
                );
            }
            (
                LayerSpec::Relu(_)
                | LayerSpec::LeakyRelu(_)
                | LayerSpec::Gelu(_)
                | LayerSpec::Sigmoid(_)
                | LayerSpec::Tanh(_)
                | LayerSpec::BatchNorm(_)
                | LayerSpec::Dropout(_),
                input,
                output,
            ) => {
                prop_assert_eq!(output, input);
            }
            (layer, input, output) => {
                return Err(TestCaseError::fail(format!(
                    "{} validated with input {input:?} and output {output:?}",
                    layer.kind_name()
                )));
            }
        }
        previous = node.output_shape;
    }
    prop_assert_eq!(graph.output_shape(), previous);
    Ok(())
}

/// A window's padding and output agree with the padding mode (TensorFlow's rule for "same").
fn check_window(
    window: &WindowGeometry,
    padding: Padding,
    height: u64,
    width: u64,
    out_height: u64,
    out_width: u64,
) -> Result<(), TestCaseError> {
    let padded_height = height + window.padding_top + window.padding_bottom;
    let padded_width = width + window.padding_left + window.padding_right;
    prop_assert!(window.kernel_height <= padded_height && window.kernel_width <= padded_width);
    prop_assert_eq!(
        out_height,
        (padded_height - window.kernel_height) / window.stride_height + 1
    );
    prop_assert_eq!(
        out_width,
        (padded_width - window.kernel_width) / window.stride_width + 1
    );
    match padding {
        Padding::Named(PaddingMode::Valid) => {
            prop_assert_eq!(padding_of(window), (0, 0, 0, 0));
        }
        Padding::Named(PaddingMode::Same) => {
            prop_assert_eq!(out_height, height.div_ceil(window.stride_height));
            prop_assert_eq!(out_width, width.div_ceil(window.stride_width));
            prop_assert!(window.padding_bottom >= window.padding_top);
            prop_assert!(window.padding_bottom - window.padding_top <= 1);
            prop_assert!(window.padding_right >= window.padding_left);
            prop_assert!(window.padding_right - window.padding_left <= 1);
        }
        Padding::Pixels(pixels) => {
            prop_assert_eq!(padding_of(window), (pixels, pixels, pixels, pixels));
        }
    }
    Ok(())
}

/// The index of the layer a `model.layers[N]...` field points at.
fn layer_index(field: &str) -> Option<usize> {
    field
        .strip_prefix("model.layers[")?
        .split(']')
        .next()?
        .parse()
        .ok()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_small_models_validate_or_name_a_model_field(
        height in 1u64..=32,
        width in 1u64..=32,
        channels in 1u64..=4,
        flat_input in proptest::bool::weighted(0.15),
        layers in proptest::collection::vec(small_layer(), 1..8),
        softmax in any::<bool>(),
    ) {
        let input_shape = if flat_input { vec![height * width * channels] } else { vec![height, width, channels] };
        let loss = if softmax { LossKind::SoftmaxCrossEntropy } else { LossKind::Mse };
        let spec = spec_with_model(input_shape, layers, loss);
        match validate_job_spec(spec.clone()) {
            Ok(job) => {
                prop_assert_eq!(&job.spec, &spec);
                check_graph(&spec, &job.graph)?;
                // A valid spec survives both serializations unchanged.
                let json = serde_json::to_string(&spec).expect("serializes");
                prop_assert_eq!(&parse_job_spec_json(&json).expect("parses"), &spec);
                let toml_text = toml::to_string(&spec).expect("serializes");
                prop_assert_eq!(&parse_job_spec_toml(&toml_text).expect("parses"), &spec);
            }
            Err(error) => {
                prop_assert!(error.field.starts_with("model."), "unexpected field in {:?}", error);
                prop_assert!(!error.reason.is_empty());
                // A layer error is about the first bad layer: everything before it is a
                // valid model (under mse, which accepts any output).
                if let Some(index) = layer_index(&error.field) {
                    prop_assert!(index < spec.model.layers.len());
                    if index > 0 {
                        let prefix = spec_with_model(
                            spec.model.input_shape.clone(),
                            spec.model.layers[..index]
                                .iter()
                                .map(|entry| entry.layer.clone())
                                .collect(),
                            LossKind::Mse,
                        );
                        let prefix_result = validate_job_spec(prefix);
                        prop_assert!(prefix_result.is_ok(), "prefix before {:?} fails: {:?}", error, prefix_result);
                    }
                } else {
                    prop_assert!(
                        ["model.loss", "model.layers", "model.input_shape"].contains(&error.field.as_str()),
                        "unexpected field in {:?}",
                        error
                    );
                }
            }
        }
    }

    #[test]
    fn absurd_models_never_panic(
        input_shape in prop_oneof![
            3 => (1u64..=16, 1u64..=16, 1u64..=4).prop_map(|(height, width, channels)| vec![height, width, channels]),
            1 => (1u64..=64).prop_map(|features| vec![features]),
            1 => proptest::collection::vec(wild_size(), 1..=3),
        ],
        layers in proptest::collection::vec(wild_layer(), 1..6),
    ) {
        let input_shape = if input_shape.len() == 2 { vec![input_shape[0]] } else { input_shape };
        let spec = spec_with_model(input_shape, layers, LossKind::Mse);
        // Full u64 values travel through JSON.
        let json = serde_json::to_string(&spec).expect("serializes");
        let parsed = parse_job_spec_json(&json).expect("parses");
        prop_assert_eq!(&parsed, &spec);
        match validate_job_spec(parsed) {
            Ok(job) => check_graph(&spec, &job.graph)?,
            Err(error) => {
                prop_assert!(error.field.starts_with("model."), "unexpected field in {:?}", error);
                prop_assert!(!error.reason.is_empty());
            }
        }
    }
}
