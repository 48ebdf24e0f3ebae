//! `carve admin` as an operator uses it, the real binary against `carve dev`: tokens list
//! their state and last use, revoked and expired ones on request (`--all`); tenant names
//! are lowercase; a tenant is deleted with its tokens, but not while it has jobs running;
//! a node drained with a reason shows it, and a connected worker is not removed.

#[path = "support/dev_cluster.rs"]
mod dev_cluster;
use dev_cluster::DevCluster;

/// The row of `id` in a `carve admin tokens list` table, or `None`.
fn row_of<'table>(table: &'table str, id: &str) -> Option<&'table str> {
    table.lines().find(|line| line.starts_with(id))
}

#[test]
fn tokens_show_their_state_names_are_lowercase_and_only_idle_tenants_are_deleted() {
    let cluster = DevCluster::start();
    let admin = &cluster.admin_token;

    // Names are lowercase: refused as an invalid argument naming the field and the rule.
    let refused = cluster
        .carve_with_token(admin, &["admin", "tenants", "create", "Team_B"])
        .expect_code(7);
    refused.assert_stderr_contains("name: ");
    refused.assert_stderr_contains("lowercase letters, digits and '-'");

    // A user token, used once, and a revoked one.
    cluster
        .carve_with_token(admin, &["admin", "tenants", "create", "team-b"])
        .expect_code(0);
    let mut ids = Vec::new();
    let mut secrets = Vec::new();
    for name in ["used", "revoked"] {
        let created = cluster
            .carve_with_token(
                admin,
                &[
                    "admin", "tokens", "create", "--tenant", "team-b", "--role", "user", "--name",
                    name, "-o", "json",
                ],
            )
            .expect_code(0)
            .json();
        ids.push(created["token"]["id"].as_str().unwrap().to_string());
        secrets.push(created["secret"].as_str().unwrap().to_string());
    }
    let [used, revoked] = [&ids[0], &ids[1]];
    cluster
        .carve_with_token(&secrets[0], &["jobs"])
        .expect_code(0);
    cluster
        .carve_with_token(admin, &["admin", "tokens", "revoke", revoked])
        .expect_code(0)
        .assert_stdout_contains(&format!("token {revoked} revoked at "));

    let listed = cluster
        .carve_with_token(admin, &["admin", "tokens", "list", "--tenant", "team-b"])
        .expect_code(0);
    let header = listed.stdout.lines().next().unwrap_or_default();
    for column in ["STATE", "LAST USED"] {
        assert!(header.contains(column), "{}", listed.context());
    }
    assert!(
        row_of(&listed.stdout, revoked).is_none(),
        "{}",
        listed.context()
    );
    let used_row = row_of(&listed.stdout, used).unwrap_or_else(|| panic!("{}", listed.context()));
    assert!(used_row.contains("active"), "{}", listed.context());
    // Its last use is today's date, not "-".
    let last_used = cluster.tenant_tokens_json(admin, "team-b");
    assert!(
        last_used["tokens"][0]["last_used_at"].is_string(),
        "{last_used}"
    );

    let everything = cluster
        .carve_with_token(
            admin,
            &[
                "admin", "tokens", "list", "--tenant", "team-b", "--all", "-o", "wide",
            ],
        )
        .expect_code(0);
    let revoked_row =
        row_of(&everything.stdout, revoked).unwrap_or_else(|| panic!("{}", everything.context()));
    assert!(
        revoked_row.contains("revoked 20"),
        "{}",
        everything.context()
    );

    // Deleting a tenant: admins only, never while it has jobs not finished.
    cluster
        .carve(&["admin", "tenants", "delete", "team-b"])
        .expect_code(5);
    cluster
        .carve(&[
            "submit",
            "examples/mnist-cnn.toml",
            "--set",
            "training.steps=1000000",
            "--set",
            "training.batch_size=8",
        ])
        .expect_code(0);
    cluster
        .carve_with_token(admin, &["admin", "tenants", "delete", "dev"])
        .expect_code(1)
        .assert_stderr_contains("has 1 job not finished");
    let deleted = cluster
        .carve_with_token(admin, &["admin", "tenants", "delete", "team-b"])
        .expect_code(0);
    deleted.assert_stdout_contains("tenant team-b deleted: 1 tokens revoked, 0 finished jobs");
    cluster
        .carve_with_token(&secrets[0], &["jobs"])
        .expect_code(5);
    cluster
        .carve_with_token(admin, &["admin", "tenants", "delete", "team-b"])
        .expect_code(6);
}

#[test]
fn a_drained_node_shows_its_reason_and_a_connected_worker_is_not_removed() {
    let cluster = DevCluster::start();
    let admin = &cluster.admin_token;
    // The dev worker registers a moment after the scheduler starts.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while cluster
        .carve(&["cluster", "-o", "json"])
        .expect_code(0)
        .json()["workers"]
        .as_array()
        .is_none_or(Vec::is_empty)
    {
        assert!(std::time::Instant::now() < deadline, "no worker registered");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    let drained = cluster
        .carve_with_token(
            admin,
            &["cluster", "drain", "dev-node", "--reason", "kernel upgrade"],
        )
        .expect_code(0);
    drained.assert_stdout_contains("is draining (kernel upgrade): it takes no new attempts");
    cluster
        .carve(&["cluster"])
        .expect_code(0)
        .assert_stdout_contains("draining (kernel upgrade)");
    cluster
        .carve(&["cluster", "-o", "wide"])
        .expect_code(0)
        .assert_stdout_contains("draining (kernel upgrade)");
    let workers = cluster
        .carve(&["cluster", "-o", "json"])
        .expect_code(0)
        .json();
    assert_eq!(
        workers["workers"][0]["drain_reason"], "kernel upgrade",
        "{workers}"
    );

    // The dev node's worker is connected: removing it is refused, saying why.
    let refused = cluster
        .carve_with_token(admin, &["admin", "workers", "remove", "dev-node"])
        .expect_code(1);
    refused.assert_stderr_contains("is connected");
    cluster
        .carve_with_token(admin, &["admin", "workers", "remove", "no-such-node"])
        .expect_code(6);
    // Removing is for admins.
    cluster
        .carve(&["admin", "workers", "remove", "dev-node"])
        .expect_code(5);

    // Undrained, the reason goes with the drain.
    cluster
        .carve_with_token(admin, &["cluster", "undrain", "dev-node"])
        .expect_code(0);
    let workers = cluster
        .carve(&["cluster", "-o", "json"])
        .expect_code(0)
        .json();
    assert!(
        workers["workers"][0]["drain_reason"]
            .as_str()
            .is_none_or(str::is_empty),
        "{workers}"
    );
}
