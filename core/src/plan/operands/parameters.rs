//! A layer's parameter tensors by name (kernel and bias, batch norm's four), checked
//! against the names the model gives them, and where each trained tensor's gradient lies
//! in a mixed-precision backward's half-gradient scratch.

use std::ops::Range;

use super::OperandError;
use crate::model::{LayerNode, LayerOp, ParameterTensor};

/// The parameter names the model gives each tensor (`ParameterTensor::name`).
pub(super) const KERNEL: &str = "kernel";
pub(super) const BIAS: &str = "bias";
pub(super) const GAMMA: &str = "gamma";
pub(super) const BETA: &str = "beta";
pub(super) const RUNNING_MEAN: &str = "running_mean";
pub(super) const RUNNING_VARIANCE: &str = "running_variance";

/// A kernel and an optional bias: conv2d, depthwise conv2d and dense. Both are trained, so
/// the same struct names their gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelParameters<T> {
    pub kernel: T,
    pub bias: Option<T>,
}

/// Batch norm's tensors: the trained scale and shift, and the fp32 running statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchNormParameters<T> {
    pub gamma: T,
    pub beta: T,
    pub running_mean: T,
    pub running_variance: T,
}

/// Batch norm's trained tensors (the running statistics have no gradient).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchNormGradients<T> {
    pub gamma: T,
    pub beta: T,
}

/// One `T` per parameter tensor of a layer (its buffers, its tensors, ...), by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerParameters<T> {
    /// Layers without parameters.
    None,
    Kernel(KernelParameters<T>),
    BatchNorm(BatchNormParameters<T>),
}

/// One `T` per trained parameter tensor of a layer (gradient buffers, where a kernel
/// writes them, the gradients it computed, ...), by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParameterGradients<T> {
    /// Layers without trained parameters.
    None,
    Kernel(KernelParameters<T>),
    BatchNorm(BatchNormGradients<T>),
}

/// Which named set of parameters a layer has, from its kind, checked against the names
/// (and trainability) the model gave its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ParameterSet {
    None,
    Kernel { bias: bool },
    BatchNorm,
}

impl ParameterSet {
    pub(super) fn of(layer: &LayerNode) -> Result<ParameterSet, OperandError> {
        let set = match layer.op {
            LayerOp::Conv2d { use_bias, .. }
            | LayerOp::DepthwiseConv2d { use_bias, .. }
            | LayerOp::Dense { use_bias, .. } => ParameterSet::Kernel { bias: use_bias },
            LayerOp::BatchNorm { .. } => ParameterSet::BatchNorm,
            LayerOp::MaxPool { .. }
            | LayerOp::AvgPool { .. }
            | LayerOp::GlobalAvgPool
            | LayerOp::Activation(_)
            | LayerOp::Dropout { .. }
            | LayerOp::Flatten
            | LayerOp::ZeroPadding2d { .. }
            | LayerOp::Add
            | LayerOp::Concat => ParameterSet::None,
        };
        let names: Vec<&str> = layer.parameters.iter().map(|tensor| tensor.name).collect();
        let trained: Vec<&str> = layer
            .parameters
            .iter()
            .filter(|tensor| tensor.trainable)
            .map(|tensor| tensor.name)
            .collect();
        if names != set.names() || trained != set.trained_names() {
            return Err(OperandError::new(format!(
                "{} has parameters {names:?} (trained {trained:?}); its kind has {:?} (trained {:?})",
                layer.label(),
                set.names(),
                set.trained_names()
            )));
        }
        Ok(set)
    }

    /// Every tensor, in the order the model lists them.
    pub(super) fn names(self) -> &'static [&'static str] {
        match self {
            ParameterSet::None => &[],
            ParameterSet::Kernel { bias: false } => &[KERNEL],
            ParameterSet::Kernel { bias: true } => &[KERNEL, BIAS],
            ParameterSet::BatchNorm => &[GAMMA, BETA, RUNNING_MEAN, RUNNING_VARIANCE],
        }
    }

    /// The trained tensors, in the same order.
    pub(super) fn trained_names(self) -> &'static [&'static str] {
        match self {
            ParameterSet::BatchNorm => &[GAMMA, BETA],
            other => other.names(),
        }
    }
}

/// `values` as an array of exactly `N`, or the error saying how many there were.
pub(super) fn exactly<T, const N: usize>(
    layer: &LayerNode,
    what: &str,
    values: Vec<T>,
    names: &[&str],
) -> Result<[T; N], OperandError> {
    let count = values.len();
    values.try_into().map_err(|_| {
        OperandError::new(format!(
            "{}: {count} {what}, its kind has {names:?}",
            layer.label()
        ))
    })
}

impl<T> KernelParameters<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> KernelParameters<U> {
        KernelParameters {
            kernel: f(self.kernel),
            bias: self.bias.map(f),
        }
    }

    pub(super) fn list(self) -> Vec<T> {
        std::iter::once(self.kernel).chain(self.bias).collect()
    }

    pub(super) fn from_list(
        layer: &LayerNode,
        what: &str,
        bias: bool,
        values: Vec<T>,
        names: &[&str],
    ) -> Result<KernelParameters<T>, OperandError> {
        Ok(if bias {
            let [kernel, bias] = exactly(layer, what, values, names)?;
            KernelParameters {
                kernel,
                bias: Some(bias),
            }
        } else {
            let [kernel] = exactly(layer, what, values, names)?;
            KernelParameters { kernel, bias: None }
        })
    }
}

impl<T> BatchNormParameters<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> BatchNormParameters<U> {
        BatchNormParameters {
            gamma: f(self.gamma),
            beta: f(self.beta),
            running_mean: f(self.running_mean),
            running_variance: f(self.running_variance),
        }
    }
}

impl<T> BatchNormGradients<T> {
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> BatchNormGradients<U> {
        BatchNormGradients {
            gamma: f(self.gamma),
            beta: f(self.beta),
        }
    }
}

impl<T> LayerParameters<T> {
    /// Names `values`, one per parameter tensor of `layer` in the order the model lists
    /// them (the order of the plan's `BufferRole::Parameter { parameter }` indices).
    pub fn name(
        layer: &LayerNode,
        values: impl IntoIterator<Item = T>,
    ) -> Result<LayerParameters<T>, OperandError> {
        let set = ParameterSet::of(layer)?;
        let values: Vec<T> = values.into_iter().collect();
        let names = set.names();
        let what = "parameter tensors";
        Ok(match set {
            ParameterSet::None => {
                let [] = exactly(layer, what, values, names)?;
                LayerParameters::None
            }
            ParameterSet::Kernel { bias } => LayerParameters::Kernel(KernelParameters::from_list(
                layer, what, bias, values, names,
            )?),
            ParameterSet::BatchNorm => {
                let [gamma, beta, running_mean, running_variance] =
                    exactly(layer, what, values, names)?;
                LayerParameters::BatchNorm(BatchNormParameters {
                    gamma,
                    beta,
                    running_mean,
                    running_variance,
                })
            }
        })
    }

    /// Every value, in the order the model lists the tensors.
    pub fn list(self) -> Vec<T> {
        match self {
            LayerParameters::None => Vec::new(),
            LayerParameters::Kernel(kernel) => kernel.list(),
            LayerParameters::BatchNorm(batch_norm) => vec![
                batch_norm.gamma,
                batch_norm.beta,
                batch_norm.running_mean,
                batch_norm.running_variance,
            ],
        }
    }

    pub fn map<U>(self, f: impl FnMut(T) -> U) -> LayerParameters<U> {
        match self {
            LayerParameters::None => LayerParameters::None,
            LayerParameters::Kernel(kernel) => LayerParameters::Kernel(kernel.map(f)),
            LayerParameters::BatchNorm(batch_norm) => LayerParameters::BatchNorm(batch_norm.map(f)),
        }
    }

    /// The kernel and bias of a conv2d, depthwise conv2d or dense layer.
    pub fn kernel(self) -> Option<KernelParameters<T>> {
        match self {
            LayerParameters::Kernel(kernel) => Some(kernel),
            _ => None,
        }
    }

    pub fn batch_norm(self) -> Option<BatchNormParameters<T>> {
        match self {
            LayerParameters::BatchNorm(batch_norm) => Some(batch_norm),
            _ => None,
        }
    }
}

impl<'a> LayerParameters<&'a ParameterTensor> {
    /// A layer's own parameter tensors (shapes, element counts), by name.
    pub fn of_layer(layer: &'a LayerNode) -> Result<Self, OperandError> {
        LayerParameters::name(layer, &layer.parameters)
    }
}

impl<T> ParameterGradients<T> {
    /// Names `values`, one per trained parameter tensor of `layer` in the order the model
    /// lists them.
    pub fn name(
        layer: &LayerNode,
        values: impl IntoIterator<Item = T>,
    ) -> Result<ParameterGradients<T>, OperandError> {
        let set = ParameterSet::of(layer)?;
        let values: Vec<T> = values.into_iter().collect();
        let names = set.trained_names();
        let what = "trained parameter tensors";
        Ok(match set {
            ParameterSet::None => {
                let [] = exactly(layer, what, values, names)?;
                ParameterGradients::None
            }
            ParameterSet::Kernel { bias } => ParameterGradients::Kernel(
                KernelParameters::from_list(layer, what, bias, values, names)?,
            ),
            ParameterSet::BatchNorm => {
                let [gamma, beta] = exactly(layer, what, values, names)?;
                ParameterGradients::BatchNorm(BatchNormGradients { gamma, beta })
            }
        })
    }

    /// Every value, in the order the model lists the trained tensors.
    pub fn list(self) -> Vec<T> {
        match self {
            ParameterGradients::None => Vec::new(),
            ParameterGradients::Kernel(kernel) => kernel.list(),
            ParameterGradients::BatchNorm(batch_norm) => vec![batch_norm.gamma, batch_norm.beta],
        }
    }

    pub fn map<U>(self, f: impl FnMut(T) -> U) -> ParameterGradients<U> {
        match self {
            ParameterGradients::None => ParameterGradients::None,
            ParameterGradients::Kernel(kernel) => ParameterGradients::Kernel(kernel.map(f)),
            ParameterGradients::BatchNorm(batch_norm) => {
                ParameterGradients::BatchNorm(batch_norm.map(f))
            }
        }
    }

    pub fn as_mut(&mut self) -> ParameterGradients<&mut T> {
        match self {
            ParameterGradients::None => ParameterGradients::None,
            ParameterGradients::Kernel(kernel) => ParameterGradients::Kernel(KernelParameters {
                kernel: &mut kernel.kernel,
                bias: kernel.bias.as_mut(),
            }),
            ParameterGradients::BatchNorm(batch_norm) => {
                ParameterGradients::BatchNorm(BatchNormGradients {
                    gamma: &mut batch_norm.gamma,
                    beta: &mut batch_norm.beta,
                })
            }
        }
    }

    /// The kernel's and the bias's gradients of a conv2d, depthwise conv2d or dense layer.
    pub fn kernel(self) -> Option<KernelParameters<T>> {
        match self {
            ParameterGradients::Kernel(kernel) => Some(kernel),
            _ => None,
        }
    }

    pub fn batch_norm(self) -> Option<BatchNormGradients<T>> {
        match self {
            ParameterGradients::BatchNorm(batch_norm) => Some(batch_norm),
            _ => None,
        }
    }
}

impl<'a> ParameterGradients<&'a ParameterTensor> {
    /// A layer's own trained parameter tensors, by name.
    pub fn of_layer(layer: &'a LayerNode) -> Result<Self, OperandError> {
        ParameterGradients::name(
            layer,
            layer.parameters.iter().filter(|tensor| tensor.trainable),
        )
    }
}

/// Where each trained tensor's gradient lies in a layer backward's `half_gradients`
/// scratch (mixed precision), in elements: the trained tensors one after the other, in
/// the model's order, `LayerNode::trainable_parameter_elements` in all.
pub fn half_gradient_layout(
    layer: &LayerNode,
) -> Result<ParameterGradients<Range<u64>>, OperandError> {
    let mut offset = 0;
    let ranges: Vec<Range<u64>> = layer
        .parameters
        .iter()
        .filter(|tensor| tensor.trainable)
        .map(|tensor| {
            let range = offset..offset + tensor.elements;
            offset = range.end;
            range
        })
        .collect();
    ParameterGradients::name(layer, ranges)
}
