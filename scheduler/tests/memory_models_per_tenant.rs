//! Command memory models that never learn nonsense and never cross tenants: tenant A's
//! measurements of a command (same argv, env, working directory) cannot change tenant
//! B's sizing of it, in the store and through the real scheduler; a profile that measured
//! nothing never gives a 0-byte slice; the slice floor; an absurd measurement rejected;
//! a declared size past every GPU (or without its unit) refused; a tenant's reset of its
//! own models. The scheduler over real gRPC with the test worker, on SQLite and on
//! PostgreSQL (as `sqlite::NAME` and `postgres::NAME`) where the store is involved.

#[macro_use]
mod support;

use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::job_service_client::JobServiceClient;
use tonic::Code;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::{TestWorker, authorized};

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{all_job_logs, get, submit, tenant_with_tokens, wait_for_state};
use support::TestDb;

on_both_databases!(
    the_store_keeps_one_tenants_models_apart_from_anothers,
    one_tenants_measurements_never_size_another_tenants_runs_of_the_same_command,
);

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The same command for every tenant: argv, env and working directory identical.
fn command_job(name: &str, vram: &str) -> String {
    serde_json::json!({
        "name": name,
        "command": {
            "argv": ["python3", "train.py", "--micro-batch", "{micro_batch}",
                     "--accumulation-steps", "{accumulation_steps}", "--steps", "{max_steps}"],
            "env": { "DATA": "/data/shared" },
            "working_directory": "/srv/shared",
            "global_batch": 64,
            "steps": 6,
        },
        "resources": { "vram": vram },
        "oom": { "strategies": ["accumulate"] },
    })
    .to_string()
}

async fn submitted(channel: &Channel, token: &str, spec: &str) -> v1::Job {
    submit(channel, token, spec, "").await.unwrap().job.unwrap()
}

async fn reset(
    channel: &Channel,
    token: &str,
    request: v1::ResetMemoryModelsRequest,
) -> Result<u64, tonic::Status> {
    JobServiceClient::new(channel.clone())
        .reset_memory_models(authorized(request, token))
        .await
        .map(|response| response.into_inner().deleted)
}

fn model_json(fixed_bytes: u64) -> String {
    format!(
        r#"{{"model":{{"fixed_bytes":{fixed_bytes},"per_sample_bytes":0,"precision":"fp32","recompute":false}},"measured":true}}"#
    )
}

async fn the_store_keeps_one_tenants_models_apart_from_anothers(db: &TestDb) {
    let store = db.open().await;
    // One shape, two tenants: what alice's runs stored is not bob's.
    store
        .put_command_memory_model("alice", "shape", &model_json(GIB), "alice's", support::T0)
        .await
        .unwrap();
    assert_eq!(
        store.command_memory_model("bob", "shape").await.unwrap(),
        None
    );
    store
        .put_command_memory_model("bob", "shape", &model_json(MIB), "bob's", support::T0)
        .await
        .unwrap();
    // Alice raises hers: bob's stays.
    store
        .put_command_memory_model(
            "alice",
            "shape",
            &model_json(8 * GIB),
            "raised",
            support::T0,
        )
        .await
        .unwrap();
    let bobs = store
        .command_memory_model("bob", "shape")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(bobs.model_json, model_json(MIB));
    assert_eq!(bobs.basis, "bob's");
    // A page of both tenants' jobs reads each its own.
    let page = store
        .command_memory_models(&[("alice", "shape"), ("bob", "shape"), ("carol", "shape")])
        .await
        .unwrap();
    assert_eq!(page.len(), 2);
    assert_eq!(
        page[&("alice".into(), "shape".into())].model_json,
        model_json(8 * GIB)
    );
    assert_eq!(
        page[&("bob".into(), "shape".into())].model_json,
        model_json(MIB)
    );
    // A reset is one tenant's: alice's shape, then all of alice's, leave bob's.
    assert_eq!(
        store
            .delete_command_memory_models("alice", Some("shape"))
            .await
            .unwrap(),
        1
    );
    store
        .put_command_memory_model("alice", "other", &model_json(GIB), "", support::T0)
        .await
        .unwrap();
    assert_eq!(
        store
            .delete_command_memory_models("alice", None)
            .await
            .unwrap(),
        1
    );
    assert!(
        store
            .command_memory_model("bob", "shape")
            .await
            .unwrap()
            .is_some()
    );
}

async fn one_tenants_measurements_never_size_another_tenants_runs_of_the_same_command(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (alice, worker_token) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let mut worker = TestWorker::connect(&channel, &worker_token, "gpu-a", 16 << 30).await;

    // Alice's profile and training run teach her model of the command a lot of memory
    // (a hostile program can make its own numbers as large as a GPU).
    let alices = submitted(&channel, &alice, &command_job("alices", "auto")).await;
    let profile = worker.next_assignment().await;
    assert!(profile.profile);
    worker.started(&profile).await;
    worker
        .finish_profile(&profile, 6 * GIB, 100 * MIB, [32, 64])
        .await;
    let training = worker.next_assignment().await;
    worker.started(&training).await;
    worker.succeed(&training, 14 * GIB).await;
    wait_for_state(&channel, &alice, &alices.id, v1::JobState::Succeeded).await;
    let alices_model = get(&channel, &alice, &alices.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();
    assert!(alices_model.fixed_bytes + 64 * alices_model.per_sample_bytes >= 14 * GIB);

    // Bob's run of the very same command knows nothing of it: it is profiled ...
    let bobs = submitted(&channel, &bob, &command_job("bobs", "auto")).await;
    assert_eq!(
        get(&channel, &bob, &bobs.id).await.unwrap().memory_model,
        None
    );
    let profile = worker.next_assignment().await;
    assert_eq!(profile.attempt.as_ref().unwrap().job_id, bobs.id);
    assert!(profile.profile, "bob's job was sized by alice's model");
    worker.started(&profile).await;
    worker
        .finish_profile(&profile, 512 * MIB, 4 * MIB, [32, 64])
        .await;
    // ... and sized by what his own profile measured, not by alice's 14 GiB.
    let training = worker.next_assignment().await;
    assert_eq!(training.attempt.as_ref().unwrap().job_id, bobs.id);
    assert!(
        training.slice_bytes < GIB,
        "bob's slice is {} B: alice's measurements sized it",
        training.slice_bytes
    );
    let bobs_model = get(&channel, &bob, &bobs.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();
    assert_eq!(bobs_model.fixed_bytes, 512 * MIB);
    assert!(bobs_model.measured);
    assert!(bobs_model.basis.contains(&bobs.id), "{}", bobs_model.basis);
    // Alice's model is unchanged by bob's profile.
    let alices_now = get(&channel, &alice, &alices.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();
    assert_eq!(alices_now, alices_model);
    // Bob's next run of the command is sized by his model alone: exactly what it needs,
    // not scaled by how far alice's run went past her estimate.
    worker.started(&training).await;
    worker.succeed(&training, 700 * MIB).await;
    wait_for_state(&channel, &bob, &bobs.id, v1::JobState::Succeeded).await;
    let bobs_again = submitted(&channel, &bob, &command_job("bobs-again", "auto")).await;
    let placed = worker.next_assignment().await;
    assert_eq!(placed.attempt.as_ref().unwrap().job_id, bobs_again.id);
    assert!(!placed.profile);
    assert_eq!(placed.slice_bytes, 512 * MIB + 64 * 4 * MIB);

    // Resets are the tenant's own: bob cannot reach alice's job or her models.
    let request = |job_id: &str, all: bool, tenant: &str| v1::ResetMemoryModelsRequest {
        job_id: job_id.into(),
        all,
        tenant: tenant.into(),
    };
    let refused = reset(&channel, &bob, request(&alices.id, false, ""))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::NotFound);
    let refused = reset(&channel, &bob, request("", true, "alice"))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert_eq!(
        reset(&channel, &bob, request(&bobs.id, false, ""))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        get(&channel, &bob, &bobs.id).await.unwrap().memory_model,
        None
    );
    assert_eq!(
        get(&channel, &alice, &alices.id)
            .await
            .unwrap()
            .memory_model,
        Some(alices_model)
    );
    assert_eq!(
        reset(&channel, &alice, request("", true, ""))
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        get(&channel, &alice, &alices.id)
            .await
            .unwrap()
            .memory_model,
        None
    );
}

#[tokio::test]
async fn a_profile_that_measured_nothing_is_unmeasured_never_a_zero_byte_slice() {
    let (_cluster, channel, user, _, mut worker) =
        cluster::start_with_worker(Duration::from_secs(30), "alice").await;
    let job = submitted(&channel, &user, &command_job("simulated", "auto")).await;
    let profile = worker.next_assignment().await;
    assert!(profile.profile);
    let profile_slice = profile.slice_bytes;
    worker.started(&profile).await;
    // What a simulated GPU measures: nothing.
    worker.finish_profile(&profile, 0, 0, [32, 64]).await;

    let training = worker.next_assignment().await;
    assert!(!training.profile);
    assert_eq!(
        training.slice_bytes, profile_slice,
        "an unmeasured profile falls back to its own slice"
    );
    let shown = get(&channel, &user, &job.id).await.unwrap();
    let model = shown.memory_model.unwrap();
    assert!(!model.measured);
    assert!(model.basis.starts_with("unmeasured: "), "{}", model.basis);
    assert!(
        model.basis.contains("the profile's slice"),
        "{}",
        model.basis
    );
    let logs = all_job_logs(&channel, &user, &job.id).await;
    assert!(
        logs.lines
            .iter()
            .any(|line| line.message.contains("profile: unmeasured")),
        "{:#?}",
        logs.lines
    );

    // A job of the same command that declares its size is sized as declared, not by
    // the fallback (which could not shrink into 3 GiB and would refuse it).
    let declared = submitted(&channel, &user, &command_job("declared", "3GiB")).await;
    assert_eq!(declared.estimate.unwrap().required_bytes, 3 * GIB);

    // The first real measurement replaces the fallback; the next job of the command is
    // sized by it, not profiled again.
    worker.started(&training).await;
    worker.succeed(&training, 900 * MIB).await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    let model = get(&channel, &user, &job.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();
    assert!(model.measured);
    assert_eq!(model.fixed_bytes, 900 * MIB);
    assert!(model.basis.contains("measured by"), "{}", model.basis);
    let declared_placed = worker.next_assignment().await;
    assert_eq!(
        declared_placed.attempt.as_ref().unwrap().job_id,
        declared.id
    );
    assert_eq!(declared_placed.slice_bytes, 3 * GIB);
    let again = submitted(&channel, &user, &command_job("again", "auto")).await;
    let placed = worker.next_assignment().await;
    assert_eq!(placed.attempt.as_ref().unwrap().job_id, again.id);
    assert!(!placed.profile);
    assert!(placed.slice_bytes >= 900 * MIB && placed.slice_bytes < GIB);
}

#[tokio::test]
async fn an_out_of_memory_after_an_unmeasured_profile_is_read_per_sample_and_retried_smaller() {
    let (_cluster, channel, user, _, mut worker) =
        cluster::start_with_worker(Duration::from_secs(30), "alice").await;
    let job = submitted(&channel, &user, &command_job("simulated", "auto")).await;
    let profile = worker.next_assignment().await;
    worker.started(&profile).await;
    worker.finish_profile(&profile, 0, 0, [32, 64]).await;
    let training = worker.next_assignment().await;
    worker.started(&training).await;
    // The program ran out (its framework said so): 10 GiB in use, 4 GiB more asked.
    worker
        .send(v1::worker_message::Body::Oom(
            v1::worker_message::OomReport {
                attempt: training.attempt.clone(),
                report: Some(v1::OutOfMemoryReport {
                    requested_bytes: 4 * GIB,
                    in_use_bytes: 10 * GIB,
                    limit_bytes: training.slice_bytes,
                    largest_free_bytes: 0,
                    peak_bytes: 10 * GIB,
                }),
                checkpoint: None,
                detected_by: "pytorch".into(),
                evidence: "torch.OutOfMemoryError: CUDA out of memory.".into(),
            },
        ))
        .await;
    // The fallback gives way to the out-of-memory, read all per sample: the retry keeps
    // the global batch at a smaller micro-batch instead of failing as "nothing fits".
    let retry = worker.next_assignment().await;
    assert_eq!(retry.attempt.as_ref().unwrap().job_id, job.id);
    let config = retry.config.unwrap();
    assert_eq!(config.batch_size, 64);
    assert!(config.micro_batch_size < 64, "{config:?}");
    let model = get(&channel, &user, &job.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();
    assert!(model.measured, "{model:?}");
    assert!(model.basis.contains("out-of-memory"), "{}", model.basis);
    // All per sample, as an out-of-memory alone is read: 14 GiB at micro-batch 64.
    assert_eq!(model.fixed_bytes, 0, "{model:?}");
    assert_eq!(model.per_sample_bytes, 14 * GIB / 64, "{model:?}");
}

#[tokio::test]
async fn no_slice_is_sized_below_the_floor_and_an_absurd_measurement_moves_nothing() {
    let (_cluster, channel, user, _, mut worker) =
        cluster::start_with_worker(Duration::from_secs(30), "alice").await;
    let job = submitted(&channel, &user, &command_job("tiny", "auto")).await;
    let profile = worker.next_assignment().await;
    worker.started(&profile).await;
    // A program of 1 MiB: its slice is the floor (256 MiB by default), not 1 MiB.
    worker.finish_profile(&profile, MIB, 0, [32, 64]).await;
    let training = worker.next_assignment().await;
    assert_eq!(training.slice_bytes, 256 * MIB);
    let before = get(&channel, &user, &job.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();

    // The run claims a peak past every GPU: no measurement of a run on one.
    worker.started(&training).await;
    worker.succeed(&training, 1 << 50).await;
    wait_for_state(&channel, &user, &job.id, v1::JobState::Succeeded).await;
    let after = get(&channel, &user, &job.id)
        .await
        .unwrap()
        .memory_model
        .unwrap();
    assert_eq!(after, before, "one absurd measurement moved the model");
    let logs = all_job_logs(&channel, &user, &job.id).await;
    assert!(
        logs.lines.iter().any(|line| line
            .message
            .contains("the memory model is not changed by this attempt's measured peak")),
        "{:#?}",
        logs.lines
    );
}

#[tokio::test]
async fn a_declared_size_past_every_gpu_or_without_its_unit_is_refused_naming_vram() {
    let (_cluster, channel, user, _, mut worker) =
        cluster::start_with_worker(Duration::from_secs(30), "alice").await;
    // A model of the command exists (a profile measured it small) ...
    let profiled = submitted(&channel, &user, &command_job("profiled", "auto")).await;
    let profile = worker.next_assignment().await;
    worker.started(&profile).await;
    worker
        .finish_profile(&profile, 512 * MIB, 4 * MIB, [32, 64])
        .await;
    let training = worker.next_assignment().await;
    worker.started(&training).await;
    worker.succeed(&training, 700 * MIB).await;
    wait_for_state(&channel, &user, &profiled.id, v1::JobState::Succeeded).await;

    // ... and still a declared 20 GiB on a 16 GiB GPU is refused, never admitted by it.
    let refused = submit(&channel, &user, &command_job("huge", "20GiB"), "")
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("spec.resources.vram"),
        "{}",
        refused.message()
    );
    assert!(
        refused.message().contains("20 GiB"),
        "{}",
        refused.message()
    );

    // `vram = 2` is a size without its unit, not a 2-byte slice.
    let bare = command_job("bare", "auto").replace(r#""vram":"auto""#, r#""vram":2"#);
    assert!(bare.contains(r#""vram":2"#), "{bare}");
    let refused = submit(&channel, &user, &bare, "").await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(
        refused.message().contains("spec.resources.vram")
            && refused.message().contains("write the unit"),
        "{}",
        refused.message()
    );
}
