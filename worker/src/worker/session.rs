//! The worker's session with the scheduler: register, hello, then the stream of
//! heartbeats, reports and acknowledgements one way and assignments, cancels and
//! recorded checkpoints the other, until the connection ends or no leader answers.

use super::*;
use crate::command_checkpoint::recorded_directory;
use crate::gang_member::member_checkpoint_directory;

/// The most cached image digests a heartbeat names (the scheduler reads no more).
const CACHED_IMAGES_REPORTED: usize = 64;

impl Worker {
    /// The images this node's cache holds, for placement's preference; none without a
    /// sandbox (no image runs uncontained).
    fn cached_image_digests(&self) -> Vec<String> {
        self.sandbox.as_ref().map_or_else(Vec::new, |sandbox| {
            sandbox
                .images()
                .recently_used_digests(CACHED_IMAGES_REPORTED)
        })
    }

    /// One session: register, hello, then stream until the connection ends. Returns
    /// only on an error or when the scheduler closes the stream.
    pub(super) async fn run_session(
        &mut self,
        incoming_reports: &mut mpsc::UnboundedReceiver<Body>,
    ) -> Result<(), WorkerError> {
        let token = BearerToken::new(&self.config.token)
            .map_err(|_| WorkerError::invalid_setting("--token", "is not a valid header value"))?;
        let endpoint = self.choose_session_endpoint().await;
        let channel = connect(
            &endpoint,
            self.config.scheduler_ca_certificate_pem.as_deref(),
            self.config.client_identity.as_ref(),
            token,
            Duration::from_secs(5),
        )
        .await
        .map_err(|error| match error {
            ApiError::InvalidArgument { field, reason } => WorkerError::invalid_setting(
                match field.as_str() {
                    "ca_cert" => "--ca-cert",
                    "tls_cert" => "--tls-cert",
                    _ => "--scheduler",
                },
                reason,
            ),
            other => WorkerError::Scheduler(format!("cannot connect to {endpoint}: {other}")),
        })?;
        let mut client = WorkerServiceClient::new(channel);
        let mut registration = tonic::Request::new(v1::RegisterWorkerRequest {
            hostname: self.config.hostname.clone(),
            gpus: self.gpus_proto(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            previous_worker_id: self.worker_id.clone(),
            // Gangs (issue 31): where other nodes' members reach rank 0 here, and the
            // ports the scheduler may name for its master.
            advertise_address: advertise_address(
                self.config.gang.advertise_address,
                &self.config.scheduler_url,
            )
            .to_string(),
            gang_port_first: u32::from(*self.config.gang.ports.start()),
            gang_port_last: u32::from(*self.config.gang.ports.end()),
        });
        registration.set_timeout(REGISTER_DEADLINE);
        let registered = client.register(registration).await;
        if let Err(status) = &registered {
            self.scheduler_answered(status, false);
        }
        let registered = registered
            .map_err(|status| match status.code() {
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                    WorkerError::TokenRefused(status.message().to_string())
                }
                _ => WorkerError::Scheduler(format!("register: {}", status.message())),
            })?
            .into_inner();
        if !self.worker_id.is_empty() && self.worker_id != registered.worker_id {
            tracing::warn!(
                previous = %self.worker_id,
                now = %registered.worker_id,
                "the scheduler forgot this worker and gave it a new id"
            );
        }
        self.worker_id = registered.worker_id;
        let heartbeat_interval =
            proto_duration(registered.heartbeat_interval).unwrap_or(Duration::from_secs(5));
        let (outgoing, outgoing_stream) = mpsc::channel::<v1::WorkerMessage>(1024);
        let mut sequence = 1u64;
        // Reports made while no session was open go with the unacknowledged ones.
        while let Ok(body) = incoming_reports.try_recv() {
            self.unacknowledged.push_back(PendingReport {
                sequence: 0,
                body,
                sessions: 0,
            });
        }
        // The hello lists what runs and what ended with its report still to come: an
        // attempt the scheduler placed here that the hello leaves out never arrived,
        // and is retried elsewhere.
        let mut running_attempts: Vec<v1::AttemptRef> = lock(&self.shared)
            .running
            .values()
            .map(|running| running.attempt.clone())
            .collect();
        running_attempts.extend(self.unacknowledged.iter().filter_map(
            |pending| match &pending.body {
                Body::AttemptFinished(finished) => finished.attempt.clone(),
                _ => None,
            },
        ));
        let closed = || WorkerError::Scheduler("the session stream closed".into());
        // The worker's own lease counts from this hello once the leader answers it.
        let session_began = Instant::now();
        if let Some(lease) = proto_duration(registered.lease_duration) {
            self.leader_lease.session_began(lease, session_began);
        }
        outgoing
            .send(v1::WorkerMessage {
                sequence,
                body: Some(Body::Hello(v1::worker_message::Hello {
                    worker_id: self.worker_id.clone(),
                    running_attempts,
                })),
            })
            .await
            .map_err(|_| closed())?;
        // What the last session did not get acknowledged goes first, renumbered.
        self.unacknowledged.retain(|pending| {
            let keep = pending.sessions < MOST_SESSIONS_PER_REPORT;
            if !keep {
                tracing::error!(report = ?pending.body, "the scheduler never acknowledged a report: dropped");
            }
            keep
        });
        for pending in self.unacknowledged.iter_mut() {
            sequence += 1;
            pending.sequence = sequence;
            pending.sessions += 1;
            outgoing
                .send(v1::WorkerMessage {
                    sequence,
                    body: Some(pending.body.clone()),
                })
                .await
                .map_err(|_| closed())?;
        }
        let incoming = client.session(ReceiverStream::new(outgoing_stream)).await;
        if let Err(status) = &incoming {
            self.scheduler_answered(status, false);
        }
        let mut incoming = incoming
            .map_err(|status| WorkerError::Scheduler(format!("session: {}", status.message())))?
            .into_inner();
        tracing::info!(worker = %self.worker_id, ?heartbeat_interval, "session open");
        self.scheduler_choice.session_opened();
        self.attempt_end = Some(AttemptEnd::SessionEnded { leader_named: None });
        let mut heartbeat = tokio::time::interval(heartbeat_interval);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = heartbeat.tick() => {
                    sequence += 1;
                    self.leader_lease.heartbeat_sent(sequence, Instant::now());
                    let gpus = self
                        .gpus_proto()
                        .into_iter()
                        .map(|gpu| v1::GpuMemory { gpu_uuid: gpu.uuid, free_bytes: gpu.free_bytes })
                        .collect();
                    outgoing
                        .send(v1::WorkerMessage {
                            sequence,
                            body: Some(Body::Heartbeat(v1::worker_message::Heartbeat {
                                gpus,
                                cached_image_digests: self.cached_image_digests(),
                            })),
                        })
                        .await
                        .map_err(|_| closed())?;
                }
                Some(body) = incoming_reports.recv() => {
                    sequence += 1;
                    self.unacknowledged.push_back(PendingReport {
                        sequence,
                        body: body.clone(),
                        sessions: 1,
                    });
                    outgoing
                        .send(v1::WorkerMessage { sequence, body: Some(body) })
                        .await
                        .map_err(|_| closed())?;
                }
                // The acknowledgement deadline: a session whose scheduler answers nothing
                // (a frozen leader whose connection still stands) is given up.
                () = crate::attempt_process::sleep_until_or_never(
                    self.leader_lease
                        .answer_overdue_at(session_began, heartbeat_interval)
                        .map(Into::into),
                ) => {
                    return Err(WorkerError::Scheduler(format!(
                        "the scheduler answered no heartbeat for {:?}: giving up the session",
                        crate::leader_lease::answer_deadline(
                            heartbeat_interval,
                            self.leader_lease.lease().unwrap_or_default(),
                        )
                    )));
                }
                message = incoming.message() => {
                    match message {
                        Ok(Some(message)) => self.handle_scheduler_message(message).await,
                        Ok(None) => return Ok(()),
                        Err(status) => {
                            self.scheduler_answered(&status, true);
                            return Err(WorkerError::Scheduler(format!(
                                "session ended: {}",
                                status.message()
                            )));
                        }
                    }
                }
            }
        }
    }

    async fn handle_scheduler_message(&mut self, message: v1::SchedulerMessage) {
        use v1::scheduler_message::Body as SchedulerBody;
        // Any answer on the session: its leader heard the hello.
        self.leader_lease.session_answered();
        match message.body {
            Some(SchedulerBody::HeartbeatAck(answer)) => {
                self.leader_lease.heartbeat_answered(answer.sequence);
            }
            Some(SchedulerBody::CheckpointRecorded(recorded)) => {
                self.delete_superseded_checkpoints(recorded);
            }
            Some(SchedulerBody::Ack(ack)) => {
                while self
                    .unacknowledged
                    .front()
                    .is_some_and(|pending| pending.sequence <= ack.sequence)
                {
                    self.unacknowledged.pop_front();
                }
            }
            Some(SchedulerBody::Assignment(assignment)) => self.start_attempt(assignment).await,
            Some(SchedulerBody::Cancel(cancel)) => {
                let Some(attempt) = cancel.attempt else {
                    return;
                };
                let shared = lock(&self.shared);
                // A cancel that names no member of a gang stops every member of the
                // attempt here (issue 31: a gang ends whole); one that names a member,
                // that member; any other, its one attempt.
                let cancelled: Vec<&RunningAttempt> = match attempt.gang_rank {
                    Some(_) => shared
                        .running
                        .get(&attempt_key(&attempt))
                        .into_iter()
                        .collect(),
                    None => shared
                        .running
                        .values()
                        .filter(|running| {
                            running.attempt.job_id == attempt.job_id
                                && running.attempt.attempt_number == attempt.attempt_number
                        })
                        .collect(),
                };
                let reason = if cancel.reason.is_empty() {
                    "cancelled by the scheduler".to_string()
                } else {
                    cancel.reason
                };
                for running in &cancelled {
                    let _ = running.control.send(AttemptControl::Cancel {
                        grace_period: proto_duration(cancel.grace_period).unwrap_or(Duration::ZERO),
                        reason: reason.clone(),
                    });
                }
                match cancelled.first() {
                    Some(_) => {}
                    None => tracing::info!(
                        job = %attempt.job_id,
                        attempt = attempt.attempt_number,
                        "cancel for an attempt that does not run here"
                    ),
                }
            }
            Some(SchedulerBody::Drain(_)) => {
                tracing::info!("draining: finishing what runs, taking nothing new");
                self.draining = true;
            }
            None => {}
        }
    }

    /// The scheduler stored a checkpoint as its job's: what it supersedes goes, off the
    /// async runtime: a command job's older recorded copies
    /// ([`crate::command_checkpoint`]), or an engine job's older files in its directory
    /// ([`crate::checkpoint_files`]).
    fn delete_superseded_checkpoints(&self, recorded: v1::scheduler_message::CheckpointRecorded) {
        let (Some(attempt), Some(checkpoint)) = (recorded.attempt, recorded.checkpoint) else {
            return;
        };
        let directory = job_directory(&self.config.checkpoint_directory, &attempt);
        let copies = recorded_directory(&member_checkpoint_directory(
            &directory,
            attempt.gang_rank.unwrap_or(0),
        ));
        tokio::task::spawn_blocking(move || {
            let location = PathBuf::from(&checkpoint.location);
            let deleted = if location.starts_with(&copies) {
                crate::command_checkpoint::delete_superseded_copies(&copies, &location)
            } else {
                crate::checkpoint_files::delete_superseded(&directory, &attempt.job_id, &location)
            };
            for deleted in deleted {
                tracing::debug!(job = %attempt.job_id, file = %deleted.display(), "deleted a superseded checkpoint");
            }
        });
    }

    /// Refuses an assignment: the attempt ends at once as failed, with the reason.
    pub(super) fn refuse(&self, attempt: v1::AttemptRef, reason: String) {
        tracing::warn!(job = %attempt.job_id, attempt = attempt.attempt_number, %reason, "assignment refused");
        let _ = self
            .reports
            .send(Body::AttemptFinished(v1::worker_message::AttemptFinished {
                attempt: Some(attempt),
                outcome: v1::AttemptOutcome::Failed as i32,
                final_loss: None,
                test_accuracy: None,
                measured_peak_bytes: 0,
                message: reason,
                steps_done: None,
                samples_per_second: None,
                profile_points: Vec::new(),
                metrics: Vec::new(),
            }));
    }
}
