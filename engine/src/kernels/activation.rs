//! Pointwise activations (relu, leaky relu, gelu, sigmoid, tanh): forward and backward.
//!
//! Backward reads whichever tensor the plan kept, following cuDNN and
//! `LayerNode::backward_reads_output`:
//! - relu, sigmoid and tanh differentiate from their **output** `y` (relu' = [y > 0],
//!   sigmoid' = y·(1 − y), tanh' = 1 − y²), so the executor may free their input;
//! - leaky relu and gelu differentiate from their **input** `x`.
//!
//! Non-finite values propagate (relu of NaN is NaN, as in PyTorch) so that an fp16
//! overflow reaches the gradients and the loss scaler sees it.

use carve_core::model::ActivationKind;

/// The activations whose derivative is a function of their output alone; only these can
/// be differentiated by [`activation_backward_from_output`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutputDifferentiableActivation {
    Relu,
    Relu6,
    Sigmoid,
    Tanh,
}

impl OutputDifferentiableActivation {
    /// `Some` for relu, sigmoid and tanh; `None` for the kinds whose backward needs the input.
    pub fn from_kind(kind: ActivationKind) -> Option<Self> {
        match kind {
            ActivationKind::Relu => Some(OutputDifferentiableActivation::Relu),
            ActivationKind::Relu6 => Some(OutputDifferentiableActivation::Relu6),
            ActivationKind::Sigmoid => Some(OutputDifferentiableActivation::Sigmoid),
            ActivationKind::Tanh => Some(OutputDifferentiableActivation::Tanh),
            ActivationKind::LeakyRelu { .. } | ActivationKind::Gelu => None,
        }
    }
}

/// Whether [`activation_backward`] reads the output (relu, sigmoid, tanh) rather than the
/// input (leaky relu, gelu). Agrees with `LayerNode::backward_reads_output`.
pub fn backward_reads_output(kind: ActivationKind) -> bool {
    OutputDifferentiableActivation::from_kind(kind).is_some()
}

/// `output = activation(input)`, element by element (output overwritten).
///
/// # Panics
/// If the slices differ in length (a bug in the caller, not in the data).
pub fn activation_forward(kind: ActivationKind, input: &[f32], output: &mut [f32]) {
    assert_eq!(
        input.len(),
        output.len(),
        "activation forward: input and output lengths differ"
    );
    // One loop per kind, so the match is not inside the hot loop.
    match kind {
        ActivationKind::Relu => {
            for (y, &x) in output.iter_mut().zip(input) {
                *y = relu(x);
            }
        }
        ActivationKind::Relu6 => {
            for (y, &x) in output.iter_mut().zip(input) {
                *y = relu6(x);
            }
        }
        ActivationKind::LeakyRelu { alpha } => {
            let alpha = alpha as f32;
            for (y, &x) in output.iter_mut().zip(input) {
                *y = leaky_relu(x, alpha);
            }
        }
        ActivationKind::Gelu => {
            for (y, &x) in output.iter_mut().zip(input) {
                *y = gelu(x);
            }
        }
        ActivationKind::Sigmoid => {
            for (y, &x) in output.iter_mut().zip(input) {
                *y = sigmoid(x);
            }
        }
        ActivationKind::Tanh => {
            for (y, &x) in output.iter_mut().zip(input) {
                *y = x.tanh();
            }
        }
    }
}

/// `input_gradient = activation'(·) ⊙ output_gradient` (input gradient overwritten), from
/// whichever saved tensor the plan kept.
///
/// Required: `output` for relu, sigmoid and tanh (when it is `None` but `input` is given,
/// the derivative is recomputed from the input, which gives the same result); `input` for
/// leaky relu and gelu. See [`backward_reads_output`].
///
/// # Panics
/// If the required slice is missing or the lengths differ: both are internal contracts
/// between the plan and the executor, never properties of the data.
pub fn activation_backward(
    kind: ActivationKind,
    input: Option<&[f32]>,
    output: Option<&[f32]>,
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    match (
        OutputDifferentiableActivation::from_kind(kind),
        output,
        input,
    ) {
        (Some(output_kind), Some(output), _) => {
            activation_backward_from_output(output_kind, output, output_gradient, input_gradient)
        }
        (_, _, Some(input)) => {
            activation_backward_from_input(kind, input, output_gradient, input_gradient)
        }
        (Some(_), None, None) => {
            panic!("activation backward: {kind:?} needs its saved output (or input), got neither")
        }
        (None, _, None) => panic!("activation backward: {kind:?} needs its saved input"),
    }
}

/// Backward of relu, sigmoid or tanh from their saved output `y`.
///
/// # Panics
/// If the slices differ in length.
pub fn activation_backward_from_output(
    kind: OutputDifferentiableActivation,
    output: &[f32],
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    assert_lengths(output.len(), output_gradient.len(), input_gradient.len());
    let pairs = input_gradient
        .iter_mut()
        .zip(output.iter().zip(output_gradient));
    match kind {
        OutputDifferentiableActivation::Relu => {
            for (dx, (&y, &dy)) in pairs {
                *dx = if y > 0.0 { dy } else { 0.0 };
            }
        }
        OutputDifferentiableActivation::Relu6 => {
            for (dx, (&y, &dy)) in pairs {
                *dx = if y > 0.0 && y < 6.0 { dy } else { 0.0 };
            }
        }
        OutputDifferentiableActivation::Sigmoid => {
            for (dx, (&y, &dy)) in pairs {
                *dx = dy * y * (1.0 - y);
            }
        }
        OutputDifferentiableActivation::Tanh => {
            for (dx, (&y, &dy)) in pairs {
                *dx = dy * (1.0 - y * y);
            }
        }
    }
}

/// Backward of any activation from its saved input `x` (relu, sigmoid and tanh recompute
/// their output per element).
///
/// # Panics
/// If the slices differ in length.
pub fn activation_backward_from_input(
    kind: ActivationKind,
    input: &[f32],
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    assert_lengths(input.len(), output_gradient.len(), input_gradient.len());
    let pairs = input_gradient
        .iter_mut()
        .zip(input.iter().zip(output_gradient));
    match kind {
        ActivationKind::Relu => {
            for (dx, (&x, &dy)) in pairs {
                *dx = if x > 0.0 { dy } else { 0.0 };
            }
        }
        ActivationKind::Relu6 => {
            for (dx, (&x, &dy)) in pairs {
                *dx = if x > 0.0 && x < 6.0 { dy } else { 0.0 };
            }
        }
        ActivationKind::LeakyRelu { alpha } => {
            let alpha = alpha as f32;
            // TF and PyTorch both take the slope alpha at exactly zero.
            for (dx, (&x, &dy)) in pairs {
                *dx = if x > 0.0 { dy } else { alpha * dy };
            }
        }
        ActivationKind::Gelu => {
            for (dx, (&x, &dy)) in pairs {
                *dx = dy * gelu_derivative(x);
            }
        }
        ActivationKind::Sigmoid => {
            for (dx, (&x, &dy)) in pairs {
                let y = sigmoid(x);
                *dx = dy * y * (1.0 - y);
            }
        }
        ActivationKind::Tanh => {
            for (dx, (&x, &dy)) in pairs {
                let y = x.tanh();
                *dx = dy * (1.0 - y * y);
            }
        }
    }
}

fn assert_lengths(saved: usize, output_gradient: usize, input_gradient: usize) {
    assert!(
        saved == output_gradient && saved == input_gradient,
        "activation backward: lengths differ (saved {saved}, output gradient \
         {output_gradient}, input gradient {input_gradient})"
    );
}

/// `max(x, 0)`, written so that NaN stays NaN (`f32::max` would turn it into 0).
fn relu(x: f32) -> f32 {
    if x < 0.0 { 0.0 } else { x }
}

/// NaN passes through, as relu's does.
fn relu6(x: f32) -> f32 {
    let clipped = relu(x);
    if clipped > 6.0 { 6.0 } else { clipped }
}

fn leaky_relu(x: f32, alpha: f32) -> f32 {
    if x > 0.0 { x } else { alpha * x }
}

/// Logistic sigmoid without overflow: `exp` is only ever taken of a non-positive number.
fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let exp_x = x.exp();
        exp_x / (1.0 + exp_x)
    }
}

/// Exact GELU, `x·Φ(x)` with Φ the standard normal CDF (Keras' default, `approximate=False`).
/// Computed in f64 so the only error is the CDF's (relative 1.2e-7) and the final rounding.
pub fn gelu(x: f32) -> f32 {
    let x = f64::from(x);
    (x * standard_normal_cdf(x)) as f32
}

/// d/dx of `x·Φ(x)` = `Φ(x) + x·φ(x)`, with φ the standard normal density.
pub fn gelu_derivative(x: f32) -> f32 {
    let x = f64::from(x);
    let density = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    (standard_normal_cdf(x) + x * density) as f32
}

/// Φ(x) = erfc(−x/√2)/2. Going through erfc rather than erf keeps the *relative* accuracy
/// in the negative tail, where Φ is tiny and `1 + erf` would cancel.
fn standard_normal_cdf(x: f64) -> f64 {
    0.5 * complementary_error_function(-x / std::f64::consts::SQRT_2)
}

/// erfc(z) by the Chebyshev fit of Numerical Recipes (`erfcc`): fractional error below
/// 1.2e-7 everywhere, which is below f32's resolution after the final rounding.
fn complementary_error_function(z: f64) -> f64 {
    let absolute = z.abs();
    let t = 1.0 / (1.0 + 0.5 * absolute);
    let polynomial = -1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let tail = t * (-absolute * absolute + polynomial).exp();
    if z >= 0.0 { tail } else { 2.0 - tail }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forward(kind: ActivationKind, inputs: &[f32]) -> Vec<f32> {
        let mut output = vec![f32::NAN; inputs.len()];
        activation_forward(kind, inputs, &mut output);
        output
    }

    fn assert_close(actual: &[f32], expected: &[f64], tolerance: f64) {
        assert_eq!(actual.len(), expected.len());
        for (index, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            assert!(
                (f64::from(a) - e).abs() <= tolerance,
                "element {index}: {a} vs expected {e}"
            );
        }
    }

    #[test]
    fn relu_and_leaky_relu_at_a_few_points() {
        let inputs = [-2.0, -0.5, 0.0, 0.5, 3.0];
        assert_eq!(
            forward(ActivationKind::Relu, &inputs),
            [0.0, 0.0, 0.0, 0.5, 3.0]
        );
        assert_eq!(
            forward(ActivationKind::LeakyRelu { alpha: 0.25 }, &inputs),
            [-0.5, -0.125, 0.0, 0.5, 3.0]
        );
        assert!(forward(ActivationKind::Relu, &[f32::NAN])[0].is_nan());

        let mut gradient = vec![f32::NAN; 5];
        let upstream = [1.0, 2.0, 3.0, 4.0, 5.0];
        let relu_output = forward(ActivationKind::Relu, &inputs);
        activation_backward(
            ActivationKind::Relu,
            None,
            Some(&relu_output),
            &upstream,
            &mut gradient,
        );
        assert_eq!(gradient, [0.0, 0.0, 0.0, 4.0, 5.0]);
        activation_backward(
            ActivationKind::LeakyRelu { alpha: 0.25 },
            Some(&inputs),
            None,
            &upstream,
            &mut gradient,
        );
        assert_eq!(gradient, [0.25, 0.5, 0.75, 4.0, 5.0]);
    }

    #[test]
    fn sigmoid_and_tanh_at_a_few_points_and_far_out() {
        let inputs = [-100.0, -1.0, 0.0, 1.0, 100.0];
        let sigmoid_output = forward(ActivationKind::Sigmoid, &inputs);
        assert_close(
            &sigmoid_output,
            &[0.0, 0.268_941_421_369_995, 0.5, 0.731_058_578_630_005, 1.0],
            1e-7,
        );
        let tanh_output = forward(ActivationKind::Tanh, &inputs);
        assert_close(
            &tanh_output,
            &[
                -1.0,
                -0.761_594_155_955_765,
                0.0,
                0.761_594_155_955_765,
                1.0,
            ],
            1e-7,
        );

        let upstream = [1.0; 5];
        let mut gradient = vec![f32::NAN; 5];
        activation_backward(
            ActivationKind::Sigmoid,
            None,
            Some(&sigmoid_output),
            &upstream,
            &mut gradient,
        );
        // σ'(1) = σ(1)(1 − σ(1)) = 0.196611933...
        assert_close(
            &gradient,
            &[0.0, 0.196_611_933_241_482, 0.25, 0.196_611_933_241_482, 0.0],
            1e-7,
        );
        activation_backward(
            ActivationKind::Tanh,
            None,
            Some(&tanh_output),
            &upstream,
            &mut gradient,
        );
        // tanh'(1) = 1 − tanh²(1) = 0.419974341...
        assert_close(
            &gradient,
            &[0.0, 0.419_974_341_614_026, 1.0, 0.419_974_341_614_026, 0.0],
            1e-6,
        );
    }

    #[test]
    fn gelu_is_the_exact_erf_form() {
        // x·Φ(x): Φ(1) = 0.841344746068543, Φ(−1) = 0.158655253931457,
        // Φ(2) = 0.977249868051821, Φ(−3) = 0.001349898031630.
        let output = forward(ActivationKind::Gelu, &[1.0, -1.0, 2.0, -3.0, 0.0, 0.5]);
        assert_close(
            &output,
            &[
                0.841_344_746_068_543,
                -0.158_655_253_931_457,
                1.954_499_736_103_642,
                -0.004_049_694_094_89,
                0.0,
                0.5 * 0.691_462_461_274_013,
            ],
            3e-7,
        );
        // The negative tail keeps its relative accuracy: gelu(−6) = −6·Φ(−6) = −5.92e-9.
        let far = f64::from(forward(ActivationKind::Gelu, &[-6.0])[0]);
        let expected = -6.0 * 9.865_876_450_376_98e-10;
        assert!(((far - expected) / expected).abs() < 1e-6, "{far}");

        // gelu'(x) = Φ(x) + x·φ(x); gelu'(1) = 0.841344746 + 0.241970725 = 1.083315471.
        let mut gradient = vec![f32::NAN; 3];
        activation_backward(
            ActivationKind::Gelu,
            Some(&[1.0, 0.0, -1.0]),
            None,
            &[1.0, 1.0, 2.0],
            &mut gradient,
        );
        assert_close(
            &gradient,
            &[
                1.083_315_470_9,
                0.5,
                2.0 * (0.158_655_253_9 - 0.241_970_724_5),
            ],
            3e-7,
        );
    }

    #[test]
    fn backward_from_input_agrees_with_backward_from_output() {
        let inputs = [-1.5, -0.25, 0.3, 2.0];
        let upstream = [0.5, -1.0, 2.0, 1.5];
        for (kind, output_kind) in [
            (ActivationKind::Relu, OutputDifferentiableActivation::Relu),
            (
                ActivationKind::Sigmoid,
                OutputDifferentiableActivation::Sigmoid,
            ),
            (ActivationKind::Tanh, OutputDifferentiableActivation::Tanh),
        ] {
            assert!(backward_reads_output(kind));
            let output = forward(kind, &inputs);
            let mut from_output = vec![0.0; 4];
            let mut from_input = vec![0.0; 4];
            activation_backward_from_output(output_kind, &output, &upstream, &mut from_output);
            activation_backward(kind, Some(&inputs), None, &upstream, &mut from_input);
            assert_close(
                &from_input,
                &from_output
                    .iter()
                    .map(|&v| f64::from(v))
                    .collect::<Vec<_>>(),
                1e-6,
            );
        }
        assert!(!backward_reads_output(ActivationKind::Gelu));
        assert!(!backward_reads_output(ActivationKind::LeakyRelu {
            alpha: 0.3
        }));
    }

    #[test]
    fn complementary_error_function_matches_reference_values() {
        for (z, expected) in [
            (0.0, 1.0),
            (0.5, 0.479_500_122_186_953),
            (1.0, 0.157_299_207_050_285),
            (2.0, 0.004_677_734_981_047),
            (-1.0, 1.842_700_792_949_715),
            (4.0, 1.541_725_790_028_002e-8),
        ] {
            let actual = complementary_error_function(z);
            assert!(
                ((actual - expected) / expected).abs() < 1.2e-7,
                "erfc({z}) = {actual}, expected {expected}"
            );
        }
    }
}
