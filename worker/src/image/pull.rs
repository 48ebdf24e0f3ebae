//! Fetching one image, verified, from where it lives: a registry (through `oci-client`,
//! with or without TLS and credentials) or an operator's OCI image layout directory (an
//! air-gapped node's images, `--image-layout`).
//!
//! Whatever the source, nothing is trusted by name: the manifest's bytes must hash to
//! the digest asked for (a pinned reference's, or the one the scheduler recorded at the
//! first pull), and every blob (config and layers) to its descriptor's digest and size,
//! before any of it is read. A manifest list (an index) is narrowed to this node's
//! platform, by digest, and verified the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use futures::StreamExt;
use oci_client::Reference;
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::{
    IMAGE_MANIFEST_LIST_MEDIA_TYPE, IMAGE_MANIFEST_MEDIA_TYPE, OCI_IMAGE_INDEX_MEDIA_TYPE,
    OCI_IMAGE_MEDIA_TYPE, OciDescriptor, OciImageIndex, OciImageManifest,
};
use oci_client::secrets::RegistryAuth;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::{ImageFailure, RegistryCredential};

/// The most bytes a manifest, index or config may have (registries cap manifests at
/// 4 MiB too).
const MAX_DOCUMENT_BYTES: usize = 4 * 1024 * 1024;

const ACCEPTED_MANIFESTS: [&str; 4] = [
    OCI_IMAGE_MEDIA_TYPE,
    IMAGE_MANIFEST_MEDIA_TYPE,
    OCI_IMAGE_INDEX_MEDIA_TYPE,
    IMAGE_MANIFEST_LIST_MEDIA_TYPE,
];

/// Where an image's bytes come from.
pub(super) enum Source<'a> {
    Registry {
        client: &'a oci_client::Client,
        reference: Reference,
        auth: RegistryAuth,
    },
    /// An OCI image layout directory (`oci-layout`, `index.json`, `blobs/sha256/...`).
    Layout { directory: PathBuf },
}

impl std::fmt::Debug for Source<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Registry { reference, .. } => write!(formatter, "registry {reference}"),
            Source::Layout { directory } => write!(formatter, "layout {}", directory.display()),
        }
    }
}

pub(super) fn registry_auth(credential: Option<&RegistryCredential>) -> RegistryAuth {
    match credential {
        Some(credential) => {
            RegistryAuth::Basic(credential.username.clone(), credential.password.clone())
        }
        None => RegistryAuth::Anonymous,
    }
}

/// The image a reference resolved to: its manifest (the platform's, out of an index),
/// the digest the reference resolved to (the index's when it is one), and its config.
#[derive(Debug)]
pub(super) struct ResolvedImage {
    pub resolved_digest: String,
    pub manifest: OciImageManifest,
    pub config: oci_client::config::ConfigFile,
}

/// The digest of `bytes`, as `sha256:<hex>`.
pub(super) fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

impl Source<'_> {
    /// Resolves `tag_or_digest` (a pinned digest when the caller has one) to this node's
    /// manifest and config, all verified.
    pub async fn resolve(&self, pinned: Option<&str>) -> Result<ResolvedImage, ImageFailure> {
        let (bytes, resolved_digest) = self.manifest(pinned).await?;
        let manifest = match parse_document(&bytes)? {
            Document::Manifest(manifest) => *manifest,
            Document::Index(index) => {
                let entry = oci_client::client::current_platform_resolver(&index.manifests)
                    .ok_or_else(|| {
                        ImageFailure::Refused(format!(
                            "the image has no manifest for this node's platform ({}/{}); it \
                             has {}",
                            std::env::consts::OS,
                            std::env::consts::ARCH,
                            index
                                .manifests
                                .iter()
                                .filter_map(|entry| entry.platform.as_ref())
                                .map(|platform| format!(
                                    "{}/{}",
                                    platform.os, platform.architecture
                                ))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ))
                    })?;
                let (bytes, _) = self.manifest(Some(&entry)).await?;
                match parse_document(&bytes)? {
                    Document::Manifest(manifest) => *manifest,
                    Document::Index(_) => {
                        return Err(ImageFailure::Refused(
                            "an index names another index for this platform".to_string(),
                        ));
                    }
                }
            }
        };
        let config_bytes = self.small_blob(&manifest.config).await?;
        let config = serde_json::from_slice(&config_bytes).map_err(|error| {
            ImageFailure::Refused(format!(
                "the image's config is not an image config: {error}"
            ))
        })?;
        Ok(ResolvedImage {
            resolved_digest,
            manifest,
            config,
        })
    }

    /// The manifest's bytes and their digest: by `digest` when given (verified to hash to
    /// it), else by the reference's own tag or digest.
    async fn manifest(&self, digest: Option<&str>) -> Result<(Vec<u8>, String), ImageFailure> {
        let (bytes, expected) = match self {
            Source::Registry {
                client,
                reference,
                auth,
            } => {
                let asked = match digest {
                    Some(digest) => reference.clone_with_digest(digest.to_string()),
                    None => reference.clone(),
                };
                let (bytes, _) = client
                    .pull_manifest_raw(&asked, auth, &ACCEPTED_MANIFESTS)
                    .await
                    .map_err(|error| registry_failure(&asked, error))?;
                (bytes.to_vec(), asked.digest().map(str::to_string))
            }
            Source::Layout { directory } => {
                let digest = match digest {
                    Some(digest) => digest.to_string(),
                    None => {
                        return Err(ImageFailure::Io(format!(
                            "layout {}: no digest to read",
                            directory.display()
                        )));
                    }
                };
                (
                    read_layout_blob(directory, &digest, MAX_DOCUMENT_BYTES).await?,
                    Some(digest),
                )
            }
        };
        if bytes.len() > MAX_DOCUMENT_BYTES {
            return Err(ImageFailure::Refused(format!(
                "its manifest is {} bytes, over {MAX_DOCUMENT_BYTES}",
                bytes.len()
            )));
        }
        let actual = sha256_digest(&bytes);
        if let Some(expected) = expected
            && expected != actual
        {
            return Err(ImageFailure::DigestMismatch(format!(
                "its manifest hashes to {actual}, not the {expected} asked for"
            )));
        }
        Ok((bytes, actual))
    }

    /// A config blob, whole in memory, verified.
    async fn small_blob(&self, descriptor: &OciDescriptor) -> Result<Vec<u8>, ImageFailure> {
        if descriptor.size < 0 || descriptor.size as usize > MAX_DOCUMENT_BYTES {
            return Err(ImageFailure::Refused(format!(
                "its config is declared as {} bytes",
                descriptor.size
            )));
        }
        let bytes = match self {
            Source::Registry {
                client, reference, ..
            } => {
                let mut bytes = Vec::new();
                client
                    .pull_blob(reference, descriptor, &mut bytes)
                    .await
                    .map_err(|error| registry_failure(reference, error))?;
                bytes
            }
            Source::Layout { directory } => {
                read_layout_blob(directory, &descriptor.digest, MAX_DOCUMENT_BYTES).await?
            }
        };
        verify_blob(descriptor, &sha256_digest(&bytes), bytes.len() as u64)?;
        Ok(bytes)
    }

    /// A layer, streamed to `path`, hashed as it comes, verified against its descriptor;
    /// `on_bytes` hears of every chunk (the pull's progress).
    pub async fn layer_to_file(
        &self,
        descriptor: &OciDescriptor,
        path: &Path,
        on_bytes: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(), ImageFailure> {
        let mut file = tokio::fs::File::create(path).await.map_err(|error| {
            ImageFailure::Io(format!("cannot create {}: {error}", path.display()))
        })?;
        let mut hasher = Sha256::new();
        let mut written: u64 = 0;
        let declared = u64::try_from(descriptor.size).unwrap_or(0);
        let mut take = |chunk: &[u8], written: &mut u64| -> Result<(), ImageFailure> {
            *written += chunk.len() as u64;
            if *written > declared {
                return Err(ImageFailure::DigestMismatch(format!(
                    "layer {} is longer than the {declared} bytes its manifest declares",
                    descriptor.digest
                )));
            }
            hasher.update(chunk);
            on_bytes(chunk.len() as u64);
            Ok(())
        };
        let write_failed = |error: std::io::Error| {
            ImageFailure::Io(format!("cannot write {}: {error}", path.display()))
        };
        match self {
            Source::Registry {
                client, reference, ..
            } => {
                let mut stream = client
                    .pull_blob_stream(reference, descriptor)
                    .await
                    .map_err(|error| registry_failure(reference, error))?;
                while let Some(chunk) = stream.next().await {
                    let chunk = chunk.map_err(|error| {
                        ImageFailure::Unavailable(format!(
                            "reading layer {}: {error}",
                            descriptor.digest
                        ))
                    })?;
                    take(&chunk, &mut written)?;
                    file.write_all(&chunk).await.map_err(write_failed)?;
                }
            }
            Source::Layout { directory } => {
                let source = layout_blob_path(directory, &descriptor.digest)?;
                let mut input = tokio::fs::File::open(&source).await.map_err(|error| {
                    ImageFailure::NotFound(format!(
                        "layout {} has no blob {}: {error}",
                        directory.display(),
                        descriptor.digest
                    ))
                })?;
                let mut buffer = vec![0_u8; 1 << 20];
                loop {
                    use tokio::io::AsyncReadExt;
                    let read = input.read(&mut buffer).await.map_err(write_failed)?;
                    if read == 0 {
                        break;
                    }
                    take(&buffer[..read], &mut written)?;
                    file.write_all(&buffer[..read])
                        .await
                        .map_err(write_failed)?;
                }
            }
        }
        file.flush().await.map_err(write_failed)?;
        verify_blob(
            descriptor,
            &format!("sha256:{:x}", hasher.finalize()),
            written,
        )
    }
}

fn verify_blob(descriptor: &OciDescriptor, actual: &str, length: u64) -> Result<(), ImageFailure> {
    if actual != descriptor.digest {
        return Err(ImageFailure::DigestMismatch(format!(
            "blob {} hashes to {actual}",
            descriptor.digest
        )));
    }
    if i64::try_from(length).ok() != Some(descriptor.size) {
        return Err(ImageFailure::DigestMismatch(format!(
            "blob {} is {length} bytes, not the {} its manifest declares",
            descriptor.digest, descriptor.size
        )));
    }
    Ok(())
}

enum Document {
    Manifest(Box<OciImageManifest>),
    Index(OciImageIndex),
}

/// A manifest or an index, told apart by their own fields (a registry's content type
/// and the document's `mediaType` may be missing).
fn parse_document(bytes: &[u8]) -> Result<Document, ImageFailure> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|error| ImageFailure::Refused(format!("its manifest is not JSON: {error}")))?;
    let refused = |error: serde_json::Error| {
        ImageFailure::Refused(format!("its manifest cannot be read: {error}"))
    };
    if value.get("manifests").is_some() {
        Ok(Document::Index(
            serde_json::from_value(value).map_err(refused)?,
        ))
    } else if value.get("layers").is_some() {
        Ok(Document::Manifest(
            serde_json::from_value(value).map_err(refused)?,
        ))
    } else {
        Err(ImageFailure::Refused(
            "its manifest is neither an image manifest nor an index (a schema 1 manifest?)"
                .to_string(),
        ))
    }
}

/// The failure a registry's answer means for the job: missing, refused credential,
/// digest, or the registry being unreachable (which a later attempt may not meet).
fn registry_failure(reference: &Reference, error: OciDistributionError) -> ImageFailure {
    // With its causes: "error sending request" alone hides the refused certificate or
    // the refused connection an operator needs to see.
    let text = std::iter::successors(Some(&error as &dyn std::error::Error), |error| {
        error.source()
    })
    .map(ToString::to_string)
    .collect::<Vec<_>>()
    .join(": ");
    match &error {
        OciDistributionError::ImageManifestNotFoundError(_) => {
            ImageFailure::NotFound(format!("{reference} is not in its registry"))
        }
        OciDistributionError::AuthenticationFailure(_)
        | OciDistributionError::UnauthorizedError { .. } => ImageFailure::Unauthorized(format!(
            "the registry refused access to {reference} (a private image needs \
             command.image_pull_secret naming a secret with a credential it accepts)"
        )),
        OciDistributionError::DigestError(_) => ImageFailure::DigestMismatch(text),
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<&OciErrorCode> =
                envelope.errors.iter().map(|error| &error.code).collect();
            if codes
                .iter()
                .any(|code| matches!(code, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                ImageFailure::Unauthorized(format!(
                    "the registry refused access to {reference} (a private image needs \
                     command.image_pull_secret naming a secret with a credential it accepts)"
                ))
            } else if codes.iter().any(|code| {
                matches!(
                    code,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::NotFound
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::ManifestBlobUnknown
                )
            }) {
                ImageFailure::NotFound(format!("{reference} is not in its registry ({text})"))
            } else {
                ImageFailure::Unavailable(text)
            }
        }
        OciDistributionError::ServerError {
            code: 401 | 403, ..
        } => ImageFailure::Unauthorized(format!(
            "the registry refused access to {reference} ({text})"
        )),
        OciDistributionError::ServerError { code: 404, .. } => {
            ImageFailure::NotFound(format!("{reference} is not in its registry ({text})"))
        }
        _ => ImageFailure::Unavailable(format!("{reference}: {text}")),
    }
}

/// The path of a blob in a layout, from a digest that is only ever `sha256:<64 hex>`
/// (checked here: it becomes a file name).
fn layout_blob_path(directory: &Path, digest: &str) -> Result<PathBuf, ImageFailure> {
    carve_core::command::image::check_digest("digest", digest)
        .map_err(|error| ImageFailure::Refused(error.reason))?;
    Ok(directory
        .join("blobs")
        .join("sha256")
        .join(&digest["sha256:".len()..]))
}

async fn read_layout_blob(
    directory: &Path,
    digest: &str,
    limit: usize,
) -> Result<Vec<u8>, ImageFailure> {
    let path = layout_blob_path(directory, digest)?;
    let metadata = tokio::fs::metadata(&path).await.map_err(|error| {
        ImageFailure::NotFound(format!(
            "layout {} has no blob {digest}: {error}",
            directory.display()
        ))
    })?;
    if metadata.len() > limit as u64 {
        return Err(ImageFailure::Refused(format!(
            "blob {digest} is {} bytes, over {limit}",
            metadata.len()
        )));
    }
    tokio::fs::read(&path)
        .await
        .map_err(|error| ImageFailure::Io(format!("cannot read {}: {error}", path.display())))
}

/// The manifest digest an OCI layout's `index.json` gives `reference` under: an entry
/// whose `org.opencontainers.image.ref.name` is the reference in full
/// (`registry/repository:tag`), without its registry (`repository:tag`) or any name that
/// means the same reference (`busybox:latest` for Docker Hub's), or, for a
/// reference pinned by digest, an entry of that digest. `None`: the layout does not have
/// the image.
pub(super) async fn find_in_layout(
    directory: &Path,
    canonical: &str,
    reference: &Reference,
) -> Result<Option<String>, ImageFailure> {
    let index_path = directory.join("index.json");
    let bytes = match tokio::fs::read(&index_path).await {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => {
            return Err(ImageFailure::Io(format!(
                "cannot read {}: {error}",
                index_path.display()
            )));
        }
    };
    #[derive(serde::Deserialize)]
    struct LayoutIndex {
        manifests: Vec<LayoutEntry>,
    }
    #[derive(serde::Deserialize)]
    struct LayoutEntry {
        digest: String,
        #[serde(default)]
        annotations: BTreeMap<String, String>,
    }
    let index: LayoutIndex = serde_json::from_slice(&bytes).map_err(|error| {
        ImageFailure::Io(format!(
            "{} is not an OCI index: {error}",
            index_path.display()
        ))
    })?;
    if let Some(digest) = reference.digest() {
        return Ok(index
            .manifests
            .iter()
            .any(|entry| entry.digest == digest)
            .then(|| digest.to_string()));
    }
    let short = match reference.tag() {
        Some(tag) => format!("{}:{tag}", reference.repository()),
        None => reference.repository().to_string(),
    };
    Ok(index
        .manifests
        .into_iter()
        .find(|entry| {
            entry
                .annotations
                .get("org.opencontainers.image.ref.name")
                .is_some_and(|name| {
                    name == canonical
                        || *name == short
                        // `busybox:latest`, as `docker save` names it, is Docker Hub's.
                        || name
                            .parse::<Reference>()
                            .is_ok_and(|named| named.whole() == reference.whole())
                })
        })
        .map(|entry| entry.digest))
}
