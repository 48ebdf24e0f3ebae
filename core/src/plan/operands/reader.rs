//! Takes an operation's buffer lists apart from the front, checking each buffer's role and
//! owner, so an accessor reads names, not positions.

use std::fmt;

use super::OperandError;
use super::parameters::*;
use crate::model::{LayerNode, LayerOp};
use crate::plan::workspace_elements;
use crate::plan::{BufferId, BufferOwner, BufferRole, Operation, OperationKind, StepPlan};

/// Takes an operation's buffers apart, one list at a time, checking each buffer's role.
pub(super) struct Reader<'a, 'p> {
    pub(super) operation: &'a Operation,
    pub(super) plan: &'p StepPlan,
}

/// One of an operation's three lists, being taken apart from the front.
pub(super) struct List<'a> {
    pub(super) name: &'static str,
    pub(super) rest: &'a [BufferId],
}

impl<'a, 'p> Reader<'a, 'p> {
    pub(super) fn new(
        operation: &'a Operation,
        plan: &'p StepPlan,
        kind_fits: bool,
        wanted: &str,
    ) -> Result<Reader<'a, 'p>, OperandError> {
        let reader = Reader { operation, plan };
        if !kind_fits {
            return Err(reader.error(format!("is not {wanted}")));
        }
        Ok(reader)
    }

    pub(super) fn error(&self, problem: impl fmt::Display) -> OperandError {
        OperandError::new(format!("{:?} {problem}", self.operation.kind))
    }

    pub(super) fn reads(&self) -> List<'a> {
        List {
            name: "reads",
            rest: &self.operation.reads,
        }
    }

    pub(super) fn writes(&self) -> List<'a> {
        List {
            name: "writes",
            rest: &self.operation.writes,
        }
    }

    pub(super) fn scratch(&self) -> List<'a> {
        List {
            name: "scratch",
            rest: &self.operation.scratch,
        }
    }

    /// Checks that `id` is a buffer of the plan whose role and owner `fits` accepts.
    pub(super) fn check(
        &self,
        id: BufferId,
        what: &str,
        fits: impl Fn(BufferRole, BufferOwner) -> bool,
    ) -> Result<BufferId, OperandError> {
        let spec = self.plan.buffers.get(id.0).ok_or_else(|| {
            self.error(format_args!(
                "names buffer {} as its {what}, which the plan does not have",
                id.0
            ))
        })?;
        if fits(spec.role, spec.owner) {
            Ok(id)
        } else {
            Err(self.error(format_args!(
                "has buffer {} ({:?} of {}) where its {what} belongs",
                id.0,
                spec.role,
                self.plan.owner_label(spec.owner)
            )))
        }
    }

    pub(super) fn one(
        &self,
        list: &mut List<'a>,
        what: &str,
        fits: impl Fn(BufferRole, BufferOwner) -> bool,
    ) -> Result<BufferId, OperandError> {
        let (first, rest) = list
            .rest
            .split_first()
            .ok_or_else(|| self.error(format_args!("lacks its {what} in {}", list.name)))?;
        list.rest = rest;
        self.check(*first, what, fits)
    }

    pub(super) fn optional(
        &self,
        list: &mut List<'a>,
        present: bool,
        what: &str,
        fits: impl Fn(BufferRole, BufferOwner) -> bool,
    ) -> Result<Option<BufferId>, OperandError> {
        if present {
            self.one(list, what, fits).map(Some)
        } else {
            Ok(None)
        }
    }

    pub(super) fn many(
        &self,
        list: &mut List<'a>,
        count: usize,
        what: &str,
        fits: impl Fn(usize, BufferRole, BufferOwner) -> bool,
    ) -> Result<&'a [BufferId], OperandError> {
        if list.rest.len() < count {
            return Err(self.error(format_args!(
                "has {} {} where its {count} {what} belong",
                list.rest.len(),
                list.name
            )));
        }
        let (taken, rest) = list.rest.split_at(count);
        list.rest = rest;
        for (position, id) in taken.iter().enumerate() {
            self.check(*id, what, |role, owner| fits(position, role, owner))?;
        }
        Ok(taken)
    }

    /// A layer's parameter buffers, in the model's order: `Parameter { parameter }` of
    /// that layer, `parameter` counting up from 0.
    pub(super) fn parameters(
        &self,
        list: &mut List<'a>,
        layer: &LayerNode,
    ) -> Result<LayerParameters<BufferId>, OperandError> {
        let owner = BufferOwner::Layer(layer.index);
        let ids = self.many(
            list,
            layer.parameters.len(),
            "parameters",
            |position, role, buffer_owner| {
                buffer_owner == owner
                    && role
                        == BufferRole::Parameter {
                            parameter: position,
                        }
            },
        )?;
        LayerParameters::name(layer, ids.iter().copied())
    }

    /// Nothing may be left in `list`.
    pub(super) fn end(&self, list: List<'a>) -> Result<(), OperandError> {
        if list.rest.is_empty() {
            Ok(())
        } else {
            Err(self.error(format_args!(
                "has {} more {} than its kind lists",
                list.rest.len(),
                list.name
            )))
        }
    }
}

/// Whether a buffer holds a tensor a layer reads: the model input or a layer's output.
pub(super) fn is_tensor(role: BufferRole) -> bool {
    matches!(role, BufferRole::LayerOutput | BufferRole::InputSlot { .. })
}

/// Whether a buffer holds the gradient of a tensor.
pub(super) fn is_tensor_gradient(role: BufferRole) -> bool {
    matches!(role, BufferRole::InputGradient | BufferRole::OutputGradient)
}

/// What a layer's forward keeps for backward besides its output.
pub(super) fn side_output_role(layer: &LayerNode) -> Option<BufferRole> {
    match layer.op {
        LayerOp::Dropout { .. } => Some(BufferRole::DropoutMask),
        LayerOp::BatchNorm { .. } => Some(BufferRole::BatchStatistics),
        _ => None,
    }
}

pub(super) fn has_workspace(layer: &LayerNode, plan: &StepPlan) -> bool {
    workspace_elements(layer, &plan.config).is_some_and(|elements| elements > 0)
}

/// Whether `layer` is the layer of a layer operation `kind`.
pub(super) fn is_layer_operation(kind: OperationKind, layer: &LayerNode, backward: bool) -> bool {
    match kind {
        OperationKind::LayerForward { layer: index }
        | OperationKind::LayerRecompute { layer: index }
        | OperationKind::LayerInference { layer: index } => !backward && index == layer.index,
        OperationKind::LayerBackward { layer: index } => backward && index == layer.index,
        _ => false,
    }
}
