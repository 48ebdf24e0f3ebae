//! The operand accessors against what the compiler meant: a model with every layer kind,
//! compiled under each precision, with and without recomputation, for both losses and
//! every optimizer state; each buffer an accessor names is checked by its role, owner and
//! the name of the parameter tensor it holds, and by where it came from in the graph.

use std::collections::HashSet;

use super::*;
use crate::model::{LayerOp, TensorSource};
use crate::plan::{
    BufferId, BufferSpec, ElementType, RunConfig, compile_step_plan, workspace_elements,
};
use crate::spec::Precision;
use crate::validate::{ValidatedJob, load_job_spec_toml};

/// Every layer kind: conv2d with and without bias (with and without workspace), batch
/// norm, each activation, zero padding, depthwise conv2d, two adds (one summing into a
/// gradient, one copying it), concat, both poolings, global average pooling, flatten,
/// dropout, dense with and without bias.
const EVERY_LAYER: &str = r#"
  { conv2d = { filters = 4, kernel = 3, padding = "same" }, name = "stem" },
  { batch_norm = {} },
  { relu = {}, name = "stem_out" },
  { zero_padding2d = { padding = [[0, 1], [0, 1]] } },
  { depthwise_conv2d = { kernel = 2, use_bias = false } },
  { relu6 = {} },
  { conv2d = { filters = 4, kernel = 1, use_bias = false }, name = "project" },
  { add = {}, inputs = ["project", "stem_out"], name = "block" },
  { leaky_relu = { alpha = 0.1 }, name = "left" },
  { gelu = {}, inputs = ["block"], name = "right" },
  { add = {}, inputs = ["left", "right"], name = "mixed" },
  { concat = {}, inputs = ["mixed", "block"] },
  { max_pool = { size = 2 } },
  { avg_pool = { size = 2, stride = 1, padding = "same" } },
  { sigmoid = {} },
  { tanh = {} },
  { global_avg_pool = {} },
  { flatten = {} },
  { dense = { units = 6, use_bias = false } },
  { dropout = { rate = 0.25 } },
  { dense = { units = 3 } },
"#;

fn job(loss: &str, optimizer: &str) -> ValidatedJob {
    let text = format!(
        "name = \"every-layer\"\n[model]\ninput_shape = [8, 8, 3]\nloss = \"{loss}\"\nlayers = [{EVERY_LAYER}]\n[training]\nbatch_size = 4\nsteps = 1\noptimizer = {optimizer}\n[data]\nformat = \"synthetic\"\nsamples = 8\ntest_samples = 4\n"
    );
    load_job_spec_toml(&text).unwrap_or_else(|error| panic!("{error}\n{text}"))
}

/// The jobs and configs the accessors are checked on: every precision, recomputation
/// on and off, both losses, no optimizer state, a velocity and two moments.
fn cases() -> Vec<(ValidatedJob, RunConfig)> {
    let jobs = [
        job(
            "softmax_cross_entropy",
            "{ sgd = { learning_rate = 0.1, momentum = 0.9 } }",
        ),
        job("mse", "{ adam = { learning_rate = 0.01 } }"),
        job("softmax_cross_entropy", "{ sgd = { learning_rate = 0.1 } }"),
    ];
    let mut cases = Vec::new();
    for job in jobs {
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            for recompute in [None, Some(2)] {
                let mut config = RunConfig::from_spec(&job.spec);
                config.precision = precision;
                config.recompute_segment_layers = recompute;
                cases.push((job.clone(), config));
            }
        }
    }
    cases
}

fn operations(steps: &[PlanStep]) -> impl Iterator<Item = &Operation> {
    steps.iter().filter_map(|step| match step {
        PlanStep::Run(operation) => Some(operation),
        _ => None,
    })
}

fn spec(plan: &StepPlan, id: BufferId) -> &BufferSpec {
    plan.buffer(id)
}

/// The model's name of the parameter tensor a buffer holds (weights or gradient).
fn parameter_name<'a>(plan: &StepPlan, layer: &'a LayerNode, id: BufferId) -> &'a str {
    let buffer = spec(plan, id);
    assert_eq!(buffer.owner, BufferOwner::Layer(layer.index), "{buffer:?}");
    let index = match buffer.role {
        BufferRole::Parameter { parameter } | BufferRole::Gradient { parameter } => parameter,
        other => panic!("{} holds {other:?}, not a parameter", id.0),
    };
    layer
        .parameters
        .get(index)
        .expect("a parameter of the layer")
        .name
}

fn assert_weights(plan: &StepPlan, layer: &LayerNode, parameters: LayerParameters<BufferId>) {
    let role_of = |id: BufferId| spec(plan, id).role;
    match parameters {
        LayerParameters::None => assert!(layer.parameters.is_empty(), "{}", layer.label()),
        LayerParameters::Kernel(KernelParameters { kernel, bias }) => {
            assert!(matches!(role_of(kernel), BufferRole::Parameter { .. }));
            assert_eq!(parameter_name(plan, layer, kernel), "kernel");
            let has_bias = layer.parameters.iter().any(|tensor| tensor.name == "bias");
            assert_eq!(bias.is_some(), has_bias, "{}", layer.label());
            if let Some(bias) = bias {
                assert_eq!(parameter_name(plan, layer, bias), "bias");
            }
        }
        LayerParameters::BatchNorm(batch_norm) => {
            assert_eq!(parameter_name(plan, layer, batch_norm.gamma), "gamma");
            assert_eq!(parameter_name(plan, layer, batch_norm.beta), "beta");
            assert_eq!(
                parameter_name(plan, layer, batch_norm.running_mean),
                "running_mean"
            );
            assert_eq!(
                parameter_name(plan, layer, batch_norm.running_variance),
                "running_variance"
            );
            // The running statistics stay fp32 whatever the precision.
            assert_eq!(
                spec(plan, batch_norm.running_mean).element_type,
                ElementType::F32
            );
        }
    }
}

fn assert_gradients(plan: &StepPlan, layer: &LayerNode, gradients: ParameterGradients<BufferId>) {
    for id in gradients.list() {
        assert!(matches!(spec(plan, id).role, BufferRole::Gradient { .. }));
        assert_eq!(spec(plan, id).element_type, ElementType::F32);
    }
    match gradients {
        ParameterGradients::None => {
            assert_eq!(layer.trainable_parameter_elements(), 0, "{}", layer.label())
        }
        ParameterGradients::Kernel(KernelParameters { kernel, bias }) => {
            assert_eq!(parameter_name(plan, layer, kernel), "kernel");
            if let Some(bias) = bias {
                assert_eq!(parameter_name(plan, layer, bias), "bias");
            }
        }
        ParameterGradients::BatchNorm(BatchNormGradients { gamma, beta }) => {
            assert_eq!(parameter_name(plan, layer, gamma), "gamma");
            assert_eq!(parameter_name(plan, layer, beta), "beta");
        }
    }
}

fn is_role(plan: &StepPlan, id: BufferId, role: BufferRole, owner: BufferOwner) -> bool {
    let buffer = spec(plan, id);
    buffer.role == role && buffer.owner == owner
}

/// The forward (or inference) pass of a phase, read through the accessors: each layer's
/// operands checked, and the buffer each layer's output is in, for the loss.
fn check_forward(
    plan: &StepPlan,
    job: &ValidatedJob,
    operations: &[&Operation],
    inference: bool,
) -> Vec<BufferId> {
    let graph = &job.graph;
    let input = plan
        .buffers
        .iter()
        .find(|buffer| buffer.role == BufferRole::InputSlot { slot: 0 })
        .unwrap()
        .id;
    let mut outputs: Vec<BufferId> = Vec::new();
    for operation in operations {
        let index = match operation.kind {
            OperationKind::LayerForward { layer } if !inference => layer,
            OperationKind::LayerInference { layer } if inference => layer,
            _ => continue,
        };
        let layer = &graph.layers[index];
        assert_eq!(index, outputs.len(), "forward runs in layer order");
        let operands = operation.layer_forward_operands(plan, layer).unwrap();
        let expected_inputs: Vec<BufferId> = layer
            .inputs
            .iter()
            .map(|source| match source {
                TensorSource::ModelInput => input,
                TensorSource::Layer(producer) => outputs[*producer],
            })
            .collect();
        assert_eq!(operands.inputs, expected_inputs, "{}", layer.label());
        assert_weights(plan, layer, operands.parameters);
        let owner = BufferOwner::Layer(index);
        match operands.output {
            Some(output) => {
                assert!(is_role(plan, output, BufferRole::LayerOutput, owner));
                outputs.push(output);
            }
            None => {
                assert!(layer.is_view(), "{}", layer.label());
                outputs.push(expected_inputs[0]);
            }
        }
        let side_role = match layer.op {
            LayerOp::Dropout { .. } if !inference => Some(BufferRole::DropoutMask),
            LayerOp::BatchNorm { .. } if !inference => Some(BufferRole::BatchStatistics),
            _ => None,
        };
        assert_eq!(
            operands.side_output.map(|id| spec(plan, id).role),
            side_role,
            "{}",
            layer.label()
        );
        if let Some(side) = operands.side_output {
            assert_eq!(spec(plan, side).owner, owner);
        }
        let wants_workspace = workspace_elements(layer, &plan.config).unwrap() > 0;
        assert_eq!(
            operands.workspace.is_some(),
            wants_workspace,
            "{}",
            layer.label()
        );
        if let Some(workspace) = operands.workspace {
            assert!(is_role(plan, workspace, BufferRole::Workspace, owner));
        }
        // Building the operation back from its operands gives the compiler's operation.
        assert_eq!(operands.operation(operation.kind), **operation);
    }
    assert_eq!(outputs.len(), graph.layers.len());
    outputs
}

fn check_loss(
    plan: &StepPlan,
    job: &ValidatedJob,
    operation: &Operation,
    model_output: BufferId,
) -> LossOperands {
    let operands = operation.loss_operands(plan).unwrap();
    assert_eq!(operands.output, model_output);
    assert!(is_role(
        plan,
        operands.target,
        BufferRole::TargetSlot { slot: 0 },
        BufferOwner::Data
    ));
    assert!(is_role(
        plan,
        operands.loss,
        BufferRole::LossValue,
        BufferOwner::Loss
    ));
    let cross_entropy = job.graph.loss == crate::spec::LossKind::SoftmaxCrossEntropy;
    assert_eq!(operands.probabilities.is_some(), cross_entropy);
    if let Some(probabilities) = operands.probabilities {
        assert!(is_role(
            plan,
            probabilities,
            BufferRole::Probabilities,
            BufferOwner::Loss
        ));
    }
    assert_eq!(operands.operation(operation.kind), *operation);
    operands
}

fn check_case(job: &ValidatedJob, config: &RunConfig, seen: &mut HashSet<String>) {
    let plan = compile_step_plan(job, config).unwrap();
    let graph = &job.graph;
    let what = format!("{config}, {:?}", graph.loss);

    // Setup: each master cast into the weights of the same tensor.
    let setup: Vec<&Operation> = operations(&plan.setup).collect();
    for operation in &setup {
        let operands = operation.initialize_operands(&plan).unwrap();
        assert!(config.precision.is_mixed());
        assert!(!operands.masters.is_empty());
        for (master, weights) in operands.pairs() {
            let (master, weights) = (spec(&plan, master), spec(&plan, weights));
            assert_eq!(master.owner, weights.owner);
            match (master.role, weights.role) {
                (
                    BufferRole::MasterParameter { parameter },
                    BufferRole::Parameter {
                        parameter: of_weights,
                    },
                ) => assert_eq!(parameter, of_weights),
                roles => panic!("{roles:?}"),
            }
        }
        assert_eq!(operands.operation(), **operation);
        seen.insert("initialize".into());
    }
    assert_eq!(
        setup.len(),
        usize::from(config.precision.is_mixed()),
        "{what}"
    );

    // Micro-batch: forward, loss, backward.
    let micro_batch: Vec<&Operation> = operations(&plan.micro_batch).collect();
    let outputs = check_forward(&plan, job, &micro_batch, false);
    let model_output = *outputs.last().unwrap();
    let loss_forward = micro_batch
        .iter()
        .find(|operation| operation.kind == OperationKind::LossForward)
        .unwrap();
    let loss = check_loss(&plan, job, loss_forward, model_output);
    seen.insert("loss".into());
    let loss_backward = micro_batch
        .iter()
        .find(|operation| operation.kind == OperationKind::LossBackward)
        .unwrap();
    let gradient = loss_backward.loss_gradient_operands(&plan).unwrap();
    assert_eq!(
        gradient.predictions,
        loss.probabilities.unwrap_or(model_output),
        "{what}"
    );
    assert_eq!(gradient.target, loss.target);
    assert!(is_role(
        &plan,
        gradient.output_gradient,
        BufferRole::OutputGradient,
        BufferOwner::Loss
    ));
    assert_eq!(gradient.operation(), **loss_backward);
    seen.insert("loss gradient".into());

    let mut backward_layers = Vec::new();
    for operation in &micro_batch {
        match operation.kind {
            OperationKind::LayerRecompute { layer } => {
                let operands = operation
                    .layer_forward_operands(&plan, &graph.layers[layer])
                    .unwrap();
                assert_weights(&plan, &graph.layers[layer], operands.parameters);
                assert_eq!(operands.operation(operation.kind), **operation);
                seen.insert("recompute".into());
            }
            OperationKind::LayerBackward { layer: index } => {
                let layer = &graph.layers[index];
                let owner = BufferOwner::Layer(index);
                let operands = operation.layer_backward_operands(&plan, layer).unwrap();
                if index == graph.layers.len() - 1 {
                    assert_eq!(operands.output_gradient, gradient.output_gradient);
                }
                assert!(matches!(
                    spec(&plan, operands.output_gradient).role,
                    BufferRole::InputGradient | BufferRole::OutputGradient
                ));
                // The kept inputs are the producers' outputs, or their recomputed copies.
                if layer.backward_reads_input() {
                    assert_eq!(operands.inputs.len(), layer.inputs.len());
                    for (id, source) in operands.inputs.iter().zip(&layer.inputs) {
                        let buffer = spec(&plan, *id);
                        match source {
                            TensorSource::ModelInput => {
                                assert!(matches!(buffer.role, BufferRole::InputSlot { slot: 0 }))
                            }
                            TensorSource::Layer(producer) => {
                                let producer_layer = &graph.layers[*producer];
                                if producer_layer.is_view()
                                    || config.recompute_segment_layers.is_none()
                                {
                                    assert_eq!(*id, outputs[*producer], "{}", layer.label());
                                } else {
                                    assert_eq!(buffer.role, BufferRole::LayerOutput);
                                }
                            }
                        }
                    }
                } else {
                    assert!(operands.inputs.is_empty());
                }
                assert_eq!(operands.output.is_some(), layer.backward_reads_output());
                if let Some(output) = operands.output {
                    assert!(is_role(&plan, output, BufferRole::LayerOutput, owner));
                    if config.recompute_segment_layers.is_none() {
                        assert_eq!(output, outputs[index]);
                    }
                }
                let side_role = match layer.op {
                    LayerOp::Dropout { .. } => Some(BufferRole::DropoutMask),
                    LayerOp::BatchNorm { .. } => Some(BufferRole::BatchStatistics),
                    _ => None,
                };
                assert_eq!(
                    operands.side_output.map(|id| spec(&plan, id).role),
                    side_role
                );
                assert_weights(&plan, layer, operands.parameters);
                assert_gradients(&plan, layer, operands.parameter_gradients);
                for id in operands.input_gradients {
                    assert!(is_role(&plan, *id, BufferRole::InputGradient, owner));
                }
                if matches!(layer.op, LayerOp::BatchNorm { .. } | LayerOp::Concat) {
                    assert_eq!(operands.input_gradients.len(), layer.inputs.len());
                }
                let trained = layer.trainable_parameter_elements();
                assert_eq!(
                    operands.half_gradients.is_some(),
                    config.precision.is_mixed() && trained > 0
                );
                if let Some(half) = operands.half_gradients {
                    assert!(is_role(&plan, half, BufferRole::HalfGradients, owner));
                    assert_eq!(spec(&plan, half).elements, trained);
                }
                assert_eq!(
                    operands.workspace.is_some(),
                    workspace_elements(layer, config).unwrap() > 0
                );
                assert_eq!(operands.operation(index), **operation);
                backward_layers.push(index);
                seen.insert(format!("backward {}", layer.kind_name));
            }
            OperationKind::AccumulateGradient { .. } | OperationKind::CopyGradient { .. } => {
                let operands = operation.gradient_sum_operands(&plan).unwrap();
                assert_ne!(operands.from, operands.into);
                assert_eq!(
                    spec(&plan, operands.from).elements,
                    spec(&plan, operands.into).elements
                );
                assert_eq!(operands.operation(operation.kind), **operation);
                seen.insert(format!("{:?}", std::mem::discriminant(&operation.kind)));
            }
            _ => {}
        }
    }
    // Every layer with trained parameters ran its backward.
    for layer in &graph.layers {
        if layer.trainable_parameter_elements() > 0 {
            assert!(backward_layers.contains(&layer.index), "{}", layer.label());
        }
    }

    // Update: the overflow check under fp16, then one update per trained tensor.
    let trained_tensors: usize = graph
        .layers
        .iter()
        .map(|layer| {
            layer
                .parameters
                .iter()
                .filter(|tensor| tensor.trainable)
                .count()
        })
        .sum();
    let mut updates = 0;
    let state_slots = job.spec.training.optimizer.state_tensors_per_parameter() as usize;
    for operation in operations(&plan.update) {
        match operation.kind {
            OperationKind::CheckOverflow => {
                assert_eq!(config.precision, Precision::Fp16);
                let operands = operation.overflow_operands(&plan).unwrap();
                assert_eq!(operands.gradients.len(), trained_tensors);
                assert_eq!(spec(&plan, operands.flag).role, BufferRole::OverflowFlag);
                assert_eq!(operands.operation(), *operation);
                seen.insert("overflow".into());
            }
            OperationKind::OptimizerUpdate { layer, parameter } => {
                let owner = BufferOwner::Layer(layer);
                let operands = operation.optimizer_operands(&plan).unwrap();
                assert!(is_role(
                    &plan,
                    operands.gradient,
                    BufferRole::Gradient { parameter },
                    owner
                ));
                assert!(is_role(
                    &plan,
                    operands.weights,
                    BufferRole::Parameter { parameter },
                    owner
                ));
                assert_eq!(operands.master.is_some(), config.precision.is_mixed());
                if let Some(master) = operands.master {
                    assert!(is_role(
                        &plan,
                        master,
                        BufferRole::MasterParameter { parameter },
                        owner
                    ));
                    assert_eq!(operands.updated(), master);
                } else {
                    assert_eq!(operands.updated(), operands.weights);
                }
                let states = operands.state.list();
                assert_eq!(states.len(), state_slots);
                for (slot, id) in states.iter().enumerate() {
                    assert!(is_role(
                        &plan,
                        *id,
                        BufferRole::OptimizerState { parameter, slot },
                        owner
                    ));
                }
                match (state_slots, operands.state) {
                    (0, OptimizerState::None)
                    | (1, OptimizerState::Velocity(_))
                    | (2, OptimizerState::Moments { .. }) => {}
                    other => panic!("{other:?}"),
                }
                assert_eq!(operands.operation(layer, parameter), *operation);
                updates += 1;
                seen.insert(format!("optimizer state {state_slots}"));
            }
            other => panic!("{other:?} in update"),
        }
    }
    assert_eq!(updates, trained_tensors, "{what}");

    // Evaluation: inference through every layer, then the loss.
    let evaluation: Vec<&Operation> = operations(&plan.evaluation).collect();
    let outputs = check_forward(&plan, job, &evaluation, true);
    let loss_evaluate = evaluation
        .iter()
        .find(|operation| operation.kind == OperationKind::LossEvaluate)
        .unwrap();
    check_loss(&plan, job, loss_evaluate, *outputs.last().unwrap());

    plan.check_operands(graph).unwrap();
}

#[test]
fn every_accessor_names_the_buffers_the_compiler_meant() {
    let mut seen = HashSet::new();
    for (job, config) in cases() {
        check_case(&job, &config, &mut seen);
    }
    for wanted in [
        "initialize",
        "loss",
        "loss gradient",
        "recompute",
        "overflow",
        "optimizer state 0",
        "optimizer state 1",
        "optimizer state 2",
        "backward conv2d",
        "backward depthwise_conv2d",
        "backward batch_norm",
        "backward dense",
        "backward concat",
        "backward dropout",
        "backward max_pool",
        "backward avg_pool",
        "backward global_avg_pool",
        "backward zero_padding2d",
        "backward relu",
        "backward relu6",
        "backward leaky_relu",
        "backward gelu",
        "backward sigmoid",
        "backward tanh",
    ] {
        assert!(seen.contains(wanted), "{wanted} never checked: {seen:?}");
    }
    // Both a gradient sum and a gradient copy (the add's).
    assert_eq!(
        seen.iter()
            .filter(|what| what.starts_with("Discriminant"))
            .count(),
        2,
        "{seen:?}"
    );
}

/// The first operation of `plan` whose kind `wanted` accepts.
fn find(plan: &StepPlan, wanted: impl Fn(OperationKind) -> bool) -> Operation {
    [
        &plan.setup,
        &plan.micro_batch,
        &plan.update,
        &plan.evaluation,
    ]
    .into_iter()
    .flat_map(|steps| operations(steps))
    .find(|operation| wanted(operation.kind))
    .cloned()
    .unwrap()
}

#[test]
fn an_operation_listed_in_another_order_is_an_error_not_a_wrong_buffer() {
    let job = job(
        "softmax_cross_entropy",
        "{ sgd = { learning_rate = 0.1, momentum = 0.9 } }",
    );
    let graph = &job.graph;
    let plan = compile_step_plan(&job, &RunConfig::from_spec(&job.spec)).unwrap();

    // The loss's output and target swapped.
    let mut loss = find(&plan, |kind| kind == OperationKind::LossForward);
    loss.reads.reverse();
    let error = loss.loss_operands(&plan).unwrap_err().to_string();
    assert!(error.contains("model output"), "{error}");

    // Batch norm's gamma and running mean swapped.
    let batch_norm = graph
        .layers
        .iter()
        .find(|layer| matches!(layer.op, LayerOp::BatchNorm { .. }))
        .unwrap();
    let mut forward = find(&plan, |kind| {
        kind == OperationKind::LayerForward {
            layer: batch_norm.index,
        }
    });
    let length = forward.reads.len();
    forward.reads.swap(length - 4, length - 2);
    let error = forward
        .layer_forward_operands(&plan, batch_norm)
        .unwrap_err()
        .to_string();
    assert!(error.contains("parameters"), "{error}");

    // A convolution without its workspace, and one read as another layer.
    let conv = &graph.layers[0];
    let mut forward = find(&plan, |kind| {
        kind == OperationKind::LayerForward { layer: 0 }
    });
    assert!(
        forward
            .layer_forward_operands(&plan, &graph.layers[1])
            .is_err()
    );
    forward.scratch.clear();
    let error = forward
        .layer_forward_operands(&plan, conv)
        .unwrap_err()
        .to_string();
    assert!(error.contains("workspace"), "{error}");

    // A backward whose bias gradient comes before its kernel gradient.
    let mut backward = find(&plan, |kind| {
        kind == OperationKind::LayerBackward { layer: 0 }
    });
    backward.writes.rotate_left(1);
    assert!(backward.layer_backward_operands(&plan, conv).is_err());

    // An optimizer update with its momentum where the weights belong.
    let mut update = find(&plan, |kind| {
        matches!(kind, OperationKind::OptimizerUpdate { .. })
    });
    update.writes.reverse();
    assert!(update.optimizer_operands(&plan).is_err());

    // The wrong accessor for the kind.
    let error = update.loss_operands(&plan).unwrap_err().to_string();
    assert!(error.contains("is not a loss forward"), "{error}");
}

#[test]
fn parameters_are_named_from_the_model_and_counted() {
    let job = job("mse", "{ sgd = { learning_rate = 0.1 } }");
    let graph = &job.graph;
    let batch_norm = &graph.layers[1];
    let tensors = LayerParameters::of_layer(batch_norm)
        .unwrap()
        .batch_norm()
        .unwrap();
    assert_eq!(tensors.gamma.name, "gamma");
    assert_eq!(tensors.running_variance.name, "running_variance");
    assert!(!tensors.running_mean.trainable);
    let channels = tensors.gamma.elements;
    // Batch norm's half gradients: gamma's, then beta's.
    let layout = half_gradient_layout(batch_norm)
        .unwrap()
        .batch_norm()
        .unwrap();
    assert_eq!(layout.gamma, 0..channels);
    assert_eq!(layout.beta, channels..2 * channels);

    // The conv without bias, the dense with one.
    let project = LayerParameters::of_layer(&graph.layers[6])
        .unwrap()
        .kernel()
        .unwrap();
    assert_eq!(project.kernel.name, "kernel");
    assert!(project.bias.is_none());
    let head = graph.layers.last().unwrap();
    let gradients = ParameterGradients::of_layer(head)
        .unwrap()
        .kernel()
        .unwrap();
    assert_eq!(gradients.bias.map(|tensor| tensor.name), Some("bias"));

    // Too few values, or a layer whose tensors are not its kind's.
    let error = LayerParameters::name(batch_norm, [1, 2, 3])
        .unwrap_err()
        .to_string();
    assert!(error.contains("3 parameter tensors"), "{error}");
    assert!(ParameterGradients::name(batch_norm, [1, 2, 3, 4]).is_err());
    assert_eq!(
        LayerParameters::name(&graph.layers[3], Vec::<u8>::new()).unwrap(),
        LayerParameters::None
    );
    let mut renamed = batch_norm.clone();
    renamed.parameters.swap(0, 1);
    let error = LayerParameters::of_layer(&renamed).unwrap_err().to_string();
    assert!(error.contains("gamma"), "{error}");

    // Optimizer state by slot count.
    assert_eq!(
        OptimizerState::from_slots([7, 8]).unwrap(),
        OptimizerState::Moments {
            first: 7,
            second: 8
        }
    );
    assert!(OptimizerState::from_slots([1, 2, 3]).is_err());
}

#[test]
fn every_example_reads_back_under_every_precision_and_recomputation() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    for folder in ["examples", "examples/keras", "engine/tests/specs"] {
        let mut paths: Vec<_> = std::fs::read_dir(root.join(folder))
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| {
                path.extension()
                    .is_some_and(|extension| extension == "toml")
            })
            .collect();
        paths.sort();
        for path in paths {
            let text = std::fs::read_to_string(&path).unwrap();
            let job = load_job_spec_toml(&text).unwrap_or_else(|error| panic!("{path:?}: {error}"));
            for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
                for recompute in [None, Some(2)] {
                    let mut config = RunConfig::from_spec(&job.spec);
                    config.precision = precision;
                    config.recompute_segment_layers = recompute;
                    let plan = compile_step_plan(&job, &config).unwrap();
                    if let Err(error) = plan.check_operands(&job.graph) {
                        panic!("{path:?} {config}: {error}");
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 6 * 10, "only {checked} plans checked");
}
