//! Finite-difference checks of the spatial and dense kernels' backward passes (depthwise
//! convolution and zero padding among them), plus the
//! properties the executor relies on: convolution results do not depend on the workspace
//! it is given, parameter gradients accumulate and input gradients are overwritten.
//!
//! Every check uses the scalar loss `L = sum(output * weights)` with random weights, so
//! `dL/doutput = weights` is what each backward pass receives, and compares the analytic
//! gradient with central differences of `L`.

use carve_core::model::WindowGeometry;
use carve_engine::kernels::conv::{conv2d_backward, conv2d_forward};
use carve_engine::kernels::dense::{dense_backward, dense_forward};
use carve_engine::kernels::depthwise::{
    depthwise_conv2d_backward, depthwise_conv2d_forward, zero_padding_backward,
    zero_padding_forward,
};
use carve_engine::kernels::pool::{
    avg_pool_backward, avg_pool_forward, global_avg_pool_backward, global_avg_pool_forward,
    max_pool_backward, max_pool_forward,
};
use carve_engine::kernels::{ImageShape, WindowedShapes};

mod gradient_support;
use gradient_support::weighted_sum;

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Small deterministic generator (xorshift64*), so the tests need no extra crate.
struct TestRandom(u64);

impl TestRandom {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn vector(&mut self, length: usize) -> Vec<f32> {
        (0..length).map(|_| self.uniform()).collect()
    }

    /// `length` distinct values `0.1` apart, shuffled: no ties, and a perturbation
    /// smaller than 0.05 never changes which one is largest.
    fn distinct_vector(&mut self, length: usize) -> Vec<f32> {
        let mut values: Vec<f32> = (0..length)
            .map(|index| (index as f32 - length as f32 / 2.0) * 0.1)
            .collect();
        for index in (1..length).rev() {
            let other = (self.next_u64() % (index as u64 + 1)) as usize;
            values.swap(index, other);
        }
        values
    }
}

fn image(batch: usize, height: usize, width: usize, channels: usize) -> ImageShape {
    ImageShape {
        batch,
        height,
        width,
        channels,
    }
}

#[derive(Debug, Clone, Copy)]
enum PaddingRule {
    Valid,
    /// TensorFlow "same": output = ceil(input / stride), the odd pixel of padding at the
    /// bottom/right.
    Same,
    /// The same number of pixels on every side.
    Pixels(usize),
}

/// Window shapes built the way carve-core's validation builds them.
fn windowed(
    input: ImageShape,
    output_channels: usize,
    kernel: (usize, usize),
    stride: (usize, usize),
    padding: PaddingRule,
) -> WindowedShapes {
    let padding_for = |input: usize, kernel: usize, stride: usize| match padding {
        PaddingRule::Valid => (0, 0),
        PaddingRule::Pixels(pixels) => (pixels, pixels),
        PaddingRule::Same => {
            let output = input.div_ceil(stride);
            let total = ((output - 1) * stride + kernel).saturating_sub(input);
            (total / 2, total - total / 2)
        }
    };
    let (top, bottom) = padding_for(input.height, kernel.0, stride.0);
    let (left, right) = padding_for(input.width, kernel.1, stride.1);
    let output_height = (input.height + top + bottom - kernel.0) / stride.0 + 1;
    let output_width = (input.width + left + right - kernel.1) / stride.1 + 1;
    WindowedShapes {
        input,
        output: image(input.batch, output_height, output_width, output_channels),
        window: WindowGeometry {
            kernel_height: kernel.0 as u64,
            kernel_width: kernel.1 as u64,
            stride_height: stride.0 as u64,
            stride_width: stride.1 as u64,
            padding_top: top as u64,
            padding_bottom: bottom as u64,
            padding_left: left as u64,
            padding_right: right as u64,
        },
    }
}

/// Compares `analytic` with central differences of `loss` around `point`, element by
/// element.
fn check_against_finite_differences(
    what: &str,
    point: &[f32],
    analytic: &[f32],
    epsilon: f32,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(point.len(), analytic.len(), "{what}: gradient length");
    let mut perturbed = point.to_vec();
    for index in 0..point.len() {
        perturbed[index] = point[index] + epsilon;
        let loss_plus = loss(&perturbed);
        perturbed[index] = point[index] - epsilon;
        let loss_minus = loss(&perturbed);
        perturbed[index] = point[index];
        let numeric = (loss_plus - loss_minus) / (2.0 * f64::from(epsilon));
        let exact = f64::from(analytic[index]);
        let tolerance = 1e-2 * exact.abs().max(numeric.abs()) + 2e-3;
        assert!(
            (exact - numeric).abs() <= tolerance,
            "{what}[{index}]: analytic {exact} vs numeric {numeric}"
        );
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (index, (&got, &want)) in got.iter().zip(want).enumerate() {
        assert!(
            (got - want).abs() <= tolerance * (1.0 + want.abs()),
            "{what}[{index}]: {got} vs {want}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Convolution
// ---------------------------------------------------------------------------------------

struct ConvCase {
    name: &'static str,
    shapes: WindowedShapes,
    use_bias: bool,
}

fn conv_cases(batch: usize) -> Vec<ConvCase> {
    let case =
        |name, input: (usize, usize, usize), filters, kernel, stride, padding, use_bias| ConvCase {
            name,
            shapes: windowed(
                image(batch, input.0, input.1, input.2),
                filters,
                kernel,
                stride,
                padding,
            ),
            use_bias,
        };
    vec![
        case(
            "3x3 stride 2 valid",
            (7, 7, 2),
            3,
            (3, 3),
            (2, 2),
            PaddingRule::Valid,
            true,
        ),
        case(
            "3x3 stride 1 same",
            (5, 6, 3),
            4,
            (3, 3),
            (1, 1),
            PaddingRule::Same,
            false,
        ),
        case(
            "4x4 same (asymmetric)",
            (5, 6, 2),
            2,
            (4, 4),
            (1, 1),
            PaddingRule::Same,
            true,
        ),
        case(
            "2x2 stride 2 same (asymmetric)",
            (5, 7, 2),
            3,
            (2, 2),
            (2, 2),
            PaddingRule::Same,
            false,
        ),
        case(
            "3x3 stride 2 same on even input",
            (6, 6, 1),
            2,
            (3, 3),
            (2, 2),
            PaddingRule::Same,
            true,
        ),
        case(
            "3x1 stride (1,2) same",
            (5, 5, 2),
            3,
            (3, 1),
            (1, 2),
            PaddingRule::Same,
            false,
        ),
        case(
            "2x3 stride (2,1) 1 pixel",
            (6, 5, 3),
            2,
            (2, 3),
            (2, 1),
            PaddingRule::Pixels(1),
            true,
        ),
        case(
            "1x1 pointwise",
            (4, 3, 3),
            5,
            (1, 1),
            (1, 1),
            PaddingRule::Valid,
            true,
        ),
        case(
            "1x1 stride 2",
            (5, 4, 2),
            3,
            (1, 1),
            (2, 2),
            PaddingRule::Valid,
            false,
        ),
        case(
            "kernel as large as the input",
            (3, 4, 2),
            2,
            (3, 4),
            (1, 1),
            PaddingRule::Valid,
            true,
        ),
    ]
}

fn kernel_elements(shapes: &WindowedShapes) -> usize {
    (shapes.window.kernel_height * shapes.window.kernel_width) as usize
        * shapes.input.channels
        * shapes.output.channels
}

/// `workspace_elements_per_sample` as carve-core computes it (0 for pointwise convs).
fn im2col_per_sample(shapes: &WindowedShapes) -> usize {
    let window = shapes.window;
    let pointwise = window.kernel_height == 1
        && window.kernel_width == 1
        && window.stride_height == 1
        && window.stride_width == 1
        && window.padding_top + window.padding_bottom + window.padding_left + window.padding_right
            == 0;
    if pointwise {
        0
    } else {
        shapes.input.channels
            * (window.kernel_height * window.kernel_width) as usize
            * shapes.output.height
            * shapes.output.width
    }
}

/// Straightforward convolution in f64, for checking the forward pass itself.
fn reference_conv(
    shapes: &WindowedShapes,
    input: &[f32],
    kernel: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (input_shape, output_shape, window) = (shapes.input, shapes.output, shapes.window);
    let (kernel_height, kernel_width) =
        (window.kernel_height as usize, window.kernel_width as usize);
    let (channels, filters) = (input_shape.channels, output_shape.channels);
    let mut output = vec![0.0; output_shape.elements()];
    for sample in 0..input_shape.batch {
        for output_row in 0..output_shape.height {
            for output_column in 0..output_shape.width {
                for filter in 0..filters {
                    let mut sum = bias.map_or(0.0, |bias| f64::from(bias[filter]));
                    for kernel_row in 0..kernel_height {
                        for kernel_column in 0..kernel_width {
                            let row = (output_row * window.stride_height as usize + kernel_row)
                                as isize
                                - window.padding_top as isize;
                            let column = (output_column * window.stride_width as usize
                                + kernel_column) as isize
                                - window.padding_left as isize;
                            if row < 0
                                || column < 0
                                || row as usize >= input_shape.height
                                || column as usize >= input_shape.width
                            {
                                continue;
                            }
                            for channel in 0..channels {
                                let input_index = ((sample * input_shape.height + row as usize)
                                    * input_shape.width
                                    + column as usize)
                                    * channels
                                    + channel;
                                let kernel_index = ((kernel_row * kernel_width + kernel_column)
                                    * channels
                                    + channel)
                                    * filters
                                    + filter;
                                sum +=
                                    f64::from(input[input_index]) * f64::from(kernel[kernel_index]);
                            }
                        }
                    }
                    let output_index = ((sample * output_shape.height + output_row)
                        * output_shape.width
                        + output_column)
                        * filters
                        + filter;
                    output[output_index] = sum as f32;
                }
            }
        }
    }
    output
}

struct ConvData {
    input: Vec<f32>,
    kernel: Vec<f32>,
    bias: Option<Vec<f32>>,
    /// `dL/doutput`.
    weights: Vec<f32>,
}

fn conv_data(case: &ConvCase, seed: u64) -> ConvData {
    let mut random = TestRandom::new(seed);
    ConvData {
        input: random.vector(case.shapes.input.elements()),
        kernel: random.vector(kernel_elements(&case.shapes)),
        bias: case
            .use_bias
            .then(|| random.vector(case.shapes.output.channels)),
        weights: random.vector(case.shapes.output.elements()),
    }
}

struct ConvResults {
    output: Vec<f32>,
    input_gradient: Vec<f32>,
    kernel_gradient: Vec<f32>,
    bias_gradient: Vec<f32>,
}

/// Forward and one backward from zeroed parameter gradients, with a workspace of
/// `workspace_length` elements filled with NaN (a kernel that read stale workspace would
/// show it).
fn run_conv(case: &ConvCase, data: &ConvData, workspace_length: usize) -> ConvResults {
    let shapes = &case.shapes;
    let mut workspace = vec![f32::NAN; workspace_length];
    let mut output = vec![f32::NAN; shapes.output.elements()];
    conv2d_forward(
        shapes,
        &data.input,
        &data.kernel,
        data.bias.as_deref(),
        &mut output,
        &mut workspace,
    );
    workspace.fill(f32::NAN);
    let (input_gradient, kernel_gradient, bias_gradient) =
        conv_gradients(case, data, &mut workspace, f32::NAN, 1);
    ConvResults {
        output,
        input_gradient,
        kernel_gradient,
        bias_gradient,
    }
}

/// The (input, kernel, bias) gradients of `passes` backward passes of `data` (its weights
/// as the output gradient), into an input gradient that starts filled with
/// `input_gradient_start` and parameter gradients that start at zero.
fn conv_gradients(
    case: &ConvCase,
    data: &ConvData,
    workspace: &mut [f32],
    input_gradient_start: f32,
    passes: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let shapes = &case.shapes;
    let mut input_gradient = vec![input_gradient_start; shapes.input.elements()];
    let mut kernel_gradient = vec![0.0; data.kernel.len()];
    let mut bias_gradient = vec![0.0; shapes.output.channels];
    for _ in 0..passes {
        conv2d_backward(
            shapes,
            &data.input,
            &data.kernel,
            &data.weights,
            Some(&mut input_gradient),
            &mut kernel_gradient,
            case.use_bias.then_some(&mut bias_gradient[..]),
            workspace,
        );
    }
    (input_gradient, kernel_gradient, bias_gradient)
}

fn conv_loss(
    case: &ConvCase,
    input: &[f32],
    kernel: &[f32],
    bias: Option<&[f32]>,
    weights: &[f32],
) -> f64 {
    let mut output = vec![0.0; case.shapes.output.elements()];
    let mut workspace = vec![0.0; im2col_per_sample(&case.shapes) * case.shapes.input.batch];
    conv2d_forward(
        &case.shapes,
        input,
        kernel,
        bias,
        &mut output,
        &mut workspace,
    );
    weighted_sum(&output, weights)
}

#[test]
fn conv_forward_matches_a_direct_reference() {
    for (seed, case) in conv_cases(2).iter().enumerate() {
        let data = conv_data(case, seed as u64 + 1);
        let expected = reference_conv(
            &case.shapes,
            &data.input,
            &data.kernel,
            data.bias.as_deref(),
        );
        let results = run_conv(case, &data, im2col_per_sample(&case.shapes) * 2);
        assert_close(case.name, &results.output, &expected, 1e-5);
    }
}

#[test]
fn conv_gradients_match_finite_differences() {
    for (seed, case) in conv_cases(2).iter().enumerate() {
        let data = conv_data(case, seed as u64 + 100);
        let results = run_conv(case, &data, im2col_per_sample(&case.shapes) * 2);
        let epsilon = 1e-2;

        check_against_finite_differences(
            &format!("{}: input gradient", case.name),
            &data.input,
            &results.input_gradient,
            epsilon,
            |input| {
                conv_loss(
                    case,
                    input,
                    &data.kernel,
                    data.bias.as_deref(),
                    &data.weights,
                )
            },
        );
        check_against_finite_differences(
            &format!("{}: kernel gradient", case.name),
            &data.kernel,
            &results.kernel_gradient,
            epsilon,
            |kernel| {
                conv_loss(
                    case,
                    &data.input,
                    kernel,
                    data.bias.as_deref(),
                    &data.weights,
                )
            },
        );
        if let Some(bias) = &data.bias {
            check_against_finite_differences(
                &format!("{}: bias gradient", case.name),
                bias,
                &results.bias_gradient,
                epsilon,
                |bias| conv_loss(case, &data.input, &data.kernel, Some(bias), &data.weights),
            );
        } else {
            assert!(results.bias_gradient.iter().all(|&value| value == 0.0));
        }
    }
}

#[test]
fn conv_results_do_not_depend_on_the_workspace() {
    // Batch 3 so that 2-sample chunks do not divide it.
    for (seed, case) in conv_cases(3).iter().enumerate() {
        let data = conv_data(case, seed as u64 + 200);
        let per_sample = im2col_per_sample(&case.shapes);
        let full = run_conv(case, &data, per_sample * 3);
        let row = per_sample / case.shapes.output.height.max(1);
        let workspace_lengths = [
            ("one sample per chunk", per_sample),
            ("two samples per chunk (batch 3)", per_sample * 2),
            ("more than the batch needs", per_sample * 5),
            ("not a whole number of samples", per_sample + row),
            ("one output row", row),
            ("just short of a row (direct path)", row.saturating_sub(1)),
            ("empty (direct path)", 0),
        ];
        for (label, workspace_length) in workspace_lengths {
            let chunked = run_conv(case, &data, workspace_length);
            let what = |part: &str| format!("{}, {label}: {part}", case.name);
            assert_close(&what("output"), &chunked.output, &full.output, 1e-5);
            assert_close(
                &what("input gradient"),
                &chunked.input_gradient,
                &full.input_gradient,
                1e-5,
            );
            assert_close(
                &what("kernel gradient"),
                &chunked.kernel_gradient,
                &full.kernel_gradient,
                1e-5,
            );
            assert_close(
                &what("bias gradient"),
                &chunked.bias_gradient,
                &full.bias_gradient,
                1e-5,
            );
        }
    }
}

#[test]
fn conv_parameter_gradients_accumulate_and_input_gradients_are_overwritten() {
    for (seed, case) in conv_cases(2).iter().enumerate() {
        let data = conv_data(case, seed as u64 + 300);
        let once = run_conv(case, &data, im2col_per_sample(&case.shapes));
        for workspace_length in [0, im2col_per_sample(&case.shapes) * 2] {
            let mut workspace = vec![0.0; workspace_length];
            // Garbage in the input gradient must not leak into the result.
            let (input_gradient, kernel_gradient, bias_gradient) =
                conv_gradients(case, &data, &mut workspace, 1e3, 2);
            let doubled =
                |values: &[f32]| values.iter().map(|value| value * 2.0).collect::<Vec<_>>();
            assert_close(case.name, &input_gradient, &once.input_gradient, 1e-5);
            assert_close(
                case.name,
                &kernel_gradient,
                &doubled(&once.kernel_gradient),
                1e-5,
            );
            assert_close(
                case.name,
                &bias_gradient,
                &doubled(&once.bias_gradient),
                1e-5,
            );

            // Without an input gradient, the parameter gradients are the same.
            let mut kernel_gradient_alone = vec![0.0; data.kernel.len()];
            conv2d_backward(
                &case.shapes,
                &data.input,
                &data.kernel,
                &data.weights,
                None,
                &mut kernel_gradient_alone,
                None,
                &mut workspace,
            );
            assert_close(
                case.name,
                &kernel_gradient_alone,
                &once.kernel_gradient,
                1e-5,
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Pooling
// ---------------------------------------------------------------------------------------

fn pool_cases(batch: usize, channels: usize) -> Vec<(&'static str, WindowedShapes)> {
    use PaddingRule::{Pixels, Same, Valid};
    // (name, input height and width, kernel, stride, padding)
    #[rustfmt::skip]
    let cases = [
        ("2x2 stride 2 valid", (6, 6), (2, 2), (2, 2), Valid),
        ("3x3 stride 2 valid, odd leftover", (8, 7), (3, 3), (2, 2), Valid),
        ("3x3 stride 1 same", (5, 4), (3, 3), (1, 1), Same),
        ("2x2 stride 1 same (asymmetric)", (4, 5), (2, 2), (1, 1), Same),
        ("2x2 stride 2 same on odd input", (5, 5), (2, 2), (2, 2), Same),
        ("3x3 stride 2 same on even input", (6, 4), (3, 3), (2, 2), Same),
        ("3x2 stride (1,2) 1 pixel", (4, 6), (3, 2), (1, 2), Pixels(1)),
    ];
    cases
        .into_iter()
        .map(|(name, (height, width), kernel, stride, padding)| {
            let input = image(batch, height, width, channels);
            (name, windowed(input, channels, kernel, stride, padding))
        })
        .collect()
}

/// Direct pooling in f64 over the positions inside the input: the max, or the mean.
fn reference_pool(shapes: &WindowedShapes, input: &[f32], max: bool) -> Vec<f32> {
    let (input_shape, output_shape, window) = (shapes.input, shapes.output, shapes.window);
    let channels = input_shape.channels;
    let mut output = vec![0.0; output_shape.elements()];
    for sample in 0..input_shape.batch {
        for output_row in 0..output_shape.height {
            for output_column in 0..output_shape.width {
                for channel in 0..channels {
                    let mut values = Vec::new();
                    for kernel_row in 0..window.kernel_height as isize {
                        for kernel_column in 0..window.kernel_width as isize {
                            let row = (output_row as isize) * window.stride_height as isize
                                + kernel_row
                                - window.padding_top as isize;
                            let column = (output_column as isize) * window.stride_width as isize
                                + kernel_column
                                - window.padding_left as isize;
                            if (0..input_shape.height as isize).contains(&row)
                                && (0..input_shape.width as isize).contains(&column)
                            {
                                let index = ((sample * input_shape.height + row as usize)
                                    * input_shape.width
                                    + column as usize)
                                    * channels
                                    + channel;
                                values.push(f64::from(input[index]));
                            }
                        }
                    }
                    let result = if max {
                        values.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                    } else {
                        values.iter().sum::<f64>() / values.len() as f64
                    };
                    let output_index = ((sample * output_shape.height + output_row)
                        * output_shape.width
                        + output_column)
                        * channels
                        + channel;
                    output[output_index] = result as f32;
                }
            }
        }
    }
    output
}

#[derive(Clone, Copy)]
enum Pooling {
    Max,
    Average,
}

/// One pooling kind on every case, case `n` with random numbers from seed
/// `first_seed + n`: the forward pass against [`reference_pool`], the backward pass
/// against finite differences, and the backward pass overwriting its input gradient.
fn check_pooling(pooling: Pooling, cases: Vec<(&'static str, WindowedShapes)>, first_seed: u64) {
    let forward = match pooling {
        Pooling::Max => max_pool_forward,
        Pooling::Average => avg_pool_forward,
    };
    for (seed, (name, shapes)) in cases.into_iter().enumerate() {
        let mut random = TestRandom::new(first_seed + seed as u64);
        let input = match pooling {
            // Distinct values 0.1 apart, perturbed by 0.01: the winner of a window never
            // changes, so central differences are exact.
            Pooling::Max => random.distinct_vector(shapes.input.elements()),
            Pooling::Average => random.vector(shapes.input.elements()),
        };
        let weights = random.vector(shapes.output.elements());
        let backward = |output: &[f32], input_gradient: &mut [f32]| match pooling {
            Pooling::Max => max_pool_backward(&shapes, &input, output, &weights, input_gradient),
            Pooling::Average => avg_pool_backward(&shapes, &weights, input_gradient),
        };

        let mut output = vec![f32::NAN; shapes.output.elements()];
        forward(&shapes, &input, &mut output);
        let reference = reference_pool(&shapes, &input, matches!(pooling, Pooling::Max));
        assert_close(name, &output, &reference, 1e-6);

        let mut input_gradient = vec![f32::NAN; shapes.input.elements()];
        backward(&output, &mut input_gradient);
        check_against_finite_differences(name, &input, &input_gradient, 1e-2, |input| {
            let mut output = vec![0.0; shapes.output.elements()];
            forward(&shapes, input, &mut output);
            weighted_sum(&output, &weights)
        });

        // Overwritten, not added to.
        let mut again = vec![5.0; shapes.input.elements()];
        backward(&output, &mut again);
        assert_eq!(again, input_gradient, "{name}");
    }
}

#[test]
fn max_pool_matches_reference_and_finite_differences() {
    check_pooling(Pooling::Max, pool_cases(2, 3), 400);
}

#[test]
fn avg_pool_matches_reference_and_finite_differences() {
    check_pooling(Pooling::Average, pool_cases(2, 2), 500);
}

#[test]
fn global_avg_pool_matches_finite_differences() {
    let shape = image(3, 4, 5, 2);
    let mut random = TestRandom::new(600);
    let input = random.vector(shape.elements());
    let weights = random.vector(shape.batch * shape.channels);

    let mut output = vec![f32::NAN; shape.batch * shape.channels];
    global_avg_pool_forward(shape, &input, &mut output);
    for sample in 0..shape.batch {
        for channel in 0..shape.channels {
            let mean = input[sample * shape.per_sample()..][..shape.per_sample()]
                .iter()
                .skip(channel)
                .step_by(shape.channels)
                .map(|&value| f64::from(value))
                .sum::<f64>()
                / 20.0;
            let got = f64::from(output[sample * shape.channels + channel]);
            assert!((got - mean).abs() < 1e-6, "mean {got} vs {mean}");
        }
    }

    let mut input_gradient = vec![f32::NAN; shape.elements()];
    global_avg_pool_backward(shape, &weights, &mut input_gradient);
    check_against_finite_differences("global avg pool", &input, &input_gradient, 1e-2, |input| {
        let mut output = vec![0.0; shape.batch * shape.channels];
        global_avg_pool_forward(shape, input, &mut output);
        weighted_sum(&output, &weights)
    });
}

// ---------------------------------------------------------------------------------------
// Dense
// ---------------------------------------------------------------------------------------

#[test]
fn dense_gradients_match_finite_differences_and_accumulate() {
    for (batch, in_features, out_features, use_bias) in [
        (4, 5, 3, true),
        (3, 7, 2, false),
        (1, 1, 1, true),
        (5, 2, 6, true),
    ] {
        let name = format!("dense {batch}x{in_features} -> {out_features}, bias {use_bias}");
        let mut random = TestRandom::new((batch * 100 + in_features * 10 + out_features) as u64);
        let input = random.vector(batch * in_features);
        let kernel = random.vector(in_features * out_features);
        let bias = use_bias.then(|| random.vector(out_features));
        let weights = random.vector(batch * out_features);

        let loss = |input: &[f32], kernel: &[f32], bias: Option<&[f32]>| {
            let mut output = vec![0.0; batch * out_features];
            dense_forward(
                batch,
                in_features,
                out_features,
                input,
                kernel,
                bias,
                &mut output,
            );
            weighted_sum(&output, &weights)
        };

        let mut input_gradient = vec![f32::NAN; input.len()];
        let mut kernel_gradient = vec![0.0; kernel.len()];
        let mut bias_gradient = vec![0.0; out_features];
        // Each call adds to the parameter gradients and rewrites the input gradient.
        let backward =
            |input_gradient: &mut [f32], kernel_gradient: &mut [f32], bias_gradient: &mut [f32]| {
                dense_backward(
                    batch,
                    in_features,
                    out_features,
                    &input,
                    &kernel,
                    &weights,
                    Some(input_gradient),
                    kernel_gradient,
                    use_bias.then_some(bias_gradient),
                )
            };
        backward(
            &mut input_gradient,
            &mut kernel_gradient,
            &mut bias_gradient,
        );
        check_against_finite_differences(&name, &input, &input_gradient, 1e-2, |input| {
            loss(input, &kernel, bias.as_deref())
        });
        check_against_finite_differences(&name, &kernel, &kernel_gradient, 1e-2, |kernel| {
            loss(&input, kernel, bias.as_deref())
        });
        if let Some(bias_values) = &bias {
            check_against_finite_differences(&name, bias_values, &bias_gradient, 1e-2, |bias| {
                loss(&input, &kernel, Some(bias))
            });
        }

        // A second call: parameter gradients double, the input gradient is rewritten.
        let first_kernel_gradient = kernel_gradient.clone();
        let first_bias_gradient = bias_gradient.clone();
        let first_input_gradient = input_gradient.clone();
        input_gradient.fill(1e3);
        backward(
            &mut input_gradient,
            &mut kernel_gradient,
            &mut bias_gradient,
        );
        let doubled = |values: &[f32]| values.iter().map(|value| value * 2.0).collect::<Vec<_>>();
        assert_close(&name, &input_gradient, &first_input_gradient, 1e-6);
        assert_close(
            &name,
            &kernel_gradient,
            &doubled(&first_kernel_gradient),
            1e-6,
        );
        assert_close(&name, &bias_gradient, &doubled(&first_bias_gradient), 1e-6);
    }
}

// ---------------------------------------------------------------------------------------
// Depthwise convolution and zero padding
// ---------------------------------------------------------------------------------------

#[test]
fn depthwise_conv_and_zero_padding_gradients_match_finite_differences() {
    let mut random = TestRandom::new(31);
    for (name, multiplier, kernel, stride, padding) in [
        ("3x3 same", 1, (3, 3), (1, 1), PaddingRule::Same),
        (
            "3x3 stride 2 multiplier 2",
            2,
            (3, 3),
            (2, 2),
            PaddingRule::Same,
        ),
        (
            "2x3 valid multiplier 3",
            3,
            (2, 3),
            (1, 2),
            PaddingRule::Valid,
        ),
    ] {
        let input_shape = image(2, 5, 6, 3);
        let shapes = windowed(input_shape, 3 * multiplier, kernel, stride, padding);
        let input = random.vector(input_shape.elements());
        let kernel_values = random.vector(kernel.0 * kernel.1 * 3 * multiplier);
        let bias = random.vector(3 * multiplier);
        let weights = random.vector(shapes.output.elements());
        let loss = |input: &[f32], kernel_values: &[f32], bias: &[f32]| {
            let mut output = vec![0.0; shapes.output.elements()];
            depthwise_conv2d_forward(
                &shapes,
                multiplier,
                input,
                kernel_values,
                Some(bias),
                &mut output,
            );
            weighted_sum(&output, &weights)
        };
        let mut input_gradient = vec![f32::NAN; input.len()];
        let mut kernel_gradient = vec![0.0; kernel_values.len()];
        let mut bias_gradient = vec![0.0; bias.len()];
        depthwise_conv2d_backward(
            &shapes,
            multiplier,
            &input,
            &kernel_values,
            &weights,
            Some(&mut input_gradient),
            &mut kernel_gradient,
            Some(&mut bias_gradient),
        );
        check_against_finite_differences(
            &format!("{name} input"),
            &input,
            &input_gradient,
            1e-2,
            |point| loss(point, &kernel_values, &bias),
        );
        check_against_finite_differences(
            &format!("{name} kernel"),
            &kernel_values,
            &kernel_gradient,
            1e-2,
            |point| loss(&input, point, &bias),
        );
        check_against_finite_differences(
            &format!("{name} bias"),
            &bias,
            &bias_gradient,
            1e-2,
            |point| loss(&input, &kernel_values, point),
        );
    }
    let (input_shape, output_shape) = (image(2, 3, 4, 2), image(2, 6, 5, 2));
    let input = random.vector(input_shape.elements());
    let weights = random.vector(output_shape.elements());
    let mut input_gradient = vec![f32::NAN; input.len()];
    zero_padding_backward(
        input_shape,
        output_shape,
        1,
        0,
        &weights,
        &mut input_gradient,
    );
    check_against_finite_differences("zero padding", &input, &input_gradient, 1e-2, |point| {
        let mut padded = vec![f32::NAN; output_shape.elements()];
        zero_padding_forward(input_shape, output_shape, 1, 0, point, &mut padded);
        weighted_sum(&padded, &weights)
    });
}
