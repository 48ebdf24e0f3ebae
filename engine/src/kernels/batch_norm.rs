//! Batch normalization: training forward (batch statistics, running-statistics update),
//! backward, and inference forward (running statistics).
//!
//! Channels are the last dimension both for NHWC images and for flat `(batch, features)`
//! tensors, so one implementation serves both: the input is `rows × channels` with
//! `rows = elements / channels` (N·H·W for images, N for flat), and statistics are taken
//! per channel over the rows.
//!
//! Conventions (Keras / TF, which PyTorch agrees with except for the momentum's sense):
//! - training normalizes with the **biased** batch variance;
//! - the running variance is updated with the **unbiased** one (`rows / (rows − 1)`);
//! - `running = momentum·running + (1 − momentum)·batch`.
//!
//! Sums are accumulated in f64: a channel of a large image batch has hundreds of thousands
//! of rows, and an f32 sum of that many terms loses digits the variance needs.

/// The shape and hyper-parameters of one batch-norm layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchNormSettings {
    /// The size of the last dimension (image channels or features).
    pub channels: usize,
    /// Added to the variance before the square root.
    pub epsilon: f32,
    /// Keras' momentum: the weight of the old running statistic.
    pub momentum: f32,
}

impl BatchNormSettings {
    /// The number of rows (`elements / channels`) statistics are taken over.
    ///
    /// # Panics
    /// If `elements` is not a multiple of `channels` (a shape bug in the caller).
    pub fn rows(&self, elements: usize) -> usize {
        if elements == 0 {
            return 0;
        }
        assert!(
            self.channels > 0 && elements.is_multiple_of(self.channels),
            "batch norm: {elements} elements are not a whole number of rows of {} channels",
            self.channels
        );
        elements / self.channels
    }
}

/// Training-mode forward: normalizes with this batch's statistics, writes
/// `saved_statistics = [mean; channels] ++ [1/sqrt(biased variance + ε); channels]` for
/// backward, and, when `running` is `Some((running_mean, running_variance))`, updates the
/// running statistics by the Keras rule. Pass `None` when recomputing a layer during
/// backward, so the running statistics are not updated twice for one batch.
///
/// An empty batch writes mean 0 and inverse std `1/sqrt(ε)` and leaves running statistics
/// alone.
///
/// # Panics
/// If slice lengths do not match `settings.channels` (internal contract).
pub fn batch_norm_forward_training(
    settings: &BatchNormSettings,
    input: &[f32],
    gamma: &[f32],
    beta: &[f32],
    output: &mut [f32],
    saved_statistics: &mut [f32],
    running: Option<(&mut [f32], &mut [f32])>,
) {
    let channels = settings.channels;
    let rows = settings.rows(input.len());
    assert_eq!(output.len(), input.len(), "batch norm: output length");
    assert_eq!(gamma.len(), channels, "batch norm: gamma length");
    assert_eq!(beta.len(), channels, "batch norm: beta length");
    assert_eq!(
        saved_statistics.len(),
        2 * channels,
        "batch norm: saved statistics hold mean and inverse std per channel"
    );

    // Two passes (mean, then squared deviations) rather than E[x²] − E[x]², which cancels
    // catastrophically when the mean is large compared with the spread.
    let mut means = vec![0.0f64; channels];
    for row in input.chunks_exact(channels.max(1)) {
        for (sum, &x) in means.iter_mut().zip(row) {
            *sum += f64::from(x);
        }
    }
    let row_count = rows.max(1) as f64;
    for mean in &mut means {
        *mean /= row_count;
    }
    let mut squared_deviations = vec![0.0f64; channels];
    for row in input.chunks_exact(channels.max(1)) {
        for ((sum, &x), &mean) in squared_deviations.iter_mut().zip(row).zip(&means) {
            let deviation = f64::from(x) - mean;
            *sum += deviation * deviation;
        }
    }

    let (saved_means, saved_inverse_stds) = saved_statistics.split_at_mut(channels);
    let epsilon = f64::from(settings.epsilon);
    for channel in 0..channels {
        let biased_variance = squared_deviations[channel] / row_count;
        saved_means[channel] = means[channel] as f32;
        saved_inverse_stds[channel] = (1.0 / (biased_variance + epsilon).sqrt()) as f32;
    }

    normalize(
        input,
        output,
        channels,
        saved_means,
        saved_inverse_stds,
        gamma,
        beta,
    );

    if let Some((running_mean, running_variance)) = running {
        check_running_lengths(running_mean, running_variance, channels);
        if rows == 0 {
            return;
        }
        // Bessel's correction, as TF and PyTorch apply to the running variance; a single
        // row has no unbiased estimate, so it contributes its (zero) biased variance.
        let variance_divisor = if rows > 1 { rows - 1 } else { 1 } as f64;
        let momentum = f64::from(settings.momentum);
        for channel in 0..channels {
            let unbiased_variance = squared_deviations[channel] / variance_divisor;
            running_mean[channel] = (momentum * f64::from(running_mean[channel])
                + (1.0 - momentum) * means[channel]) as f32;
            running_variance[channel] = (momentum * f64::from(running_variance[channel])
                + (1.0 - momentum) * unbiased_variance)
                as f32;
        }
    }
}

/// Backward of the training forward. With `x̂ = (x − mean)·inv_std`:
/// - `beta_gradient += Σ dy`, `gamma_gradient += Σ dy·x̂` (parameter gradients accumulate);
/// - `input_gradient = γ·inv_std·(dy − mean(dy) − x̂·mean(dy·x̂))` (overwritten), the
///   exact gradient through the batch mean and variance.
///
/// `saved_statistics` is what [`batch_norm_forward_training`] wrote for this input.
///
/// # Panics
/// If slice lengths do not match `settings.channels` (internal contract).
#[allow(clippy::too_many_arguments)]
pub fn batch_norm_backward(
    settings: &BatchNormSettings,
    input: &[f32],
    gamma: &[f32],
    saved_statistics: &[f32],
    output_gradient: &[f32],
    input_gradient: &mut [f32],
    gamma_gradient: &mut [f32],
    beta_gradient: &mut [f32],
) {
    let channels = settings.channels;
    let rows = settings.rows(input.len());
    assert_eq!(
        output_gradient.len(),
        input.len(),
        "batch norm: output gradient length"
    );
    assert_eq!(
        input_gradient.len(),
        input.len(),
        "batch norm: input gradient length"
    );
    assert_eq!(gamma.len(), channels, "batch norm: gamma length");
    assert_eq!(
        gamma_gradient.len(),
        channels,
        "batch norm: gamma gradient length"
    );
    assert_eq!(
        beta_gradient.len(),
        channels,
        "batch norm: beta gradient length"
    );
    assert_eq!(
        saved_statistics.len(),
        2 * channels,
        "batch norm: saved statistics length"
    );
    if rows == 0 {
        return;
    }
    let (means, inverse_stds) = saved_statistics.split_at(channels);

    let mut sum_gradient = vec![0.0f64; channels];
    let mut sum_gradient_times_normalized = vec![0.0f64; channels];
    for (input_row, gradient_row) in input
        .chunks_exact(channels)
        .zip(output_gradient.chunks_exact(channels))
    {
        for channel in 0..channels {
            let normalized = (input_row[channel] - means[channel]) * inverse_stds[channel];
            let gradient = f64::from(gradient_row[channel]);
            sum_gradient[channel] += gradient;
            sum_gradient_times_normalized[channel] += gradient * f64::from(normalized);
        }
    }

    let row_count = rows as f64;
    let mean_gradient: Vec<f32> = sum_gradient
        .iter()
        .map(|&sum| (sum / row_count) as f32)
        .collect();
    let mean_gradient_times_normalized: Vec<f32> = sum_gradient_times_normalized
        .iter()
        .map(|&sum| (sum / row_count) as f32)
        .collect();
    let coefficients: Vec<f32> = gamma
        .iter()
        .zip(inverse_stds)
        .map(|(&g, &inverse_std)| g * inverse_std)
        .collect();

    for ((input_row, gradient_row), input_gradient_row) in input
        .chunks_exact(channels)
        .zip(output_gradient.chunks_exact(channels))
        .zip(input_gradient.chunks_exact_mut(channels))
    {
        for channel in 0..channels {
            let normalized = (input_row[channel] - means[channel]) * inverse_stds[channel];
            input_gradient_row[channel] = coefficients[channel]
                * (gradient_row[channel]
                    - mean_gradient[channel]
                    - normalized * mean_gradient_times_normalized[channel]);
        }
    }

    for channel in 0..channels {
        gamma_gradient[channel] += sum_gradient_times_normalized[channel] as f32;
        beta_gradient[channel] += sum_gradient[channel] as f32;
    }
}

/// Inference forward: `γ·(x − running_mean)/sqrt(running_variance + ε) + β`.
///
/// # Panics
/// If slice lengths do not match `settings.channels` (internal contract).
pub fn batch_norm_forward_inference(
    settings: &BatchNormSettings,
    input: &[f32],
    gamma: &[f32],
    beta: &[f32],
    running_mean: &[f32],
    running_variance: &[f32],
    output: &mut [f32],
) {
    let channels = settings.channels;
    settings.rows(input.len());
    assert_eq!(output.len(), input.len(), "batch norm: output length");
    assert_eq!(gamma.len(), channels, "batch norm: gamma length");
    assert_eq!(beta.len(), channels, "batch norm: beta length");
    check_running_lengths(running_mean, running_variance, channels);
    let epsilon = f64::from(settings.epsilon);
    let inverse_stds: Vec<f32> = running_variance
        .iter()
        .map(|&variance| (1.0 / (f64::from(variance) + epsilon).sqrt()) as f32)
        .collect();
    normalize(
        input,
        output,
        channels,
        running_mean,
        &inverse_stds,
        gamma,
        beta,
    );
}

/// `y = γ·((x − mean)·inv_std) + β` per channel. Subtracting the mean first (rather than
/// folding everything into one scale and shift) keeps the precision when the mean is large.
fn normalize(
    input: &[f32],
    output: &mut [f32],
    channels: usize,
    means: &[f32],
    inverse_stds: &[f32],
    gamma: &[f32],
    beta: &[f32],
) {
    if channels == 0 {
        return;
    }
    for (input_row, output_row) in input
        .chunks_exact(channels)
        .zip(output.chunks_exact_mut(channels))
    {
        for channel in 0..channels {
            output_row[channel] = gamma[channel]
                * ((input_row[channel] - means[channel]) * inverse_stds[channel])
                + beta[channel];
        }
    }
}

/// Panics unless the running statistics have one value per channel (a caller bug).
fn check_running_lengths(running_mean: &[f32], running_variance: &[f32], channels: usize) {
    assert_eq!(
        running_mean.len(),
        channels,
        "batch norm: running mean length"
    );
    assert_eq!(
        running_variance.len(),
        channels,
        "batch norm: running variance length"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(channels: usize) -> BatchNormSettings {
        BatchNormSettings {
            channels,
            epsilon: 1e-3,
            momentum: 0.99,
        }
    }

    #[test]
    fn forward_training_normalizes_per_channel_and_updates_running_statistics() {
        // rows = 4, channels = 2. Channel 0: 1, 2, 3, 4 (mean 2.5, biased variance 1.25,
        // unbiased 5/3); channel 1: 10 everywhere (mean 10, variance 0).
        let input = [1.0, 10.0, 2.0, 10.0, 3.0, 10.0, 4.0, 10.0];
        let gamma = [2.0, 1.0];
        let beta = [0.5, -1.0];
        let mut output = [0.0; 8];
        let mut saved = [0.0; 4];
        let mut running_mean = [1.0, 0.0];
        let mut running_variance = [1.0, 1.0];
        batch_norm_forward_training(
            &settings(2),
            &input,
            &gamma,
            &beta,
            &mut output,
            &mut saved,
            Some((&mut running_mean, &mut running_variance)),
        );
        let inverse_std_0 = 1.0 / (1.25f64 + 1e-3).sqrt();
        let inverse_std_1 = 1.0 / 1e-3f64.sqrt();
        assert!((f64::from(saved[0]) - 2.5).abs() < 1e-6);
        assert!((f64::from(saved[1]) - 10.0).abs() < 1e-6);
        assert!((f64::from(saved[2]) - inverse_std_0).abs() < 1e-6);
        assert!((f64::from(saved[3]) - inverse_std_1).abs() < 1e-3);
        for row in 0..4 {
            let expected = 2.0 * ((row as f64 + 1.0 - 2.5) * inverse_std_0) + 0.5;
            assert!((f64::from(output[2 * row]) - expected).abs() < 1e-5);
            assert!((output[2 * row + 1] - -1.0).abs() < 1e-6);
        }
        // Keras: running = 0.99·running + 0.01·batch, with the unbiased variance.
        assert!((f64::from(running_mean[0]) - (0.99 + 0.01 * 2.5)).abs() < 1e-6);
        assert!((f64::from(running_mean[1]) - 0.1).abs() < 1e-6);
        assert!((f64::from(running_variance[0]) - (0.99 + 0.01 * 5.0 / 3.0)).abs() < 1e-6);
        assert!((f64::from(running_variance[1]) - 0.99).abs() < 1e-6);
    }

    #[test]
    fn inference_uses_the_running_statistics() {
        let input = [3.0, -1.0];
        let mut output = [0.0; 2];
        batch_norm_forward_inference(
            &settings(1),
            &input,
            &[2.0],
            &[1.0],
            &[1.0],
            &[4.0 - 1e-3],
            &mut output,
        );
        // (x − 1)/2·2 + 1
        assert!((output[0] - 3.0).abs() < 1e-5);
        assert!((output[1] - -1.0).abs() < 1e-5);
    }

    #[test]
    fn a_single_row_updates_running_variance_with_the_biased_zero() {
        let mut output = [0.0; 3];
        let mut saved = [0.0; 6];
        let mut running_mean = [0.0; 3];
        let mut running_variance = [1.0; 3];
        let mut settings = settings(3);
        settings.momentum = 0.5;
        batch_norm_forward_training(
            &settings,
            &[2.0, 4.0, 6.0],
            &[1.0; 3],
            &[0.0; 3],
            &mut output,
            &mut saved,
            Some((&mut running_mean, &mut running_variance)),
        );
        assert_eq!(output, [0.0; 3]);
        assert_eq!(running_mean, [1.0, 2.0, 3.0]);
        assert_eq!(running_variance, [0.5; 3]);
    }

    #[test]
    fn backward_matches_a_hand_computed_case() {
        // One channel, x = [0, 1, 2], ε = 0: mean 1, biased variance 2/3,
        // inv_std = a = sqrt(3/2), x̂ = [−a, 0, a].
        let settings = BatchNormSettings {
            channels: 1,
            epsilon: 0.0,
            momentum: 0.9,
        };
        let input = [0.0, 1.0, 2.0];
        let mut output = [0.0; 3];
        let mut saved = [0.0; 2];
        batch_norm_forward_training(
            &settings,
            &input,
            &[2.0],
            &[0.0],
            &mut output,
            &mut saved,
            None,
        );
        let a = 1.5f64.sqrt();
        let inverse_std = a;
        // dy = [1, 0, 0]: mean(dy) = 1/3, mean(dy·x̂) = −a/3.
        // dx = 2·inv_std·(dy − 1/3 + x̂·a/3) = 2a·[1 − 1/3 − 1/2, −1/3, −1/3 + 1/2].
        let mut input_gradient = [f32::NAN; 3];
        let mut gamma_gradient = [10.0];
        let mut beta_gradient = [20.0];
        batch_norm_backward(
            &settings,
            &input,
            &[2.0],
            &saved,
            &[1.0, 0.0, 0.0],
            &mut input_gradient,
            &mut gamma_gradient,
            &mut beta_gradient,
        );
        let expected = [1.0 / 6.0, -1.0 / 3.0, 1.0 / 6.0].map(|v| 2.0 * inverse_std * v);
        for (actual, expected) in input_gradient.iter().zip(expected) {
            assert!(
                (f64::from(*actual) - expected).abs() < 1e-5,
                "{actual} {expected}"
            );
        }
        assert!((f64::from(gamma_gradient[0]) - (10.0 - a)).abs() < 1e-5);
        assert_eq!(beta_gradient, [21.0]);
    }

    #[test]
    fn empty_batches_do_nothing_harmful() {
        let mut saved = [f32::NAN; 4];
        let mut running_mean = [0.5; 2];
        let mut running_variance = [2.0; 2];
        batch_norm_forward_training(
            &settings(2),
            &[],
            &[1.0; 2],
            &[0.0; 2],
            &mut [],
            &mut saved,
            Some((&mut running_mean, &mut running_variance)),
        );
        assert_eq!(saved[0], 0.0);
        assert!(saved[2].is_finite());
        assert_eq!(running_mean, [0.5; 2]);
        assert_eq!(running_variance, [2.0; 2]);
    }
}
