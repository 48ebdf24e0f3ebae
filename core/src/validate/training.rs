//! The `[training]` checks: batch and step counts, accumulation, recomputation, the
//! optimizer's hyperparameters.

use super::{MAX_BATCH_SIZE, in_unit_interval, non_negative_finite, positive_finite};
use crate::error::FieldError;
use crate::spec::{JobSpec, OptimizerSpec};

pub(super) fn validate_training(spec: &JobSpec) -> Result<(), FieldError> {
    let training = &spec.training;
    if training.batch_size == 0 {
        return Err(FieldError::new("training.batch_size", "must be at least 1"));
    }
    if training.batch_size > MAX_BATCH_SIZE {
        return Err(FieldError::new(
            "training.batch_size",
            format!(
                "{} is larger than the limit of {MAX_BATCH_SIZE}",
                training.batch_size
            ),
        ));
    }
    match (training.steps, training.epochs) {
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                "training.epochs",
                "give either steps or epochs, not both",
            ));
        }
        (None, None) => {
            return Err(FieldError::new(
                "training.steps",
                "give either steps or epochs",
            ));
        }
        (Some(0), None) => return Err(FieldError::new("training.steps", "must be at least 1")),
        (None, Some(0)) => return Err(FieldError::new("training.epochs", "must be at least 1")),
        _ => {}
    }
    if training.accumulation_steps == 0 {
        return Err(FieldError::new(
            "training.accumulation_steps",
            "must be at least 1",
        ));
    }
    if !training
        .batch_size
        .is_multiple_of(training.accumulation_steps)
    {
        return Err(FieldError::new(
            "training.accumulation_steps",
            format!(
                "{} does not divide batch_size {}",
                training.accumulation_steps, training.batch_size
            ),
        ));
    }
    if let Some(segment) = training.recompute_segment_layers {
        let layer_count = spec.model.layers.len() as u64;
        if segment == 0 || segment > layer_count {
            return Err(FieldError::new(
                "training.recompute_segment_layers",
                format!("{segment} must be between 1 and the {layer_count} layers of the model"),
            ));
        }
    }
    match &training.optimizer {
        OptimizerSpec::Sgd(sgd) => {
            positive_finite(sgd.learning_rate, "training.optimizer.sgd.learning_rate")?;
            in_unit_interval(sgd.momentum, "training.optimizer.sgd.momentum")?;
            non_negative_finite(sgd.weight_decay, "training.optimizer.sgd.weight_decay")?;
            if sgd.nesterov && sgd.momentum == 0.0 {
                return Err(FieldError::new(
                    "training.optimizer.sgd.nesterov",
                    "needs momentum > 0",
                ));
            }
        }
        OptimizerSpec::Adam(adam) | OptimizerSpec::Adamw(adam) => {
            let prefix = format!("training.optimizer.{}", training.optimizer.kind_name());
            positive_finite(adam.learning_rate, &format!("{prefix}.learning_rate"))?;
            in_unit_interval(adam.beta1, &format!("{prefix}.beta1"))?;
            in_unit_interval(adam.beta2, &format!("{prefix}.beta2"))?;
            positive_finite(adam.epsilon, &format!("{prefix}.epsilon"))?;
            non_negative_finite(adam.weight_decay, &format!("{prefix}.weight_decay"))?;
        }
    }
    Ok(())
}
