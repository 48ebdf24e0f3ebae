//! The CPU-heavy part of requests (validating a spec, estimating it, planning a shrink),
//! run off the async runtime on a bounded pool, with a budget of compute time per tenant.
//!
//! Their cost grows with the model, and a plain user chooses the model: on the async
//! runtime two large EstimateJob calls once held every runtime thread for half a minute,
//! so health checks and submits timed out and a heartbeating worker was declared lost.
//! Here the runtime only waits for them. The pool has at most `pool_permits` of these
//! computations running at once, a tenant at most `tenant_permits` of them (its further
//! requests queue behind its own, not in front of other tenants'), and each tenant spends
//! from a bucket of compute seconds that refills at `refill_per_second`: a tenant that
//! has used its burst is refused with RESOURCE_EXHAUSTED and told when to retry, rather
//! than queued for ever.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use carve_proto::ApiError;
use tokio::sync::Semaphore;

use crate::error::SchedulerError;

/// Limits of the pool and of each tenant's share of it.
#[derive(Debug, Clone)]
pub struct ComputeLimits {
    /// Computations running at once, all tenants together.
    pub pool_permits: usize,
    /// Computations of one tenant running or waiting for the pool at once.
    pub tenant_permits: usize,
    /// Compute seconds a tenant may spend in a burst.
    pub burst_seconds: f64,
    /// Compute seconds a tenant earns back per second.
    pub refill_per_second: f64,
}

impl Default for ComputeLimits {
    /// Half the machine's cores for the pool (the other half serves the runtime: requests,
    /// heartbeats, passes), half of that for one tenant; a minute of compute in a burst,
    /// a quarter of a core sustained.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        let pool_permits = (cores / 2).max(1);
        ComputeLimits {
            pool_permits,
            tenant_permits: (pool_permits / 2).max(1),
            burst_seconds: 60.0,
            refill_per_second: 0.25,
        }
    }
}

#[derive(Debug)]
struct TenantShare {
    permits: Arc<Semaphore>,
    /// Compute seconds left; may go below zero by the last computation's overrun.
    seconds_left: f64,
    refilled_at: Instant,
}

/// The pool; one per scheduler.
#[derive(Debug)]
pub struct ComputePool {
    limits: ComputeLimits,
    permits: Arc<Semaphore>,
    tenants: Mutex<HashMap<String, TenantShare>>,
}

impl ComputePool {
    pub fn new(limits: ComputeLimits) -> ComputePool {
        ComputePool {
            permits: Arc::new(Semaphore::new(limits.pool_permits.max(1))),
            limits,
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// Runs `work` for `tenant` on the pool and returns what it returns; refused at once
    /// when the tenant has spent its compute budget.
    pub async fn run<T, Work>(&self, tenant: &str, work: Work) -> Result<T, SchedulerError>
    where
        T: Send + 'static,
        Work: FnOnce() -> T + Send + 'static,
    {
        let tenant_permits = self.admit(tenant, Instant::now())?;
        let _tenant_permit = tenant_permits
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Unavailable("the scheduler is stopping".into()))?;
        // The calls queued behind the tenant's own may have spent its budget meanwhile.
        self.admit(tenant, Instant::now())?;
        let pool_permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Unavailable("the scheduler is stopping".into()))?;
        let started = Instant::now();
        let result = tokio::task::spawn_blocking(move || {
            let _pool_permit = pool_permit;
            work()
        })
        .await;
        self.charge(tenant, started.elapsed(), Instant::now());
        result.map_err(|error| {
            SchedulerError::Api(ApiError::Internal(format!(
                "the computation stopped unexpectedly: {error}"
            )))
        })
    }

    /// Runs the scheduler's own `work` (an OOM's shrink plan) on the pool: it waits for a
    /// permit like any request's work, but no tenant's budget can refuse it.
    pub async fn run_for_scheduler<T, Work>(&self, work: Work) -> Result<T, SchedulerError>
    where
        T: Send + 'static,
        Work: FnOnce() -> T + Send + 'static,
    {
        let pool_permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .map_err(|_| ApiError::Unavailable("the scheduler is stopping".into()))?;
        tokio::task::spawn_blocking(move || {
            let _pool_permit = pool_permit;
            work()
        })
        .await
        .map_err(|error| {
            SchedulerError::Api(ApiError::Internal(format!(
                "the computation stopped unexpectedly: {error}"
            )))
        })
    }

    /// The tenant's permits, if its budget is not spent.
    fn admit(&self, tenant: &str, now: Instant) -> Result<Arc<Semaphore>, SchedulerError> {
        let mut tenants = self
            .tenants
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let share = tenants
            .entry(tenant.to_string())
            .or_insert_with(|| TenantShare {
                permits: Arc::new(Semaphore::new(self.limits.tenant_permits.max(1))),
                seconds_left: self.limits.burst_seconds,
                refilled_at: now,
            });
        self.refill(share, now);
        if share.seconds_left <= 0.0 {
            let wait = -share.seconds_left / self.limits.refill_per_second.max(f64::MIN_POSITIVE);
            return Err(ApiError::ResourceExhausted(format!(
                "tenant {tenant} has used its budget of {:.0} s of validation and estimation \
                 compute (it refills at {} s per second); retry in {:.1} s",
                self.limits.burst_seconds,
                self.limits.refill_per_second,
                wait.max(0.1)
            ))
            .into());
        }
        Ok(Arc::clone(&share.permits))
    }

    fn charge(&self, tenant: &str, spent: Duration, now: Instant) {
        let mut tenants = self
            .tenants
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(share) = tenants.get_mut(tenant) {
            self.refill(share, now);
            share.seconds_left -= spent.as_secs_f64();
        }
    }

    fn refill(&self, share: &mut TenantShare, now: Instant) {
        let earned =
            now.duration_since(share.refilled_at).as_secs_f64() * self.limits.refill_per_second;
        share.seconds_left = (share.seconds_left + earned).min(self.limits.burst_seconds);
        share.refilled_at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(burst_seconds: f64) -> ComputeLimits {
        ComputeLimits {
            pool_permits: 1,
            tenant_permits: 1,
            burst_seconds,
            refill_per_second: 1.0,
        }
    }

    #[test]
    fn a_tenant_that_spent_its_burst_is_refused_until_it_refills() {
        let pool = ComputePool::new(limits(2.0));
        let start = Instant::now();
        pool.admit("alice", start).unwrap();
        pool.charge("alice", Duration::from_secs(3), start);
        let refused = pool.admit("alice", start).unwrap_err();
        assert!(
            matches!(&refused, SchedulerError::Api(ApiError::ResourceExhausted(message))
                if message.contains("tenant alice") && message.contains("retry in 1.0 s")),
            "{refused:?}"
        );
        // Another tenant is not affected.
        pool.admit("bob", start).unwrap();
        // A second and a half later alice has half a second again.
        pool.admit("alice", start + Duration::from_millis(1500))
            .unwrap();
    }

    #[test]
    fn the_budget_never_exceeds_the_burst() {
        let pool = ComputePool::new(limits(2.0));
        let start = Instant::now();
        pool.admit("alice", start).unwrap();
        // An hour idle earns no more than the burst.
        let later = start + Duration::from_secs(3600);
        pool.charge("alice", Duration::from_millis(2100), later);
        assert!(pool.admit("alice", later).is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_queued_behind_a_tenants_own_are_refused_once_its_budget_is_spent() {
        let pool = std::sync::Arc::new(ComputePool::new(ComputeLimits {
            refill_per_second: 0.001,
            ..limits(0.2)
        }));
        // Four calls of 150 ms each, sent at once: all are admitted on arrival, run one at
        // a time (one permit per tenant), and the budget of 0.2 s is spent by the second.
        let calls: Vec<_> = (0..4)
            .map(|_| {
                let pool = std::sync::Arc::clone(&pool);
                tokio::spawn(async move {
                    pool.run("alice", || std::thread::sleep(Duration::from_millis(150)))
                        .await
                })
            })
            .collect();
        let mut refused = 0;
        for call in calls {
            if call.await.unwrap().is_err() {
                refused += 1;
            }
        }
        assert_eq!(refused, 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn work_runs_off_the_runtime_and_returns_its_value() {
        let pool = ComputePool::new(limits(10.0));
        let runtime_thread = std::thread::current().id();
        let (value, thread) = pool
            .run("alice", move || (6 * 7, std::thread::current().id()))
            .await
            .unwrap();
        assert_eq!(value, 42);
        assert_ne!(thread, runtime_thread);
    }
}
