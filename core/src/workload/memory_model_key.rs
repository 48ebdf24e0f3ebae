//! The key a job's memory model is kept under (with its tenant): the store's
//! `command_memory_models.shape_key`. Only a kind whose memory is measured has one: a
//! command job's key is a digest of its command's shape, what decides its program's
//! memory apart from the knobs Carve turns (argv, environment, working directory, the
//! precisions, the recompute arguments, and the image when one is named). Not its name,
//! priority, batch sizes or run config: one model covers every configuration of a
//! command, and the model itself scales with the batch. A model job has none; the
//! estimator sizes it.
//!
//! Unlike the peak keys ([`super::peak_key`]), this key is the digest of serde output of
//! those fields, as the scheduler has written it since command jobs began. Stored models
//! are found only by it, so what it hashes never changes: a test pins the key of a known
//! spec, and the fields are inserted in the order serde_json writes a map's keys either
//! way (sorted), so even the `preserve_order` feature would not move it.

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{JobKind, Workload};
use crate::command::spec::CommandSpec;
use crate::error::FieldError;
use crate::spec::VramRequest;

/// What a job's memory model is looked up and judged by ([`Workload::memory_model_key`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryModelKey {
    /// The key the model is stored under, with the job's tenant.
    pub shape_key: String,
    /// The job's declared `resources.vram`; `None` for `"auto"`, whose memory a profile
    /// measures. A declared size is the program's own statement of its need.
    pub declared_bytes: Option<u64>,
}

impl Workload {
    /// The key this job's memory model is kept under, and its declared size; `None` for a
    /// kind whose memory is not measured (a model job), which has no memory model.
    pub fn memory_model_key(&self) -> Option<MemoryModelKey> {
        match self {
            Workload::Model(_) => None,
            Workload::Command(job) => Some(MemoryModelKey {
                shape_key: command_shape_key(&job.spec.command),
                declared_bytes: match job.spec.resources.vram {
                    VramRequest::Bytes(bytes) => Some(bytes),
                    VramRequest::Auto => None,
                },
            }),
        }
    }
}

/// The memory-model key of a job stored as `kind` with `spec_json`, read as it was
/// admitted: only the `command` table is parsed (the rest of the spec is skipped,
/// whatever its size) and nothing is checked again, so reads never validate (validation
/// changes no field the key reads, so this is [`Workload::memory_model_key`]'s key).
/// `None` for a kind without a memory model; an error naming `command` when a command
/// job's command does not read.
pub fn stored_memory_model_key(
    kind: JobKind,
    spec_json: &str,
) -> Result<Option<String>, FieldError> {
    #[derive(Deserialize)]
    struct CommandOnly {
        command: CommandSpec,
    }
    match kind {
        JobKind::Model => Ok(None),
        JobKind::Command => serde_json::from_str::<CommandOnly>(spec_json)
            .map(|spec| Some(command_shape_key(&spec.command)))
            .map_err(|error| FieldError::new("command", error.to_string())),
    }
}

/// The digest of the command's shape: 32 hex digits of the SHA-256 of `command|` and the
/// shape as compact JSON. Never change what it writes (see the module's documentation).
fn command_shape_key(command: &CommandSpec) -> String {
    // In sorted order, as serde_json's map writes them without `preserve_order`. The
    // image, which holds the program and its framework, is part of the shape only when
    // one is named: the keys of jobs without one stay the keys they were stored under.
    let shape = match &command.image {
        None => serde_json::json!({
            "argv": command.argv,
            "env": command.env,
            "precisions": command.precisions,
            "recompute": command.recompute,
            "working_directory": command.working_directory,
        }),
        Some(image) => serde_json::json!({
            "argv": command.argv,
            "env": command.env,
            "image": image,
            "precisions": command.precisions,
            "recompute": command.recompute,
            "working_directory": command.working_directory,
        }),
    };
    Sha256::digest(format!("command|{shape}").as_bytes())
        .iter()
        .take(16)
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A command job's spec as a user may write it, with every field the shape key reads.
    const PINNED_SPEC: &str = r#"{
        "name": "pinned",
        "description": "not part of the key",
        "command": {
            "argv": ["python3", "train.py", "--micro-batch", "{micro_batch}",
                     "--precision", "{precision}", "--steps", "{max_steps}"],
            "env": { "DATA": "/data/set", "SEED": "7" },
            "working_directory": "/work",
            "global_batch": 64,
            "micro_batch": 32,
            "steps": 100,
            "precisions": ["bf16", "fp32"],
            "recompute": { "argv": ["--checkpointing"] }
        },
        "resources": { "vram": "auto" },
        "oom": { "strategies": ["accumulate"] }
    }"#;

    /// The key of [`PINNED_SPEC`] as the scheduler computed it before reads stopped
    /// validating (commit 48efa21), and in the scheduler's own function before the key
    /// moved here (f4c26b4): memory models stored under it must still be found.
    const PINNED_KEY: &str = "b2ed8872a7ff3098860e1dcc4c04cf6d";

    #[test]
    fn a_command_job_has_the_key_its_models_were_stored_under() {
        let workload = Workload::from_json(PINNED_SPEC).unwrap();
        assert_eq!(
            workload.memory_model_key(),
            Some(MemoryModelKey {
                shape_key: PINNED_KEY.into(),
                declared_bytes: None,
            })
        );
        assert_eq!(
            stored_memory_model_key(JobKind::Command, PINNED_SPEC).unwrap(),
            Some(PINNED_KEY.to_string())
        );
    }

    #[test]
    fn only_the_commands_shape_decides_the_key() {
        let key = |spec: &str| {
            Workload::from_json(spec)
                .unwrap()
                .memory_model_key()
                .unwrap()
        };
        // Name, description, batches, steps, resources and the OOM policy: not the shape.
        let renamed = PINNED_SPEC
            .replace(r#""pinned""#, r#""other""#)
            .replace(r#""global_batch": 64"#, r#""global_batch": 128"#)
            .replace(r#""steps": 100"#, r#""steps": 5"#)
            .replace(r#""vram": "auto""#, r#""vram": "20GiB""#);
        let declared = key(&renamed);
        assert_eq!(declared.shape_key, PINNED_KEY);
        assert_eq!(declared.declared_bytes, Some(20 << 30));
        // Each field of the shape moves it.
        for (from, to) in [
            (r#""train.py""#, r#""eval.py""#),
            (r#""SEED": "7""#, r#""SEED": "8""#),
            (r#""/work""#, r#""/work2""#),
            (r#"["bf16", "fp32"]"#, r#"["fp32"]"#),
            (r#"["--checkpointing"]"#, r#"["--remat"]"#),
        ] {
            let changed = PINNED_SPEC.replace(from, to);
            assert_ne!(key(&changed).shape_key, PINNED_KEY, "{from} -> {to}");
        }
        // The image holds the program and its framework: each image its own model, the
        // same in a read of the stored spec.
        let in_image = |image: &str| {
            PINNED_SPEC.replace(
                r#""working_directory": "/work","#,
                &format!(r#""working_directory": "/work", "image": "{image}","#),
            )
        };
        let (first, second) = (in_image("team/train:v1"), in_image("team/train:v2"));
        let first_key = key(&first).shape_key;
        assert_ne!(first_key, PINNED_KEY);
        assert_ne!(first_key, key(&second).shape_key);
        assert_eq!(
            stored_memory_model_key(JobKind::Command, &first).unwrap(),
            Some(first_key)
        );
    }

    #[test]
    fn a_stored_command_is_read_without_being_validated() {
        // global_batch 0 and a relative working directory fail validation; a read of a
        // row stored by an older, laxer version still finds its key.
        let lax = PINNED_SPEC
            .replace(r#""global_batch": 64"#, r#""global_batch": 0"#)
            .replace(r#""/work""#, r#""work""#);
        assert!(Workload::from_json(&lax).is_err());
        assert!(
            stored_memory_model_key(JobKind::Command, &lax)
                .unwrap()
                .is_some()
        );
        // A model job has no memory model (its text is not read); a command that does
        // not read is an error naming it.
        assert_eq!(
            stored_memory_model_key(JobKind::Model, PINNED_SPEC).unwrap(),
            None
        );
        let error =
            stored_memory_model_key(JobKind::Command, r#"{"command": {"argv": 3}}"#).unwrap_err();
        assert_eq!(error.field, "command");
    }
}
