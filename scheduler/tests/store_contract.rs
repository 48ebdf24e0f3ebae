//! The store's contract: every test here runs against SQLite (a temp file) and against
//! PostgreSQL (a database of its own on a server this binary starts; see
//! `support/mod.rs`), as `sqlite::NAME` and `postgres::NAME`.

#[macro_use]
mod support;

use std::collections::{BTreeSet, HashMap, HashSet};

use carve_core::allocator::OutOfMemory;
use carve_core::workload::{JobKind, Workload};
use carve_proto::ApiError;
use carve_scheduler::convert::{attempt_to_proto, job_to_proto};
use carve_scheduler::error::SchedulerError;
use carve_scheduler::store::{
    AttemptDetails, AttemptEnd, AttemptOutcome, AttemptRecord, AttemptResults, Backend, JobFilter,
    JobRecord, JobState, LogBatcher, LogBatcherSettings, LogLineRecord, LogPage, LogQuery,
    MAX_LOG_LINES_PER_JOB, MAX_LOG_MESSAGE_BYTES, NewLogLine, Role, Store, SubmitBatcher,
    TenantRecord, TokenRecord, WORKLOAD_COLUMN, WorkerRecord, WorkerState, workload_from_json,
    workload_to_json,
};
use support::{T0, TestDb, attempt, finish_plainly, job, open_with_acme, tenant};

on_both_databases!(
    durability_settings_are_safe,
    tenants_crud,
    tokens_are_found_by_hash_and_revoked,
    submit_group_commit_assigns_increasing_sequences,
    a_failing_group_commits_nothing,
    idempotency_keys_within_a_group_and_across_groups,
    concurrent_submits_through_the_batcher_share_commits,
    batcher_answers_each_job_of_a_failing_group_on_its_own,
    list_jobs_filters_and_pages,
    list_jobs_pages_are_stable_while_jobs_arrive,
    update_job_rewrites_all_but_the_identity,
    jobs_in_states_are_oldest_first,
    count_jobs_counts_one_tenants_jobs_in_one_state,
    attempts_are_listed_by_number,
    an_attempt_ends_once_while_it_runs,
    record_job_and_attempt_is_atomic,
    job_reads_show_the_stored_estimate_without_validating_the_spec,
    a_jobs_validated_workload_is_stored_with_it_and_read_back_as_validated,
    checkpoint_steps_are_stored_with_jobs_and_attempts,
    workers_upsert_and_state,
    peak_correction_is_the_largest_ratio,
    data_survives_reopening,
    log_lines_get_per_job_sequences_and_read_in_pages,
    log_lines_filter_by_attempt_and_tail,
    log_lines_are_trimmed_to_the_newest_per_job,
    appending_log_lines_is_all_or_nothing,
    the_log_batcher_writes_groups_and_flush_makes_them_readable,
);

/// Checks `answer` is the not-found error for the `what` named `id`.
#[track_caller]
fn assert_not_found<T: std::fmt::Debug + PartialEq>(
    answer: Result<T, SchedulerError>,
    what: &'static str,
    id: &str,
) {
    assert_eq!(answer, Err(SchedulerError::not_found(what, id)));
}

fn keyed(mut job: JobRecord, key: &str) -> JobRecord {
    job.idempotency_key = Some(key.to_string());
    job
}

fn worker(id: &str, hostname: &str) -> WorkerRecord {
    WorkerRecord {
        id: id.to_string(),
        hostname: hostname.to_string(),
        gpus_json: r#"[{"uuid":"GPU-0","total_bytes":17179869184}]"#.to_string(),
        state: WorkerState::Ready,
        last_heartbeat_ms: T0,
        registered_at_ms: T0,
        version: "0.1.0".to_string(),
        token_id: "token-node".to_string(),
        drain_reason: String::new(),
    }
}

/// Every job the filter matches, page by page, checking each page on the way.
async fn all_pages(store: &Store, filter: &JobFilter) -> (Vec<JobRecord>, usize) {
    let mut filter = filter.clone();
    let mut jobs = Vec::new();
    let mut pages = 0;
    loop {
        let (page, next) = store.list_jobs(&filter).await.unwrap();
        pages += 1;
        assert!(pages < 1000, "paging does not end");
        assert!(
            page.len() <= filter.page_size as usize,
            "a page of {} jobs for page size {}",
            page.len(),
            filter.page_size
        );
        jobs.extend(page);
        match next {
            Some(token) => {
                assert!(!token.is_empty());
                filter.page_token = Some(token);
            }
            None => break,
        }
    }
    (jobs, pages)
}

async fn durability_settings_are_safe(db: &TestDb) {
    let store = db.open().await;
    let settings: HashMap<String, String> = store
        .durability_settings()
        .await
        .unwrap()
        .into_iter()
        .collect();
    let expected: &[(&str, &str)] = match db.backend() {
        Backend::Sqlite => &[
            ("journal_mode", "wal"),
            ("synchronous", "full"),
            ("foreign_keys", "on"),
        ],
        Backend::Postgres => &[("fsync", "on"), ("synchronous_commit", "on")],
    };
    for (name, value) in expected {
        assert_eq!(
            settings.get(*name).map(String::as_str),
            Some(*value),
            "{name} in {settings:?}"
        );
    }
    if db.backend() == Backend::Sqlite {
        let busy_timeout: i64 = settings["busy_timeout_ms"].parse().unwrap();
        assert!(busy_timeout >= 1000, "busy timeout {busy_timeout} ms");
    }
}

async fn tenants_crud(db: &TestDb) {
    let store = db.open().await;
    assert_eq!(store.list_tenants().await.unwrap(), vec![]);

    let acme = TenantRecord {
        name: "acme".into(),
        vram_quota_bytes: Some(32 << 30),
        max_running_jobs: Some(4),
        fair_share_weight: 2,
        created_at_ms: T0,
    };
    let zeta = tenant("zeta");
    let beta = TenantRecord {
        created_at_ms: T0 + 5,
        ..tenant("beta")
    };
    for tenant in [&zeta, &acme, &beta] {
        store.create_tenant(tenant).await.unwrap();
    }
    assert_eq!(store.get_tenant("acme").await.unwrap(), acme);
    assert_eq!(store.get_tenant("beta").await.unwrap(), beta);
    assert_eq!(
        store.list_tenants().await.unwrap(),
        vec![acme.clone(), beta.clone(), zeta.clone()],
        "by name"
    );

    let again = TenantRecord {
        fair_share_weight: 9,
        ..acme.clone()
    };
    assert_eq!(
        store.create_tenant(&again).await,
        Err(SchedulerError::already_exists("tenant", "acme"))
    );
    assert_eq!(store.get_tenant("acme").await.unwrap(), acme, "unchanged");
    assert_not_found(store.get_tenant("nope").await, "tenant", "nope");

    let updated = store.set_quota("acme", None, Some(8), 3).await.unwrap();
    let expected = TenantRecord {
        vram_quota_bytes: None,
        max_running_jobs: Some(8),
        fair_share_weight: 3,
        ..acme.clone()
    };
    assert_eq!(updated, expected);
    assert_eq!(store.get_tenant("acme").await.unwrap(), expected);
    assert_eq!(
        store.get_tenant("zeta").await.unwrap(),
        zeta,
        "others untouched"
    );
    assert_not_found(
        store.set_quota("nope", Some(1), None, 1).await,
        "tenant",
        "nope",
    );
}

async fn tokens_are_found_by_hash_and_revoked(db: &TestDb) {
    let store = db.open().await;
    let alice = TokenRecord {
        id: "tok-alice".into(),
        tenant: "acme".into(),
        role: Role::User,
        secret_hash: vec![1, 2, 3, 4, 0, 255],
        description: "alice's laptop".into(),
        created_at_ms: T0,
        expires_at_ms: Some(T0 + 86_400_000),
        revoked: false,
        revoked_at_ms: None,
        last_used_at_ms: None,
    };
    let bob = TokenRecord {
        id: "tok-bob".into(),
        secret_hash: vec![9, 9, 9],
        description: "bob".into(),
        created_at_ms: T0 + 10,
        expires_at_ms: None,
        ..alice.clone()
    };
    let admin = TokenRecord {
        id: "tok-admin".into(),
        tenant: String::new(),
        role: Role::Admin,
        secret_hash: vec![7; 32],
        description: "operator".into(),
        created_at_ms: T0 + 20,
        expires_at_ms: None,
        revoked: false,
        revoked_at_ms: None,
        last_used_at_ms: None,
    };
    for token in [&alice, &bob, &admin] {
        store.create_token(token).await.unwrap();
    }

    assert_eq!(
        store
            .find_token_by_hash(&[1, 2, 3, 4, 0, 255])
            .await
            .unwrap(),
        Some(alice.clone())
    );
    assert_eq!(
        store.find_token_by_hash(&[7; 32]).await.unwrap(),
        Some(admin.clone())
    );
    assert_eq!(store.find_token_by_hash(&[1, 2, 3]).await.unwrap(), None);

    assert_eq!(
        store.list_tokens(Some("acme")).await.unwrap(),
        vec![bob.clone(), alice.clone()],
        "newest first"
    );
    assert_eq!(
        store.list_tokens(None).await.unwrap(),
        vec![admin.clone(), bob.clone(), alice.clone()]
    );
    assert_eq!(store.list_tokens(Some("beta")).await.unwrap(), vec![]);

    let duplicate_id = TokenRecord {
        secret_hash: vec![5, 5],
        ..alice.clone()
    };
    assert_eq!(
        store.create_token(&duplicate_id).await,
        Err(SchedulerError::already_exists("token", "tok-alice"))
    );
    let duplicate_hash = TokenRecord {
        id: "tok-other".into(),
        ..bob.clone()
    };
    assert_eq!(
        store.create_token(&duplicate_hash).await,
        Err(SchedulerError::already_exists("token", "tok-other"))
    );

    // A use is recorded, and never moves back in time.
    store.record_token_use("tok-alice", T0 + 500).await.unwrap();
    store.record_token_use("tok-alice", T0 + 400).await.unwrap();
    store.record_token_use("tok-nope", T0 + 500).await.unwrap();
    let alice = TokenRecord {
        last_used_at_ms: Some(T0 + 500),
        ..alice
    };
    assert_eq!(
        store.get_token("tok-alice").await.unwrap(),
        alice,
        "the latest use is kept"
    );

    let revoked = store.revoke_token("tok-alice", T0 + 1000).await.unwrap();
    let expected = TokenRecord {
        revoked: true,
        revoked_at_ms: Some(T0 + 1000),
        ..alice.clone()
    };
    assert_eq!(revoked, expected);
    assert_eq!(
        store.find_token_by_hash(&alice.secret_hash).await.unwrap(),
        Some(expected.clone()),
        "a revoked token is still found, marked revoked"
    );
    assert_eq!(
        store.revoke_token("tok-alice", T0 + 2000).await.unwrap(),
        expected,
        "revoking twice changes nothing, not even the time"
    );
    assert_eq!(
        store.find_token_by_hash(&bob.secret_hash).await.unwrap(),
        Some(bob.clone()),
        "other tokens stay valid"
    );
    assert_not_found(
        store.revoke_token("tok-nope", T0).await,
        "token",
        "tok-nope",
    );
}

async fn submit_group_commit_assigns_increasing_sequences(db: &TestDb) {
    let store = open_with_acme(db).await;
    assert_eq!(store.submit_jobs(Vec::new()).await.unwrap(), vec![]);

    let first: Vec<JobRecord> = (0..5)
        .map(|i| JobRecord {
            // Whatever the caller puts here is replaced.
            submit_sequence: 999 - i,
            ..job(&format!("j-{i}"), "acme", &format!("train-{i}"))
        })
        .collect();
    let outcomes = store.submit_jobs(first.clone()).await.unwrap();
    assert_eq!(outcomes.len(), 5);
    for (outcome, submitted) in outcomes.iter().zip(&first) {
        assert!(outcome.created);
        assert_eq!(outcome.job.id, submitted.id, "answers in submit order");
        assert_eq!(
            JobRecord {
                submit_sequence: submitted.submit_sequence,
                ..outcome.job.clone()
            },
            *submitted,
            "stored as given, but for the sequence"
        );
        assert_eq!(store.get_job(&outcome.job.id).await.unwrap(), outcome.job);
    }
    let sequences: Vec<i64> = outcomes.iter().map(|o| o.job.submit_sequence).collect();
    assert!(
        sequences.windows(2).all(|pair| pair[0] < pair[1]),
        "increasing within the group: {sequences:?}"
    );
    assert!(sequences[0] > 0);

    let second = store
        .submit_jobs(vec![job("j-5", "acme", "a"), job("j-6", "acme", "b")])
        .await
        .unwrap();
    let later: Vec<i64> = second.iter().map(|o| o.job.submit_sequence).collect();
    assert!(
        later[0] > sequences[4] && later[1] > later[0],
        "a later group gets later numbers: {sequences:?} then {later:?}"
    );
    assert_not_found(store.get_job("nope").await, "job", "nope");
}

async fn a_failing_group_commits_nothing(db: &TestDb) {
    let store = open_with_acme(db).await;
    store
        .submit_jobs(vec![job("taken", "acme", "x")])
        .await
        .unwrap();

    let unknown_tenant = store
        .submit_jobs(vec![
            job("g1-a", "acme", "x"),
            job("g1-b", "ghost", "x"),
            job("g1-c", "acme", "x"),
        ])
        .await;
    assert_not_found(unknown_tenant, "tenant", "ghost");
    let taken_id = store
        .submit_jobs(vec![
            keyed(job("g2-a", "acme", "x"), "k"),
            job("taken", "acme", "y"),
        ])
        .await;
    assert_eq!(
        taken_id,
        Err(SchedulerError::already_exists("job", "taken"))
    );
    for id in ["g1-a", "g1-b", "g1-c", "g2-a"] {
        assert_eq!(
            store.get_job(id).await,
            Err(SchedulerError::not_found("job", id)),
            "{id} must not be stored: its group failed"
        );
    }
    assert_eq!(store.get_job("taken").await.unwrap().name, "x");
    // The key of the rolled-back job is free again.
    let outcome = store
        .submit_jobs(vec![keyed(job("g4-a", "acme", "x"), "k")])
        .await
        .unwrap();
    assert!(outcome[0].created);
}

async fn idempotency_keys_within_a_group_and_across_groups(db: &TestDb) {
    let store = open_with_acme(db).await;
    store.create_tenant(&tenant("beta")).await.unwrap();

    let outcomes = store
        .submit_jobs(vec![
            keyed(job("a", "acme", "first"), "k1"),
            keyed(job("b", "acme", "second"), "k1"),
            job("c", "acme", "unkeyed"),
            keyed(job("d", "beta", "other tenant"), "k1"),
            keyed(job("e", "acme", "k2"), "k2"),
            keyed(job("f", "acme", "third"), "k1"),
        ])
        .await
        .unwrap();
    let summary: Vec<(&str, bool)> = outcomes
        .iter()
        .map(|o| (o.job.id.as_str(), o.created))
        .collect();
    assert_eq!(
        summary,
        vec![
            ("a", true),
            ("a", false),
            ("c", true),
            ("d", true),
            ("e", true),
            ("a", false),
        ]
    );
    assert_eq!(outcomes[1].job, outcomes[0].job, "the job the key created");
    assert_eq!(outcomes[1].job.name, "first");
    for id in ["b", "f"] {
        assert_eq!(
            store.get_job(id).await,
            Err(SchedulerError::not_found("job", id))
        );
    }

    let stored_a = store.get_job("a").await.unwrap();
    let later = store
        .submit_jobs(vec![
            keyed(job("g", "acme", "retry"), "k1"),
            keyed(job("h", "acme", "empty key"), ""),
            keyed(job("i", "acme", "empty key too"), ""),
            keyed(job("j", "beta", "retry"), "k1"),
        ])
        .await
        .unwrap();
    assert!(!later[0].created);
    assert_eq!(
        later[0].job, stored_a,
        "the stored job, same id and sequence"
    );
    assert!(
        later[1].created && later[2].created,
        "an empty key is no key"
    );
    assert_eq!(later[1].job.idempotency_key, None);
    assert!(!later[3].created);
    assert_eq!(later[3].job.id, "d");

    let (all, _) = store
        .list_jobs(&JobFilter {
            page_size: 100,
            ..JobFilter::default()
        })
        .await
        .unwrap();
    let mut ids: Vec<&str> = all.iter().map(|job| job.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, vec!["a", "c", "d", "e", "h", "i"], "never a duplicate");
    let sequences: HashSet<i64> = all.iter().map(|job| job.submit_sequence).collect();
    assert_eq!(sequences.len(), all.len(), "sequences are unique");
}

async fn concurrent_submits_through_the_batcher_share_commits(db: &TestDb) {
    let store = open_with_acme(db).await;
    let batcher = SubmitBatcher::spawn(store.clone());

    const SUBMITS: usize = 200;
    let mut tasks = Vec::new();
    for i in 0..SUBMITS {
        let batcher = batcher.clone();
        // 20 of them share two idempotency keys; the rest are distinct jobs.
        let mut submitted = job(&format!("job-{i:03}"), "acme", &format!("n-{i}"));
        if i % 10 == 0 {
            submitted.idempotency_key = Some(format!("shared-{}", i % 20));
        } else if i % 3 == 0 {
            submitted.idempotency_key = Some(format!("own-{i}"));
        }
        let workload_json = Some(format!("workload of {}", submitted.id));
        tasks.push(tokio::spawn(async move {
            (
                submitted.clone(),
                batcher.submit(submitted, workload_json).await,
            )
        }));
    }
    let mut answers = Vec::new();
    for task in tasks {
        let (submitted, answer) = task.await.unwrap();
        answers.push((submitted, answer.expect("every submit is acknowledged")));
    }

    // Read back through a new pool: an acknowledged submit is committed.
    let reader = db.open().await;
    let mut created_sequences = BTreeSet::new();
    let mut by_shared_key: HashMap<String, BTreeSet<String>> = HashMap::new();
    for (submitted, outcome) in &answers {
        let stored = reader.get_job(&outcome.job.id).await.unwrap();
        assert_eq!(stored, outcome.job);
        // Each created job is stored with the workload its own submit carried.
        if outcome.created {
            assert_eq!(
                reader.job_workload_json(&outcome.job.id).await.unwrap(),
                Some(format!("workload of {}", outcome.job.id)),
            );
        }
        match submitted.idempotency_key.as_deref() {
            Some(key) if key.starts_with("shared-") => {
                by_shared_key
                    .entry(key.to_string())
                    .or_default()
                    .insert(outcome.job.id.clone());
            }
            _ => {
                assert!(outcome.created, "{} has its own key", submitted.id);
                assert_eq!(outcome.job.id, submitted.id);
            }
        }
        if outcome.created {
            assert!(
                created_sequences.insert(outcome.job.submit_sequence),
                "sequence {} handed out twice",
                outcome.job.submit_sequence
            );
        }
    }
    assert_eq!(by_shared_key.len(), 2);
    for (key, ids) in &by_shared_key {
        assert_eq!(ids.len(), 1, "{key} made one job: {ids:?}");
    }
    let created = answers
        .iter()
        .filter(|(_, outcome)| outcome.created)
        .count();
    assert_eq!(created, SUBMITS - 20 + 2);
    let (listed, _) = all_pages(
        &reader,
        &JobFilter {
            tenant: Some("acme".into()),
            page_size: 1000,
            ..JobFilter::default()
        },
    )
    .await;
    assert_eq!(listed.len(), created, "nothing more is stored");

    assert_eq!(batcher.jobs_committed(), SUBMITS as u64);
    let groups = batcher.groups_committed();
    assert!(
        (1..SUBMITS as u64).contains(&groups),
        "{SUBMITS} concurrent submits took {groups} commits: they must share commits"
    );
}

async fn batcher_answers_each_job_of_a_failing_group_on_its_own(db: &TestDb) {
    let store = open_with_acme(db).await;
    let batcher = SubmitBatcher::spawn(store.clone());
    let mut tasks = Vec::new();
    for i in 0..40 {
        let batcher = batcher.clone();
        let tenant = if i == 7 { "ghost" } else { "acme" };
        let submitted = job(&format!("b-{i:02}"), tenant, "x");
        tasks.push(tokio::spawn(async move {
            batcher.submit(submitted, None).await
        }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let answer = task.await.unwrap();
        if i == 7 {
            assert_eq!(answer, Err(SchedulerError::not_found("tenant", "ghost")));
        } else {
            let outcome = answer.unwrap_or_else(|error| panic!("b-{i:02}: {error}"));
            assert!(outcome.created);
            assert_eq!(store.get_job(&outcome.job.id).await.unwrap(), outcome.job);
        }
    }
}

async fn list_jobs_filters_and_pages(db: &TestDb) {
    let store = open_with_acme(db).await;
    store.create_tenant(&tenant("beta")).await.unwrap();
    let states = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
    ];
    let mut submitted = Vec::new();
    for i in 0..30 {
        let tenant = if i % 3 == 0 { "beta" } else { "acme" };
        let name = match i {
            28 => "tr%n-wild".to_string(),
            29 => "TRAIN-upper".to_string(),
            i if i % 2 == 0 => format!("train-{i}"),
            i => format!("eval-{i}"),
        };
        submitted.push(JobRecord {
            state: states[i % states.len()],
            ..job(&format!("j-{i:02}"), tenant, &name)
        });
    }
    // Several groups, so sequences come from several commits.
    let mut all = Vec::new();
    for group in submitted.chunks(7) {
        for outcome in store.submit_jobs(group.to_vec()).await.unwrap() {
            all.push(outcome.job);
        }
    }
    all.sort_by_key(|job| std::cmp::Reverse(job.submit_sequence));

    // Lists with `filter` at several page sizes; expects the jobs `matches` picks of `all`.
    let check = |filter: JobFilter, matches: fn(&JobRecord) -> bool| {
        let store = store.clone();
        let expected: Vec<JobRecord> = all.iter().filter(|job| matches(job)).cloned().collect();
        async move {
            for page_size in [1, 4, 7, 10, 1000] {
                let filter = JobFilter {
                    page_size,
                    ..filter.clone()
                };
                let (jobs, pages) = all_pages(&store, &filter).await;
                assert_eq!(
                    jobs.iter().map(|job| &job.id).collect::<Vec<_>>(),
                    expected.iter().map(|job| &job.id).collect::<Vec<_>>(),
                    "every matching job exactly once, newest first, for {filter:?}"
                );
                assert_eq!(jobs, expected);
                let full_pages = expected.len().div_ceil(page_size as usize).max(1);
                assert_eq!(pages, full_pages, "no empty trailing page for {filter:?}");
            }
        }
    };

    let of_tenant = |tenant: &str| JobFilter {
        tenant: Some(tenant.into()),
        ..JobFilter::default()
    };
    let named = |prefix: &str| JobFilter {
        name_prefix: Some(prefix.into()),
        ..JobFilter::default()
    };
    check(JobFilter::default(), |_| true).await;
    check(of_tenant("acme"), |j| j.tenant == "acme").await;
    check(of_tenant("nobody"), |_| false).await;
    check(
        JobFilter {
            states: vec![JobState::Queued, JobState::Failed],
            ..JobFilter::default()
        },
        |j| j.state == JobState::Queued || j.state == JobState::Failed,
    )
    .await;
    check(named("train-"), |j| j.name.starts_with("train-")).await;
    // No LIKE wildcards, and case matters.
    check(named("tr%"), |j| j.name == "tr%n-wild").await;
    check(named("TRAIN"), |j| j.name == "TRAIN-upper").await;
    check(
        JobFilter {
            tenant: Some("acme".into()),
            states: vec![JobState::Queued, JobState::Succeeded],
            name_prefix: Some("train".into()),
            ..JobFilter::default()
        },
        |j| {
            j.tenant == "acme"
                && (j.state == JobState::Queued || j.state == JobState::Succeeded)
                && j.name.starts_with("train")
        },
    )
    .await;

    let (default_page, next) = store.list_jobs(&JobFilter::default()).await.unwrap();
    assert_eq!(
        default_page.len(),
        30,
        "page size 0 means the default (100)"
    );
    assert_eq!(next, None);

    let bad_token = store
        .list_jobs(&JobFilter {
            page_token: Some("not-a-token".into()),
            ..JobFilter::default()
        })
        .await;
    assert!(
        matches!(&bad_token, Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "page_token"),
        "{bad_token:?}"
    );
}

async fn list_jobs_pages_are_stable_while_jobs_arrive(db: &TestDb) {
    let store = open_with_acme(db).await;
    for i in 0..10 {
        store
            .submit_jobs(vec![job(&format!("old-{i}"), "acme", "x")])
            .await
            .unwrap();
    }
    let filter = JobFilter {
        page_size: 4,
        ..JobFilter::default()
    };
    let (first, token) = store.list_jobs(&filter).await.unwrap();
    // New jobs arrive between pages: they are newer than every page already handed out.
    store
        .submit_jobs(vec![job("new-0", "acme", "x"), job("new-1", "acme", "x")])
        .await
        .unwrap();
    let (rest, pages) = all_pages(
        &store,
        &JobFilter {
            page_token: token,
            ..filter.clone()
        },
    )
    .await;
    assert_eq!(pages, 2);
    let ids: Vec<&str> = first.iter().chain(&rest).map(|j| j.id.as_str()).collect();
    let expected: Vec<String> = (0..10).rev().map(|i| format!("old-{i}")).collect();
    assert_eq!(ids, expected);
}

async fn update_job_rewrites_all_but_the_identity(db: &TestDb) {
    let store = open_with_acme(db).await;
    store.create_tenant(&tenant("beta")).await.unwrap();
    let outcomes = store
        .submit_jobs(vec![
            keyed(job("j-1", "acme", "one"), "key-1"),
            job("j-2", "acme", "two"),
        ])
        .await
        .unwrap();
    let stored = outcomes[0].job.clone();

    let changed = JobRecord {
        name: "one-renamed".into(),
        spec_json: r#"{"name":"one-renamed"}"#.into(),
        state: JobState::Failed,
        priority: 7,
        config_json: r#"{"batch_size":32,"micro_batch_size":8}"#.into(),
        estimate_json: r#"{"required_bytes":524288}"#.into(),
        required_bytes: 524_288,
        waiting_reason: "no gpu has 512 KiB free".into(),
        message: "out of memory with no retry left".into(),
        finished_at_ms: Some(T0 + 1000),
        checkpoint_location: Some("/ckpt/j-1/step-40".into()),
        checkpoint_step: 40,
        attempts_count: 3,
        ..stored.clone()
    };
    store.update_job(&changed).await.unwrap();
    assert_eq!(store.get_job("j-1").await.unwrap(), changed);

    // The identity never changes, whatever the record says.
    let identity_changed = JobRecord {
        tenant: "beta".into(),
        submit_sequence: stored.submit_sequence + 100,
        idempotency_key: Some("other".into()),
        created_at_ms: 1,
        message: "again".into(),
        finished_at_ms: None,
        checkpoint_location: None,
        ..changed.clone()
    };
    store.update_job(&identity_changed).await.unwrap();
    let after = store.get_job("j-1").await.unwrap();
    assert_eq!(
        after,
        JobRecord {
            message: "again".into(),
            finished_at_ms: None,
            checkpoint_location: None,
            ..changed.clone()
        }
    );
    assert_eq!(
        store.get_job("j-2").await.unwrap(),
        outcomes[1].job,
        "untouched"
    );

    assert_not_found(
        store.update_job(&job("j-nope", "acme", "x")).await,
        "job",
        "j-nope",
    );
    assert_eq!(store.get_job("j-1").await.unwrap().state, JobState::Failed);
}

async fn jobs_in_states_are_oldest_first(db: &TestDb) {
    let store = open_with_acme(db).await;
    let mut ids = Vec::new();
    for (i, state) in [
        JobState::Queued,
        JobState::Running,
        JobState::Queued,
        JobState::Succeeded,
        JobState::Placed,
    ]
    .into_iter()
    .enumerate()
    {
        let outcome = store
            .submit_jobs(vec![JobRecord {
                state,
                ..job(&format!("j-{i}"), "acme", "x")
            }])
            .await
            .unwrap();
        ids.push(outcome[0].job.id.clone());
    }
    let ids_of = |jobs: Vec<JobRecord>| jobs.into_iter().map(|j| j.id).collect::<Vec<_>>();
    assert_eq!(
        ids_of(store.jobs_in_states(&[JobState::Queued]).await.unwrap()),
        vec!["j-0", "j-2"]
    );
    assert_eq!(
        ids_of(
            store
                .jobs_in_states(&[JobState::Running, JobState::Placed, JobState::Queued])
                .await
                .unwrap()
        ),
        vec!["j-0", "j-1", "j-2", "j-4"]
    );
    assert_eq!(store.jobs_in_states(&[]).await.unwrap(), vec![]);
    assert_eq!(
        store.jobs_in_states(&[JobState::Cancelled]).await.unwrap(),
        vec![]
    );
}

async fn count_jobs_counts_one_tenants_jobs_in_one_state(db: &TestDb) {
    let store = open_with_acme(db).await;
    store.create_tenant(&tenant("globex")).await.unwrap();
    assert_eq!(store.count_jobs("acme", JobState::Queued).await.unwrap(), 0);
    // More than a listing's largest page, so a count that pages would come up short.
    let queued: Vec<JobRecord> = (0..1_005)
        .map(|i| job(&format!("q-{i}"), "acme", "x"))
        .collect();
    store.submit_jobs(queued).await.unwrap();
    let mut others = Vec::new();
    for (i, (tenant_name, state)) in [
        ("acme", JobState::Running),
        ("acme", JobState::Succeeded),
        ("globex", JobState::Queued),
        ("globex", JobState::Queued),
    ]
    .into_iter()
    .enumerate()
    {
        others.push(JobRecord {
            state,
            ..job(&format!("o-{i}"), tenant_name, "x")
        });
    }
    store.submit_jobs(others).await.unwrap();
    assert_eq!(
        store.count_jobs("acme", JobState::Queued).await.unwrap(),
        1_005
    );
    assert_eq!(
        store.count_jobs("acme", JobState::Running).await.unwrap(),
        1
    );
    assert_eq!(
        store.count_jobs("acme", JobState::Cancelled).await.unwrap(),
        0
    );
    assert_eq!(
        store.count_jobs("globex", JobState::Queued).await.unwrap(),
        2
    );
    assert_eq!(
        store.count_jobs("nobody", JobState::Queued).await.unwrap(),
        0
    );
}

async fn attempts_are_listed_by_number(db: &TestDb) {
    let store = open_with_acme(db).await;
    store
        .submit_jobs(vec![job("j", "acme", "x"), job("k", "acme", "y")])
        .await
        .unwrap();
    let third = AttemptRecord {
        outcome: AttemptOutcome::OutOfMemory,
        measured_peak_bytes: Some(3 << 20),
        oom: Some(OutOfMemory {
            requested: 1024,
            in_use: 3 << 20,
            limit: 4 << 20,
            largest_free: 512,
            peak: 3 << 20,
        }),
        message: "oom".into(),
        resumed_from: Some("/ckpt/j/10".into()),
        resumed_from_step: 10,
        finished_at_ms: Some(T0 + 99),
        // Its worker ran it without a container.
        details: AttemptDetails {
            uncontained: true,
            ..AttemptDetails::default()
        },
        ..attempt("j", 3, 5)
    };
    for record in [
        &third,
        &attempt("j", 1, 1),
        &attempt("k", 1, 1),
        &attempt("j", 2, 2),
    ] {
        store.create_attempt(record).await.unwrap();
    }
    let listed = store.list_attempts("j").await.unwrap();
    assert_eq!(
        listed,
        vec![attempt("j", 1, 1), attempt("j", 2, 2), third.clone()]
    );
    assert_eq!(store.list_attempts("nope").await.unwrap(), vec![]);

    assert_eq!(
        store.create_attempt(&attempt("j", 2, 9)).await,
        Err(SchedulerError::already_exists("attempt", "j/2"))
    );
    assert_not_found(
        store.create_attempt(&attempt("ghost", 1, 1)).await,
        "job",
        "ghost",
    );
    assert_eq!(store.list_attempts("j").await.unwrap().len(), 3);
}

/// An attempt is ended by its number, once, while it runs: no attempt is reassigned
/// under another lease epoch (a job's next try is a new attempt), so nothing but its
/// outcome fences the end.
async fn an_attempt_ends_once_while_it_runs(db: &TestDb) {
    let store = open_with_acme(db).await;
    store
        .submit_jobs(vec![job("j", "acme", "x")])
        .await
        .unwrap();
    store.create_attempt(&attempt("j", 1, 1)).await.unwrap();
    store.create_attempt(&attempt("j", 2, 2)).await.unwrap();

    let oom = OutOfMemory {
        requested: 4096,
        in_use: 1024,
        limit: 2048,
        largest_free: 1024,
        peak: 1024,
    };
    store
        .end_attempt(
            &AttemptEnd {
                job_id: "j".into(),
                attempt_number: 2,
                outcome: AttemptOutcome::OutOfMemory,
                measured_peak_bytes: Some(2 << 20),
                oom: Some(oom),
                message: "oom in conv".into(),
                finished_at_ms: T0 + 60,
                results: AttemptResults::default(),
                details: Default::default(),
            },
            None,
        )
        .await
        .unwrap();
    let finished = AttemptRecord {
        outcome: AttemptOutcome::OutOfMemory,
        measured_peak_bytes: Some(2 << 20),
        oom: Some(oom),
        message: "oom in conv".into(),
        finished_at_ms: Some(T0 + 60),
        ..attempt("j", 2, 2)
    };
    assert_eq!(store.list_attempts("j").await.unwrap()[1], finished);

    // Finished attempts stay finished: a second report of the end changes nothing.
    assert_eq!(
        finish_plainly(&store, "j", 2, 2, AttemptOutcome::Succeeded, T0 + 70).await,
        Err(SchedulerError::Conflict(
            "attempt j/2 already ended (out_of_memory)".into()
        ))
    );
    assert_eq!(store.list_attempts("j").await.unwrap()[1], finished);

    assert_eq!(
        finish_plainly(&store, "j", 9, 1, AttemptOutcome::Failed, T0).await,
        Err(SchedulerError::not_found("attempt", "j/9"))
    );
    assert!(matches!(
        finish_plainly(&store, "j", 1, 1, AttemptOutcome::Running, T0).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "outcome"
    ));
    store
        .end_attempt(
            &AttemptEnd {
                job_id: "j".into(),
                attempt_number: 1,
                outcome: AttemptOutcome::Lost,
                measured_peak_bytes: None,
                oom: None,
                message: "worker w-1 lost its lease".into(),
                finished_at_ms: T0 + 80,
                results: AttemptResults::default(),
                details: Default::default(),
            },
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        store.list_attempts("j").await.unwrap()[0].outcome,
        AttemptOutcome::Lost
    );
}

/// A stored estimate with its breakdowns, as admission writes it.
const FULL_ESTIMATE_JSON: &str = r#"{"peak_bytes":3000,"required_bytes":4096,"persistent_bytes":1000,"fragmentation_bytes_at_peak":96,"fragmentation_at_peak":0.03,"by_category":[{"category":"weights","bytes":1000},{"category":"activations","bytes":2000}],"by_layer":[{"layer":"layers[0].dense","bytes":3000}],"peak_during":"backward layers[0].dense"}"#;

/// Job reads (get, list, through `job_to_proto`) show the estimate stored with the job
/// and never validate or estimate the spec again: the spec here would not even
/// validate, so a read that re-estimated could not show these numbers.
async fn job_reads_show_the_stored_estimate_without_validating_the_spec(db: &TestDb) {
    let store = open_with_acme(db).await;
    let config_json = r#"{"batch_size":32,"micro_batch_size":8,"precision":"fp16","recompute_segment_layers":null,"workspace_limit_bytes":0,"prefetch_batches":2}"#;
    let stored = JobRecord {
        spec_json: r#"{"name":"no model, no training: never valid"}"#.into(),
        config_json: config_json.into(),
        estimate_json: FULL_ESTIMATE_JSON.into(),
        ..job("full", "acme", "full")
    };
    // Rows written before the breakdowns were stored hold the two byte counts only.
    let legacy = JobRecord {
        config_json: config_json.into(),
        estimate_json: r#"{"peak_bytes":3000,"required_bytes":4096}"#.into(),
        ..job("legacy", "acme", "legacy")
    };
    let corrupt = JobRecord {
        config_json: config_json.into(),
        estimate_json: r#"{"required_bytes":4096}"#.into(),
        ..job("corrupt", "acme", "corrupt")
    };
    let not_json = JobRecord {
        config_json: config_json.into(),
        estimate_json: "peak=3000".into(),
        ..job("not-json", "acme", "not-json")
    };
    store
        .submit_jobs(vec![stored, legacy, corrupt, not_json])
        .await
        .unwrap();

    let (page, _) = store
        .list_jobs(&JobFilter {
            name_prefix: Some("full".into()),
            ..JobFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(page.len(), 1);
    let message = job_to_proto(&page[0], &[]).unwrap();
    let estimate = message.estimate.expect("the stored estimate");
    assert_eq!(estimate.peak_bytes, 3000);
    assert_eq!(estimate.required_bytes, 4096);
    assert_eq!(estimate.persistent_bytes, 1000);
    assert_eq!(estimate.fragmentation_bytes_at_peak, 96);
    assert_eq!(estimate.fragmentation_at_peak, 0.03);
    assert_eq!(
        estimate
            .by_category
            .iter()
            .map(|entry| (entry.category.as_str(), entry.bytes))
            .collect::<Vec<_>>(),
        [("weights", 1000), ("activations", 2000)]
    );
    assert_eq!(estimate.by_layer.len(), 1);
    assert_eq!(estimate.by_layer[0].layer, "layers[0].dense");
    assert_eq!(estimate.peak_during, "backward layers[0].dense");
    // The estimate's configuration is the job's current one.
    assert_eq!(estimate.config, message.current_config);
    assert_eq!(estimate.config.unwrap().micro_batch_size, 8);

    let legacy = job_to_proto(&store.get_job("legacy").await.unwrap(), &[]).unwrap();
    let legacy_estimate = legacy.estimate.expect("what the old row holds");
    assert_eq!(
        (legacy_estimate.peak_bytes, legacy_estimate.required_bytes),
        (3000, 4096)
    );
    assert!(legacy_estimate.by_category.is_empty() && legacy_estimate.peak_during.is_empty());

    // A corrupt estimate is an error naming the job, never an estimate of zero bytes.
    for id in ["corrupt", "not-json"] {
        let error = job_to_proto(&store.get_job(id).await.unwrap(), &[]).unwrap_err();
        assert!(
            matches!(&error, SchedulerError::Api(ApiError::Internal(message)) if message.contains(&format!("column \"estimate_json\" of job \"{id}\""))),
            "{id}: {error:?}"
        );
    }
}

/// What admission validated is stored with the job in the submit's transaction, in both
/// submit paths (the group's multi-row insert and, after a group fails, row by row), and
/// reads back as the workload it was, without its spec being read; a job stored without
/// one (a row from before the column) has none until the scheduler backfills it, which
/// never replaces one that is there; an unreadable form is an error naming the column and
/// the job. Job reads never carry the column.
async fn a_jobs_validated_workload_is_stored_with_it_and_read_back_as_validated(db: &TestDb) {
    let store = open_with_acme(db).await;
    let model = Workload::from_json(
        r#"{"name":"m","model":{"input_shape":[8],"loss":"mse","layers":[{"dense":{"units":2}}]},"training":{"batch_size":4,"steps":2,"optimizer":{"sgd":{"learning_rate":0.1}}},"data":{"format":"synthetic","samples":16}}"#,
    )
    .unwrap();
    let command = Workload::from_json(
        r#"{"name":"c","command":{"argv":["python3","/opt/train.py"],"global_batch":32,"steps":10},"resources":{"vram":"1GiB"}}"#,
    )
    .unwrap();
    let command_job = JobRecord {
        kind: JobKind::Command,
        ..job("w-command", "acme", "c")
    };
    store
        .submit_jobs_with_workloads(vec![
            (job("w-model", "acme", "m"), Some(workload_to_json(&model))),
            (command_job, Some(workload_to_json(&command))),
            (job("w-none", "acme", "n"), None),
        ])
        .await
        .unwrap();
    let read = |id: &'static str, kind: JobKind| {
        let store = store.clone();
        async move {
            let text = store.job_workload_json(id).await.unwrap()?;
            Some(workload_from_json(kind, &text).map_err(|error| error.of_job(id)))
        }
    };
    assert_eq!(
        read("w-model", JobKind::Model).await,
        Some(Ok(Some(model.clone())))
    );
    assert_eq!(
        read("w-command", JobKind::Command).await,
        Some(Ok(Some(command.clone())))
    );
    assert_eq!(read("w-none", JobKind::Model).await, None);
    assert_not_found(
        store.job_workload_json("w-missing").await,
        "job",
        "w-missing",
    );

    // The row-by-row path (a group whose job id is taken) stores it too.
    let taken = store
        .submit_jobs_with_workloads(vec![
            (job("w-second", "acme", "m"), Some(workload_to_json(&model))),
            (job("w-model", "acme", "m"), Some("never stored".into())),
        ])
        .await;
    assert!(taken.is_err(), "{taken:?}");
    store
        .submit_jobs_with_workloads(vec![(
            job("w-second", "acme", "m"),
            Some(workload_to_json(&model)),
        )])
        .await
        .unwrap();
    assert_eq!(
        read("w-second", JobKind::Model).await,
        Some(Ok(Some(model.clone())))
    );
    assert_eq!(
        read("w-model", JobKind::Model).await,
        Some(Ok(Some(model.clone())))
    );

    // A backfill fills a missing form and never replaces one.
    store
        .backfill_job_workload("w-none", &workload_to_json(&model))
        .await
        .unwrap();
    assert_eq!(
        read("w-none", JobKind::Model).await,
        Some(Ok(Some(model.clone())))
    );
    store
        .backfill_job_workload("w-command", &workload_to_json(&model))
        .await
        .unwrap();
    assert_eq!(
        read("w-command", JobKind::Command).await,
        Some(Ok(Some(command)))
    );
    assert_not_found(
        store.backfill_job_workload("w-missing", "{}").await,
        "job",
        "w-missing",
    );

    // Read as another kind than the job's, or unreadable: an error naming the column and
    // the job, never a workload.
    let error = read("w-model", JobKind::Command)
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(error.column, WORKLOAD_COLUMN);
    assert!(
        error
            .to_string()
            .starts_with(r#"corrupt row: column "workload_json" of job "w-model": "#),
        "{error}"
    );
    store
        .submit_jobs_with_workloads(vec![(
            job("w-corrupt", "acme", "x"),
            Some("{\"version\":1".into()),
        )])
        .await
        .unwrap();
    assert!(read("w-corrupt", JobKind::Model).await.unwrap().is_err());

    // Job reads and listings leave the column out: a job reads as it did without one.
    let (listed, _) = store.list_jobs(&JobFilter::default()).await.unwrap();
    assert!(listed.iter().any(|listed| listed.id == "w-model"));
    assert_eq!(
        store.get_job("w-model").await.unwrap().spec_json,
        r#"{"name":"m"}"#
    );
}

/// The step of a job's checkpoint is stored next to its location, and an attempt keeps
/// the step it resumed from; the API shows it.
async fn checkpoint_steps_are_stored_with_jobs_and_attempts(db: &TestDb) {
    let store = open_with_acme(db).await;
    let submitted = store
        .submit_jobs(vec![job("j", "acme", "x")])
        .await
        .unwrap()
        .remove(0)
        .job;
    let checkpointed = JobRecord {
        checkpoint_location: Some("/ckpt/j.ckpt".into()),
        checkpoint_step: 1234,
        ..submitted
    };
    store.update_job(&checkpointed).await.unwrap();
    let read = store.get_job("j").await.unwrap();
    assert_eq!(read.checkpoint_step, 1234);
    let placed = JobRecord {
        state: JobState::Placed,
        attempts_count: 1,
        ..read.clone()
    };
    let resumed = AttemptRecord {
        resumed_from: read.checkpoint_location.clone(),
        resumed_from_step: read.checkpoint_step,
        ..attempt("j", 1, 1)
    };
    store
        .record_job_and_attempt(&placed, &resumed)
        .await
        .unwrap();
    let attempts = store.list_attempts("j").await.unwrap();
    assert_eq!(attempts, vec![resumed]);
    let shown = attempt_to_proto(&attempts[0]).resumed_from.unwrap();
    assert_eq!(
        (shown.step, shown.location.as_str()),
        (1234, "/ckpt/j.ckpt")
    );
}

async fn record_job_and_attempt_is_atomic(db: &TestDb) {
    let store = open_with_acme(db).await;
    let queued = store
        .submit_jobs(vec![job("j", "acme", "x")])
        .await
        .unwrap()
        .remove(0)
        .job;

    // Placing: the job and its first attempt together.
    let placed = JobRecord {
        state: JobState::Placed,
        attempts_count: 1,
        ..queued.clone()
    };
    store
        .record_job_and_attempt(&placed, &attempt("j", 1, 1))
        .await
        .unwrap();
    assert_eq!(store.get_job("j").await.unwrap(), placed);
    assert_eq!(
        store.list_attempts("j").await.unwrap(),
        vec![attempt("j", 1, 1)]
    );

    // Recording the same attempt again fails, and the job change with it is undone.
    let running = JobRecord {
        state: JobState::Running,
        message: "should not stick".into(),
        ..placed.clone()
    };
    assert_eq!(
        store
            .record_job_and_attempt(&running, &attempt("j", 1, 1))
            .await,
        Err(SchedulerError::already_exists("attempt", "j/1"))
    );
    assert_eq!(store.get_job("j").await.unwrap(), placed);

    // Nor under another epoch: an attempt is never placed twice (the store's
    // reassignment path is gone), and nothing of the call sticks.
    assert_eq!(
        store
            .record_job_and_attempt(&running, &attempt("j", 1, 4))
            .await,
        Err(SchedulerError::already_exists("attempt", "j/1"))
    );
    assert_eq!(store.get_job("j").await.unwrap(), placed);
    assert_eq!(
        store.list_attempts("j").await.unwrap(),
        vec![attempt("j", 1, 1)]
    );

    // A missing job: no attempt is written either.
    let ghost = job("ghost", "acme", "x");
    assert_eq!(
        store
            .record_job_and_attempt(&ghost, &attempt("ghost", 1, 1))
            .await,
        Err(SchedulerError::not_found("job", "ghost"))
    );
    assert_eq!(store.list_attempts("ghost").await.unwrap(), vec![]);
    // An attempt of another job is refused before anything is written.
    assert!(matches!(
        store
            .record_job_and_attempt(&running, &attempt("other", 2, 1))
            .await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { .. }))
    ));
    assert_eq!(store.get_job("j").await.unwrap(), placed);
}

async fn workers_upsert_and_state(db: &TestDb) {
    let store = db.open().await;
    let node_b = worker("w-1", "node-b");
    let node_a = worker("w-2", "node-a");
    assert_eq!(store.upsert_worker(&node_b).await.unwrap(), node_b);
    assert_eq!(store.upsert_worker(&node_a).await.unwrap(), node_a);
    assert_eq!(store.get_worker("w-1").await.unwrap(), node_b);
    assert_eq!(
        store.list_workers().await.unwrap(),
        vec![node_a.clone(), node_b.clone()],
        "by hostname"
    );

    // Registering again replaces what it reports but keeps when it first registered.
    let again = WorkerRecord {
        hostname: "node-b2".into(),
        gpus_json: "[]".into(),
        last_heartbeat_ms: T0 + 500,
        registered_at_ms: T0 + 500,
        version: "0.2.0".into(),
        token_id: "token-node-2".into(),
        ..node_b.clone()
    };
    let expected = WorkerRecord {
        registered_at_ms: T0,
        ..again.clone()
    };
    assert_eq!(store.upsert_worker(&again).await.unwrap(), expected);
    assert_eq!(store.get_worker("w-1").await.unwrap(), expected);

    let draining = store
        .set_worker_state("w-1", WorkerState::Draining)
        .await
        .unwrap();
    assert_eq!(draining.state, WorkerState::Draining);
    assert_eq!(
        store.get_worker("w-1").await.unwrap().state,
        WorkerState::Draining
    );
    store
        .set_worker_state("w-1", WorkerState::Lost)
        .await
        .unwrap();
    assert_eq!(
        store.get_worker("w-1").await.unwrap().state,
        WorkerState::Lost
    );
    assert_eq!(store.get_worker("w-2").await.unwrap(), node_a, "untouched");
    store.record_heartbeat("w-2", T0 + 900).await.unwrap();
    assert_eq!(
        store.get_worker("w-2").await.unwrap().last_heartbeat_ms,
        T0 + 900
    );

    assert_not_found(
        store.set_worker_state("w-9", WorkerState::Ready).await,
        "worker",
        "w-9",
    );
    assert_not_found(store.get_worker("w-9").await, "worker", "w-9");
    assert_not_found(store.record_heartbeat("w-9", T0).await, "worker", "w-9");
}

async fn peak_correction_is_the_largest_ratio(db: &TestDb) {
    let store = db.open().await;
    assert_eq!(store.peak_correction("conv-1024").await.unwrap(), None);
    store
        .record_peak("conv-1024", 1000, 1200, T0)
        .await
        .unwrap();
    assert_eq!(store.peak_correction("conv-1024").await.unwrap(), Some(1.2));
    store
        .record_peak("conv-1024", 1000, 1100, T0 + 1)
        .await
        .unwrap();
    assert_eq!(
        store.peak_correction("conv-1024").await.unwrap(),
        Some(1.2),
        "a smaller ratio does not lower it"
    );
    store
        .record_peak("conv-1024", 2000, 3000, T0 + 2)
        .await
        .unwrap();
    assert_eq!(store.peak_correction("conv-1024").await.unwrap(), Some(1.5));
    store.record_peak("mlp", 4000, 3000, T0).await.unwrap();
    assert_eq!(store.peak_correction("mlp").await.unwrap(), Some(0.75));
    assert_eq!(store.peak_correction("conv-1024").await.unwrap(), Some(1.5));
    assert_eq!(store.peak_correction("other").await.unwrap(), None);
    assert!(matches!(
        store.record_peak("mlp", 0, 10, T0).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "estimated_bytes"
    ));
    assert!(matches!(
        store.record_peak("mlp", 10, -1, T0).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "measured_bytes"
    ));
    assert_eq!(store.peak_correction("mlp").await.unwrap(), Some(0.75));
}

async fn data_survives_reopening(db: &TestDb) {
    let acme = TenantRecord {
        vram_quota_bytes: Some(1 << 30),
        ..tenant("acme")
    };
    let token = TokenRecord {
        id: "tok-1".into(),
        tenant: "acme".into(),
        role: Role::User,
        secret_hash: vec![42; 32],
        description: "ci".into(),
        created_at_ms: T0,
        expires_at_ms: None,
        revoked: false,
        revoked_at_ms: None,
        last_used_at_ms: None,
    };
    let node = worker("w-1", "node-1");
    let before;
    {
        let store = db.open().await;
        store.create_tenant(&acme).await.unwrap();
        store.create_token(&token).await.unwrap();
        before = store
            .submit_jobs(vec![
                keyed(job("j-1", "acme", "x"), "k"),
                job("j-2", "acme", "y"),
            ])
            .await
            .unwrap();
        store.create_attempt(&attempt("j-1", 1, 1)).await.unwrap();
        store.upsert_worker(&node).await.unwrap();
        store.record_peak("shape", 100, 130, T0).await.unwrap();
        store.close().await;
    }

    // A new pool on the same file / database; migrations run again and change nothing.
    let store = db.open().await;
    assert_eq!(store.get_tenant("acme").await.unwrap(), acme);
    assert_eq!(
        store.find_token_by_hash(&[42; 32]).await.unwrap(),
        Some(token)
    );
    for outcome in &before {
        assert_eq!(store.get_job(&outcome.job.id).await.unwrap(), outcome.job);
    }
    assert_eq!(
        store.list_attempts("j-1").await.unwrap(),
        vec![attempt("j-1", 1, 1)]
    );
    assert_eq!(store.get_worker("w-1").await.unwrap(), node);
    assert_eq!(store.peak_correction("shape").await.unwrap(), Some(1.3));

    // The idempotency key and the sequence counter survived too.
    let after = store
        .submit_jobs(vec![
            keyed(job("j-3", "acme", "retry"), "k"),
            job("j-4", "acme", "z"),
        ])
        .await
        .unwrap();
    assert!(!after[0].created);
    assert_eq!(after[0].job, before[0].job);
    assert!(after[1].created);
    assert!(after[1].job.submit_sequence > before[1].job.submit_sequence);
    store.close().await;
    assert!(
        store.get_tenant("acme").await.is_err(),
        "a closed store answers nothing"
    );
}

/// The harness itself: a server runs as an unprivileged user, listens on 127.0.0.1 only,
/// and is stopped, its files removed, when its guard drops.
#[tokio::test]
async fn a_postgres_test_server_is_unprivileged_local_and_stopped_on_drop() {
    use sqlx::Connection;

    let server = support::PgServer::start().unwrap_or_else(|reason| panic!("{reason}"));
    let url = server.url("postgres");
    let root = server.root().to_path_buf();
    let mut connection = sqlx::PgConnection::connect(&url).await.unwrap();
    let listen: String = sqlx::query_scalar("SHOW listen_addresses")
        .fetch_one(&mut connection)
        .await
        .unwrap();
    assert_eq!(listen, "127.0.0.1");
    let fsync: String = sqlx::query_scalar("SHOW fsync")
        .fetch_one(&mut connection)
        .await
        .unwrap();
    assert_eq!(fsync, "on");
    connection.close().await.unwrap();

    let pid_file = std::fs::read_to_string(root.join("data/postmaster.pid")).unwrap();
    let pid = pid_file.lines().next().unwrap().trim();
    use std::os::unix::fs::MetadataExt;
    let server_uid = std::fs::metadata(format!("/proc/{pid}")).unwrap().uid();
    assert_ne!(server_uid, 0, "postgres must not run as root");

    drop(server);
    assert!(!root.exists(), "{} is left behind", root.display());
    // Gone, or a zombie its new parent has not reaped yet.
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ")?.1.chars().next());
    assert!(
        matches!(state, None | Some('Z') | Some('X')),
        "postgres {pid} still runs (state {state:?})"
    );
    assert!(sqlx::PgConnection::connect(&url).await.is_err());
}

/// The other ways to name a SQLite database: a `sqlite://` URL and an in-memory one
/// (which several pool connections share).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_urls_and_in_memory_stores_open() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("by-url.db").display());
    let store = Store::open(&url).await.unwrap();
    store.create_tenant(&tenant("acme")).await.unwrap();
    store.close().await;
    let reopened = Store::open(&url).await.unwrap();
    assert_eq!(reopened.get_tenant("acme").await.unwrap(), tenant("acme"));

    let memory = Store::open("sqlite::memory:").await.unwrap();
    assert_eq!(memory.backend(), Backend::Sqlite);
    memory.create_tenant(&tenant("acme")).await.unwrap();
    let batcher = SubmitBatcher::spawn(memory.clone());
    let mut tasks = Vec::new();
    for i in 0..20 {
        let batcher = batcher.clone();
        tasks.push(tokio::spawn(async move {
            batcher
                .submit(job(&format!("m-{i}"), "acme", "x"), None)
                .await
        }));
    }
    for task in tasks {
        let outcome = task.await.unwrap().unwrap();
        assert_eq!(memory.get_job(&outcome.job.id).await.unwrap(), outcome.job);
    }
    assert_eq!(
        Store::open("").await.err(),
        Some(SchedulerError::invalid_argument(
            "database_url",
            "must not be empty"
        ))
    );
}

// ---- job log lines ----

fn log_line(job_id: &str, attempt_number: i64, message: &str) -> NewLogLine {
    NewLogLine {
        job_id: job_id.to_string(),
        time_ms: T0 + 7,
        attempt_number,
        level: "info".to_string(),
        message: message.to_string(),
        event: None,
        stream: String::new(),
    }
}

fn log_query(job_id: &str) -> LogQuery {
    LogQuery {
        job_id: job_id.to_string(),
        attempt_number: None,
        after_sequence: 0,
        page_size: 0,
        tail: None,
    }
}

/// The (sequence, message) pairs of a page, for compact assertions.
fn sequenced(page: &LogPage) -> Vec<(i64, String)> {
    page.lines
        .iter()
        .map(|line| (line.sequence, line.message.clone()))
        .collect()
}

/// Two jobs with lines, written by one append as the batcher does.
async fn two_jobs_for_logs(store: &Store) {
    store.create_tenant(&tenant("acme")).await.unwrap();
    store
        .submit_jobs(vec![job("j-1", "acme", "x"), job("j-2", "acme", "y")])
        .await
        .unwrap();
}

async fn log_lines_get_per_job_sequences_and_read_in_pages(db: &TestDb) {
    let store = db.open().await;
    two_jobs_for_logs(&store).await;
    assert_eq!(
        store.read_log_lines(&log_query("j-1")).await.unwrap(),
        LogPage {
            lines: vec![],
            more: false
        }
    );
    store.append_log_lines(&[]).await.unwrap();
    // Interleaved jobs in one append: each job's lines keep their order.
    let mut lines = Vec::new();
    for i in 1..=5 {
        lines.push(log_line("j-1", 1, &format!("one {i}")));
        lines.push(log_line("j-2", 1, &format!("two {i}")));
    }
    lines[0] = NewLogLine {
        level: "warn".into(),
        attempt_number: 0,
        ..lines[0].clone()
    };
    store.append_log_lines(&lines).await.unwrap();
    let everything = store.read_log_lines(&log_query("j-1")).await.unwrap();
    assert!(!everything.more);
    assert_eq!(
        everything.lines[0],
        LogLineRecord {
            job_id: "j-1".into(),
            sequence: 1,
            time_ms: T0 + 7,
            attempt_number: 0,
            level: "warn".into(),
            message: "one 1".into(),
            stream: String::new(),
        }
    );
    assert_eq!(
        sequenced(&everything),
        (1..=5).map(|i| (i, format!("one {i}"))).collect::<Vec<_>>()
    );
    let other = store.read_log_lines(&log_query("j-2")).await.unwrap();
    assert_eq!(
        sequenced(&other),
        (1..=5).map(|i| (i, format!("two {i}"))).collect::<Vec<_>>()
    );

    // Pages of 2 after a sequence, with `more` telling whether another page exists.
    let page = |after_sequence: i64| LogQuery {
        after_sequence,
        page_size: 2,
        ..log_query("j-1")
    };
    let first = store.read_log_lines(&page(0)).await.unwrap();
    assert_eq!(
        sequenced(&first),
        vec![(1, "one 1".into()), (2, "one 2".into())]
    );
    assert!(first.more);
    let second = store.read_log_lines(&page(2)).await.unwrap();
    assert_eq!(
        sequenced(&second),
        vec![(3, "one 3".into()), (4, "one 4".into())]
    );
    assert!(second.more);
    let last = store.read_log_lines(&page(4)).await.unwrap();
    assert_eq!(sequenced(&last), vec![(5, "one 5".into())]);
    assert!(!last.more);
    let beyond = store.read_log_lines(&page(5)).await.unwrap();
    assert_eq!(beyond.lines, vec![]);
    assert!(!beyond.more);

    // A later append continues the job's sequence, also after reopening the store.
    store
        .append_log_lines(&[log_line("j-1", 2, "one 6")])
        .await
        .unwrap();
    store.close().await;
    let store = db.open().await;
    store
        .append_log_lines(&[log_line("j-1", 2, "one 7")])
        .await
        .unwrap();
    let after_reopen = store.read_log_lines(&page(5)).await.unwrap();
    assert_eq!(
        sequenced(&after_reopen),
        vec![(6, "one 6".into()), (7, "one 7".into())]
    );

    // Page size 0 is the default page (1000 lines); more than that is another page.
    let many: Vec<NewLogLine> = (8..=1_010)
        .map(|i| log_line("j-1", 2, &format!("one {i}")))
        .collect();
    store.append_log_lines(&many).await.unwrap();
    let default_page = store.read_log_lines(&log_query("j-1")).await.unwrap();
    assert_eq!(default_page.lines.len(), 1_000);
    assert_eq!(default_page.lines.last().unwrap().sequence, 1_000);
    assert!(default_page.more);
}

async fn log_lines_filter_by_attempt_and_tail(db: &TestDb) {
    let store = db.open().await;
    two_jobs_for_logs(&store).await;
    // The scheduler's notes (attempt 0) around two attempts' lines.
    let lines = vec![
        log_line("j-1", 0, "placed"),
        log_line("j-1", 1, "a1 first"),
        log_line("j-1", 1, "a1 second"),
        log_line("j-1", 0, "out of memory"),
        log_line("j-1", 2, "a2 first"),
        log_line("j-1", 1, "a1 late"),
        log_line("j-1", 2, "a2 second"),
        log_line("j-1", 0, "succeeded"),
        log_line("j-2", 1, "other job"),
    ];
    store.append_log_lines(&lines).await.unwrap();
    let attempt = |number: i64| LogQuery {
        attempt_number: Some(number),
        ..log_query("j-1")
    };
    assert_eq!(
        sequenced(&store.read_log_lines(&attempt(1)).await.unwrap()),
        vec![
            (2, "a1 first".into()),
            (3, "a1 second".into()),
            (6, "a1 late".into())
        ]
    );
    // Paging within one attempt: after_sequence counts the job's sequences.
    let paged = store
        .read_log_lines(&LogQuery {
            after_sequence: 2,
            page_size: 1,
            ..attempt(1)
        })
        .await
        .unwrap();
    assert_eq!(sequenced(&paged), vec![(3, "a1 second".into())]);
    assert!(paged.more);
    assert_eq!(
        sequenced(&store.read_log_lines(&attempt(2)).await.unwrap()),
        vec![(5, "a2 first".into()), (7, "a2 second".into())]
    );
    assert_eq!(
        store.read_log_lines(&attempt(3)).await.unwrap().lines,
        vec![]
    );

    // The tail: the last lines after the attempt filter, oldest first, ignoring
    // after_sequence and the page size; never `more`.
    let tail = |tail: u32| LogQuery {
        tail: Some(tail),
        after_sequence: 7,
        page_size: 1,
        ..log_query("j-1")
    };
    let last_three = store.read_log_lines(&tail(3)).await.unwrap();
    assert_eq!(
        sequenced(&last_three),
        vec![
            (6, "a1 late".into()),
            (7, "a2 second".into()),
            (8, "succeeded".into())
        ]
    );
    assert!(!last_three.more);
    assert_eq!(
        store.read_log_lines(&tail(100)).await.unwrap().lines.len(),
        8
    );
    // Tails over the cap are capped, not refused.
    assert_eq!(
        store
            .read_log_lines(&tail(u32::MAX))
            .await
            .unwrap()
            .lines
            .len(),
        8
    );
    let attempt_tail = store
        .read_log_lines(&LogQuery {
            tail: Some(2),
            ..attempt(1)
        })
        .await
        .unwrap();
    assert_eq!(
        sequenced(&attempt_tail),
        vec![(3, "a1 second".into()), (6, "a1 late".into())]
    );
    // A tail of 0 is no tail.
    assert_eq!(
        store
            .read_log_lines(&LogQuery {
                tail: Some(0),
                ..log_query("j-1")
            })
            .await
            .unwrap()
            .lines
            .len(),
        8
    );
}

async fn log_lines_are_trimmed_to_the_newest_per_job(db: &TestDb) {
    let store = db.open().await;
    two_jobs_for_logs(&store).await;
    let numbered = |job_id: &str, range: std::ops::RangeInclusive<i64>| -> Vec<NewLogLine> {
        range
            .map(|i| log_line(job_id, 1, &format!("line {i}")))
            .collect()
    };
    store
        .append_log_lines_keeping(&numbered("j-1", 1..=3), 5)
        .await
        .unwrap();
    store
        .append_log_lines_keeping(&numbered("j-2", 1..=2), 5)
        .await
        .unwrap();
    store
        .append_log_lines_keeping(&numbered("j-1", 4..=7), 5)
        .await
        .unwrap();
    let kept = store.read_log_lines(&log_query("j-1")).await.unwrap();
    assert_eq!(
        sequenced(&kept),
        (3..=7)
            .map(|i| (i, format!("line {i}")))
            .collect::<Vec<_>>(),
        "the two oldest lines are gone, sequences unchanged"
    );
    // One append larger than the limit keeps its own newest lines.
    store
        .append_log_lines_keeping(&numbered("j-1", 8..=20), 5)
        .await
        .unwrap();
    assert_eq!(
        sequenced(&store.read_log_lines(&log_query("j-1")).await.unwrap()),
        (16..=20)
            .map(|i| (i, format!("line {i}")))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        store
            .read_log_lines(&log_query("j-2"))
            .await
            .unwrap()
            .lines
            .len(),
        2,
        "another job's lines are not trimmed"
    );

    // The default limit is 10,000 lines per job.
    assert_eq!(MAX_LOG_LINES_PER_JOB, 10_000);
    store
        .append_log_lines(&numbered("j-2", 3..=10_000))
        .await
        .unwrap();
    store
        .append_log_lines(&numbered("j-2", 10_001..=10_025))
        .await
        .unwrap();
    let oldest = store
        .read_log_lines(&LogQuery {
            page_size: 1,
            ..log_query("j-2")
        })
        .await
        .unwrap();
    assert_eq!(sequenced(&oldest), vec![(26, "line 26".into())]);
    let newest = store
        .read_log_lines(&LogQuery {
            tail: Some(1),
            ..log_query("j-2")
        })
        .await
        .unwrap();
    assert_eq!(sequenced(&newest), vec![(10_025, "line 10025".into())]);
    let mut count = 0;
    let mut after_sequence = 0;
    loop {
        let page = store
            .read_log_lines(&LogQuery {
                after_sequence,
                page_size: 10_000,
                ..log_query("j-2")
            })
            .await
            .unwrap();
        count += page.lines.len();
        after_sequence = page
            .lines
            .last()
            .map_or(after_sequence, |line| line.sequence);
        if !page.more {
            break;
        }
    }
    assert_eq!(count, 10_000);
}

async fn appending_log_lines_is_all_or_nothing(db: &TestDb) {
    let store = db.open().await;
    two_jobs_for_logs(&store).await;
    assert!(matches!(
        store
            .append_log_lines(&[log_line("j-1", 1, "kept?"), log_line("missing", 1, "x")])
            .await,
        Err(SchedulerError::Api(ApiError::NotFound { what: "job", .. }))
    ));
    let invalid_level = NewLogLine {
        level: "loud".into(),
        ..log_line("j-1", 1, "x")
    };
    assert!(matches!(
        store.append_log_lines(&[log_line("j-1", 1, "kept?"), invalid_level]).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "lines[1].level"
    ));
    let negative_attempt = log_line("j-1", -1, "x");
    assert!(matches!(
        store.append_log_lines(&[negative_attempt]).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "lines[0].attempt_number"
    ));
    let too_long = log_line("j-1", 1, &"x".repeat(MAX_LOG_MESSAGE_BYTES + 1));
    assert!(matches!(
        store.append_log_lines(&[too_long]).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "lines[0].message"
    ));
    assert!(matches!(
        store.append_log_lines_keeping(&[log_line("j-1", 1, "x")], 0).await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "keep_per_job"
    ));
    // Nothing of the refused appends was written, not even their sequences.
    assert_eq!(
        store.read_log_lines(&log_query("j-1")).await.unwrap().lines,
        vec![]
    );
    store
        .append_log_lines(&[log_line("j-1", 1, "first")])
        .await
        .unwrap();
    assert_eq!(
        sequenced(&store.read_log_lines(&log_query("j-1")).await.unwrap()),
        vec![(1, "first".into())]
    );
    assert!(matches!(
        store
            .read_log_lines(&LogQuery {
                after_sequence: -1,
                ..log_query("j-1")
            })
            .await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "after_sequence"
    ));
    assert!(matches!(
        store
            .read_log_lines(&LogQuery {
                attempt_number: Some(-2),
                ..log_query("j-1")
            })
            .await,
        Err(SchedulerError::Api(ApiError::InvalidArgument { field, .. })) if field == "attempt_number"
    ));
}

async fn the_log_batcher_writes_groups_and_flush_makes_them_readable(db: &TestDb) {
    let store = db.open().await;
    two_jobs_for_logs(&store).await;
    // An interval no test waits for: only the group size and flushes write here.
    let batcher = LogBatcher::spawn_with(
        store.clone(),
        LogBatcherSettings {
            flush_interval: std::time::Duration::from_secs(3600),
            max_group: 10,
            capacity: 1_000,
            keep_per_job: 1_000,
        },
    );
    for i in 1..=25 {
        batcher.append(log_line(
            if i % 2 == 0 { "j-2" } else { "j-1" },
            1,
            &format!("{i}"),
        ));
    }
    // A line for a job that does not exist costs only its own line.
    batcher.append(log_line("missing", 1, "lost"));
    batcher.flush().await;
    assert_eq!(batcher.lines_stored(), 25);
    assert_eq!(batcher.lines_dropped(), 1);
    let odd = store.read_log_lines(&log_query("j-1")).await.unwrap();
    assert_eq!(
        odd.lines
            .iter()
            .map(|line| line.message.clone())
            .collect::<Vec<_>>(),
        (1..=25)
            .step_by(2)
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
    );
    let even = store.read_log_lines(&log_query("j-2")).await.unwrap();
    assert_eq!(
        sequenced(&even).last(),
        Some(&(12, "24".to_string())),
        "12 lines, in order"
    );
    // A flush with nothing waiting answers at once.
    batcher.flush().await;
    assert_eq!(batcher.lines_stored(), 25);
}
