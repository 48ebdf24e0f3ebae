//! The command job file: `[command]` in place of `[model]`, `[training]` and `[data]`.
//!
//! ```toml
//! name = "resnet-pytorch"
//! [command]
//! argv = ["python3", "train.py", "--batch-size", "{micro_batch}", "--accum",
//!         "{accumulation_steps}", "--precision", "{precision}",
//!         "--checkpoint-dir", "{checkpoint_dir}", "--steps", "{max_steps}"]
//! global_batch = 256
//! steps = 1000
//! precisions = ["fp32", "bf16"]
//! recompute = { argv = ["--grad-checkpointing"] }
//! [resources]
//! vram = "auto"
//! [oom]
//! strategies = ["mixed_precision", "accumulate", "recompute"]
//! ```
//!
//! Like `crate::spec`, the serde derives are the format itself; unknown fields are
//! rejected with their path.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::spec::{OomPolicySpec, Precision, ResourcesSpec};

/// A whole command job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandJobSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Higher runs first within one tenant.
    #[serde(default)]
    pub priority: i32,
    pub command: CommandSpec,
    #[serde(default)]
    pub resources: ResourcesSpec,
    #[serde(default)]
    pub oom: OomPolicySpec,
}

/// The program and the knobs Carve may turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandSpec {
    /// The program and its arguments; arguments may hold placeholders
    /// (`render::PLACEHOLDERS`). No shell is involved.
    pub argv: Vec<String>,
    /// Extra environment variables; values may hold placeholders.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Where the program runs (an absolute path); the worker's attempt directory when
    /// unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_directory: Option<String>,
    /// Host paths (absolute) the program reads besides its working directory: a data
    /// set, a virtual environment. Its container sees them read-only, and a worker takes
    /// only paths under the directories its operator lets jobs name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read_only_paths: Vec<String>,
    /// The OCI image the program runs in (`registry/repository:tag` or `@sha256:...`;
    /// `image.rs`): its files are the container's root filesystem instead of the host's.
    /// Unset: the host's system directories, read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The name of the tenant's stored secret holding the registry credential for a
    /// private `image` (never the credential itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_secret: Option<String>,
    /// The effective batch the optimizer sees per step, which Carve keeps.
    pub global_batch: u64,
    /// Samples per forward/backward pass of the first attempt; must divide
    /// `global_batch`. Defaults to `global_batch` (no accumulation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<u64>,
    /// Optimizer steps of a full run, what `{max_steps}` renders to outside the profile.
    /// Required when `{max_steps}` is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<u64>,
    /// The precisions the program accepts for `{precision}`; the first is where it
    /// starts unless `precision` says otherwise.
    #[serde(default = "default_precisions")]
    pub precisions: Vec<Precision>,
    /// The precision of the first attempt; one of `precisions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
    /// How to turn recomputation (gradient checkpointing) on: arguments appended to
    /// argv. Unset: the program cannot recompute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recompute: Option<RecomputeSpec>,
    /// The short run that measures the program's memory with `vram = "auto"`.
    #[serde(default)]
    pub profile: ProfileSpec,
}

/// Arguments that turn recomputation on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecomputeSpec {
    pub argv: Vec<String>,
}

/// The profile: the program run for `steps` optimizer steps at two micro-batch sizes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    /// Optimizer steps of each profile run, what `{max_steps}` renders to there.
    #[serde(default = "default_profile_steps")]
    pub steps: u64,
    /// The two micro-batch sizes measured, each a divisor of `global_batch`; by default
    /// the first attempt's micro-batch and the largest divisor at or below half of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batches: Option<[u64; 2]>,
}

impl Default for ProfileSpec {
    fn default() -> Self {
        ProfileSpec {
            steps: default_profile_steps(),
            micro_batches: None,
        }
    }
}

fn default_precisions() -> Vec<Precision> {
    vec![Precision::Fp32]
}

fn default_profile_steps() -> u64 {
    2
}
