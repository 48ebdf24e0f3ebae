//! A command attempt's image (`command.image`): from the node's cache or pulled into it,
//! with the pull's progress in the job's log, and the attempt's final report when it
//! cannot be had.

use super::*;

/// How often a pull's progress goes to the job's log and the scheduler.
const IMAGE_PULL_PROGRESS_INTERVAL: Duration = Duration::from_secs(5);

/// What an assignment says of the job's image (issue 30).
#[derive(Debug, Clone, Default)]
pub struct AssignedImage {
    /// The manifest digest the job's first pull resolved (`Assignment.image_digest`):
    /// this attempt runs exactly it, whatever the tag names now. `None` before a first
    /// pull was reported.
    pub pinned_digest: Option<String>,
    /// The credential of the job's `command.image_pull_secret`, from the scheduler's
    /// tenant secrets; never logged (its `Debug` is redacted).
    pub credential: Option<RegistryCredential>,
}

impl AssignedImage {
    /// What an assignment's fields say: an empty digest is none.
    pub fn of_assignment(assignment: &v1::scheduler_message::Assignment) -> AssignedImage {
        AssignedImage {
            pinned_digest: (!assignment.image_digest.is_empty())
                .then(|| assignment.image_digest.clone()),
            credential: assignment.image_pull_credential.as_ref().map(|credential| {
                RegistryCredential {
                    username: credential.username.clone(),
                    password: credential.password.clone(),
                }
            }),
        }
    }
}

/// The image a job names (`command.image`), from the node's cache or pulled into it;
/// `Err` is the attempt's final report: a job's image runs only in a container, its pull
/// secret needs the credential the scheduler sends with it, and a pull that fails ends the
/// attempt `failed` (missing image, refused credential, digest mismatch, hostile
/// image: a retry would meet it again) or `interrupted` (an unreachable registry, the
/// worker's disk), never as an out-of-memory.
pub(super) async fn job_image(
    launch: &CommandAttemptLaunch,
    reports: &mpsc::UnboundedSender<Body>,
) -> Result<Option<PulledImage>, Vec<Body>> {
    let Some(reference) = &launch.job.spec.command.image else {
        return Ok(None);
    };
    let fail = |outcome, message: String| ended(&launch.attempt, outcome, message);
    let Some(sandbox) = &launch.sandbox else {
        return Err(fail(
            v1::AttemptOutcome::Failed,
            format!(
                "command.image {reference:?}: an image runs only in a container, and this \
                 worker runs attempts uncontained (--insecure-no-sandbox, or no runtime)"
            ),
        ));
    };
    if let Some(secret) = &launch.job.spec.command.image_pull_secret
        && launch.image.credential.is_none()
    {
        return Err(fail(
            v1::AttemptOutcome::Failed,
            format!(
                "command.image_pull_secret {secret:?}: the scheduler sent no credential for \
                 it (was the secret deleted after the job was submitted?)"
            ),
        ));
    }
    let canonical = match parse_image_reference("command.image", reference) {
        Ok(image) => image.canonical(),
        Err(error) => return Err(fail(v1::AttemptOutcome::Failed, error.to_string())),
    };
    let request = ImageRequest {
        reference: canonical.clone(),
        pinned_digest: launch.image.pinned_digest.clone(),
        credential: launch.image.credential.clone(),
    };
    let log = |message: String| {
        let _ = reports.send(Body::Log(v1::worker_message::LogLine {
            attempt: Some(launch.attempt.clone()),
            level: "info".into(),
            message,
            stream: String::new(),
        }));
    };
    // The pull's progress goes to the job's log every few seconds while it lasts.
    let (progress, seen) = tokio::sync::watch::channel(PullProgress::default());
    let started = Instant::now();
    let acquired = {
        let pull = sandbox.images().acquire(&request, Some(&progress));
        tokio::pin!(pull);
        let mut ticker = tokio::time::interval(IMAGE_PULL_PROGRESS_INTERVAL);
        ticker.tick().await;
        loop {
            tokio::select! {
                result = &mut pull => break result,
                _ = ticker.tick() => {
                    let now = *seen.borrow();
                    if now.total_bytes > 0 {
                        // The job's state while it lasts (`carve get`, `watch`).
                        let _ = reports.send(Body::ImagePull(
                            v1::worker_message::ImagePullProgress {
                                attempt: Some(launch.attempt.clone()),
                                pull: Some(v1::ImagePull {
                                    image: canonical.clone(),
                                    done_bytes: now.done_bytes,
                                    total_bytes: now.total_bytes,
                                }),
                            },
                        ));
                        log(format!(
                            "pulling image {canonical} ({} of {} MiB)",
                            now.done_bytes >> 20,
                            now.total_bytes.div_ceil(1 << 20)
                        ));
                    }
                }
            }
        }
    };
    match acquired {
        Ok(image) => {
            log(if image.pulled_now {
                format!(
                    "image {canonical}: {} pulled into this node's cache ({} MiB unpacked, {:.1}s)",
                    image.record.digest,
                    image.record.size_bytes.div_ceil(1 << 20),
                    started.elapsed().as_secs_f64()
                )
            } else {
                format!(
                    "image {canonical}: {} from this node's cache",
                    image.record.digest
                )
            });
            tracing::info!(
                job = %launch.attempt.job_id,
                image = %canonical,
                digest = %image.record.digest,
                pulled_now = image.pulled_now,
                "the attempt's image is ready"
            );
            Ok(Some(image))
        }
        Err(failure) => {
            let outcome = if failure.is_transient() {
                v1::AttemptOutcome::Interrupted
            } else {
                v1::AttemptOutcome::Failed
            };
            Err(fail(outcome, format!("image {canonical}: {failure}")))
        }
    }
}
