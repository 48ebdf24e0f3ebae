//! `[resources]` `gpus` and `placement`: how many slices a command job asks for, each on
//! a distinct GPU (a *gang*, placed all at once by `crate::gang`), and where its members
//! may go. Read and checked here, with errors that name the field.

use serde::{Deserialize, Serialize};

use crate::error::FieldError;

/// The most members a gang may have: more than any data-parallel job Carve's users run
/// on a shared cluster, and a bound on the placement's work per pass.
pub const MAX_GANG_MEMBERS: u64 = 64;

/// Where a gang's members may go. Whatever the policy, no two members of one job share
/// a GPU.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum GangPlacementPolicy {
    /// On as few nodes as hold it (one node when one can): the fastest collectives.
    #[default]
    Pack,
    /// Over as many nodes as it can, evenly: a node's loss ends the fewest members' work
    /// and members do not share a node's host memory or network.
    Spread,
    /// Every member on one node, or the job waits (NVLink-only programs).
    OneNode,
}

impl GangPlacementPolicy {
    pub const ALL: [GangPlacementPolicy; 3] = [
        GangPlacementPolicy::Pack,
        GangPlacementPolicy::Spread,
        GangPlacementPolicy::OneNode,
    ];

    /// The name a job file writes: `pack`, `spread` or `one_node`.
    pub fn name(self) -> &'static str {
        match self {
            GangPlacementPolicy::Pack => "pack",
            GangPlacementPolicy::Spread => "spread",
            GangPlacementPolicy::OneNode => "one_node",
        }
    }

    /// Whether this is the default (`pack`), which a spec need not write.
    pub fn is_default(&self) -> bool {
        *self == GangPlacementPolicy::default()
    }
}

/// `resources.gpus` of a command job: 1 to [`MAX_GANG_MEMBERS`].
pub(crate) fn check_command_gpus(gpus: u64) -> Result<(), FieldError> {
    if (1..=MAX_GANG_MEMBERS).contains(&gpus) {
        Ok(())
    } else {
        Err(FieldError::new(
            "resources.gpus",
            format!("{gpus}: must be between 1 and {MAX_GANG_MEMBERS} (one slice per GPU)"),
        ))
    }
}

/// `resources.gpus` of a model job: Carve's engine trains in one slice, so 1.
pub(crate) fn check_model_gpus(gpus: u64) -> Result<(), FieldError> {
    if gpus == 1 {
        Ok(())
    } else {
        Err(FieldError::new(
            "resources.gpus",
            format!(
                "{gpus} GPUs asked: model jobs keep one slice (Carve's engine trains on one \
                 GPU); a command job may ask for up to {MAX_GANG_MEMBERS}"
            ),
        ))
    }
}
