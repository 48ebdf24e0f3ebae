//! ClusterService.GetUsage through real gRPC (issue 32's accounting): a tenant's token
//! reads its own tenant's usage and nothing of another's (asking by name is
//! PERMISSION_DENIED on `tenant`; an empty tenant or another tenant's submitter shows
//! nothing of theirs); an admin reads every tenant's; the submitter is the token that
//! submitted; bad periods are refused by field; the metrics page counts the same figures.

use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::cluster_service_client::ClusterServiceClient;
use carve_scheduler::store::UsageRecord;
use tonic::Code;

#[path = "support/worker.rs"]
mod test_worker;
use test_worker::authorized;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{ADMIN, Cluster, JOB, channel, scrape, start, submit, token_with_id};

const HOUR_MS: i64 = 3_600_000;
const GIB: i64 = 1 << 30;
const GPU: &str = "NVIDIA H100 80GB HBM3";

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn timestamp(milliseconds: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: milliseconds.div_euclid(1000),
        nanos: (milliseconds.rem_euclid(1000) * 1_000_000) as i32,
    }
}

fn ended(job_id: &str, tenant: &str, placed: i64, hours: i64, slice_gib: i64) -> UsageRecord {
    UsageRecord {
        job_id: job_id.to_string(),
        attempt_number: 1,
        tenant: tenant.to_string(),
        gpu_type: GPU.to_string(),
        slice_bytes: slice_gib * GIB,
        placed_at_ms: placed,
        ended_at_ms: Some(placed + hours * HOUR_MS),
        measured_peak_bytes: None,
    }
}

async fn get_usage(
    channel: &tonic::transport::Channel,
    token: &str,
    request: v1::GetUsageRequest,
) -> Result<v1::GetUsageResponse, tonic::Status> {
    ClusterServiceClient::new(channel.clone())
        .get_usage(authorized(request, token))
        .await
        .map(tonic::Response::into_inner)
}

/// Two tenants, each with a user token, and usage of both: acme's job submitted
/// through the API (so its submitter is acme's token) with 2 hours of a 10 GiB slice,
/// globex's 3 hours of 20 GiB. Answers the cluster, its channel, the tokens (acme's
/// id and secret, globex's secret) and the period's start.
struct TwoTenants {
    _cluster: Cluster,
    channel: tonic::transport::Channel,
    metrics_address: std::net::SocketAddr,
    acme_token_id: String,
    acme: String,
    globex: String,
    from_ms: i64,
}

async fn two_tenants() -> TwoTenants {
    let cluster = start(Duration::from_secs(30)).await;
    let channel = channel(&cluster).await;
    for tenant in ["acme", "globex"] {
        cluster::create_tenant(&channel, ADMIN, tenant)
            .await
            .unwrap();
    }
    let (acme_token_id, acme) = token_with_id(&channel, "acme", v1::Role::User).await;
    let (_, globex) = token_with_id(&channel, "globex", v1::Role::User).await;
    // No worker: the job stays queued; its usage is written as history below.
    let acme_job = submit(&channel, &acme, JOB, "").await.unwrap().job.unwrap();
    let start = now_ms() - 10 * HOUR_MS;
    cluster
        .other_replica()
        .await
        .record_usage(&[
            ended(&acme_job.id, "acme", start, 2, 10),
            ended("job-globex", "globex", start, 3, 20),
        ])
        .await
        .unwrap();
    TwoTenants {
        metrics_address: cluster.metrics_address,
        _cluster: cluster,
        channel,
        acme_token_id,
        acme,
        globex,
        from_ms: start,
    }
}

fn period(from_ms: i64, tenant: &str, user: &str) -> v1::GetUsageRequest {
    v1::GetUsageRequest {
        from: Some(timestamp(from_ms)),
        to: None,
        tenant: tenant.to_string(),
        user: user.to_string(),
    }
}

fn tenants_of(answer: &v1::GetUsageResponse) -> Vec<&str> {
    let mut tenants: Vec<&str> = answer
        .tenants
        .iter()
        .chain(&answer.users)
        .map(|figures| figures.tenant.as_str())
        .collect();
    tenants.sort_unstable();
    tenants.dedup();
    tenants
}

/// The hostile tenant: globex's token asks for acme's usage by name, by an empty
/// tenant, and by acme's submitter; it learns nothing of acme.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_never_reads_another_tenants_usage() {
    let world = two_tenants().await;
    let refused = get_usage(
        &world.channel,
        &world.globex,
        period(world.from_ms, "acme", ""),
    )
    .await
    .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(
        refused.message().starts_with("tenant:"),
        "the refusal names the field: {refused:?}"
    );
    assert!(!refused.message().contains("10737418240"), "{refused:?}");

    let own = get_usage(&world.channel, &world.globex, period(world.from_ms, "", ""))
        .await
        .unwrap();
    assert_eq!(tenants_of(&own), ["globex"], "{own:#?}");
    let by_acme_user = get_usage(
        &world.channel,
        &world.globex,
        period(world.from_ms, "", &world.acme_token_id),
    )
    .await
    .unwrap();
    assert!(
        by_acme_user.tenants.is_empty() && by_acme_user.users.is_empty(),
        "{by_acme_user:#?}"
    );
    // Asking for its own tenant by name is the same as asking for none.
    let named = get_usage(
        &world.channel,
        &world.globex,
        period(world.from_ms, "globex", ""),
    )
    .await
    .unwrap();
    assert_eq!(named.tenants, own.tenants);
    assert_eq!(named.users, own.users);

    // A worker's token reads no usage at all.
    let (_, worker) = token_with_id(&world.channel, "acme", v1::Role::Worker).await;
    let refused = get_usage(&world.channel, &worker, period(world.from_ms, "", ""))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_reads_every_tenant_and_the_submitter_is_the_submitting_token() {
    let world = two_tenants().await;
    let everyone = get_usage(&world.channel, ADMIN, period(world.from_ms, "", ""))
        .await
        .unwrap();
    assert_eq!(tenants_of(&everyone), ["acme", "globex"]);
    let acme = &everyone.tenants[0];
    assert_eq!((acme.jobs, acme.attempts), (1, 1));
    assert_eq!(acme.gpu_type, GPU);
    assert_eq!(acme.gpu_milliseconds, 2 * HOUR_MS as u64);
    assert_eq!(
        acme.vram_requested_byte_milliseconds,
        (10 * GIB as u128 * 2 * HOUR_MS as u128).to_string()
    );
    let globex = &everyone.tenants[1];
    assert_eq!(
        globex.vram_requested_byte_milliseconds,
        (20 * GIB as u128 * 3 * HOUR_MS as u128).to_string()
    );
    // acme's job was submitted through the API: its submitter is acme's token, with the
    // token's description; globex's row has no job, so its submitter is unknown.
    let users: Vec<(&str, &str, &str)> = everyone
        .users
        .iter()
        .map(|figures| {
            (
                figures.tenant.as_str(),
                figures.user_token_id.as_str(),
                figures.user.as_str(),
            )
        })
        .collect();
    assert_eq!(
        users,
        [
            ("acme", world.acme_token_id.as_str(), "test"),
            ("globex", "", "")
        ]
    );
    // The admin may filter by tenant, and by user.
    let one = get_usage(&world.channel, ADMIN, period(world.from_ms, "globex", ""))
        .await
        .unwrap();
    assert_eq!(tenants_of(&one), ["globex"]);
    let by_user = get_usage(
        &world.channel,
        ADMIN,
        period(world.from_ms, "", &world.acme_token_id),
    )
    .await
    .unwrap();
    assert_eq!(tenants_of(&by_user), ["acme"]);
    // acme's own token sees the same figures of acme as the admin.
    let own = get_usage(&world.channel, &world.acme, period(world.from_ms, "", ""))
        .await
        .unwrap();
    assert_eq!(own.tenants, vec![acme.clone()]);

    // The same figures, over all time, on the metrics page.
    let page = scrape(world.metrics_address).await;
    for expected in [
        format!("carve_tenant_gpu_seconds_total{{tenant=\"acme\",gpu_type=\"{GPU}\"}} 7200.0"),
        format!("carve_tenant_gpu_seconds_total{{tenant=\"globex\",gpu_type=\"{GPU}\"}} 10800.0"),
        format!(
            "carve_tenant_vram_requested_byte_seconds_total{{tenant=\"globex\",gpu_type=\"{GPU}\"}} {}.0",
            20 * GIB * 3 * 3600
        ),
        format!("carve_tenant_oom_retries_total{{tenant=\"acme\",gpu_type=\"{GPU}\"}} 0.0"),
    ] {
        assert!(
            page.lines().any(|line| line == expected),
            "{expected} missing from:\n{page}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_periods_are_refused_by_field() {
    let world = two_tenants().await;
    let cases = [
        (
            v1::GetUsageRequest {
                from: None,
                ..period(0, "", "")
            },
            "from",
        ),
        (
            v1::GetUsageRequest {
                to: Some(timestamp(world.from_ms - 1)),
                ..period(world.from_ms, "", "")
            },
            "to",
        ),
        (
            v1::GetUsageRequest {
                from: Some(prost_types::Timestamp {
                    seconds: 0,
                    nanos: -1,
                }),
                ..period(0, "", "")
            },
            "from",
        ),
        (
            v1::GetUsageRequest {
                from: Some(prost_types::Timestamp {
                    seconds: i64::MAX,
                    nanos: 0,
                }),
                ..period(0, "", "")
            },
            "from",
        ),
    ];
    for (request, field) in cases {
        let refused = get_usage(&world.channel, &world.acme, request.clone())
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{request:?}");
        assert!(
            refused.message().contains(field),
            "{field} in {refused:?} for {request:?}"
        );
    }
}
