//! The guard's state: its configuration (read once from the environment the worker
//! sets), the shared account, and this process's tables of what it has charged.
//!
//! Configuration problems make the guard fail closed: every hooked allocation (and
//! `cuInit`) answers `CUDA_ERROR_NOT_PERMITTED` and one `carve-guard: ` line on stderr says
//! why. The process state is keyed by process id: a forked child (whose id differs from
//! the one cached) registers its own slot and starts with empty tables, since the
//! parent's pointers are not its own.
#![allow(unsafe_code)] // The per-process state is published through an AtomicPtr.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use carve_guard_account::{
    Account, ENV_ACCOUNT, ENV_LIMIT_BYTES, ENV_OOM_RECORD, OomRecordLine, OverLimit, SlotIndex,
    append_oom_record,
};

use crate::driver_types::{CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_OUT_OF_MEMORY, CuResult};
use crate::pools::PoolCharge;

/// What the worker's environment says, with the account opened.
#[derive(Debug)]
pub(crate) struct Config {
    /// Opened with the environment's limit, which it holds (`Account::limit_bytes`).
    pub(crate) account: Account,
    oom_record: Option<PathBuf>,
}

static CONFIG: OnceLock<Result<Config, String>> = OnceLock::new();

fn load_config() -> Result<Config, String> {
    let limit_text = std::env::var(ENV_LIMIT_BYTES).map_err(|_| {
        format!("{ENV_LIMIT_BYTES} is not set: no memory limit, so CUDA is refused")
    })?;
    let limit_bytes = match limit_text.trim().parse::<u64>() {
        Ok(limit) if limit > 0 => limit,
        _ => {
            return Err(format!(
                "{ENV_LIMIT_BYTES}={limit_text:?} is not a positive number of bytes, so CUDA is refused"
            ));
        }
    };
    let account_path = std::env::var_os(ENV_ACCOUNT)
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| format!("{ENV_ACCOUNT} is not set: no account, so CUDA is refused"))?;
    let account = Account::open_or_create(&account_path, limit_bytes).map_err(|error| {
        format!(
            "cannot open the account {}: {error}; CUDA is refused",
            account_path.display()
        )
    })?;
    let oom_record = std::env::var_os(ENV_OOM_RECORD)
        .filter(|path| !path.is_empty())
        .map(PathBuf::from);
    Ok(Config {
        account,
        oom_record,
    })
}

/// The configuration, or why the guard fails closed.
pub(crate) fn config() -> Result<&'static Config, &'static str> {
    CONFIG
        .get_or_init(load_config)
        .as_ref()
        .map_err(String::as_str)
}

/// Writes `carve-guard: <message>` on stderr (never panics, even with stderr closed).
pub(crate) fn say(message: &str) {
    let _ = writeln!(std::io::stderr().lock(), "carve-guard: {message}");
}

static SAID_CLOSED: AtomicBool = AtomicBool::new(false);

/// Refuses a call because the guard cannot enforce the limit; says why once.
pub(crate) fn refuse_closed(reason: &str) -> CuResult {
    if !SAID_CLOSED.swap(true, Ordering::AcqRel) {
        say(reason);
    }
    CUDA_ERROR_NOT_PERMITTED
}

/// What a process has charged to the account, by kind, so a free credits exactly what
/// its allocation charged (and an unknown handle credits nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// `cuMemAlloc_v2`, `cuMemAllocPitch_v2`, `cuMemAllocManaged`: freed by `cuMemFree_v2`.
    Linear,
    /// `cuMemCreate` handles: freed by `cuMemRelease`.
    Physical,
    /// `cuArrayCreate_v2`, `cuArray3DCreate_v2`: freed by `cuArrayDestroy`.
    Array,
    /// `cuMipmappedArrayCreate`: freed by `cuMipmappedArrayDestroy`.
    MipmappedArray,
}

/// A stream-ordered allocation: its pool and size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pooled {
    pub(crate) pool: usize,
    pub(crate) bytes: u64,
}

/// One process's tables. Locks are held only around map updates, never across a call
/// into the driver.
#[derive(Debug)]
pub(crate) struct Process {
    process_id: u32,
    slot: SlotIndex,
    charged: Mutex<HashMap<(Kind, u64), u64>>,
    /// Stream-ordered allocations by device pointer.
    pooled: Mutex<HashMap<u64, Pooled>>,
    /// Pools seen, each with what the account holds for it.
    pools: Mutex<HashMap<usize, Arc<Mutex<PoolCharge>>>>,
}

/// Locks a mutex, taking the data even if a panicking thread poisoned it (the maps stay
/// consistent: every update is a single insert or remove).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Process {
    pub(crate) fn remember(&self, kind: Kind, key: u64, bytes: u64) {
        lock(&self.charged).insert((kind, key), bytes);
    }

    pub(crate) fn forget(&self, kind: Kind, key: u64) -> Option<u64> {
        lock(&self.charged).remove(&(kind, key))
    }

    pub(crate) fn remember_pooled(&self, pointer: u64, pooled: Pooled) {
        lock(&self.pooled).insert(pointer, pooled);
    }

    pub(crate) fn forget_pooled(&self, pointer: u64) -> Option<Pooled> {
        lock(&self.pooled).remove(&pointer)
    }

    /// Bytes of `pool`'s allocations not yet freed.
    pub(crate) fn outstanding_in(&self, pool: usize) -> u64 {
        lock(&self.pooled)
            .values()
            .filter(|pooled| pooled.pool == pool)
            .map(|pooled| pooled.bytes)
            .sum()
    }

    /// The charge record of `pool` if the process has one.
    pub(crate) fn existing_pool(&self, pool: usize) -> Option<Arc<Mutex<PoolCharge>>> {
        lock(&self.pools).get(&pool).map(Arc::clone)
    }

    /// The charge record of `pool`, created at first sight.
    pub(crate) fn pool(&self, pool: usize) -> Arc<Mutex<PoolCharge>> {
        Arc::clone(lock(&self.pools).entry(pool).or_default())
    }

    pub(crate) fn known_pools(&self) -> Vec<(usize, Arc<Mutex<PoolCharge>>)> {
        lock(&self.pools)
            .iter()
            .map(|(pool, charge)| (*pool, Arc::clone(charge)))
            .collect()
    }

    pub(crate) fn drop_pool(&self, pool: usize) -> Option<Arc<Mutex<PoolCharge>>> {
        lock(&self.pools).remove(&pool)
    }
}

/// This process's state; replaced (the old one leaked on purpose) when the process id
/// changes, i.e. in a forked child, whose copy of the parent's locks may be held by
/// threads that do not exist in the child.
static PROCESS: AtomicPtr<Process> = AtomicPtr::new(std::ptr::null_mut());

/// The guard as a hook sees it: the configuration and this process's state.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Guard {
    pub(crate) config: &'static Config,
    pub(crate) process: &'static Process,
}

/// The guard for this call, or the fail-closed answer.
pub(crate) fn guard() -> Result<Guard, CuResult> {
    let config = config().map_err(refuse_closed)?;
    let process_id = std::process::id();
    loop {
        let current = PROCESS.load(Ordering::Acquire);
        // SAFETY: a published Process is leaked, so a non-null pointer stays valid forever.
        if let Some(process) = unsafe { current.as_ref() }
            && process.process_id == process_id
        {
            return Ok(Guard { config, process });
        }
        let slot = config.account.register(process_id).map_err(|error| {
            refuse_closed(&format!(
                "cannot register process {process_id} in the account: {error}; CUDA is refused"
            ))
        })?;
        let fresh = Box::into_raw(Box::new(Process {
            process_id,
            slot,
            charged: Mutex::default(),
            pooled: Mutex::default(),
            pools: Mutex::default(),
        }));
        match PROCESS.compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                // SAFETY: `fresh` came from Box::into_raw just above and is now leaked.
                let process = unsafe { &*fresh };
                return Ok(Guard { config, process });
            }
            // SAFETY: `fresh` was never published; this thread still owns it alone.
            Err(_) => drop(unsafe { Box::from_raw(fresh) }),
        }
    }
}

/// At a normal exit the driver frees everything the process held, so its share goes back
/// to the account now rather than when a later reservation finds the process dead (a
/// killed process still waits for that). A forked child that never used CUDA has no
/// state of its own and gives back nothing.
extern "C" fn give_back_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        let current = PROCESS.load(Ordering::Acquire);
        // SAFETY: a published Process is leaked, so a non-null pointer stays valid forever.
        let Some(process) = (unsafe { current.as_ref() }) else {
            return;
        };
        if process.process_id == std::process::id()
            && let Ok(config) = config()
        {
            config.account.release(process.slot, u64::MAX);
        }
    });
}

// SAFETY: `.fini_array` holds the functions the C runtime calls at exit; this entry is a
// plain `extern "C" fn()` that never unwinds.
#[used]
#[unsafe(link_section = ".fini_array")]
static GIVE_BACK_AT_EXIT: extern "C" fn() = give_back_at_exit;

impl Guard {
    /// Charges `bytes` before the driver is asked, so that concurrent threads and
    /// processes never exceed the limit together. Over the limit it first credits what
    /// pools gave back unseen, then refuses with `CUDA_ERROR_OUT_OF_MEMORY` and an OOM
    /// record naming `entry_point` (as the program called it).
    pub(crate) fn reserve(&self, entry_point: &str, bytes: u64) -> Result<(), CuResult> {
        self.reserve_for(entry_point, bytes, bytes)
    }

    /// As `reserve`, but the record says `requested_bytes` (a pool asks the account only
    /// for what it cannot serve from its free reserve).
    pub(crate) fn reserve_for(
        &self,
        entry_point: &str,
        bytes: u64,
        requested_bytes: u64,
    ) -> Result<(), CuResult> {
        if bytes == 0 || self.try_reserve(bytes).is_ok() {
            return Ok(());
        }
        crate::pools::reconcile_all(*self);
        match self.try_reserve(bytes) {
            Ok(()) => Ok(()),
            Err(over) => {
                self.record_out_of_memory(entry_point, requested_bytes, over);
                Err(CUDA_ERROR_OUT_OF_MEMORY)
            }
        }
    }

    /// Charges without reconciling pools or recording a refusal.
    pub(crate) fn try_reserve(&self, bytes: u64) -> Result<(), OverLimit> {
        self.config
            .account
            .try_reserve(self.process.slot, bytes)
            .map(|_| ())
    }

    pub(crate) fn release(&self, bytes: u64) {
        if bytes > 0 {
            self.config.account.release(self.process.slot, bytes);
        }
    }

    /// Appends one line to the attempt's OOM record.
    pub(crate) fn record_out_of_memory(
        &self,
        entry_point: &str,
        requested_bytes: u64,
        over: OverLimit,
    ) {
        let Some(path) = &self.config.oom_record else {
            return;
        };
        let line = OomRecordLine {
            entry_point: entry_point.to_owned(),
            requested_bytes,
            in_use_bytes: over.in_use_bytes,
            limit_bytes: over.limit_bytes,
            peak_bytes: over.peak_bytes,
            process_id: self.process.process_id,
            time_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |since| since.as_millis() as u64),
        };
        if let Err(error) = append_oom_record(path, &line) {
            say(&format!(
                "cannot append to the OOM record {}: {error}",
                path.display()
            ));
        }
    }

    /// Bytes the whole attempt holds now.
    pub(crate) fn in_use_bytes(&self) -> u64 {
        self.config.account.usage().in_use_bytes
    }
}
