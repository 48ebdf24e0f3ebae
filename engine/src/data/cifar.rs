//! CIFAR-10 binary batches (`data_batch_1.bin` ... `test_batch.bin`): records of one label
//! byte followed by 3072 pixel bytes, the 1024 red values of the 32x32 image row-major, then
//! the 1024 green, then the 1024 blue.
//!
//! Several files make one data set, concatenated in the order the job lists them. The
//! records are channel-planar (CHW); the engine works in NHWC, so each record is
//! interleaved to height x width x channels and scaled to [0, 1] as it is read.

use std::path::PathBuf;

use carve_core::model::FeatureShape;

use super::file::{DataFile, SCAN_CHUNK_BYTES};
use super::{
    SampleLayout, SampleRequest, SampleSource, SampleTarget, TargetKind, label_out_of_range,
    shape_as_written,
};
use crate::error::EngineError;

pub const CIFAR10_IMAGE_SIDE: usize = 32;
pub const CIFAR10_CHANNELS: usize = 3;
const PIXELS_PER_CHANNEL: usize = CIFAR10_IMAGE_SIDE * CIFAR10_IMAGE_SIDE;
const IMAGE_BYTES: usize = PIXELS_PER_CHANNEL * CIFAR10_CHANNELS;
/// One label byte and the image.
pub const CIFAR10_RECORD_BYTES: usize = 1 + IMAGE_BYTES;

/// CIFAR-10 binary files as one data set.
#[derive(Debug)]
pub struct Cifar10Dataset {
    files: Vec<DataFile>,
    /// The global index of each file's first record, ascending, so a sample's file is found
    /// by binary search.
    first_record_of_file: Vec<u64>,
    records: u64,
    classes: u64,
}

impl Cifar10Dataset {
    /// Opens the files in order. The model input must be `[32, 32, 3]`; every label must be
    /// in `0..classes`.
    pub fn open(
        paths: &[PathBuf],
        input_shape: FeatureShape,
        classes: u64,
    ) -> Result<Self, EngineError> {
        let expected_shape = FeatureShape::Image {
            height: CIFAR10_IMAGE_SIDE as u64,
            width: CIFAR10_IMAGE_SIDE as u64,
            channels: CIFAR10_CHANNELS as u64,
        };
        let mut files = Vec::with_capacity(paths.len());
        let mut first_record_of_file = Vec::with_capacity(paths.len());
        let mut records = 0u64;
        for path in paths {
            let file = DataFile::open(path)?;
            if input_shape != expected_shape {
                return Err(file.error(format!(
                    "cifar-10 images are [32, 32, 3], but model.input_shape is {}",
                    shape_as_written(input_shape)
                )));
            }
            let record_bytes = CIFAR10_RECORD_BYTES as u64;
            if file.length() == 0 {
                return Err(file.error(format!(
                    "file is empty; a cifar-10 batch holds records of {record_bytes} bytes"
                )));
            }
            if !file.length().is_multiple_of(record_bytes) {
                return Err(file.error(format!(
                    "file is {} bytes, not a multiple of the {record_bytes}-byte cifar-10 record (1 label byte + 3072 pixel bytes)",
                    file.length()
                )));
            }
            let file_records = file.length() / record_bytes;
            check_labels(&file, file_records, classes)?;
            first_record_of_file.push(records);
            records += file_records;
            files.push(file);
        }
        if records == 0 {
            return Err(EngineError::data(
                "cifar10",
                "no files given; list the batch files in files = [...]",
            ));
        }
        Ok(Cifar10Dataset {
            files,
            first_record_of_file,
            records,
            classes,
        })
    }
}

/// One pass over a file for the label bytes, so an out-of-range label fails the open.
fn check_labels(file: &DataFile, records: u64, classes: u64) -> Result<(), EngineError> {
    let mut buffer = vec![0u8; SCAN_CHUNK_BYTES];
    file.read_in_pieces(
        0,
        file.length(),
        CIFAR10_RECORD_BYTES,
        &mut buffer,
        |before, piece| {
            let first_record = before / CIFAR10_RECORD_BYTES as u64;
            for (offset, record) in piece.chunks_exact(CIFAR10_RECORD_BYTES).enumerate() {
                if u64::from(record[0]) >= classes {
                    return Err(file.error(label_out_of_range(
                        record[0],
                        first_record + offset as u64,
                        classes,
                    )));
                }
            }
            Ok(())
        },
    )?;
    debug_assert_eq!(records * CIFAR10_RECORD_BYTES as u64, file.length());
    Ok(())
}

/// Writes a channel-planar (CHW) record image as height x width x channels, scaled to [0, 1].
pub(crate) fn planar_to_interleaved(planar: &[u8], interleaved: &mut [f32]) {
    for (channel, plane) in planar.chunks_exact(PIXELS_PER_CHANNEL).enumerate() {
        for (pixel, byte) in plane.iter().enumerate() {
            interleaved[pixel * CIFAR10_CHANNELS + channel] = f32::from(*byte) / 255.0;
        }
    }
}

impl SampleSource for Cifar10Dataset {
    fn source(&self) -> &str {
        self.files[0].path()
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout {
            samples: self.records,
            input_elements: IMAGE_BYTES,
            target_kind: TargetKind::Classes {
                classes: self.classes,
            },
        }
    }

    fn read_checked(&self, request: SampleRequest<'_>) -> Result<SampleTarget, EngineError> {
        let SampleRequest { index, input, .. } = request;
        // The last file whose first record is at or before `index`.
        let file_number = self
            .first_record_of_file
            .partition_point(|first| *first <= index)
            - 1;
        let file = &self.files[file_number];
        let record_in_file = index - self.first_record_of_file[file_number];
        let mut record = [0u8; CIFAR10_RECORD_BYTES];
        file.read_exact_at(record_in_file * CIFAR10_RECORD_BYTES as u64, &mut record)?;
        let label = record[0];
        // Checked at open; checked again because the file may have been replaced since.
        if u64::from(label) >= self.classes {
            return Err(file.error(label_out_of_range(label, record_in_file, self.classes)));
        }
        planar_to_interleaved(&record[1..], input);
        Ok(SampleTarget::Class(i32::from(label)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planar_records_become_height_width_channels() {
        let mut planar = vec![0u8; IMAGE_BYTES];
        for channel in 0..3 {
            for pixel in 0..PIXELS_PER_CHANNEL {
                planar[channel * PIXELS_PER_CHANNEL + pixel] = ((pixel * 3 + channel) % 256) as u8;
            }
        }
        let mut interleaved = vec![0f32; IMAGE_BYTES];
        planar_to_interleaved(&planar, &mut interleaved);
        for (position, value) in interleaved.iter().enumerate() {
            assert_eq!(*value, (position % 256) as u8 as f32 / 255.0);
        }
        // Row 1, column 2, green: pixel 34, channel 1.
        let row = 1;
        let column = 2;
        let pixel = row * 32 + column;
        assert_eq!(
            interleaved[(row * 32 + column) * 3 + 1],
            f32::from(planar[PIXELS_PER_CHANNEL + pixel]) / 255.0
        );
    }
}
