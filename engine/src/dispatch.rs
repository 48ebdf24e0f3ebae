//! The one reading of a plan operation, shared by the backends: which operation it is,
//! which buffers play which role, and which layer family's kernel runs. Which buffer is
//! which comes from core's operand accessors (`Operation::layer_forward_operands`,
//! `loss_operands`, ...), never from a position in the operation's lists.
//!
//! A backend implements one trait per layer family (the families of `kernels/`: conv,
//! dense, pooling, activation, batch norm, dropout, loss, optimizer) plus `LayerPasses`,
//! what it does around every layer operation; its `Backend::run` is `run_operation`. So
//! the match over operation kinds and layer kinds is written once, here, and a new layer
//! kind is a compile error in every backend until each has its kernel.

use carve_core::model::{ActivationKind, FeatureShape, LayerNode, LayerOp, ParameterTensor};
use carve_core::plan::{
    BatchNormParameters, BufferId, BufferRole, GradientSumOperands, KernelParameters,
    LayerBackwardOperands, LayerForwardOperands, LayerParameters, LossGradientOperands,
    LossOperands, Operation, OperationKind, OptimizerOperands, ParameterGradients,
};

use crate::backend::{OperationContext, OperationResult};
use crate::error::EngineError;
use crate::kernels::{ImageShape, WindowedShapes};

pub(crate) fn image_shape(shape: FeatureShape, batch: usize) -> ImageShape {
    match shape {
        FeatureShape::Image {
            height,
            width,
            channels,
        } => ImageShape {
            batch,
            height: height as usize,
            width: width as usize,
            channels: channels as usize,
        },
        FeatureShape::Flat { features } => ImageShape {
            batch,
            height: 1,
            width: 1,
            channels: features as usize,
        },
    }
}

pub(crate) fn windowed_shapes(layer: &LayerNode, batch: usize) -> Option<WindowedShapes> {
    let window = match layer.op {
        LayerOp::Conv2d { window, .. }
        | LayerOp::DepthwiseConv2d { window, .. }
        | LayerOp::MaxPool { window }
        | LayerOp::AvgPool { window } => window,
        _ => return None,
    };
    Some(WindowedShapes {
        input: image_shape(layer.input_shape, batch),
        output: image_shape(layer.output_shape, batch),
        window,
    })
}

/// The buffers of a layer operation by what they are for, forward or backward alike, as
/// core's operand accessors name them.
#[derive(Debug)]
pub(crate) struct Roles<'a> {
    /// The input of a single-input layer (`None` for a merge, which reads `inputs`).
    pub(crate) input: Option<BufferId>,
    /// Every input, in the layer's input order (for backward: those kept for it).
    pub(crate) inputs: &'a [BufferId],
    pub(crate) output: Option<BufferId>,
    pub(crate) parameters: LayerParameters<BufferId>,
    /// Dropout's mask or batch norm's statistics.
    pub(crate) side: Option<BufferId>,
    /// Backward: the gradient of the layer's output.
    pub(crate) gradient_in: Option<BufferId>,
    /// Backward: the input gradient of a single-input layer, when one is needed.
    pub(crate) input_gradient: Option<BufferId>,
    /// Backward: every input gradient written, in input order (a concat writes one per
    /// input).
    pub(crate) input_gradients: &'a [BufferId],
    /// Backward: the fp32 gradients the computed ones are added into.
    pub(crate) parameter_gradients: ParameterGradients<BufferId>,
    pub(crate) workspace: Option<BufferId>,
    pub(crate) half_gradients: Option<BufferId>,
}

/// The one buffer of a single-input layer's list.
fn sole(ids: &[BufferId]) -> Option<BufferId> {
    match ids {
        [only] => Some(*only),
        _ => None,
    }
}

impl<'a> Roles<'a> {
    fn forward(operands: LayerForwardOperands<'a>) -> Roles<'a> {
        Roles {
            input: sole(operands.inputs),
            inputs: operands.inputs,
            output: operands.output,
            parameters: operands.parameters,
            side: operands.side_output,
            gradient_in: None,
            input_gradient: None,
            input_gradients: &[],
            parameter_gradients: ParameterGradients::None,
            workspace: operands.workspace,
            half_gradients: None,
        }
    }

    fn backward(operands: LayerBackwardOperands<'a>) -> Roles<'a> {
        Roles {
            input: sole(operands.inputs),
            inputs: operands.inputs,
            output: operands.output,
            parameters: operands.parameters,
            side: operands.side_output,
            gradient_in: Some(operands.output_gradient),
            input_gradient: sole(operands.input_gradients),
            input_gradients: operands.input_gradients,
            parameter_gradients: operands.parameter_gradients,
            workspace: operands.workspace,
            half_gradients: operands.half_gradients,
        }
    }
}

/// Max or average pooling: one family, one kernel each way on both backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pooling {
    Max,
    Average,
}

/// One layer operation (forward, recompute, inference or backward) as the backends
/// read it.
#[derive(Debug)]
pub(crate) struct LayerCall<'a> {
    pub(crate) operation: &'a Operation,
    pub(crate) context: &'a OperationContext<'a>,
    pub(crate) layer: &'a LayerNode,
    pub(crate) layer_index: usize,
    pub(crate) roles: Roles<'a>,
    /// Samples in this micro-batch.
    pub(crate) batch: usize,
}

impl<'a> LayerCall<'a> {
    fn new(
        operation: &'a Operation,
        context: &'a OperationContext<'a>,
        layer_index: usize,
    ) -> Result<LayerCall<'a>, EngineError> {
        let layer = context.graph.layers.get(layer_index).ok_or_else(|| {
            EngineError::Backend(format!(
                "the plan names layer {layer_index}, the model has none"
            ))
        })?;
        let roles = if matches!(operation.kind, OperationKind::LayerBackward { .. }) {
            Roles::backward(operation.layer_backward_operands(context.plan, layer)?)
        } else {
            Roles::forward(operation.layer_forward_operands(context.plan, layer)?)
        };
        Ok(LayerCall {
            operation,
            context,
            layer,
            layer_index,
            roles,
            batch: context.samples,
        })
    }

    pub(crate) fn input_elements(&self) -> usize {
        self.batch * self.layer.input_shape.elements() as usize
    }

    pub(crate) fn output_elements(&self) -> usize {
        self.batch * self.layer.output_shape.elements() as usize
    }

    pub(crate) fn is_inference(&self) -> bool {
        matches!(self.operation.kind, OperationKind::LayerInference { .. })
    }

    /// Only the first forward of a batch counts it in batch norm's running statistics: a
    /// recomputed forward must not count it twice.
    pub(crate) fn updates_running_statistics(&self) -> bool {
        matches!(self.operation.kind, OperationKind::LayerForward { .. })
    }

    fn side_with_role(&self, role: BufferRole) -> Option<BufferId> {
        self.roles
            .side
            .filter(|id| self.context.plan.buffers[id.0].role == role)
    }

    pub(crate) fn dropout_mask(&self) -> Option<BufferId> {
        self.side_with_role(BufferRole::DropoutMask)
    }

    pub(crate) fn batch_statistics(&self) -> Option<BufferId> {
        self.side_with_role(BufferRole::BatchStatistics)
    }

    /// The stream dropout masks are drawn from: (step, micro-batch, layer), so a
    /// recomputed dropout layer draws the same mask.
    pub(crate) fn dropout_stream(&self) -> [u64; 3] {
        [
            self.context.step,
            self.context.micro_batch,
            self.layer_index as u64,
        ]
    }

    /// A forward's input and output buffers, which every forward has.
    pub(crate) fn forward_buffers(&self) -> Result<(BufferId, BufferId), EngineError> {
        let input = self
            .roles
            .input
            .ok_or_else(|| EngineError::Backend("forward without an input".into()))?;
        let output = self
            .roles
            .output
            .ok_or_else(|| EngineError::Backend("forward without an output".into()))?;
        Ok((input, output))
    }

    /// The kernel and bias of a conv2d, depthwise conv2d or dense layer.
    pub(crate) fn kernel_parameters(&self) -> Result<KernelParameters<BufferId>, EngineError> {
        self.roles
            .parameters
            .kernel()
            .ok_or_else(|| self.missing("kernel"))
    }

    /// Batch norm's gamma, beta and running statistics.
    pub(crate) fn batch_norm_parameters(
        &self,
    ) -> Result<BatchNormParameters<BufferId>, EngineError> {
        self.roles
            .parameters
            .batch_norm()
            .ok_or_else(|| self.missing("gamma, beta and running statistics"))
    }

    /// The layer's own parameter tensors (shapes, element counts), by name.
    pub(crate) fn parameter_tensors(
        &self,
    ) -> Result<LayerParameters<&'a ParameterTensor>, EngineError> {
        Ok(LayerParameters::of_layer(self.layer)?)
    }

    /// The error for an operation that lacks one of its buffers.
    pub(crate) fn missing(&self, what: &str) -> EngineError {
        let pass = match self.operation.kind {
            OperationKind::LayerBackward { .. } => "backward",
            OperationKind::LayerRecompute { .. } => "recompute",
            OperationKind::LayerInference { .. } => "inference",
            _ => "forward",
        };
        EngineError::Backend(format!("{} {pass} without its {what}", self.layer.label()))
    }
}

/// What a backend does around every layer operation, and the operations that are not a
/// layer family's: parameter initialization and the overflow check.
pub(crate) trait LayerPasses {
    /// A forward's buffers as the backend holds them while the family's kernel runs.
    type Forward;
    /// A backward's buffers as the backend holds them while the family's kernel runs.
    type Backward;

    /// `weights = master`, rounding to the weights' type.
    fn initialize_parameters(
        &mut self,
        master: BufferId,
        weights: BufferId,
    ) -> Result<(), EngineError>;
    /// Whether every value of these gradients is finite.
    fn gradients_are_finite(&mut self, gradients: &[BufferId]) -> Result<bool, EngineError>;

    /// Gets a forward's buffers ready; `None` when there is nothing to compute.
    fn begin_forward(&mut self, call: &LayerCall<'_>)
    -> Result<Option<Self::Forward>, EngineError>;
    fn end_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: Self::Forward,
    ) -> Result<(), EngineError>;
    /// Gets a backward's buffers ready; `None` when there is nothing to compute.
    fn begin_backward(
        &mut self,
        call: &LayerCall<'_>,
    ) -> Result<Option<Self::Backward>, EngineError>;
    /// Adds the computed parameter gradients into the accumulated ones.
    fn end_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: Self::Backward,
    ) -> Result<(), EngineError>;
}

pub(crate) trait ConvKernels: LayerPasses {
    fn conv2d_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        use_bias: bool,
    ) -> Result<(), EngineError>;
    fn conv2d_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        use_bias: bool,
    ) -> Result<(), EngineError>;
    fn depthwise_conv2d_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        multiplier: usize,
        use_bias: bool,
    ) -> Result<(), EngineError>;
    fn depthwise_conv2d_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        multiplier: usize,
        use_bias: bool,
    ) -> Result<(), EngineError>;
}

pub(crate) trait DenseKernels: LayerPasses {
    fn dense_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        units: usize,
        use_bias: bool,
    ) -> Result<(), EngineError>;
    fn dense_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        units: usize,
        use_bias: bool,
    ) -> Result<(), EngineError>;
}

pub(crate) trait PoolKernels: LayerPasses {
    fn pool_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        pooling: Pooling,
    ) -> Result<(), EngineError>;
    fn pool_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        pooling: Pooling,
    ) -> Result<(), EngineError>;
    fn global_avg_pool_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
    ) -> Result<(), EngineError>;
    fn global_avg_pool_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
    ) -> Result<(), EngineError>;
    /// Zeros `top` rows above and `left` columns before the image (the rest after).
    fn zero_padding_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        top: usize,
        left: usize,
    ) -> Result<(), EngineError>;
    fn zero_padding_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        top: usize,
        left: usize,
    ) -> Result<(), EngineError>;
}

pub(crate) trait ActivationKernels: LayerPasses {
    fn activation_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        kind: ActivationKind,
    ) -> Result<(), EngineError>;
    fn activation_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        kind: ActivationKind,
    ) -> Result<(), EngineError>;
}

pub(crate) trait BatchNormKernels: LayerPasses {
    fn batch_norm_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        momentum: f64,
        epsilon: f64,
    ) -> Result<(), EngineError>;
    fn batch_norm_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        momentum: f64,
        epsilon: f64,
    ) -> Result<(), EngineError>;
}

pub(crate) trait DropoutKernels: LayerPasses {
    fn dropout_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut Self::Forward,
        rate: f64,
    ) -> Result<(), EngineError>;
    fn dropout_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut Self::Backward,
        rate: f64,
    ) -> Result<(), EngineError>;
}

pub(crate) trait LossKernels {
    /// The loss of the model output against the targets, into `operands.loss` (and the
    /// probabilities for cross-entropy).
    fn loss_forward(
        &mut self,
        operands: &LossOperands,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError>;
    /// The loss gradient, scaled by `context.loss_gradient_scale`.
    fn loss_backward(
        &mut self,
        operands: &LossGradientOperands,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError>;
}

/// An optimizer update's buffers, as core names them.
pub(crate) type OptimizerBuffers = OptimizerOperands;

pub(crate) trait OptimizerKernels {
    /// One parameter's update (when `context.apply_update`), then its gradient zeroed.
    fn optimizer_update(
        &mut self,
        buffers: &OptimizerBuffers,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError>;
}

/// The merges of graph models and the gradient sums of tensors read by several layers.
/// They read and write whole buffers, so they skip `LayerPasses`.
pub(crate) trait MergeKernels {
    /// `roles.output = sum of roles.inputs`.
    fn add_forward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError>;
    /// `roles.inputs` joined along the last axis into `roles.output`.
    fn concat_forward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError>;
    /// The output gradient split into `roles.input_gradients`.
    fn concat_backward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError>;
    /// `into += from` when `accumulate`, else `into = from`, over the first `elements`.
    fn gradient_sum(
        &mut self,
        from: BufferId,
        into: BufferId,
        elements: usize,
        accumulate: bool,
    ) -> Result<(), EngineError>;
}

/// The widths along the last axis of a concat's inputs and the rows they are joined in.
pub(crate) fn concat_layout(call: &LayerCall<'_>) -> (usize, Vec<usize>) {
    let graph = call.context.graph;
    let widths: Vec<usize> = graph
        .input_shapes(call.layer)
        .into_iter()
        .map(|shape| image_shape(shape, 1).channels)
        .collect();
    let total: usize = widths.iter().sum();
    (call.output_elements() / total.max(1), widths)
}

/// Every family: what a backend implements to run plans.
pub(crate) trait OperationKernels:
    ConvKernels
    + DenseKernels
    + PoolKernels
    + ActivationKernels
    + BatchNormKernels
    + DropoutKernels
    + LossKernels
    + OptimizerKernels
    + MergeKernels
{
}

impl<K> OperationKernels for K where
    K: ConvKernels
        + DenseKernels
        + PoolKernels
        + ActivationKernels
        + BatchNormKernels
        + DropoutKernels
        + LossKernels
        + OptimizerKernels
        + MergeKernels
{
}

/// Runs one plan operation on a backend's kernels: `Backend::run` of every backend.
pub(crate) fn run_operation<K: OperationKernels>(
    kernels: &mut K,
    operation: &Operation,
    context: &mut OperationContext<'_>,
) -> Result<OperationResult, EngineError> {
    let plan = context.plan;
    match operation.kind {
        OperationKind::InitializeParameters => {
            for (master, weights) in operation.initialize_operands(plan)?.pairs() {
                kernels.initialize_parameters(master, weights)?;
            }
        }
        OperationKind::LayerForward { layer }
        | OperationKind::LayerRecompute { layer }
        | OperationKind::LayerInference { layer } => {
            layer_forward(kernels, operation, context, layer)?
        }
        OperationKind::LayerBackward { layer } => {
            layer_backward(kernels, operation, context, layer)?
        }
        OperationKind::LossForward | OperationKind::LossEvaluate => {
            return kernels.loss_forward(&operation.loss_operands(plan)?, context);
        }
        OperationKind::LossBackward => {
            kernels.loss_backward(&operation.loss_gradient_operands(plan)?, context)?
        }
        OperationKind::AccumulateGradient { .. } | OperationKind::CopyGradient { .. } => {
            let GradientSumOperands { from, into } = operation.gradient_sum_operands(plan)?;
            let spec = plan.buffer(into);
            // Gradients are per micro-batch: a short batch sums only its own samples.
            let per_sample = spec.elements / context.plan.config.micro_batch_size.max(1);
            let elements = (per_sample as usize) * context.samples;
            let accumulate = matches!(operation.kind, OperationKind::AccumulateGradient { .. });
            kernels.gradient_sum(from, into, elements, accumulate)?;
        }
        OperationKind::CheckOverflow => {
            let operands = operation.overflow_operands(plan)?;
            let finite = kernels.gradients_are_finite(operands.gradients)?;
            *context.apply_update = context.loss_scaler.update(!finite);
        }
        OperationKind::OptimizerUpdate { .. } => {
            kernels.optimizer_update(&operation.optimizer_operands(plan)?, context)?
        }
    }
    Ok(OperationResult::default())
}

fn layer_forward<K: OperationKernels>(
    kernels: &mut K,
    operation: &Operation,
    context: &OperationContext<'_>,
    layer_index: usize,
) -> Result<(), EngineError> {
    // A view (flatten) is its input's buffer read another way: nothing runs.
    if context.graph.layers[layer_index].is_view() {
        return Ok(());
    }
    let call = LayerCall::new(operation, context, layer_index)?;
    match call.layer.op {
        LayerOp::Add => return kernels.add_forward(&call),
        LayerOp::Concat => return kernels.concat_forward(&call),
        _ => {}
    }
    let Some(mut forward) = kernels.begin_forward(&call)? else {
        return Ok(());
    };
    let state = &mut forward;
    match call.layer.op {
        LayerOp::Conv2d { use_bias, .. } => kernels.conv2d_forward(&call, state, use_bias)?,
        LayerOp::DepthwiseConv2d {
            multiplier,
            use_bias,
            ..
        } => kernels.depthwise_conv2d_forward(&call, state, multiplier as usize, use_bias)?,
        LayerOp::ZeroPadding2d { top, left, .. } => {
            kernels.zero_padding_forward(&call, state, top as usize, left as usize)?
        }
        LayerOp::MaxPool { .. } => kernels.pool_forward(&call, state, Pooling::Max)?,
        LayerOp::AvgPool { .. } => kernels.pool_forward(&call, state, Pooling::Average)?,
        LayerOp::GlobalAvgPool => kernels.global_avg_pool_forward(&call, state)?,
        LayerOp::Activation(kind) => kernels.activation_forward(&call, state, kind)?,
        LayerOp::Dense { units, use_bias } => {
            kernels.dense_forward(&call, state, units as usize, use_bias)?
        }
        LayerOp::BatchNorm { momentum, epsilon } => {
            kernels.batch_norm_forward(&call, state, momentum, epsilon)?
        }
        LayerOp::Dropout { rate } => kernels.dropout_forward(&call, state, rate)?,
        LayerOp::Flatten | LayerOp::Add | LayerOp::Concat => {}
    }
    kernels.end_forward(&call, forward)
}

fn layer_backward<K: OperationKernels>(
    kernels: &mut K,
    operation: &Operation,
    context: &OperationContext<'_>,
    layer_index: usize,
) -> Result<(), EngineError> {
    let call = LayerCall::new(operation, context, layer_index)?;
    match call.layer.op {
        // An add has no backward of its own: the plan hands its gradient on.
        LayerOp::Add => return Ok(()),
        LayerOp::Concat => return kernels.concat_backward(&call),
        _ => {}
    }
    let Some(mut backward) = kernels.begin_backward(&call)? else {
        return Ok(());
    };
    let state = &mut backward;
    match call.layer.op {
        LayerOp::Conv2d { use_bias, .. } => kernels.conv2d_backward(&call, state, use_bias)?,
        LayerOp::DepthwiseConv2d {
            multiplier,
            use_bias,
            ..
        } => kernels.depthwise_conv2d_backward(&call, state, multiplier as usize, use_bias)?,
        LayerOp::ZeroPadding2d { top, left, .. } => {
            kernels.zero_padding_backward(&call, state, top as usize, left as usize)?
        }
        LayerOp::MaxPool { .. } => kernels.pool_backward(&call, state, Pooling::Max)?,
        LayerOp::AvgPool { .. } => kernels.pool_backward(&call, state, Pooling::Average)?,
        LayerOp::GlobalAvgPool => kernels.global_avg_pool_backward(&call, state)?,
        LayerOp::Activation(kind) => kernels.activation_backward(&call, state, kind)?,
        LayerOp::Dense { units, use_bias } => {
            kernels.dense_backward(&call, state, units as usize, use_bias)?
        }
        LayerOp::BatchNorm { momentum, epsilon } => {
            kernels.batch_norm_backward(&call, state, momentum, epsilon)?
        }
        LayerOp::Dropout { rate } => kernels.dropout_backward(&call, state, rate)?,
        LayerOp::Flatten | LayerOp::Add | LayerOp::Concat => {}
    }
    kernels.end_backward(&call, backward)
}
