//! `--image-archive FILE`: images an air-gapped node gets as a tarball, as `docker save`
//! (every version), `podman save` or `skopeo copy ... oci-archive:` write them. Each
//! archive is unpacked once into the cache's `archives/` (again when the file changes)
//! and read from there as an OCI image layout, before any registry:
//!
//! - an archive with Docker's `manifest.json` (`[{"Config", "RepoTags", "Layers"}]`,
//!   written by every `docker save`; Docker 25 and later write an OCI layout beside it)
//!   becomes a layout of its own: each image's config and layers as blobs (each layer's
//!   media type by its first bytes: gzip, zstd or a plain tar), a manifest for it, and
//!   `index.json` naming it by each of its `RepoTags`;
//! - an archive without one that holds `index.json` is a layout as it is.
//!
//! The archive is the operator's, not a tenant's; still, only its regular files are
//! read, every path it names stays inside it, and what it holds is checked like any
//! pull (digests, sizes, the layers as hostile input) when a job uses it.

use std::io::Read;
use std::path::{Component, Path, PathBuf};

use oci_client::manifest::{
    IMAGE_CONFIG_MEDIA_TYPE, IMAGE_LAYER_GZIP_MEDIA_TYPE, IMAGE_LAYER_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageManifest,
};
use sha2::{Digest, Sha256};

use super::layout::{IMAGE_LAYER_ZSTD_MEDIA_TYPE, add_to_index, create_layout, write_blob};

/// The OCI layout `archive` is read as, unpacked under `archives_directory` (made the
/// first time, or when the archive's size or modification time changed).
pub fn archive_layout(archive: &Path, archives_directory: &Path) -> Result<PathBuf, String> {
    let failed = |what: &str, error: std::io::Error| {
        format!(
            "--image-archive {}: cannot {what}: {error}",
            archive.display()
        )
    };
    let metadata = std::fs::metadata(archive).map_err(|error| failed("read it", error))?;
    let stamp = format!(
        "{} {:?}",
        metadata.len(),
        metadata
            .modified()
            .map_err(|error| failed("read it", error))?
    );
    let name = format!("{:x}", Sha256::digest(archive.to_string_lossy().as_bytes()));
    let unpacked = archives_directory.join(&name[..32]);
    let stamp_file = unpacked.join(".carve-archive-source");
    if std::fs::read_to_string(&stamp_file).is_ok_and(|seen| seen == stamp) {
        return Ok(unpacked.join("layout"));
    }
    let partial = archives_directory.join(format!("{}.partial", &name[..32]));
    for leftover in [&unpacked, &partial] {
        super::remove_without_following(leftover)
            .map_err(|error| failed("replace its earlier unpacking", error))?;
    }
    let contents = partial.join("contents");
    std::fs::create_dir_all(&contents).map_err(|error| failed("unpack it", error))?;
    let file = std::fs::File::open(archive).map_err(|error| failed("read it", error))?;
    tar::Archive::new(file)
        .unpack(&contents)
        .map_err(|error| failed("unpack it", error))?;
    let layout = partial.join("layout");
    if contents.join("manifest.json").is_file() {
        layout_of_docker_archive(&contents, &layout)
            .map_err(|reason| format!("--image-archive {}: {reason}", archive.display()))?;
    } else if contents.join("index.json").is_file() {
        std::fs::rename(&contents, &layout).map_err(|error| failed("unpack it", error))?;
    } else {
        return Err(format!(
            "--image-archive {}: neither a docker save archive (manifest.json) nor an OCI \
             layout (index.json)",
            archive.display()
        ));
    }
    let _ = std::fs::remove_dir_all(&contents);
    std::fs::write(partial.join(".carve-archive-source"), &stamp)
        .and_then(|()| std::fs::rename(&partial, &unpacked))
        .map_err(|error| failed("unpack it", error))?;
    Ok(unpacked.join("layout"))
}

/// One image of Docker's `manifest.json`.
#[derive(serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerArchiveImage {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

/// Writes the OCI layout of the Docker archive unpacked in `contents` to `layout`.
fn layout_of_docker_archive(contents: &Path, layout: &Path) -> Result<(), String> {
    let manifest_json = std::fs::read(contents.join("manifest.json"))
        .map_err(|error| format!("cannot read manifest.json: {error}"))?;
    let images: Vec<DockerArchiveImage> = serde_json::from_slice(&manifest_json)
        .map_err(|error| format!("manifest.json is not a docker save manifest: {error}"))?;
    let failed = |error: std::io::Error| format!("cannot write the layout: {error}");
    let blobs = create_layout(layout).map_err(failed)?;
    for image in images {
        let config = blob_of(contents, &image.config, &blobs, |_| {
            IMAGE_CONFIG_MEDIA_TYPE.to_string()
        })?;
        let layers = image
            .layers
            .iter()
            .map(|layer| blob_of(contents, layer, &blobs, layer_media_type))
            .collect::<Result<Vec<_>, _>>()?;
        let manifest = OciImageManifest {
            schema_version: 2,
            media_type: Some(OCI_IMAGE_MEDIA_TYPE.to_string()),
            config,
            layers,
            ..OciImageManifest::default()
        };
        let bytes = serde_json::to_vec(&manifest).map_err(|error| error.to_string())?;
        let descriptor = write_blob(&blobs, &bytes, OCI_IMAGE_MEDIA_TYPE).map_err(failed)?;
        for tag in image.repo_tags.unwrap_or_default() {
            add_to_index(layout, &descriptor, &tag).map_err(failed)?;
        }
    }
    Ok(())
}

/// The archive's file `relative` (a regular file inside `contents`, never through a
/// link) as a blob of `blobs`, with the media type `media_type` gives its first bytes.
fn blob_of(
    contents: &Path,
    relative: &str,
    blobs: &Path,
    media_type: impl Fn(&[u8]) -> String,
) -> Result<OciDescriptor, String> {
    let inside = Path::new(relative)
        .components()
        .all(|component| matches!(component, Component::Normal(_)));
    if !inside {
        return Err(format!(
            "manifest.json names {relative}, outside the archive"
        ));
    }
    let mut path = contents.to_path_buf();
    for component in Path::new(relative).components() {
        path.push(component);
        let kind = std::fs::symlink_metadata(&path)
            .map_err(|error| format!("manifest.json names {relative}: {error}"))?
            .file_type();
        if kind.is_symlink() {
            return Err(format!(
                "manifest.json names {relative}, which passes through a link"
            ));
        }
    }
    let mut file =
        std::fs::File::open(&path).map_err(|error| format!("cannot read {relative}: {error}"))?;
    let mut hasher = Sha256::new();
    let mut first_bytes = Vec::new();
    let mut size = 0u64;
    let mut buffer = vec![0u8; 1 << 20];
    loop {
        let read = file
            .read(&mut buffer)
            .map_err(|error| format!("cannot read {relative}: {error}"))?;
        if read == 0 {
            break;
        }
        if first_bytes.len() < 4 {
            first_bytes.extend_from_slice(&buffer[..read.min(4 - first_bytes.len())]);
        }
        hasher.update(&buffer[..read]);
        size += read as u64;
    }
    let digest = format!("sha256:{:x}", hasher.finalize());
    let blob = blobs.join(digest.trim_start_matches("sha256:"));
    if !blob.exists() && std::fs::hard_link(&path, &blob).is_err() {
        std::fs::copy(&path, &blob).map_err(|error| format!("cannot write the layout: {error}"))?;
    }
    Ok(OciDescriptor {
        media_type: media_type(&first_bytes),
        digest,
        size: size as i64,
        ..OciDescriptor::default()
    })
}

/// A layer's media type by its first bytes: gzip, zstd, else a plain tar.
fn layer_media_type(first_bytes: &[u8]) -> String {
    match first_bytes {
        [0x1f, 0x8b, ..] => IMAGE_LAYER_GZIP_MEDIA_TYPE,
        [0x28, 0xb5, 0x2f, 0xfd, ..] => IMAGE_LAYER_ZSTD_MEDIA_TYPE,
        _ => IMAGE_LAYER_MEDIA_TYPE,
    }
    .to_string()
}

#[cfg(test)]
mod tests;
