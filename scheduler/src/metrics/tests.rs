//! The metrics page as rendered: names, types and labels, the tenants' usage counters,
//! and every series the dashboard and the alert rules query.
use super::*;

#[test]
fn the_page_keeps_its_names_types_and_labels() {
    let metrics = Metrics::default();
    Metrics::count(&metrics.submits_accepted);
    metrics.observe_submit_latency(Duration::from_millis(3));
    let mut gauges = ClusterGauges {
        workers_ready: 2,
        log_lines_stored: 7,
        ..ClusterGauges::default()
    };
    gauges.queued_jobs.insert("alpha".to_string(), 4);
    metrics.count_rejected_submit(SubmitRejection::Quota);
    gauges.workers_draining = 1;
    gauges.gpu_capacity.insert(
        "NVIDIA H100 80GB HBM3".to_string(),
        GpuCapacity {
            gpus: 8,
            total_bytes: 8 << 30,
            allocatable_bytes: 7 << 30,
        },
    );
    let text = metrics.render(&gauges);
    let build_info = format!(
        "carve_build_info{{version=\"{}\",git_commit=\"{GIT_COMMIT}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    let expected = [
        build_info.as_str(),
        "# TYPE carve_submits_rejected_total counter",
        "carve_submits_rejected_total{reason=\"quota\"} 1",
        "carve_submits_rejected_total{reason=\"too_large\"} 0",
        "carve_submits_rejected_total{reason=\"invalid_spec\"} 0",
        "# TYPE carve_gpus gauge",
        "carve_gpus{model=\"NVIDIA H100 80GB HBM3\"} 8",
        "carve_gpu_memory_total_bytes{model=\"NVIDIA H100 80GB HBM3\"} 8589934592",
        "carve_gpu_memory_allocatable_bytes{model=\"NVIDIA H100 80GB HBM3\"} 7516192768",
        "carve_workers{state=\"draining\"} 1",
        "# HELP carve_submits_accepted_total jobs admitted.",
        "# TYPE carve_submits_accepted_total counter",
        "carve_submits_accepted_total 1",
        "carve_jobs_failed_total 0",
        "# TYPE carve_oom_retries_exhausted_total counter",
        "carve_oom_retries_exhausted_total 0",
        "# TYPE carve_log_lines_stored_total counter",
        "carve_log_lines_stored_total 7",
        "# TYPE carve_submit_latency_seconds histogram",
        "carve_submit_latency_seconds_bucket{le=\"0.002\"} 0",
        "carve_submit_latency_seconds_bucket{le=\"0.005\"} 1",
        "carve_submit_latency_seconds_bucket{le=\"1\"} 1",
        "carve_submit_latency_seconds_bucket{le=\"+Inf\"} 1",
        "carve_submit_latency_seconds_sum 0.003",
        "carve_submit_latency_seconds_count 1",
        "# TYPE carve_queued_jobs gauge",
        "carve_queued_jobs{tenant=\"alpha\"} 4",
        "# TYPE carve_workers gauge",
        "carve_workers{state=\"ready\"} 2",
        "carve_workers{state=\"lost\"} 0",
    ];
    let missing: Vec<&str> = expected
        .into_iter()
        .filter(|line| !text.lines().any(|got| got == *line))
        .collect();
    assert!(missing.is_empty(), "{missing:?} missing from:\n{text}");
}

#[test]
fn tenant_usage_counters_show_the_figures_and_never_go_down() {
    let metrics = Metrics::default();
    let figures = UsageFigures {
        tenant: "alpha".to_string(),
        gpu_type: "H100".to_string(),
        gpu_milliseconds: 7_200_500,
        vram_requested_byte_milliseconds: 3 << 40,
        vram_used_byte_milliseconds: 1 << 40,
        vram_requested_measured_byte_milliseconds: 2 << 40,
        oom_retries: 2,
        preemptions: 1,
        ..UsageFigures::default()
    };
    let key = ("alpha".to_string(), "H100".to_string());
    let first = Instant::now();
    assert!(metrics.tenant_usage_read_due(first));
    metrics.record_tenant_usage([(key.clone(), TenantUsageTotals::of(&figures))], first);
    assert!(!metrics.tenant_usage_read_due(first));
    assert!(metrics.tenant_usage_read_due(first + TENANT_USAGE_READ_INTERVAL));
    // A later read a little lower (a running attempt's stored end before the last
    // read's now) keeps the counter where it was; the rest moves on.
    let lower = UsageFigures {
        gpu_milliseconds: 7_200_000,
        preemptions: 3,
        ..figures
    };
    metrics.record_tenant_usage([(key, TenantUsageTotals::of(&lower))], first);
    let text = metrics.render(&ClusterGauges::default());
    for expected in [
        "# TYPE carve_tenant_gpu_seconds_total counter",
        "carve_tenant_gpu_seconds_total{tenant=\"alpha\",gpu_type=\"H100\"} 7200.5",
        "carve_tenant_vram_requested_byte_seconds_total{tenant=\"alpha\",gpu_type=\"H100\"} 3298534883.328",
        "carve_tenant_vram_used_byte_seconds_total{tenant=\"alpha\",gpu_type=\"H100\"} 1099511627.776",
        "carve_tenant_vram_requested_measured_byte_seconds_total{tenant=\"alpha\",gpu_type=\"H100\"} 2199023255.552",
        "carve_tenant_oom_retries_total{tenant=\"alpha\",gpu_type=\"H100\"} 2.0",
        "carve_tenant_preemptions_total{tenant=\"alpha\",gpu_type=\"H100\"} 3.0",
    ] {
        assert!(
            text.lines().any(|line| line == expected),
            "{expected} missing from:\n{text}"
        );
    }
}

/// The dashboard and the alert rules query series by the names the encoder writes (a
/// counter with its `_total`, a histogram's `_bucket`, `_sum` and `_count`): every
/// name they query is on the page, as rendered with one tenant and one GPU model
/// present. `.ci/check-deploy` reads this file's source text and can only check the
/// names up to those suffixes.
#[test]
fn every_series_the_dashboard_and_alerts_query_is_on_the_page() {
    let mut gauges = ClusterGauges::default();
    gauges.include_tenant("alpha");
    gauges
        .gpu_capacity
        .insert("model".to_string(), GpuCapacity::default());
    let metrics = Metrics::default();
    metrics.record_tenant_usage(
        [(
            ("alpha".to_string(), "model".to_string()),
            TenantUsageTotals::default(),
        )],
        Instant::now(),
    );
    let text = metrics.render(&gauges);
    let on_the_page: std::collections::HashSet<&str> = text
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .collect();
    for (file, at_least) in [
        ("deploy/grafana/carve-dashboard.json", 10),
        ("deploy/k8s/components/monitoring/prometheus-rules.yaml", 4),
    ] {
        let path = format!("{}/../{file}", env!("CARGO_MANIFEST_DIR"));
        let queries = std::fs::read_to_string(&path).unwrap();
        let queried: std::collections::BTreeSet<&str> = queries
            .match_indices("carve_")
            .map(|(start, _)| {
                let rest = &queries[start..];
                let end = rest
                    .find(|character: char| {
                        !(character.is_ascii_lowercase()
                            || character.is_ascii_digit()
                            || character == '_')
                    })
                    .unwrap_or(rest.len());
                &rest[..end]
            })
            .collect();
        assert!(
            queried.len() >= at_least,
            "found only {queried:?} in {file}"
        );
        let missing: Vec<&str> = queried
            .into_iter()
            .filter(|name| !on_the_page.contains(name))
            .collect();
        assert!(
            missing.is_empty(),
            "{file} queries {missing:?}, not on:\n{text}"
        );
    }
}
