//! The cpu backend's merges (`add`, `concat`) and gradient sums, on f32 copies of whole
//! buffers; half-precision buffers are rounded when written back, as every kernel's are.

use super::CpuBackend;
use crate::backend::Backend;
use crate::dispatch::{LayerCall, MergeKernels, concat_layout};
use crate::error::EngineError;
use crate::kernels::merge::{accumulate, add_forward, concat_backward, concat_forward};

impl CpuBackend {
    /// Every input of a merge as f32, in order.
    fn merge_inputs(&self, call: &LayerCall<'_>) -> Result<Vec<Vec<f32>>, EngineError> {
        call.roles
            .inputs
            .iter()
            .map(|id| self.read_f32(*id))
            .collect()
    }

    fn output_of(call: &LayerCall<'_>) -> Result<carve_core::plan::BufferId, EngineError> {
        call.roles.output.ok_or_else(|| {
            EngineError::Backend(format!("{} without an output", call.layer.label()))
        })
    }
}

impl MergeKernels for CpuBackend {
    fn add_forward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError> {
        let output_id = Self::output_of(call)?;
        let elements = call.output_elements();
        let inputs = self.merge_inputs(call)?;
        let views: Vec<&[f32]> = inputs.iter().map(|values| &values[..elements]).collect();
        let mut output = self.take_f32(output_id)?;
        add_forward(&views, &mut output[..elements]);
        self.put_f32(output_id, output)
    }

    fn concat_forward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError> {
        let output_id = Self::output_of(call)?;
        let (positions, widths) = concat_layout(call);
        let inputs = self.merge_inputs(call)?;
        let views: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
        let mut output = self.take_f32(output_id)?;
        concat_forward(positions, &widths, &views, &mut output);
        self.put_f32(output_id, output)
    }

    fn concat_backward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError> {
        let gradient_id = call
            .roles
            .gradient_in
            .ok_or_else(|| call.missing("gradient"))?;
        let (positions, widths) = concat_layout(call);
        let output_gradient = self.read_f32(gradient_id)?;
        let mut gradients: Vec<Vec<f32>> = call
            .roles
            .input_gradients
            .iter()
            .map(|id| self.take_f32(*id))
            .collect::<Result<_, _>>()?;
        let mut views: Vec<&mut [f32]> = gradients.iter_mut().map(Vec::as_mut_slice).collect();
        concat_backward(positions, &widths, &output_gradient, &mut views);
        for (id, values) in call.roles.input_gradients.iter().zip(gradients) {
            self.put_f32(*id, values)?;
        }
        Ok(())
    }

    fn gradient_sum(
        &mut self,
        from: carve_core::plan::BufferId,
        into: carve_core::plan::BufferId,
        elements: usize,
        accumulate_into: bool,
    ) -> Result<(), EngineError> {
        let addend = self.read_f32(from)?;
        let mut values = self.take_f32(into)?;
        if accumulate_into {
            accumulate(&addend[..elements], &mut values[..elements]);
        } else {
            values[..elements].copy_from_slice(&addend[..elements]);
        }
        self.put_f32(into, values)
    }
}
