//! The request target's seed corpus: one valid request per method, and the requests
//! the harness makes at start (the submitted job, the registered worker).

use carve_proto::v1;
use prost::Message;

use super::METHODS;

/// The example job as `carve submit` sends it.
pub fn example_spec_json() -> String {
    let job =
        carve_core::validate::load_job_spec_toml(include_str!("../../../examples/mnist-cnn.toml"))
            .expect("the example job is valid");
    carve_proto::convert::job_spec_to_json(&job.spec).expect("the example job writes as JSON")
}

pub(super) fn seed_submit() -> v1::SubmitJobRequest {
    v1::SubmitJobRequest {
        spec_json: example_spec_json(),
        idempotency_key: "carve-fuzz-seed".into(),
    }
}

pub(super) fn seed_register() -> v1::RegisterWorkerRequest {
    v1::RegisterWorkerRequest {
        hostname: "fuzz-node".into(),
        gpus: vec![v1::Gpu {
            uuid: "SIM-fuzz-0".into(),
            index: 0,
            model_name: "simulated".into(),
            total_bytes: 80 << 30,
            context_bytes: 640 << 20,
            ..Default::default()
        }],
        version: "fuzz".into(),
        previous_worker_id: String::new(),
        ..Default::default()
    }
}

fn attempt() -> Option<v1::AttemptRef> {
    Some(v1::AttemptRef {
        job_id: "submitted".into(),
        attempt_number: 1,
        lease_epoch: 1,
        gang_rank: None,
    })
}

/// One valid request per method (named `<Method>[-<variant>]`), the seed corpus of the
/// target: each is the selector byte and the encoded message.
pub fn seed_inputs() -> Vec<(String, Vec<u8>)> {
    use v1::worker_message::Body;
    let selector = |method: &str| {
        METHODS
            .iter()
            .position(|name| *name == method)
            .expect("a method of METHODS") as u8
    };
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, method: &str, message: Vec<u8>| {
        let mut input = vec![selector(method)];
        input.extend(message);
        seeds.push((name.to_string(), input));
    };
    let spec_json = example_spec_json();
    add("SubmitJob", "SubmitJob", seed_submit().encode_to_vec());
    let job_id = || "submitted".to_string();
    add(
        "GetJob",
        "GetJob",
        v1::GetJobRequest { job_id: job_id() }.encode_to_vec(),
    );
    add(
        "ListJobs",
        "ListJobs",
        v1::ListJobsRequest {
            tenant: "default".into(),
            states: vec![v1::JobState::Queued as i32],
            name_prefix: "mnist".into(),
            page_size: 10,
            page_token: String::new(),
        }
        .encode_to_vec(),
    );
    add(
        "CancelJob",
        "CancelJob",
        v1::CancelJobRequest {
            job_id: job_id(),
            reason: "fuzz".into(),
        }
        .encode_to_vec(),
    );
    add(
        "WatchJob",
        "WatchJob",
        v1::WatchJobRequest {
            job_id: job_id(),
            include_logs: true,
            resumable: false,
            after_log_sequence: None,
        }
        .encode_to_vec(),
    );
    add(
        "EstimateJob",
        "EstimateJob",
        v1::EstimateJobRequest {
            spec_json: spec_json.clone(),
            batch_size: Some(32),
            precision: Some(v1::Precision::Fp16 as i32),
            slice_bytes: None,
        }
        .encode_to_vec(),
    );
    add(
        "EstimateJob-shrink",
        "EstimateJob",
        v1::EstimateJobRequest {
            spec_json,
            batch_size: None,
            precision: None,
            slice_bytes: Some(8 << 20),
        }
        .encode_to_vec(),
    );
    add(
        "GetJobLogs",
        "GetJobLogs",
        v1::GetJobLogsRequest {
            job_id: job_id(),
            attempt_number: 0,
            after_sequence: 0,
            page_size: 10,
            tail: 5,
        }
        .encode_to_vec(),
    );
    let quota = Some(v1::Quota {
        vram_bytes: Some(40 << 30),
        max_running_jobs: Some(4),
        fair_share_weight: 2.0,
    });
    add(
        "CreateTenant",
        "CreateTenant",
        v1::CreateTenantRequest {
            name: "team-a".into(),
            quota,
        }
        .encode_to_vec(),
    );
    add(
        "ListTenants",
        "ListTenants",
        v1::ListTenantsRequest {}.encode_to_vec(),
    );
    add(
        "SetQuota",
        "SetQuota",
        v1::SetQuotaRequest {
            tenant: "default".into(),
            quota,
        }
        .encode_to_vec(),
    );
    add(
        "CreateToken",
        "CreateToken",
        v1::CreateTokenRequest {
            tenant: "default".into(),
            role: v1::Role::User as i32,
            description: "fuzz".into(),
            time_to_live: Some(prost_types::Duration {
                seconds: 3600,
                nanos: 0,
            }),
        }
        .encode_to_vec(),
    );
    add(
        "ListTokens",
        "ListTokens",
        v1::ListTokensRequest {
            tenant: "default".into(),
            include_inactive: true,
        }
        .encode_to_vec(),
    );
    add(
        "RevokeToken",
        "RevokeToken",
        v1::RevokeTokenRequest {
            token_id: "spare".into(),
        }
        .encode_to_vec(),
    );
    add(
        "ListWorkers",
        "ListWorkers",
        v1::ListWorkersRequest {
            states: vec![v1::WorkerState::Ready as i32],
        }
        .encode_to_vec(),
    );
    let worker_id = || "registered".to_string();
    add(
        "GetWorker",
        "GetWorker",
        v1::GetWorkerRequest {
            worker_id: worker_id(),
        }
        .encode_to_vec(),
    );
    add(
        "DrainWorker",
        "DrainWorker",
        v1::DrainWorkerRequest {
            worker_id: worker_id(),
            reason: "fuzz".into(),
        }
        .encode_to_vec(),
    );
    add(
        "UndrainWorker",
        "UndrainWorker",
        v1::UndrainWorkerRequest {
            worker_id: worker_id(),
        }
        .encode_to_vec(),
    );
    add(
        "ListSlices",
        "ListSlices",
        v1::ListSlicesRequest {
            worker_id: worker_id(),
            gpu_uuid: "SIM-fuzz-0".into(),
            job_id: job_id(),
        }
        .encode_to_vec(),
    );
    add(
        "ResetMemoryModels",
        "ResetMemoryModels",
        v1::ResetMemoryModelsRequest {
            job_id: job_id(),
            all: false,
            tenant: String::new(),
        }
        .encode_to_vec(),
    );
    add(
        "ResetMemoryModels-all",
        "ResetMemoryModels",
        v1::ResetMemoryModelsRequest {
            job_id: String::new(),
            all: true,
            tenant: "default".into(),
        }
        .encode_to_vec(),
    );
    let mut register = seed_register();
    register.previous_worker_id = worker_id();
    add("Register", "Register", register.encode_to_vec());
    let messages = [
        Body::Hello(v1::worker_message::Hello {
            worker_id: worker_id(),
            running_attempts: attempt().into_iter().collect(),
        }),
        Body::Heartbeat(v1::worker_message::Heartbeat {
            gpus: vec![v1::GpuMemory {
                gpu_uuid: "SIM-fuzz-0".into(),
                free_bytes: 70 << 30,
            }],
            cached_image_digests: vec![format!("sha256:{}", "ab".repeat(32))],
        }),
        Body::AttemptStarted(v1::worker_message::AttemptStarted {
            attempt: attempt(),
            reserved_bytes: 1 << 30,
            resumed_from: Some(v1::Checkpoint {
                step: 10,
                location: "/checkpoints/job.ckpt".into(),
            }),
            command_argv: Vec::new(),
            uncontained: false,
            image_digest: String::new(),
        }),
        Body::ImagePull(v1::worker_message::ImagePullProgress {
            attempt: attempt(),
            pull: Some(v1::ImagePull {
                image: "registry.example.org/team/train:1".into(),
                done_bytes: 1 << 20,
                total_bytes: 8 << 20,
            }),
        }),
        Body::Progress(v1::worker_message::Progress {
            attempt: attempt(),
            progress: Some(v1::TrainingProgress {
                step: 10,
                total_steps: 200,
                loss: 0.5,
                samples_per_second: 1000.0,
                memory_in_use_bytes: 1 << 29,
                memory_peak_bytes: 1 << 29,
                seconds_left: Some(190.0),
            }),
        }),
        Body::CheckpointWritten(v1::worker_message::CheckpointWritten {
            attempt: attempt(),
            checkpoint: Some(v1::Checkpoint {
                step: 10,
                location: "/checkpoints/job.ckpt".into(),
            }),
        }),
        Body::Log(v1::worker_message::LogLine {
            attempt: attempt(),
            level: "info".into(),
            message: "step 10".into(),
            stream: "stdout".into(),
        }),
        Body::Oom(v1::worker_message::OomReport {
            attempt: attempt(),
            report: Some(v1::OutOfMemoryReport {
                requested_bytes: 1 << 20,
                in_use_bytes: 1 << 29,
                limit_bytes: 1 << 30,
                largest_free_bytes: 1 << 19,
                peak_bytes: 1 << 29,
            }),
            checkpoint: None,
            detected_by: "guard".into(),
            evidence: "refused 1 MiB".into(),
        }),
        Body::AttemptFinished(v1::worker_message::AttemptFinished {
            attempt: attempt(),
            outcome: v1::AttemptOutcome::Succeeded as i32,
            final_loss: Some(0.1),
            test_accuracy: Some(0.9),
            measured_peak_bytes: 1 << 29,
            message: String::new(),
            steps_done: Some(200),
            samples_per_second: Some(1000.0),
            profile_points: Vec::new(),
            metrics: vec![v1::Metric {
                name: "val_loss".into(),
                value: 0.2,
            }],
        }),
    ];
    let mut session = Vec::new();
    for (sequence, body) in messages.into_iter().enumerate() {
        v1::WorkerMessage {
            sequence: sequence as u64 + 1,
            body: Some(body),
        }
        .encode_length_delimited(&mut session)
        .expect("a Vec grows");
    }
    add("Session", "Session", session);
    seeds
}
