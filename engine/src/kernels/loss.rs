//! Losses: softmax cross-entropy for classification (integer labels) and mean squared
//! error for regression, plus the accuracy count.
//!
//! Forward functions return the **sum** over the batch of per-sample losses, in f64, so the
//! trainer can add micro-batches and divide once by the effective batch size. Backward
//! functions take `gradient_scale`, which the trainer sets to
//! `loss_scale / effective_batch_size`: accumulated micro-batches then give the gradient of
//! the mean loss over the whole batch, multiplied by the loss scale.
//!
//! Labels come from data files, so a label outside `0..classes` is an error, never a panic.

/// A problem with the data the loss was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LossError {
    #[error("sample {sample} has label {label}, outside the {classes} classes 0..{classes}")]
    LabelOutOfRange {
        sample: usize,
        label: i32,
        classes: usize,
    },
}

/// The class index of `label` if it is in `0..classes`.
fn class_index(label: i32, classes: usize) -> Option<usize> {
    usize::try_from(label).ok().filter(|&class| class < classes)
}

/// Softmax of each sample's logits into `probabilities` (overwritten) and the sum over the
/// batch of `−log p[label]`.
///
/// Numerically stable: the maximum logit is subtracted before exponentiating, and the loss
/// is computed as `logsumexp − logit[label]` in f64 rather than as `−log p`, so a confident
/// wrong answer gives a large finite loss instead of `log(0)`.
///
/// All labels are checked before anything is written.
///
/// # Panics
/// If slice lengths do not match `batch` and `classes` (internal contract).
pub fn softmax_cross_entropy_forward(
    batch: usize,
    classes: usize,
    logits: &[f32],
    labels: &[i32],
    probabilities: &mut [f32],
) -> Result<f64, LossError> {
    assert_eq!(
        logits.len(),
        batch * classes,
        "cross-entropy: logits length"
    );
    assert_eq!(labels.len(), batch, "cross-entropy: labels length");
    assert_eq!(
        probabilities.len(),
        batch * classes,
        "cross-entropy: probabilities length"
    );
    let mut targets = Vec::with_capacity(batch);
    for (sample, &label) in labels.iter().enumerate() {
        let class = class_index(label, classes).ok_or(LossError::LabelOutOfRange {
            sample,
            label,
            classes,
        })?;
        targets.push(class);
    }
    if classes == 0 {
        // Only reachable with an empty batch: every label of a non-empty one was rejected.
        return Ok(0.0);
    }

    let mut total = 0.0f64;
    for ((sample_logits, sample_probabilities), &target) in logits
        .chunks_exact(classes)
        .zip(probabilities.chunks_exact_mut(classes))
        .zip(&targets)
    {
        // Not f32::max: a NaN logit must poison the loss (and so the step), not vanish.
        let max =
            sample_logits.iter().fold(
                f32::NEG_INFINITY,
                |max, &logit| if logit > max { logit } else { max },
            );
        let max = f64::from(max);
        let mut sum_of_exponentials = 0.0f64;
        for (probability, &logit) in sample_probabilities.iter_mut().zip(sample_logits) {
            let exponential = (f64::from(logit) - max).exp();
            *probability = exponential as f32;
            sum_of_exponentials += exponential;
        }
        let inverse_sum = 1.0 / sum_of_exponentials;
        for probability in sample_probabilities.iter_mut() {
            *probability = (f64::from(*probability) * inverse_sum) as f32;
        }
        total += sum_of_exponentials.ln() - (f64::from(sample_logits[target]) - max);
    }
    Ok(total)
}

/// `logits_gradient = (probabilities − one_hot(labels))·gradient_scale` (overwritten), with
/// the probabilities [`softmax_cross_entropy_forward`] wrote.
///
/// The forward pass has already rejected labels out of range; should one reach here anyway
/// its sample gets `probabilities·gradient_scale` (no one-hot term) rather than a panic.
///
/// # Panics
/// If slice lengths do not match `batch` and `classes` (internal contract).
pub fn softmax_cross_entropy_backward(
    batch: usize,
    classes: usize,
    probabilities: &[f32],
    labels: &[i32],
    gradient_scale: f32,
    logits_gradient: &mut [f32],
) {
    assert_eq!(
        probabilities.len(),
        batch * classes,
        "cross-entropy: probabilities length"
    );
    assert_eq!(labels.len(), batch, "cross-entropy: labels length");
    assert_eq!(
        logits_gradient.len(),
        batch * classes,
        "cross-entropy: logits gradient length"
    );
    if classes == 0 {
        return;
    }
    for ((sample_probabilities, sample_gradient), &label) in probabilities
        .chunks_exact(classes)
        .zip(logits_gradient.chunks_exact_mut(classes))
        .zip(labels)
    {
        let target = class_index(label, classes);
        for (class, (gradient, &probability)) in sample_gradient
            .iter_mut()
            .zip(sample_probabilities)
            .enumerate()
        {
            let one_hot = if Some(class) == target { 1.0 } else { 0.0 };
            *gradient = (probability - one_hot) * gradient_scale;
        }
    }
}

/// How many samples have their label as the arg-max of their logits (or probabilities;
/// softmax does not move the arg-max). Ties go to the first maximum; NaN never wins; a
/// label out of range never counts.
///
/// # Panics
/// If slice lengths do not match `batch` and `classes` (internal contract).
pub fn count_correct(
    batch: usize,
    classes: usize,
    logits_or_probabilities: &[f32],
    labels: &[i32],
) -> usize {
    assert_eq!(
        logits_or_probabilities.len(),
        batch * classes,
        "count correct: scores length"
    );
    assert_eq!(labels.len(), batch, "count correct: labels length");
    if classes == 0 {
        return 0;
    }
    logits_or_probabilities
        .chunks_exact(classes)
        .zip(labels)
        .filter(|(scores, label)| {
            let mut best_class = 0;
            let mut best_score = scores[0];
            for (class, &score) in scores.iter().enumerate().skip(1) {
                // Strictly greater: the first maximum wins; the NaN test lets a real score
                // replace a leading NaN.
                if score > best_score || (best_score.is_nan() && !score.is_nan()) {
                    best_class = class;
                    best_score = score;
                }
            }
            !best_score.is_nan() && class_index(**label, classes) == Some(best_class)
        })
        .count()
}

/// The sum over samples of each sample's mean squared error over its
/// `elements_per_sample` elements (Keras' `mean_squared_error` reduces over the last axis,
/// then the trainer averages over the batch).
///
/// # Panics
/// If slice lengths do not match `batch` and `elements_per_sample` (internal contract).
pub fn mse_forward(
    batch: usize,
    elements_per_sample: usize,
    output: &[f32],
    targets: &[f32],
) -> f64 {
    assert_eq!(
        output.len(),
        batch * elements_per_sample,
        "mse: output length"
    );
    assert_eq!(
        targets.len(),
        batch * elements_per_sample,
        "mse: targets length"
    );
    if elements_per_sample == 0 {
        return 0.0;
    }
    let sum_of_squares: f64 = output
        .iter()
        .zip(targets)
        .map(|(&y, &t)| {
            let error = f64::from(y) - f64::from(t);
            error * error
        })
        .sum();
    // Every sample has the same element count, so dividing the grand total once equals
    // summing the per-sample means.
    sum_of_squares / elements_per_sample as f64
}

/// `output_gradient = 2·(y − t)/elements_per_sample·gradient_scale` (overwritten).
///
/// # Panics
/// If slice lengths do not match `batch` and `elements_per_sample` (internal contract).
pub fn mse_backward(
    batch: usize,
    elements_per_sample: usize,
    output: &[f32],
    targets: &[f32],
    gradient_scale: f32,
    output_gradient: &mut [f32],
) {
    let elements = batch * elements_per_sample;
    assert_eq!(output.len(), elements, "mse: output length");
    assert_eq!(targets.len(), elements, "mse: targets length");
    assert_eq!(
        output_gradient.len(),
        elements,
        "mse: output gradient length"
    );
    if elements == 0 {
        return;
    }
    let factor = 2.0 * gradient_scale / elements_per_sample as f32;
    for ((gradient, &y), &t) in output_gradient.iter_mut().zip(output).zip(targets) {
        *gradient = (y - t) * factor;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_cross_entropy_on_two_samples_of_three_classes() {
        // Sample 0: logits [1, 2, 3], label 2. exp(−2), exp(−1), 1 over their sum
        // 1.503214724: p = [0.090030573, 0.244728471, 0.665240956], loss = −ln 0.665240956
        // = 0.407605964.
        // Sample 1: logits [0, 0, 0], label 0: p = 1/3 each, loss = ln 3 = 1.098612289.
        let logits = [1.0, 2.0, 3.0, 0.0, 0.0, 0.0];
        let labels = [2, 0];
        let mut probabilities = [0.0; 6];
        let loss =
            softmax_cross_entropy_forward(2, 3, &logits, &labels, &mut probabilities).unwrap();
        assert!(
            (loss - (0.407_605_964 + 1.098_612_289)).abs() < 1e-8,
            "{loss}"
        );
        let expected = [
            0.090_030_573,
            0.244_728_471,
            0.665_240_956,
            1.0 / 3.0,
            1.0 / 3.0,
            1.0 / 3.0,
        ];
        for (&p, e) in probabilities.iter().zip(expected) {
            assert!((f64::from(p) - e).abs() < 1e-7);
        }

        let mut gradient = [f32::NAN; 6];
        softmax_cross_entropy_backward(2, 3, &probabilities, &labels, 0.5, &mut gradient);
        let expected = [
            0.090_030_573 * 0.5,
            0.244_728_471 * 0.5,
            (0.665_240_956 - 1.0) * 0.5,
            (1.0 / 3.0 - 1.0) * 0.5,
            1.0 / 6.0,
            1.0 / 6.0,
        ];
        for (&g, e) in gradient.iter().zip(expected) {
            assert!((f64::from(g) - e).abs() < 1e-7);
        }
    }

    #[test]
    fn huge_logits_stay_finite() {
        let mut probabilities = [0.0; 2];
        let loss =
            softmax_cross_entropy_forward(1, 2, &[1000.0, -1000.0], &[1], &mut probabilities)
                .unwrap();
        assert!((loss - 2000.0).abs() < 1e-9);
        assert_eq!(probabilities, [1.0, 0.0]);
        let loss = softmax_cross_entropy_forward(1, 2, &[f32::NAN, 0.0], &[1], &mut probabilities)
            .unwrap();
        assert!(loss.is_nan());
    }

    #[test]
    fn labels_out_of_range_are_errors() {
        let mut probabilities = [7.0; 4];
        for (label, sample) in [(2, 1), (-1, 1)] {
            let error =
                softmax_cross_entropy_forward(2, 2, &[0.0; 4], &[0, label], &mut probabilities)
                    .unwrap_err();
            assert_eq!(
                error,
                LossError::LabelOutOfRange {
                    sample,
                    label,
                    classes: 2
                }
            );
            assert!(error.to_string().contains("sample 1"));
        }
        // Nothing was written.
        assert_eq!(probabilities, [7.0; 4]);
        assert!(softmax_cross_entropy_forward(1, 0, &[], &[0], &mut []).is_err());
        assert_eq!(
            softmax_cross_entropy_forward(0, 0, &[], &[], &mut []),
            Ok(0.0)
        );
    }

    #[test]
    fn count_correct_takes_the_first_maximum() {
        let scores = [
            0.1,
            0.7,
            0.2, // arg-max 1
            0.5,
            0.5,
            0.0, // tie: 0
            0.2,
            0.3,
            0.9, // 2
            f32::NAN,
            0.1,
            0.2, // NaN ignored: 2
        ];
        assert_eq!(count_correct(4, 3, &scores, &[1, 0, 2, 2]), 4);
        assert_eq!(count_correct(4, 3, &scores, &[1, 1, 0, 2]), 2);
        assert_eq!(count_correct(4, 3, &scores, &[1, 0, 2, 9]), 3);
        assert_eq!(count_correct(1, 3, &[f32::NAN; 3], &[0]), 0);
    }

    #[test]
    fn mse_sums_per_sample_means() {
        // Sample 0: errors 1, −3 → mean 5. Sample 1: errors 0, 2 → mean 2. Sum 7.
        let output = [2.0, 0.0, 1.0, 3.0];
        let targets = [1.0, 3.0, 1.0, 1.0];
        assert!((mse_forward(2, 2, &output, &targets) - 7.0).abs() < 1e-12);
        let mut gradient = [f32::NAN; 4];
        mse_backward(2, 2, &output, &targets, 0.5, &mut gradient);
        // 2·e/2·0.5 = e/2
        assert_eq!(gradient, [0.5, -1.5, 0.0, 1.0]);
        assert_eq!(mse_forward(3, 0, &[], &[]), 0.0);
    }
}
