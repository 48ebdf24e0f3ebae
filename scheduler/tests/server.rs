//! The real scheduler in-process on 127.0.0.1:0, a real SQLite file, real gRPC clients, and
//! a test worker that speaks the worker protocol by hand: submit to success, OOM retries
//! with the planner's config, lease expiry and fencing, cancel, tenancy, quotas,
//! idempotency, and the status of every invalid request.

use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::admin_service_client::AdminServiceClient;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_proto::v1::job_service_client::JobServiceClient;
use tokio_stream::StreamExt;
use tonic::{Code, Request};

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::{TestWorker, authorized, out_of_memory_in};

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{
    ADMIN, JOB, all_job_logs, cancel, channel, create_tenant, get, job_logs, list_jobs,
    list_slices, metric, revoke_token, scrape, start, start_for_tenant, start_with_worker, submit,
    submit_and_place, tenant_with_tokens, token_with_id, wait_for_state, watch,
};

#[tokio::test]
async fn a_job_goes_from_submit_to_success_and_watch_sees_every_state() {
    let (cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let submitted = submit(&channel, &user, JOB, "").await.unwrap();
    assert!(submitted.created);
    let job = submitted.job.unwrap();
    assert!(job.estimate.as_ref().unwrap().peak_bytes > 0);
    let mut watch = watch(&channel, &user, &job.id).await;

    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    assert_eq!(attempt.job_id, job.id);
    assert_eq!(attempt.attempt_number, 1);
    // The kind stored at admission travels with the assignment; the worker never sniffs it.
    assert_eq!(assignment.kind, "model");
    assert!(assignment.slice_bytes >= job.estimate.as_ref().unwrap().peak_bytes);
    worker.report_started(&assignment).await;
    worker.report_halfway(&attempt).await;
    worker
        .finish(&attempt, v1::AttemptOutcome::Succeeded, 2 << 20)
        .await;

    let mut states = Vec::new();
    let mut saw_progress = false;
    while let Some(event) = tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .unwrap()
    {
        match event.unwrap().event.unwrap() {
            v1::job_event::Event::StateChanged(changed) => {
                states.push(v1::JobState::try_from(changed.state).unwrap())
            }
            v1::job_event::Event::Progress(progress) => {
                saw_progress |= progress.progress.unwrap().step == 5
            }
            _ => {}
        }
    }
    assert!(saw_progress);
    assert_eq!(states.last(), Some(&v1::JobState::Succeeded), "{states:?}");
    assert!(states.contains(&v1::JobState::Running), "{states:?}");
    let finished = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(finished.state, v1::JobState::Succeeded as i32);
    let metrics = scrape(cluster.metrics_address).await;
    for line in [
        "carve_submits_accepted_total 1",
        "carve_placements_total 1",
        "carve_jobs_succeeded_total 1",
        "carve_submit_latency_seconds_count 1",
        "carve_workers{state=\"ready\"} 1",
    ] {
        assert!(
            metrics.lines().any(|metric| metric == line),
            "{line} missing from:\n{metrics}"
        );
    }
    assert_eq!(finished.attempts.len(), 1);
    assert_eq!(finished.attempts[0].measured_peak_bytes, Some(2 << 20));
    assert_eq!(
        finished.attempts[0].outcome,
        v1::AttemptOutcome::Succeeded as i32
    );
}

#[tokio::test]
async fn an_oom_is_retried_with_the_planners_config_from_the_checkpoint() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let (job, first) = submit_and_place(&channel, &user, &mut worker).await;
    let attempt = first.attempt.clone().unwrap();
    // The attempt died a quarter short of its slice: something outside the plan took memory.
    worker
        .send(v1::worker_message::Body::Oom(
            v1::worker_message::OomReport {
                attempt: Some(attempt.clone()),
                report: Some(out_of_memory_in(first.slice_bytes)),
                checkpoint: Some(v1::Checkpoint {
                    step: 4,
                    location: "/checkpoints/a.ckpt".into(),
                }),
                detected_by: String::new(),
                evidence: String::new(),
            },
        ))
        .await;
    let second = worker.next_assignment().await;
    assert_eq!(second.attempt.as_ref().unwrap().attempt_number, 2);
    assert_eq!(
        second.resume_from.as_ref().unwrap().location,
        "/checkpoints/a.ckpt"
    );
    let old = first.config.unwrap();
    let new = second.config.unwrap();
    assert_eq!(
        new.batch_size, old.batch_size,
        "the effective batch is kept"
    );
    assert_ne!(new, old, "the planner changed the config");
    worker.succeed(&second, 1 << 20).await;
    let done = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(done.attempts.len(), 2);
    assert_eq!(
        done.attempts[0].outcome,
        v1::AttemptOutcome::OutOfMemory as i32
    );
    assert_eq!(
        done.attempts[0].oom.as_ref().unwrap().limit_bytes,
        first.slice_bytes
    );
    assert_eq!(
        done.attempts[1].outcome,
        v1::AttemptOutcome::Succeeded as i32
    );
    assert_eq!(done.current_config.unwrap(), new);
}

#[tokio::test]
async fn a_silent_worker_loses_its_attempt_and_cannot_report_on_it_later() {
    let (_cluster, channel, user, worker_token, mut first_worker) =
        start_with_worker(Duration::from_millis(600), "alice").await;
    let (job, first) = submit_and_place(&channel, &user, &mut first_worker).await;
    let stale_attempt = first.attempt.clone().unwrap();
    // The first worker goes silent: its heartbeats stop (the session stays open).
    let stale_outgoing = first_worker.go_silent();
    let mut second_worker = TestWorker::connect(&channel, &worker_token, "gpu-b", 16 << 30).await;
    let second = second_worker.next_assignment().await;
    assert_eq!(second.attempt.as_ref().unwrap().attempt_number, 2);
    assert_eq!(
        (first.resume_from, second.resume_from.clone()),
        (None, None),
        "no attempt reported a checkpoint: both start from scratch"
    );
    // The stale worker's late report is fenced off.
    let _ = stale_outgoing
        .send(v1::WorkerMessage {
            sequence: 99,
            body: Some(v1::worker_message::Body::AttemptFinished(
                v1::worker_message::AttemptFinished {
                    attempt: Some(stale_attempt),
                    outcome: v1::AttemptOutcome::Succeeded as i32,
                    final_loss: None,
                    test_accuracy: None,
                    measured_peak_bytes: 1,
                    message: "late".into(),
                    steps_done: None,
                    samples_per_second: None,
                    profile_points: Vec::new(),
                    metrics: Vec::new(),
                },
            )),
        })
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let job_now = get(&channel, &user, &job.id).await.unwrap();
    assert_ne!(job_now.state, v1::JobState::Succeeded as i32);
    assert_eq!(job_now.attempts[0].outcome, v1::AttemptOutcome::Lost as i32);
    second_worker.succeed(&second, 1 << 20).await;
    let done = wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    assert_eq!(done.attempts[1].worker_id, second_worker.id);
    // The job's log says why it moved.
    let logs = all_job_logs(&channel, &user, &job.id).await;
    let lease_lost = format!(
        "placed -> queued: lease lost: worker {} stopped heartbeating during attempt 1",
        done.attempts[0].worker_id
    );
    assert!(
        logs.lines
            .iter()
            .any(|line| line.level == "warn" && line.message.starts_with(&lease_lost)),
        "no {lease_lost:?} in {:#?}",
        logs.lines
    );
}

#[tokio::test]
async fn cancel_reaches_the_running_attempt() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let (job, assignment) = submit_and_place(&channel, &user, &mut worker).await;
    let cancelled = cancel(&channel, &user, &job.id, "changed my mind")
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(cancelled.state, v1::JobState::Cancelled as i32);
    match worker.next().await {
        v1::scheduler_message::Body::Cancel(cancel) => {
            assert_eq!(cancel.attempt, assignment.attempt)
        }
        other => panic!("expected a cancel, got {other:?}"),
    }
    let again = cancel(&channel, &user, &job.id, "").await.unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition);
}

/// The scheduler keeps a copy of the queue and reads only new jobs each pass; jobs moved
/// by another replica (here: a second store on the same database) must still be seen:
/// one it queued, and one it put back in the queue under an old submit sequence.
#[tokio::test]
async fn jobs_queued_by_another_replica_are_placed() {
    let (cluster, channel, user, worker_token) =
        start_for_tenant(Duration::from_secs(30), "alice").await;
    let requeued = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let kept = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    cancel(&channel, &user, &requeued.id, "").await.unwrap();
    // Passes have usually run over the queue by now (each submit wakes one); either way
    // the changes below are made behind this scheduler's back.
    let other_replica = cluster.other_replica().await;
    let mut back = other_replica.get_job(&requeued.id).await.unwrap();
    back.state = carve_scheduler::store::JobState::Queued;
    back.finished_at_ms = None;
    back.message.clear();
    other_replica.update_job(&back).await.unwrap();
    let mut elsewhere = other_replica.get_job(&kept.id).await.unwrap();
    elsewhere.id = "job-from-another-replica".into();
    elsewhere.idempotency_key = None;
    other_replica.submit_jobs(vec![elsewhere]).await.unwrap();

    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let mut placed = Vec::new();
    for _ in 0..3 {
        let assignment = worker.next_assignment().await;
        placed.push(assignment.attempt.unwrap().job_id);
    }
    placed.sort();
    let mut expected = vec![
        requeued.id.clone(),
        kept.id.clone(),
        "job-from-another-replica".to_string(),
    ];
    expected.sort();
    assert_eq!(placed, expected);
    // The copy was read whole again when it disagreed with the store (the first full
    // read is the first pass's).
    let metrics = scrape(cluster.metrics_address).await;
    let full_reads = metric(&metrics, "carve_queue_full_reads_total");
    assert!(full_reads >= 1, "{metrics}");
}

#[tokio::test]
async fn tenants_see_only_their_own_jobs() {
    let (_cluster, channel, alice, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let job = submit(&channel, &alice, JOB, "")
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(
        get(&channel, &bob, &job.id).await.unwrap_err().code(),
        Code::NotFound
    );
    let listed = list_jobs(&channel, &bob, v1::ListJobsRequest::default())
        .await
        .unwrap();
    assert!(listed.jobs.is_empty());
    let refused = cancel(&channel, &bob, &job.id, "").await.unwrap_err();
    assert_eq!(refused.code(), Code::NotFound);
    let mine = list_jobs(&channel, &alice, v1::ListJobsRequest::default())
        .await
        .unwrap();
    assert_eq!(mine.jobs.len(), 1);
    let admin_view = get(&channel, ADMIN, &job.id).await.unwrap();
    assert_eq!(admin_view.tenant, "alice");
}

#[tokio::test]
async fn a_running_jobs_quota_holds_under_concurrent_submits() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let quota = v1::Quota {
        vram_bytes: None,
        max_running_jobs: Some(2),
        fair_share_weight: 1.0,
    };
    let (user, worker_token) = tenant_with_tokens(&channel, "alice", quota).await;
    let _worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 80 << 30).await;
    let submits = (0..12).map(|index| {
        let channel = channel.clone();
        let user = user.clone();
        async move {
            submit(&channel, &user, JOB, &format!("key-{index}"))
                .await
                .unwrap()
        }
    });
    let jobs = futures::future::join_all(submits).await;
    assert_eq!(jobs.len(), 12);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let slices = list_slices(&channel).await;
    assert_eq!(slices.len(), 2, "{slices:?}");
    let waiting = get(&channel, &user, &jobs[0].job.as_ref().unwrap().id)
        .await
        .unwrap();
    let waiting_jobs = list_jobs(
        &channel,
        &user,
        v1::ListJobsRequest {
            states: vec![v1::JobState::Queued as i32],
            ..Default::default()
        },
    )
    .await
    .unwrap()
    .jobs;
    assert_eq!(waiting_jobs.len(), 10);
    assert!(
        waiting_jobs
            .iter()
            .all(|job| job.waiting_reason.contains("running")),
        "{:?} / {:?}",
        waiting_jobs.first().map(|job| &job.waiting_reason),
        waiting.waiting_reason
    );
}

#[tokio::test]
async fn a_retried_submit_returns_the_same_job() {
    let (_cluster, channel, user, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let first = submit(&channel, &user, JOB, "retry-me").await.unwrap();
    let second = submit(&channel, &user, JOB, "retry-me").await.unwrap();
    assert!(first.created);
    assert!(!second.created);
    assert_eq!(first.job.unwrap().id, second.job.unwrap().id);
    let other = submit(&channel, &user, JOB, "another").await.unwrap();
    assert!(other.created);
}

#[tokio::test]
async fn a_revoked_token_is_refused_at_once_by_the_scheduler_that_revoked_it() {
    let (_cluster, channel, other_user, _) =
        start_for_tenant(Duration::from_secs(30), "alice").await;
    let (token_id, secret) = token_with_id(&channel, "alice", v1::Role::User).await;
    // Used once first, so the scheduler holds it in its token cache when it is revoked.
    submit(&channel, &secret, JOB, "before").await.unwrap();
    revoke_token(&channel, &token_id).await;
    let refused = submit(&channel, &secret, JOB, "after").await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("revoked"), "{refused:?}");
    let listed = list_jobs(&channel, &secret, v1::ListJobsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(listed.code(), Code::Unauthenticated);
    // Only that token: the tenant's other token still works.
    submit(&channel, &other_user, JOB, "other").await.unwrap();
}

#[tokio::test]
async fn a_quota_change_applies_to_the_next_submit() {
    let (_cluster, channel, user, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    // Admitted once first, so the scheduler holds the tenant in its cache.
    submit(&channel, &user, JOB, "first").await.unwrap();
    let set_quota = |vram_bytes: Option<u64>| {
        let mut admin = AdminServiceClient::new(channel.clone());
        async move {
            admin
                .set_quota(authorized(
                    v1::SetQuotaRequest {
                        tenant: "alice".into(),
                        quota: Some(v1::Quota {
                            vram_bytes,
                            max_running_jobs: None,
                            fair_share_weight: 1.0,
                        }),
                    },
                    ADMIN,
                ))
                .await
                .unwrap()
        }
    };
    set_quota(Some(1)).await;
    let refused = submit(&channel, &user, JOB, "second").await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    set_quota(None).await;
    assert!(submit(&channel, &user, JOB, "third").await.unwrap().created);
}

/// A job without its waiting reason: the answer carries the one the job was stored with
/// (none, or "no schedulable gpu" when no worker is ready), a pass may have set another
/// since, and that is not what the comparison is about.
fn as_submitted(mut job: v1::Job) -> v1::Job {
    job.waiting_reason.clear();
    job
}

#[tokio::test]
async fn the_submit_answer_is_the_job_as_stored_also_when_shrunk_at_admission() {
    let (_cluster, channel, user, _) = start_for_tenant(Duration::from_secs(30), "alice").await;
    let answered = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let stored = get(&channel, &user, &answered.id).await.unwrap();
    assert_eq!(as_submitted(stored), as_submitted(answered.clone()));
    // A slice of half what the job needs makes admission shrink its configuration; the
    // answer must carry the shrunk configuration and its estimate, as a read does.
    let required = answered.estimate.as_ref().unwrap().required_bytes;
    let smaller = JOB.replacen(
        r#""data":"#,
        &format!(r#""resources": {{ "vram": "{}B" }}, "data":"#, required / 2),
        1,
    );
    let shrunk = submit(&channel, &user, &smaller, "")
        .await
        .unwrap()
        .job
        .unwrap();
    assert_ne!(shrunk.current_config, answered.current_config);
    assert!(shrunk.estimate.as_ref().unwrap().required_bytes <= required / 2);
    let stored = get(&channel, &user, &shrunk.id).await.unwrap();
    assert_eq!(as_submitted(stored), as_submitted(shrunk));
    // The idempotent answer is the stored job too.
    let keyed = submit(&channel, &user, JOB, "key").await.unwrap();
    let again = submit(&channel, &user, JOB, "key").await.unwrap();
    assert!(!again.created);
    assert_eq!(again.job.map(as_submitted), keyed.job.map(as_submitted));
}

#[tokio::test]
async fn a_measured_peak_raises_the_next_slice_of_the_same_shape_at_once() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    // The first submit caches "nothing measured yet" for this shape.
    let first = submit(&channel, &user, JOB, "first").await.unwrap();
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    assert_eq!(attempt.job_id, first.job.unwrap().id);
    worker.report_started(&assignment).await;
    worker
        .finish(
            &attempt,
            v1::AttemptOutcome::Succeeded,
            assignment.slice_bytes * 4,
        )
        .await;
    wait_for_state(&channel, &user, &attempt.job_id, v1::JobState::Succeeded).await;
    submit(&channel, &user, JOB, "second").await.unwrap();
    let second = worker.next_assignment().await;
    assert!(
        second.slice_bytes > assignment.slice_bytes,
        "{} after a peak of 4x {}",
        second.slice_bytes,
        assignment.slice_bytes
    );
}

#[tokio::test]
async fn invalid_requests_get_the_right_status_naming_the_field() {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    let (user, worker_token) = tenant_with_tokens(
        &channel,
        "alice",
        v1::Quota {
            vram_bytes: Some(1 << 30),
            max_running_jobs: None,
            fair_share_weight: 1.0,
        },
    )
    .await;
    let _worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;

    let bad_kernel = JOB.replace("\"kernel\": 3, \"padding\": \"same\"", "\"kernel\": 9");
    let error = submit(&channel, &user, &bad_kernel, "").await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(
        error
            .message()
            .contains("spec.model.layers[0].conv2d.kernel"),
        "{}",
        error.message()
    );

    let unknown_field = JOB.replace("\"name\": \"small\"", "\"name\": \"small\", \"gpus\": 2");
    let error = submit(&channel, &user, &unknown_field, "")
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("gpus"), "{}", error.message());

    let error = submit(&channel, &user, "", "").await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("spec_json"), "{}", error.message());

    let huge = JOB
        .replace("\"batch_size\": 64", "\"batch_size\": 65536")
        .replace("[8, 8, 1]", "[512, 512, 3]");
    let error = submit(&channel, &user, &huge, "").await.unwrap_err();
    assert_eq!(error.code(), Code::ResourceExhausted, "{}", error.message());

    let error = JobServiceClient::new(channel.clone())
        .submit_job(Request::new(v1::SubmitJobRequest {
            spec_json: JOB.into(),
            idempotency_key: String::new(),
        }))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);
    let error = submit(&channel, "carve_not_a_token", JOB, "")
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);
    assert!(error.message().contains("token rejected"));

    let error = create_tenant(&channel, &user, "mallory").await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);

    let error = get(&channel, &user, "job-does-not-exist")
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::NotFound);
    let error = get(&channel, &user, "").await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("job_id"));

    let error = create_tenant(&channel, ADMIN, "alice").await.unwrap_err();
    assert_eq!(error.code(), Code::AlreadyExists);

    let error = list_jobs(
        &channel,
        &user,
        v1::ListJobsRequest {
            states: vec![42],
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("states[0]"), "{}", error.message());
}

#[tokio::test]
async fn a_drained_worker_takes_nothing_new_until_undrained() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let worker_id = worker.id.clone();
    let mut cluster_client = ClusterServiceClient::new(channel.clone());
    // Operators know their nodes by name: a drain takes the node's name as well as the id.
    let hostname = cluster_client
        .get_worker(authorized(
            v1::GetWorkerRequest {
                worker_id: worker_id.clone(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner()
        .worker
        .unwrap()
        .hostname;
    let drain = |reference: &str| {
        authorized(
            v1::DrainWorkerRequest {
                worker_id: reference.into(),
                reason: "maintenance".into(),
            },
            ADMIN,
        )
    };
    let error = cluster_client
        .drain_worker(drain("no-such-node"))
        .await
        .unwrap_err();
    assert_eq!(error.code(), Code::NotFound, "{}", error.message());
    let drained = cluster_client
        .drain_worker(drain(&hostname))
        .await
        .unwrap()
        .into_inner()
        .worker
        .unwrap();
    assert_eq!(drained.state, v1::WorkerState::Draining as i32);
    assert_eq!(drained.id, worker_id);
    assert!(matches!(
        worker.next().await,
        v1::scheduler_message::Body::Drain(_)
    ));
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = get(&channel, &user, &job.id).await.unwrap();
    assert_eq!(waiting.state, v1::JobState::Queued as i32);
    assert!(!waiting.waiting_reason.is_empty());
    let undrain = |token: &str| {
        let mut cluster_client = cluster_client.clone();
        let request = authorized(
            v1::UndrainWorkerRequest {
                worker_id: worker_id.clone(),
            },
            token,
        );
        async move { cluster_client.undrain_worker(request).await }
    };
    let error = undrain(&user).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    undrain(ADMIN).await.unwrap();
    let assignment = worker.next_assignment().await;
    assert_eq!(assignment.attempt.unwrap().job_id, job.id);
}

#[tokio::test]
async fn job_logs_keep_the_attempts_lines_and_the_schedulers_notes_for_their_tenant() {
    let (cluster, channel, user, worker_token) =
        start_for_tenant(Duration::from_secs(30), "alice").await;
    let (other_user, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;
    let job = submit(&channel, &user, JOB, "").await.unwrap().job.unwrap();
    let mut watch = watch(&channel, &user, &job.id).await;
    let assignment = worker.next_assignment().await;
    let attempt = assignment.attempt.clone().unwrap();
    worker.report_started(&assignment).await;
    let log = |attempt: &v1::AttemptRef, level: &str, message: &str| {
        v1::worker_message::Body::Log(v1::worker_message::LogLine {
            attempt: Some(attempt.clone()),
            level: level.into(),
            message: message.into(),
            stream: String::new(),
        })
    };
    worker.send(log(&attempt, "info", "step 1 loss 2.30")).await;
    worker
        .send(log(&attempt, "WARNING", "loss scale halved\n"))
        .await;
    // A line about an attempt this worker does not hold is not the job's.
    let stale = v1::AttemptRef {
        attempt_number: 7,
        lease_epoch: 7,
        ..attempt.clone()
    };
    worker.send(log(&stale, "error", "not this attempt")).await;
    worker
        .send(log(&attempt, "debug", "step 10 loss 0.91"))
        .await;
    worker
        .finish(&attempt, v1::AttemptOutcome::Succeeded, 2 << 20)
        .await;
    // The terminal event is sent after its note is queued, so the logs read next have it.
    loop {
        let event = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("an event within 10 s")
            .expect("the watch ends only after the terminal state")
            .unwrap();
        if let Some(v1::job_event::Event::StateChanged(changed)) = event.event
            && changed.state == v1::JobState::Succeeded as i32
        {
            break;
        }
    }

    let request = |after_sequence: u64, page_size: u32| v1::GetJobLogsRequest {
        job_id: job.id.clone(),
        attempt_number: 0,
        after_sequence,
        page_size,
        tail: 0,
    };
    let all = job_logs(&channel, &user, request(0, 0)).await.unwrap();
    assert!(!all.more);
    assert_eq!(all.last_sequence, all.lines.last().unwrap().sequence);
    let text: Vec<String> = all
        .lines
        .iter()
        .map(|line| format!("{} {} {}", line.attempt_number, line.level, line.message))
        .collect();
    assert!(
        all.lines
            .windows(2)
            .all(|pair| pair[0].sequence < pair[1].sequence),
        "{text:#?}"
    );
    assert!(all.lines.iter().all(|line| line.time.is_some()));
    let worker_lines: Vec<&String> = text.iter().filter(|line| line.starts_with("1 ")).collect();
    assert_eq!(
        worker_lines,
        vec![
            "1 info step 1 loss 2.30",
            "1 warn loss scale halved",
            "1 debug step 10 loss 0.91",
            // The results the worker reported at the end, as a line of the attempt.
            "1 info ended: final loss 0.1000"
        ],
        "{text:#?}"
    );
    // The scheduler's notes tell the story around them, in order.
    let position = |needle: &str| {
        text.iter()
            .position(|line| line.starts_with("0 ") && line.contains(needle))
            .unwrap_or_else(|| panic!("no note containing {needle:?} in {text:#?}"))
    };
    let submitted = position("job submitted");
    let placed = position("queued -> placed: placed on gpu-a");
    let started = position("placed -> running");
    let first_worker_line = text.iter().position(|line| line.starts_with("1 ")).unwrap();
    let succeeded = position("running -> succeeded");
    assert!(
        submitted < placed && placed < started && started < first_worker_line,
        "{text:#?}"
    );
    assert_eq!(succeeded, text.len() - 1, "{text:#?}");
    assert!(position("attempt 1 assigned") > placed);

    // One attempt's lines only.
    let attempt_only = v1::GetJobLogsRequest {
        attempt_number: 1,
        ..request(0, 0)
    };
    let attempt_only = job_logs(&channel, &user, attempt_only).await.unwrap();
    assert_eq!(attempt_only.lines.len(), worker_lines.len());
    assert!(
        attempt_only
            .lines
            .iter()
            .all(|line| line.attempt_number == 1)
    );

    // Paging by after_sequence gives the same lines, page by page.
    let mut paged = Vec::new();
    let mut after_sequence = 0;
    let mut pages = 0;
    loop {
        let page = job_logs(&channel, &user, request(after_sequence, 2))
            .await
            .unwrap();
        assert!(page.lines.len() <= 2);
        pages += 1;
        assert!(pages <= all.lines.len(), "paging does not end");
        paged.extend(page.lines);
        after_sequence = page.last_sequence;
        if !page.more {
            break;
        }
    }
    assert_eq!(paged, all.lines);
    // Past the end: nothing, and last_sequence stays where the caller was.
    let past = job_logs(&channel, &user, request(all.last_sequence, 0))
        .await
        .unwrap();
    assert_eq!(
        (past.lines.len(), past.last_sequence, past.more),
        (0, all.last_sequence, false)
    );

    // The tail; a page size over the cap is capped, not refused.
    let tail = v1::GetJobLogsRequest {
        tail: 2,
        ..request(0, 0)
    };
    let tail = job_logs(&channel, &user, tail).await.unwrap();
    assert_eq!(tail.lines, all.lines[all.lines.len() - 2..]);
    let capped = job_logs(&channel, &user, request(0, 1_000_000))
        .await
        .unwrap();
    assert_eq!(capped.lines, all.lines);

    // Visibility is GetJob's: another tenant's job does not exist for it; admins see it.
    assert_eq!(
        job_logs(&channel, ADMIN, request(0, 0))
            .await
            .unwrap()
            .lines,
        all.lines
    );
    let of_job = |job_id: &str| v1::GetJobLogsRequest {
        job_id: job_id.into(),
        ..request(0, 0)
    };
    // (who asks, what, the refusal's code, what its message names: "" for anything)
    for (token, refused_request, code, named) in [
        (other_user.as_str(), request(0, 0), Code::NotFound, ""),
        (
            worker_token.as_str(),
            request(0, 0),
            Code::PermissionDenied,
            "",
        ),
        (
            user.as_str(),
            of_job("job-does-not-exist"),
            Code::NotFound,
            "",
        ),
        (user.as_str(), of_job(""), Code::InvalidArgument, "job_id"),
        (
            user.as_str(),
            request(u64::MAX, 0),
            Code::InvalidArgument,
            "after_sequence",
        ),
    ] {
        let error = job_logs(&channel, token, refused_request.clone())
            .await
            .unwrap_err();
        assert_eq!(
            error.code(),
            code,
            "{refused_request:?}: {}",
            error.message()
        );
        assert!(error.message().contains(named), "{}", error.message());
    }

    let metrics = scrape(cluster.metrics_address).await;
    let stored = metric(&metrics, "carve_log_lines_stored_total");
    assert!(
        stored >= all.lines.len() as u64,
        "{stored} < {}",
        all.lines.len()
    );
    assert!(
        metrics
            .lines()
            .any(|line| line == "carve_log_lines_dropped_total 0"),
        "{metrics}"
    );
}

#[tokio::test]
async fn job_logs_tell_an_oom_retry_and_a_cancel() {
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    let (job, first) = submit_and_place(&channel, &user, &mut worker).await;
    worker
        .send(v1::worker_message::Body::Oom(
            v1::worker_message::OomReport {
                attempt: first.attempt.clone(),
                report: Some(out_of_memory_in(first.slice_bytes)),
                checkpoint: None,
                detected_by: String::new(),
                evidence: String::new(),
            },
        ))
        .await;
    let second = worker.next_assignment().await;
    assert_eq!(second.attempt.as_ref().unwrap().attempt_number, 2);
    cancel(&channel, &user, &job.id, "").await.unwrap();
    let logs = all_job_logs(&channel, &user, &job.id).await;
    let notes: Vec<String> = logs
        .lines
        .iter()
        .map(|line| format!("{} {}", line.level, line.message))
        .collect();
    let position = |needle: &str| {
        notes
            .iter()
            .position(|line| line.contains(needle))
            .unwrap_or_else(|| panic!("no note containing {needle:?} in {notes:#?}"))
    };
    let oom = position("warn attempt 1 ran out of memory: requested");
    let shrink = position("info shrink decision: ");
    let requeued = position("warn placed -> queued: out of memory");
    let second_placement = position("attempt 2 assigned");
    let cancelled = position("warn placed -> cancelled: cancelled by");
    assert!(
        oom < shrink
            && shrink < requeued
            && requeued < second_placement
            && second_placement < cancelled,
        "{notes:#?}"
    );
    assert!(logs.lines.iter().all(|line| line.attempt_number == 0));
}
