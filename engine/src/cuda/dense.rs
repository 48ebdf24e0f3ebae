//! The cuda backend's dense layers: cuBLAS GEMMs with fp32 accumulation, the bias and its
//! gradient through NVRTC kernels.

use carve_core::plan::KernelParameters;

use super::device::{GemmCall, LaunchShape};
use super::{CudaBackend, CudaBackward, CudaForward, count, pointer, type_code};
use crate::dispatch::{DenseKernels, LayerCall};
use crate::error::EngineError;

impl DenseKernels for CudaBackend {
    fn dense_forward(
        &mut self,
        call: &LayerCall<'_>,
        forward: &mut CudaForward,
        units: usize,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let CudaForward { input, output } = *forward;
        let element_type = output.element_type;
        let parameters = call.kernel_parameters()?;
        let kernel = self.buffer(parameters.kernel)?;
        let in_features = layer.input_shape.elements() as usize;
        // Row-major Y[N, out] = X[N, in] W[in, out] is column-major
        // Y^T = W^T X^T: m = out, n = N, k = in.
        self.device
            .gemm(&GemmCall {
                transpose_a: false,
                transpose_b: false,
                m: units,
                n: batch,
                k: in_features,
                a: kernel.address,
                lda: units,
                b: input.address,
                ldb: in_features,
                c: output.address,
                ldc: units,
                input_type: element_type,
                output_type: element_type,
                beta: 0.0,
            })
            .map_err(|failure| self.fail(failure.during(layer.label())))?;
        if let Some(bias) = self.parameter_buffer(parameters.bias.filter(|_| use_bias))? {
            self.launch(
                "add_bias_rows",
                LaunchShape::Elements(call.output_elements() as u64),
                &[
                    pointer(output.address),
                    type_code(element_type),
                    pointer(bias.address),
                    type_code(bias.element_type),
                    count(batch),
                    count(units),
                ],
            )?;
        }
        Ok(())
    }

    fn dense_backward(
        &mut self,
        call: &LayerCall<'_>,
        backward: &mut CudaBackward,
        units: usize,
        use_bias: bool,
    ) -> Result<(), EngineError> {
        let LayerCall { layer, batch, .. } = *call;
        let gradient_in = backward.gradient_in;
        let element_type = gradient_in.element_type;
        let input = backward.saved_input(call)?;
        let kernel = self.buffer(call.kernel_parameters()?.kernel)?;
        let in_features = layer.input_shape.elements() as usize;
        let KernelParameters {
            kernel: kernel_target,
            bias: bias_target,
        } = backward.kernel_targets(call)?;
        // dW[in, out] (+)= X^T dY: column-major dW^T = dY^T X, m = out, n = in, k = N.
        self.device
            .gemm(&GemmCall {
                transpose_a: false,
                transpose_b: true,
                m: units,
                n: in_features,
                k: batch,
                a: gradient_in.address,
                lda: units,
                b: input.address,
                ldb: in_features,
                c: kernel_target.address,
                ldc: units,
                input_type: element_type,
                output_type: kernel_target.element_type,
                beta: if kernel_target.accumulate { 1.0 } else { 0.0 },
            })
            .map_err(|failure| self.fail(failure.during(layer.label())))?;
        if let Some(dx) = backward.input_gradient {
            // dX[N, in] = dY W^T: column-major dX^T = W dY^T, m = in, n = N, k = out.
            self.device
                .gemm(&GemmCall {
                    transpose_a: true,
                    transpose_b: false,
                    m: in_features,
                    n: batch,
                    k: units,
                    a: kernel.address,
                    lda: units,
                    b: gradient_in.address,
                    ldb: units,
                    c: dx.address,
                    ldc: in_features,
                    input_type: element_type,
                    output_type: dx.element_type,
                    beta: 0.0,
                })
                .map_err(|failure| self.fail(failure.during(layer.label())))?;
        }
        if use_bias && let Some(bias_target) = bias_target {
            self.column_sums(gradient_in, batch as u64, units as u64, bias_target)?;
        }
        Ok(())
    }
}
