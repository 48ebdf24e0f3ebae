//! IDX files, the format MNIST (and Fashion-MNIST, EMNIST, KMNIST) is distributed in: an
//! images file (magic `0x00000803`: unsigned bytes, dimensions N, H, W) and a labels file
//! (magic `0x00000801`: unsigned bytes, dimension N), both big-endian.
//!
//! Headers are checked at open (magic, counts equal, file lengths exact, image size against
//! the model's input shape) and the labels file is scanned once for labels outside the
//! model's classes, so a wrong file fails before training starts. Samples are then read on
//! demand with positioned reads: pixels scaled to [0, 1] by dividing by 255.

use std::path::Path;

use carve_core::model::FeatureShape;

use super::file::{DataFile, SAMPLE_CHUNK_BYTES, SCAN_CHUNK_BYTES, big_endian_u32};
use super::{
    SampleLayout, SampleRequest, SampleSource, SampleTarget, TargetKind, label_out_of_range,
    shape_as_written,
};
use crate::error::EngineError;

/// Unsigned-byte data (`0x08`) with 3 dimensions.
pub const IDX_IMAGES_MAGIC: u32 = 0x0000_0803;
/// Unsigned-byte data (`0x08`) with 1 dimension.
pub const IDX_LABELS_MAGIC: u32 = 0x0000_0801;
const IMAGES_HEADER_BYTES: u64 = 16;
const LABELS_HEADER_BYTES: u64 = 8;

/// A pair of IDX files as one data set.
#[derive(Debug)]
pub struct IdxDataset {
    images: DataFile,
    labels: DataFile,
    samples: u64,
    pixels_per_image: usize,
    classes: u64,
}

impl IdxDataset {
    /// Opens and checks both files. `input_shape` must be `[H, W, 1]` or `[H * W]` for the
    /// images' H x W; every label must be in `0..classes`.
    pub fn open(
        images_path: &Path,
        labels_path: &Path,
        input_shape: FeatureShape,
        classes: u64,
    ) -> Result<Self, EngineError> {
        let images = DataFile::open(images_path)?;
        let mut header = [0u8; IMAGES_HEADER_BYTES as usize];
        read_header(&images, &mut header, IDX_IMAGES_MAGIC, "idx images")?;
        let samples = u64::from(big_endian_u32(&header, 4));
        let height = u64::from(big_endian_u32(&header, 8));
        let width = u64::from(big_endian_u32(&header, 12));
        // Checked: a corrupt header may claim 2^32 x 2^32 x 2^32 bytes.
        let expected_length = samples
            .checked_mul(height)
            .and_then(|product| product.checked_mul(width))
            .and_then(|payload| payload.checked_add(IMAGES_HEADER_BYTES));
        match expected_length {
            Some(expected) if expected == images.length() => {}
            Some(expected) => {
                return Err(images.error(format!(
                    "file is {} bytes, expected {expected} for {samples} images of {height}x{width}",
                    images.length()
                )));
            }
            None => {
                return Err(images.error(format!(
                    "header claims {samples} images of {height}x{width}, more bytes than a file can hold"
                )));
            }
        }
        if samples == 0 {
            return Err(images.error("has no images"));
        }
        let matches_model = match input_shape {
            FeatureShape::Image {
                height: model_height,
                width: model_width,
                channels: 1,
            } => model_height == height && model_width == width,
            FeatureShape::Flat { features } => features == height * width,
            FeatureShape::Image { .. } => false,
        };
        if !matches_model {
            return Err(images.error(format!(
                "images are {height}x{width} with 1 channel, but model.input_shape is {}; use [{height}, {width}, 1] or [{}]",
                shape_as_written(input_shape),
                height * width
            )));
        }
        let pixels_per_image = usize::try_from(height * width)
            .map_err(|_| images.error(format!("{height}x{width} images are too large")))?;

        let labels = DataFile::open(labels_path)?;
        let mut header = [0u8; LABELS_HEADER_BYTES as usize];
        read_header(&labels, &mut header, IDX_LABELS_MAGIC, "idx labels")?;
        let label_count = u64::from(big_endian_u32(&header, 4));
        if label_count != samples {
            return Err(labels.error(format!(
                "has {label_count} labels but {samples} images (in {})",
                images.path()
            )));
        }
        let expected_length = LABELS_HEADER_BYTES + label_count;
        if labels.length() != expected_length {
            return Err(labels.error(format!(
                "file is {} bytes, expected {expected_length} for {label_count} labels",
                labels.length()
            )));
        }
        check_labels(&labels, samples, classes)?;
        Ok(IdxDataset {
            images,
            labels,
            samples,
            pixels_per_image,
            classes,
        })
    }
}

/// Reads a header and checks its magic number.
fn read_header(
    file: &DataFile,
    header: &mut [u8],
    expected_magic: u32,
    what: &str,
) -> Result<(), EngineError> {
    if file.length() < header.len() as u64 {
        return Err(file.error(format!(
            "file is {} bytes, shorter than the {}-byte {what} header",
            file.length(),
            header.len()
        )));
    }
    file.read_exact_at(0, header)?;
    let magic = big_endian_u32(header, 0);
    if magic != expected_magic {
        return Err(file.error(format!(
            "bad magic {magic:#010x}, expected {expected_magic:#010x} ({what})"
        )));
    }
    Ok(())
}

/// One pass over the labels file so an out-of-range label fails the open, not step 10 000.
fn check_labels(labels: &DataFile, samples: u64, classes: u64) -> Result<(), EngineError> {
    let mut buffer = vec![0u8; SCAN_CHUNK_BYTES];
    labels.read_in_pieces(
        LABELS_HEADER_BYTES,
        samples,
        1,
        &mut buffer,
        |before, piece| match piece.iter().position(|label| u64::from(*label) >= classes) {
            Some(position) => Err(labels.error(label_out_of_range(
                piece[position],
                before + position as u64,
                classes,
            ))),
            None => Ok(()),
        },
    )
}

impl SampleSource for IdxDataset {
    fn source(&self) -> &str {
        self.images.path()
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout {
            samples: self.samples,
            input_elements: self.pixels_per_image,
            target_kind: TargetKind::Classes {
                classes: self.classes,
            },
        }
    }

    fn read_checked(&self, request: SampleRequest<'_>) -> Result<SampleTarget, EngineError> {
        let SampleRequest { index, input, .. } = request;
        let pixels = self.pixels_per_image as u64;
        // In range: index < samples and the file length equals header + samples * pixels.
        let offset = IMAGES_HEADER_BYTES + index * pixels;
        let mut buffer = [0u8; SAMPLE_CHUNK_BYTES];
        self.images
            .read_in_pieces(offset, pixels, 1, &mut buffer, |before, piece| {
                let start = before as usize;
                for (value, byte) in input[start..start + piece.len()].iter_mut().zip(piece) {
                    *value = f32::from(*byte) / 255.0;
                }
                Ok(())
            })?;
        let mut label = [0u8; 1];
        self.labels
            .read_exact_at(LABELS_HEADER_BYTES + index, &mut label)?;
        // Checked at open; checked again because the file may have been replaced since.
        if u64::from(label[0]) >= self.classes {
            return Err(self
                .labels
                .error(label_out_of_range(label[0], index, self.classes)));
        }
        Ok(SampleTarget::Class(i32::from(label[0])))
    }
}
