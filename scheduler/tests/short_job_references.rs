//! Short job references, as people type them: an id without its `job-` prefix, the last
//! hex digits of an id (ids are time-ordered, so their starts are alike and their ends
//! are random), and a name that finished runs of a resubmitted file share with the one
//! still going. Every short reference is resolved within the caller's tenant: another
//! tenant's job can be neither reached nor counted through one. The real server over real
//! gRPC, on SQLite and on PostgreSQL (as `sqlite::NAME` and `postgres::NAME`).

#[macro_use]
mod support;

use carve_proto::v1;
use tonic::Code;
use tonic::transport::Channel;

#[path = "support/worker.rs"]
mod test_worker;

#[path = "support/cluster.rs"]
mod cluster;
use cluster::{cancel, get, submit_named, tenant_with_tokens};
use support::TestDb;

on_both_databases!(
    an_id_is_found_without_its_prefix_and_by_its_last_digits,
    a_name_means_the_one_job_of_that_name_still_going,
    another_tenants_job_cannot_be_reached_or_counted_by_a_short_reference,
);

/// The whole id of the job `reference` names, as `token` gets it.
async fn resolved_id(channel: &Channel, token: &str, reference: &str) -> String {
    match get(channel, token, reference).await {
        Ok(job) => job.id,
        Err(status) => panic!("{reference} should name one job: {status:?}"),
    }
}

/// An id's hex digits, without `job-`.
fn digits(id: &str) -> &str {
    id.strip_prefix("job-").expect("job ids start with job-")
}

/// An id's last `count` characters.
fn suffix(id: &str, count: usize) -> &str {
    &id[id.len() - count..]
}

async fn an_id_is_found_without_its_prefix_and_by_its_last_digits(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (user, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let mut jobs = Vec::new();
    for index in 0..3 {
        jobs.push(submit_named(&channel, &user, &format!("run-{index}")).await);
    }
    for job in &jobs {
        // The whole id without its prefix, most of it, and its last six digits.
        assert_eq!(resolved_id(&channel, &user, digits(&job.id)).await, job.id);
        let most = &digits(&job.id)[..28];
        assert_eq!(resolved_id(&channel, &user, most).await, job.id);
        assert_eq!(
            resolved_id(&channel, &user, suffix(&job.id, 6)).await,
            job.id
        );
    }
    // Every call that takes a job reference takes a short one.
    let cancelled = cancel(&channel, &user, suffix(&jobs[0].id, 6), "short")
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(cancelled.id, jobs[0].id);

    // The first digits are the time, alike for jobs submitted together: a short id that
    // names several jobs is refused, listing them, and touches none.
    let shared = &digits(&jobs[0].id)[..4];
    let ambiguous = cancel(&channel, &user, shared, "").await.unwrap_err();
    assert_eq!(ambiguous.code(), Code::InvalidArgument, "{ambiguous:?}");
    let message = ambiguous.message();
    assert!(
        message.starts_with(&format!(
            "job_id: \"{shared}\" is ambiguous: it names 3 jobs: "
        )),
        "{message}"
    );
    for job in &jobs {
        assert!(message.contains(&job.id), "{message}");
    }
    assert_eq!(
        get(&channel, &user, &jobs[1].id).await.unwrap().state,
        v1::JobState::Queued as i32
    );

    // Digits no id has, and a reference that is no job's anything, are missing.
    let missing = get(&channel, &user, "zz-not-a-job").await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound, "{missing:?}");
    assert_eq!(missing.message(), "job zz-not-a-job not found");
}

async fn a_name_means_the_one_job_of_that_name_still_going(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (user, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let first = submit_named(&channel, &user, "again").await;
    let second = submit_named(&channel, &user, "again").await;

    // Two going: the name is ambiguous.
    let ambiguous = get(&channel, &user, "again").await.unwrap_err();
    assert_eq!(ambiguous.code(), Code::InvalidArgument, "{ambiguous:?}");
    assert!(
        ambiguous.message().contains("it names 2 jobs"),
        "{ambiguous:?}"
    );

    // One finished, one going: the name is the one going, even though it is older.
    cancel(&channel, &user, &second.id, "").await.unwrap();
    assert_eq!(resolved_id(&channel, &user, "again").await, first.id);
    let cancelled = cancel(&channel, &user, "again", "by name")
        .await
        .unwrap()
        .job
        .unwrap();
    assert_eq!(cancelled.id, first.id);

    // None going: every job of the name is listed, with its state.
    let ambiguous = get(&channel, &user, "again").await.unwrap_err();
    assert_eq!(ambiguous.code(), Code::InvalidArgument, "{ambiguous:?}");
    let message = ambiguous.message();
    assert!(message.contains("it names 2 jobs"), "{message}");
    assert!(
        message.contains(&format!("{} (again, cancelled)", first.id))
            && message.contains(&format!("{} (again, cancelled)", second.id)),
        "{message}"
    );

    // The file resubmitted: its name is the new job.
    let third = submit_named(&channel, &user, "again").await;
    assert_eq!(resolved_id(&channel, &user, "again").await, third.id);
}

async fn another_tenants_job_cannot_be_reached_or_counted_by_a_short_reference(db: &TestDb) {
    let (_stop, channel) = cluster::start_on_database(db.url()).await;
    let (alice, _) = tenant_with_tokens(&channel, "alice", v1::Quota::default()).await;
    let (bob, _) = tenant_with_tokens(&channel, "bob", v1::Quota::default()).await;
    let bobs = submit_named(&channel, &bob, "shared").await;
    // Alice's runs of the same name are all finished; Bob's is the only one going.
    for _ in 0..2 {
        let alices = submit_named(&channel, &alice, "shared").await;
        cancel(&channel, &alice, &alices.id, "").await.unwrap();
    }

    // Bob's id, short in every way Bob may write it, is missing for Alice, with the
    // message a reference to no job gets.
    for reference in [
        digits(&bobs.id),
        &digits(&bobs.id)[..28],
        suffix(&bobs.id, 6),
        suffix(&bobs.id, 4),
    ] {
        let hidden = get(&channel, &alice, reference).await.unwrap_err();
        assert_eq!(hidden.code(), Code::NotFound, "{reference}: {hidden:?}");
        assert_eq!(hidden.message(), format!("job {reference} not found"));
        let hidden = cancel(&channel, &alice, reference, "").await.unwrap_err();
        assert_eq!(hidden.code(), Code::NotFound, "{reference}: {hidden:?}");
    }
    assert_eq!(
        get(&channel, &bob, &bobs.id).await.unwrap().state,
        v1::JobState::Queued as i32
    );

    // Bob's job going does not make Alice's name mean it: her two finished runs are
    // listed, and his is not among them.
    let ambiguous = get(&channel, &alice, "shared").await.unwrap_err();
    assert_eq!(ambiguous.code(), Code::InvalidArgument, "{ambiguous:?}");
    assert!(
        ambiguous.message().contains("it names 2 jobs") && !ambiguous.message().contains(&bobs.id),
        "{ambiguous:?}"
    );
    // And for Bob the name is his one job.
    assert_eq!(resolved_id(&channel, &bob, "shared").await, bobs.id);
}
