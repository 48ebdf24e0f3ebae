//! Writing an OCI image layout directory from layer tars: the air-gapped source the cache
//! reads (`--image-layout`), the images tests build (and push to a registry on
//! loopback), and a tiny image a development cluster can run.
//!
//! The layout is the OCI image-layout spec's: `oci-layout`, `index.json` naming each
//! manifest under `org.opencontainers.image.ref.name`, and `blobs/sha256/<hex>`.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use oci_client::manifest::{
    IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_MEDIA_TYPE,
    OCI_IMAGE_INDEX_MEDIA_TYPE, OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest,
};

use super::pull::sha256_digest;

/// The zstd layer media type (oci-client names gzip and plain only).
pub const IMAGE_LAYER_ZSTD_MEDIA_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

/// One layer to write: a tar's bytes and how to compress it.
#[derive(Debug, Clone)]
pub struct LayerToWrite {
    pub tar: Vec<u8>,
    pub compression: super::Compression,
}

/// An image written into a layout: what a registry push or a test needs of it.
#[derive(Debug, Clone)]
pub struct WrittenImage {
    pub manifest: OciImageManifest,
    /// The manifest's bytes as written (its digest is theirs).
    pub manifest_bytes: Vec<u8>,
    pub manifest_digest: String,
    pub config_bytes: Vec<u8>,
    /// Each layer's blob bytes (compressed), in order.
    pub layer_blobs: Vec<Vec<u8>>,
}

/// Writes an image of `layers` with `env` and `working_directory` into the layout at
/// `directory` (created if needed), named `ref_name` in its `index.json` (added to the
/// names already there).
pub fn write_image(
    directory: &Path,
    ref_name: &str,
    layers: &[LayerToWrite],
    env: &[String],
    working_directory: Option<&str>,
) -> std::io::Result<WrittenImage> {
    let blobs = create_layout(directory)?;
    let mut layer_descriptors = Vec::new();
    let mut layer_blobs = Vec::new();
    let mut diff_ids = Vec::new();
    for layer in layers {
        diff_ids.push(sha256_digest(&layer.tar));
        let (blob, media_type) = match layer.compression {
            super::Compression::None => (layer.tar.clone(), IMAGE_LAYER_MEDIA_TYPE),
            super::Compression::Gzip => {
                let mut encoder =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                encoder.write_all(&layer.tar)?;
                (encoder.finish()?, IMAGE_LAYER_GZIP_MEDIA_TYPE)
            }
            super::Compression::Zstd => (
                zstd::encode_all(layer.tar.as_slice(), 3)?,
                IMAGE_LAYER_ZSTD_MEDIA_TYPE,
            ),
        };
        layer_descriptors.push(write_blob(&blobs, &blob, media_type)?);
        layer_blobs.push(blob);
    }
    let config = serde_json::json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "config": {
            "Env": env,
            "WorkingDir": working_directory.unwrap_or(""),
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    });
    let config_bytes = serde_json::to_vec(&config).map_err(std::io::Error::other)?;
    let config_descriptor = write_blob(&blobs, &config_bytes, IMAGE_CONFIG_MEDIA_TYPE)?;
    let manifest = OciImageManifest {
        schema_version: 2,
        media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_string()),
        config: config_descriptor,
        layers: layer_descriptors,
        ..OciImageManifest::default()
    };
    let manifest_bytes = serde_json::to_vec(&manifest).map_err(std::io::Error::other)?;
    let manifest_descriptor = write_blob(&blobs, &manifest_bytes, OCI_IMAGE_MEDIA_TYPE)?;
    add_to_index(directory, &manifest_descriptor, ref_name)?;
    Ok(WrittenImage {
        manifest_digest: manifest_descriptor.digest,
        manifest,
        manifest_bytes,
        config_bytes,
        layer_blobs,
    })
}

/// Makes `directory` an OCI layout (its `oci-layout` file and blob directory, whose path
/// it returns), keeping what it holds already.
pub(super) fn create_layout(directory: &Path) -> std::io::Result<PathBuf> {
    let blobs = directory.join("blobs").join("sha256");
    std::fs::create_dir_all(&blobs)?;
    std::fs::write(
        directory.join("oci-layout"),
        br#"{"imageLayoutVersion":"1.0.0"}"#,
    )?;
    Ok(blobs)
}

/// The layout's blob file of `digest`.
pub fn blob_path(directory: &Path, digest: &str) -> PathBuf {
    directory
        .join("blobs")
        .join("sha256")
        .join(digest.trim_start_matches("sha256:"))
}

pub(super) fn write_blob(
    blobs: &Path,
    bytes: &[u8],
    media_type: &str,
) -> std::io::Result<OciDescriptor> {
    let digest = sha256_digest(bytes);
    std::fs::write(blobs.join(digest.trim_start_matches("sha256:")), bytes)?;
    Ok(OciDescriptor {
        media_type: media_type.to_string(),
        digest,
        size: bytes.len() as i64,
        ..OciDescriptor::default()
    })
}

/// Names `manifest` `ref_name` in the layout's `index.json` (made when missing), in place
/// of an entry of that name.
pub(super) fn add_to_index(
    directory: &Path,
    manifest: &OciDescriptor,
    ref_name: &str,
) -> std::io::Result<()> {
    let path = directory.join("index.json");
    let mut index: serde_json::Value = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(std::io::Error::other)?,
        Err(_) => serde_json::json!({
            "schemaVersion": 2,
            "mediaType": OCI_IMAGE_INDEX_MEDIA_TYPE,
            "manifests": [],
        }),
    };
    let annotations: BTreeMap<&str, &str> =
        BTreeMap::from([("org.opencontainers.image.ref.name", ref_name)]);
    let manifests = index["manifests"]
        .as_array_mut()
        .ok_or_else(|| std::io::Error::other("index.json has no manifests list"))?;
    manifests.retain(|entry| {
        entry["annotations"]["org.opencontainers.image.ref.name"].as_str() != Some(ref_name)
    });
    manifests.push(serde_json::json!({
        "mediaType": manifest.media_type,
        "digest": manifest.digest,
        "size": manifest.size,
        "annotations": annotations,
    }));
    std::fs::write(
        &path,
        serde_json::to_vec_pretty(&index).map_err(std::io::Error::other)?,
    )
}

/// Whether `bytes` is a 64-bit ELF without a program interpreter (`PT_INTERP`): one that
/// runs in an image holding no dynamic loader or libc (a dynamically linked busybox
/// would need the host's).
pub fn is_static_executable(bytes: &[u8]) -> bool {
    let read = |offset: usize, length: usize| -> Option<u64> {
        let slice = bytes.get(offset..offset + length)?;
        Some(
            slice
                .iter()
                .rev()
                .fold(0, |value, byte| value << 8 | u64::from(*byte)),
        )
    };
    if bytes.get(..5) != Some(b"\x7fELF\x02") {
        return false;
    }
    let (Some(table), Some(entry_size), Some(count)) =
        (read(0x20, 8), read(0x36, 2), read(0x38, 2))
    else {
        return false;
    };
    (0..count).all(|index| {
        let offset = (table + index * entry_size) as usize;
        read(offset, 4).is_some_and(|kind| kind != 3)
    })
}

/// This node's architecture as OCI names it.
pub fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// A tar of `files` (path inside the image, bytes, mode), with the directories above
/// them, and `symlinks` (path, target): the layers tests and small images are made of.
pub fn tar_of_files(files: &[(&str, &[u8], u32)], symlinks: &[(&str, &str)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut directories = std::collections::BTreeSet::new();
    for (path, _, _) in files {
        let mut parent = Path::new(path).parent();
        while let Some(directory) = parent.filter(|directory| !directory.as_os_str().is_empty()) {
            directories.insert(directory.to_path_buf());
            parent = directory.parent();
        }
    }
    for directory in &directories {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        builder
            .append_data(&mut header, directory, std::io::empty())
            .expect("a tar in memory");
    }
    for (path, bytes, mode) in files {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(*mode);
        header.set_size(bytes.len() as u64);
        builder
            .append_data(&mut header, path, *bytes)
            .expect("a tar in memory");
    }
    for (path, target) in symlinks {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Symlink);
        header.set_mode(0o777);
        header.set_size(0);
        builder
            .append_link(&mut header, path, target)
            .expect("a tar in memory");
    }
    builder.into_inner().expect("a tar in memory")
}
