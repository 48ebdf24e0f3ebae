//! Graph models: layers that name their inputs, `add` and `concat`, and what the step plan
//! makes of them — a tensor read by two layers lives until the later one, its gradient is
//! the sum of both readers' (summed in place), recomputation segments start only where
//! one tensor carries everything after, and a sequential list means what it always did.

use carve_core::estimator::estimate_job;
use carve_core::model::TensorSource;
use carve_core::plan::{BufferId, OperationKind, PlanStep, RunConfig, StepPlan, compile_step_plan};
use carve_core::validate::{ValidatedJob, load_job_spec_toml, parse_job_spec_json};

const SMALL_RESNET: &str = include_str!("../../engine/tests/specs/small-resnet.toml");

fn job(text: &str) -> ValidatedJob {
    load_job_spec_toml(text).unwrap_or_else(|error| panic!("{error}\n{text}"))
}

/// A spec around `layers` on an 8x8x2 input.
fn spec_with_layers(layers: &[&str]) -> String {
    format!(
        "name = \"graph\"\n[model]\ninput_shape = [8, 8, 2]\nloss = \"mse\"\nlayers = [\n{}\n]\n[training]\nbatch_size = 4\nsteps = 1\noptimizer = {{ sgd = {{ learning_rate = 0.1 }} }}\n[data]\nformat = \"synthetic\"\nsamples = 8\n",
        layers.join(",\n")
    )
}

fn rejected(layers: &[&str]) -> carve_core::FieldError {
    let text = spec_with_layers(layers);
    match load_job_spec_toml(&text) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(error) => error,
    }
}

fn plan(job: &ValidatedJob, config: &RunConfig) -> StepPlan {
    compile_step_plan(job, config).unwrap()
}

fn operations(steps: &[PlanStep]) -> Vec<&carve_core::plan::Operation> {
    steps
        .iter()
        .filter_map(|step| match step {
            PlanStep::Run(operation) => Some(operation),
            _ => None,
        })
        .collect()
}

fn position_of_free(steps: &[PlanStep], id: BufferId) -> usize {
    steps
        .iter()
        .position(|step| *step == PlanStep::Free(id))
        .unwrap()
}

#[test]
fn a_residual_graph_infers_its_shapes_and_reads() {
    let job = job(SMALL_RESNET);
    let graph = &job.graph;
    let add = &graph.layers[6];
    assert_eq!(
        add.inputs,
        vec![TensorSource::Layer(5), TensorSource::Layer(2)]
    );
    assert_eq!(graph.layers[10].inputs, vec![TensorSource::Layer(7)]);
    let concat = &graph.layers[14];
    assert_eq!(concat.output_shape.to_string(), "4x4x15");
    assert_eq!(graph.layers[0].inputs, vec![TensorSource::ModelInput]);
    assert!(!graph.is_sequential());
    // Cuts: between the stem's layers, after each add, before the head; never inside a
    // block, whose shortcut reads across it.
    assert_eq!(graph.cut_points(), vec![0, 1, 2, 3, 7, 8, 12, 15, 16]);
    assert_eq!(graph.layers[6].named_label(), "layers[6].add");
    assert_eq!(
        graph.layers[11].named_label(),
        "layers[11].add \"block2_out\""
    );
}

#[test]
fn graph_errors_name_the_layer_and_the_reason() {
    let conv = "{ conv2d = { filters = 2, kernel = 3, padding = \"same\" }";
    let unknown = rejected(&[
        &format!("{conv}, name = \"a\" }}"),
        "{ add = {}, inputs = [\"a\", \"b\"] }",
    ]);
    assert_eq!(unknown.field, "model.layers[1].inputs");
    assert!(unknown.reason.contains("`b` is not the name"), "{unknown}");

    let cycle = rejected(&[
        &format!("{conv}, name = \"a\", inputs = [\"b\"] }}"),
        &format!("{conv}, name = \"b\", inputs = [\"a\"] }}"),
    ]);
    assert_eq!(cycle.field, "model.layers[0].inputs");
    assert!(cycle.reason.contains("cycle"), "{cycle}");
    assert!(
        cycle
            .reason
            .contains("`a` (layers[0]) -> `b` (layers[1]) -> `a`"),
        "{cycle}"
    );

    let later = rejected(&[
        &format!("{conv}, name = \"a\", inputs = [\"b\"] }}"),
        &format!("{conv}, name = \"b\", inputs = [\"input\"] }}"),
        "{ add = {}, inputs = [\"a\", \"b\"] }",
    ]);
    assert!(later.reason.contains("comes later"), "{later}");

    let duplicate = rejected(&[
        &format!("{conv}, name = \"a\" }}"),
        &format!("{conv}, name = \"a\" }}"),
    ]);
    assert_eq!(duplicate.field, "model.layers[1].name");
    assert!(duplicate.reason.contains("already the name of layers[0]"));

    let mismatch = rejected(&[
        "{ conv2d = { filters = 3, kernel = 3, padding = \"same\" }, name = \"a\" }",
        "{ add = {}, inputs = [\"a\", \"input\"] }",
    ]);
    assert_eq!(mismatch.field, "model.layers[1].add");
    assert!(
        mismatch.reason.contains("8x8x3") && mismatch.reason.contains("8x8x2"),
        "{mismatch}"
    );

    let concat = rejected(&[
        "{ conv2d = { filters = 3, kernel = 3, stride = 2 }, name = \"a\" }",
        "{ concat = {}, inputs = [\"a\", \"input\"] }",
    ]);
    assert!(concat.reason.contains("same height and width"), "{concat}");

    let unread = rejected(&[
        &format!("{conv}, name = \"a\" }}"),
        "{ relu = {}, inputs = [\"input\"] }",
    ]);
    assert_eq!(unread.field, "model.layers[0]");
    assert!(unread.reason.contains("never read"), "{unread}");

    let lonely = rejected(&["{ add = {} }"]);
    assert!(lonely.reason.contains("at least two inputs"), "{lonely}");
    let two = rejected(&["{ relu = {}, inputs = [\"input\", \"input\"] }"]);
    assert!(two.reason.contains("reads one input"), "{two}");
    let reserved = rejected(&["{ relu = {}, name = \"input\" }"]);
    assert_eq!(reserved.field, "model.layers[0].name");
}

#[test]
fn naming_the_previous_layer_changes_nothing() {
    let implicit = spec_with_layers(&[
        "{ conv2d = { filters = 2, kernel = 3 } }",
        "{ relu = {} }",
        "{ flatten = {} }",
        "{ dense = { units = 3 } }",
    ]);
    let explicit = spec_with_layers(&[
        "{ conv2d = { filters = 2, kernel = 3 }, inputs = [\"input\"], name = \"c\" }",
        "{ relu = {}, inputs = [\"c\"], name = \"r\" }",
        "{ flatten = {}, inputs = [\"r\"], name = \"f\" }",
        "{ dense = { units = 3 }, inputs = [\"f\"] }",
    ]);
    let implicit = job(&implicit);
    let explicit = job(&explicit);
    assert!(implicit.graph.is_sequential() && explicit.graph.is_sequential());
    for recompute in [None, Some(2)] {
        let mut config = RunConfig::from_spec(&implicit.spec);
        config.recompute_segment_layers = recompute;
        let a = plan(&implicit, &config);
        let b = plan(&explicit, &config);
        assert_eq!(a.buffers, b.buffers);
        assert_eq!(a.micro_batch, b.micro_batch);
        assert_eq!(a.evaluation, b.evaluation);
    }
}

#[test]
fn a_sequential_spec_serializes_as_before_and_names_round_trip() {
    let spec = job(SMALL_RESNET).spec;
    let json = serde_json::to_string(&spec.model.layers[1]).unwrap();
    assert_eq!(json, r#"{"batch_norm":{"momentum":0.99,"epsilon":0.001}}"#);
    let json = serde_json::to_string(&spec.model.layers[6]).unwrap();
    assert_eq!(json, r#"{"add":{},"inputs":["block1_conv2","stem_out"]}"#);
    let whole = serde_json::to_string(&spec).unwrap();
    assert_eq!(parse_job_spec_json(&whole).unwrap(), spec);
    let two_kinds = spec_with_layers(&["{ relu = {}, tanh = {} }"]);
    let error = load_job_spec_toml(&two_kinds).unwrap_err();
    assert_eq!(error.field, "model.layers[0]");
    assert!(error.reason.contains("two layer kinds"), "{error}");
}

#[test]
fn a_tensor_read_by_two_layers_lives_until_the_later_and_its_gradient_is_summed() {
    let job = job(SMALL_RESNET);
    let config = RunConfig::from_spec(&job.spec);
    let plan = plan(&job, &config);
    let steps = &plan.micro_batch;
    let ops = operations(steps);
    // The stem output (layer 2) is read by layer 3 and by the add (layer 6): freed after
    // the add's forward, not after layer 3's.
    let forward_of = |layer: usize| {
        ops.iter()
            .find(|operation| operation.kind == OperationKind::LayerForward { layer })
            .unwrap()
    };
    let forward_operands = |layer: usize| {
        forward_of(layer)
            .layer_forward_operands(&plan, &job.graph.layers[layer])
            .unwrap()
    };
    let stem_out = forward_operands(2).output.unwrap();
    assert!(forward_operands(6).inputs.contains(&stem_out));
    let add_position = steps
        .iter()
        .position(|step| matches!(step, PlanStep::Run(op) if op.kind == OperationKind::LayerForward { layer: 6 }))
        .unwrap();
    assert!(position_of_free(steps, stem_out) > add_position);
    // Gradients of the stem output and of block 1's output come from two readers each:
    // one summed in place into the other.
    let sums: Vec<_> = ops
        .iter()
        .filter(|operation| matches!(operation.kind, OperationKind::AccumulateGradient { .. }))
        .collect();
    assert!(sums.len() >= 2, "{sums:?}");
    for sum in &sums {
        let operands = sum.gradient_sum_operands(&plan).unwrap();
        assert_ne!(operands.from, operands.into);
    }
    // Every backward runs once, and the estimate replays this plan.
    let backwards = ops
        .iter()
        .filter(|operation| matches!(operation.kind, OperationKind::LayerBackward { .. }))
        .count();
    // All but the flatten and the adds (pure gradient routing).
    assert_eq!(backwards, 17 - 3);
    let estimate = estimate_job(&job, &config).unwrap();
    assert!(estimate.peak_bytes > estimate.persistent_bytes);
}

#[test]
fn recomputation_segments_start_only_at_cut_points() {
    let job = job(SMALL_RESNET);
    let mut config = RunConfig::from_spec(&job.spec);
    let plain = estimate_job(&job, &config).unwrap();
    for segment in 1..=17 {
        config.recompute_segment_layers = Some(segment);
        let plan = plan(&job, &config);
        let cuts = job.graph.cut_points();
        // Layers recomputed together run from a cut point; each layer's recompute
        // happens at most once.
        let recomputed: Vec<usize> = operations(&plan.micro_batch)
            .iter()
            .filter_map(|operation| match operation.kind {
                OperationKind::LayerRecompute { layer } => Some(layer),
                _ => None,
            })
            .collect();
        let mut sorted = recomputed.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), recomputed.len(), "segment {segment}");
        for (position, layer) in recomputed.iter().enumerate() {
            if position == 0 || recomputed[position - 1] + 1 != *layer {
                assert!(
                    cuts.contains(layer),
                    "segment {segment}: recompute starts at {layer}"
                );
            }
        }
        let estimate = estimate_job(&job, &config).unwrap();
        assert!(estimate.peak_bytes > 0);
        // Inside a residual block even one-layer segments must span the block.
        if segment == 1 {
            assert_eq!(recomputed, vec![12, 13, 8, 9, 10, 3, 4, 5]);
        }
    }
    config.recompute_segment_layers = Some(4);
    assert!(estimate_job(&job, &config).unwrap().peak_bytes <= plain.peak_bytes);
}

#[test]
fn depthwise_convolution_zero_padding_and_relu6_infer_their_shapes() {
    let job = job(&spec_with_layers(&[
        "{ zero_padding2d = { padding = [[0, 1], [2, 3]] } }",
        "{ depthwise_conv2d = { kernel = 3, stride = 2, depth_multiplier = 3 } }",
        "{ relu6 = {} }",
        "{ zero_padding2d = { padding = 1 } }",
        "{ zero_padding2d = { padding = [1, 0] } }",
    ]));
    let layers = &job.graph.layers;
    assert_eq!(layers[0].output_shape.to_string(), "9x13x2");
    assert_eq!(layers[1].output_shape.to_string(), "4x6x6");
    // Kernel [3, 3, 2, 3] and a bias per output channel, as Keras counts them.
    assert_eq!(layers[1].trainable_parameter_elements(), 3 * 3 * 2 * 3 + 6);
    assert_eq!(layers[2].output_shape, layers[1].output_shape);
    assert_eq!(layers[3].output_shape.to_string(), "6x8x6");
    assert_eq!(layers[4].output_shape.to_string(), "8x8x6");
    let zero = rejected(&["{ depthwise_conv2d = { kernel = 3, depth_multiplier = 0 } }"]);
    assert_eq!(
        zero.field,
        "model.layers[0].depthwise_conv2d.depth_multiplier"
    );
}

/// A random graph on 6x6x2 images: a stem conv, then layers that each read one or more
/// random earlier tensors (all 6x6x4: convs, relus, batch norms, adds of two or three,
/// concats that a 1x1 conv brings back to 4 channels), every unread output summed at the
/// end, then global pooling and a dense head.
fn random_graph_spec(choices: &[(u8, usize, usize, usize)]) -> String {
    let mut layers = vec![
        "{ conv2d = { filters = 4, kernel = 3, padding = \"same\" }, name = \"t0\" }".to_string(),
    ];
    let mut tensors = vec!["t0".to_string()];
    let mut read = vec![false];
    for (kind, a, b, c) in choices {
        let pick = |index: usize| index % tensors.len();
        let (a, b, c) = (pick(*a), pick(*b), pick(*c));
        let name = format!("t{}", tensors.len());
        let quoted = |index: usize| format!("\"{}\"", tensors[index]);
        let (layer, reads) = match kind % 5 {
            0 => (
                format!(
                    "{{ conv2d = {{ filters = 4, kernel = 3, padding = \"same\" }}, name = \"{name}\", inputs = [{}] }}",
                    quoted(a)
                ),
                vec![a],
            ),
            1 => (
                format!(
                    "{{ relu = {{}}, name = \"{name}\", inputs = [{}] }}",
                    quoted(a)
                ),
                vec![a],
            ),
            2 => (
                format!(
                    "{{ batch_norm = {{}}, name = \"{name}\", inputs = [{}] }}",
                    quoted(a)
                ),
                vec![a],
            ),
            3 => (
                format!(
                    "{{ add = {{}}, name = \"{name}\", inputs = [{}, {}, {}] }}",
                    quoted(a),
                    quoted(b),
                    quoted(c)
                ),
                vec![a, b, c],
            ),
            _ => {
                layers.push(format!(
                    "{{ concat = {{}}, inputs = [{}, {}] }}",
                    quoted(a),
                    quoted(b)
                ));
                (
                    format!("{{ conv2d = {{ filters = 4, kernel = 1 }}, name = \"{name}\" }}"),
                    vec![a, b],
                )
            }
        };
        for index in reads {
            read[index] = true;
        }
        layers.push(layer);
        tensors.push(name);
        read.push(false);
    }
    let unread: Vec<String> = tensors
        .iter()
        .zip(&read)
        .filter(|(_, was_read)| !**was_read)
        .map(|(name, _)| format!("\"{name}\""))
        .collect();
    if unread.len() > 1 {
        layers.push(format!(
            "{{ add = {{}}, inputs = [{}] }}",
            unread.join(", ")
        ));
    } else {
        layers.push(format!("{{ relu = {{}}, inputs = [{}] }}", unread[0]));
    }
    layers.push("{ global_avg_pool = {} }".to_string());
    layers.push("{ dense = { units = 3 } }".to_string());
    let refs: Vec<&str> = layers.iter().map(String::as_str).collect();
    spec_with_layers(&refs)
}

/// Every buffer an operation touches is allocated and not yet freed, every phase-local
/// buffer it reads was written earlier in the phase (gradients included: a gradient is
/// complete before it is read), and every phase-local buffer is freed exactly once.
fn check_phase(plan: &StepPlan, what: &str) {
    let persistent: std::collections::HashSet<BufferId> = plan
        .setup
        .iter()
        .filter_map(|step| match step {
            PlanStep::Allocate(id) => Some(*id),
            _ => None,
        })
        .collect();
    let mut live = std::collections::HashSet::new();
    let mut written = std::collections::HashSet::new();
    let mut freed = std::collections::HashSet::new();
    for step in &plan.micro_batch {
        match step {
            PlanStep::Allocate(id) => assert!(live.insert(*id), "{what}: {id:?} allocated twice"),
            PlanStep::Free(id) => {
                assert!(live.remove(id), "{what}: {id:?} freed while not live");
                assert!(freed.insert(*id), "{what}: {id:?} freed twice");
            }
            PlanStep::Run(operation) => {
                for id in operation
                    .reads
                    .iter()
                    .chain(&operation.writes)
                    .chain(&operation.scratch)
                {
                    assert!(
                        persistent.contains(id) || live.contains(id),
                        "{what}: {:?} touches {id:?}, not allocated",
                        operation.kind
                    );
                }
                for id in &operation.reads {
                    assert!(
                        persistent.contains(id) || written.contains(id),
                        "{what}: {:?} reads {id:?} before anything wrote it",
                        operation.kind
                    );
                }
                written.extend(operation.writes.iter().copied());
            }
        }
    }
    assert!(live.is_empty(), "{what}: {live:?} never freed");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    #[test]
    fn random_graphs_compile_to_sound_plans(
        choices in proptest::collection::vec((0u8..5, 0usize..64, 0usize..64, 0usize..64), 1..14)
    ) {
        let text = random_graph_spec(&choices);
        let job = load_job_spec_toml(&text).unwrap_or_else(|error| panic!("{error}\n{text}"));
        for (precision, micro_batch_size, recompute) in [
            (carve_core::spec::Precision::Fp32, 4, None),
            (carve_core::spec::Precision::Bf16, 2, Some(1)),
            (carve_core::spec::Precision::Fp32, 4, Some(3)),
            (carve_core::spec::Precision::Fp16, 1, Some(7)),
        ] {
            let mut config = RunConfig::from_spec(&job.spec);
            config.precision = precision;
            config.micro_batch_size = micro_batch_size;
            config.recompute_segment_layers = recompute.filter(|segment| *segment <= job.graph.layers.len() as u64);
            let plan = plan(&job, &config);
            check_phase(&plan, &format!("{config}\n{text}"));
            // Every operation reads back through core's named operand accessors.
            if let Err(error) = plan.check_operands(&job.graph) {
                proptest::prop_assert!(false, "{error}\n{config}\n{text}");
            }
            let backwards: Vec<usize> = operations(&plan.micro_batch)
                .iter()
                .filter_map(|operation| match operation.kind {
                    OperationKind::LayerBackward { layer } => Some(layer),
                    _ => None,
                })
                .collect();
            for layer in &job.graph.layers {
                let expected = usize::from(!matches!(layer.op, carve_core::model::LayerOp::Add));
                let count = backwards.iter().filter(|index| **index == layer.index).count();
                proptest::prop_assert_eq!(count, expected, "{} in\n{}", layer.label(), text);
            }
            proptest::prop_assert!(estimate_job(&job, &config).is_ok());
        }
    }
}
