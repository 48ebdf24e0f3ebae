//! The cuda backend's losses: softmax cross-entropy and MSE as NVRTC kernels, which report
//! the loss sum, the correct count and any out-of-range label through the mailbox.

use carve_core::plan::{ElementType, LossGradientOperands, LossOperands};
use carve_core::spec::LossKind;

use super::device::{KernelArgument, LaunchShape};
use super::graphs::HeldBackLoss;
use super::kernels::{MAILBOX_BAD_LABEL_SAMPLE, MAILBOX_CORRECT, MAILBOX_LOSS_SUM};
use super::{CudaBackend, count, pointer, type_code};
use crate::backend::{OperationContext, OperationResult};
use crate::dispatch::LossKernels;
use crate::error::EngineError;
use crate::kernels::loss::LossError;

impl CudaBackend {
    /// The loss results a loss kernel left in the result area (waits for the GPU); an
    /// out-of-range label is a data error naming the sample.
    pub(super) fn read_loss(&self, loss: &HeldBackLoss) -> Result<OperationResult, EngineError> {
        let mailbox = self
            .device
            .read_mailbox()
            .map_err(|failure| self.fail(failure))?;
        match loss.kind {
            LossKind::SoftmaxCrossEntropy => {
                if mailbox[MAILBOX_BAD_LABEL_SAMPLE] != 0 {
                    let sample = !mailbox[MAILBOX_BAD_LABEL_SAMPLE] as usize;
                    let mut label = [0u8; 4];
                    self.device
                        .download(loss.target_address + 4 * sample as u64, &mut label)
                        .map_err(|failure| self.fail(failure))?;
                    let error = LossError::LabelOutOfRange {
                        sample,
                        label: i32::from_le_bytes(label),
                        classes: loss.per_sample,
                    };
                    return Err(EngineError::data("labels", error.to_string()));
                }
                Ok(OperationResult {
                    loss_sum: Some(f64::from_bits(mailbox[MAILBOX_LOSS_SUM])),
                    correct: Some(mailbox[MAILBOX_CORRECT] as usize),
                })
            }
            LossKind::Mse => Ok(OperationResult {
                loss_sum: Some(f64::from_bits(mailbox[MAILBOX_LOSS_SUM])),
                correct: None,
            }),
        }
    }
}

impl LossKernels for CudaBackend {
    fn loss_forward(
        &mut self,
        operands: &LossOperands,
        context: &mut OperationContext<'_>,
    ) -> Result<OperationResult, EngineError> {
        let output = self.buffer(operands.output)?;
        let target = self.buffer(operands.target)?;
        let loss_value = self.buffer(operands.loss)?;
        let batch = context.samples;
        let per_sample = context.graph.output_shape().elements() as usize;
        self.device
            .clear_mailbox()
            .map_err(|failure| self.fail(failure))?;
        let mailbox_address = self.device.mailbox_address();
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => {
                let probabilities = self.buffer(operands.probabilities.ok_or_else(|| {
                    EngineError::Backend("cross-entropy without its probabilities".into())
                })?)?;
                if probabilities.element_type != ElementType::F32
                    || target.element_type != ElementType::I32
                {
                    return Err(EngineError::Backend(
                        "cross-entropy needs fp32 probabilities and i32 labels".into(),
                    ));
                }
                self.launch(
                    "softmax_cross_entropy_forward",
                    LaunchShape::Blocks(1),
                    &[
                        pointer(output.address),
                        type_code(output.element_type),
                        pointer(target.address),
                        pointer(probabilities.address),
                        count(batch),
                        count(per_sample),
                        pointer(mailbox_address),
                        pointer(loss_value.address),
                        type_code(loss_value.element_type),
                    ],
                )?;
            }
            LossKind::Mse => {
                if target.element_type != ElementType::F32 {
                    return Err(EngineError::Backend("mse needs fp32 targets".into()));
                }
                self.launch(
                    "mse_forward",
                    LaunchShape::Blocks(1),
                    &[
                        pointer(output.address),
                        type_code(output.element_type),
                        pointer(target.address),
                        count(batch * per_sample),
                        count(per_sample),
                        count(batch),
                        pointer(mailbox_address),
                        pointer(loss_value.address),
                        type_code(loss_value.element_type),
                    ],
                )?;
            }
        }
        let loss = HeldBackLoss {
            kind: context.graph.loss,
            target_address: target.address,
            per_sample,
        };
        // A recording has not run the kernel yet: the loss is read after the graph.
        if let Some(capture) = self.graphs.capture.as_mut() {
            capture.loss = Some(loss);
            return Ok(OperationResult::default());
        }
        self.read_loss(&loss)
    }

    fn loss_backward(
        &mut self,
        operands: &LossGradientOperands,
        context: &mut OperationContext<'_>,
    ) -> Result<(), EngineError> {
        let batch = context.samples;
        let per_sample = context.graph.output_shape().elements() as usize;
        let gradient = self.buffer(operands.output_gradient)?;
        let values = self.buffer(operands.predictions)?;
        let targets = self.buffer(operands.target)?;
        let elements = batch * per_sample;
        match context.graph.loss {
            LossKind::SoftmaxCrossEntropy => self.launch(
                "softmax_cross_entropy_backward",
                LaunchShape::Elements(elements as u64),
                &[
                    pointer(values.address),
                    pointer(targets.address),
                    count(batch),
                    count(per_sample),
                    KernelArgument::F32(context.loss_gradient_scale),
                    pointer(gradient.address),
                    type_code(gradient.element_type),
                ],
            ),
            LossKind::Mse => {
                if per_sample == 0 {
                    return Ok(());
                }
                let factor = 2.0 * context.loss_gradient_scale / per_sample as f32;
                self.launch(
                    "mse_backward",
                    LaunchShape::Elements(elements as u64),
                    &[
                        pointer(values.address),
                        type_code(values.element_type),
                        pointer(targets.address),
                        count(elements),
                        KernelArgument::F32(factor),
                        pointer(gradient.address),
                        type_code(gradient.element_type),
                    ],
                )
            }
        }
    }
}
