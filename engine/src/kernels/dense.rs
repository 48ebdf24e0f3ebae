//! Fully connected (dense) layer, forward and backward: one GEMM each way.
//!
//! Shapes: input `[batch, in_features]`, kernel `[in_features, out_features]`, bias
//! `[out_features]`, output `[batch, out_features]`, all row-major.

use super::gemm::gemm;

fn check_lengths(
    batch: usize,
    in_features: usize,
    out_features: usize,
    input: &[f32],
    kernel: &[f32],
    output_like: &[f32],
    bias_like: Option<&[f32]>,
) {
    assert_eq!(input.len(), batch * in_features, "dense: input length");
    assert_eq!(
        kernel.len(),
        in_features * out_features,
        "dense: kernel length"
    );
    assert_eq!(
        output_like.len(),
        batch * out_features,
        "dense: output length"
    );
    if let Some(bias) = bias_like {
        assert_eq!(bias.len(), out_features, "dense: bias length");
    }
}

/// `output = input * kernel + bias` (overwritten).
///
/// # Panics
///
/// When a slice's length does not match the dimensions (a caller bug).
pub fn dense_forward(
    batch: usize,
    in_features: usize,
    out_features: usize,
    input: &[f32],
    kernel: &[f32],
    bias: Option<&[f32]>,
    output: &mut [f32],
) {
    check_lengths(
        batch,
        in_features,
        out_features,
        input,
        kernel,
        output,
        bias,
    );
    // Start from the bias and let the GEMM accumulate onto it, saving a second pass.
    let beta = match bias {
        Some(bias) if out_features > 0 => {
            for row in output.chunks_exact_mut(out_features) {
                row.copy_from_slice(bias);
            }
            1.0
        }
        _ => 0.0,
    };
    gemm(
        batch,
        in_features,
        out_features,
        input,
        false,
        kernel,
        false,
        output,
        1.0,
        beta,
    );
}

/// Dense backward:
/// - `kernel_gradient += input^T * output_gradient` (added to);
/// - `bias_gradient += output_gradient` summed over the batch (added to);
/// - `input_gradient = output_gradient * kernel^T` (overwritten), skipped when `None`.
///
/// # Panics
///
/// When a slice's length does not match the dimensions (a caller bug).
#[allow(clippy::too_many_arguments)]
pub fn dense_backward(
    batch: usize,
    in_features: usize,
    out_features: usize,
    input: &[f32],
    kernel: &[f32],
    output_gradient: &[f32],
    input_gradient: Option<&mut [f32]>,
    kernel_gradient: &mut [f32],
    bias_gradient: Option<&mut [f32]>,
) {
    check_lengths(
        batch,
        in_features,
        out_features,
        input,
        kernel,
        output_gradient,
        bias_gradient.as_deref(),
    );
    gemm(
        in_features,
        batch,
        out_features,
        input,
        true,
        output_gradient,
        false,
        kernel_gradient,
        1.0,
        1.0,
    );
    if let Some(bias_gradient) = bias_gradient
        && out_features > 0
    {
        for row in output_gradient.chunks_exact(out_features) {
            for (gradient, contribution) in bias_gradient.iter_mut().zip(row) {
                *gradient += contribution;
            }
        }
    }
    if let Some(input_gradient) = input_gradient {
        gemm(
            batch,
            out_features,
            in_features,
            output_gradient,
            false,
            kernel,
            true,
            input_gradient,
            1.0,
            0.0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_samples_three_inputs_two_outputs() {
        let input = [1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
        // kernel[i][o]
        let kernel = [1.0, 0.0, 0.0, 1.0, 1.0, -1.0];
        let bias = [0.5, -0.5];
        let mut output = [f32::NAN; 4];
        dense_forward(2, 3, 2, &input, &kernel, Some(&bias), &mut output);
        assert_eq!(output, [4.5, -1.5, 0.5, -1.5]);

        let output_gradient = [1.0, 2.0, 3.0, 4.0];
        let mut input_gradient = [f32::NAN; 6];
        let mut kernel_gradient = [1.0; 6];
        let mut bias_gradient = [1.0, 1.0];
        dense_backward(
            2,
            3,
            2,
            &input,
            &kernel,
            &output_gradient,
            Some(&mut input_gradient),
            &mut kernel_gradient,
            Some(&mut bias_gradient),
        );
        // dX = dY * K^T: rows (1*1 + 2*0, 1*0 + 2*1, 1*1 - 2*1), (3, 4, -1).
        assert_eq!(input_gradient, [1.0, 2.0, -1.0, 3.0, 4.0, -1.0]);
        // dK[i][o] = sum_n x[n][i] dY[n][o], plus the 1 already there.
        assert_eq!(
            kernel_gradient,
            [
                1.0 + 1.0 - 3.0,
                1.0 + 2.0 - 4.0,
                1.0 + 2.0,
                1.0 + 4.0,
                1.0 + 3.0 + 3.0,
                1.0 + 6.0 + 4.0
            ]
        );
        assert_eq!(bias_gradient, [1.0 + 4.0, 1.0 + 6.0]);
    }

    #[test]
    fn without_bias_or_input_gradient() {
        let mut output = [0.0; 1];
        dense_forward(1, 2, 1, &[2.0, 3.0], &[4.0, 5.0], None, &mut output);
        assert_eq!(output, [23.0]);
        let mut kernel_gradient = [0.0; 2];
        dense_backward(
            1,
            2,
            1,
            &[2.0, 3.0],
            &[4.0, 5.0],
            &[2.0],
            None,
            &mut kernel_gradient,
            None,
        );
        assert_eq!(kernel_gradient, [4.0, 6.0]);
    }
}
