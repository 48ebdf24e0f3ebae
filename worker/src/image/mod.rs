//! Job images: pulling a command job's image (`command.image`), verifying it and keeping
//! it unpacked in a cache that the node's attempts share.
//!
//! - `pull.rs`: the image's manifest, config and layers from a registry (`oci-client`)
//!   or an operator's OCI image layout directory, every byte verified against its digest;
//! - `container_root.rs`: an image as one run's read-only root (an overlay with the
//!   run's mount points above the cached image);
//! - `layout.rs`: writing an OCI image layout (air-gapped sources, test images);
//! - `unpack.rs`: layers applied to one root filesystem, as hostile input (no entry
//!   outside the root, links resolved inside it, whiteouts, size bounds).
//!
//! The cache (`<checkpoint dir>/images/`, [`ImageCache`]): one directory per resolved
//! manifest digest (`images/<hex>/rootfs`, with `image.json` saying what it is), so two
//! tags of the same bytes share it and a retag never changes what a pinned job runs.
//! Attempts hold a [`PulledImage`] while they run; the cache keeps its total under
//! `--image-cache-limit` by removing the least recently used images **that no attempt
//! holds** (it may stay over its limit rather than remove one in use). Concurrent
//! requests for one image wait for a single pull. Images are unpacked into `staging/`
//! and renamed into place once whole, so a crash never leaves half an image in the cache;
//! removed ones are renamed into `trash/` first, so a new pull of the same digest never
//! meets a half-deleted directory.
//!
//! The files are the worker's (root's) on the host, read-only to everyone else; a
//! container sees an image's root read-only (`sandbox/`).

mod archive;
pub mod container_root;
pub mod layout;
mod pull;
mod registry_authorities;
mod unpack;
pub(crate) use unpack::remove_without_following;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use oci_client::Reference;
use oci_client::client::{ClientConfig, ClientProtocol};

pub use registry_authorities::{RegistryAuthority, read_registry_authority};
pub use unpack::{Compression, UnpackError, UnpackSummary, apply_layer, resolve_in_root};

use pull::Source;

/// The default size limit of the image cache: 100 GiB.
pub const DEFAULT_CACHE_LIMIT_BYTES: u64 = 100 * 1024 * 1024 * 1024;

/// The operator's settings for job images.
#[derive(Debug, Clone)]
pub struct ImageSettings {
    /// Where unpacked images live (`<checkpoint dir>/images` by default).
    pub cache_directory: PathBuf,
    /// `--image-cache-limit`: the most bytes of unpacked images the cache keeps when no
    /// attempt holds them.
    pub cache_limit_bytes: u64,
    /// `--insecure-registry HOST[:PORT]`: registries reached over plain HTTP.
    pub insecure_registries: Vec<String>,
    /// `--image-layout DIR`: OCI image layout directories looked in before any registry
    /// (an air-gapped node's images), by `org.opencontainers.image.ref.name`.
    pub layout_directories: Vec<PathBuf>,
    /// `--registry-ca REGISTRY=FILE`: private registries' certificate authorities.
    pub registry_authorities: Vec<RegistryAuthority>,
    /// `--image-archive FILE`: `docker save` (or OCI) tarballs read as layouts, after
    /// the layout directories ([`archive`]).
    pub archives: Vec<PathBuf>,
}

impl ImageSettings {
    /// The defaults under `checkpoint_directory`.
    pub fn under(checkpoint_directory: &Path) -> ImageSettings {
        ImageSettings {
            cache_directory: checkpoint_directory.join("images"),
            cache_limit_bytes: DEFAULT_CACHE_LIMIT_BYTES,
            insecure_registries: Vec::new(),
            layout_directories: Vec::new(),
            registry_authorities: Vec::new(),
            archives: Vec::new(),
        }
    }
}

/// A registry credential (a tenant's pull secret), never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryCredential {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for RegistryCredential {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("RegistryCredential(<redacted>)")
    }
}

/// Why an image could not be had. Only [`ImageFailure::Unavailable`] and
/// [`ImageFailure::Io`] may pass with a later try; the others are the job's to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageFailure {
    /// No such repository, tag or digest.
    NotFound(String),
    /// The registry refused the credential, or wants one the job did not give.
    Unauthorized(String),
    /// Bytes that do not hash to the digest they were asked for or declared with.
    DigestMismatch(String),
    /// An image the worker will not run: unreadable, hostile, too big, another platform.
    Refused(String),
    /// The registry could not be reached or failed.
    Unavailable(String),
    /// The worker's own disk.
    Io(String),
}

impl ImageFailure {
    /// Whether another attempt (on this node or another) may succeed unchanged.
    pub fn is_transient(&self) -> bool {
        matches!(self, ImageFailure::Unavailable(_) | ImageFailure::Io(_))
    }
}

impl std::fmt::Display for ImageFailure {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (what, reason) = match self {
            ImageFailure::NotFound(reason) => ("image not found", reason),
            ImageFailure::Unauthorized(reason) => ("registry credential refused", reason),
            ImageFailure::DigestMismatch(reason) => ("image digest mismatch", reason),
            ImageFailure::Refused(reason) => ("image refused", reason),
            ImageFailure::Unavailable(reason) => ("registry unavailable", reason),
            ImageFailure::Io(reason) => ("image cache", reason),
        };
        write!(formatter, "{what}: {reason}")
    }
}

/// How far a pull is, for `carve get` and `watch`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PullProgress {
    pub done_bytes: u64,
    pub total_bytes: u64,
}

/// One image to run: its reference in full, the digest the scheduler pinned it to (from
/// the job's first pull; `None` before it), and the credential of its pull secret.
#[derive(Debug, Clone)]
pub struct ImageRequest {
    pub reference: String,
    pub pinned_digest: Option<String>,
    pub credential: Option<RegistryCredential>,
}

/// What `image.json` keeps of an image, beside its root.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CachedImageRecord {
    /// The reference it was first pulled by (for people reading the cache).
    pub reference: String,
    /// The digest a reference resolves to (an index's, for a multi-platform image).
    pub digest: String,
    /// The bytes of its unpacked files.
    pub size_bytes: u64,
    /// The image config's `Env` (`KEY=value`), which the program starts with.
    pub env: Vec<String>,
    /// The image config's `WorkingDir`.
    pub working_directory: Option<String>,
}

/// An image an attempt uses: its root filesystem stays in the cache while this lives.
#[derive(Debug)]
pub struct PulledImage {
    pub record: CachedImageRecord,
    pub rootfs: PathBuf,
    /// Whether this request pulled it (else the cache had it).
    pub pulled_now: bool,
    cache: Arc<CacheInner>,
}

impl Drop for PulledImage {
    fn drop(&mut self) {
        let mut state = self.cache.lock();
        if let Some(entry) = state.entries.get_mut(&self.record.digest) {
            entry.users = entry.users.saturating_sub(1);
        }
    }
}

#[derive(Debug)]
struct CacheEntry {
    size_bytes: u64,
    /// A logical clock: larger is more recent.
    last_used: u64,
    /// Attempts holding it now; never evicted while > 0.
    users: usize,
}

#[derive(Debug, Default)]
struct CacheState {
    entries: HashMap<String, CacheEntry>,
    clock: u64,
}

struct CacheInner {
    directory: PathBuf,
    limit_bytes: u64,
    /// `--insecure-registry`: registries reached over plain HTTP.
    insecure_registries: Vec<String>,
    registry_authorities: Vec<RegistryAuthority>,
    layouts: Vec<PathBuf>,
    state: Mutex<CacheState>,
    /// One lock per digest being pulled: a second request for it waits, then finds it.
    pulls: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pulls_done: AtomicU64,
    trash_counter: AtomicU64,
}

impl std::fmt::Debug for CacheInner {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("CacheInner")
            .field("directory", &self.directory)
            .field("limit_bytes", &self.limit_bytes)
            .finish_non_exhaustive()
    }
}

impl CacheInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn images(&self) -> PathBuf {
        self.directory.join("images")
    }

    fn image_directory(&self, digest: &str) -> PathBuf {
        self.images().join(digest.trim_start_matches("sha256:"))
    }
}

/// The node's image cache; cloning shares it.
#[derive(Debug, Clone)]
pub struct ImageCache {
    inner: Arc<CacheInner>,
}

fn io_failure(context: String) -> impl FnOnce(std::io::Error) -> ImageFailure {
    move |error| ImageFailure::Io(format!("{context}: {error}"))
}

impl ImageCache {
    /// Opens (or creates) the cache of `settings`, reading the images a previous run
    /// left; half-unpacked and half-removed ones are deleted.
    pub fn open(settings: &ImageSettings) -> Result<ImageCache, ImageFailure> {
        use std::os::unix::fs::PermissionsExt;
        let directory = settings.cache_directory.clone();
        container_root::remove_leftover_run_roots(&directory.join("runs"));
        for name in ["staging", "trash"] {
            let _ = std::fs::remove_dir_all(directory.join(name));
        }
        for path in [
            directory.clone(),
            directory.join("images"),
            directory.join("staging"),
            directory.join("trash"),
            directory.join("runs"),
        ] {
            std::fs::create_dir_all(&path)
                .map_err(io_failure(format!("cannot create {}", path.display())))?;
            // Containers' root users (tenants' host ids) pass through to an image's root;
            // nobody but the worker lists what is cached.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o711))
                .map_err(io_failure(format!("cannot set up {}", path.display())))?;
        }
        install_crypto_provider();
        // Absolute: an image root is an overlay's lower directory and a runtime's root
        // path, which a relative path would make relative to something else.
        let directory = directory.canonicalize().map_err(io_failure(format!(
            "cannot resolve {}",
            directory.display()
        )))?;
        let mut layouts = settings.layout_directories.clone();
        for archive in &settings.archives {
            layouts.push(
                archive::archive_layout(archive, &directory.join("archives"))
                    .map_err(ImageFailure::Io)?,
            );
        }
        let mut state = CacheState::default();
        let mut found: Vec<(std::time::SystemTime, String, u64)> = Vec::new();
        let images = directory.join("images");
        for entry in std::fs::read_dir(&images)
            .map_err(io_failure(format!("cannot list {}", images.display())))?
            .flatten()
        {
            let record_path = entry.path().join("image.json");
            let record = std::fs::read(&record_path)
                .ok()
                .and_then(|bytes| serde_json::from_slice::<CachedImageRecord>(&bytes).ok());
            match record {
                Some(record)
                    if record.digest.trim_start_matches("sha256:")
                        == entry.file_name().to_string_lossy() =>
                {
                    let used = std::fs::metadata(entry.path().join("last-used"))
                        .and_then(|metadata| metadata.modified())
                        .unwrap_or(std::time::UNIX_EPOCH);
                    found.push((used, record.digest, record.size_bytes));
                }
                _ => {
                    tracing::warn!(path = %entry.path().display(), "removing an unreadable cached image");
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
        found.sort();
        for (_, digest, size_bytes) in found {
            state.clock += 1;
            state.entries.insert(
                digest,
                CacheEntry {
                    size_bytes,
                    last_used: state.clock,
                    users: 0,
                },
            );
        }
        Ok(ImageCache {
            inner: Arc::new(CacheInner {
                directory,
                limit_bytes: settings.cache_limit_bytes,
                insecure_registries: settings.insecure_registries.clone(),
                registry_authorities: settings.registry_authorities.clone(),
                layouts,
                state: Mutex::new(state),
                pulls: Mutex::new(HashMap::new()),
                pulls_done: AtomicU64::new(0),
                trash_counter: AtomicU64::new(0),
            }),
        })
    }

    /// A registry client for one request. A registry on loopback (`localhost`,
    /// `127.0.0.0/8`, `[::1]`) is reached over plain HTTP, as Docker does: nothing
    /// between the worker and it can read or change the traffic; unless the operator
    /// named its CA (`registry_authorities`), which only its requests trust.
    fn client(&self, reference: &Reference) -> oci_client::Client {
        let mut insecure = self.inner.insecure_registries.clone();
        let registry = reference.registry();
        let host = registry
            .rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|byte| byte.is_ascii_digit()))
            .map_or(registry, |(host, _)| host);
        let loopback = host == "localhost"
            || host == "[::1]"
            || host
                .parse::<std::net::Ipv4Addr>()
                .is_ok_and(|address| address.is_loopback());
        let authorities =
            registry_authorities::authorities_for(&self.inner.registry_authorities, registry);
        if loopback && authorities.is_empty() {
            insecure.push(registry.to_string());
        }
        let protocol = if insecure.is_empty() {
            ClientProtocol::Https
        } else {
            ClientProtocol::HttpsExcept(insecure)
        };
        let mut config = ClientConfig {
            protocol,
            extra_root_certificates: authorities,
            ..ClientConfig::default()
        };
        config.platform_resolver = Some(Box::new(oci_client::client::current_platform_resolver));
        oci_client::Client::new(config)
    }

    /// Where runs' image roots are mounted (`container_root.rs`).
    pub fn runs_directory(&self) -> PathBuf {
        self.inner.directory.join("runs")
    }

    /// How many images this cache pulled and unpacked since it was opened.
    pub fn pulls_done(&self) -> u64 {
        self.inner.pulls_done.load(Ordering::SeqCst)
    }

    /// The digests of the images the cache holds now.
    pub fn cached_digests(&self) -> Vec<String> {
        let mut digests: Vec<String> = self.inner.lock().entries.keys().cloned().collect();
        digests.sort();
        digests
    }

    /// The digests of at most `limit` images the cache holds now, the most recently
    /// used first (what heartbeats tell the scheduler, for placement).
    pub fn recently_used_digests(&self, limit: usize) -> Vec<String> {
        let state = self.inner.lock();
        let mut entries: Vec<(&String, u64)> = state
            .entries
            .iter()
            .map(|(digest, entry)| (digest, entry.last_used))
            .collect();
        entries.sort_by(|left, right| right.1.cmp(&left.1).then_with(|| left.0.cmp(right.0)));
        entries
            .into_iter()
            .take(limit)
            .map(|(digest, _)| digest.clone())
            .collect()
    }

    /// The bytes of unpacked images the cache holds now.
    pub fn cached_bytes(&self) -> u64 {
        self.inner
            .lock()
            .entries
            .values()
            .map(|entry| entry.size_bytes)
            .sum()
    }

    /// The image `request` names, from the cache or pulled into it, held for the caller
    /// until the returned value is dropped. `progress` hears of a pull's bytes.
    pub async fn acquire(
        &self,
        request: &ImageRequest,
        progress: Option<&tokio::sync::watch::Sender<PullProgress>>,
    ) -> Result<PulledImage, ImageFailure> {
        let reference = Reference::try_from(request.reference.as_str()).map_err(|error| {
            ImageFailure::Refused(format!(
                "{:?} is not an image reference: {error}",
                request.reference
            ))
        })?;
        if let Some(pinned) = &request.pinned_digest {
            carve_core::command::image::check_digest("digest", pinned)
                .map_err(|error| ImageFailure::Refused(error.reason))?;
            if let Some(digest) = reference.digest()
                && digest != pinned
            {
                return Err(ImageFailure::DigestMismatch(format!(
                    "{} names {digest}, but the job was pinned to {pinned}",
                    request.reference
                )));
            }
            // Pinned and here: no registry is asked at all.
            if let Some(image) = self.lease(pinned)? {
                return Ok(image);
            }
        }
        let mut layout = None;
        for directory in &self.inner.layouts {
            if let Some(digest) =
                pull::find_in_layout(directory, &request.reference, &reference).await?
            {
                layout = Some((directory.clone(), digest));
                break;
            }
        }
        // A client of this request's own: oci-client keeps the first credential it is
        // given for a registry, so a shared one would pull for one tenant with
        // another's.
        let client = self.client(&reference);
        let (source, layout_digest) = match layout {
            Some((directory, digest)) => (Source::Layout { directory }, Some(digest)),
            None => (
                Source::Registry {
                    client: &client,
                    reference: reference.clone(),
                    auth: pull::registry_auth(request.credential.as_ref()),
                },
                None,
            ),
        };
        let wanted = request
            .pinned_digest
            .clone()
            .or_else(|| reference.digest().map(str::to_string));
        let resolved = source
            .resolve(wanted.as_deref().or(layout_digest.as_deref()))
            .await
            .map_err(|failure| match (failure, &request.pinned_digest) {
                (ImageFailure::NotFound(reason), Some(pinned)) => {
                    ImageFailure::DigestMismatch(format!(
                        "the job runs {pinned}, the digest its first pull resolved to, and \
                         its source no longer has it ({reason})"
                    ))
                }
                (failure, _) => failure,
            })?;
        let digest = resolved.resolved_digest.clone();
        if let Some(wanted) = &wanted
            && *wanted != digest
        {
            return Err(ImageFailure::DigestMismatch(format!(
                "{} resolved to {digest}, not {wanted}",
                request.reference
            )));
        }

        let pull_lock = {
            let mut pulls = self
                .inner
                .pulls
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            pulls.entry(digest.clone()).or_default().clone()
        };
        let _pulling = pull_lock.lock().await;
        if let Some(image) = self.lease(&digest)? {
            return Ok(image);
        }
        let result = self
            .pull_and_unpack(&request.reference, &source, resolved, progress)
            .await;
        self.inner
            .pulls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&digest);
        result
    }

    /// The cached image `digest`, held, when the cache has it.
    fn lease(&self, digest: &str) -> Result<Option<PulledImage>, ImageFailure> {
        let directory = self.inner.image_directory(digest);
        {
            let mut state = self.inner.lock();
            state.clock += 1;
            let clock = state.clock;
            let Some(entry) = state.entries.get_mut(digest) else {
                return Ok(None);
            };
            entry.users += 1;
            entry.last_used = clock;
        }
        let record = std::fs::read(directory.join("image.json"))
            .map_err(io_failure(format!("cannot read {}", directory.display())))
            .and_then(|bytes| {
                serde_json::from_slice::<CachedImageRecord>(&bytes)
                    .map_err(|error| ImageFailure::Io(format!("{}: {error}", directory.display())))
            });
        let record = match record {
            Ok(record) => record,
            Err(failure) => {
                let mut state = self.inner.lock();
                if let Some(entry) = state.entries.get_mut(digest) {
                    entry.users = entry.users.saturating_sub(1);
                }
                return Err(failure);
            }
        };
        let image = self.held(record, &directory, false);
        touch(&directory.join("last-used"));
        // Images released since the last pull may have left the cache over its limit.
        self.evict_over_limit();
        Ok(Some(image))
    }

    fn held(&self, record: CachedImageRecord, directory: &Path, pulled_now: bool) -> PulledImage {
        PulledImage {
            record,
            rootfs: directory.join("rootfs"),
            pulled_now,
            cache: self.inner.clone(),
        }
    }

    async fn pull_and_unpack(
        &self,
        reference: &str,
        source: &Source<'_>,
        resolved: pull::ResolvedImage,
        progress: Option<&tokio::sync::watch::Sender<PullProgress>>,
    ) -> Result<PulledImage, ImageFailure> {
        let digest = resolved.resolved_digest.clone();
        let declared: u64 = resolved
            .manifest
            .layers
            .iter()
            .map(|layer| u64::try_from(layer.size).unwrap_or(u64::MAX))
            .fold(0, u64::saturating_add);
        if declared > self.inner.limit_bytes {
            return Err(ImageFailure::Refused(format!(
                "its layers are {declared} bytes, more than this worker's image cache holds \
                 ({} bytes, --image-cache-limit)",
                self.inner.limit_bytes
            )));
        }
        let staging = self.inner.directory.join("staging").join(format!(
            "{}-{}",
            digest.trim_start_matches("sha256:"),
            self.inner.trash_counter.fetch_add(1, Ordering::SeqCst)
        ));
        let rootfs = staging.join("rootfs");
        std::fs::create_dir_all(&rootfs)
            .map_err(io_failure(format!("cannot create {}", rootfs.display())))?;
        let result = self
            .unpack_into(source, &resolved, &staging, declared, progress)
            .await;
        let size_bytes = match result {
            Ok(size_bytes) => size_bytes,
            Err(failure) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(failure);
            }
        };
        let config = resolved.config.config.unwrap_or_default();
        let record = CachedImageRecord {
            reference: reference.to_string(),
            digest: digest.clone(),
            size_bytes,
            env: config.env.unwrap_or_default(),
            working_directory: config.working_dir.filter(|directory| !directory.is_empty()),
        };
        let record_bytes = serde_json::to_vec_pretty(&record)
            .map_err(|error| ImageFailure::Io(format!("cannot write image.json: {error}")))?;
        std::fs::write(staging.join("image.json"), record_bytes)
            .map_err(io_failure(format!("cannot write {}", staging.display())))?;
        touch(&staging.join("last-used"));
        {
            use std::os::unix::fs::PermissionsExt;
            for path in [&staging, &rootfs] {
                let mode = if path == &rootfs { 0o755 } else { 0o711 };
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
                    .map_err(io_failure(format!("cannot set up {}", path.display())))?;
            }
        }
        let directory = self.inner.image_directory(&digest);
        std::fs::rename(&staging, &directory).map_err(io_failure(format!(
            "cannot move {} into place",
            staging.display()
        )))?;
        self.inner.pulls_done.fetch_add(1, Ordering::SeqCst);
        {
            let mut state = self.inner.lock();
            state.clock += 1;
            let clock = state.clock;
            state.entries.insert(
                digest.clone(),
                CacheEntry {
                    size_bytes,
                    last_used: clock,
                    users: 1,
                },
            );
        }
        self.evict_over_limit();
        tracing::info!(image = reference, %digest, size_bytes, "image pulled into the cache");
        Ok(self.held(record, &directory, true))
    }

    /// Fetches and applies every layer in order; returns the bytes written.
    async fn unpack_into(
        &self,
        source: &Source<'_>,
        resolved: &pull::ResolvedImage,
        staging: &Path,
        declared: u64,
        progress: Option<&tokio::sync::watch::Sender<PullProgress>>,
    ) -> Result<u64, ImageFailure> {
        let rootfs = staging.join("rootfs");
        let blob = staging.join("layer");
        let mut done_bytes = 0_u64;
        let mut written = 0_u64;
        if let Some(progress) = progress {
            progress.send_replace(PullProgress {
                done_bytes,
                total_bytes: declared,
            });
        }
        for (index, layer) in resolved.manifest.layers.iter().enumerate() {
            let mut on_bytes = |bytes: u64| {
                done_bytes += bytes;
                if let Some(progress) = progress {
                    progress.send_replace(PullProgress {
                        done_bytes,
                        total_bytes: declared,
                    });
                }
            };
            source.layer_to_file(layer, &blob, &mut on_bytes).await?;
            let budget = self.inner.limit_bytes.saturating_sub(written);
            let media_type = layer.media_type.clone();
            let (rootfs_for_task, blob_for_task) = (rootfs.clone(), blob.clone());
            let summary = tokio::task::spawn_blocking(move || {
                let compression = Compression::of_layer(&media_type, &blob_for_task)?;
                apply_layer(&rootfs_for_task, &blob_for_task, compression, budget)
            })
            .await
            .map_err(|error| ImageFailure::Io(format!("unpacking stopped: {error}")))?
            .map_err(|error| match error {
                UnpackError::Refused(reason) => {
                    ImageFailure::Refused(format!("layer {index} ({}): {reason}", layer.digest))
                }
                UnpackError::Io(context, error) => ImageFailure::Io(format!("{context}: {error}")),
            })?;
            written += summary.file_bytes;
            let _ = std::fs::remove_file(&blob);
        }
        Ok(written)
    }

    /// Removes least recently used images no attempt holds until the cache is within its
    /// limit (or only held images are left).
    fn evict_over_limit(&self) {
        let mut removed = Vec::new();
        {
            let mut state = self.inner.lock();
            loop {
                let total: u64 = state.entries.values().map(|entry| entry.size_bytes).sum();
                if total <= self.inner.limit_bytes {
                    break;
                }
                let victim = state
                    .entries
                    .iter()
                    .filter(|(_, entry)| entry.users == 0)
                    .min_by_key(|(_, entry)| entry.last_used)
                    .map(|(digest, _)| digest.clone());
                let Some(victim) = victim else {
                    tracing::warn!(
                        total,
                        limit = self.inner.limit_bytes,
                        "the image cache is over its limit with every image in use"
                    );
                    break;
                };
                state.entries.remove(&victim);
                // Renamed while the lock is held, so a pull of the same digest that
                // starts after this finds the name free.
                let trash = self.inner.directory.join("trash").join(format!(
                    "{}-{}",
                    victim.trim_start_matches("sha256:"),
                    self.inner.trash_counter.fetch_add(1, Ordering::SeqCst)
                ));
                if std::fs::rename(self.inner.image_directory(&victim), &trash).is_ok() {
                    removed.push(trash);
                }
                tracing::info!(digest = %victim, "image evicted from the cache");
            }
        }
        for trash in removed {
            let _ = std::fs::remove_dir_all(trash);
        }
    }
}

/// Installs rustls' ring provider for the process (once; later calls do nothing):
/// reqwest, under `oci-client`, needs a process-wide provider, and ring is the one the
/// worker's gRPC uses already (the crate's own default, aws-lc, needs a C toolchain).
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn touch(path: &Path) {
    let _ = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .and_then(|file| file.set_modified(std::time::SystemTime::now()));
}

#[cfg(test)]
mod tests;
