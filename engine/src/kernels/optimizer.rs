//! Optimizer updates of one fp32 parameter tensor (SGD with momentum / Nesterov, Adam,
//! AdamW) and dynamic loss scaling for fp16 mixed precision.
//!
//! The formulas are PyTorch's (`torch.optim.SGD`, `Adam`, `AdamW`, with dampening 0 and
//! `amsgrad` off), all in f32 as on the GPU. Every update first multiplies the raw
//! accumulated gradient by `gradient_scale`, which the trainer sets to `1 / loss_scale`, so
//! loss scaling never reaches the optimizer state. The gradient buffers are read only: the
//! trainer zeroes them after the step.

use carve_core::spec::{AdamSpec, SgdSpec};

/// One SGD step, PyTorch's formulation:
/// `g = scale·raw + weight_decay·w` (L2); with momentum `v = momentum·v + g` and the step
/// `g + momentum·v` (Nesterov) or `v`; without momentum the step is `g`; `w −= lr·step`.
///
/// `velocity` must be `Some` exactly when `settings.momentum != 0`
/// (`OptimizerSpec::state_tensors_per_parameter`). A zero-initialized velocity makes the
/// first step `v = g`, which is PyTorch's first step too.
///
/// # Panics
/// If the lengths differ or velocity is missing with non-zero momentum (internal contract).
pub fn sgd_update(
    parameters: &mut [f32],
    gradients: &[f32],
    velocity: Option<&mut [f32]>,
    settings: &SgdSpec,
    gradient_scale: f32,
) {
    assert_eq!(
        parameters.len(),
        gradients.len(),
        "sgd: parameter and gradient lengths differ"
    );
    let learning_rate = settings.learning_rate as f32;
    let momentum = settings.momentum as f32;
    let weight_decay = settings.weight_decay as f32;
    match velocity {
        None => {
            assert!(
                settings.momentum == 0.0,
                "sgd: momentum {} needs a velocity buffer",
                settings.momentum
            );
            for (w, &raw) in parameters.iter_mut().zip(gradients) {
                let gradient = raw * gradient_scale + weight_decay * *w;
                *w -= learning_rate * gradient;
            }
        }
        Some(velocity) => {
            assert_eq!(
                velocity.len(),
                parameters.len(),
                "sgd: velocity and parameter lengths differ"
            );
            for ((w, &raw), v) in parameters.iter_mut().zip(gradients).zip(velocity) {
                let gradient = raw * gradient_scale + weight_decay * *w;
                *v = momentum * *v + gradient;
                let step = if settings.nesterov {
                    gradient + momentum * *v
                } else {
                    *v
                };
                *w -= learning_rate * step;
            }
        }
    }
}

/// One Adam (or, with `decoupled_weight_decay`, AdamW) step, PyTorch's formulation:
/// - Adam: `g = scale·raw + weight_decay·w` (L2 through the moments);
/// - AdamW: `g = scale·raw` and `w ← w − lr·weight_decay·w` before the Adam step;
/// - `m = β₁·m + (1 − β₁)·g`, `v = β₂·v + (1 − β₂)·g²`;
/// - `w −= lr/(1 − β₁ᵗ) · m / (sqrt(v)/sqrt(1 − β₂ᵗ) + ε)`, i.e. `lr·m̂/(sqrt(v̂) + ε)`.
///
/// `step` is 1-based (the number of this update); 0 is treated as 1 so the bias correction
/// never divides by zero.
///
/// # Panics
/// If the lengths differ (internal contract).
#[allow(clippy::too_many_arguments)]
pub fn adam_update(
    parameters: &mut [f32],
    gradients: &[f32],
    first_moment: &mut [f32],
    second_moment: &mut [f32],
    step: u64,
    settings: &AdamSpec,
    decoupled_weight_decay: bool,
    gradient_scale: f32,
) {
    let length = parameters.len();
    assert!(
        gradients.len() == length && first_moment.len() == length && second_moment.len() == length,
        "adam: parameter, gradient and moment lengths differ"
    );
    let beta1 = settings.beta1 as f32;
    let beta2 = settings.beta2 as f32;
    // 1 − β in f64 before rounding, as PyTorch does with its Python-float betas: in f32,
    // 1 − 0.999f32 is off by 1.3e-5 relative.
    let one_minus_beta1 = (1.0 - settings.beta1) as f32;
    let one_minus_beta2 = (1.0 - settings.beta2) as f32;
    let epsilon = settings.epsilon as f32;
    // The bias corrections are per step, not per element: compute them once in f64.
    // powf rather than powi: step can exceed i32::MAX in principle.
    let step = step.max(1) as f64;
    let bias_correction1 = 1.0 - settings.beta1.powf(step);
    let bias_correction2 = 1.0 - settings.beta2.powf(step);
    let step_size = (settings.learning_rate / bias_correction1) as f32;
    let bias_correction2_sqrt = bias_correction2.sqrt() as f32;
    let (l2_decay, decoupled_decay_factor) = if decoupled_weight_decay {
        (
            0.0,
            1.0 - (settings.learning_rate * settings.weight_decay) as f32,
        )
    } else {
        (settings.weight_decay as f32, 1.0)
    };

    for (((w, &raw), m), v) in parameters
        .iter_mut()
        .zip(gradients)
        .zip(first_moment)
        .zip(second_moment)
    {
        let gradient = raw * gradient_scale + l2_decay * *w;
        *w *= decoupled_decay_factor;
        *m = beta1 * *m + one_minus_beta1 * gradient;
        *v = beta2 * *v + one_minus_beta2 * gradient * gradient;
        let denominator = v.sqrt() / bias_correction2_sqrt + epsilon;
        *w -= step_size * *m / denominator;
    }
}

/// Whether every gradient is finite; an fp16 overflow shows up as inf or NaN here.
pub fn gradients_are_finite(gradients: &[f32]) -> bool {
    gradients.iter().all(|gradient| gradient.is_finite())
}

/// The loss scale fp16 training starts from (PyTorch's `GradScaler` default is 2¹⁶).
pub const FP16_INITIAL_LOSS_SCALE: f32 = 65536.0;

/// Finite steps in a row after which the scale doubles (PyTorch's and Keras' default).
pub const DEFAULT_GROWTH_INTERVAL: u32 = 2000;

/// Dynamic loss scaling, as a pure state machine the trainer drives once per step:
/// multiply the loss by [`LossScaler::scale`], check the accumulated gradients with
/// [`gradients_are_finite`], call [`LossScaler::update`] with the result, and apply the
/// optimizer only if it returns true, with `gradient_scale =`
/// [`LossScaler::unscale_factor`]. Not `1/scale()` read after `update`: on a growth step
/// `update` has already doubled the scale the *next* step will use, while these gradients
/// were computed with the old one.
///
/// - overflow: halve the scale (not below 1), restart the count, skip the step;
/// - `growth_interval` finite steps in a row: double the scale.
///
/// A *disabled* scaler (fp32 and bf16, which have fp32's range) keeps scale 1 forever but
/// still skips a step whose gradients are not finite. A scale of 1.0 given to
/// [`LossScaler::new`] or [`LossScaler::from_state`] means disabled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaler {
    scale: f32,
    /// 0 marks a disabled scaler; `u32::MAX` a dynamic one that never grows.
    growth_interval: u32,
    good_steps: u32,
    /// The scale the gradients given to the latest `update` were computed with.
    scale_of_checked_step: f32,
}

impl LossScaler {
    /// A dynamic scaler starting at `initial_scale` (e.g. [`FP16_INITIAL_LOSS_SCALE`]).
    /// A scale of 1.0 — or anything not above 1 or not finite, which could not work as
    /// a dynamic scale — gives [`LossScaler::disabled`].
    pub fn new(initial_scale: f32) -> Self {
        Self::from_state(initial_scale, 0)
    }

    /// Scale 1, never changes.
    pub fn disabled() -> Self {
        LossScaler {
            scale: 1.0,
            growth_interval: 0,
            good_steps: 0,
            scale_of_checked_step: 1.0,
        }
    }

    /// A dynamic scaler with a growth interval other than [`DEFAULT_GROWTH_INTERVAL`]
    /// (0 means it only ever shrinks). The same rule as [`LossScaler::new`] for 1.0.
    pub fn with_growth_interval(initial_scale: f32, growth_interval: u32) -> Self {
        if initial_scale > 1.0 && initial_scale.is_finite() {
            LossScaler {
                scale: initial_scale,
                growth_interval: if growth_interval == 0 {
                    u32::MAX
                } else {
                    growth_interval
                },
                good_steps: 0,
                scale_of_checked_step: initial_scale,
            }
        } else {
            Self::disabled()
        }
    }

    /// Restores what [`LossScaler::state`] returned, from a checkpoint, with the default
    /// growth interval. A saved scale of 1.0 restores a disabled scaler, the same rule as
    /// [`LossScaler::new`]. (A dynamic scaler reaches 1.0 only after overflowing even
    /// unscaled fp16 gradients again and again; restored, it stays at 1.)
    pub fn from_state(scale: f32, good_steps: u32) -> Self {
        let mut scaler = Self::with_growth_interval(scale, DEFAULT_GROWTH_INTERVAL);
        if scaler.is_dynamic() {
            scaler.good_steps = good_steps.min(DEFAULT_GROWTH_INTERVAL - 1);
        }
        scaler
    }

    /// `(scale, finite steps in a row since the last change)`, for checkpoints.
    pub fn state(&self) -> (f32, u32) {
        (self.scale, self.good_steps)
    }

    /// The factor to multiply the loss by (and to divide the gradients by).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// `1 / (the scale of the step last passed to update)`: the `gradient_scale` for that
    /// step's optimizer update, which brings its gradients back to the loss's own scale.
    /// Before any update, `1 / scale()`.
    pub fn unscale_factor(&self) -> f32 {
        1.0 / self.scale_of_checked_step
    }

    /// Whether the scale adapts (fp16) rather than staying at 1.
    pub fn is_dynamic(&self) -> bool {
        self.growth_interval > 0
    }

    /// Records one step's outcome and returns whether its optimizer update should be
    /// applied (`false` when the gradients overflowed).
    pub fn update(&mut self, found_overflow: bool) -> bool {
        self.scale_of_checked_step = self.scale;
        if !self.is_dynamic() {
            return !found_overflow;
        }
        if found_overflow {
            self.scale = (self.scale * 0.5).max(1.0);
            self.good_steps = 0;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps >= self.growth_interval {
            let doubled = self.scale * 2.0;
            // Never grow into infinity: an infinite scale would overflow every step.
            if doubled.is_finite() {
                self.scale = doubled;
            }
            self.good_steps = 0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_close(actual: &[f32], expected: &[f64], tolerance: f64) {
        for (index, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            assert!(
                (f64::from(a) - e).abs() <= tolerance,
                "element {index}: {a} vs {e}"
            );
        }
    }

    fn sgd(momentum: f64, nesterov: bool, weight_decay: f64) -> SgdSpec {
        SgdSpec {
            learning_rate: 0.1,
            momentum,
            nesterov,
            weight_decay,
        }
    }

    #[test]
    fn plain_sgd_with_weight_decay_and_gradient_scale() {
        // raw 4, scale 0.5 → g = 2 + 0.01·1 = 2.01; w = 1 − 0.1·2.01 = 0.799.
        let mut parameters = [1.0, -2.0];
        sgd_update(
            &mut parameters,
            &[4.0, 0.0],
            None,
            &sgd(0.0, false, 0.01),
            0.5,
        );
        // second: g = 0 + 0.01·(−2) = −0.02; w = −2 + 0.002 = −1.998.
        assert_close(&parameters, &[0.799, -1.998], 1e-7);
    }

    #[test]
    fn sgd_momentum_and_nesterov_over_two_steps() {
        // PyTorch, momentum 0.9, lr 0.1, gradients 1 then 2, w₀ = 0:
        // step 1: v = 1, w = −0.1; step 2: v = 0.9 + 2 = 2.9, w = −0.1 − 0.29 = −0.39.
        let mut parameters = [0.0];
        let mut velocity = [0.0];
        let settings = sgd(0.9, false, 0.0);
        sgd_update(&mut parameters, &[1.0], Some(&mut velocity), &settings, 1.0);
        sgd_update(&mut parameters, &[2.0], Some(&mut velocity), &settings, 1.0);
        assert_close(&parameters, &[-0.39], 1e-7);
        assert_close(&velocity, &[2.9], 1e-6);

        // Nesterov: step 1: v = 1, step = 1 + 0.9 = 1.9, w = −0.19;
        // step 2: v = 2.9, step = 2 + 2.61 = 4.61, w = −0.19 − 0.461 = −0.651.
        let mut parameters = [0.0];
        let mut velocity = [0.0];
        let settings = sgd(0.9, true, 0.0);
        sgd_update(&mut parameters, &[1.0], Some(&mut velocity), &settings, 1.0);
        assert_close(&parameters, &[-0.19], 1e-7);
        sgd_update(&mut parameters, &[2.0], Some(&mut velocity), &settings, 1.0);
        assert_close(&parameters, &[-0.651], 1e-6);
    }

    fn adam(weight_decay: f64) -> AdamSpec {
        AdamSpec {
            learning_rate: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-7,
            weight_decay,
        }
    }

    #[test]
    fn adam_first_steps_by_hand() {
        // Step 1 with g = 2: m = 0.2, v = 0.004, m̂ = 2, v̂ = 4, w −= 0.01·2/(2 + 1e-7).
        let mut parameters = [1.0];
        let mut first = [0.0];
        let mut second = [0.0];
        adam_update(
            &mut parameters,
            &[4.0],
            &mut first,
            &mut second,
            1,
            &adam(0.0),
            false,
            0.5,
        );
        assert_close(&parameters, &[1.0 - 0.01 * 2.0 / (2.0 + 1e-7)], 1e-7);
        assert_close(&first, &[0.2], 1e-7);
        assert_close(&second, &[0.004], 1e-9);

        // Step 2 with g = −1: m = 0.18 − 0.1 = 0.08, v = 0.003996 + 0.001 = 0.004996;
        // m̂ = 0.08/0.19, v̂ = 0.004996/0.001999.
        adam_update(
            &mut parameters,
            &[-1.0],
            &mut first,
            &mut second,
            2,
            &adam(0.0),
            false,
            1.0,
        );
        let corrected_first: f64 = 0.08 / (1.0 - 0.81);
        let corrected_second: f64 = 0.004_996 / (1.0 - 0.998_001);
        let expected = 1.0
            - 0.01 * 2.0 / (2.0 + 1e-7)
            - 0.01 * corrected_first / (corrected_second.sqrt() + 1e-7);
        assert_close(&parameters, &[expected], 1e-6);
    }

    /// One Adam(W) update of w = 2 with raw g = 1 and weight decay 0.5, from zero state:
    /// the parameter and the first moment after it.
    fn one_decayed_step(step: u64, decoupled: bool) -> ([f32; 1], [f32; 1]) {
        let mut parameters = [2.0];
        let (mut first, mut second) = ([0.0], [0.0]);
        adam_update(
            &mut parameters,
            &[1.0],
            &mut first,
            &mut second,
            step,
            &adam(0.5),
            decoupled,
            1.0,
        );
        (parameters, first)
    }

    #[test]
    fn adam_couples_weight_decay_and_adamw_decouples_it() {
        // Adam, wd 0.5, w = 2, raw g = 1: g = 1 + 1 = 2 → m̂ = 2, v̂ = 4, step = 0.01·2/2.
        let (parameters, first) = one_decayed_step(1, false);
        assert_close(&parameters, &[2.0 - 0.01 * 2.0 / (2.0 + 1e-7)], 1e-7);
        assert_close(&first, &[0.2], 1e-7);

        // AdamW: w = 2·(1 − 0.01·0.5) = 1.99, then g = 1 → m̂ = 1, v̂ = 1, step 0.01/(1 + ε).
        let (parameters, first) = one_decayed_step(1, true);
        assert_close(&parameters, &[1.99 - 0.01 / (1.0 + 1e-7)], 1e-7);
        assert_close(&first, &[0.1], 1e-7);
        // Step 0 behaves as step 1 (no division by zero).
        let (parameters, _) = one_decayed_step(0, true);
        assert_close(&parameters, &[1.99 - 0.01 / (1.0 + 1e-7)], 1e-7);
    }

    #[test]
    fn loss_scaler_halves_on_overflow_and_skips_the_step() {
        let mut scaler = LossScaler::new(FP16_INITIAL_LOSS_SCALE);
        assert!(scaler.is_dynamic());
        assert!(scaler.update(false));
        assert_eq!(scaler.state(), (65536.0, 1));
        assert!(!scaler.update(true));
        assert_eq!(scaler.state(), (32768.0, 0));
        // Never below 1.
        for _ in 0..40 {
            assert!(!scaler.update(true));
        }
        assert_eq!(scaler.scale(), 1.0);
    }

    #[test]
    fn loss_scaler_doubles_after_the_growth_interval() {
        let mut scaler = LossScaler::new(1024.0);
        for _ in 0..DEFAULT_GROWTH_INTERVAL - 1 {
            assert!(scaler.update(false));
        }
        assert_eq!(scaler.state(), (1024.0, DEFAULT_GROWTH_INTERVAL - 1));
        assert_eq!(scaler.unscale_factor(), 1.0 / 1024.0);
        assert!(scaler.update(false));
        assert_eq!(scaler.state(), (2048.0, 0));
        // The step that triggered the growth was computed with 1024: unscale by that.
        assert_eq!(scaler.unscale_factor(), 1.0 / 1024.0);
        scaler.update(false);
        assert_eq!(scaler.unscale_factor(), 1.0 / 2048.0);
        // An overflow restarts the count.
        let mut scaler = LossScaler::with_growth_interval(8.0, 3);
        scaler.update(false);
        scaler.update(false);
        scaler.update(true);
        scaler.update(false);
        scaler.update(false);
        assert_eq!(scaler.state(), (4.0, 2));
        scaler.update(false);
        assert_eq!(scaler.state(), (8.0, 0));
        // Growth stops short of infinity.
        let mut scaler = LossScaler::with_growth_interval(f32::MAX, 1);
        scaler.update(false);
        assert_eq!(scaler.scale(), f32::MAX);
    }

    #[test]
    fn loss_scaler_state_round_trips() {
        let mut scaler = LossScaler::new(FP16_INITIAL_LOSS_SCALE);
        for _ in 0..5 {
            scaler.update(false);
        }
        scaler.update(true);
        scaler.update(false);
        let (scale, good_steps) = scaler.state();
        let mut restored = LossScaler::from_state(scale, good_steps);
        assert_eq!(restored, scaler);
        for found_overflow in [false, false, true, false] {
            assert_eq!(
                restored.update(found_overflow),
                scaler.update(found_overflow)
            );
        }
        assert_eq!(restored, scaler);
    }

    #[test]
    fn a_disabled_scaler_never_changes_but_still_skips_non_finite_steps() {
        for mut scaler in [LossScaler::disabled(), LossScaler::new(1.0)] {
            assert!(!scaler.is_dynamic());
            for _ in 0..5000 {
                assert!(scaler.update(false));
            }
            assert!(!scaler.update(true));
            assert_eq!(scaler.state(), (1.0, 0));
            assert_eq!(LossScaler::from_state(1.0, 0), LossScaler::disabled());
        }
        assert!(gradients_are_finite(&[0.0, -1e30, 3.0]));
        assert!(!gradients_are_finite(&[0.0, f32::INFINITY]));
        assert!(!gradients_are_finite(&[f32::NAN]));
    }
}
