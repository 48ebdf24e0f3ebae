//! Inverted dropout: during training each element is kept with probability `1 − rate`
//! and scaled by `1/(1 − rate)`, so inference is the identity.
//!
//! The mask comes from `Rng::for_stream(seed, stream)`, one draw per element in order, so
//! recomputing a layer during backward (activation recomputation) with the same
//! `(seed, stream)` rebuilds exactly the same mask. The mask is one byte per element:
//! 1 kept, 0 dropped.
//!
//! Dropped elements are *multiplied* by zero rather than overwritten with zero, as in
//! PyTorch and TF, so an fp16 overflow (inf) upstream still shows up as NaN and the loss
//! scaler skips the step.

use crate::rng::Rng;

/// `output = input ⊙ mask / (1 − rate)` with a freshly drawn mask (output and mask
/// overwritten). `rate <= 0` (or NaN) is the identity with an all-ones mask; `rate >= 1`
/// drops everything.
///
/// # Panics
/// If the slices differ in length (internal contract).
pub fn dropout_forward(
    rate: f32,
    seed: u64,
    stream: &[u64],
    input: &[f32],
    output: &mut [f32],
    mask: &mut [u8],
) {
    assert!(
        input.len() == output.len() && input.len() == mask.len(),
        "dropout forward: input, output and mask lengths differ"
    );
    // NaN, like 0, means no dropout.
    if rate.is_nan() || rate <= 0.0 {
        output.copy_from_slice(input);
        mask.fill(1);
        return;
    }
    let mut rng = Rng::for_stream(seed, stream);
    let keep_scale = keep_scale(rate);
    for ((y, kept), &x) in output.iter_mut().zip(mask.iter_mut()).zip(input) {
        // next_f32 is uniform in [0, 1): P(draw >= rate) = 1 − rate.
        let keep = rng.next_f32() >= rate;
        *kept = u8::from(keep);
        *y = x * if keep { keep_scale } else { 0.0 };
    }
}

/// `input_gradient = output_gradient ⊙ mask / (1 − rate)` (overwritten), with the mask
/// that [`dropout_forward`] wrote.
///
/// # Panics
/// If the slices differ in length (internal contract).
pub fn dropout_backward(
    rate: f32,
    mask: &[u8],
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    assert!(
        mask.len() == output_gradient.len() && mask.len() == input_gradient.len(),
        "dropout backward: mask and gradient lengths differ"
    );
    let keep_scale = keep_scale(rate);
    for ((dx, &kept), &dy) in input_gradient.iter_mut().zip(mask).zip(output_gradient) {
        *dx = dy * if kept != 0 { keep_scale } else { 0.0 };
    }
}

/// `1/(1 − rate)` for `0 < rate < 1`; 1 when there is no dropout. With `rate >= 1` nothing
/// is kept, so the scale is never applied; 0 rather than infinity keeps it harmless.
pub(crate) fn keep_scale(rate: f32) -> f32 {
    if rate.is_nan() || rate <= 0.0 {
        1.0
    } else if rate >= 1.0 {
        0.0
    } else {
        1.0 / (1.0 - rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_and_stream_give_the_same_mask() {
        let input: Vec<f32> = (0..1000).map(|index| index as f32).collect();
        let mut first_output = vec![0.0; 1000];
        let mut first_mask = vec![0u8; 1000];
        dropout_forward(
            0.5,
            7,
            &[3, 1, 4],
            &input,
            &mut first_output,
            &mut first_mask,
        );
        let mut second_output = vec![f32::NAN; 1000];
        let mut second_mask = vec![9u8; 1000];
        dropout_forward(
            0.5,
            7,
            &[3, 1, 4],
            &input,
            &mut second_output,
            &mut second_mask,
        );
        assert_eq!(first_mask, second_mask);
        assert_eq!(first_output, second_output);

        let mut other_mask = vec![0u8; 1000];
        dropout_forward(
            0.5,
            7,
            &[3, 1, 5],
            &input,
            &mut second_output,
            &mut other_mask,
        );
        assert_ne!(first_mask, other_mask);
    }

    #[test]
    fn kept_values_are_scaled_and_the_keep_fraction_matches_the_rate() {
        let count = 100_000;
        let input = vec![1.0f32; count];
        let mut output = vec![0.0; count];
        let mut mask = vec![0u8; count];
        dropout_forward(0.3, 11, &[0], &input, &mut output, &mut mask);
        let kept = mask.iter().filter(|&&kept| kept == 1).count();
        let keep_fraction = kept as f64 / count as f64;
        // Binomial standard deviation sqrt(0.7·0.3/100000) ≈ 0.0014; allow 5 of them.
        assert!((keep_fraction - 0.7).abs() < 0.007, "{keep_fraction}");
        for (&y, &kept) in output.iter().zip(&mask) {
            if kept == 1 {
                assert!((y - 1.0 / 0.7).abs() < 1e-6);
            } else {
                assert_eq!(y, 0.0);
            }
        }
        // The expectation is preserved (that is what the scaling is for).
        let mean = output.iter().map(|&y| f64::from(y)).sum::<f64>() / count as f64;
        assert!((mean - 1.0).abs() < 0.01, "{mean}");

        let gradient = vec![2.0f32; count];
        let mut input_gradient = vec![f32::NAN; count];
        dropout_backward(0.3, &mask, &gradient, &mut input_gradient);
        for (&dx, &kept) in input_gradient.iter().zip(&mask) {
            assert_eq!(dx, if kept == 1 { 2.0 / 0.7 } else { 0.0 });
        }
    }

    #[test]
    fn rate_zero_is_the_identity() {
        let input = [1.5, -2.0, f32::INFINITY];
        let mut output = [0.0; 3];
        let mut mask = [0u8; 3];
        dropout_forward(0.0, 1, &[2], &input, &mut output, &mut mask);
        assert_eq!(output, input);
        assert_eq!(mask, [1; 3]);
        let mut input_gradient = [0.0; 3];
        dropout_backward(0.0, &mask, &[1.0, 2.0, 3.0], &mut input_gradient);
        assert_eq!(input_gradient, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn rate_one_drops_everything_and_overflow_still_shows() {
        let mut output = [9.0; 2];
        let mut mask = [9u8; 2];
        dropout_forward(1.0, 1, &[], &[1.0, 2.0], &mut output, &mut mask);
        assert_eq!(output, [0.0; 2]);
        assert_eq!(mask, [0; 2]);

        let mut output = [0.0; 64];
        let mut mask = [0u8; 64];
        dropout_forward(0.5, 1, &[], &[f32::INFINITY; 64], &mut output, &mut mask);
        assert!(output.iter().all(|y| !y.is_finite()));
    }
}
