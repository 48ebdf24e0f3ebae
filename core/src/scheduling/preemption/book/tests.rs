//! The preemption book's decisions, one by one, on small hand-built clusters; and the
//! scheduler's instantiation (job ids, milliseconds) deciding as the simulator's (job
//! indexes, seconds) does for the same cluster.

use super::*;

const GIB: u64 = 1 << 30;

fn gpu(id: &str, usable_gib: u64, allocated_gib: u64) -> GpuState {
    GpuState {
        gpu_id: id.to_string(),
        worker_id: format!("worker-{id}"),
        total_bytes: usable_gib * GIB,
        context_bytes: 0,
        allocated_bytes: allocated_gib * GIB,
        schedulable: true,
    }
}

fn settings() -> BookSettings {
    BookSettings {
        limits: PreemptionSettings {
            min_run_time_seconds: 300,
            max_preemptions_per_job_per_hour: 2,
        },
        grace_period_s: 30.0,
    }
}

fn occupant(
    job: usize,
    gpu: usize,
    priority: i32,
    slice_gib: u64,
    started_at: f64,
) -> Occupant<usize, f64> {
    Occupant {
        job,
        attempt_number: 1,
        gpu,
        tenant: "batch".to_string(),
        priority,
        slice_bytes: slice_gib * GIB,
        started_at,
    }
}

fn waiting(job: usize, priority: i32, slice_gib: u64) -> WaitingJob<usize> {
    WaitingJob {
        job,
        tenant: "oncall".to_string(),
        priority,
        submit_sequence: job as u64,
        slice_bytes: slice_gib * GIB,
    }
}

fn pass<'a>(
    now: f64,
    gpus: &'a [GpuState],
    running: Vec<Occupant<usize, f64>>,
    waiting: Vec<WaitingJob<usize>>,
) -> PassInput<'a, usize, f64> {
    PassInput {
        now,
        settings: settings(),
        gpus,
        running,
        waiting,
        fair_share: FairShareState::default(),
    }
}

/// One 80 GiB GPU with job 0 (priority 0, 60 GiB) running since 0; job 1 (priority 10,
/// 40 GiB) waits.
fn one_gpu_one_victim(now: f64) -> (PreemptionBook<usize, f64>, PassOutcome<usize, f64>) {
    let gpus = [gpu("g0", 80, 60)];
    let mut book = PreemptionBook::default();
    let outcome = book.preempt(pass(
        now,
        &gpus,
        vec![occupant(0, 0, 0, 60, 0.0)],
        vec![waiting(1, 10, 40)],
    ));
    (book, outcome)
}

#[test]
fn a_pass_evicts_a_lower_priority_attempt_and_claims_its_bytes() {
    let (book, outcome) = one_gpu_one_victim(600.0);
    assert_eq!(outcome.retry_at, None);
    let [preemption] = outcome.preemptions.as_slice() else {
        panic!("{outcome:?}");
    };
    assert_eq!(preemption.urgent, 1);
    assert_eq!(preemption.gpu_id, "g0");
    assert_eq!(preemption.slice_bytes, 40 * GIB);
    assert_eq!(
        preemption.reason,
        "preempting 0 (priority 0) on g0 to make room: placed once they have stopped"
    );
    let [victim] = preemption.victims.as_slice() else {
        panic!("{preemption:?}");
    };
    assert_eq!((victim.job, victim.attempt_number), (0, 1));
    assert_eq!(victim.ground, EvictionGround::HigherPriority);
    assert_eq!(victim.grace_ends_at, 630.0);
    assert_eq!(
        victim.message,
        "preempted by job 1 (priority 10): job 1 (priority 10) needs 40 GiB on g0 and this \
         job's priority is 0; it checkpoints, stops within 30s and resumes from its checkpoint"
    );
    assert_eq!(book.claimed_jobs(), BTreeSet::from([1]));
    let eviction = book.eviction(&0).expect("job 0 is being evicted");
    assert_eq!(eviction.urgent, 1);
    assert_eq!(eviction.message, victim.message);
    assert_eq!(book.preemptions_in_last_hour(&0, 600.0), 1);
    assert_eq!(book.preemptions_in_last_hour(&0, 4200.0), 0);
}

#[test]
fn claimed_bytes_are_held_from_a_pass_and_given_back() {
    let (book, _) = one_gpu_one_victim(600.0);
    let mut gpus = [gpu("g0", 80, 60), gpu("g1", 80, 0)];
    let before = gpus.clone();
    let held = book.hold_claims(&mut gpus);
    // Only what is free is held: the job's 40 GiB, of which 20 are free now.
    assert_eq!(held, [(0, 20 * GIB)]);
    assert_eq!(gpus[0].free_bytes(), 0);
    assert_eq!(gpus[1], before[1]);
    PreemptionBook::<usize, f64>::release_claims(&mut gpus, &held);
    assert_eq!(gpus, before);
}

#[test]
fn a_claimed_job_a_claimed_gpu_and_a_stopping_victim_are_not_chosen_again() {
    let (mut book, _) = one_gpu_one_victim(600.0);
    // The same job again, and another urgent job: g0 is claimed and job 0 is stopping.
    let gpus = [gpu("g0", 80, 60), gpu("g1", 80, 70)];
    let outcome = book.preempt(pass(
        700.0,
        &gpus,
        vec![occupant(0, 0, 0, 60, 0.0), occupant(2, 1, 0, 70, 0.0)],
        vec![waiting(1, 10, 40), waiting(3, 10, 40)],
    ));
    let urgent: Vec<(usize, &str)> = outcome
        .preemptions
        .iter()
        .map(|preemption| (preemption.urgent, preemption.gpu_id.as_str()))
        .collect();
    assert_eq!(urgent, [(3, "g1")]);
    // One plan per GPU: a third urgent job finds nothing left.
    let gpus = [gpu("g0", 80, 60), gpu("g1", 80, 70), gpu("g2", 80, 0)];
    let outcome = book.preempt(pass(
        800.0,
        &gpus,
        vec![occupant(0, 0, 0, 60, 0.0), occupant(2, 1, 0, 70, 0.0)],
        vec![waiting(4, 10, 40)],
    ));
    assert_eq!(outcome.preemptions, []);
}

#[test]
fn the_highest_priority_then_oldest_job_gets_the_only_gpu() {
    let gpus = [gpu("g0", 80, 60)];
    let mut book = PreemptionBook::default();
    let mut older = waiting(5, 10, 40);
    older.submit_sequence = 1;
    let mut younger = waiting(2, 10, 40);
    younger.submit_sequence = 9;
    let outcome = book.preempt(pass(
        600.0,
        &gpus,
        vec![occupant(0, 0, 0, 60, 0.0)],
        vec![waiting(3, 5, 40), younger, older],
    ));
    let urgent: Vec<usize> = outcome.preemptions.iter().map(|p| p.urgent).collect();
    assert_eq!(urgent, [5]);
}

#[test]
fn a_young_attempt_is_spared_until_its_minimum_run_time_and_the_book_says_when() {
    let (book, outcome) = one_gpu_one_victim(100.0);
    assert_eq!(outcome.preemptions, []);
    assert_eq!(outcome.retry_at, Some(300.0));
    assert!(book.claimed_jobs().is_empty());
    let (_, outcome) = one_gpu_one_victim(300.0);
    assert_eq!(outcome.preemptions.len(), 1);
}

#[test]
fn a_job_preempted_to_the_cap_is_spared_for_an_hour_after_the_first() {
    let gpus = [gpu("g0", 80, 60)];
    let mut book = PreemptionBook::default();
    let mut now = 600.0;
    // Preempted twice (it ends each time, and starts again at once).
    for attempt in 1..=2 {
        let mut running = occupant(0, 0, 0, 60, 0.0);
        running.attempt_number = attempt;
        let outcome = book.preempt(pass(
            now,
            &gpus,
            vec![running],
            vec![waiting(attempt as usize, 10, 40)],
        ));
        assert_eq!(outcome.preemptions.len(), 1, "{outcome:?}");
        assert!(book.take_eviction(&0, attempt).is_some());
        book.drop_claim(&(attempt as usize));
        now += 600.0;
    }
    let mut running = occupant(0, 0, 0, 60, 0.0);
    running.attempt_number = 3;
    let outcome = book.preempt(pass(
        now,
        &gpus,
        vec![running.clone()],
        vec![waiting(9, 10, 40)],
    ));
    assert_eq!(outcome.preemptions, []);
    assert_eq!(outcome.retry_at, Some(600.0 + 3600.0));
    let outcome = book.preempt(pass(4200.0, &gpus, vec![running], vec![waiting(9, 10, 40)]));
    assert_eq!(outcome.preemptions.len(), 1);
    // Only the one of the last hour counts now (the 600 s one was forgotten).
    assert_eq!(book.preemptions_in_last_hour(&0, 4200.0), 2);
}

#[test]
fn a_cap_of_zero_spares_every_attempt_and_asks_for_no_retry() {
    let gpus = [gpu("g0", 80, 60)];
    let mut book = PreemptionBook::default();
    let mut input = pass(
        600.0,
        &gpus,
        vec![occupant(0, 0, 0, 60, 0.0)],
        vec![waiting(1, 10, 40)],
    );
    input.settings.limits.max_preemptions_per_job_per_hour = 0;
    assert_eq!(book.preempt(input), PassOutcome::default());
}

#[test]
fn an_attempt_that_ends_while_evicted_ends_preempted_and_its_claim_is_ready() {
    let (mut book, _) = one_gpu_one_victim(600.0);
    assert!(!book.grace_over(&0, 1, 629.0));
    assert!(book.grace_over(&0, 1, 630.0));
    assert!(!book.grace_over(&0, 2, 630.0));
    assert!(book.take_ready_claims().is_empty());
    let eviction = book.take_eviction(&0, 1).expect("it was being evicted");
    assert_eq!(eviction.urgent, 1);
    assert_eq!(book.take_eviction(&0, 1), None);
    let ready = book.take_ready_claims();
    assert_eq!(ready.len(), 1);
    let (urgent, claim) = &ready[0];
    assert_eq!(*urgent, 1);
    assert_eq!((claim.gpu_id.as_str(), claim.slice_bytes), ("g0", 40 * GIB));
    assert!(claim.fits(&[gpu("g0", 80, 0)]));
    assert!(!claim.fits(&[gpu("g0", 80, 41)]));
    let mut draining = gpu("g0", 80, 0);
    draining.schedulable = false;
    assert!(!claim.fits(&[draining]));
    assert!(book.claimed_jobs().is_empty());
}

#[test]
fn another_attempts_end_is_not_a_preemption_and_forgets_the_stale_eviction() {
    let (mut book, _) = one_gpu_one_victim(600.0);
    assert_eq!(book.take_eviction(&0, 2), None);
    assert_eq!(book.eviction(&0), None);
    // Its claim still waits for it, until the victim is known gone.
    assert!(book.take_ready_claims().is_empty());
    book.forget_lost_victims(|_, _| true);
    assert_eq!(book.take_ready_claims().len(), 1);
}

#[test]
fn a_victim_lost_without_a_report_is_gone_from_its_claim() {
    let (mut book, _) = one_gpu_one_victim(600.0);
    book.forget_lost_victims(|job, attempt| (*job, attempt) == (0, 1));
    assert!(book.take_ready_claims().is_empty());
    book.forget_lost_victims(|_, _| false);
    assert_eq!(book.eviction(&0), None);
    assert_eq!(book.take_ready_claims().len(), 1);
}

#[test]
fn a_claim_lapses_when_its_job_is_placed_or_leaves_the_queue() {
    let (mut book, _) = one_gpu_one_victim(600.0);
    book.retain_claims(|job| *job != 7);
    assert!(book.is_claimed(&1));
    book.retain_claims(|job| *job != 1);
    assert!(!book.is_claimed(&1));
    let (mut book, _) = one_gpu_one_victim(600.0);
    assert!(book.drop_claim(&1).is_some());
    // The victim still stops, and its end is still a preemption.
    assert!(book.take_eviction(&0, 1).is_some());
    assert!(book.take_ready_claims().is_empty());
}

#[test]
fn fair_share_counts_schedulable_gpus_and_tenants_with_work() {
    let tenant = |name: &str, in_use: u64| TenantState {
        tenant: name.to_string(),
        weight: 2,
        vram_quota_bytes: None,
        running_jobs_quota: None,
        vram_in_use_bytes: in_use,
        running_jobs: 0,
        decayed_usage_byte_seconds: 0,
    };
    let mut draining = gpu("g1", 40, 0);
    draining.schedulable = false;
    let tenants = [
        tenant("idle", 0),
        tenant("queued", 0),
        tenant("running", GIB),
    ];
    let state = fair_share_state(
        &[gpu("g0", 80, 10), draining],
        tenants
            .iter()
            .map(|tenant| (tenant, tenant.tenant == "queued")),
    );
    assert_eq!(state.usable_bytes, 80 * GIB);
    let names: Vec<&str> = state
        .tenants
        .iter()
        .map(|share| share.tenant.as_str())
        .collect();
    assert_eq!(names, ["queued", "running"]);
}

#[test]
fn the_clocks_count_whole_seconds() {
    assert_eq!(10.9_f64.whole_seconds_since(0.5), 10);
    assert_eq!(0.5_f64.whole_seconds_since(10.0), 0);
    assert_eq!(Millis(10_999).whole_seconds_since(Millis(1_000)), 9);
    assert_eq!(Millis(0).whole_seconds_since(Millis(5_000)), 0);
    assert_eq!(Millis(1_000).plus_seconds(7.5), Millis(8_500));
    assert!(within_hour(3599.9_f64, 0.0));
    assert!(!within_hour(3600.0_f64, 0.0));
    assert!(!within_hour(Millis(3_600_000), Millis(0)));
}

/// The scheduler's book (job ids, milliseconds) and the simulator's (job indexes,
/// seconds) decide the same for the same cluster: whom to evict, for whom, when the
/// grace ends, what the messages say, and when a young attempt becomes evictable.
#[test]
fn the_schedulers_and_the_simulators_books_decide_alike() {
    let gpus = [gpu("g0", 80, 70), gpu("g1", 80, 75), gpu("g2", 40, 30)];
    // (job, gpu, priority, slice GiB, started at s)
    let running = [
        (0, 0, 0, 30, 0),
        (1, 0, 5, 40, 100),
        (2, 1, 0, 75, 50),
        (3, 2, 0, 30, 590),
    ];
    // (job, priority, slice GiB, submit sequence)
    let waiting = [
        (4, 10, 20, 4),
        (5, 10, 60, 5),
        (6, 1, 35, 6),
        (7, 10, 15, 7),
    ];
    let simulated: PassOutcome<usize, f64> = {
        let mut book = PreemptionBook::default();
        book.preempt(PassInput {
            now: 600.0,
            settings: settings(),
            gpus: &gpus,
            running: running
                .iter()
                .map(|&(job, gpu, priority, slice, started)| {
                    occupant(job, gpu, priority, slice, f64::from(started))
                })
                .collect(),
            waiting: waiting
                .iter()
                .map(|&(job, priority, slice, sequence)| WaitingJob {
                    submit_sequence: sequence,
                    ..self::waiting(job, priority, slice)
                })
                .collect(),
            fair_share: FairShareState::default(),
        })
    };
    // The scheduler's job ids are text; these name the same jobs as the indexes.
    let name = |job: usize| job.to_string();
    let epoch = 1_700_000_000_000;
    let at = |seconds: f64| Millis(epoch + (seconds * 1000.0).round() as i64);
    let live: PassOutcome<String, Millis> = {
        let mut book = PreemptionBook::default();
        book.preempt(PassInput {
            now: at(600.0),
            settings: settings(),
            gpus: &gpus,
            running: running
                .iter()
                .map(|&(job, gpu, priority, slice, started)| Occupant {
                    job: name(job),
                    attempt_number: 1,
                    gpu,
                    tenant: "batch".to_string(),
                    priority,
                    slice_bytes: slice * GIB,
                    started_at: at(f64::from(started)),
                })
                .collect(),
            waiting: waiting
                .iter()
                .map(|&(job, priority, slice, sequence)| WaitingJob {
                    job: name(job),
                    tenant: "oncall".to_string(),
                    priority,
                    submit_sequence: sequence,
                    slice_bytes: slice * GIB,
                })
                .collect(),
            fair_share: FairShareState::default(),
        })
    };
    assert!(!simulated.preemptions.is_empty());
    assert_eq!(simulated.preemptions.len(), live.preemptions.len());
    for (simulated, live) in simulated.preemptions.iter().zip(&live.preemptions) {
        assert_eq!(name(simulated.urgent), live.urgent);
        assert_eq!(simulated.gpu_id, live.gpu_id);
        assert_eq!(simulated.reason, live.reason);
        assert_eq!(simulated.victims.len(), live.victims.len());
        for (simulated, live) in simulated.victims.iter().zip(&live.victims) {
            assert_eq!(name(simulated.job), live.job);
            assert_eq!(simulated.ground, live.ground);
            assert_eq!(at(simulated.grace_ends_at), live.grace_ends_at);
            assert_eq!(simulated.message, live.message);
        }
    }
    assert_eq!(simulated.retry_at.map(at), live.retry_at);
}

#[test]
fn a_restored_book_decides_as_the_one_it_was_kept_from() {
    let (book, outcome) = one_gpu_one_victim(1000.0);
    assert_eq!(outcome.preemptions.len(), 1);
    let restored = PreemptionBook::restore(
        book.claims().map(|(job, claim)| {
            let mut claim = claim.clone();
            // What a store keeps of a claim: its victims are the evictions naming it.
            claim.victims.clear();
            (*job, claim)
        }),
        book.evictions()
            .map(|(job, eviction)| (*job, eviction.clone())),
        [(0, 1000.0)],
    );
    assert_eq!(restored, book);

    // The victim's end is a preemption, its claim is then ready, and no second victim is
    // chosen for the claimed job while it waits.
    let mut restored = restored;
    let gpus = [gpu("g0", 80, 60)];
    let again = restored.preempt(pass(
        1001.0,
        &gpus,
        vec![occupant(0, 0, 0, 60, 0.0)],
        vec![waiting(1, 10, 40)],
    ));
    assert!(again.preemptions.is_empty(), "{again:?}");
    assert!(restored.take_eviction(&0, 1).is_some());
    let ready = restored.take_ready_claims();
    assert_eq!(ready.len(), 1);
    assert_eq!(ready[0].0, 1);
}

#[test]
fn a_restored_eviction_without_its_claim_still_ends_preempted() {
    let (book, _) = one_gpu_one_victim(1000.0);
    let mut restored: PreemptionBook<usize, f64> = PreemptionBook::restore(
        [],
        book.evictions()
            .map(|(job, eviction)| (*job, eviction.clone())),
        [],
    );
    assert!(restored.claims().next().is_none());
    assert_eq!(restored.preemptions_in_last_hour(&0, 1000.0), 0);
    assert!(restored.take_eviction(&0, 1).is_some());
}
