//! What the kernel gradient checks share: the scalar loss they differentiate.

/// The loss `sum(values * weights)` in f64: its gradient with respect to `values` is
/// `weights`, what each backward pass under test receives as its output gradient.
pub fn weighted_sum(values: &[f32], weights: &[f32]) -> f64 {
    values
        .iter()
        .zip(weights)
        .map(|(&value, &weight)| f64::from(value) * f64::from(weight))
        .sum()
}
