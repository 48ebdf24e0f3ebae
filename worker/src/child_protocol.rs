//! What an attempt process writes on stdout, one JSON object a line, and the run config
//! it is handed on its command line. Both sides (the worker and the attempt process)
//! use these types, so the format is defined once.

use carve_proto::v1;
use serde::{Deserialize, Serialize};

/// One line of an attempt process's stdout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ChildLine {
    /// The slice is reserved; training starts. `resumed_from` is the checkpoint the
    /// process loaded (absent when it starts from scratch, and in lines of older workers).
    Started {
        reserved_bytes: u64,
        pid: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        resumed_from: Option<CheckpointLine>,
    },
    Progress {
        step: u64,
        total_steps: u64,
        #[serde(deserialize_with = "number_or_nan")]
        loss: f64,
        #[serde(deserialize_with = "number_or_nan")]
        samples_per_second: f64,
        memory_in_use_bytes: u64,
        memory_peak_bytes: u64,
    },
    /// A checkpoint is on disk.
    Checkpoint { step: u64, location: String },
    /// Training completed; exit code 0 follows. `steps` counts those before a resume
    /// too; `samples_per_second` is the mean over this attempt's own steps. Both default
    /// to 0 (unknown) in lines of older workers.
    Finished {
        #[serde(deserialize_with = "number_or_nan")]
        final_loss: f64,
        test_accuracy: Option<f64>,
        peak_bytes: u64,
        #[serde(default)]
        steps: u64,
        #[serde(default, deserialize_with = "number_or_nan")]
        samples_per_second: f64,
    },
    /// The slice could not hold a buffer; exit code 3 follows.
    Oom {
        requested_bytes: u64,
        in_use_bytes: u64,
        limit_bytes: u64,
        largest_free_bytes: u64,
        peak_bytes: u64,
        checkpoint: Option<CheckpointLine>,
    },
}

/// Reads a float that may be `null`: JSON has no NaN or infinity, so serde_json writes
/// them as `null`, and a diverged run's loss is NaN. Read back as NaN, the line still
/// says what happened; refused, the worker would take a finished attempt's last line for
/// a library's output and fail the attempt for ending without a result.
fn number_or_nan<'de, D>(deserializer: D) -> Result<f64, D::Error>
where
    D: serde::Deserializer<'de>,
{
    Ok(Option::<f64>::deserialize(deserializer)?.unwrap_or(f64::NAN))
}

/// A checkpoint as an OOM line names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointLine {
    pub step: u64,
    pub location: String,
}

/// The exit code of an attempt process that ran out of memory in its slice.
pub const OUT_OF_MEMORY_EXIT_CODE: i32 = 3;

/// The exit code of an attempt process that stopped because its worker is gone: a
/// protocol line could not be written (stdout closed) or its parent process changed.
pub const WORKER_GONE_EXIT_CODE: i32 = 4;

/// The exit code of an attempt process that stopped on SIGTERM after writing its
/// checkpoint (128 + 15, as a shell shows a process SIGTERM ended): the worker's own stop,
/// or, when the worker sent none, an interruption from outside like the signal itself.
pub const STOPPED_ON_SIGTERM_EXIT_CODE: i32 = 143;

/// The run config on the attempt process's command line (`--config-json`): the wire
/// config's fields, with the precision as its protobuf number, so the child checks it
/// with the same conversion the scheduler uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigArgument {
    pub batch_size: u64,
    pub micro_batch_size: u64,
    pub precision: i32,
    pub recompute_segment_layers: Option<u64>,
    pub workspace_limit_bytes: u64,
    pub prefetch_batches: u64,
}

impl From<&v1::RunConfig> for ConfigArgument {
    fn from(config: &v1::RunConfig) -> Self {
        ConfigArgument {
            batch_size: config.batch_size,
            micro_batch_size: config.micro_batch_size,
            precision: config.precision,
            recompute_segment_layers: config.recompute_segment_layers,
            workspace_limit_bytes: config.workspace_limit_bytes,
            prefetch_batches: config.prefetch_batches,
        }
    }
}

impl From<&ConfigArgument> for v1::RunConfig {
    fn from(config: &ConfigArgument) -> Self {
        v1::RunConfig {
            batch_size: config.batch_size,
            micro_batch_size: config.micro_batch_size,
            precision: config.precision,
            recompute_segment_layers: config.recompute_segment_layers,
            workspace_limit_bytes: config.workspace_limit_bytes,
            prefetch_batches: config.prefetch_batches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_tagged_by_type() {
        let line = ChildLine::Checkpoint {
            step: 4,
            location: "/c/job.ckpt".into(),
        };
        let text = serde_json::to_string(&line).unwrap();
        assert_eq!(
            text,
            r#"{"type":"checkpoint","step":4,"location":"/c/job.ckpt"}"#
        );
        assert_eq!(serde_json::from_str::<ChildLine>(&text).unwrap(), line);
        let oom: ChildLine = serde_json::from_str(
            r#"{"type":"oom","requested_bytes":1,"in_use_bytes":2,"limit_bytes":3,"largest_free_bytes":0,"peak_bytes":2,"checkpoint":null}"#,
        )
        .unwrap();
        assert!(matches!(oom, ChildLine::Oom { limit_bytes: 3, .. }));
    }

    /// A worker reads the lines of an attempt process of the version before it: the
    /// fields added since are optional.
    #[test]
    fn lines_without_the_newer_fields_are_read() {
        let started: ChildLine =
            serde_json::from_str(r#"{"type":"started","reserved_bytes":5,"pid":9}"#).unwrap();
        assert_eq!(
            started,
            ChildLine::Started {
                reserved_bytes: 5,
                pid: 9,
                resumed_from: None
            }
        );
        let finished: ChildLine = serde_json::from_str(
            r#"{"type":"finished","final_loss":0.5,"test_accuracy":null,"peak_bytes":7}"#,
        )
        .unwrap();
        assert!(matches!(
            finished,
            ChildLine::Finished {
                steps: 0,
                samples_per_second,
                ..
            } if samples_per_second == 0.0
        ));
    }

    /// Found by the child_line fuzz target: a diverged run's NaN loss is written as
    /// `null`, which the worker could not read back, so a finished attempt failed.
    #[test]
    fn a_nan_loss_is_written_and_read_back_as_nan() {
        let finished = ChildLine::Finished {
            final_loss: f64::NAN,
            test_accuracy: Some(f64::INFINITY),
            peak_bytes: 7,
            steps: 3,
            samples_per_second: 2.5,
        };
        let text = serde_json::to_string(&finished).unwrap();
        assert_eq!(
            text,
            r#"{"type":"finished","final_loss":null,"test_accuracy":null,"peak_bytes":7,"steps":3,"samples_per_second":2.5}"#
        );
        let ChildLine::Finished {
            final_loss,
            test_accuracy,
            peak_bytes,
            ..
        } = serde_json::from_str(&text).unwrap()
        else {
            panic!("{text} is not read back as a finished line");
        };
        assert!(final_loss.is_nan());
        assert_eq!((test_accuracy, peak_bytes), (None, 7));
        let progress = ChildLine::Progress {
            step: 1,
            total_steps: 2,
            loss: f64::NEG_INFINITY,
            samples_per_second: f64::NAN,
            memory_in_use_bytes: 3,
            memory_peak_bytes: 4,
        };
        let text = serde_json::to_string(&progress).unwrap();
        let ChildLine::Progress {
            loss,
            samples_per_second,
            ..
        } = serde_json::from_str(&text).unwrap()
        else {
            panic!("{text} is not read back as a progress line");
        };
        assert!(loss.is_nan() && samples_per_second.is_nan());
    }
}
