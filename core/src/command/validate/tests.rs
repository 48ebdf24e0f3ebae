//! Reading either kind of spec, and every check of a command job naming its field.

use super::*;
use crate::spec::Precision;

/// A valid command job; tests replace one line of it or add to it.
const COMMAND_JOB: &str = r#"
name = "resnet-pytorch"
[command]
argv = ["python3", "train.py", "--batch-size", "{micro_batch}", "--accum",
        "{accumulation_steps}", "--precision", "{precision}",
        "--checkpoint-dir", "{checkpoint_dir}", "--steps", "{max_steps}"]
global_batch = 256
steps = 1000
precisions = ["fp32", "bf16"]
recompute = { argv = ["--grad-checkpointing"] }
[resources]
vram = "auto"
[oom]
strategies = ["mixed_precision", "accumulate", "recompute"]
"#;

const MODEL_JOB: &str = r#"
name = "mnist"
[model]
input_shape = [8]
loss = "mse"
layers = [{ dense = { units = 2 } }]
[training]
batch_size = 4
steps = 2
optimizer = { sgd = { learning_rate = 0.1 } }
[data]
format = "synthetic"
samples = 16
"#;

fn command_job(text: &str) -> ValidatedCommandJob {
    match load_spec_toml(text) {
        Ok(ValidatedSpec::Command(job)) => job,
        other => panic!("expected a command job, got {other:?}"),
    }
}

/// The error `text` is refused with.
fn refused(text: &str) -> FieldError {
    load_spec_toml(text).expect_err("the spec should be refused")
}

/// COMMAND_JOB with `from` replaced by `to` (which must occur).
fn edited(from: &str, to: &str) -> String {
    assert!(COMMAND_JOB.contains(from), "{from:?} is not in the spec");
    COMMAND_JOB.replacen(from, to, 1)
}

#[test]
fn reads_a_command_job_from_toml_and_json_alike() {
    let job = command_job(COMMAND_JOB);
    assert_eq!(job.spec.name, "resnet-pytorch");
    assert_eq!(job.spec.command.global_batch, 256);
    let json = serde_json::to_string(&job.spec).unwrap();
    match parse_spec_json(&json) {
        Ok(ValidatedSpec::Command(again)) => assert_eq!(again, job),
        other => panic!("expected a command job, got {other:?}"),
    }
}

#[test]
fn model_jobs_are_read_as_before() {
    let spec = load_spec_toml(MODEL_JOB).unwrap();
    assert!(matches!(spec, ValidatedSpec::Model(_)));
    assert_eq!(spec.name(), "mnist");
    let json = match &spec {
        ValidatedSpec::Model(job) => serde_json::to_string(&job.spec).unwrap(),
        ValidatedSpec::Command(_) => unreachable!(),
    };
    assert!(matches!(
        parse_spec_json(&json),
        Ok(ValidatedSpec::Model(_))
    ));
    // A model job's errors are the model parser's, unchanged.
    let broken = MODEL_JOB.replace("batch_size = 4", "batch_size = 4\nbogus = 1");
    assert_eq!(
        load_spec_toml(&broken).unwrap_err(),
        crate::validate::load_job_spec_toml(&broken).unwrap_err()
    );
    assert_eq!(
        load_spec_toml("name = [").unwrap_err(),
        crate::validate::load_job_spec_toml("name = [").unwrap_err()
    );
    assert_eq!(
        parse_spec_json("[1, 2]").unwrap_err(),
        crate::validate::parse_job_spec_json("[1, 2]")
            .map(|_| ())
            .unwrap_err()
    );
}

#[test]
fn a_spec_with_command_and_model_is_refused_naming_command() {
    let both = format!("{COMMAND_JOB}\n[model]\ninput_shape = [8]\n");
    let error = refused(&both);
    assert_eq!(error.field, "command");
    assert!(
        error.reason.contains("either [command] or [model]"),
        "{error}"
    );
    let json = r#"{"name": "x", "command": {"argv": ["a"], "global_batch": 1}, "training": {}}"#;
    assert_eq!(parse_spec_json(json).unwrap_err().field, "command");
}

#[test]
fn parse_errors_name_the_field_and_line() {
    let error = refused(&edited(
        "global_batch = 256",
        "global_batch = 256\nbatch = 3",
    ));
    assert_eq!(error.field, "command.batch");
    assert!(error.reason.contains("unknown field `batch`"), "{error}");
    assert!(error.reason.contains("(line"), "{error}");
    let error = refused(&edited("global_batch = 256\n", ""));
    assert_eq!(error.field, "command.global_batch");
    let error = refused(&edited(
        r#"precisions = ["fp32", "bf16"]"#,
        r#"precisions = ["fp32", "fp8"]"#,
    ));
    assert_eq!(error.field, "command.precisions[1]");
    let json = r#"{"name": "x", "command": {"argv": ["a"], "global_batch": "many"}}"#;
    assert_eq!(
        parse_spec_json(json).unwrap_err().field,
        "command.global_batch"
    );
}

#[test]
fn initial_config_follows_the_spec() {
    let config = command_job(COMMAND_JOB).initial_config();
    assert_eq!(
        config,
        RunConfig {
            batch_size: 256,
            micro_batch_size: 256,
            precision: Precision::Fp32,
            recompute_segment_layers: None,
            engine: None,
        }
    );
    let job = command_job(&edited(
        "global_batch = 256",
        "global_batch = 256\nmicro_batch = 64\nprecision = \"bf16\"",
    ));
    let config = job.initial_config();
    assert_eq!(config.micro_batch_size, 64);
    assert_eq!(config.accumulation_steps(), 4);
    assert_eq!(config.precision, Precision::Bf16);
    let job = command_job(&edited(
        r#"precisions = ["fp32", "bf16"]"#,
        r#"precisions = ["bf16", "fp32"]"#,
    ));
    assert_eq!(job.initial_config().precision, Precision::Bf16);
    assert_eq!(
        ValidatedSpec::Command(job.clone()).initial_config(),
        job.initial_config()
    );
}

#[test]
fn profile_micro_batches_default_to_the_first_and_a_divisor_at_most_half_of_it() {
    assert_eq!(command_job(COMMAND_JOB).profile_micro_batches(), [256, 128]);
    let job = command_job(&edited(
        "global_batch = 256",
        "global_batch = 96\nmicro_batch = 12",
    ));
    assert_eq!(job.profile_micro_batches(), [12, 6]);
    let job = command_job(&edited(
        "global_batch = 256",
        "global_batch = 21\nmicro_batch = 7",
    ));
    assert_eq!(job.profile_micro_batches(), [7, 3]);
    let job = command_job(&edited("global_batch = 256", "global_batch = 1"));
    assert_eq!(job.profile_micro_batches(), [1, 1]);
    let job = command_job(&edited(
        "[resources]",
        "profile = { steps = 3, micro_batches = [32, 8] }\n[resources]",
    ));
    assert_eq!(job.profile_micro_batches(), [32, 8]);
    assert_eq!(job.spec.command.profile.steps, 3);
}

#[test]
fn argv_and_placeholders_are_checked_with_their_path() {
    let error = refused(&edited(
        r#""--steps", "{max_steps}"]"#,
        r#""--steps", "{max_step}"]"#,
    ));
    assert_eq!(error.field, "command.argv[11]");
    assert!(
        error.reason.contains("unknown placeholder `{max_step}`"),
        "{error}"
    );
    assert!(
        error.reason.contains("{micro_batch}, {accumulation_steps}"),
        "{error}"
    );
    let error = refused(&edited(
        r#""--accum","#,
        r#""--accum={accumulation_steps","#,
    ));
    assert_eq!(error.field, "command.argv[4]");
    assert!(error.reason.contains("not closed"), "{error}");
    let error = refused(&edited(r#""--accum","#, r#""--accum}","#));
    assert_eq!(error.field, "command.argv[4]");
    assert!(error.reason.contains("closes nothing"), "{error}");
    // Escaped braces are fine.
    command_job(&edited(r#""--accum","#, r#""--json={{\"a\": 1}}","#));
    let error = refused(&edited(
        "recompute = { argv = [\"--grad-checkpointing\"] }",
        "recompute = { argv = [\"--ckpt={segments}\"] }",
    ));
    assert_eq!(error.field, "command.recompute.argv[0]");
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nenv = { SEED = \"{seed}\" }\n",
    ));
    assert_eq!(error.field, "command.env.SEED");
    let error = refused(&edited("argv = [\"python3\"", "argv = [\"\""));
    assert_eq!(error.field, "command.argv[0]");
    let empty =
        "name = \"x\"\n[command]\nargv = []\nglobal_batch = 1\n[resources]\nvram = \"1GiB\"\n";
    assert_eq!(refused(empty).field, "command.argv");
    let error = refused(&edited("\"--accum\",", "\"--ac\\u0000cum\","));
    assert_eq!(error.field, "command.argv[4]");
}

#[test]
fn max_steps_needs_steps_and_auto_vram_needs_max_steps() {
    let error = refused(&edited("steps = 1000\n", ""));
    assert_eq!(error.field, "command.steps");
    assert!(error.reason.contains("command.argv[11]"), "{error}");
    assert_eq!(
        refused(&edited("steps = 1000", "steps = 0")).field,
        "command.steps"
    );
    let without_max_steps = edited(r#", "--steps", "{max_steps}"]"#, "]");
    let error = refused(&without_max_steps);
    assert_eq!(error.field, "command.argv");
    assert!(error.reason.contains("{max_steps}"), "{error}");
    // A declared slice needs no profile; {max_steps} in env also lets it stop.
    command_job(&without_max_steps.replace("vram = \"auto\"", "vram = \"8GiB\""));
    command_job(&without_max_steps.replace(
        "steps = 1000\n",
        "steps = 1000\nenv = { TRAIN_STEPS = \"{max_steps}\" }\n",
    ));
    // In the recompute arguments alone it does not count: the profile runs without them.
    let error = refused(&without_max_steps.replace(
        "[\"--grad-checkpointing\"]",
        "[\"--grad-checkpointing\", \"--steps={max_steps}\"]",
    ));
    assert_eq!(error.field, "command.argv");
}

#[test]
fn environment_names_must_be_valid_and_not_carves() {
    for (name, field) in [
        ("CARVE_SLICE_BYTES", "command.env.CARVE_SLICE_BYTES"),
        ("LD_PRELOAD", "command.env.LD_PRELOAD"),
        ("CUDA_VISIBLE_DEVICES", "command.env.CUDA_VISIBLE_DEVICES"),
        ("\"1ABC\"", "command.env.1ABC"),
        ("\"A-B\"", "command.env.A-B"),
    ] {
        let error = refused(&edited(
            "steps = 1000\n",
            &format!("steps = 1000\nenv = {{ {name} = \"1\" }}\n"),
        ));
        assert_eq!(error.field, field);
    }
    let job = command_job(&edited(
        "steps = 1000\n",
        "steps = 1000\nenv = { OMP_NUM_THREADS = \"4\", _PRIVATE = \"{precision}\" }\n",
    ));
    assert_eq!(job.spec.command.env.len(), 2);
}

#[test]
fn read_only_paths_must_be_absolute_and_are_named_by_their_index() {
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nread_only_paths = [\"/data/digits\", \"venv\"]\n",
    ));
    assert_eq!(error.field, "command.read_only_paths[1]");
    let job = command_job(&edited(
        "steps = 1000\n",
        "steps = 1000\nread_only_paths = [\"/data/digits\"]\n",
    ));
    assert_eq!(job.spec.command.read_only_paths, ["/data/digits"]);
}

#[test]
fn image_and_its_pull_secret_are_checked_naming_the_field() {
    let job = command_job(&edited(
        "steps = 1000\n",
        "steps = 1000\nimage = \"127.0.0.1:5000/team/train:2.5\"\nimage_pull_secret = \"team-registry\"\n",
    ));
    assert_eq!(
        job.spec.command.image.as_deref(),
        Some("127.0.0.1:5000/team/train:2.5")
    );
    assert_eq!(
        job.spec.command.image_pull_secret.as_deref(),
        Some("team-registry")
    );
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nimage = \"Team/Train:latest\"\n",
    ));
    assert_eq!(error.field, "command.image");
    assert!(error.reason.contains("lowercase"), "{}", error.reason);
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nimage = \"team/train\"\nimage_pull_secret = \"alice:hunter2\"\n",
    ));
    assert_eq!(error.field, "command.image_pull_secret");
    assert!(!error.reason.contains("hunter2"), "{}", error.reason);
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nimage_pull_secret = \"team-registry\"\n",
    ));
    assert_eq!(error.field, "command.image_pull_secret");
    assert!(error.reason.contains("command.image"), "{}", error.reason);
}

#[test]
fn working_directory_must_be_absolute() {
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nworking_directory = \"runs/a\"\n",
    ));
    assert_eq!(error.field, "command.working_directory");
    let error = refused(&edited(
        "steps = 1000\n",
        "steps = 1000\nworking_directory = \"/srv/\\u0000runs\"\n",
    ));
    assert_eq!(error.field, "command.working_directory");
    command_job(&edited(
        "steps = 1000\n",
        "steps = 1000\nworking_directory = \"/srv/runs\"\n",
    ));
}

#[test]
fn batches_must_divide() {
    assert_eq!(
        refused(&edited("global_batch = 256", "global_batch = 0")).field,
        "command.global_batch"
    );
    let error = refused(&edited("global_batch = 256", "global_batch = 99999999999"));
    assert_eq!(error.field, "command.global_batch");
    assert!(error.reason.contains("limit"), "{error}");
    let error = refused(&edited(
        "global_batch = 256",
        "global_batch = 256\nmicro_batch = 48",
    ));
    assert_eq!(error.field, "command.micro_batch");
    assert!(error.reason.contains("does not divide"), "{error}");
    assert_eq!(
        refused(&edited(
            "global_batch = 256",
            "global_batch = 256\nmicro_batch = 0"
        ))
        .field,
        "command.micro_batch"
    );
    let error = refused(&edited(
        "[resources]",
        "profile = { micro_batches = [64, 3] }\n[resources]",
    ));
    assert_eq!(error.field, "command.profile.micro_batches[1]");
    let error = refused(&edited(
        "[resources]",
        "profile = { steps = 0 }\n[resources]",
    ));
    assert_eq!(error.field, "command.profile.steps");
}

#[test]
fn precisions_are_checked() {
    let error = refused(&edited(
        r#"precisions = ["fp32", "bf16"]"#,
        "precisions = []",
    ));
    assert_eq!(error.field, "command.precisions");
    let error = refused(&edited(
        r#"precisions = ["fp32", "bf16"]"#,
        r#"precisions = ["fp32", "bf16", "fp32"]"#,
    ));
    assert_eq!(error.field, "command.precisions[2]");
    let error = refused(&edited(
        "steps = 1000",
        "steps = 1000\nprecision = \"fp16\"",
    ));
    assert_eq!(error.field, "command.precision");
    assert!(error.reason.contains("fp32, bf16"), "{error}");
}

#[test]
fn a_vram_written_as_a_bare_small_number_is_refused_as_a_missing_unit() {
    // `vram = 2` meant 2 GiB; taken as bytes it ran the program in a "2 B slice".
    for written in ["vram = 2", "vram = \"2\"", "vram = 1048575"] {
        let error = refused(&edited("vram = \"auto\"", written));
        assert_eq!(error.field, "resources.vram", "{written}");
        assert!(
            error.reason.contains("write the unit"),
            "{written}: {error}"
        );
    }
    let job = command_job(&edited("vram = \"auto\"", "vram = \"2 GiB\""));
    assert_eq!(job.spec.resources.vram, VramRequest::Bytes(2 << 30));
}

#[test]
fn resources_and_oom_policy_are_checked_as_for_model_jobs() {
    assert_eq!(
        refused(&edited("vram = \"auto\"", "vram = 0")).field,
        "resources.vram"
    );
    for gpus in [0, 65] {
        let error = refused(&edited(
            "vram = \"auto\"",
            &format!("vram = \"auto\"\ngpus = {gpus}"),
        ));
        assert_eq!(error.field, "resources.gpus", "{gpus}");
        assert!(error.reason.contains("between 1 and 64"), "{error}");
    }
    assert_eq!(
        refused(&edited(
            "vram = \"auto\"",
            "vram = \"auto\"\nplacement = \"everywhere\""
        ))
        .field,
        "resources.placement"
    );
    let error = refused(&edited("[oom]", "[oom]\nmin_micro_batch = 512"));
    assert_eq!(error.field, "oom.min_micro_batch");
    assert!(error.reason.contains("command.global_batch 256"), "{error}");
    let error = refused(&edited(
        r#"strategies = ["mixed_precision", "accumulate", "recompute"]"#,
        r#"strategies = ["accumulate", "accumulate"]"#,
    ));
    assert_eq!(error.field, "oom.strategies[1]");
    assert_eq!(
        refused(&edited("[oom]", "[oom]\nhalf_precision = \"fp32\"")).field,
        "oom.half_precision"
    );
}

#[test]
fn strategies_a_command_job_cannot_use_are_refused() {
    let error = refused(&edited(
        r#"strategies = ["mixed_precision", "accumulate", "recompute"]"#,
        r#"strategies = ["accumulate", "workspace"]"#,
    ));
    assert_eq!(error.field, "oom.strategies[1]");
    assert!(error.reason.contains("workspace"), "{error}");
    let error = refused(&edited(
        r#"precisions = ["fp32", "bf16"]"#,
        r#"precisions = ["fp32"]"#,
    ));
    assert_eq!(error.field, "oom.strategies[0]");
    assert!(error.reason.contains("mixed_precision needs"), "{error}");
    let error = refused(&edited(
        "recompute = { argv = [\"--grad-checkpointing\"] }\n",
        "",
    ));
    assert_eq!(error.field, "oom.strategies[2]");
    assert!(error.reason.contains("command.recompute"), "{error}");
    let job = command_job(&edited(
        r#"strategies = ["mixed_precision", "accumulate", "recompute"]"#,
        r#"strategies = ["accumulate", "shrink_batch"]"#,
    ));
    assert_eq!(
        job.spec.oom.strategies,
        [ShrinkStrategy::Accumulate, ShrinkStrategy::ShrinkBatch]
    );
}

#[test]
fn the_default_strategy_list_is_narrowed_to_what_the_job_can_use() {
    let unwritten = edited(
        "[oom]\nstrategies = [\"mixed_precision\", \"accumulate\", \"recompute\"]\n",
        "",
    );
    let job = command_job(&unwritten);
    assert_eq!(
        job.spec.oom.strategies,
        [
            ShrinkStrategy::MixedPrecision,
            ShrinkStrategy::Accumulate,
            ShrinkStrategy::Recompute
        ]
    );
    let job = command_job(
        &unwritten
            .replace(
                r#"precisions = ["fp32", "bf16"]"#,
                r#"precisions = ["fp32"]"#,
            )
            .replace("recompute = { argv = [\"--grad-checkpointing\"] }\n", ""),
    );
    assert_eq!(job.spec.oom.strategies, [ShrinkStrategy::Accumulate]);
}

#[test]
fn the_name_follows_the_model_jobs_rule() {
    assert_eq!(
        refused(&edited("name = \"resnet-pytorch\"", "name = \"a b\"")).field,
        "name"
    );
    assert_eq!(
        refused(&edited("name = \"resnet-pytorch\"", "name = \"\"")).field,
        "name"
    );
}

#[test]
fn half_precision_prefers_the_policy_then_what_the_program_accepts() {
    let job = command_job(COMMAND_JOB);
    // The policy's default half precision is fp16, which this program does not accept.
    assert_eq!(half_precision_for(&job), Some(Precision::Bf16));
    let job = command_job(&edited(
        r#"precisions = ["fp32", "bf16"]"#,
        r#"precisions = ["fp32", "bf16", "fp16"]"#,
    ));
    assert_eq!(half_precision_for(&job), Some(Precision::Fp16));
    let job = command_job(
        &edited("[oom]", "[oom]\nhalf_precision = \"bf16\"").replace(
            r#"precisions = ["fp32", "bf16"]"#,
            r#"precisions = ["fp32", "fp16", "bf16"]"#,
        ),
    );
    assert_eq!(half_precision_for(&job), Some(Precision::Bf16));
    let job = command_job(
        &edited(
            r#"precisions = ["fp32", "bf16"]"#,
            r#"precisions = ["fp32"]"#,
        )
        .replace(r#""mixed_precision", "#, ""),
    );
    assert_eq!(half_precision_for(&job), None);
}

#[test]
fn validated_spec_reads_either_kind() {
    let spec = ValidatedSpec::Command(command_job(COMMAND_JOB));
    assert_eq!(spec.name(), "resnet-pytorch");
    assert_eq!(spec.priority(), 0);
    assert_eq!(spec.resources().vram, VramRequest::Auto);
    assert_eq!(spec.oom().strategies.len(), 3);
    assert!(spec.warnings().is_empty());
}

/// A gang: `gpus` slices of the same declared or profiled `vram`, placed by `placement`.
#[test]
fn a_command_job_may_ask_for_a_gang_with_a_placement_policy() {
    use crate::spec::GangPlacementPolicy;
    let job = command_job(&edited("vram = \"auto\"", "vram = \"auto\"\ngpus = 4"));
    assert_eq!(job.spec.resources.gpus, 4);
    assert_eq!(job.spec.resources.placement, GangPlacementPolicy::Pack);
    for policy in GangPlacementPolicy::ALL {
        let job = command_job(&edited(
            "vram = \"auto\"",
            &format!(
                "vram = \"auto\"\ngpus = 64\nplacement = \"{}\"",
                policy.name()
            ),
        ));
        assert_eq!(job.spec.resources.placement, policy);
        assert_eq!(job.spec.resources.gpus, 64);
    }
}
