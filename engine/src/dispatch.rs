//! The one reading of a plan operation, shared by the backends: which operation it is,
//! which buffers play which role, and which layer family's kernel runs.
//!
//! A backend implements one trait per layer family (the families of `kernels/`: conv,
//! dense, pooling, activation, batch norm, dropout, loss, optimizer) plus `LayerPasses`,
//! what it does around every layer operation; its `Backend::run` is `run_operation`. So
//! the match over operation kinds and layer kinds is written once, here, and a new layer
//! kind is a compile error in every backend until each has its kernel.

use carve_core::model::{ActivationKind, FeatureShape, LayerNode, LayerOp};
use carve_core::plan::{BufferId, BufferOwner, BufferRole, BufferSpec, Operation, OperationKind};

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

/// The ids an operation touches, sorted out by what they are for.
#[derive(Debug, Default)]
pub(crate) struct Roles {
    /// The (last) input; `inputs` has them all, in order, for merges.
    pub(crate) input: Option<BufferId>,
    pub(crate) inputs: Vec<BufferId>,
    pub(crate) output: Option<BufferId>,
    pub(crate) parameters: Vec<BufferId>,
    pub(crate) side: Option<BufferId>,
    pub(crate) gradient_in: Option<BufferId>,
    pub(crate) input_gradient: Option<BufferId>,
    /// Every input gradient written, in input order (a concat writes one per input).
    pub(crate) input_gradients: Vec<BufferId>,
    pub(crate) parameter_gradients: Vec<BufferId>,
    pub(crate) workspace: Option<BufferId>,
    pub(crate) half_gradients: Option<BufferId>,
}

pub(crate) fn sort_roles(
    operation: &Operation,
    buffers: &[BufferSpec],
    layer_index: usize,
) -> Roles {
    let mut roles = Roles::default();
    let is_backward = matches!(operation.kind, OperationKind::LayerBackward { .. });
    for (position, id) in operation.reads.iter().enumerate() {
        let spec = &buffers[id.0];
        if is_backward && position == 0 {
            roles.gradient_in = Some(*id);
            continue;
        }
        match spec.role {
            BufferRole::Parameter { .. } => roles.parameters.push(*id),
            BufferRole::DropoutMask | BufferRole::BatchStatistics => roles.side = Some(*id),
            BufferRole::LayerOutput if spec.owner == BufferOwner::Layer(layer_index) => {
                roles.output = Some(*id)
            }
            _ => {
                roles.input = Some(*id);
                roles.inputs.push(*id);
            }
        }
    }
    for id in &operation.writes {
        match buffers[id.0].role {
            BufferRole::LayerOutput => roles.output = Some(*id),
            BufferRole::DropoutMask | BufferRole::BatchStatistics => roles.side = Some(*id),
            BufferRole::InputGradient => {
                roles.input_gradient = Some(*id);
                roles.input_gradients.push(*id);
            }
            BufferRole::Gradient { .. } => roles.parameter_gradients.push(*id),
            _ => {}
        }
    }
    for id in &operation.scratch {
        match buffers[id.0].role {
            BufferRole::Workspace => roles.workspace = Some(*id),
            BufferRole::HalfGradients => roles.half_gradients = Some(*id),
            _ => {}
        }
    }
    roles
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
    pub(crate) roles: Roles,
    /// Samples in this micro-batch.
    pub(crate) batch: usize,
}

impl<'a> LayerCall<'a> {
    fn new(
        operation: &'a Operation,
        context: &'a OperationContext<'a>,
        layer_index: usize,
    ) -> LayerCall<'a> {
        LayerCall {
            operation,
            context,
            layer: &context.graph.layers[layer_index],
            layer_index,
            roles: sort_roles(operation, &context.plan.buffers, layer_index),
            batch: context.samples,
        }
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

    /// The error for a backward that lacks one of its buffers.
    pub(crate) fn missing(&self, what: &str) -> EngineError {
        EngineError::Backend(format!(
            "{} backward without its {what}",
            self.layer.label()
        ))
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
    /// The loss of the model output against the targets (`reads`: output, targets;
    /// `writes`: the loss value, then the probabilities for cross-entropy).
    fn loss_forward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError>;
    /// The loss gradient, scaled by `context.loss_gradient_scale`.
    fn loss_backward(
        &mut self,
        operation: &Operation,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError>;
}

/// An optimizer update's buffers, as the plan lists them.
#[derive(Debug)]
pub(crate) struct OptimizerBuffers {
    pub(crate) gradient: BufferId,
    /// The weights the layers compute with.
    pub(crate) weights: BufferId,
    /// The fp32 masters under mixed precision.
    pub(crate) master: Option<BufferId>,
    pub(crate) states: Vec<BufferId>,
}

impl OptimizerBuffers {
    fn of(operation: &Operation, buffers: &[BufferSpec]) -> OptimizerBuffers {
        let with_role = |matches_role: fn(&BufferRole) -> bool| {
            operation
                .writes
                .iter()
                .copied()
                .filter(move |id| matches_role(&buffers[id.0].role))
        };
        OptimizerBuffers {
            gradient: operation.reads[0],
            weights: operation.writes[0],
            master: with_role(|role| matches!(role, BufferRole::MasterParameter { .. })).next(),
            states: with_role(|role| matches!(role, BufferRole::OptimizerState { .. })).collect(),
        }
    }

    /// Where the update happens: on the fp32 masters under mixed precision (the compute
    /// copy is then rounded from them), else on the weights.
    pub(crate) fn target(&self) -> BufferId {
        self.master.unwrap_or(self.weights)
    }
}

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
    match operation.kind {
        OperationKind::InitializeParameters => {
            for (master, weights) in operation.reads.iter().zip(&operation.writes) {
                kernels.initialize_parameters(*master, *weights)?;
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
            return kernels.loss_forward(operation, context);
        }
        OperationKind::LossBackward => kernels.loss_backward(operation, context)?,
        OperationKind::AccumulateGradient { .. } | OperationKind::CopyGradient { .. } => {
            let from = operation.reads[0];
            let into = operation.writes[0];
            let spec = &context.plan.buffers[into.0];
            // Gradients are per micro-batch: a short batch sums only its own samples.
            let per_sample = spec.elements / context.plan.config.micro_batch_size.max(1);
            let elements = (per_sample as usize) * context.samples;
            let accumulate = matches!(operation.kind, OperationKind::AccumulateGradient { .. });
            kernels.gradient_sum(from, into, elements, accumulate)?;
        }
        OperationKind::CheckOverflow => {
            let finite = kernels.gradients_are_finite(&operation.reads)?;
            *context.apply_update = context.loss_scaler.update(!finite);
        }
        OperationKind::OptimizerUpdate { .. } => {
            let buffers = OptimizerBuffers::of(operation, &context.plan.buffers);
            kernels.optimizer_update(&buffers, context)?
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
    let call = LayerCall::new(operation, context, layer_index);
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
    let call = LayerCall::new(operation, context, layer_index);
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
