//! The CUDA backend's merges (`add`, `concat`) and gradient sums: NVRTC kernels over
//! whole buffers of the compute precision, the same per-element formulas as the cpu
//! backend's (`kernels::merge`). An add of more than two inputs rounds after each sum in
//! half precision, where the cpu rounds once: equal for the two-input adds of ResNets.

use carve_core::plan::BufferId;

use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, count, pointer, type_code};
use crate::dispatch::{LayerCall, MergeKernels, concat_layout};
use crate::error::EngineError;

impl CudaBackend {
    fn same_type_buffers(
        &self,
        call: &LayerCall<'_>,
        ids: &[BufferId],
    ) -> Result<Vec<super::DeviceBuffer>, EngineError> {
        let buffers: Vec<_> = ids
            .iter()
            .map(|id| self.buffer(*id))
            .collect::<Result<_, _>>()?;
        if buffers
            .windows(2)
            .any(|pair| pair[0].element_type != pair[1].element_type)
        {
            return Err(EngineError::Backend(format!(
                "{}: inputs of different precisions",
                call.layer.label()
            )));
        }
        Ok(buffers)
    }

    fn merge_output(&self, call: &LayerCall<'_>) -> Result<super::DeviceBuffer, EngineError> {
        let id = call.roles.output.ok_or_else(|| {
            EngineError::Backend(format!("{} without an output", call.layer.label()))
        })?;
        self.buffer(id)
    }
}

impl MergeKernels for CudaBackend {
    fn add_forward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError> {
        let output = self.merge_output(call)?;
        let inputs = self.same_type_buffers(call, call.roles.inputs)?;
        let elements = call.output_elements();
        let t = output.element_type;
        let Some((first, rest)) = inputs.split_first() else {
            return Err(call.missing("inputs"));
        };
        let mut first = first.address;
        for input in rest {
            self.launch(
                "add_elements",
                LaunchShape::Elements(elements as u64),
                &[
                    pointer(first),
                    pointer(input.address),
                    pointer(output.address),
                    type_code(t),
                    count(elements),
                ],
            )?;
            first = output.address;
        }
        Ok(())
    }

    fn concat_forward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError> {
        let output = self.merge_output(call)?;
        let inputs = self.same_type_buffers(call, call.roles.inputs)?;
        let (rows, widths) = concat_layout(call);
        self.concat_launches(rows, &widths, &inputs, output, false)
    }

    fn concat_backward(&mut self, call: &LayerCall<'_>) -> Result<(), EngineError> {
        let gradient_id = call
            .roles
            .gradient_in
            .ok_or_else(|| call.missing("gradient"))?;
        let gradient = self.buffer(gradient_id)?;
        let slices = self.same_type_buffers(call, call.roles.input_gradients)?;
        let (rows, widths) = concat_layout(call);
        self.concat_launches(rows, &widths, &slices, gradient, true)
    }

    fn gradient_sum(
        &mut self,
        from: BufferId,
        into: BufferId,
        elements: usize,
        accumulate: bool,
    ) -> Result<(), EngineError> {
        let source = self.buffer(from)?;
        let target = self.buffer(into)?;
        if accumulate {
            self.launch(
                "add_elements",
                LaunchShape::Elements(elements as u64),
                &[
                    pointer(target.address),
                    pointer(source.address),
                    pointer(target.address),
                    type_code(target.element_type),
                    count(elements),
                ],
            )
        } else {
            self.convert_elements(
                source.address,
                source.element_type,
                target.address,
                target.element_type,
                elements as u64,
            )
        }
    }
}

impl CudaBackend {
    /// One `concat_rows` per input: its slice written into the joined buffer, or (`split`)
    /// read out of it.
    fn concat_launches(
        &self,
        rows: usize,
        widths: &[usize],
        parts: &[super::DeviceBuffer],
        joined: super::DeviceBuffer,
        split: bool,
    ) -> Result<(), EngineError> {
        let total: usize = widths.iter().sum();
        let mut offset = 0;
        for (part, width) in parts.iter().zip(widths) {
            let (source, destination) = if split {
                (joined.address, part.address)
            } else {
                (part.address, joined.address)
            };
            self.launch(
                "concat_rows",
                LaunchShape::Elements((rows * width) as u64),
                &[
                    pointer(source),
                    pointer(destination),
                    type_code(joined.element_type),
                    count(rows),
                    count(*width),
                    count(total),
                    count(offset),
                    KernelArgument::I32(i32::from(split)),
                ],
            )?;
            offset += width;
        }
        Ok(())
    }
}
