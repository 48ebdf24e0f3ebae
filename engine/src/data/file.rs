//! A data file opened for positioned reads, shared by the IDX, CIFAR-10 and NPY readers.
//!
//! Positioned reads (`pread`) need no cursor, so one open file serves the loader thread and
//! the trainer at once without a lock, and nothing but the bytes of the sample being read is
//! ever in memory. Every failure becomes `EngineError::Data` naming the file.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::EngineError;

/// Bytes read per `pread` when a sample is converted piece by piece on the stack, so reading
/// a sample allocates nothing whatever its size.
pub(crate) const SAMPLE_CHUNK_BYTES: usize = 16 * 1024;

/// Bytes read per `pread` when a whole file is scanned once at open (label checks): large
/// enough that the scan runs at disk speed, small enough to be no concern for memory.
pub(crate) const SCAN_CHUNK_BYTES: usize = 1 << 20;

#[derive(Debug)]
pub(crate) struct DataFile {
    file: File,
    path: String,
    length: u64,
}

impl DataFile {
    pub(crate) fn open(path: &Path) -> Result<Self, EngineError> {
        let display = path.display().to_string();
        let file = File::open(path)
            .map_err(|error| EngineError::data(&display, io_reason("cannot open", &error)))?;
        let metadata = file.metadata().map_err(|error| {
            EngineError::data(&display, io_reason("cannot read metadata", &error))
        })?;
        if metadata.is_dir() {
            return Err(EngineError::data(
                display,
                "is a directory, expected a file",
            ));
        }
        Ok(DataFile {
            file,
            path: display,
            length: metadata.len(),
        })
    }

    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// The length when the file was opened; readers check it against their headers.
    pub(crate) fn length(&self) -> u64 {
        self.length
    }

    /// An error about this file.
    pub(crate) fn error(&self, reason: impl Into<String>) -> EngineError {
        EngineError::data(&self.path, reason)
    }

    /// Fills `buffer` from `offset`. A file that became shorter since it was opened (replaced
    /// or truncated while training) is reported as such.
    pub(crate) fn read_exact_at(&self, offset: u64, buffer: &mut [u8]) -> Result<(), EngineError> {
        self.file.read_exact_at(buffer, offset).map_err(|error| {
            let end = offset.saturating_add(buffer.len() as u64);
            if error.kind() == io::ErrorKind::UnexpectedEof {
                self.error(format!(
                    "file ends before byte {end}; was it truncated or replaced while in use?"
                ))
            } else {
                self.error(io_reason(
                    &format!("cannot read {} bytes at offset {offset}", buffer.len()),
                    &error,
                ))
            }
        })
    }

    /// Reads `length` bytes from `offset` through `buffer`, in pieces whose sizes are
    /// multiples of `unit` (so an element or a record never straddles two pieces), and hands
    /// each piece to `visit` with the number of bytes before it.
    pub(crate) fn read_in_pieces(
        &self,
        offset: u64,
        length: u64,
        unit: usize,
        buffer: &mut [u8],
        mut visit: impl FnMut(u64, &[u8]) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let unit = unit.max(1);
        let piece_capacity = buffer.len() - buffer.len() % unit;
        if piece_capacity == 0 {
            return Err(self.error(format!(
                "internal error: a {}-byte read buffer cannot hold a {unit}-byte unit",
                buffer.len()
            )));
        }
        let mut done = 0u64;
        while done < length {
            let piece = usize::try_from(length - done)
                .unwrap_or(usize::MAX)
                .min(piece_capacity);
            let piece_buffer = &mut buffer[..piece];
            self.read_exact_at(offset.saturating_add(done), piece_buffer)?;
            visit(done, piece_buffer)?;
            done += piece as u64;
        }
        Ok(())
    }
}

/// `"cannot open: no such file or directory (os error 2)"`: the action, then the system's
/// message in lowercase like every other reason.
pub(crate) fn io_reason(action: &str, error: &io::Error) -> String {
    let message = error.to_string();
    let mut characters = message.chars();
    let message = match characters.next() {
        Some(first) => first.to_lowercase().chain(characters).collect(),
        None => message,
    };
    format!("{action}: {message}")
}

/// Bytes of a big-endian u32 at `offset` of a header already read.
pub(crate) fn big_endian_u32(bytes: &[u8], offset: usize) -> u32 {
    u32::from_be_bytes([
        bytes[offset],
        bytes[offset + 1],
        bytes[offset + 2],
        bytes[offset + 3],
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_never_split_a_unit_and_cover_the_range() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("bytes");
        let content: Vec<u8> = (0..1000u32).map(|value| (value % 251) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        let file = DataFile::open(&path).unwrap();
        assert_eq!(file.length(), 1000);
        let mut buffer = [0u8; 64];
        let mut seen = Vec::new();
        file.read_in_pieces(10, 900, 3, &mut buffer, |before, piece| {
            assert_eq!(before as usize, seen.len());
            assert_eq!(piece.len() % 3, 0);
            assert!(piece.len() <= 63);
            seen.extend_from_slice(piece);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, &content[10..910]);
    }

    #[test]
    fn reading_past_the_end_and_missing_files_are_errors_naming_the_file() {
        let directory = tempfile::tempdir().unwrap();
        let path = directory.path().join("short");
        std::fs::write(&path, [1u8, 2, 3]).unwrap();
        let file = DataFile::open(&path).unwrap();
        let mut buffer = [0u8; 8];
        let error = file.read_exact_at(0, &mut buffer).unwrap_err().to_string();
        assert!(error.contains("short"), "{error}");
        assert!(error.contains("file ends before byte 8"), "{error}");

        let missing = DataFile::open(&directory.path().join("missing")).unwrap_err();
        let message = missing.to_string();
        assert!(
            message.contains("missing: cannot open: no such file"),
            "{message}"
        );

        let directory_error = DataFile::open(directory.path()).unwrap_err().to_string();
        assert!(
            directory_error.contains("is a directory"),
            "{directory_error}"
        );
    }
}
