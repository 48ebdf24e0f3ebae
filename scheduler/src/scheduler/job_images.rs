//! Job images on the scheduler's side (issue 30): a tenant's secrets, the check at
//! admission that a job's `command.image_pull_secret` names one of its tenant's, the
//! credential in the assignment of an attempt whose image needs it, the digest the first
//! pull resolved (recorded once, named in every later assignment), pulls under way as
//! the job's state, and the workers' caches for placement's preference.
//!
//! A secret's value leaves the store only in an assignment (`assignment_image`): it is
//! never logged, never shown by a read, never sent to another tenant's job (every lookup
//! names the job's own tenant).

use std::collections::HashMap;

use carve_core::scheduling::CachedImages;
use carve_core::workload::Workload;
use carve_proto::ApiError;

use crate::auth::{Caller, Role};
use crate::error::SchedulerError;
use crate::store::{JobRecord, SecretRecord};

use super::logs::JobUpdateKind;
use super::worker_reports::{AttemptRef, ImagePullProgress, RegistryCredential};
use super::{Scheduler, now_ms};

/// The most cached digests read from one heartbeat; the rest are dropped.
pub const MAX_CACHED_IMAGES_READ: usize = 64;

/// The largest secret value accepted.
pub const MAX_SECRET_VALUE_BYTES: usize = 8 * 1024;

/// The most secrets one tenant keeps.
pub const MAX_SECRETS_PER_TENANT: usize = 256;

/// Whether `text` is a manifest digest as the workers report them: `sha256:` and 64
/// lowercase hex digits.
pub fn is_manifest_digest(text: &str) -> bool {
    text.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte))
    })
}

/// A registry credential out of a secret's value (`username:password`, one trailing
/// newline dropped); `None` for a value that is not one. The reason never quotes the
/// value.
pub fn registry_credential(value: &[u8]) -> Result<RegistryCredential, &'static str> {
    let text = std::str::from_utf8(value).map_err(|_| "is not UTF-8 text")?;
    let text = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(text);
    let (username, password) = text
        .split_once(':')
        .ok_or("is not `username:password` (no ':')")?;
    if username.is_empty() {
        return Err("has an empty username before ':'");
    }
    if password.is_empty() {
        return Err("has an empty password after ':'");
    }
    if text.contains(['\n', '\r']) {
        return Err("spans several lines; a credential is one line `username:password`");
    }
    Ok(RegistryCredential {
        username: username.to_string(),
        password: password.to_string(),
    })
}

/// What the scheduler holds in memory of images: the workers' caches as their last
/// heartbeats said, and each placed attempt's pull under way.
#[derive(Debug, Default)]
pub(super) struct LiveImages {
    worker_caches: HashMap<String, Vec<String>>,
    /// By job: the attempt number and its latest pull report.
    pulls: HashMap<String, (u32, ImagePullProgress)>,
}

impl Scheduler {
    fn images(&self) -> std::sync::MutexGuard<'_, LiveImages> {
        self.images
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The tenant whose secrets `caller` manages with `requested`: a USER its own (an
    /// empty `requested` or its own name), an ADMIN the one it names.
    fn secrets_tenant(&self, caller: &Caller, requested: &str) -> Result<String, SchedulerError> {
        caller.require(&[Role::User, Role::Admin])?;
        match caller.role {
            Role::Admin if requested.is_empty() => Err(SchedulerError::invalid_argument(
                "tenant",
                "an admin names the tenant whose secrets it manages",
            )),
            Role::Admin => Ok(requested.to_string()),
            _ if requested.is_empty() || requested == caller.tenant => Ok(caller.tenant.clone()),
            _ => Err(ApiError::PermissionDenied(
                "a user manages only its own tenant's secrets".into(),
            )
            .into()),
        }
    }

    /// Stores a secret for the caller's tenant (or the one an admin names). The value
    /// must be a registry credential, `username:password`; a refusal never quotes it.
    pub async fn create_secret(
        &self,
        caller: &Caller,
        tenant: &str,
        name: &str,
        value: &[u8],
        replace: bool,
    ) -> Result<SecretRecord, SchedulerError> {
        let tenant = self.secrets_tenant(caller, tenant)?;
        carve_core::command::image::check_secret_name("name", name)
            .map_err(|error| SchedulerError::invalid_argument("name", error.reason))?;
        if value.len() > MAX_SECRET_VALUE_BYTES {
            return Err(SchedulerError::invalid_argument(
                "value",
                format!(
                    "is {} bytes; the limit is {MAX_SECRET_VALUE_BYTES}",
                    value.len()
                ),
            ));
        }
        registry_credential(value)
            .map_err(|reason| SchedulerError::invalid_argument("value", reason))?;
        let existing = self.store.list_secrets(&tenant).await?;
        if existing.len() >= MAX_SECRETS_PER_TENANT
            && !existing.iter().any(|secret| secret.name == name)
        {
            return Err(ApiError::ResourceExhausted(format!(
                "tenant {tenant} keeps {} secrets, the most it may",
                existing.len()
            ))
            .into());
        }
        // The value without its trailing newline: what `registry_credential` reads.
        let credential = registry_credential(value)
            .map_err(|reason| SchedulerError::invalid_argument("value", reason))?;
        let value = format!("{}:{}", credential.username, credential.password);
        let stored = self
            .settings
            .sealing
            .seal(&tenant, name, value.as_bytes())?;
        let record = self
            .store
            .create_secret(&tenant, name, &stored, replace, now_ms())
            .await?;
        tracing::info!(tenant = %tenant, secret = %name, replace, "secret stored");
        Ok(record)
    }

    /// The secrets of the caller's tenant (or the one an admin names), without values.
    pub async fn list_secrets(
        &self,
        caller: &Caller,
        tenant: &str,
    ) -> Result<Vec<SecretRecord>, SchedulerError> {
        let tenant = self.secrets_tenant(caller, tenant)?;
        self.store.list_secrets(&tenant).await
    }

    /// Deletes a secret of the caller's tenant (or the one an admin names).
    pub async fn delete_secret(
        &self,
        caller: &Caller,
        tenant: &str,
        name: &str,
    ) -> Result<(), SchedulerError> {
        let tenant = self.secrets_tenant(caller, tenant)?;
        self.store.delete_secret(&tenant, name).await?;
        tracing::info!(tenant = %tenant, secret = %name, "secret deleted");
        Ok(())
    }

    /// Admission: a job naming a pull secret its tenant does not hold is refused, naming
    /// `command.image_pull_secret` (and the secret's name, never a value).
    pub(super) async fn check_image_pull_secret(
        &self,
        tenant: &str,
        workload: &Workload,
    ) -> Result<(), SchedulerError> {
        let Some(secret) = workload.image_pull_secret() else {
            return Ok(());
        };
        if self.store.secret_exists(tenant, secret).await? {
            return Ok(());
        }
        Err(SchedulerError::invalid_argument(
            "command.image_pull_secret",
            format!(
                "tenant {tenant} has no secret named {secret:?} (create it with `carve secret \
                 create {secret} --from-file FILE`)"
            ),
        ))
    }

    /// What an assignment of `job` says of its image: the digest its first pull
    /// resolved (`None` before one, and for jobs without an image), and the credential of
    /// its pull secret, read from the job's own tenant's secrets (`None` unless the job
    /// names one; a secret deleted since admission sends none, and the worker fails the
    /// attempt saying so).
    pub(super) async fn assignment_image(
        &self,
        job: &JobRecord,
    ) -> Result<(Option<String>, Option<RegistryCredential>), SchedulerError> {
        if !job.kind.may_name_image() {
            return Ok((None, None));
        }
        let workload = self.stored_workload(job).await?;
        if workload.image().is_none() {
            return Ok((None, None));
        }
        let digest = self.store.job_image_digest(&job.id).await?;
        let credential = match workload.image_pull_secret() {
            Some(secret) => match self.store.secret_value(&job.tenant, secret).await? {
                Some(stored) => {
                    let opened = self.settings.sealing.open(&job.tenant, secret, &stored);
                    let credential = opened
                        .and_then(|value| registry_credential(&value).map_err(str::to_string));
                    match credential {
                        Ok(credential) => Some(credential),
                        Err(reason) => {
                            tracing::warn!(job = %job.id, secret, reason, "unreadable pull secret");
                            None
                        }
                    }
                }
                None => {
                    tracing::warn!(
                        job = %job.id,
                        secret,
                        "the job's pull secret is gone; its attempt gets no credential"
                    );
                    None
                }
            },
            None => None,
        };
        Ok((digest, credential))
    }

    /// An attempt reported the digest of the image it runs: the job's first one is
    /// recorded for every later attempt; one that differs from the recorded digest
    /// (a worker that did not pin it) is logged, and the recorded one stays.
    pub(super) async fn record_image_digest(
        &self,
        attempt: &AttemptRef,
        digest: &str,
    ) -> Result<(), SchedulerError> {
        self.images().pulls.remove(&attempt.job_id);
        let kept = self
            .store
            .record_job_image_digest(&attempt.job_id, digest, now_ms())
            .await?;
        if kept != digest {
            tracing::warn!(
                job = %attempt.job_id,
                attempt = attempt.attempt_number,
                reported = digest,
                recorded = %kept,
                "an attempt ran another image digest than the job's recorded one"
            );
        } else if attempt.attempt_number == 1 {
            self.emit_attempt_line(
                attempt,
                format!("image resolved to {digest}; every later attempt runs it"),
            );
        }
        Ok(())
    }

    /// A placed attempt's worker is pulling its image: held as the job's state for reads
    /// and sent to watchers (paced like progress). Fenced like progress.
    pub(super) fn image_pull_reported(
        &self,
        worker_id: &str,
        attempt: AttemptRef,
        pull: ImagePullProgress,
    ) -> Result<(), SchedulerError> {
        if self.current_attempt(worker_id, &attempt).is_none() {
            return Err(self.fenced(&attempt));
        }
        {
            let running: Vec<(String, u32)> = self
                .live()
                .running
                .iter()
                .map(|(job_id, running)| (job_id.clone(), running.attempt_number))
                .collect();
            let mut images = self.images();
            // Pulls of attempts no longer running are forgotten here.
            images.pulls.retain(|job_id, (number, _)| {
                running.iter().any(|(running_job, running_number)| {
                    running_job == job_id && running_number == number
                })
            });
            images.pulls.insert(
                attempt.job_id.clone(),
                (attempt.attempt_number, pull.clone()),
            );
        }
        self.emit(
            &attempt.job_id,
            JobUpdateKind::ImagePull {
                attempt_number: attempt.attempt_number,
                pull,
            },
        );
        Ok(())
    }

    /// The pull under way of the attempt of `job_id` running on this scheduler, if its
    /// worker reported one and the attempt has not started its program yet.
    pub fn image_pull(&self, job_id: &str) -> Option<(u32, ImagePullProgress)> {
        let number = self.live().running.get(job_id)?.attempt_number;
        self.images()
            .pulls
            .get(job_id)
            .filter(|(pulling, _)| *pulling == number)
            .cloned()
    }

    /// A worker's heartbeat said which images its cache holds.
    pub fn record_cached_images(&self, worker_id: &str, digests: &[String]) {
        let mut images = self.images();
        if digests.is_empty() {
            images.worker_caches.remove(worker_id);
        } else {
            images
                .worker_caches
                .insert(worker_id.to_string(), digests.to_vec());
        }
    }

    /// What placement's tie-break needs (`carve_core::scheduling::image_affinity`): the
    /// workers' caches and the recorded digests of the queued jobs. Nothing is read from
    /// the store while no worker reports a cached image.
    pub(super) async fn cached_images_for_pass(&self) -> Result<CachedImages, SchedulerError> {
        let caches: Vec<(String, Vec<String>)> = self
            .images()
            .worker_caches
            .iter()
            .map(|(worker, digests)| (worker.clone(), digests.clone()))
            .collect();
        let mut images = CachedImages::default();
        if caches.is_empty() {
            return Ok(images);
        }
        for (worker, digests) in caches {
            images.add_worker_images(worker, digests);
        }
        for (job_id, digest) in self.store.queued_job_image_digests().await? {
            images.add_job_image(job_id, digest);
        }
        Ok(images)
    }

    /// The recorded image digests of a page of jobs (those of a kind that may name an
    /// image only).
    pub(super) async fn image_digests_of(
        &self,
        jobs: &[JobRecord],
    ) -> Result<HashMap<String, String>, SchedulerError> {
        let ids: Vec<&str> = jobs
            .iter()
            .filter(|job| job.kind.may_name_image())
            .map(|job| job.id.as_str())
            .collect();
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        self.store.job_image_digests(&ids).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_credential_is_username_colon_password_on_one_line() {
        let credential = registry_credential(b"robot$pull:s3cr3t:with:colons\n").unwrap();
        assert_eq!(credential.username, "robot$pull");
        assert_eq!(credential.password, "s3cr3t:with:colons");
        for bad in [
            &b"no-colon"[..],
            b":password",
            b"user:",
            b"user:pass\nsecond:line",
            b"\xff\xfe:x",
        ] {
            assert!(registry_credential(bad).is_err(), "{bad:?}");
        }
        let refused = registry_credential(b"hunter2-no-colon").unwrap_err();
        assert!(!refused.contains("hunter2"), "{refused}");
        assert_eq!(format!("{credential:?}"), "RegistryCredential(<redacted>)");
    }

    #[test]
    fn digests_are_sha256_and_64_lowercase_hex_digits() {
        let good = format!("sha256:{}", "ab12".repeat(16));
        assert!(is_manifest_digest(&good));
        assert!(!is_manifest_digest(&good.to_uppercase()));
        assert!(!is_manifest_digest("sha256:abc"));
        assert!(!is_manifest_digest(&format!(
            "sha512:{}",
            "ab12".repeat(16)
        )));
        assert!(!is_manifest_digest(&format!("{good}\n")));
    }
}
