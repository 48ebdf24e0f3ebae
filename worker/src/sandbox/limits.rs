//! Which host limits one attempt's container gets: the operator's defaults
//! (`--attempt-memory`, `--attempt-pids`, `--attempt-cpus`, `--attempt-scratch`), a
//! tenant's override of any of them (`--tenant-limits TENANT:memory=...,pids=...`),
//! lowered by what the job asks for in `[resources]` (`host_memory`, `cpus`, `pids`,
//! checked by core). A job only ever lowers its limits: the smaller of the worker's and
//! the job's holds (`carve_core::spec::lower_limit`).

use std::collections::BTreeMap;

use carve_core::bytes::parse_byte_size;
use carve_core::spec::{HostLimitsRequest, lower_limit};

use super::AttemptLimits;
use crate::error::WorkerError;

/// One tenant's override of the operator's defaults; `None` keeps the default. The
/// operator may raise or lower each (a tenant with larger data loaders, a tenant held to
/// less).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TenantLimits {
    pub memory_bytes: Option<u64>,
    pub pids: Option<i64>,
    pub cpus: Option<f64>,
    /// Both `/tmp` and `/dev/shm`, as `--attempt-scratch`.
    pub scratch_bytes: Option<u64>,
}

/// Reads one `--tenant-limits` value: `TENANT:memory=32GiB,pids=8192,cpus=8,scratch=4GiB`
/// (any of the four, at least one).
pub fn parse_tenant_limits(text: &str) -> Result<(String, TenantLimits), WorkerError> {
    let invalid = |reason: String| WorkerError::invalid_setting("--tenant-limits", reason);
    let (tenant, settings) = text.split_once(':').ok_or_else(|| {
        invalid(format!(
            "{text:?}: write TENANT:memory=32GiB,pids=8192,cpus=8,scratch=4GiB"
        ))
    })?;
    let tenant = tenant.trim();
    if tenant.is_empty() {
        return Err(invalid(format!("{text:?}: the tenant's name is empty")));
    }
    let mut limits = TenantLimits::default();
    for setting in settings.split(',').map(str::trim) {
        let (name, value) = setting
            .split_once('=')
            .ok_or_else(|| invalid(format!("{setting:?} in {text:?}: write NAME=VALUE")))?;
        let value = value.trim();
        let bad = |reason: String| invalid(format!("{name}={value} for {tenant}: {reason}"));
        let bytes = || {
            parse_byte_size(value)
                .map_err(|error| bad(error.to_string()))
                .and_then(|bytes| {
                    if bytes == 0 {
                        Err(bad("must be more than 0".into()))
                    } else {
                        Ok(bytes)
                    }
                })
        };
        match name.trim() {
            "memory" => limits.memory_bytes = Some(bytes()?),
            "scratch" => limits.scratch_bytes = Some(bytes()?),
            "pids" => {
                limits.pids = Some(
                    value
                        .parse::<i64>()
                        .ok()
                        .filter(|pids| *pids > 0)
                        .ok_or_else(|| bad("must be a whole number above 0".into()))?,
                );
            }
            "cpus" => {
                limits.cpus = Some(
                    value
                        .parse::<f64>()
                        .ok()
                        .filter(|cpus| cpus.is_finite() && *cpus > 0.0)
                        .ok_or_else(|| bad("must be a number of CPUs above 0".into()))?,
                );
            }
            other => {
                return Err(invalid(format!(
                    "{other:?} for {tenant}: the limits are memory, pids, cpus and scratch"
                )));
            }
        }
    }
    Ok((tenant.to_string(), limits))
}

/// The limits of one attempt of `tenant` whose job asks for `asked`.
pub fn effective_limits(
    defaults: &AttemptLimits,
    tenants: &BTreeMap<String, TenantLimits>,
    tenant: &str,
    asked: &HostLimitsRequest,
) -> AttemptLimits {
    let overrides = tenants.get(tenant).cloned().unwrap_or_default();
    let scratch = overrides.scratch_bytes;
    let memory_bytes = overrides.memory_bytes.unwrap_or(defaults.memory_bytes);
    let pids = overrides.pids.unwrap_or(defaults.pids);
    let asked_pids = asked
        .pids
        .map(|pids| i64::try_from(pids).unwrap_or(i64::MAX));
    AttemptLimits {
        memory_bytes: lower_limit(Some(memory_bytes), asked.memory_bytes).unwrap_or(memory_bytes),
        pids: lower_limit(Some(pids), asked_pids).unwrap_or(pids),
        cpus: lower_limit(overrides.cpus.or(defaults.cpus), asked.cpus),
        tmp_bytes: scratch.unwrap_or(defaults.tmp_bytes),
        shm_bytes: scratch.unwrap_or(defaults.shm_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> AttemptLimits {
        AttemptLimits {
            memory_bytes: 16 << 30,
            pids: 4096,
            cpus: Some(8.0),
            tmp_bytes: 1 << 30,
            shm_bytes: 1 << 30,
        }
    }

    #[test]
    fn tenant_limits_are_read_and_bad_ones_say_why() {
        let (tenant, limits) =
            parse_tenant_limits("alice:memory=32GiB, pids=8192,cpus=2.5,scratch=4GiB").unwrap();
        assert_eq!(tenant, "alice");
        assert_eq!(
            limits,
            TenantLimits {
                memory_bytes: Some(32 << 30),
                pids: Some(8192),
                cpus: Some(2.5),
                scratch_bytes: Some(4 << 30),
            }
        );
        for bad in [
            "alice",
            ":memory=1GiB",
            "alice:memory",
            "alice:memory=lots",
            "alice:memory=0",
            "alice:pids=-3",
            "alice:cpus=0",
            "alice:cpus=NaN",
            "alice:gpus=2",
        ] {
            let error = parse_tenant_limits(bad).unwrap_err().to_string();
            assert!(error.starts_with("--tenant-limits"), "{bad}: {error}");
        }
    }

    #[test]
    fn a_tenants_override_replaces_the_default_and_a_job_may_only_lower_it() {
        let tenants = BTreeMap::from([(
            "alice".to_string(),
            TenantLimits {
                memory_bytes: Some(32 << 30),
                pids: Some(100),
                cpus: None,
                scratch_bytes: Some(2 << 30),
            },
        )]);
        let none = HostLimitsRequest::default();
        let alice = effective_limits(&defaults(), &tenants, "alice", &none);
        assert_eq!(alice.memory_bytes, 32 << 30);
        assert_eq!(alice.pids, 100);
        assert_eq!(alice.cpus, Some(8.0));
        assert_eq!((alice.tmp_bytes, alice.shm_bytes), (2 << 30, 2 << 30));
        assert_eq!(
            effective_limits(&defaults(), &tenants, "bob", &none),
            defaults()
        );

        let asks_less = HostLimitsRequest {
            memory_bytes: Some(4 << 30),
            cpus: Some(1.0),
            pids: Some(50),
        };
        let lowered = effective_limits(&defaults(), &tenants, "alice", &asks_less);
        assert_eq!(
            (lowered.memory_bytes, lowered.pids, lowered.cpus),
            (4 << 30, 50, Some(1.0))
        );
    }

    /// The hostile ask: a job that names more than its worker allows gets the worker's
    /// limit, for each of the three.
    #[test]
    fn a_spec_cannot_raise_its_limits() {
        let asks_more = HostLimitsRequest {
            memory_bytes: Some(1 << 40),
            cpus: Some(4096.0),
            pids: Some(u64::MAX),
        };
        let limits = effective_limits(&defaults(), &BTreeMap::new(), "mallory", &asks_more);
        assert_eq!(limits, defaults());
        // Without an operator's CPU cap the job's ask is the only one: it can only cap
        // itself.
        let uncapped = AttemptLimits {
            cpus: None,
            ..defaults()
        };
        let limits = effective_limits(&uncapped, &BTreeMap::new(), "mallory", &asks_more);
        assert_eq!(limits.cpus, Some(4096.0));
    }
}
