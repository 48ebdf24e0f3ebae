//! The request target: every request message of the four services, decoded from the
//! input with prost and handed to its real handler (`carve_scheduler::services`) on one
//! in-process scheduler over a temporary SQLite store, with an admin token in the
//! metadata, so every check past authentication is reached.
//!
//! Input: the first byte picks the method (modulo [`METHODS`]); the rest is that method's
//! request message. For `Session`, the rest is a sequence of length-delimited
//! `WorkerMessage`s, sent as the session's stream. An input that does not decode is not
//! a call (that is tonic's layer, before any handler).
//!
//! The string `registered` in a worker id, `submitted` in a job id and `spare` in a token
//! id stand for the worker, job and token the harness made at start, so mutations reach
//! the checks that need one to exist.
//!
//! A finding: a panic, an `INTERNAL` or `UNKNOWN` status (bad input must get a status a
//! client can act on), or a handler that does not answer within [`ANSWER_TIMEOUT`].
//!
//! The scheduler is made once per process and keeps what earlier inputs did (tenants,
//! tokens, jobs): cheap enough for a campaign, but an input that failed may need the ones
//! before it. The CI run is deterministic in any case (a fixed order on a fresh process).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use carve_proto::v1;
use carve_proto::v1::admin_service_server::AdminService;
use carve_proto::v1::cluster_service_server::ClusterService;
use carve_proto::v1::job_service_server::JobService;
use carve_proto::v1::worker_service_server::WorkerService;
use carve_scheduler::auth::hash_secret;
use carve_scheduler::convert::job_update_to_stored_event;
use carve_scheduler::scheduler::{Scheduler, SchedulerSettings, now_ms};
use carve_scheduler::services::Services;
use carve_scheduler::store::{Role, Store, TenantRecord, TokenRecord};
use http_body::Frame;
use http_body_util::StreamBody;
use prost::Message;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, Streaming};
use tonic::{Code, Request, Status};

use crate::MAX_INPUT_BYTES;

mod seeds;
pub use seeds::{example_spec_json, seed_inputs};
use seeds::{seed_register, seed_submit};

/// How long a handler may take before the run counts it as stalled. Generous, since the
/// CI machine is small and shared; a stall the issue describes takes tens of seconds.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// The methods, in the order the input's first byte picks them.
pub const METHODS: [&str; 21] = [
    "SubmitJob",
    "GetJob",
    "ListJobs",
    "CancelJob",
    "WatchJob",
    "EstimateJob",
    "GetJobLogs",
    "CreateTenant",
    "ListTenants",
    "SetQuota",
    "CreateToken",
    "ListTokens",
    "RevokeToken",
    "ListWorkers",
    "GetWorker",
    "DrainWorker",
    "UndrainWorker",
    "ListSlices",
    "Register",
    "Session",
    // Last, so the selector bytes of the checked-in corpus keep naming the same methods.
    "ResetMemoryModels",
];

/// Words of the API for the CI mutator.
pub const REQUEST_DICTIONARY: &[&[u8]] = &[
    b"registered",
    b"submitted",
    b"spare",
    b"default",
    b"{}",
    b"\"layers\"",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    b"\x80\x80\x80\x80\x10",
    b"\x08\x00",
    b"\x10\x00",
];

const SECRET: &str = "carve-fuzz-admin-secret";
const ADMIN_TOKEN_ID: &str = "token-fuzz-admin";
const SPARE_TOKEN_ID: &str = "token-fuzz-spare";

/// The scheduler every input is sent to, with what the placeholders stand for.
struct Harness {
    runtime: tokio::runtime::Runtime,
    services: Services,
    worker_id: String,
    job_id: String,
    _directory: tempfile::TempDir,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let directory = tempfile::tempdir().expect("a temp dir for the fuzz store");
        let path = directory.path().join("carve.db");
        let services = runtime.block_on(async {
            let store = Store::open(path.to_str().expect("temp paths are utf-8"))
                .await
                .expect("open the fuzz store");
            store
                .create_tenant(&TenantRecord {
                    name: "default".into(),
                    vram_quota_bytes: None,
                    max_running_jobs: None,
                    fair_share_weight: 1,
                    created_at_ms: now_ms(),
                })
                .await
                .expect("create the default tenant");
            for (id, role, secret) in [
                (ADMIN_TOKEN_ID, Role::Admin, SECRET.to_string()),
                (SPARE_TOKEN_ID, Role::User, format!("{SECRET}-spare")),
            ] {
                store
                    .create_token(&TokenRecord {
                        id: id.into(),
                        tenant: "default".into(),
                        role,
                        secret_hash: hash_secret(&secret),
                        description: "carve-fuzz".into(),
                        created_at_ms: now_ms(),
                        expires_at_ms: None,
                        revoked: false,
                        revoked_at_ms: None,
                        last_used_at_ms: None,
                    })
                    .await
                    .expect("create the fuzz tokens");
            }
            let scheduler = Arc::new(Scheduler::new(
                store,
                SchedulerSettings::default(),
                job_update_to_stored_event,
            ));
            scheduler.recover().await.expect("recover the empty store");
            Services { scheduler }
        });
        let (job_id, worker_id) = runtime.block_on(async {
            let job_id = services
                .submit_job(authorized(seed_submit()))
                .await
                .map(|response| response.into_inner().job.unwrap_or_default().id)
                .unwrap_or_else(|status| {
                    eprintln!("carve-fuzz: the seed job was not submitted: {status:?}");
                    String::new()
                });
            let worker_id = services
                .register(authorized(seed_register()))
                .await
                .map(|response| response.into_inner().worker_id)
                .unwrap_or_else(|status| {
                    eprintln!("carve-fuzz: the seed worker was not registered: {status:?}");
                    String::new()
                });
            (job_id, worker_id)
        });
        Harness {
            runtime,
            services,
            worker_id,
            job_id,
            _directory: directory,
        }
    })
}

/// How many inputs reached a handler, how many of those it accepted, and how many jobs
/// sessions were assigned: what a run reports, so a corpus that never gets past decoding,
/// validation or fencing shows.
static HANDLED: AtomicU64 = AtomicU64::new(0);
static ACCEPTED: AtomicU64 = AtomicU64::new(0);
static ASSIGNMENTS: AtomicU64 = AtomicU64::new(0);

/// (calls that reached a handler, calls it accepted, assignments sessions received) in
/// this process so far.
pub fn statistics() -> (u64, u64, u64) {
    (
        HANDLED.load(Ordering::Relaxed),
        ACCEPTED.load(Ordering::Relaxed),
        ASSIGNMENTS.load(Ordering::Relaxed),
    )
}

fn authorized<T>(message: T) -> Request<T> {
    carve_proto::client::authorized_request(message, SECRET).expect("a valid token")
}

pub fn fuzz_request(data: &[u8]) {
    if data.len() > MAX_INPUT_BYTES {
        return;
    }
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let method = METHODS[usize::from(selector) % METHODS.len()];
    let harness = harness();
    let outcome = harness.runtime.block_on(async {
        tokio::time::timeout(ANSWER_TIMEOUT, call(harness, method, body)).await
    });
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(status)) => panic!(
            "{method} answered {:?} for bad input: {}",
            status.code(),
            status.message()
        ),
        Err(_) => panic!("{method} did not answer within {ANSWER_TIMEOUT:?}"),
    }
}

/// Fails with the status when it is one a client cannot act on.
fn check<T>(result: Result<T, Status>) -> Result<Option<T>, Status> {
    HANDLED.fetch_add(1, Ordering::Relaxed);
    match result {
        Ok(value) => {
            ACCEPTED.fetch_add(1, Ordering::Relaxed);
            Ok(Some(value))
        }
        Err(status) if matches!(status.code(), Code::Internal | Code::Unknown) => Err(status),
        Err(_) => Ok(None),
    }
}

fn replace(field: &mut String, placeholder: &str, value: &str) {
    if field.contains(placeholder) {
        *field = field.replace(placeholder, value);
    }
}

/// Decodes `body` as the request, or ends the call: an undecodable body never reaches a
/// handler.
macro_rules! decode {
    ($type:ty, $body:expr) => {
        match <$type>::decode($body) {
            Ok(message) => message,
            Err(_) => return Ok(()),
        }
    };
}

async fn call(harness: &Harness, method: &str, body: &[u8]) -> Result<(), Status> {
    let services = &harness.services;
    let worker = harness.worker_id.as_str();
    let job = harness.job_id.as_str();
    match method {
        "SubmitJob" => {
            let request = decode!(v1::SubmitJobRequest, body);
            check(services.submit_job(authorized(request)).await)?;
        }
        "GetJob" => {
            let mut request = decode!(v1::GetJobRequest, body);
            replace(&mut request.job_id, "submitted", job);
            check(services.get_job(authorized(request)).await)?;
        }
        "ListJobs" => {
            let request = decode!(v1::ListJobsRequest, body);
            check(services.list_jobs(authorized(request)).await)?;
        }
        "CancelJob" => {
            let mut request = decode!(v1::CancelJobRequest, body);
            replace(&mut request.job_id, "submitted", job);
            check(services.cancel_job(authorized(request)).await)?;
        }
        "WatchJob" => {
            let mut request = decode!(v1::WatchJobRequest, body);
            replace(&mut request.job_id, "submitted", job);
            if let Some(response) = check(services.watch_job(authorized(request)).await)? {
                let mut events = response.into_inner();
                // The first event is the current state; then the stream waits for changes.
                if let Ok(Some(event)) =
                    tokio::time::timeout(Duration::from_secs(1), events.next()).await
                {
                    check(event)?;
                }
            }
        }
        "EstimateJob" => {
            let request = decode!(v1::EstimateJobRequest, body);
            check(services.estimate_job(authorized(request)).await)?;
        }
        "GetJobLogs" => {
            let mut request = decode!(v1::GetJobLogsRequest, body);
            replace(&mut request.job_id, "submitted", job);
            check(services.get_job_logs(authorized(request)).await)?;
        }
        "CreateTenant" => {
            let request = decode!(v1::CreateTenantRequest, body);
            check(services.create_tenant(authorized(request)).await)?;
        }
        "ListTenants" => {
            let request = decode!(v1::ListTenantsRequest, body);
            check(services.list_tenants(authorized(request)).await)?;
        }
        "SetQuota" => {
            let request = decode!(v1::SetQuotaRequest, body);
            check(services.set_quota(authorized(request)).await)?;
        }
        "CreateToken" => {
            let request = decode!(v1::CreateTokenRequest, body);
            check(services.create_token(authorized(request)).await)?;
        }
        "ListTokens" => {
            let request = decode!(v1::ListTokensRequest, body);
            check(services.list_tokens(authorized(request)).await)?;
        }
        "RevokeToken" => {
            let mut request = decode!(v1::RevokeTokenRequest, body);
            replace(&mut request.token_id, "spare", SPARE_TOKEN_ID);
            // Revoking the harness's own token would end every later call at
            // authentication, which says nothing about the handlers.
            if request.token_id == ADMIN_TOKEN_ID {
                return Ok(());
            }
            check(services.revoke_token(authorized(request)).await)?;
        }
        "ListWorkers" => {
            let request = decode!(v1::ListWorkersRequest, body);
            check(services.list_workers(authorized(request)).await)?;
        }
        "GetWorker" => {
            let mut request = decode!(v1::GetWorkerRequest, body);
            replace(&mut request.worker_id, "registered", worker);
            check(services.get_worker(authorized(request)).await)?;
        }
        "DrainWorker" => {
            let mut request = decode!(v1::DrainWorkerRequest, body);
            replace(&mut request.worker_id, "registered", worker);
            check(services.drain_worker(authorized(request)).await)?;
        }
        "UndrainWorker" => {
            let mut request = decode!(v1::UndrainWorkerRequest, body);
            replace(&mut request.worker_id, "registered", worker);
            check(services.undrain_worker(authorized(request)).await)?;
        }
        "ResetMemoryModels" => {
            let mut request = decode!(v1::ResetMemoryModelsRequest, body);
            replace(&mut request.job_id, "submitted", job);
            check(services.reset_memory_models(authorized(request)).await)?;
        }
        "ListSlices" => {
            let mut request = decode!(v1::ListSlicesRequest, body);
            replace(&mut request.worker_id, "registered", worker);
            replace(&mut request.job_id, "submitted", job);
            check(services.list_slices(authorized(request)).await)?;
        }
        "Register" => {
            let mut request = decode!(v1::RegisterWorkerRequest, body);
            replace(&mut request.previous_worker_id, "registered", worker);
            check(services.register(authorized(request)).await)?;
        }
        "Session" => session(harness, body).await?,
        other => unreachable!("{other} is not in METHODS"),
    }
    Ok(())
}

/// Sends the messages of `body` as one session's stream and reads what the scheduler
/// answers until the session ends. Between the first message (hello) and the rest, a
/// scheduling pass runs, so the queued jobs are placed on the open session's worker and
/// its reports about them reach the checks behind the fencing.
async fn session(harness: &Harness, mut body: &[u8]) -> Result<(), Status> {
    let mut frames = Vec::new();
    while !body.is_empty() {
        let Ok(mut message) = v1::WorkerMessage::decode_length_delimited(&mut body) else {
            return Ok(());
        };
        if let Some(v1::worker_message::Body::Hello(hello)) = &mut message.body {
            replace(&mut hello.worker_id, "registered", &harness.worker_id);
            for attempt in &mut hello.running_attempts {
                replace(&mut attempt.job_id, "submitted", &harness.job_id);
            }
        }
        // gRPC's framing: not compressed, the length as a big-endian u32, the message.
        let encoded = message.encode_to_vec();
        let mut frame = Vec::with_capacity(encoded.len() + 5);
        frame.push(0u8);
        frame.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
        frame.extend_from_slice(&encoded);
        frames.push(Bytes::from(frame));
    }
    let (sender, receiver) =
        tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(frames.len().max(1));
    let mut frames = frames.into_iter();
    // The handler waits for the first message: without one, the stream must end.
    let sender = match frames.next() {
        Some(first) => {
            let _ = sender.send(Ok(Frame::data(first))).await;
            Some(sender)
        }
        None => {
            drop(sender);
            None
        }
    };
    let mut codec = tonic_prost::ProstCodec::<v1::SchedulerMessage, v1::WorkerMessage>::default();
    let incoming = Streaming::new_request(
        codec.decoder(),
        StreamBody::new(ReceiverStream::new(receiver)),
        None,
        None,
    );
    let opened = check(harness.services.session(authorized(incoming)).await);
    let Some(response) = opened? else {
        return Ok(());
    };
    // A pass's own failure is the store's business, not the session's input's.
    let _ = harness.services.scheduler.schedule_once().await;
    if let Some(sender) = sender {
        for frame in frames {
            if sender.send(Ok(Frame::data(frame))).await.is_err() {
                break;
            }
        }
    }
    let mut answers = response.into_inner();
    // The session ends when its stream has been read; an answer that takes longer than
    // this is left (the scheduler may push assignments at any time).
    while let Ok(Some(answer)) = tokio::time::timeout(Duration::from_secs(2), answers.next()).await
    {
        if let Some(v1::SchedulerMessage {
            body: Some(v1::scheduler_message::Body::Assignment(_)),
        }) = check(answer)?
        {
            ASSIGNMENTS.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}
