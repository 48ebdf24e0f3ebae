//! `carve admin` as an operator uses it, the real binary against `carve dev`: tokens list
//! their state and last use, revoked and expired ones on request (`--all`); tenant names
//! are lowercase; a tenant is deleted with its tokens, but not while it has jobs running.

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
