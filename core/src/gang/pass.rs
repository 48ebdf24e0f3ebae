//! One scheduling pass over jobs of any number of slices: [`solve_gangs`].
//!
//! # The policy, exactly
//!
//! Inputs are sorted first (GPUs by id, tenants by name, jobs by tenant, priority, age
//! and id), so the decision does not depend on the order of the input vectors. GPUs are
//! the schedulable ones; a GPU listed twice is one GPU (its most allocated entry).
//!
//! 1. **Order**: the single-job pass's weighted fair share over time
//!    ([`crate::scheduling`] rule 1), with a gang counting all its members' bytes: the
//!    next job is the next of the tenant with the lowest effective usage per weight;
//!    within a tenant, priority (higher first), then age (`submit_sequence`), then id.
//! 2. **Filters**: unknown tenant; no schedulable GPU; a gang the schedulable GPUs could
//!    not hold even empty ([`GangWaitReason::NeverFits`]); the tenant's VRAM quota must
//!    hold `members x member_slice_bytes` more, its running-jobs quota one job more,
//!    both counting what the pass placed and what a reservation of the tenant holds.
//! 3. **All or nothing**: the job's members go where
//!    [`place_gang`](super::place_gang)'s policy puts them among the GPUs it may use now
//!    (rule 5), or the job waits; nothing is held for a job that waits, except by a
//!    reservation (rule 4).
//! 4. **Reservations** (with [`GangOptions::reservations`]), decided before anything is
//!    placed, on the state at the start of the pass. Each tenant's *head* is its first
//!    job that passes the filters; a head that does not fit now is *blocked*. Blocked
//!    heads, by priority (higher first), then `queued_at`, then `submit_sequence`, then
//!    id (an order that only changes when a higher-priority job arrives, so a reservation
//!    is not lost to the churn of fair share), take up to
//!    [`GangOptions::max_reservations`] reservations: with the running slices of the
//!    GPUs not yet reserved released in order of their expected end, the first time `t`
//!    at which the job fits (rule 3's choice on those GPUs' bytes at `t`) gives its
//!    GPUs and its expected start `max(t, now)`; if it fits only once the slices without
//!    an expected end are released too, its start is unknown (`None`). Its tenant's
//!    quotas hold its bytes and one job. Its backfill ends at `queued_at +
//!    max_reservation_wait` ([`GangReservation::backfill_until`]).
//! 5. **Backfill**: a job may take a reserved GPU only while `now <
//!    backfill_until`, and only if it does not delay the reservation: it is expected to
//!    end (`now + expected_duration`) by the reservation's known start, or the GPU's
//!    bytes at that start (its free bytes plus the slices expected to have ended by then)
//!    still hold the reserved member beside it. Unreserved GPUs take anything that fits.
//!    So under true expected ends a reserved job starts by its expected start; with
//!    false ones (a job that overruns), nothing new lands on its GPUs after
//!    `backfill_until`, and it starts once what ran there has ended.
//!
//! A single-slice job is a gang of one: the same rules (best fit for its one member),
//! and a blocked one reserves too, as the single-job pass's heads do.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use super::placement::{
    Candidate, candidates, choose_members, members_on, misfit, sorted_schedulable,
};
use super::{GangMember, GangPlacement, GangShape, GangWaitReason};
use crate::scheduling::tenants::{FairShareTurn, tenants_by_name};
use crate::scheduling::{GpuState, TenantState, WaitReason};
use crate::usage::UsageDecay;

/// A slice running on a GPU: what the pass counts on to free it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RunningSlice {
    pub job_id: String,
    pub worker_id: String,
    pub gpu_id: String,
    pub slice_bytes: u64,
    /// When the slice is expected to be free (its attempt's start plus its
    /// `max_duration`, a bound the worker enforces, is the scheduler's safe choice);
    /// `None` when nothing bounds it.
    pub expected_end: Option<u64>,
}

/// A queued job of one or more slices.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PendingGang {
    /// Unique among the pending jobs of a problem.
    pub job_id: String,
    pub tenant: String,
    pub priority: i32,
    /// Lower is older.
    pub submit_sequence: u64,
    pub shape: GangShape,
    /// When the job joined the queue: its reservation's backfill ends
    /// `max_reservation_wait` later.
    pub queued_at: u64,
    /// How long an attempt is expected to run (a bound, such as `max_duration`, keeps a
    /// reservation's start true); `None`: unknown, so it never backfills by ending early.
    pub expected_duration: Option<u64>,
}

/// Everything one pass decides on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GangProblem {
    pub now: u64,
    /// `allocated_bytes` counts every running slice (listed in `running` or not).
    pub gpus: Vec<GpuState>,
    /// The slices running on the GPUs, with their expected ends (for reservations).
    pub running: Vec<RunningSlice>,
    pub tenants: Vec<TenantState>,
    pub pending: Vec<PendingGang>,
}

/// Switches of the pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GangOptions {
    /// Reserve GPUs for blocked heads (rule 4). Off, a large gang can wait forever
    /// behind a stream of small jobs.
    pub reservations: bool,
    /// Reservations per pass (1: EASY backfill, one job protected at a time).
    pub max_reservations: usize,
    /// After `queued_at` plus this, nothing new is placed on a job's reserved GPUs.
    pub max_reservation_wait: u64,
    /// Fair share over time, as [`crate::scheduling::SchedulingOptions::usage_decay`].
    pub usage_decay: UsageDecay,
}

impl Default for GangOptions {
    /// Reservations on, one at a time, backfill for an hour in milliseconds.
    fn default() -> Self {
        GangOptions {
            reservations: true,
            max_reservations: 1,
            max_reservation_wait: 3_600_000,
            usage_decay: UsageDecay::default(),
        }
    }
}

/// GPUs kept for a blocked job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GangReservation {
    pub job_id: String,
    /// The GPUs the job is expected to get, by rank.
    pub members: Vec<GangMember>,
    /// When they are expected to be free; `None`: a slice there has no expected end.
    pub expected_start: Option<u64>,
    /// From this time on nothing new is placed on the reserved GPUs.
    pub backfill_until: u64,
}

/// What one pass decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GangDecision {
    /// Whole gangs, in the order decided.
    pub placements: Vec<GangPlacement>,
    /// Every pending job not placed: unknown tenants' first, then the global order.
    pub waiting: Vec<(String, GangWaitReason)>,
    /// By the owners' priority, then `queued_at`, then `submit_sequence`, then id.
    pub reservations: Vec<GangReservation>,
}

/// A tenant's quotas and use during the pass.
struct Ledger<'a> {
    state: &'a TenantState,
    in_use: u128,
    running: u64,
    /// What its reservation holds, and the job holding it.
    held: Option<(usize, u128)>,
    jobs: std::ops::Range<usize>,
    next: usize,
}

impl Ledger<'_> {
    fn quota_reason(&self, job: usize, needs: u128) -> Option<WaitReason> {
        let (held_bytes, held_jobs) = match self.held {
            Some((holder, bytes)) if holder != job => (bytes, 1),
            _ => (0, 0),
        };
        if let Some(quota) = self.state.vram_quota_bytes {
            let in_use = self.in_use + held_bytes;
            if in_use + needs > u128::from(quota) {
                return Some(WaitReason::TenantVramQuota {
                    in_use: u64::try_from(in_use).unwrap_or(u64::MAX),
                    quota,
                    needs: u64::try_from(needs).unwrap_or(u64::MAX),
                });
            }
        }
        if let Some(quota) = self.state.running_jobs_quota {
            let running = self.running + held_jobs;
            if running >= u64::from(quota) {
                return Some(WaitReason::TenantRunningJobsQuota {
                    running: u32::try_from(running).unwrap_or(u32::MAX),
                    quota,
                });
            }
        }
        None
    }

    fn turn(&self, ledger_index: usize, holding_seconds: u128) -> FairShareTurn {
        FairShareTurn {
            effective_usage: self
                .state
                .decayed_usage_byte_seconds
                .saturating_add(self.in_use.saturating_mul(holding_seconds)),
            vram_in_use_bytes: self.in_use,
            weight: u128::from(self.state.weight.max(1)),
            ledger_index,
        }
    }
}

/// A reservation during the pass.
struct Held {
    job: usize,
    member_bytes: u64,
    gpus: Vec<usize>,
    expected_start: Option<u64>,
    backfill_until: u64,
}

/// The GPUs during the pass: free bytes and what runs on each, with expected ends.
struct Cluster<'a> {
    gpus: Vec<&'a GpuState>,
    free: Vec<u64>,
    /// `(expected end, bytes)` of each GPU's slices, those placed in the pass included.
    slices: Vec<Vec<(Option<u64>, u64)>>,
    /// The reservation (index into the held list) of each GPU.
    reserved: Vec<Option<usize>>,
}

impl Cluster<'_> {
    /// The GPU's free bytes once the slices expected to end by `at` have.
    fn free_at(&self, gpu: usize, at: u64) -> u128 {
        u128::from(self.free[gpu])
            + self.slices[gpu]
                .iter()
                .filter(|(end, _)| end.is_some_and(|end| end <= at))
                .map(|&(_, bytes)| u128::from(bytes))
                .sum::<u128>()
    }
}

/// One pass over jobs of any number of slices; see the module documentation for the
/// policy.
pub fn solve_gangs(problem: &GangProblem, options: &GangOptions) -> GangDecision {
    let now = problem.now;
    let mut decision = GangDecision::default();

    let mut jobs: Vec<&PendingGang> = problem.pending.iter().collect();
    jobs.sort_unstable_by(|left, right| {
        (
            &left.tenant,
            Reverse(left.priority),
            left.submit_sequence,
            &left.job_id,
        )
            .cmp(&(
                &right.tenant,
                Reverse(right.priority),
                right.submit_sequence,
                &right.job_id,
            ))
            .then_with(|| {
                (
                    left.shape.members,
                    left.shape.member_slice_bytes,
                    left.queued_at,
                )
                    .cmp(&(
                        right.shape.members,
                        right.shape.member_slice_bytes,
                        right.queued_at,
                    ))
            })
    });
    let tenants = tenants_by_name(&problem.tenants);
    let mut ledgers: Vec<Ledger<'_>> = Vec::new();
    let mut start = 0;
    while start < jobs.len() {
        let name = jobs[start].tenant.as_str();
        let end = start
            + jobs[start..]
                .iter()
                .take_while(|job| job.tenant == name)
                .count();
        match tenants.binary_search_by(|tenant| tenant.tenant.as_str().cmp(name)) {
            Ok(position) => ledgers.push(Ledger {
                state: tenants[position],
                in_use: u128::from(tenants[position].vram_in_use_bytes),
                running: u64::from(tenants[position].running_jobs),
                held: None,
                jobs: start..end,
                next: start,
            }),
            Err(_) => decision.waiting.extend(jobs[start..end].iter().map(|job| {
                (
                    job.job_id.clone(),
                    GangWaitReason::Scheduling(WaitReason::UnknownTenant),
                )
            })),
        }
        start = end;
    }

    let gpus = sorted_schedulable(&problem.gpus);
    if gpus.is_empty() {
        for ledger in &ledgers {
            decision
                .waiting
                .extend(jobs[ledger.jobs.clone()].iter().map(|job| {
                    (
                        job.job_id.clone(),
                        GangWaitReason::Scheduling(WaitReason::NoSchedulableGpu),
                    )
                }));
        }
        return decision;
    }
    let index_of: BTreeMap<(&str, &str), usize> = gpus
        .iter()
        .enumerate()
        .map(|(index, gpu)| ((gpu.worker_id.as_str(), gpu.gpu_id.as_str()), index))
        .collect();
    let mut cluster = Cluster {
        free: gpus.iter().map(|gpu| gpu.free_bytes()).collect(),
        slices: vec![Vec::new(); gpus.len()],
        reserved: vec![None; gpus.len()],
        gpus,
    };
    for slice in &problem.running {
        if let Some(&index) = index_of.get(&(slice.worker_id.as_str(), slice.gpu_id.as_str())) {
            cluster.slices[index].push((slice.expected_end, slice.slice_bytes));
        }
    }
    let empty = candidates(&cluster.gpus, GpuState::usable_bytes);
    let never_fits: Vec<bool> = jobs
        .iter()
        .map(|job| choose_members(&job.shape, &empty).is_none())
        .collect();

    let mut held: Vec<Held> = Vec::new();
    if options.reservations && options.max_reservations > 0 {
        held =
            reserve_for_blocked_heads(&jobs, &never_fits, &mut ledgers, &mut cluster, now, options);
        for reservation in &held {
            let job = jobs[reservation.job];
            decision.reservations.push(GangReservation {
                job_id: job.job_id.clone(),
                members: members_on(
                    &reservation.gpus,
                    &cluster.gpus,
                    job.shape.member_slice_bytes,
                ),
                expected_start: reservation.expected_start,
                backfill_until: reservation.backfill_until,
            });
        }
    }

    let holding_seconds = options.usage_decay.steady_state_byte_seconds(1).max(1);
    let mut turns: BinaryHeap<Reverse<FairShareTurn>> = ledgers
        .iter()
        .enumerate()
        .filter(|(_, ledger)| !ledger.jobs.is_empty())
        .map(|(index, ledger)| Reverse(ledger.turn(index, holding_seconds)))
        .collect();
    while let Some(Reverse(turn)) = turns.pop() {
        let ledger = &mut ledgers[turn.ledger_index];
        let job_index = ledger.next;
        ledger.next += 1;
        let job = jobs[job_index];
        let needs = job.shape.total_bytes();
        let owned = held.iter().find(|reservation| reservation.job == job_index);
        let outcome = if never_fits[job_index] {
            Err(misfit(&job.shape, &cluster.gpus, &empty))
        } else if let Some(reason) = ledger.quota_reason(job_index, needs) {
            Err(GangWaitReason::Scheduling(reason))
        } else if let Some(reservation) = owned {
            // It did not fit at the start of the pass, and GPUs only fill up during it.
            Err(GangWaitReason::Reserved {
                expected_start: reservation.expected_start,
            })
        } else {
            place_now(job, &cluster, &held, now).map_err(|reason| match reason {
                Blocked::ByReservation(owner) => GangWaitReason::ReservedForJob {
                    job_id: jobs[held[owner].job].job_id.clone(),
                },
                Blocked::NoRoom(allowed) => misfit(&job.shape, &cluster.gpus, &allowed),
            })
        };
        match outcome {
            Ok(chosen) => {
                let end = job
                    .expected_duration
                    .map(|duration| now.saturating_add(duration));
                for &gpu in &chosen {
                    cluster.free[gpu] -= job.shape.member_slice_bytes;
                    cluster.slices[gpu].push((end, job.shape.member_slice_bytes));
                }
                ledger.in_use += needs;
                ledger.running += 1;
                decision.placements.push(GangPlacement {
                    job_id: job.job_id.clone(),
                    members: members_on(&chosen, &cluster.gpus, job.shape.member_slice_bytes),
                });
            }
            Err(reason) => decision.waiting.push((job.job_id.clone(), reason)),
        }
        if ledger.next < ledger.jobs.end {
            turns.push(Reverse(ledger.turn(turn.ledger_index, holding_seconds)));
        }
    }
    decision
}

enum Blocked<'a> {
    /// It fits but only on GPUs reserved for this reservation (index into the held list).
    ByReservation(usize),
    /// It does not fit the GPUs it may use (these candidates) now.
    NoRoom(Vec<Candidate<'a>>),
}

/// Rule 3 and rule 5: the job's GPUs among those it may use now.
fn place_now<'a>(
    job: &PendingGang,
    cluster: &Cluster<'a>,
    held: &[Held],
    now: u64,
) -> Result<Vec<usize>, Blocked<'a>> {
    let member = job.shape.member_slice_bytes;
    let end = job
        .expected_duration
        .map(|duration| now.saturating_add(duration));
    let may_use = |gpu: usize| match cluster.reserved[gpu] {
        None => true,
        Some(owner) => {
            let reservation = &held[owner];
            let reserved_member = u128::from(reservation.member_bytes);
            now < reservation.backfill_until
                && match reservation.expected_start {
                    Some(start) => {
                        end.is_some_and(|end| end <= start)
                            || cluster.free_at(gpu, start) >= reserved_member + u128::from(member)
                    }
                    None => u128::from(cluster.free[gpu]) >= reserved_member + u128::from(member),
                }
        }
    };
    let allowed: Vec<Candidate<'a>> = candidates(&cluster.gpus, |_| 0)
        .into_iter()
        .map(|mut candidate| {
            candidate.free_bytes = if may_use(candidate.index) {
                cluster.free[candidate.index]
            } else {
                0
            };
            candidate
        })
        .collect();
    if let Some(chosen) = choose_members(&job.shape, &allowed) {
        return Ok(chosen);
    }
    let unrestricted: Vec<Candidate<'a>> = candidates(&cluster.gpus, |_| 0)
        .into_iter()
        .map(|mut candidate| {
            candidate.free_bytes = cluster.free[candidate.index];
            candidate
        })
        .collect();
    if let Some(chosen) = choose_members(&job.shape, &unrestricted)
        && let Some(owner) = chosen.iter().filter_map(|&gpu| cluster.reserved[gpu]).min()
    {
        return Err(Blocked::ByReservation(owner));
    }
    Err(Blocked::NoRoom(allowed))
}

/// Rule 4: each tenant's head, and reservations for the blocked ones in their order.
fn reserve_for_blocked_heads(
    jobs: &[&PendingGang],
    never_fits: &[bool],
    ledgers: &mut [Ledger<'_>],
    cluster: &mut Cluster<'_>,
    now: u64,
    options: &GangOptions,
) -> Vec<Held> {
    let free_now = candidates(&cluster.gpus, |_| 0)
        .into_iter()
        .map(|mut candidate| {
            candidate.free_bytes = cluster.free[candidate.index];
            candidate
        })
        .collect::<Vec<_>>();
    let mut blocked: Vec<(usize, usize)> = Vec::new();
    for (ledger_index, ledger) in ledgers.iter().enumerate() {
        let head = ledger.jobs.clone().find(|&job| {
            !never_fits[job]
                && ledger
                    .quota_reason(job, jobs[job].shape.total_bytes())
                    .is_none()
        });
        if let Some(job) = head
            && choose_members(&jobs[job].shape, &free_now).is_none()
        {
            blocked.push((job, ledger_index));
        }
    }
    blocked.sort_unstable_by(|&(left, _), &(right, _)| {
        let (left, right) = (jobs[left], jobs[right]);
        (
            Reverse(left.priority),
            left.queued_at,
            left.submit_sequence,
            &left.job_id,
        )
            .cmp(&(
                Reverse(right.priority),
                right.queued_at,
                right.submit_sequence,
                &right.job_id,
            ))
    });
    let mut held = Vec::new();
    for (job, ledger_index) in blocked {
        if held.len() >= options.max_reservations {
            break;
        }
        let Some((gpus, expected_start)) = earliest_fit(&jobs[job].shape, cluster, now) else {
            continue;
        };
        let owner = held.len();
        for &gpu in &gpus {
            cluster.reserved[gpu] = Some(owner);
        }
        ledgers[ledger_index].held = Some((job, jobs[job].shape.total_bytes()));
        held.push(Held {
            job,
            member_bytes: jobs[job].shape.member_slice_bytes,
            gpus,
            expected_start,
            backfill_until: jobs[job]
                .queued_at
                .saturating_add(options.max_reservation_wait),
        });
    }
    held
}

/// The GPUs not yet reserved on which `shape` fits first as their slices end in order
/// of expected end, and when: `Some(max(end, now))`, or `None` when it fits only once the
/// slices without an expected end are gone too. `None` overall when it never fits on
/// them (the other reservations hold what it needs).
fn earliest_fit(
    shape: &GangShape,
    cluster: &Cluster<'_>,
    now: u64,
) -> Option<(Vec<usize>, Option<u64>)> {
    let mut projected: Vec<Candidate<'_>> = candidates(&cluster.gpus, |_| 0)
        .into_iter()
        .map(|mut candidate| {
            candidate.free_bytes = if cluster.reserved[candidate.index].is_none() {
                cluster.free[candidate.index]
            } else {
                0
            };
            candidate
        })
        .collect();
    if let Some(chosen) = choose_members(shape, &projected) {
        return Some((chosen, Some(now)));
    }
    let mut ends: Vec<(u64, usize, u64)> = Vec::new();
    let mut unbounded: Vec<(usize, u64)> = Vec::new();
    for (gpu, slices) in cluster.slices.iter().enumerate() {
        if cluster.reserved[gpu].is_some() {
            continue;
        }
        for &(end, bytes) in slices {
            match end {
                Some(end) => ends.push((end, gpu, bytes)),
                None => unbounded.push((gpu, bytes)),
            }
        }
    }
    ends.sort_unstable();
    let mut position = 0;
    while position < ends.len() {
        let at = ends[position].0;
        while position < ends.len() && ends[position].0 == at {
            let (_, gpu, bytes) = ends[position];
            projected[gpu].free_bytes = projected[gpu].free_bytes.saturating_add(bytes);
            position += 1;
        }
        if let Some(chosen) = choose_members(shape, &projected) {
            return Some((chosen, Some(at.max(now))));
        }
    }
    for (gpu, bytes) in unbounded {
        projected[gpu].free_bytes = projected[gpu].free_bytes.saturating_add(bytes);
    }
    choose_members(shape, &projected).map(|chosen| (chosen, None))
}
