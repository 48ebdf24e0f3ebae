//! The account file: a header (the limit, the attempt's total in use and its peak) and
//! [`SLOT_COUNT`] process slots, mapped shared by every process of the attempt.
//!
//! Every operation is a lock-free atomic on the mapping, so any thread of any process may
//! call any of them at once, and a process killed in the middle leaves nothing locked.
//! The total is the one number the limit is checked against: a reservation is a
//! compare-and-swap on it, so concurrent reservations can never exceed the limit
//! together. Each slot keeps its process's share, so the share of a process that died
//! without freeing (a killed data-loader worker) can be taken back from the total.
//! Subtractions saturate: a mistake elsewhere can make the account too generous by the
//! mistaken amount, never wrap it to 2^64 and refuse everything.

// The mapping is shared memory: creating, reading and unmapping it is FFI.
#![allow(unsafe_code)]

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::AccountError;

/// Process slots in one account: far more than the processes of one attempt (HAMi-core
/// uses as many for a whole container).
pub const SLOT_COUNT: usize = 1024;

const MAGIC: u64 = u64::from_le_bytes(*b"CARVEACC");
const LAYOUT_VERSION: u32 = 1;
/// A slot's process id while its dead owner's share is being taken back.
const RECLAIMING: u32 = u32::MAX;

#[repr(C)]
struct Header {
    magic: u64,
    layout_version: u32,
    slot_count: u32,
    limit_bytes: u64,
    in_use_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    _reserved: [u64; 3],
}

#[repr(C)]
struct Slot {
    /// 0 when free, [`RECLAIMING`] while being taken back.
    process_id: AtomicU32,
    _padding: u32,
    in_use_bytes: AtomicU64,
    peak_bytes: AtomicU64,
    _reserved: u64,
}

#[repr(C)]
struct Layout {
    header: Header,
    slots: [Slot; SLOT_COUNT],
}

const FILE_BYTES: usize = std::mem::size_of::<Layout>();

/// A process's slot in the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotIndex(pub u32);

/// The attempt's numbers just after a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    pub in_use_bytes: u64,
    pub peak_bytes: u64,
}

/// A refused reservation, with what the OOM record needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverLimit {
    pub requested_bytes: u64,
    pub in_use_bytes: u64,
    pub limit_bytes: u64,
    pub peak_bytes: u64,
}

/// The attempt's memory as the account holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountUsage {
    pub limit_bytes: u64,
    pub in_use_bytes: u64,
    pub peak_bytes: u64,
    pub processes: Vec<ProcessUsage>,
}

/// One live slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUsage {
    pub process_id: u32,
    pub in_use_bytes: u64,
    pub peak_bytes: u64,
}

/// One mapped account file.
#[derive(Debug)]
pub struct Account {
    layout: std::ptr::NonNull<Layout>,
    path: PathBuf,
}

// SAFETY: the mapping lives as long as the Account, and every field another thread or
// process may change is an atomic; the plain header fields are written once, before the
// file is visible under its name (see `write_new_file`), and only read after.
unsafe impl Send for Account {}
// SAFETY: as for Send: shared access only goes through atomics or immutable fields.
unsafe impl Sync for Account {}

impl Drop for Account {
    fn drop(&mut self) {
        // SAFETY: `layout` is the start of a FILE_BYTES mapping made by `map`, unmapped
        // only here, and no reference into it outlives `self`.
        unsafe {
            libc::munmap(self.layout.as_ptr().cast(), FILE_BYTES);
        }
    }
}

impl Account {
    /// A new, empty account at `path`, replacing any file there (a retried attempt
    /// starts from zero).
    pub fn create(path: &Path, limit_bytes: u64) -> Result<Account, AccountError> {
        let staged = write_new_file(path, limit_bytes)?;
        std::fs::rename(&staged, path).map_err(|source| io_error(path, source))?;
        Account::open(path)
    }

    /// Joins the account at `path`, creating it when there is none; an existing
    /// account's limit must be `limit_bytes`. Processes racing to create it end up in one
    /// account: the file appears under its name whole or not at all (`link` fails when
    /// another process got there first).
    pub fn open_or_create(path: &Path, limit_bytes: u64) -> Result<Account, AccountError> {
        if !path.exists() {
            let staged = write_new_file(path, limit_bytes)?;
            let linked = std::fs::hard_link(&staged, path);
            let _ = std::fs::remove_file(&staged);
            match linked {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(source) => return Err(io_error(path, source)),
            }
        }
        let account = Account::open(path)?;
        if account.limit_bytes() != limit_bytes {
            return Err(AccountError::LimitMismatch {
                path: path.to_path_buf(),
                account_limit_bytes: account.limit_bytes(),
                expected_limit_bytes: limit_bytes,
            });
        }
        Ok(account)
    }

    /// Maps an existing account, checking that it is one. Never through a symbolic link
    /// and only a regular file: the account lives in a directory the job may write, and
    /// the worker, which reads it with more rights than the job, must not be sent to
    /// another attempt's account or any other file.
    pub fn open(path: &Path) -> Result<Account, AccountError> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .map_err(|source| io_error(path, source))?;
        let metadata = file.metadata().map_err(|source| io_error(path, source))?;
        if !metadata.is_file() {
            return Err(not_an_account(path, "not a regular file".into()));
        }
        let length = metadata.len();
        if length != FILE_BYTES as u64 {
            return Err(not_an_account(
                path,
                format!("{length} bytes, an account has {FILE_BYTES}"),
            ));
        }
        let account = Account {
            layout: map(&file, path)?,
            path: path.to_path_buf(),
        };
        let header = &account.layout().header;
        if header.magic != MAGIC {
            return Err(not_an_account(path, "wrong magic number".into()));
        }
        if header.layout_version != LAYOUT_VERSION || header.slot_count as usize != SLOT_COUNT {
            return Err(not_an_account(
                path,
                format!(
                    "layout {} with {} slots, this build reads layout {LAYOUT_VERSION} with \
                     {SLOT_COUNT}",
                    header.layout_version, header.slot_count
                ),
            ));
        }
        Ok(account)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn limit_bytes(&self) -> u64 {
        self.layout().header.limit_bytes
    }

    /// Claims a slot for `process_id`. A slot the id already holds belonged to the
    /// program this process ran before `exec` (whose device memory the driver freed with
    /// its context), so its share is taken back and the slot reused. When no slot is
    /// free, dead processes' slots are reclaimed first.
    pub fn register(&self, process_id: u32) -> Result<SlotIndex, AccountError> {
        let slots = &self.layout().slots;
        if let Some(index) = slots
            .iter()
            .position(|slot| slot.process_id.load(Ordering::Acquire) == process_id)
        {
            let slot = &slots[index];
            let share = slot.in_use_bytes.swap(0, Ordering::AcqRel);
            slot.peak_bytes.store(0, Ordering::Release);
            self.subtract_from_total(share);
            return Ok(SlotIndex(index as u32));
        }
        for attempt in 0..2 {
            for (index, slot) in slots.iter().enumerate() {
                if slot
                    .process_id
                    .compare_exchange(0, process_id, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return Ok(SlotIndex(index as u32));
                }
            }
            if attempt == 0 {
                self.reclaim_dead_processes();
            }
        }
        Err(AccountError::NoFreeSlot)
    }

    /// Charges `bytes` to `slot` if the attempt's total stays within the limit. On
    /// refusal, dead processes' shares are taken back and the reservation tried once
    /// more, so memory a killed process never freed does not refuse the living.
    pub fn try_reserve(&self, slot: SlotIndex, bytes: u64) -> Result<Reserved, OverLimit> {
        match self.reserve_once(slot, bytes) {
            Ok(reserved) => Ok(reserved),
            Err(refused) => {
                if self.reclaim_dead_processes() > 0 {
                    self.reserve_once(slot, bytes)
                } else {
                    Err(refused)
                }
            }
        }
    }

    fn reserve_once(&self, slot: SlotIndex, bytes: u64) -> Result<Reserved, OverLimit> {
        let header = &self.layout().header;
        let limit_bytes = header.limit_bytes;
        let mut current = header.in_use_bytes.load(Ordering::Acquire);
        let in_use_bytes = loop {
            let wanted = current
                .checked_add(bytes)
                .filter(|&wanted| wanted <= limit_bytes);
            let Some(wanted) = wanted else {
                return Err(OverLimit {
                    requested_bytes: bytes,
                    in_use_bytes: current,
                    limit_bytes,
                    peak_bytes: header.peak_bytes.load(Ordering::Acquire),
                });
            };
            match header.in_use_bytes.compare_exchange_weak(
                current,
                wanted,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break wanted,
                Err(actual) => current = actual,
            }
        };
        let peak_bytes = header
            .peak_bytes
            .fetch_max(in_use_bytes, Ordering::AcqRel)
            .max(in_use_bytes);
        if let Some(slot) = self.slot(slot) {
            let share = slot.in_use_bytes.fetch_add(bytes, Ordering::AcqRel) + bytes;
            slot.peak_bytes.fetch_max(share, Ordering::AcqRel);
        }
        Ok(Reserved {
            in_use_bytes,
            peak_bytes,
        })
    }

    /// Gives `bytes` back. A slot never goes below zero, and the total drops by what the
    /// slot actually gave, so the total stays the sum of the slots.
    pub fn release(&self, slot: SlotIndex, bytes: u64) {
        let Some(slot) = self.slot(slot) else {
            return;
        };
        let before = slot
            .in_use_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |share| {
                Some(share.saturating_sub(bytes))
            })
            .unwrap_or_else(|share| share);
        self.subtract_from_total(before.min(bytes));
    }

    /// Takes back the shares of processes that no longer exist; returns the bytes given
    /// back.
    pub fn reclaim_dead_processes(&self) -> u64 {
        let mut reclaimed = 0;
        for slot in &self.layout().slots {
            let process_id = slot.process_id.load(Ordering::Acquire);
            if process_id == 0 || process_id == RECLAIMING || process_is_alive(process_id) {
                continue;
            }
            // Only one reclaimer wins the slot; the dead owner cannot touch it any more.
            if slot
                .process_id
                .compare_exchange(process_id, RECLAIMING, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                continue;
            }
            let share = slot.in_use_bytes.swap(0, Ordering::AcqRel);
            slot.peak_bytes.store(0, Ordering::Release);
            self.subtract_from_total(share);
            reclaimed += share;
            slot.process_id.store(0, Ordering::Release);
        }
        reclaimed
    }

    /// The attempt's numbers now, with every live slot.
    pub fn usage(&self) -> AccountUsage {
        let layout = self.layout();
        let processes = layout
            .slots
            .iter()
            .filter_map(|slot| {
                let process_id = slot.process_id.load(Ordering::Acquire);
                (process_id != 0 && process_id != RECLAIMING).then(|| ProcessUsage {
                    process_id,
                    in_use_bytes: slot.in_use_bytes.load(Ordering::Acquire),
                    peak_bytes: slot.peak_bytes.load(Ordering::Acquire),
                })
            })
            .collect();
        AccountUsage {
            limit_bytes: layout.header.limit_bytes,
            in_use_bytes: layout.header.in_use_bytes.load(Ordering::Acquire),
            peak_bytes: layout.header.peak_bytes.load(Ordering::Acquire),
            processes,
        }
    }

    fn subtract_from_total(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let _ = self.layout().header.in_use_bytes.fetch_update(
            Ordering::AcqRel,
            Ordering::Acquire,
            |total| Some(total.saturating_sub(bytes)),
        );
    }

    fn slot(&self, slot: SlotIndex) -> Option<&Slot> {
        self.layout().slots.get(slot.0 as usize)
    }

    fn layout(&self) -> &Layout {
        // SAFETY: `layout` points at a live FILE_BYTES mapping (unmapped only on drop),
        // page-aligned, so every field is aligned; all zeroes and any bytes written by
        // another process are valid values for these integer and atomic fields.
        unsafe { self.layout.as_ref() }
    }
}

/// Writes a complete new account next to `path` under a name of this process's own and
/// returns that name, so the account only ever appears under `path` whole.
fn write_new_file(path: &Path, limit_bytes: u64) -> Result<PathBuf, AccountError> {
    let file_name = path
        .file_name()
        .ok_or_else(|| not_an_account(path, "the path has no file name".into()))?;
    let staged = path.with_file_name(format!(
        ".{}.{}.new",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let mut bytes = vec![0u8; FILE_BYTES];
    let mut put = |offset: usize, value: &[u8]| {
        bytes[offset..offset + value.len()].copy_from_slice(value);
    };
    put(std::mem::offset_of!(Header, magic), &MAGIC.to_ne_bytes());
    put(
        std::mem::offset_of!(Header, layout_version),
        &LAYOUT_VERSION.to_ne_bytes(),
    );
    put(
        std::mem::offset_of!(Header, slot_count),
        &(SLOT_COUNT as u32).to_ne_bytes(),
    );
    put(
        std::mem::offset_of!(Header, limit_bytes),
        &limit_bytes.to_ne_bytes(),
    );
    // A new file, never one already there: the directory is the job's, and whatever it
    // left under this name (a symbolic link to a file of the host, say) must not be
    // written through by the worker.
    match std::fs::remove_file(&staged) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(io_error(&staged, source)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(&staged)
        .map_err(|source| io_error(&staged, source))?;
    file.write_all(&bytes)
        .map_err(|source| io_error(&staged, source))?;
    Ok(staged)
}

fn map(file: &File, path: &Path) -> Result<std::ptr::NonNull<Layout>, AccountError> {
    // SAFETY: a fresh shared mapping of an open file whose length was checked to be
    // FILE_BYTES; the kernel keeps the mapping after the descriptor closes.
    let address = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            FILE_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if address == libc::MAP_FAILED {
        return Err(io_error(path, std::io::Error::last_os_error()));
    }
    std::ptr::NonNull::new(address.cast())
        .ok_or_else(|| not_an_account(path, "mapped at address zero".into()))
}

/// Whether a process exists (a zombie still does; EPERM means it exists under another
/// user).
fn process_is_alive(process_id: u32) -> bool {
    let Ok(process_id) = libc::pid_t::try_from(process_id) else {
        return false;
    };
    // SAFETY: signal 0 sends nothing; kill only checks that the process exists.
    let result = unsafe { libc::kill(process_id, 0) };
    result == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn io_error(path: &Path, source: std::io::Error) -> AccountError {
    AccountError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn not_an_account(path: &Path, reason: String) -> AccountError {
    AccountError::NotAnAccount {
        path: path.to_path_buf(),
        reason,
    }
}

#[cfg(test)]
mod tests;
