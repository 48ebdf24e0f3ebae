//! The cpu backend's layer kernels: each family's forward and backward on f32 copies of
//! its buffers (`Workbench`), which `LayerPasses` takes out before and puts back after.

use carve_core::model::{ActivationKind, LayerOp};
use carve_core::plan::{
    BatchNormGradients, BufferId, KernelParameters, ParameterGradients, half_gradient_layout,
};

use super::{CpuBackend, Workbench};
use crate::backend::Backend;
use crate::dispatch::{
    ActivationKernels, BatchNormKernels, ConvKernels, DenseKernels, DropoutKernels, LayerCall,
    LayerPasses, PoolKernels, Pooling, image_shape, windowed_shapes,
};
use crate::error::EngineError;
use crate::kernels::activation::{activation_backward, activation_forward};
use crate::kernels::batch_norm::{
    BatchNormSettings, batch_norm_backward, batch_norm_forward_inference,
    batch_norm_forward_training,
};
use crate::kernels::conv::{conv2d_backward, conv2d_forward};
use crate::kernels::dense::{dense_backward, dense_forward};
use crate::kernels::depthwise::{
    depthwise_conv2d_backward, depthwise_conv2d_forward, zero_padding_backward,
    zero_padding_forward,
};
use crate::kernels::dropout::{dropout_backward, dropout_forward};
use crate::kernels::optimizer::gradients_are_finite;
use crate::kernels::pool::{
    avg_pool_backward, avg_pool_forward, global_avg_pool_backward, global_avg_pool_forward,
    max_pool_backward, max_pool_forward,
};

/// A forward's buffers on the cpu: everything it writes taken out of the bench, so the
/// reads can borrow the bench while the kernel writes.
#[derive(Debug)]
pub(crate) struct CpuForward {
    bench: Workbench,
    input_id: BufferId,
    output_id: BufferId,
    statistics_id: Option<BufferId>,
    output: Vec<f32>,
    workspace: Vec<f32>,
    statistics: Vec<f32>,
    /// Batch norm's running mean and variance, taken out when a training forward runs.
    running: Option<(Vec<f32>, Vec<f32>)>,
}

/// What a forward's kernel sees of its buffers.
struct ForwardViews<'s> {
    bench: &'s Workbench,
    input: &'s [f32],
    output: &'s mut [f32],
    workspace: &'s mut Vec<f32>,
    statistics: &'s mut Vec<f32>,
    running: Option<(&'s mut [f32], &'s mut [f32])>,
}

impl CpuForward {
    fn views(&mut self, call: &LayerCall<'_>) -> ForwardViews<'_> {
        ForwardViews {
            bench: &self.bench,
            input: &self.bench.get(self.input_id)[..call.input_elements()],
            output: &mut self.output[..call.output_elements()],
            workspace: &mut self.workspace,
            statistics: &mut self.statistics,
            running: self
                .running
                .as_mut()
                .map(|(mean, variance)| (&mut mean[..], &mut variance[..])),
        }
    }
}

/// A backward's buffers on the cpu. Parameter gradients are computed into zeroed f32
/// temporaries and then added to the accumulated gradients: directly in fp32, through
/// the half scratch buffer under mixed precision (the rounding a half-precision kernel
/// would do).
#[derive(Debug)]
pub(crate) struct CpuBackward {
    bench: Workbench,
    gradient_in_id: BufferId,
    mask_id: Option<BufferId>,
    input_gradient: Option<Vec<f32>>,
    workspace: Vec<f32>,
    parameter_gradients: ParameterGradients<Vec<f32>>,
}

/// What a backward's kernel sees of its buffers.
struct BackwardViews<'s> {
    bench: &'s Workbench,
    dy: &'s [f32],
    input: Option<&'s [f32]>,
    output: Option<&'s [f32]>,
    dx: Option<&'s mut [f32]>,
    workspace: &'s mut Vec<f32>,
    parameter_gradients: ParameterGradients<&'s mut Vec<f32>>,
}

impl CpuBackward {
    fn views(&mut self, call: &LayerCall<'_>) -> BackwardViews<'_> {
        let input_elements = call.input_elements();
        let output_elements = call.output_elements();
        let bench = &self.bench;
        BackwardViews {
            bench,
            dy: &bench.get(self.gradient_in_id)[..output_elements],
            input: call.roles.input.map(|id| &bench.get(id)[..input_elements]),
            output: call
                .roles
                .output
                .map(|id| &bench.get(id)[..output_elements]),
            dx: self
                .input_gradient
                .as_mut()
                .map(|values| &mut values[..input_elements]),
            workspace: &mut self.workspace,
            parameter_gradients: self.parameter_gradients.as_mut(),
        }
    }
}

impl LayerPasses for CpuBackend {
    type Forward = CpuForward;
    type Backward = CpuBackward;

    fn initialize_parameters(
        &mut self,
        master: BufferId,
        weights: BufferId,
    ) -> Result<(), EngineError> {
        let values = self.read_f32(master)?;
        self.put_f32(weights, values)
    }

    fn gradients_are_finite(&mut self, gradients: &[BufferId]) -> Result<bool, EngineError> {
        let mut finite = true;
        for id in gradients {
            let values = self.take_f32(*id)?;
            finite &= gradients_are_finite(&values);
            self.put_f32(*id, values)?;
        }
        Ok(finite)
    }

    fn begin_forward(&mut self, call: &LayerCall<'_>) -> Result<Option<CpuForward>, EngineError> {
        let roles = &call.roles;
        let (input_id, output_id) = call.forward_buffers()?;
        let statistics_id = call.batch_statistics();
        let mut ids = vec![input_id, output_id];
        ids.extend(roles.parameters.list());
        ids.extend(statistics_id);
        ids.extend(roles.workspace);
        let mut bench = self.bench(ids)?;
        // Everything written is taken out of the bench first, so the reads can borrow it.
        let output = bench.take(output_id);
        let workspace = roles.workspace.map(|id| bench.take(id)).unwrap_or_default();
        let statistics = statistics_id.map(|id| bench.take(id)).unwrap_or_default();
        let is_batch_norm_training =
            matches!(call.layer.op, LayerOp::BatchNorm { .. }) && !call.is_inference();
        let running = if is_batch_norm_training {
            let batch_norm = call.batch_norm_parameters()?;
            Some((
                bench.take(batch_norm.running_mean),
                bench.take(batch_norm.running_variance),
            ))
        } else {
            None
        };
        Ok(Some(CpuForward {
            bench,
            input_id,
            output_id,
            statistics_id,
            output,
            workspace,
            statistics,
            running,
        }))
    }

    fn end_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: CpuForward,
    ) -> Result<(), EngineError> {
        let CpuForward {
            mut bench,
            output_id,
            statistics_id,
            output,
            workspace,
            statistics,
            running,
            ..
        } = forward;
        if let Some(id) = call.roles.workspace {
            bench.give(id, workspace);
        }
        if let Some(id) = statistics_id {
            bench.give(id, statistics);
        }
        if let Some((running_mean, running_variance)) = running {
            let batch_norm = call.batch_norm_parameters()?;
            bench.give(batch_norm.running_mean, running_mean);
            bench.give(batch_norm.running_variance, running_variance);
        }
        bench.give(output_id, output);
        self.return_bench(bench)
    }

    fn begin_backward(&mut self, call: &LayerCall<'_>) -> Result<Option<CpuBackward>, EngineError> {
        let roles = &call.roles;
        let gradient_in_id = roles
            .gradient_in
            .ok_or_else(|| EngineError::Backend("backward without a gradient".into()))?;
        let mask_id = call.dropout_mask();
        let mut ids = vec![gradient_in_id];
        ids.extend(roles.input);
        ids.extend(roles.output);
        ids.extend(roles.parameters.list());
        ids.extend(roles.side.filter(|id| Some(*id) != mask_id));
        ids.extend(roles.input_gradient);
        ids.extend(roles.workspace);
        let mut bench = self.bench(ids)?;
        let input_gradient = roles.input_gradient.map(|id| bench.take(id));
        let workspace = roles.workspace.map(|id| bench.take(id)).unwrap_or_default();
        let parameter_gradients = ParameterGradients::of_layer(call.layer)?
            .map(|tensor| vec![0.0; tensor.elements as usize]);
        Ok(Some(CpuBackward {
            bench,
            gradient_in_id,
            mask_id,
            input_gradient,
            workspace,
            parameter_gradients,
        }))
    }

    fn end_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: CpuBackward,
    ) -> Result<(), EngineError> {
        let CpuBackward {
            mut bench,
            input_gradient,
            workspace,
            mut parameter_gradients,
            ..
        } = backward;
        let roles = &call.roles;
        if let (Some(id), Some(values)) = (roles.input_gradient, input_gradient) {
            bench.give(id, values);
        }
        if let Some(id) = roles.workspace {
            bench.give(id, workspace);
        }
        self.return_bench(bench)?;
        if let Some(half_id) = roles.half_gradients {
            // Rounded through the half scratch, laid out as core says.
            let layout = half_gradient_layout(call.layer)?.list();
            let elements = layout.last().map_or(0, |range| range.end as usize);
            let mut flat = vec![0.0; elements];
            for (range, values) in layout.iter().zip(parameter_gradients.as_mut().list()) {
                flat[range.start as usize..range.end as usize].copy_from_slice(values);
            }
            self.write_f32(half_id, &flat)?;
            let rounded = self.read_f32(half_id)?;
            for (range, values) in layout.iter().zip(parameter_gradients.as_mut().list()) {
                values.copy_from_slice(&rounded[range.start as usize..range.end as usize]);
            }
        }
        let accumulated_into = roles.parameter_gradients.list();
        for (gradient_id, computed) in accumulated_into.into_iter().zip(parameter_gradients.list())
        {
            let mut accumulated = self.take_f32(gradient_id)?;
            for (sum, value) in accumulated.iter_mut().zip(computed) {
                *sum += value;
            }
            self.put_f32(gradient_id, accumulated)?;
        }
        Ok(())
    }
}

impl ConvKernels for CpuBackend {
    fn conv2d_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let KernelParameters { kernel, bias } = call.kernel_parameters()?;
        let views = forward.views(call);
        let shapes = windowed_shapes(call.layer, call.batch).expect("conv has a window");
        conv2d_forward(
            &shapes,
            views.input,
            views.bench.get(kernel),
            bias.filter(|_| use_bias).map(|id| views.bench.get(id)),
            views.output,
            views.workspace,
        );
        Ok(())
    }

    fn conv2d_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        _use_bias: bool,
    ) -> Result<(), EngineError> {
        let kernel = call.kernel_parameters()?.kernel;
        let views = backward.views(call);
        let shapes = windowed_shapes(call.layer, call.batch).expect("conv has a window");
        let gradients = kernel_gradients(call, views.parameter_gradients)?;
        conv2d_backward(
            &shapes,
            views.input.ok_or_else(|| call.missing("input"))?,
            views.bench.get(kernel),
            views.dy,
            views.dx,
            gradients.kernel,
            gradients.bias.map(Vec::as_mut_slice),
            views.workspace,
        );
        Ok(())
    }

    fn depthwise_conv2d_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        multiplier: usize,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let KernelParameters { kernel, bias } = call.kernel_parameters()?;
        let views = forward.views(call);
        depthwise_conv2d_forward(
            &Self::depthwise_shapes(call),
            multiplier,
            views.input,
            views.bench.get(kernel),
            bias.filter(|_| use_bias).map(|id| views.bench.get(id)),
            views.output,
        );
        Ok(())
    }

    fn depthwise_conv2d_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        multiplier: usize,
        _use_bias: bool,
    ) -> Result<(), EngineError> {
        let kernel = call.kernel_parameters()?.kernel;
        let views = backward.views(call);
        let gradients = kernel_gradients(call, views.parameter_gradients)?;
        depthwise_conv2d_backward(
            &Self::depthwise_shapes(call),
            multiplier,
            views.input.ok_or_else(|| call.missing("input"))?,
            views.bench.get(kernel),
            views.dy,
            views.dx,
            gradients.kernel,
            gradients.bias.map(Vec::as_mut_slice),
        );
        Ok(())
    }
}

impl CpuBackend {
    fn depthwise_shapes(call: &LayerCall<'_>) -> crate::kernels::WindowedShapes {
        windowed_shapes(call.layer, call.batch).expect("depthwise conv has a window")
    }
}

impl DenseKernels for CpuBackend {
    fn dense_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        units: usize,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let KernelParameters { kernel, bias } = call.kernel_parameters()?;
        let views = forward.views(call);
        dense_forward(
            call.batch,
            call.layer.input_shape.elements() as usize,
            units,
            views.input,
            views.bench.get(kernel),
            bias.filter(|_| use_bias).map(|id| views.bench.get(id)),
            views.output,
        );
        Ok(())
    }

    fn dense_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        units: usize,
        _use_bias: bool,
    ) -> Result<(), EngineError> {
        let kernel = call.kernel_parameters()?.kernel;
        let views = backward.views(call);
        let gradients = kernel_gradients(call, views.parameter_gradients)?;
        dense_backward(
            call.batch,
            call.layer.input_shape.elements() as usize,
            units,
            views.input.ok_or_else(|| call.missing("input"))?,
            views.bench.get(kernel),
            views.dy,
            views.dx,
            gradients.kernel,
            gradients.bias.map(Vec::as_mut_slice),
        );
        Ok(())
    }
}

impl PoolKernels for CpuBackend {
    fn pool_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        pooling: Pooling,
    ) -> Result<(), EngineError> {
        let views = forward.views(call);
        let shapes = windowed_shapes(call.layer, call.batch).expect("pool has a window");
        match pooling {
            Pooling::Max => max_pool_forward(&shapes, views.input, views.output),
            Pooling::Average => avg_pool_forward(&shapes, views.input, views.output),
        }
        Ok(())
    }

    fn pool_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        pooling: Pooling,
    ) -> Result<(), EngineError> {
        let views = backward.views(call);
        let shapes = windowed_shapes(call.layer, call.batch).expect("pool has a window");
        match pooling {
            Pooling::Max => max_pool_backward(
                &shapes,
                views.input.ok_or_else(|| call.missing("input"))?,
                views.output.ok_or_else(|| call.missing("output"))?,
                views.dy,
                views.dx.ok_or_else(|| call.missing("input gradient"))?,
            ),
            Pooling::Average => avg_pool_backward(
                &shapes,
                views.dy,
                views.dx.ok_or_else(|| call.missing("input gradient"))?,
            ),
        }
        Ok(())
    }

    fn global_avg_pool_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
    ) -> Result<(), EngineError> {
        let views = forward.views(call);
        global_avg_pool_forward(
            image_shape(call.layer.input_shape, call.batch),
            views.input,
            views.output,
        );
        Ok(())
    }

    fn global_avg_pool_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
    ) -> Result<(), EngineError> {
        let views = backward.views(call);
        global_avg_pool_backward(
            image_shape(call.layer.input_shape, call.batch),
            views.dy,
            views.dx.ok_or_else(|| call.missing("input gradient"))?,
        );
        Ok(())
    }

    fn zero_padding_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        top: usize,
        left: usize,
    ) -> Result<(), EngineError> {
        let views = forward.views(call);
        zero_padding_forward(
            image_shape(call.layer.input_shape, call.batch),
            image_shape(call.layer.output_shape, call.batch),
            top,
            left,
            views.input,
            views.output,
        );
        Ok(())
    }

    fn zero_padding_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        top: usize,
        left: usize,
    ) -> Result<(), EngineError> {
        let views = backward.views(call);
        zero_padding_backward(
            image_shape(call.layer.input_shape, call.batch),
            image_shape(call.layer.output_shape, call.batch),
            top,
            left,
            views.dy,
            views.dx.ok_or_else(|| call.missing("input gradient"))?,
        );
        Ok(())
    }
}

impl ActivationKernels for CpuBackend {
    fn activation_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        kind: ActivationKind,
    ) -> Result<(), EngineError> {
        let views = forward.views(call);
        activation_forward(kind, views.input, views.output);
        Ok(())
    }

    fn activation_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        kind: ActivationKind,
    ) -> Result<(), EngineError> {
        let views = backward.views(call);
        activation_backward(
            kind,
            views.input,
            views.output,
            views.dy,
            views.dx.ok_or_else(|| call.missing("input gradient"))?,
        );
        Ok(())
    }
}

impl BatchNormKernels for CpuBackend {
    fn batch_norm_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        momentum: f64,
        epsilon: f64,
    ) -> Result<(), EngineError> {
        let batch_norm = call.batch_norm_parameters()?;
        let settings = batch_norm_settings(call, momentum, epsilon)?;
        let views = forward.views(call);
        let parameter = |id: BufferId| views.bench.get(id);
        if call.is_inference() {
            batch_norm_forward_inference(
                &settings,
                views.input,
                parameter(batch_norm.gamma),
                parameter(batch_norm.beta),
                parameter(batch_norm.running_mean),
                parameter(batch_norm.running_variance),
                views.output,
            );
        } else {
            let running = views.running.filter(|_| call.updates_running_statistics());
            batch_norm_forward_training(
                &settings,
                views.input,
                parameter(batch_norm.gamma),
                parameter(batch_norm.beta),
                views.output,
                views.statistics,
                running,
            );
        }
        Ok(())
    }

    fn batch_norm_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        momentum: f64,
        epsilon: f64,
    ) -> Result<(), EngineError> {
        let gamma = call.batch_norm_parameters()?.gamma;
        let settings = batch_norm_settings(call, momentum, epsilon)?;
        let statistics = call.roles.side.ok_or_else(|| call.missing("statistics"))?;
        let views = backward.views(call);
        let BatchNormGradients {
            gamma: gamma_gradient,
            beta: beta_gradient,
        } = views
            .parameter_gradients
            .batch_norm()
            .ok_or_else(|| call.missing("gamma and beta gradients"))?;
        batch_norm_backward(
            &settings,
            views.input.ok_or_else(|| call.missing("input"))?,
            views.bench.get(gamma),
            views.bench.get(statistics),
            views.dy,
            views.dx.ok_or_else(|| call.missing("input gradient"))?,
            gamma_gradient,
            beta_gradient,
        );
        Ok(())
    }
}

impl DropoutKernels for CpuBackend {
    fn dropout_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CpuForward,
        rate: f64,
    ) -> Result<(), EngineError> {
        let views = forward.views(call);
        match call.dropout_mask() {
            Some(mask_id) if !call.is_inference() => {
                let mut mask = self.take_mask(mask_id)?;
                dropout_forward(
                    rate as f32,
                    call.context.seed,
                    &call.dropout_stream(),
                    views.input,
                    views.output,
                    &mut mask[..call.output_elements()],
                );
                self.put_mask(mask_id, mask)?;
            }
            _ => views.output.copy_from_slice(views.input),
        }
        Ok(())
    }

    fn dropout_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CpuBackward,
        rate: f64,
    ) -> Result<(), EngineError> {
        let mask_id = backward.mask_id.ok_or_else(|| call.missing("mask"))?;
        let views = backward.views(call);
        let mask = self.take_mask(mask_id)?;
        dropout_backward(
            rate as f32,
            &mask[..call.output_elements()],
            views.dy,
            views.dx.ok_or_else(|| call.missing("input gradient"))?,
        );
        self.put_mask(mask_id, mask)
    }
}

/// A kernel layer's computed kernel and bias gradients.
fn kernel_gradients<'v>(
    call: &LayerCall<'_>,
    gradients: ParameterGradients<&'v mut Vec<f32>>,
) -> Result<KernelParameters<&'v mut Vec<f32>>, EngineError> {
    gradients
        .kernel()
        .ok_or_else(|| call.missing("kernel gradient"))
}

fn batch_norm_settings(
    call: &LayerCall<'_>,
    momentum: f64,
    epsilon: f64,
) -> Result<BatchNormSettings, EngineError> {
    let gamma = call
        .parameter_tensors()?
        .batch_norm()
        .ok_or_else(|| call.missing("gamma"))?
        .gamma;
    Ok(BatchNormSettings {
        channels: gamma.elements as usize,
        epsilon: epsilon as f32,
        momentum: momentum as f32,
    })
}
