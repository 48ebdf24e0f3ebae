//! A worker that speaks the worker protocol by hand, for the server and restart tests:
//! it registers one simulated GPU, opens a session, heartbeats in the background and
//! sends exactly the messages a test tells it to, so a test controls every step a real
//! worker would take on its own. Included with `#[path]` by the test files that need it.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use carve_proto::v1;
use carve_proto::v1::worker_service_client::WorkerServiceClient;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;
use tonic::transport::Channel;

/// How long a test waits for a message the scheduler must send.
pub const WORKER_DEADLINE: Duration = Duration::from_secs(10);

/// The CUDA context each simulated GPU reserves outside its slices.
const CONTEXT_BYTES: u64 = 256 << 20;

/// `message` with `token` as its bearer token.
pub fn authorized<T>(message: T, token: &str) -> Request<T> {
    carve_proto::client::authorized_request(message, token).expect("a valid token")
}

/// What an attempt in a slice of `slice_bytes` reports when it died a quarter short of
/// it: something outside the plan took memory.
pub fn out_of_memory_in(slice_bytes: u64) -> v1::OutOfMemoryReport {
    v1::OutOfMemoryReport {
        requested_bytes: slice_bytes / 2,
        in_use_bytes: slice_bytes / 4 * 3,
        limit_bytes: slice_bytes,
        largest_free_bytes: slice_bytes / 4,
        peak_bytes: slice_bytes / 4 * 3,
    }
}

pub struct TestWorker {
    pub id: String,
    heartbeating: Arc<AtomicBool>,
    outgoing: mpsc::Sender<v1::WorkerMessage>,
    incoming: tonic::Streaming<v1::SchedulerMessage>,
    /// Messages that arrived while `send` waited for its ack, not yet received.
    pending: VecDeque<v1::scheduler_message::Body>,
    sequence: u64,
}

impl TestWorker {
    /// A new worker with one GPU of `total_bytes`.
    pub async fn connect(
        channel: &Channel,
        token: &str,
        gpu_uuid: &str,
        total_bytes: u64,
    ) -> TestWorker {
        Self::reconnect(channel, token, gpu_uuid, total_bytes, "", vec![]).await
    }

    /// Registers (as `previous_worker_id` when not empty, as after a restart) and opens a
    /// session whose hello lists `running_attempts`.
    pub async fn reconnect(
        channel: &Channel,
        token: &str,
        gpu_uuid: &str,
        total_bytes: u64,
        previous_worker_id: &str,
        running_attempts: Vec<v1::AttemptRef>,
    ) -> TestWorker {
        let mut client = WorkerServiceClient::new(channel.clone());
        let registered = client
            .register(authorized(
                v1::RegisterWorkerRequest {
                    hostname: format!("host-{gpu_uuid}"),
                    gpus: vec![v1::Gpu {
                        uuid: gpu_uuid.into(),
                        index: 0,
                        model_name: "simulated".into(),
                        total_bytes,
                        context_bytes: CONTEXT_BYTES,
                        free_bytes: total_bytes - CONTEXT_BYTES,
                        simulated: true,
                        slices: vec![],
                        compute_capability: "9.0".into(),
                    }],
                    version: "test".into(),
                    previous_worker_id: previous_worker_id.into(),
                    ..Default::default()
                },
                token,
            ))
            .await
            .unwrap()
            .into_inner();
        let (outgoing, receiver) = mpsc::channel(64);
        outgoing
            .send(v1::WorkerMessage {
                sequence: 0,
                body: Some(v1::worker_message::Body::Hello(v1::worker_message::Hello {
                    worker_id: registered.worker_id.clone(),
                    running_attempts,
                })),
            })
            .await
            .unwrap();
        let incoming = client
            .session(authorized(ReceiverStream::new(receiver), token))
            .await
            .unwrap()
            .into_inner();
        let worker = TestWorker {
            id: registered.worker_id,
            heartbeating: Arc::new(AtomicBool::new(true)),
            outgoing,
            incoming,
            pending: VecDeque::new(),
            sequence: 0,
        };
        worker.keep_alive();
        worker
    }

    /// Heartbeats in the background until the worker disconnects or is dropped.
    fn keep_alive(&self) {
        let outgoing = self.outgoing.clone();
        let heartbeating = self.heartbeating.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if !heartbeating.load(Ordering::Relaxed) {
                    return;
                }
                let heartbeat = v1::WorkerMessage {
                    sequence: 0,
                    body: Some(v1::worker_message::Body::Heartbeat(
                        v1::worker_message::Heartbeat::default(),
                    )),
                };
                if outgoing.send(heartbeat).await.is_err() {
                    return;
                }
            }
        });
    }

    /// Ends the session as a worker process would when its scheduler went away: no more
    /// heartbeats, both directions of the stream dropped.
    pub fn disconnect(self) {
        self.heartbeating.store(false, Ordering::Relaxed);
    }

    /// Stops heartbeating but keeps the session open, reading and dropping what comes, as
    /// a hung worker would; returns the raw sender, for a late report.
    pub fn go_silent(self) -> mpsc::Sender<v1::WorkerMessage> {
        self.heartbeating.store(false, Ordering::Relaxed);
        let mut incoming = self.incoming;
        tokio::spawn(async move { while incoming.next().await.is_some() {} });
        self.outgoing
    }

    /// How the scheduler ended this session, within `wait`: the stream's error status,
    /// `None` when it is still open then (messages before the end are dropped).
    pub async fn session_end(&mut self, wait: Duration) -> Option<tonic::Status> {
        let until = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(until, self.incoming.next()).await {
                Err(_) => return None,
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(status))) => return Some(status),
                Ok(None) => return Some(tonic::Status::ok("the stream ended")),
            }
        }
    }

    /// Sends one message and waits for its ack. Returns the other messages the scheduler
    /// sent meanwhile, which `next` and `messages_within` still deliver afterwards.
    pub async fn send(
        &mut self,
        body: v1::worker_message::Body,
    ) -> Vec<v1::scheduler_message::Body> {
        self.sequence += 1;
        let sequence = self.sequence;
        self.outgoing
            .send(v1::WorkerMessage {
                sequence,
                body: Some(body),
            })
            .await
            .unwrap();
        let mut others = Vec::new();
        loop {
            match self.receive_from_stream(WORKER_DEADLINE).await {
                Some(v1::scheduler_message::Body::Ack(ack)) if ack.sequence == sequence => {
                    self.pending.extend(others.iter().cloned());
                    return others;
                }
                Some(v1::scheduler_message::Body::Ack(_)) => {}
                Some(other) => others.push(other),
                None => panic!("no ack for message {sequence} within {WORKER_DEADLINE:?}"),
            }
        }
    }

    /// Sends one message the scheduler must refuse; returns the status it ends the
    /// session with (a refused report is not acknowledged: the worker sends it again on
    /// its next session).
    pub async fn send_refused(&mut self, body: v1::worker_message::Body) -> tonic::Status {
        self.sequence += 1;
        self.outgoing
            .send(v1::WorkerMessage {
                sequence: self.sequence,
                body: Some(body),
            })
            .await
            .unwrap();
        self.session_end(WORKER_DEADLINE)
            .await
            .unwrap_or_else(|| panic!("message {} was not refused", self.sequence))
    }

    /// The next message from the session within `wait`, acks included; None when none
    /// came.
    async fn receive_from_stream(&mut self, wait: Duration) -> Option<v1::scheduler_message::Body> {
        // One deadline for the whole wait: the leader's answers to heartbeats, skipped
        // below, come several times a second and must not restart it.
        let until = tokio::time::Instant::now() + wait;
        loop {
            let message = tokio::time::timeout_at(until, self.incoming.next())
                .await
                .ok()?
                .expect("the session is open")
                .expect("not an error");
            match message.body {
                // The leader's answers to heartbeats and its word that a checkpoint is
                // stored: the real worker's lease and clean-up, nothing these tests
                // script.
                Some(
                    v1::scheduler_message::Body::HeartbeatAck(_)
                    | v1::scheduler_message::Body::CheckpointRecorded(_),
                )
                | None => {}
                Some(body) => return Some(body),
            }
        }
    }

    /// The next message that is not an ack, within `wait`.
    async fn receive(&mut self, wait: Duration) -> Option<v1::scheduler_message::Body> {
        if let Some(body) = self.pending.pop_front() {
            return Some(body);
        }
        let until = tokio::time::Instant::now() + wait;
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            match self.receive_from_stream(left).await? {
                v1::scheduler_message::Body::Ack(_) => {}
                body => return Some(body),
            }
        }
    }

    /// The next message that is not an ack.
    pub async fn next(&mut self) -> v1::scheduler_message::Body {
        self.receive(WORKER_DEADLINE)
            .await
            .unwrap_or_else(|| panic!("no scheduler message within {WORKER_DEADLINE:?}"))
    }

    /// Every message but acks that arrives within `window`.
    pub async fn messages_within(&mut self, window: Duration) -> Vec<v1::scheduler_message::Body> {
        let until = tokio::time::Instant::now() + window;
        let mut messages = Vec::new();
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() && self.pending.is_empty() {
                return messages;
            }
            match self.receive(left).await {
                Some(body) => messages.push(body),
                None => return messages,
            }
        }
    }

    pub async fn next_assignment(&mut self) -> v1::scheduler_message::Assignment {
        match self.next().await {
            v1::scheduler_message::Body::Assignment(assignment) => assignment,
            other => panic!("expected an assignment, got {other:?}"),
        }
    }

    /// Reports `assignment` started in its slice; the scheduler must send nothing else.
    pub async fn started(&mut self, assignment: &v1::scheduler_message::Assignment) {
        let others = self.report_started(assignment).await;
        assert!(others.is_empty(), "unexpected messages: {others:?}");
    }

    /// Reports the attempt of `assignment` started in its whole slice; returns what else
    /// the scheduler sent meanwhile (unchecked, unlike [`TestWorker::started`]).
    pub async fn report_started(
        &mut self,
        assignment: &v1::scheduler_message::Assignment,
    ) -> Vec<v1::scheduler_message::Body> {
        self.report_resumed(assignment, None).await
    }

    /// Reports the attempt of `assignment` started in its whole slice after loading
    /// `resumed_from` (from scratch when `None`); returns what else the scheduler sent.
    pub async fn report_resumed(
        &mut self,
        assignment: &v1::scheduler_message::Assignment,
        resumed_from: Option<v1::Checkpoint>,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::AttemptStarted(
            v1::worker_message::AttemptStarted {
                attempt: assignment.attempt.clone(),
                reserved_bytes: assignment.slice_bytes,
                resumed_from,
                command_argv: Vec::new(),
                uncontained: false,
                image_digest: String::new(),
            },
        ))
        .await
    }

    /// Reports [`halfway_progress`] for `attempt`; returns what else the scheduler sent.
    pub async fn report_halfway(
        &mut self,
        attempt: &v1::AttemptRef,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::Progress(
            v1::worker_message::Progress {
                attempt: Some(attempt.clone()),
                progress: Some(halfway_progress()),
            },
        ))
        .await
    }

    /// Reports `attempt` wrote a checkpoint of `step` at `location`; returns what else the
    /// scheduler sent meanwhile.
    pub async fn checkpoint_written(
        &mut self,
        attempt: &v1::AttemptRef,
        step: u64,
        location: String,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::CheckpointWritten(
            v1::worker_message::CheckpointWritten {
                attempt: Some(attempt.clone()),
                checkpoint: Some(v1::Checkpoint { step, location }),
            },
        ))
        .await
    }

    /// Reports the attempt of `assignment` ran out of memory ([`out_of_memory_in`] its
    /// slice), without a checkpoint; returns what else the scheduler sent meanwhile.
    pub async fn run_out_of_memory(
        &mut self,
        assignment: &v1::scheduler_message::Assignment,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::Oom(
            v1::worker_message::OomReport {
                attempt: assignment.attempt.clone(),
                report: Some(out_of_memory_in(assignment.slice_bytes)),
                checkpoint: None,
                detected_by: String::new(),
                evidence: String::new(),
            },
        ))
        .await
    }

    /// Reports the profile of `assignment` succeeded, measuring `fixed_bytes` plus
    /// `per_sample_bytes` per sample at each of `micro_batches` (its peak the larger);
    /// returns what else the scheduler sent meanwhile.
    pub async fn finish_profile(
        &mut self,
        assignment: &v1::scheduler_message::Assignment,
        fixed_bytes: u64,
        per_sample_bytes: u64,
        micro_batches: [u64; 2],
    ) -> Vec<v1::scheduler_message::Body> {
        let points: Vec<v1::ProfilePoint> = micro_batches
            .iter()
            .map(|&micro_batch| v1::ProfilePoint {
                micro_batch,
                peak_bytes: fixed_bytes + micro_batch * per_sample_bytes,
                ran_out: false,
            })
            .collect();
        self.report_finished(v1::worker_message::AttemptFinished {
            attempt: assignment.attempt.clone(),
            outcome: v1::AttemptOutcome::Succeeded as i32,
            measured_peak_bytes: points
                .iter()
                .map(|point| point.peak_bytes)
                .max()
                .unwrap_or(0),
            profile_points: points,
            ..Default::default()
        })
        .await
    }

    /// Reports the attempt of `assignment` succeeded with a measured `peak`; returns what
    /// else the scheduler sent meanwhile.
    pub async fn succeed(
        &mut self,
        assignment: &v1::scheduler_message::Assignment,
        peak: u64,
    ) -> Vec<v1::scheduler_message::Body> {
        let attempt = assignment
            .attempt
            .as_ref()
            .expect("an assignment names its attempt");
        self.finish(attempt, v1::AttemptOutcome::Succeeded, peak)
            .await
    }

    /// Reports `attempt` ended with `outcome` and a measured `peak`; returns what else the
    /// scheduler sent meanwhile.
    pub async fn finish(
        &mut self,
        attempt: &v1::AttemptRef,
        outcome: v1::AttemptOutcome,
        peak: u64,
    ) -> Vec<v1::scheduler_message::Body> {
        self.report_finished(v1::worker_message::AttemptFinished {
            attempt: Some(attempt.clone()),
            outcome: outcome as i32,
            final_loss: Some(0.1),
            test_accuracy: None,
            measured_peak_bytes: peak,
            message: String::new(),
            steps_done: None,
            samples_per_second: None,
            profile_points: Vec::new(),
            metrics: Vec::new(),
        })
        .await
    }

    /// Sends `finished` as it is; returns what else the scheduler sent meanwhile.
    pub async fn report_finished(
        &mut self,
        finished: v1::worker_message::AttemptFinished,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::AttemptFinished(finished))
            .await
    }

    /// Reports `progress` for `attempt`; returns what else the scheduler sent meanwhile.
    pub async fn report_progress(
        &mut self,
        attempt: &v1::AttemptRef,
        progress: v1::TrainingProgress,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::Progress(
            v1::worker_message::Progress {
                attempt: Some(attempt.clone()),
                progress: Some(progress),
            },
        ))
        .await
    }

    /// Sends a line of the attempt's output; returns what else the scheduler sent.
    pub async fn report_log(
        &mut self,
        attempt: &v1::AttemptRef,
        level: &str,
        message: &str,
    ) -> Vec<v1::scheduler_message::Body> {
        self.send(v1::worker_message::Body::Log(v1::worker_message::LogLine {
            attempt: Some(attempt.clone()),
            level: level.into(),
            message: message.into(),
            stream: String::new(),
        }))
        .await
    }
}

/// Step 5 of 10 at a loss of 0.5 and 100 samples/s, with 1 MiB in use and a 2 MiB peak.
pub fn halfway_progress() -> v1::TrainingProgress {
    v1::TrainingProgress {
        step: 5,
        total_steps: 10,
        loss: 0.5,
        samples_per_second: 100.0,
        memory_in_use_bytes: 1 << 20,
        memory_peak_bytes: 2 << 20,
        seconds_left: None,
    }
}
