//! Finite-difference checks of the pointwise and per-channel kernels' backward passes
//! (activations, batch norm, dropout, the merges add and concat) and of the losses' gradients, plus the accumulation
//! contract: parameter gradients are added to, input gradients overwritten.
//!
//! Every check differentiates a scalar: `L = Σ output·weights` with random weights (so
//! the output gradient handed to backward is `weights`), or the loss itself for the losses.
//! Central differences are taken on f32 inputs while `L` is summed in f64, so the only
//! rounding noise is the kernels' own f32 arithmetic.

use carve_core::model::ActivationKind;
use carve_engine::kernels::activation::{
    activation_backward, activation_forward, backward_reads_output,
};
use carve_engine::kernels::batch_norm::{
    BatchNormSettings, batch_norm_backward, batch_norm_forward_training,
};
use carve_engine::kernels::dropout::{dropout_backward, dropout_forward};
use carve_engine::kernels::loss::{
    mse_backward, mse_forward, softmax_cross_entropy_backward, softmax_cross_entropy_forward,
};
use carve_engine::kernels::merge::{add_forward, concat_backward, concat_forward};
use carve_engine::rng::Rng;

mod gradient_support;
use gradient_support::weighted_sum;

fn random_values(rng: &mut Rng, count: usize, scale: f32, offset: f32) -> Vec<f32> {
    (0..count).map(|_| rng.normal() * scale + offset).collect()
}

/// Central differences of `loss` at `point`, element by element. The step actually taken
/// (after f32 rounding of `x ± step`) is the divisor, not the nominal `2·step`.
fn numerical_gradient(point: &[f32], step: f32, mut loss: impl FnMut(&[f32]) -> f64) -> Vec<f64> {
    let mut perturbed = point.to_vec();
    (0..point.len())
        .map(|index| {
            let original = point[index];
            let above = original + step;
            let below = original - step;
            perturbed[index] = above;
            let loss_above = loss(&perturbed);
            perturbed[index] = below;
            let loss_below = loss(&perturbed);
            perturbed[index] = original;
            (loss_above - loss_below) / (f64::from(above) - f64::from(below))
        })
        .collect()
}

/// Each element within 1% of the larger of the two values, plus an absolute allowance of
/// 1e-3 of the largest gradient for elements near zero.
fn assert_gradients_match(what: &str, analytic: &[f32], numerical: &[f64]) {
    assert_eq!(analytic.len(), numerical.len(), "{what}: lengths");
    let largest = numerical
        .iter()
        .fold(0.0f64, |largest, value| largest.max(value.abs()));
    assert!(largest > 0.0, "{what}: the numerical gradient is all zero");
    for (index, (&analytic, &numerical)) in analytic.iter().zip(numerical).enumerate() {
        let analytic = f64::from(analytic);
        let tolerance = 1e-2 * analytic.abs().max(numerical.abs()) + 1e-3 * largest;
        assert!(
            (analytic - numerical).abs() <= tolerance,
            "{what}: element {index}: analytic {analytic} vs numerical {numerical}"
        );
    }
}

fn all_activations() -> [ActivationKind; 6] {
    [
        ActivationKind::Relu,
        ActivationKind::Relu6,
        ActivationKind::LeakyRelu { alpha: 0.2 },
        ActivationKind::Gelu,
        ActivationKind::Sigmoid,
        ActivationKind::Tanh,
    ]
}

#[test]
fn every_activation_backward_matches_finite_differences() {
    let count = 64;
    let mut rng = Rng::for_stream(1, &[0]);
    for kind in all_activations() {
        // Keep away from relu's kink at 0, where the central difference straddles it.
        let input: Vec<f32> = random_values(&mut rng, count, 2.0, 0.0)
            .into_iter()
            .map(|x| if x.abs() < 0.05 { x + 0.1 } else { x })
            .collect();
        let weights = random_values(&mut rng, count, 1.0, 0.0);

        let mut output = vec![0.0; count];
        activation_forward(kind, &input, &mut output);
        // Garbage first: the input gradient must be overwritten, not accumulated.
        let mut input_gradient = vec![f32::NAN; count];
        if backward_reads_output(kind) {
            activation_backward(kind, None, Some(&output), &weights, &mut input_gradient);
        } else {
            activation_backward(kind, Some(&input), None, &weights, &mut input_gradient);
        }

        let numerical = numerical_gradient(&input, 1e-3, |input| {
            let mut output = vec![0.0; count];
            activation_forward(kind, input, &mut output);
            weighted_sum(&output, &weights)
        });
        assert_gradients_match(&format!("{kind:?}"), &input_gradient, &numerical);

        // Called again on the same buffer: the same values, not twice them.
        let first = input_gradient.clone();
        activation_backward(
            kind,
            Some(&input),
            Some(&output),
            &weights,
            &mut input_gradient,
        );
        assert_eq!(
            first, input_gradient,
            "{kind:?}: input gradient overwritten"
        );
    }
}

/// One batch-norm layer with random data, for the gradient checks.
struct BatchNormCase {
    settings: BatchNormSettings,
    input: Vec<f32>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
    weights: Vec<f32>,
}

impl BatchNormCase {
    fn new(rows: usize, channels: usize, seed: u64) -> Self {
        let mut rng = Rng::for_stream(seed, &[rows as u64, channels as u64]);
        let elements = rows * channels;
        BatchNormCase {
            settings: BatchNormSettings {
                channels,
                epsilon: 1e-3,
                momentum: 0.99,
            },
            // An offset mean, so the mean subtraction matters.
            input: random_values(&mut rng, elements, 1.5, 3.0),
            gamma: random_values(&mut rng, channels, 0.5, 1.0),
            beta: random_values(&mut rng, channels, 0.5, 0.0),
            weights: random_values(&mut rng, elements, 1.0, 0.0),
        }
    }

    fn forward(&self, input: &[f32], gamma: &[f32], beta: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let mut output = vec![0.0; input.len()];
        let mut saved = vec![0.0; 2 * self.settings.channels];
        batch_norm_forward_training(
            &self.settings,
            input,
            gamma,
            beta,
            &mut output,
            &mut saved,
            None,
        );
        (output, saved)
    }

    fn loss(&self, input: &[f32], gamma: &[f32], beta: &[f32]) -> f64 {
        weighted_sum(&self.forward(input, gamma, beta).0, &self.weights)
    }

    fn check(&self, what: &str) {
        let channels = self.settings.channels;
        let (_, saved) = self.forward(&self.input, &self.gamma, &self.beta);
        let mut input_gradient = vec![f32::NAN; self.input.len()];
        // Non-zero starting values: parameter gradients must be added to.
        let mut gamma_gradient = vec![0.5; channels];
        let mut beta_gradient = vec![-0.25; channels];
        let backward =
            |input_gradient: &mut [f32], gamma_gradient: &mut [f32], beta_gradient: &mut [f32]| {
                batch_norm_backward(
                    &self.settings,
                    &self.input,
                    &self.gamma,
                    &saved,
                    &self.weights,
                    input_gradient,
                    gamma_gradient,
                    beta_gradient,
                );
            };
        backward(&mut input_gradient, &mut gamma_gradient, &mut beta_gradient);
        let gamma_once: Vec<f32> = gamma_gradient.iter().map(|g| g - 0.5).collect();
        let beta_once: Vec<f32> = beta_gradient.iter().map(|g| g + 0.25).collect();

        let numerical_input = numerical_gradient(&self.input, 1e-2, |input| {
            self.loss(input, &self.gamma, &self.beta)
        });
        assert_gradients_match(&format!("{what}: input"), &input_gradient, &numerical_input);
        let numerical_gamma = numerical_gradient(&self.gamma, 1e-2, |gamma| {
            self.loss(&self.input, gamma, &self.beta)
        });
        assert_gradients_match(&format!("{what}: gamma"), &gamma_once, &numerical_gamma);
        let numerical_beta = numerical_gradient(&self.beta, 1e-2, |beta| {
            self.loss(&self.input, &self.gamma, beta)
        });
        assert_gradients_match(&format!("{what}: beta"), &beta_once, &numerical_beta);

        // The output is invariant to shifting a channel's input, so the input gradient of
        // every channel sums to zero.
        for channel in 0..channels {
            let column = input_gradient.iter().skip(channel).step_by(channels);
            let sum: f64 = column.clone().map(|&g| f64::from(g)).sum();
            let magnitude: f64 = column.map(|&g| f64::from(g).abs()).sum();
            assert!(
                sum.abs() <= 1e-5 * magnitude.max(1.0),
                "{what}: channel {channel} input gradient sums to {sum}"
            );
        }

        // A second micro-batch: input gradient overwritten, parameter gradients added.
        let first_input_gradient = input_gradient.clone();
        backward(&mut input_gradient, &mut gamma_gradient, &mut beta_gradient);
        assert_eq!(input_gradient, first_input_gradient, "{what}: overwritten");
        for channel in 0..channels {
            let gamma_twice = gamma_gradient[channel] - 0.5;
            let beta_twice = beta_gradient[channel] + 0.25;
            assert!(
                (gamma_twice - 2.0 * gamma_once[channel]).abs() <= 1e-5,
                "{what}"
            );
            assert!(
                (beta_twice - 2.0 * beta_once[channel]).abs() <= 1e-5,
                "{what}"
            );
        }
    }
}

#[test]
fn batch_norm_gradients_match_finite_differences_for_images_and_flat_features() {
    // NHWC (2, 3, 3, 4): statistics per channel over N·H·W = 18 rows.
    BatchNormCase::new(2 * 3 * 3, 4, 10).check("image (2, 3, 3, 4)");
    // Flat (6, 5): statistics per feature over the batch.
    BatchNormCase::new(6, 5, 11).check("flat (6, 5)");
    // A small batch, where the gradient through the mean and variance dominates. (Two rows
    // would be degenerate: they normalize to about ±1 whatever the input, so every input
    // gradient is of the order of ε and finite differences are all noise.)
    BatchNormCase::new(3, 3, 12).check("flat (3, 3)");
}

/// The values of one channel (or feature) of `channels`, interleaved as NHWC lays them
/// out, widened to f64.
fn channel_values(values: &[f32], channel: usize, channels: usize) -> Vec<f64> {
    values
        .iter()
        .skip(channel)
        .step_by(channels)
        .map(|&value| f64::from(value))
        .collect()
}

#[test]
fn batch_norm_image_statistics_are_per_channel_over_batch_height_and_width() {
    let case = BatchNormCase::new(2 * 3 * 3, 4, 20);
    let (output, saved) = case.forward(&case.input, &case.gamma, &case.beta);
    for channel in 0..4 {
        let values = channel_values(&case.input, channel, 4);
        assert_eq!(values.len(), 18);
        let mean = values.iter().sum::<f64>() / 18.0;
        let variance = values.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / 18.0;
        assert!((f64::from(saved[channel]) - mean).abs() < 1e-5);
        assert!((f64::from(saved[4 + channel]) - 1.0 / (variance + 1e-3).sqrt()).abs() < 1e-5);
        // The normalized output of each channel has mean β and (nearly) std |γ|.
        let outputs = channel_values(&output, channel, 4);
        let output_mean = outputs.iter().sum::<f64>() / 18.0;
        assert!((output_mean - f64::from(case.beta[channel])).abs() < 1e-5);
    }
}

#[test]
fn batch_norm_updates_running_statistics_only_when_asked() {
    let case = BatchNormCase::new(6, 5, 30);
    let mut running_mean = vec![0.25; 5];
    let mut running_variance = vec![2.0; 5];

    // Recomputation during backward passes None: running statistics stay as they were
    // (they are not even handed over), and the output is the same as in the first pass.
    let (recomputed_output, recomputed_saved) = case.forward(&case.input, &case.gamma, &case.beta);
    assert_eq!(running_mean, vec![0.25; 5]);
    assert_eq!(running_variance, vec![2.0; 5]);

    let mut output = vec![0.0; case.input.len()];
    let mut saved = vec![0.0; 10];
    batch_norm_forward_training(
        &case.settings,
        &case.input,
        &case.gamma,
        &case.beta,
        &mut output,
        &mut saved,
        Some((&mut running_mean, &mut running_variance)),
    );
    assert_eq!(output, recomputed_output);
    assert_eq!(saved, recomputed_saved);
    for feature in 0..5 {
        let values = channel_values(&case.input, feature, 5);
        let mean = values.iter().sum::<f64>() / 6.0;
        let unbiased = values.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / 5.0;
        // Keras: running = momentum·running + (1 − momentum)·batch.
        let expected_mean = 0.99 * 0.25 + 0.01 * mean;
        let expected_variance = 0.99 * 2.0 + 0.01 * unbiased;
        assert!((f64::from(running_mean[feature]) - expected_mean).abs() < 1e-6);
        assert!((f64::from(running_variance[feature]) - expected_variance).abs() < 1e-5);
    }
}

#[test]
fn dropout_backward_matches_finite_differences_with_the_mask_fixed_by_the_seed() {
    let count = 200;
    let mut rng = Rng::for_stream(2, &[0]);
    let input = random_values(&mut rng, count, 1.0, 0.0);
    let weights = random_values(&mut rng, count, 1.0, 0.0);
    let (rate, seed, stream) = (0.4, 99, [5u64, 0, 3]);
    let forward = |input: &[f32]| {
        let mut output = vec![0.0; count];
        let mut mask = vec![0u8; count];
        dropout_forward(rate, seed, &stream, input, &mut output, &mut mask);
        (output, mask)
    };
    let (_, mask) = forward(&input);
    assert!(mask.contains(&0) && mask.contains(&1));
    let mut input_gradient = vec![f32::NAN; count];
    dropout_backward(rate, &mask, &weights, &mut input_gradient);
    // Each evaluation redraws the mask from (seed, stream): the same mask every time.
    let numerical = numerical_gradient(&input, 1e-2, |input| {
        let (output, recomputed_mask) = forward(input);
        assert_eq!(recomputed_mask, mask);
        weighted_sum(&output, &weights)
    });
    assert_gradients_match("dropout", &input_gradient, &numerical);
    for (&gradient, &kept) in input_gradient.iter().zip(&mask) {
        if kept == 0 {
            assert_eq!(gradient, 0.0);
        }
    }
}

#[test]
fn softmax_cross_entropy_gradient_matches_finite_differences() {
    let (batch, classes) = (4, 5);
    let mut rng = Rng::for_stream(3, &[0]);
    let logits = random_values(&mut rng, batch * classes, 2.0, 0.0);
    let labels: Vec<i32> = (0..batch)
        .map(|_| rng.below(classes as u64) as i32)
        .collect();
    // The trainer's scale: loss scale / effective batch size.
    let gradient_scale = 8.0 / batch as f32;
    let loss = |logits: &[f32]| {
        let mut probabilities = vec![0.0; batch * classes];
        softmax_cross_entropy_forward(batch, classes, logits, &labels, &mut probabilities)
            .expect("labels are in range")
            * f64::from(gradient_scale)
    };

    let mut probabilities = vec![0.0; batch * classes];
    softmax_cross_entropy_forward(batch, classes, &logits, &labels, &mut probabilities)
        .expect("labels are in range");
    let mut logits_gradient = vec![f32::NAN; batch * classes];
    softmax_cross_entropy_backward(
        batch,
        classes,
        &probabilities,
        &labels,
        gradient_scale,
        &mut logits_gradient,
    );
    let numerical = numerical_gradient(&logits, 1e-3, loss);
    assert_gradients_match("softmax cross-entropy", &logits_gradient, &numerical);

    // Each sample's gradient sums to zero (probabilities sum to one, as does the one-hot).
    for sample in logits_gradient.chunks_exact(classes) {
        assert!(sample.iter().map(|&g| f64::from(g)).sum::<f64>().abs() < 1e-5);
    }
}

#[test]
fn mse_gradient_matches_finite_differences() {
    let (batch, elements_per_sample) = (3, 4);
    let mut rng = Rng::for_stream(4, &[0]);
    let output = random_values(&mut rng, batch * elements_per_sample, 1.0, 0.0);
    let targets = random_values(&mut rng, batch * elements_per_sample, 1.0, 0.5);
    let gradient_scale = 1.0 / batch as f32;
    let mut output_gradient = vec![f32::NAN; batch * elements_per_sample];
    mse_backward(
        batch,
        elements_per_sample,
        &output,
        &targets,
        gradient_scale,
        &mut output_gradient,
    );
    let numerical = numerical_gradient(&output, 1e-3, |output| {
        mse_forward(batch, elements_per_sample, output, &targets) * f64::from(gradient_scale)
    });
    assert_gradients_match("mse", &output_gradient, &numerical);
}

/// The merges of graph models: `add` passes its output gradient to every input, `concat`
/// hands each input its slice of the last axis.
#[test]
fn add_and_concat_backward_match_finite_differences() {
    let mut rng = Rng::for_stream(4, &[0]);
    let (rows, widths) = (6, [3usize, 1, 2]);
    let inputs: Vec<Vec<f32>> = widths
        .iter()
        .map(|width| random_values(&mut rng, rows * width, 1.0, 0.0))
        .collect();
    let total: usize = widths.iter().sum();
    let weights = random_values(&mut rng, rows * total, 1.0, 0.0);
    let mut slices: Vec<Vec<f32>> = widths
        .iter()
        .map(|width| vec![f32::NAN; rows * width])
        .collect();
    let mut views: Vec<&mut [f32]> = slices.iter_mut().map(Vec::as_mut_slice).collect();
    concat_backward(rows, &widths, &weights, &mut views);
    for (index, input) in inputs.iter().enumerate() {
        let numerical = numerical_gradient(input, 1e-2, |perturbed| {
            let mut parts: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
            parts[index] = perturbed;
            let mut output = vec![0.0; rows * total];
            concat_forward(rows, &widths, &parts, &mut output);
            weighted_sum(&output, &weights)
        });
        assert_gradients_match(&format!("concat input {index}"), &slices[index], &numerical);
    }
    let count = 12;
    let a = random_values(&mut rng, count, 1.0, 0.0);
    let b = random_values(&mut rng, count, 1.0, 0.0);
    let weights = random_values(&mut rng, count, 1.0, 0.0);
    for (index, point) in [&a, &b].into_iter().enumerate() {
        let numerical = numerical_gradient(point, 1e-2, |perturbed| {
            let mut output = vec![0.0; count];
            let parts: [&[f32]; 2] = if index == 0 {
                [perturbed, &b]
            } else {
                [&a, perturbed]
            };
            add_forward(&parts, &mut output);
            weighted_sum(&output, &weights)
        });
        // The plan hands the add's output gradient itself to each input.
        assert_gradients_match(&format!("add input {index}"), &weights, &numerical);
    }
}
