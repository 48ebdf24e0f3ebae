//! The kinds and their answers, and the versioned peak keys.

use super::*;
use crate::allocator::OutOfMemory;
use crate::plan::EngineSettings;
use crate::spec::Precision;

const COMMAND_JOB: &str = r#"
name = "resnet-pytorch"
[command]
argv = ["python3", "train.py", "--batch-size", "{micro_batch}", "--accum",
        "{accumulation_steps}", "--precision", "{precision}", "--steps", "{max_steps}"]
global_batch = 256
steps = 1000
precisions = ["fp32", "bf16"]
recompute = { argv = ["--grad-checkpointing"] }
[resources]
vram = "auto"
[oom]
strategies = ["mixed_precision", "accumulate", "recompute"]
max_retries = 3
"#;

const MODEL_JOB: &str = r#"
name = "mnist"
[model]
input_shape = [8, 8, 1]
loss = "softmax_cross_entropy"
layers = [
  { conv2d = { filters = 4, kernel = 3, padding = "same" } },
  { relu = {} },
  { flatten = {} },
  { dense = { units = 10 } },
]
[training]
batch_size = 32
steps = 2
optimizer = { sgd = { learning_rate = 0.1 } }
[data]
format = "synthetic"
samples = 64
"#;

fn model() -> Workload {
    Workload::from_toml(MODEL_JOB).unwrap()
}

fn command() -> Workload {
    Workload::from_toml(COMMAND_JOB).unwrap()
}

fn edited(text: &str, from: &str, to: &str) -> Workload {
    assert!(text.contains(from), "{from:?} is not in the spec");
    Workload::from_toml(&text.replacen(from, to, 1)).unwrap()
}

#[test]
fn kinds_have_stable_names_and_refuse_unknown_ones() {
    assert_eq!(JobKind::Model.name(), "model");
    assert_eq!(JobKind::Command.name(), "command");
    for kind in JobKind::ALL {
        assert_eq!(JobKind::from_name(kind.name()), Ok(kind));
        assert_eq!(kind.name().parse::<JobKind>(), Ok(kind));
        assert_eq!(JobKind::try_from(kind.name()), Ok(kind));
        assert_eq!(kind.to_string(), kind.name());
    }
    let error = JobKind::from_name("Model").unwrap_err();
    assert_eq!(
        error.to_string(),
        "\"Model\" is not a job kind (model, command)"
    );
    assert!(JobKind::from_name("").is_err());
    assert!(JobKind::Command.memory_is_measured());
    assert!(!JobKind::Model.memory_is_measured());
}

#[test]
fn the_kind_of_a_spec_text_is_its_top_level_command() {
    let json = |workload: &Workload| match workload {
        Workload::Model(job) => serde_json::to_string(&job.spec).unwrap(),
        Workload::Command(job) => serde_json::to_string(&job.spec).unwrap(),
    };
    assert_eq!(
        JobKind::of_spec_text(COMMAND_JOB, SpecFormat::Toml),
        JobKind::Command
    );
    assert_eq!(
        JobKind::of_spec_text(MODEL_JOB, SpecFormat::Toml),
        JobKind::Model
    );
    assert_eq!(
        JobKind::of_spec_text(&json(&command()), SpecFormat::Json),
        JobKind::Command
    );
    assert_eq!(
        JobKind::of_spec_text(&json(&model()), SpecFormat::Json),
        JobKind::Model
    );
    // A `command` deeper down is not a top-level one; text that does not parse, or is
    // not a table, is read (and refused) as a model job.
    for text in [
        r#"{"name": "x", "data": {"command": 1}}"#,
        "[1, 2]",
        "not json",
        "",
    ] {
        assert_eq!(
            JobKind::of_spec_text(text, SpecFormat::Json),
            JobKind::Model,
            "{text}"
        );
    }
    assert_eq!(
        JobKind::of_spec_text(r#"{"command": 5}"#, SpecFormat::Json),
        JobKind::Command
    );
    // Both kinds' sections: refused, naming `command`.
    let both = format!("{MODEL_JOB}\n[command]\nargv = [\"x\"]\nglobal_batch = 1\n");
    assert_eq!(
        JobKind::of_spec_text(&both, SpecFormat::Toml),
        JobKind::Command
    );
    assert_eq!(Workload::from_toml(&both).unwrap_err().field, "command");
}

#[test]
fn a_stored_spec_is_read_as_its_stored_kind() {
    for workload in [model(), command()] {
        let text = match &workload {
            Workload::Model(job) => serde_json::to_string(&job.spec).unwrap(),
            Workload::Command(job) => serde_json::to_string(&job.spec).unwrap(),
        };
        let kind = workload.kind();
        assert_eq!(Workload::from_stored(kind, &text).unwrap(), workload);
        assert_eq!(Workload::from_json(&text).unwrap(), workload);
        let other = JobKind::ALL
            .into_iter()
            .find(|other| *other != kind)
            .unwrap();
        assert!(
            Workload::from_stored(other, &text).is_err(),
            "a {kind} spec read as {other}"
        );
    }
}

#[test]
fn each_kind_answers_its_configuration_and_retries() {
    let model = model();
    assert_eq!(model.kind(), JobKind::Model);
    assert!(model.as_model().is_some() && model.as_command().is_none());
    let config = model.initial_config();
    assert_eq!((config.batch_size, config.micro_batch_size), (32, 32));
    assert_eq!(
        model.max_oom_retries(),
        OomPolicySpec::default().max_retries
    );
    assert_eq!(model.name(), "mnist");

    let command = command();
    assert_eq!(command.kind(), JobKind::Command);
    assert!(command.as_command().is_some() && command.as_model().is_none());
    let config = command.initial_config();
    assert_eq!((config.batch_size, config.micro_batch_size), (256, 256));
    assert_eq!(config.precision, Precision::Fp32);
    assert_eq!(command.max_oom_retries(), 3);
    assert!(command.require_absolute_paths().is_ok());
}

#[test]
fn a_model_job_is_estimated_by_the_estimator_whatever_was_measured() {
    let model = model();
    let config = model.initial_config();
    let expected = estimate_job(model.as_model().unwrap(), &config).unwrap();
    assert_eq!(
        model.spec_estimate(&config).unwrap(),
        Some(expected.clone())
    );
    let measured = CommandMemoryModel {
        fixed_bytes: 1,
        per_sample_bytes: 1,
        precision: Precision::Fp32,
        recompute: false,
    };
    assert_eq!(
        model.estimate(&config, Some(&measured), Some(1)).unwrap(),
        expected
    );
    assert_eq!(model.profile_plan(None), None);
}

#[test]
fn a_command_job_is_estimated_by_its_model_its_vram_or_its_profile_slice() {
    let command = command();
    let config = command.initial_config();
    assert_eq!(command.spec_estimate(&config).unwrap(), None);
    // vram = "auto", nothing measured: the profile's slice, and a profile first.
    let estimate = command.estimate(&config, None, Some(40 << 30)).unwrap();
    assert_eq!(estimate.required_bytes, 40 << 30);
    assert_eq!(
        estimate.peak_during,
        format!("command: {PROFILE_ESTIMATE_SOURCE}")
    );
    let estimate = command.estimate(&config, None, None).unwrap();
    assert_eq!(estimate.required_bytes, PROFILE_SLICE_WITHOUT_GPUS);
    assert_eq!(
        command.profile_plan(None),
        Some(ProfilePlan {
            steps: 2,
            micro_batches: [256, 128]
        })
    );
    // Measured: the model's need, and no profile.
    let measured = CommandMemoryModel {
        fixed_bytes: 1 << 30,
        per_sample_bytes: 1 << 20,
        precision: Precision::Fp32,
        recompute: false,
    };
    let estimate = command.estimate(&config, Some(&measured), None).unwrap();
    assert_eq!(estimate.required_bytes, (1 << 30) + 256 * (1 << 20));
    assert!(!command.needs_profile(Some(&measured)));
    // Declared: the declared vram, and no profile.
    let declared = edited(COMMAND_JOB, r#"vram = "auto""#, r#"vram = "8GiB""#);
    let estimate = declared.estimate(&config, None, Some(40 << 30)).unwrap();
    assert_eq!(estimate.required_bytes, 8 << 30);
    assert_eq!(
        estimate.peak_during,
        format!("command: {DECLARED_VRAM_SOURCE}")
    );
    assert!(!declared.needs_profile(None));
}

#[test]
fn each_kind_plans_its_retry_after_an_oom() {
    let model = model();
    let config = model.initial_config();
    let needed = model
        .spec_estimate(&config)
        .unwrap()
        .unwrap()
        .required_bytes;
    let slice = needed * 3 / 4;
    let report = OutOfMemory {
        requested: needed / 4,
        in_use: slice - needed / 4,
        limit: slice,
        largest_free: 0,
        peak: slice,
    };
    let observation = OomObservation {
        report,
        estimated_required_bytes: needed,
    };
    let decision = model
        .plan_shrink(&config, Some(&observation), slice, None)
        .unwrap();
    assert_eq!(
        decision,
        crate::shrink::plan_shrink(
            model.as_model().unwrap(),
            &config,
            Some(&observation),
            slice
        )
        .unwrap()
    );

    let command = command();
    let config = command.initial_config();
    let measured = CommandMemoryModel {
        fixed_bytes: 1 << 30,
        per_sample_bytes: 64 << 20,
        precision: Precision::Fp32,
        recompute: false,
    };
    let slice = 8u64 << 30;
    let report = OutOfMemory {
        requested: 1 << 30,
        in_use: slice - (1 << 30),
        limit: slice,
        largest_free: 0,
        peak: slice,
    };
    let observation = OomObservation {
        report,
        estimated_required_bytes: measured.need_bytes(&config),
    };
    let decision = command
        .plan_shrink(&config, Some(&observation), slice, Some(&measured))
        .unwrap();
    assert_eq!(
        decision,
        plan_command_shrink(
            command.as_command().unwrap(),
            &measured,
            &config,
            Some(&observation),
            slice
        )
        .unwrap()
    );
    assert_ne!(decision.config, config);
    // No model: after an OOM, the report's worst case; before any, nothing predicts.
    let from_report = CommandMemoryModel::from_out_of_memory(&config, &report);
    assert_eq!(
        command
            .plan_shrink(&config, Some(&observation), slice, None)
            .unwrap(),
        plan_command_shrink(
            command.as_command().unwrap(),
            &from_report,
            &config,
            Some(&observation),
            slice
        )
        .unwrap()
    );
    let declared = edited(COMMAND_JOB, r#"vram = "auto""#, r#"vram = "80GiB""#);
    match declared.plan_shrink(&config, None, 40 << 30, None) {
        Err(CoreError::DoesNotFit {
            available_bytes,
            smallest_required_bytes,
            ..
        }) => {
            assert_eq!(available_bytes, 40 << 30);
            assert_eq!(smallest_required_bytes, 80 << 30);
        }
        other => panic!("expected DoesNotFit, got {other:?}"),
    }
}

#[test]
fn peak_keys_are_versioned_and_name_the_kind() {
    let model = model();
    let key = model.peak_key(&model.initial_config());
    assert!(key.starts_with("v2|model|"), "{key}");
    assert_eq!(key.len(), "v2|model|".len() + 32);
    let command = command();
    let key = command.peak_key(&command.initial_config());
    assert!(key.starts_with("v2|command|"), "{key}");
    // Stable: the same job and config, the same key, every time and every build. A
    // change here orphans every stored correction: raise PEAK_KEY_VERSION instead.
    assert_eq!(key, command.peak_key(&command.initial_config()));
}

#[test]
fn a_model_peak_key_ignores_what_does_not_decide_memory() {
    let base = model();
    let config = base.initial_config();
    let key = base.peak_key(&config);
    for (from, to) in [
        (r#"name = "mnist""#, r#"name = "other""#),
        (
            r#"name = "mnist""#,
            "name = \"mnist\"\ndescription = \"a new field of the spec\"\npriority = 7",
        ),
        ("learning_rate = 0.1", "learning_rate = 0.5"),
        ("steps = 2", "steps = 2000"),
        ("samples = 64", "samples = 6400"),
        // Written differently, resolved the same: "same" padding of a 3x3 kernel.
        (r#"padding = "same""#, r#"padding = 1"#),
        ("{ relu = {} }", r#"{ relu = {}, name = "activation" }"#),
        (
            "[data]",
            "[oom]\nmax_retries = 9\n[resources]\nvram = \"4GiB\"\n[data]",
        ),
    ] {
        let other = edited(MODEL_JOB, from, to);
        assert_eq!(other.peak_key(&config), key, "{from} -> {to}");
    }
}

#[test]
fn a_model_peak_key_changes_with_what_decides_memory() {
    let base = model();
    let config = base.initial_config();
    let key = base.peak_key(&config);
    for (from, to) in [
        ("filters = 4", "filters = 8"),
        ("units = 10", "units = 11"),
        ("input_shape = [8, 8, 1]", "input_shape = [8, 8, 3]"),
        ("{ relu = {} }", "{ sigmoid = {} }"),
        (r#"padding = "same""#, r#"padding = "valid""#),
        (
            "optimizer = { sgd = { learning_rate = 0.1 } }",
            "optimizer = { adam = { learning_rate = 0.1 } }",
        ),
        (r#"loss = "softmax_cross_entropy""#, r#"loss = "mse""#),
    ] {
        let other = edited(MODEL_JOB, from, to);
        assert_ne!(
            other.peak_key(&other.initial_config()),
            key,
            "{from} -> {to}"
        );
    }
    // Every knob of the run config.
    let changed = [
        RunConfig {
            batch_size: 64,
            micro_batch_size: 64,
            ..config
        },
        RunConfig {
            micro_batch_size: 16,
            ..config
        },
        RunConfig {
            precision: Precision::Bf16,
            ..config
        },
        RunConfig {
            recompute_segment_layers: Some(1),
            ..config
        },
        config.with_workspace_limit(config.workspace_limit_bytes() + 1),
        config.with_prefetch_batches(config.engine.unwrap().prefetch_batches + 1),
    ];
    for other in changed {
        assert_ne!(base.peak_key(&other), key, "{other:?}");
    }
}

#[test]
fn a_command_peak_key_is_its_command_shape_and_config() {
    let base = command();
    let config = base.initial_config();
    let key = base.peak_key(&config);
    for (from, to) in [
        (r#"name = "resnet-pytorch""#, r#"name = "other""#),
        ("steps = 1000", "steps = 5"),
        (
            "global_batch = 256",
            "global_batch = 256\nread_only_paths = [\"/data\"]",
        ),
        ("max_retries = 3", "max_retries = 1"),
    ] {
        let other = edited(COMMAND_JOB, from, to);
        assert_eq!(other.peak_key(&config), key, "{from} -> {to}");
    }
    for (from, to) in [
        (r#""train.py""#, r#""train2.py""#),
        (
            "global_batch = 256",
            "global_batch = 256\nenv = { MODEL = \"large\" }",
        ),
        (
            "global_batch = 256",
            "global_batch = 256\nworking_directory = \"/work\"",
        ),
        (r#""--grad-checkpointing""#, r#""--checkpoint-all""#),
    ] {
        let other = edited(COMMAND_JOB, from, to);
        assert_ne!(other.peak_key(&config), key, "{from} -> {to}");
    }
    let halved = RunConfig {
        micro_batch_size: 128,
        ..config
    };
    assert_ne!(base.peak_key(&halved), key);
    // A model job and a command job never share a key.
    assert_ne!(model().peak_key(&config), key);
}

#[test]
fn peak_keys_do_not_change_between_builds() {
    // Written out: a change to what a key is written from shows here. If it is meant,
    // raise PEAK_KEY_VERSION (stored corrections are then measured again) and update
    // these.
    assert_eq!(
        model().peak_key(&model().initial_config()),
        "v2|model|1a6465ddda341b1839f9c3e93640b345"
    );
    assert_eq!(
        command().peak_key(&command().initial_config()),
        "v2|command|3f0af8d0553a15a1ce3e385ceaa6552c"
    );
}

#[test]
fn a_config_from_outside_is_checked_as_its_jobs_kind_reads_one() {
    // A command job has no engine knobs: its own config lacks them, and one that has
    // them is refused naming the knob.
    let command = command();
    let own = command.initial_config();
    assert_eq!(own.engine, None);
    assert_eq!(command.check_config(&own), Ok(()));
    let prefetching = RunConfig {
        engine: Some(EngineSettings {
            workspace_limit_bytes: 0,
            prefetch_batches: 2,
        }),
        ..own
    };
    let refused = command.check_config(&prefetching).unwrap_err();
    assert_eq!(refused.field, "prefetch_batches");
    let with_workspace = RunConfig {
        engine: Some(EngineSettings {
            workspace_limit_bytes: 1 << 20,
            prefetch_batches: 0,
        }),
        ..own
    };
    let refused = command.check_config(&with_workspace).unwrap_err();
    assert_eq!(refused.field, "workspace_limit_bytes");
    let uneven = RunConfig {
        micro_batch_size: own.batch_size + 1,
        ..own
    };
    assert_eq!(
        command.check_config(&uneven).unwrap_err().field,
        "micro_batch_size"
    );

    // A model job's config is checked against its model: it needs the engine's knobs,
    // and prefetches at least one batch.
    let model = model();
    let own = model.initial_config();
    assert_eq!(model.check_config(&own), Ok(()));
    assert_eq!(
        model
            .check_config(&own.with_prefetch_batches(0))
            .unwrap_err()
            .field,
        "prefetch_batches"
    );
    let without_engine = RunConfig {
        engine: None,
        ..own
    };
    assert_eq!(
        model.check_config(&without_engine).unwrap_err().field,
        "prefetch_batches"
    );
}

#[test]
fn each_kind_is_sized_at_admission_as_its_memory_is_known() {
    const GIB: u64 = 1 << 30;
    // A model job: corrected by measured peaks, sized by the estimator exactly, with
    // nothing declared to check.
    let model = model();
    assert!(model.takes_peak_corrections());
    assert_eq!(model.memory_model_key(), None);
    assert_eq!(model.check_fits_largest_gpu(Some(1)), Ok(()));
    assert_eq!(model.slice_with_floor(GIB, 4 * GIB, Some(80 * GIB)), GIB);

    // A command job: its tenant's memory model, never the shared corrections; no slice
    // below the floor (itself never above the largest GPU).
    let command = command();
    assert!(!command.takes_peak_corrections());
    let key = command.memory_model_key().unwrap();
    assert_eq!(key.declared_bytes, None);
    assert_eq!(command.check_fits_largest_gpu(Some(GIB)), Ok(()));
    assert_eq!(
        command.slice_with_floor(GIB, 4 * GIB, Some(80 * GIB)),
        4 * GIB
    );
    assert_eq!(
        command.slice_with_floor(GIB, 4 * GIB, Some(2 * GIB)),
        2 * GIB
    );
    assert_eq!(command.slice_with_floor(8 * GIB, 4 * GIB, None), 8 * GIB);

    // A declared size larger than every GPU is refused as written, naming it.
    let declared = edited(COMMAND_JOB, r#"vram = "auto""#, r#"vram = "40GiB""#);
    assert_eq!(
        declared.memory_model_key().unwrap().declared_bytes,
        Some(40 * GIB)
    );
    assert_eq!(
        declared.memory_model_key().unwrap().shape_key,
        key.shape_key,
        "the declared size is not part of the command's shape"
    );
    assert_eq!(declared.check_fits_largest_gpu(Some(80 * GIB)), Ok(()));
    assert_eq!(declared.check_fits_largest_gpu(None), Ok(()));
    assert_eq!(
        declared
            .check_fits_largest_gpu(Some(24 * GIB))
            .unwrap_err()
            .field,
        "resources.vram"
    );
}

#[test]
fn only_a_kind_that_may_name_an_image_has_one() {
    assert!(JobKind::Command.may_name_image());
    assert!(!JobKind::Model.may_name_image());
    assert_eq!(model().image(), None);
    assert_eq!(model().image_pull_secret(), None);
    assert_eq!(command().image(), None);
    let imaged = edited(
        COMMAND_JOB,
        "steps = 1000\n",
        "steps = 1000\nimage = \"127.0.0.1:5000/team/train:2.5\"\nimage_pull_secret = \"team-registry\"\n",
    );
    assert_eq!(imaged.image(), Some("127.0.0.1:5000/team/train:2.5"));
    assert_eq!(imaged.image_pull_secret(), Some("team-registry"));
    assert!(imaged.kind().may_name_image());
}
