//! Checkpoints: everything a resumed attempt needs to continue exactly where the last
//! one stopped, written atomically.
//!
//! What is stored is independent of the run config, because the point of a checkpoint
//! is that an attempt shrunk after an OOM (mixed precision, micro-batches, ...) resumes
//! from it: parameters as fp32 (the masters under mixed precision), optimizer state, the
//! step, the number of applied updates (Adam's bias correction), the loss scaler, and the
//! seed. There is no other RNG state to keep: data order and dropout masks are pure
//! functions of (seed, step, micro-batch, layer).
//!
//! File layout: `CARVECKP`, a u32 format version, a u64 header length, the JSON header
//! (step, settings, tensor names and lengths), the tensors as little-endian f32 in header
//! order, and a CRC-32 of everything before it. Written to a temporary file in the same
//! directory, fsynced, renamed over the target, and the directory fsynced, so a crash
//! leaves either the old checkpoint or the new one, never half of one.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::EngineError;

const MAGIC: &[u8; 8] = b"CARVECKP";
const FORMAT_VERSION: u32 = 1;

/// One named tensor of the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// `layers[0].conv2d/kernel`, `layers[0].conv2d/kernel/optimizer_state0`, ...
    pub name: String,
    pub values: Vec<f32>,
}

/// The state of a training run between two steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub job_name: String,
    /// Optimizer steps completed.
    pub step: u64,
    /// Updates actually applied (steps skipped for loss-scale overflow are not counted).
    pub applied_updates: u64,
    pub loss_scale: f32,
    pub loss_scale_good_steps: u32,
    pub seed: u64,
    pub tensors: Vec<NamedTensor>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    job_name: String,
    step: u64,
    applied_updates: u64,
    loss_scale: f32,
    loss_scale_good_steps: u32,
    seed: u64,
    tensors: Vec<TensorEntry>,
}

#[derive(Debug, Serialize, Deserialize)]
struct TensorEntry {
    name: String,
    elements: u64,
}

impl Checkpoint {
    pub fn tensor(&self, name: &str) -> Option<&[f32]> {
        self.tensors
            .iter()
            .find(|tensor| tensor.name == name)
            .map(|tensor| tensor.values.as_slice())
    }

    fn encode(&self) -> Result<Vec<u8>, serde_json::Error> {
        let header = Header {
            job_name: self.job_name.clone(),
            step: self.step,
            applied_updates: self.applied_updates,
            loss_scale: self.loss_scale,
            loss_scale_good_steps: self.loss_scale_good_steps,
            seed: self.seed,
            tensors: self
                .tensors
                .iter()
                .map(|tensor| TensorEntry {
                    name: tensor.name.clone(),
                    elements: tensor.values.len() as u64,
                })
                .collect(),
        };
        let header = serde_json::to_vec(&header)?;
        let data_bytes: usize = self
            .tensors
            .iter()
            .map(|tensor| tensor.values.len() * 4)
            .sum();
        let mut bytes = Vec::with_capacity(24 + header.len() + data_bytes);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(header.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&header);
        for tensor in &self.tensors {
            for value in &tensor.values {
                bytes.extend_from_slice(&value.to_le_bytes());
            }
        }
        let checksum = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&checksum.to_le_bytes());
        Ok(bytes)
    }

    fn decode(bytes: &[u8]) -> Result<Checkpoint, String> {
        if bytes.len() < 24 || &bytes[..8] != MAGIC {
            return Err("not a carve checkpoint (bad magic)".to_string());
        }
        let (body, checksum) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes(checksum.try_into().expect("4 bytes"));
        if crc32fast::hash(body) != stored {
            return Err("checksum mismatch: the file is damaged or truncated".to_string());
        }
        let version = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
        if version != FORMAT_VERSION {
            return Err(format!(
                "format version {version}, this build reads {FORMAT_VERSION}"
            ));
        }
        let header_length = u64::from_le_bytes(body[12..20].try_into().expect("8 bytes"));
        let header_end = usize::try_from(header_length)
            .ok()
            .and_then(|length| length.checked_add(20))
            .filter(|end| *end <= body.len())
            .ok_or("header length runs past the end of the file")?;
        let header: Header = serde_json::from_slice(&body[20..header_end])
            .map_err(|error| format!("bad header: {error}"))?;
        let mut position = header_end;
        let mut tensors = Vec::with_capacity(header.tensors.len());
        for entry in header.tensors {
            let byte_length = usize::try_from(entry.elements)
                .ok()
                .and_then(|elements| elements.checked_mul(4))
                .filter(|length| position + length <= body.len())
                .ok_or_else(|| format!("tensor {} runs past the end of the file", entry.name))?;
            let values = body[position..position + byte_length]
                .chunks_exact(4)
                .map(|chunk| f32::from_le_bytes(chunk.try_into().expect("4 bytes")))
                .collect();
            position += byte_length;
            tensors.push(NamedTensor {
                name: entry.name,
                values,
            });
        }
        if position != body.len() {
            return Err(format!(
                "{} unexpected bytes after the tensors",
                body.len() - position
            ));
        }
        Ok(Checkpoint {
            job_name: header.job_name,
            step: header.step,
            applied_updates: header.applied_updates,
            loss_scale: header.loss_scale,
            loss_scale_good_steps: header.loss_scale_good_steps,
            seed: header.seed,
            tensors,
        })
    }
}

/// Writes `checkpoint` to `path` atomically (temporary file, fsync, rename, fsync of the
/// directory).
pub fn write_checkpoint(path: &Path, checkpoint: &Checkpoint) -> Result<(), EngineError> {
    let shown = path.display().to_string();
    let failed = |what: &str, error: std::io::Error| {
        EngineError::checkpoint(&shown, format!("{what}: {error}"))
    };
    let bytes = checkpoint
        .encode()
        .map_err(|error| EngineError::checkpoint(&shown, error.to_string()))?;
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => Path::new(".").to_path_buf(),
    };
    fs::create_dir_all(&directory).map_err(|error| failed("cannot create the directory", error))?;
    let file_name = path
        .file_name()
        .ok_or_else(|| EngineError::checkpoint(&shown, "the path has no file name"))?;
    let temporary = directory.join(format!(
        ".{}.{}.tmp",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut file = File::create(&temporary)
            .map_err(|error| failed("cannot create the temporary file", error))?;
        file.write_all(&bytes)
            .map_err(|error| failed("cannot write", error))?;
        file.sync_all()
            .map_err(|error| failed("cannot fsync", error))?;
        fs::rename(&temporary, path).map_err(|error| failed("cannot rename into place", error))?;
        // The rename is durable only once the directory entry is.
        File::open(&directory)
            .and_then(|directory| directory.sync_all())
            .map_err(|error| failed("cannot fsync the directory", error))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temporary);
    }
    result
}

pub fn read_checkpoint(path: &Path) -> Result<Checkpoint, EngineError> {
    let shown = path.display().to_string();
    let bytes = fs::read(path)
        .map_err(|error| EngineError::checkpoint(&shown, format!("cannot read: {error}")))?;
    Checkpoint::decode(&bytes).map_err(|reason| EngineError::checkpoint(&shown, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        Checkpoint {
            job_name: "job".into(),
            step: 10,
            applied_updates: 9,
            loss_scale: 32768.0,
            loss_scale_good_steps: 3,
            seed: 7,
            tensors: vec![
                NamedTensor {
                    name: "layers[0].dense/kernel".into(),
                    values: vec![1.0, -2.5, f32::MIN_POSITIVE],
                },
                NamedTensor {
                    name: "layers[0].dense/bias".into(),
                    values: vec![],
                },
            ],
        }
    }

    #[test]
    fn round_trips_exactly_and_leaves_no_temporary_file() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("nested/run.ckpt");
        write_checkpoint(&path, &sample()).unwrap();
        assert_eq!(read_checkpoint(&path).unwrap(), sample());
        let mut second = sample();
        second.step = 20;
        write_checkpoint(&path, &second).unwrap();
        assert_eq!(read_checkpoint(&path).unwrap().step, 20);
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn damage_is_detected_not_loaded() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("run.ckpt");
        write_checkpoint(&path, &sample()).unwrap();
        let mut bytes = fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x40;
        fs::write(&path, &bytes).unwrap();
        let error = read_checkpoint(&path).unwrap_err().to_string();
        assert!(error.contains("checksum mismatch"), "{error}");
        fs::write(&path, &bytes[..bytes.len() / 3]).unwrap();
        assert!(read_checkpoint(&path).is_err());
        fs::write(&path, b"hello").unwrap();
        assert!(
            read_checkpoint(&path)
                .unwrap_err()
                .to_string()
                .contains("bad magic")
        );
        assert!(
            read_checkpoint(&directory.path().join("missing"))
                .unwrap_err()
                .to_string()
                .contains("cannot read")
        );
    }
}
