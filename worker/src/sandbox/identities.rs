//! Each tenant's own range of host uids and gids, kept in a small file so that a tenant
//! keeps its range across worker restarts (the files its programs wrote stay its own)
//! and two tenants never share one. Ranges are handed out in the order tenants first
//! run here: tenant number n gets `first + n * size .. first + (n + 1) * size`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::WorkerError;

/// A tenant's host id range: container id k is host id `first_host_id + k`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantIdentity {
    pub first_host_id: u32,
    pub size: u32,
}

/// The file's content: tenant name to its number.
#[derive(Debug, Default, Serialize, Deserialize)]
struct TenantNumbers {
    tenants: BTreeMap<String, u32>,
}

/// The table of tenants' ranges, loaded from and saved to one file.
#[derive(Debug)]
pub struct TenantIdentities {
    file: PathBuf,
    first_host_id: u32,
    size: u32,
    numbers: TenantNumbers,
}

impl TenantIdentities {
    /// Loads the table (an empty one when the file does not exist yet).
    pub fn open(
        file: &Path,
        first_host_id: u32,
        size: u32,
    ) -> Result<TenantIdentities, WorkerError> {
        let numbers = match std::fs::read(file) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|error| WorkerError::Io {
                context: format!("{} is not a table of tenants' ids", file.display()),
                source: std::io::Error::other(error),
            })?,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => TenantNumbers::default(),
            Err(error) => {
                return Err(WorkerError::io(
                    format!("cannot read {}", file.display()),
                    error,
                ));
            }
        };
        Ok(TenantIdentities {
            file: file.to_path_buf(),
            first_host_id,
            size,
            numbers,
        })
    }

    /// `tenant`'s range, giving it the next free one (saved before it is used) the first
    /// time.
    pub fn identity_of(&mut self, tenant: &str) -> Result<TenantIdentity, WorkerError> {
        if tenant.is_empty() {
            // An assignment from a scheduler older than the tenant field: no range can
            // be told apart from another tenant's, so it is refused, not guessed.
            return Err(WorkerError::Attempt(
                "the assignment names no tenant, so its container cannot get the tenant's \
                 own ids: upgrade the scheduler"
                    .to_string(),
            ));
        }
        let number = match self.numbers.tenants.get(tenant) {
            Some(number) => *number,
            None => {
                let next = self
                    .numbers
                    .tenants
                    .values()
                    .max()
                    .map_or(0, |largest| largest + 1);
                self.numbers.tenants.insert(tenant.to_string(), next);
                if let Err(error) = self.save() {
                    self.numbers.tenants.remove(tenant);
                    return Err(error);
                }
                next
            }
        };
        let first_host_id = number
            .checked_mul(self.size)
            .and_then(|offset| offset.checked_add(self.first_host_id))
            .filter(|first| first.checked_add(self.size).is_some())
            .ok_or_else(|| {
                WorkerError::Attempt(format!(
                    "no host ids left for tenant {tenant} (number {number}): lower \
                     --sandbox-first-uid"
                ))
            })?;
        Ok(TenantIdentity {
            first_host_id,
            size: self.size,
        })
    }

    /// Writes the table whole (a temporary file renamed over the old one), so a crash
    /// leaves the old table or the new one, never half of one.
    fn save(&self) -> Result<(), WorkerError> {
        let text = serde_json::to_vec_pretty(&self.numbers)
            .map_err(|error| WorkerError::Attempt(format!("tenant ids: {error}")))?;
        let temporary = self.file.with_extension("json.new");
        std::fs::write(&temporary, text)
            .and_then(|()| std::fs::rename(&temporary, &self.file))
            .map_err(|error| {
                WorkerError::io(format!("cannot write {}", self.file.display()), error)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_get_distinct_ranges_that_survive_a_restart() {
        let directory = tempfile::tempdir().unwrap();
        let file = directory.path().join("tenant-ids.json");
        let mut table = TenantIdentities::open(&file, 1_000_000, 65_536).unwrap();
        let alice = table.identity_of("alice").unwrap();
        let bob = table.identity_of("bob").unwrap();
        assert_eq!(alice.first_host_id, 1_000_000);
        assert_eq!(bob.first_host_id, 1_065_536);
        assert_eq!(table.identity_of("alice").unwrap(), alice);
        let mut reopened = TenantIdentities::open(&file, 1_000_000, 65_536).unwrap();
        assert_eq!(reopened.identity_of("bob").unwrap(), bob);
        assert_eq!(
            reopened.identity_of("carol").unwrap().first_host_id,
            1_131_072
        );
    }

    #[test]
    fn no_tenant_and_no_room_are_refused() {
        let directory = tempfile::tempdir().unwrap();
        let file = directory.path().join("tenant-ids.json");
        let mut table = TenantIdentities::open(&file, u32::MAX - 70_000, 65_536).unwrap();
        assert!(table.identity_of("").is_err());
        assert!(table.identity_of("first").is_ok());
        let error = table.identity_of("second").unwrap_err().to_string();
        assert!(error.contains("no host ids left"), "{error}");
    }
}
