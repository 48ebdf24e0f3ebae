//! Leadership among replicas on one PostgreSQL database: which replica places jobs and
//! holds worker sessions, how it takes over and steps down (see ARCHITECTURE.md, "High
//! availability"). The lease row and the fence are the store's (`store::leadership`).

use std::sync::Arc;
use std::time::Duration;

use carve_proto::ApiError;
use tokio::time::Instant;

use crate::error::SchedulerError;
use crate::metrics::Metrics;

use super::{Live, Scheduler};

/// How long after a renewal began a leader that has not renewed since stops acting: a
/// quarter of the lease before the lease itself runs out, so the fence comes first
/// even when the renewal's statement reached the database late, and a leader renewing
/// every quarter lease is fenced only after two renewals in a row failed or hung.
pub fn self_fence_after(lease: Duration) -> Duration {
    lease - lease / 4
}

/// Sleeps until `deadline`; without one, never wakes (a `select!` branch that is off).
async fn sleep_until_or_never(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// How long after a leader's lease ends (by the database's clock) a standby that saw it
/// stop renewing tries to take over: enough for the lease to have ended when the
/// statement runs, short beside the lease.
const LEASE_END_MARGIN: Duration = Duration::from_millis(5);

/// What this replica is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaderRole {
    /// The only scheduler on its database (SQLite, or a store used without leadership):
    /// it leads, unfenced.
    Alone,
    /// It leads under this epoch.
    Leading { epoch: i64 },
    /// Another replica leads (at this endpoint, when known) or nobody yet.
    Standby { leader_endpoint: Option<String> },
}

/// Who this replica is in the leadership row, and how long its lease lasts.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// A random id of this process.
    pub holder: String,
    /// Where its gRPC API is, told to clients of standbys.
    pub endpoint: String,
    pub lease: Duration,
}

impl Scheduler {
    /// What this replica is now. A leader whose lease it could not renew in time is a
    /// standby from the moment its self-fence passed (see [`self_fence_after`]), before
    /// its lease could have passed to another replica and whether or not its renewal
    /// task has run since (a process frozen by SIGSTOP wakes with every timer due, and
    /// whichever task runs first must already see it fenced).
    pub fn leader_role(&self) -> LeaderRole {
        let role = self
            .role
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        match role {
            LeaderRole::Leading { .. } if self.lease_fence_passed() => {
                // Fenced writes are refused from now on, before the renewal task steps
                // down.
                self.store.set_leader_epoch(None);
                LeaderRole::Standby {
                    leader_endpoint: None,
                }
            }
            role => role,
        }
    }

    /// Whether this leader's self-fence has passed (always false when not leading on
    /// PostgreSQL).
    fn lease_fence_passed(&self) -> bool {
        self.lease_fenced_at()
            .is_some_and(|fenced_at| Instant::now() >= fenced_at)
    }

    fn lease_fenced_at(&self) -> Option<Instant> {
        *self
            .lease_fenced_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Moves the self-fence to `lease` (less the margin) after `renewal_started`, the
    /// moment before the statement that renewed (or took) the lease was sent: the
    /// database counts the lease from a later moment, so the fence always comes first.
    fn extend_lease_fence(&self, renewal_started: Instant, lease: Duration) {
        *self
            .lease_fenced_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) =
            Some(renewal_started + self_fence_after(lease));
    }

    fn clear_lease_fence(&self) {
        *self
            .lease_fenced_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
    }

    fn set_role(&self, role: LeaderRole) {
        *self
            .role
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = role;
    }

    /// Whether this replica places jobs and checks leases now.
    pub fn is_leading(&self) -> bool {
        !matches!(self.leader_role(), LeaderRole::Standby { .. })
    }

    /// `Unavailable`, naming the leader when known, on a standby: what it answers worker
    /// sessions and the calls that act on live state (cancels, drains, watches).
    pub fn require_leader(&self) -> Result<(), SchedulerError> {
        match self.leader_role() {
            LeaderRole::Standby { leader_endpoint } => {
                Err(SchedulerError::Api(ApiError::NotLeader {
                    reason: match &leader_endpoint {
                        Some(endpoint) => format!(
                            "this scheduler replica is a standby; the leader is at {endpoint}"
                        ),
                        None => "this scheduler replica is a standby and no leader is known \
                                 yet; try again in a moment"
                            .to_string(),
                    },
                    leader_endpoint,
                }))
            }
            _ => Ok(()),
        }
    }

    /// Joins the leadership protocol as a standby (writes fenced off) and takes the
    /// leadership at once when nobody holds it. Called once, before serving.
    pub async fn join_leadership(&self, candidate: &Candidate) -> Result<(), SchedulerError> {
        self.store.set_leader_epoch(None);
        self.set_role(LeaderRole::Standby {
            leader_endpoint: None,
        });
        self.leadership_round(candidate).await
    }

    /// Keeps leading (renewing the lease) or standing by (taking over when the leader's
    /// lease runs out) for as long as the scheduler runs.
    ///
    /// A leader that cannot renew stops acting at its self-fence ([`self_fence_after`]
    /// of the lease after its last renewal began), which comes before any standby can
    /// take the lease over: however long a renewal hangs (a partitioned database, a
    /// process frozen mid-call), the wait for it ends at the fence, fenced writes are
    /// refused from then on and its worker sessions end, so the workers go to the
    /// replica that takes over instead of holding sessions with one that cannot act.
    pub async fn keep_leadership(self: Arc<Self>, candidate: Candidate) {
        loop {
            let fence = self.lease_fenced_at();
            tokio::select! {
                _ = tokio::time::sleep(candidate.lease / 4) => {}
                _ = sleep_until_or_never(fence) => {}
            }
            if self.fence_if_due().await {
                continue;
            }
            let fence = self.lease_fenced_at();
            let round = tokio::select! {
                round = self.leadership_round(&candidate) => round,
                () = sleep_until_or_never(fence) => {
                    self.fence_if_due().await;
                    continue;
                }
            };
            if let Err(error) = round {
                tracing::warn!(%error, "leadership check failed");
            }
        }
    }

    /// Steps down when this leader's self-fence has passed; whether it did.
    async fn fence_if_due(&self) -> bool {
        let leading = matches!(
            *self
                .role
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
            LeaderRole::Leading { .. }
        );
        if !leading || !self.lease_fence_passed() {
            return false;
        }
        tracing::warn!(
            "could not renew the leadership before its self-fence: stepping down before \
             another replica can take the lease over"
        );
        Metrics::count(&self.metrics.leader_self_fences);
        self.clear_lease_fence();
        self.step_down(None).await;
        true
    }

    /// One renewal (leading) or takeover attempt (standing by). Each successful one
    /// moves the self-fence to [`self_fence_after`] the lease from the moment before its
    /// statement; a leader whose renewal fails keeps leading until that fence.
    async fn leadership_round(&self, candidate: &Candidate) -> Result<(), SchedulerError> {
        match self.leader_role() {
            LeaderRole::Alone => Ok(()),
            LeaderRole::Leading { epoch } => {
                let started = Instant::now();
                match self
                    .store
                    .renew_leadership(&candidate.holder, epoch, candidate.lease)
                    .await
                {
                    Ok(true) => {
                        self.extend_lease_fence(started, candidate.lease);
                        Ok(())
                    }
                    Ok(false) => {
                        tracing::warn!(epoch, "another replica took the leadership over");
                        let leader = self.store.leadership().await.ok();
                        self.clear_lease_fence();
                        self.step_down(leader.map(|row| row.endpoint)).await;
                        Ok(())
                    }
                    Err(error) => Err(error),
                }
            }
            LeaderRole::Standby { .. } => {
                // Counted from before the takeover's statement, like a renewal.
                let started = Instant::now();
                let taken = self
                    .store
                    .try_take_leadership(&candidate.holder, &candidate.endpoint, candidate.lease)
                    .await;
                match taken? {
                    Some(epoch) => {
                        self.extend_lease_fence(started, candidate.lease);
                        self.become_leader(epoch).await
                    }
                    None => {
                        let leader = self.store.leadership().await?;
                        self.set_role(LeaderRole::Standby {
                            leader_endpoint: Some(leader.endpoint).filter(|_| leader.current),
                        });
                        if leader.lease_left < candidate.lease / 4 {
                            self.take_over_when_lease_ends(candidate, leader.lease_left)
                                .await?;
                        }
                        Ok(())
                    }
                }
            }
        }
    }

    /// A standby whose leader stopped renewing (a live one renews every quarter lease)
    /// tries again just after that lease ends, `lease_left` from now by the database's
    /// clock, not up to a quarter lease later: a failover takes the lease and no more.
    async fn take_over_when_lease_ends(
        &self,
        candidate: &Candidate,
        lease_left: Duration,
    ) -> Result<(), SchedulerError> {
        tokio::time::sleep(lease_left + LEASE_END_MARGIN).await;
        // Counted from before the takeover's statement, like a renewal.
        let started = Instant::now();
        if let Some(epoch) = self
            .store
            .try_take_leadership(&candidate.holder, &candidate.endpoint, candidate.lease)
            .await?
        {
            self.extend_lease_fence(started, candidate.lease);
            return self.become_leader(epoch).await;
        }
        Ok(())
    }

    /// Leads under `epoch`: the live state is rebuilt from the store (attempts still
    /// running keep their slices; their workers get one lease to come back) and passes
    /// start.
    async fn become_leader(&self, epoch: i64) -> Result<(), SchedulerError> {
        let _changes = self.job_changes.lock().await;
        self.store.set_leader_epoch(Some(epoch));
        *self.live() = Live::default();
        self.queue().invalidate();
        *self
            .last_pass_inputs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
        if let Err(error) = self.recover().await {
            self.store.set_leader_epoch(None);
            return Err(error);
        }
        // Event sequences keep rising across leaders (a watcher's last one stays
        // below the new leader's first): each epoch starts its own range.
        let first_sequence = u64::try_from(epoch).unwrap_or(0) << 40;
        self.event_sequence
            .fetch_max(first_sequence, std::sync::atomic::Ordering::AcqRel);
        self.set_role(LeaderRole::Leading { epoch });
        tracing::info!(epoch, "leading");
        self.wake();
        Ok(())
    }

    /// Stops leading: fenced writes are refused from now on, worker sessions end (their
    /// workers reconnect to the leader) and the live state is dropped.
    async fn step_down(&self, leader_endpoint: Option<String>) {
        self.store.set_leader_epoch(None);
        self.set_role(LeaderRole::Standby {
            leader_endpoint: leader_endpoint.clone(),
        });
        // Waits for a pass or report in flight (its writes are refused now).
        let _changes = self.job_changes.lock().await;
        let mut live = self.live();
        for worker in live.workers.values_mut() {
            if let Some(session) = worker.session.take() {
                session.end(SchedulerError::Api(ApiError::NotLeader {
                    reason: match &leader_endpoint {
                        Some(endpoint) => format!(
                            "this scheduler replica no longer leads; the leader is at {endpoint}"
                        ),
                        None => "this scheduler replica no longer leads; reconnect to another"
                            .to_string(),
                    },
                    leader_endpoint: leader_endpoint.clone(),
                }));
            }
        }
        *live = Live::default();
    }

    /// Ends this replica's lease at once when it leads (a graceful stop), so a standby
    /// takes over without waiting for it to run out.
    pub async fn release_leadership(&self, candidate: &Candidate) {
        if let LeaderRole::Leading { epoch } = self.leader_role() {
            self.store.set_leader_epoch(None);
            if let Err(error) = self
                .store
                .release_leadership(&candidate.holder, epoch)
                .await
            {
                tracing::warn!(%error, "could not release the leadership");
            }
        }
    }
}
