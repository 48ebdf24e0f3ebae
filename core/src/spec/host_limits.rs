//! What a job may ask of its attempt's host resources (`[resources]` `host_memory`,
//! `cpus`, `pids`): less than its worker allows, never more. The worker's limit (its
//! operator's default, or the tenant's override) stays the ceiling; a job's ask only
//! lowers it (the effective limit is the smaller of the two), so a spec cannot raise
//! what its container gets. Read and checked here, with errors that name the field.

use crate::bytes::parse_byte_size;
use crate::error::FieldError;

/// The smallest host memory a job may ask for: a container below a few MiB cannot even
/// start its runtime's init, and a job that asks for less meant another unit.
pub const MIN_HOST_MEMORY_BYTES: u64 = 16 << 20;

/// The most CPUs a job may name: more than any node has, so a larger number is a typo.
pub const MAX_CPUS: f64 = 4096.0;

/// A job's asks, read; `None`: the worker's limit alone.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HostLimitsRequest {
    /// `resources.host_memory`: the container's memory (its `/tmp` included).
    pub memory_bytes: Option<u64>,
    /// `resources.cpus`: CPUs' worth of time (e.g. 2 or 0.5).
    pub cpus: Option<f64>,
    /// `resources.pids`: processes and threads.
    pub pids: Option<u64>,
}

impl HostLimitsRequest {
    /// Reads a spec's three fields, or says which one is wrong and why.
    pub fn read(
        host_memory: Option<&str>,
        cpus: Option<f64>,
        pids: Option<u64>,
    ) -> Result<HostLimitsRequest, FieldError> {
        let memory_bytes = host_memory
            .map(|text| {
                let refused = |reason: String| {
                    FieldError::new("resources.host_memory", format!("{text:?}: {reason}"))
                };
                let bytes = parse_byte_size(text).map_err(|error| refused(error.to_string()))?;
                if bytes < MIN_HOST_MEMORY_BYTES {
                    return Err(refused(format!(
                        "is under the smallest container, 16MiB (did you mean {text}GiB?)"
                    )));
                }
                Ok(bytes)
            })
            .transpose()?;
        if let Some(cpus) = cpus
            && !(cpus.is_finite() && (0.01..=MAX_CPUS).contains(&cpus))
        {
            return Err(FieldError::new(
                "resources.cpus",
                format!("{cpus}: must be between 0.01 and {MAX_CPUS} CPUs"),
            ));
        }
        if pids == Some(0) {
            return Err(FieldError::new(
                "resources.pids",
                "0: a program needs at least 1 process",
            ));
        }
        Ok(HostLimitsRequest {
            memory_bytes,
            cpus,
            pids,
        })
    }
}

/// The limit that holds: the worker's, lowered by the job's ask where it asks for less.
/// `None` is "no limit" for the worker (a CPU cap it does not set) and "no ask" for the
/// job.
pub fn lower_limit<T: PartialOrd + Copy>(worker: Option<T>, asked: Option<T>) -> Option<T> {
    match (worker, asked) {
        (Some(worker), Some(asked)) if asked < worker => Some(asked),
        (Some(worker), _) => Some(worker),
        (None, asked) => asked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_are_read_and_bad_ones_name_their_field() {
        assert_eq!(
            HostLimitsRequest::read(Some("8GiB"), Some(2.5), Some(512)).unwrap(),
            HostLimitsRequest {
                memory_bytes: Some(8 << 30),
                cpus: Some(2.5),
                pids: Some(512),
            }
        );
        assert_eq!(
            HostLimitsRequest::read(None, None, None).unwrap(),
            HostLimitsRequest::default()
        );
        let refused = |memory: Option<&str>, cpus: Option<f64>, pids: Option<u64>| {
            HostLimitsRequest::read(memory, cpus, pids).unwrap_err()
        };
        let error = refused(Some("8"), None, None);
        assert_eq!(error.field, "resources.host_memory");
        assert!(error.reason.contains("8GiB"), "{error}");
        assert_eq!(
            refused(Some("lots"), None, None).field,
            "resources.host_memory"
        );
        for cpus in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e9] {
            assert_eq!(refused(None, Some(cpus), None).field, "resources.cpus");
        }
        assert_eq!(refused(None, None, Some(0)).field, "resources.pids");
    }

    /// Validation of a whole `[resources]` table reads them: a spec that asks badly is
    /// refused at submit, naming the field.
    #[test]
    fn a_spec_with_a_bad_ask_is_refused_by_validation() {
        use crate::spec::ResourcesSpec;
        let resources = ResourcesSpec {
            pids: Some(0),
            ..ResourcesSpec::default()
        };
        let error = crate::validate::validate_resources(&resources).unwrap_err();
        assert_eq!(error.field, "resources.pids");
        let resources = ResourcesSpec {
            host_memory: Some("4GiB".into()),
            cpus: Some(1.0),
            pids: Some(64),
            ..ResourcesSpec::default()
        };
        crate::validate::validate_resources(&resources).unwrap();
        // A TOML job file writes them as numbers and a size.
        let table: ResourcesSpec =
            toml::from_str("host_memory = \"4GiB\"\ncpus = 2\npids = 64\n").unwrap();
        assert_eq!(table.cpus, Some(2.0));
        assert_eq!(table.pids, Some(64));
    }

    /// A job can lower its limits, never raise them: whatever it asks, the limit that
    /// holds is at most the worker's.
    #[test]
    fn a_job_cannot_raise_a_limit_only_lower_it() {
        assert_eq!(lower_limit(Some(16u64), Some(8)), Some(8));
        assert_eq!(lower_limit(Some(16u64), Some(64)), Some(16));
        assert_eq!(lower_limit(Some(16u64), None), Some(16));
        // The worker sets no CPU cap: the job's ask is the cap.
        assert_eq!(lower_limit(None, Some(2.0)), Some(2.0));
        assert_eq!(lower_limit::<f64>(None, None), None);
    }
}
