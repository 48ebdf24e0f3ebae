//! ListJobs pages: bounded in bytes, so that a page of jobs with large specs still fits
//! what a gRPC client decodes by default (4 MiB), and continued by their token with no
//! job lost or repeated; and what a page shows of each job (its attempts, its command's
//! memory model) is what GetJob shows, though a page reads them for all its jobs at once.
//! The real server over real gRPC clients with tonic's default limits, on SQLite and on
//! PostgreSQL (as `sqlite::NAME` and `postgres::NAME`), and the store's page reads on both.

#[macro_use]
mod support;

use std::collections::HashSet;
use std::time::Duration;

use carve_proto::v1;
use carve_scheduler::store::{
    AttemptOutcome, AttemptRecord, JobFilter, JobRecord, JobState, shown_text_bytes,
};
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{get, list_jobs, start_with_worker, submit, tenant_with_tokens};
use support::{TestDb, attempt, finish_plainly, job, open_with_acme};

on_both_databases!(
    pages_of_large_jobs_fit_the_default_decode_limit_and_hold_every_job_once,
    the_store_reads_a_pages_attempts_and_models_at_once,
    the_store_cuts_a_page_by_the_bytes_it_shows_before_reading_its_rows,
);

/// What a gRPC client decodes by default (tonic's `max_decoding_message_size`).
const DEFAULT_DECODE_LIMIT: usize = 4 << 20;

/// A command job with a declared size (no profile) whose spec is about `spec_bytes`
/// long: its description fills it.
fn large_command_job(name: &str, spec_bytes: usize) -> String {
    serde_json::json!({
        "name": name,
        "description": "d".repeat(spec_bytes),
        "command": {
            "argv": ["python3", "train.py", "--steps", "{max_steps}"],
            "working_directory": "/tmp",
            "global_batch": 64,
            "steps": 6,
        },
        "resources": { "vram": "2GiB" },
        "oom": { "strategies": ["accumulate"] },
    })
    .to_string()
}

/// Every page of the jobs `token` sees, listing `page_size` at a time with the default
/// client; panics (failing the test) when a page cannot be received.
async fn all_pages(channel: &Channel, token: &str, page_size: u32) -> Vec<v1::ListJobsResponse> {
    let mut pages = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = list_jobs(
            channel,
            token,
            v1::ListJobsRequest {
                page_size,
                page_token: page_token.clone(),
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|status| panic!("page {} of ListJobs: {status}", pages.len() + 1));
        page_token.clone_from(&page.next_page_token);
        pages.push(page);
        if page_token.is_empty() {
            return pages;
        }
        assert!(pages.len() < 1000, "ListJobs pages without end");
    }
}

async fn pages_of_large_jobs_fit_the_default_decode_limit_and_hold_every_job_once(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (user, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    // 100 jobs of 100 KB: a page of 100 is 10 MB, far over what the client takes.
    let mut submitted = Vec::new();
    for index in 0..100 {
        let spec = large_command_job(&format!("large-{index}"), 100 << 10);
        let job = submit(&channel, &user, &spec, "")
            .await
            .unwrap()
            .job
            .unwrap();
        submitted.push(job.id);
    }
    // And a small one, newest, so that a page mixes sizes.
    let small = large_command_job("small", 10);
    submitted.push(
        submit(&channel, &user, &small, "")
            .await
            .unwrap()
            .job
            .unwrap()
            .id,
    );

    for page_size in [0, 100, 1000, 7] {
        let pages = all_pages(&channel, &user, page_size).await;
        let mut seen = Vec::new();
        for page in &pages {
            let bytes = prost::Message::encoded_len(page);
            assert!(
                bytes < DEFAULT_DECODE_LIMIT,
                "page size {page_size}: a page of {bytes} bytes"
            );
            assert!(
                !page.jobs.is_empty(),
                "page size {page_size}: an empty page"
            );
            seen.extend(page.jobs.iter().map(|job| job.id.clone()));
        }
        // Newest first, each job once, none missing.
        let expected: Vec<String> = submitted.iter().rev().cloned().collect();
        assert_eq!(seen, expected, "page size {page_size}");
        let distinct: HashSet<&String> = seen.iter().collect();
        assert_eq!(distinct.len(), seen.len());
        if page_size != 7 {
            // Cut by bytes, not by count: 100 KB jobs fill 3 MiB with about 30.
            assert!(
                pages.len() >= 3,
                "page size {page_size}: {} pages",
                pages.len()
            );
            assert!(
                pages.iter().all(|page| page.jobs.len() < 50),
                "page size {page_size}"
            );
        } else {
            // Small pages are cut by count, as before.
            assert_eq!(pages.len(), 101usize.div_ceil(7));
        }
    }
}

/// A job a `cluster` test worker ran as a profile and then trains.
fn profiled_command_job(name: &str) -> String {
    serde_json::json!({
        "name": name,
        "command": {
            "argv": ["python3", "train.py", "--micro-batch", "{micro_batch}",
                     "--steps", "{max_steps}"],
            "working_directory": "/tmp",
            "global_batch": 64,
            "steps": 6,
        },
        "resources": { "vram": "auto" },
        "oom": { "strategies": ["accumulate"] },
    })
    .to_string()
}

#[tokio::test]
async fn a_page_shows_each_jobs_attempts_and_memory_model_as_get_job_does() {
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;
    let (_cluster, channel, user, _, mut worker) =
        start_with_worker(Duration::from_secs(30), "alice").await;
    // A command job profiled (its model stored) and then training: two attempts.
    let profiled = submit(&channel, &user, &profiled_command_job("profiled"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    let profile = worker.next_assignment().await;
    assert!(profile.profile);
    worker.started(&profile).await;
    worker
        .finish_profile(&profile, GIB, 16 * MIB, [32, 64])
        .await;
    let training = worker.next_assignment().await;
    assert_eq!(training.attempt.as_ref().unwrap().job_id, profiled.id);
    worker.started(&training).await;
    // The same command again (same shape, same model), a model job, and a command job
    // whose shape has no model yet (queued behind the first on the one GPU or placed).
    let again = submit(&channel, &user, &profiled_command_job("again"), "")
        .await
        .unwrap()
        .job
        .unwrap();
    submit(&channel, &user, cluster::JOB, "").await.unwrap();
    let other_shape = profiled_command_job("other").replace("train.py", "other.py");
    submit(&channel, &user, &other_shape, "").await.unwrap();
    // The passes place what fits meanwhile (the worker answers nothing more): once they
    // have, the list and the gets below read the same attempts.
    worker.messages_within(Duration::from_millis(500)).await;

    let page = list_jobs(&channel, &user, v1::ListJobsRequest::default())
        .await
        .unwrap();
    assert_eq!(page.jobs.len(), 4);
    assert!(page.next_page_token.is_empty());
    for listed in &page.jobs {
        let shown = get(&channel, &user, &listed.id).await.unwrap();
        assert_eq!(
            listed.attempts, shown.attempts,
            "attempts of {}",
            listed.name
        );
        assert_eq!(
            listed.memory_model, shown.memory_model,
            "memory model of {}",
            listed.name
        );
        assert_eq!(listed.spec_json, shown.spec_json);
        assert_eq!(listed.estimate, shown.estimate);
    }
    let by_name = |name: &str| page.jobs.iter().find(|job| job.name == name).unwrap();
    assert_eq!(by_name("profiled").attempts.len(), 2);
    assert!(by_name("profiled").attempts[0].profile);
    let model = by_name("profiled").memory_model.clone().unwrap();
    assert!(model.measured);
    assert!(model.basis.starts_with("fitted from "), "{}", model.basis);
    assert_eq!(by_name("again").memory_model, Some(model));
    assert_eq!(by_name("again").id, again.id);
    assert_eq!(by_name("small").memory_model, None);
    assert_eq!(by_name("other").memory_model, None);
}

async fn the_store_reads_a_pages_attempts_and_models_at_once(db: &TestDb) {
    let store = open_with_acme(db).await;
    store
        .submit_jobs(vec![
            job("j", "acme", "x"),
            job("k", "acme", "y"),
            job("l", "acme", "z"),
        ])
        .await
        .unwrap();
    for record in [attempt("j", 1, 1), attempt("k", 1, 1), attempt("j", 2, 2)] {
        store.create_attempt(&record).await.unwrap();
    }
    finish_plainly(&store, "j", 1, 1, AttemptOutcome::Failed, support::T0 + 5)
        .await
        .unwrap();
    let attempts = store
        .attempts_of_jobs(&["j", "k", "l", "ghost"])
        .await
        .unwrap();
    // Each job's, as its own read lists them; none for a job without attempts.
    for id in ["j", "k"] {
        assert_eq!(attempts[id], store.list_attempts(id).await.unwrap(), "{id}");
    }
    assert_eq!(attempts["j"].len(), 2);
    assert_eq!(attempts["j"][0].outcome, AttemptOutcome::Failed);
    assert_eq!(attempts.len(), 2);
    assert_eq!(
        store.attempts_of_jobs(&[]).await.unwrap(),
        Default::default()
    );
    // A page of the largest size is one statement; more ids still read them all.
    let many: Vec<String> = (0..1500).map(|index| format!("none-{index}")).collect();
    let mut ids: Vec<&str> = many.iter().map(String::as_str).collect();
    ids.push("k");
    let found = store.attempts_of_jobs(&ids).await.unwrap();
    assert_eq!(
        found.get("k").map(Vec::as_slice),
        Some(&[attempt("k", 1, 1)] as &[AttemptRecord])
    );

    store
        .put_command_memory_model("acme", "shape-a", r#"{"a":1}"#, "basis a", support::T0)
        .await
        .unwrap();
    store
        .put_command_memory_model("acme", "shape-b", r#"{"b":2}"#, "basis b", support::T0)
        .await
        .unwrap();
    let models = store
        .command_memory_models(&[
            ("acme", "shape-a"),
            ("acme", "shape-b"),
            ("acme", "shape-none"),
        ])
        .await
        .unwrap();
    assert_eq!(models.len(), 2);
    let key = |shape: &str| ("acme".to_string(), shape.to_string());
    assert_eq!(models[&key("shape-a")].model_json, r#"{"a":1}"#);
    assert_eq!(models[&key("shape-a")].basis, "basis a");
    assert_eq!(
        Some(models[&key("shape-b")].clone()),
        store.command_memory_model("acme", "shape-b").await.unwrap()
    );
}

/// `Store::list_jobs_within` sizes a page in the database (`octet_length`, bytes, as
/// `shown_text_bytes` counts a read row: a multi-byte name and spec count by their bytes,
/// not their characters) and reads only the jobs it shows: the first always, then as many
/// as fit the budget; its token continues right after them, so the pages hold every job
/// once, in the order `list_jobs` gives, with the filter and its own token applied.
async fn the_store_cuts_a_page_by_the_bytes_it_shows_before_reading_its_rows(db: &TestDb) {
    let store = open_with_acme(db).await;
    // Sizes that vary, with multi-byte text ("é" is 2 bytes, "喵" 3), one job large
    // enough to pass the budget alone, and one in another state the filter leaves out.
    let mut jobs = Vec::new();
    for index in 0..23_usize {
        let filler = ["é", "喵", "a"][index % 3].repeat(40 + 150 * (index % 5));
        jobs.push(JobRecord {
            spec_json: format!(r#"{{"name":"{filler}"}}"#),
            message: if index % 4 == 0 {
                "ö".repeat(30)
            } else {
                String::new()
            },
            ..job(&format!("j-{index:02}"), "acme", &format!("名前-{index}"))
        });
    }
    jobs[7].spec_json = "x".repeat(5_000);
    jobs[11].state = JobState::Succeeded;
    store.submit_jobs(jobs).await.unwrap();
    let filter = JobFilter {
        states: vec![JobState::Queued],
        page_size: 8,
        ..JobFilter::default()
    };
    let (expected, _) = store
        .list_jobs(&JobFilter {
            page_size: 1000,
            ..filter.clone()
        })
        .await
        .unwrap();
    assert_eq!(expected.len(), 22);

    const BUDGET: u64 = 1_500;
    let mut seen: Vec<JobRecord> = Vec::new();
    let mut token = None;
    loop {
        let (page, next) = store
            .list_jobs_within(
                &JobFilter {
                    page_token: token.clone(),
                    ..filter.clone()
                },
                BUDGET,
            )
            .await
            .unwrap();
        assert!(!page.is_empty() && page.len() <= 8, "{} jobs", page.len());
        let bytes: Vec<u64> = page
            .iter()
            .map(|job| shown_text_bytes(job) as u64)
            .collect();
        let total: u64 = bytes.iter().sum();
        // Within the budget, or one job that passes it alone.
        assert!(total <= BUDGET || page.len() == 1, "{bytes:?}");
        // Nothing was left out that would have fit: the next job passes the budget.
        let after = expected.get(seen.len() + page.len());
        if page.len() < 8
            && let Some(after) = after
        {
            assert!(
                total + shown_text_bytes(after) as u64 > BUDGET,
                "{} would have fit after {bytes:?}",
                after.id
            );
        }
        seen.extend(page);
        match next {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    assert_eq!(seen, expected, "every job once, in list_jobs' order");
    // The large job had a page of its own; a budget of 0 still shows one job a page.
    let (one, next) = store.list_jobs_within(&filter, 0).await.unwrap();
    assert_eq!((one.len(), next.is_some()), (1, true));
    assert_eq!(one[0], expected[0]);
    // No match: an empty page without a token.
    let none = JobFilter {
        name_prefix: Some("nobody".into()),
        ..filter
    };
    assert_eq!(
        store.list_jobs_within(&none, BUDGET).await.unwrap(),
        (Vec::new(), None)
    );
}
