//! A fake CUDA driver (`libcuda.so.1`) and NVML (`libnvidia-ml.so.1`) in one shared
//! library, backed by host memory, so the guard and command jobs can be tested on machines
//! without a GPU.
//!
//! Tests put symlinks named `libcuda.so.1`, `libcuda.so`, `libnvidia-ml.so.1` and
//! `libnvidia-ml.so` to `target/<profile>/deps/libcarve_fake_driver.so` in a directory on
//! the program's `LD_LIBRARY_PATH`. The exports follow the real driver's C ABI (types as in
//! `cuda.h`; cudarc's sys bindings were the reference). What the fake promises:
//!
//! - One device, ordinal 0, "Carve Fake GPU", uuid [`DEVICE_UUID`], with
//!   `CARVE_FAKE_CUDA_TOTAL_BYTES` of memory (default 16 GiB), read once when the library
//!   is first used. `cuDriverGetVersion` says 13000.
//! - Device memory is host memory: every allocation is its own anonymous `MAP_NORESERVE`
//!   mapping (freed ones are reused by length, see `host_memory.rs`) and the device pointer
//!   is its host address, so untouched pages cost nothing and `cuMemcpy*` are plain copies.
//! - Everything the driver holds counts against the capacity: plain, pitched and managed
//!   allocations, virtual-memory physical handles, arrays, and the RESERVED bytes of every
//!   memory pool. Past it: `CUDA_ERROR_OUT_OF_MEMORY`.
//! - Calls before `cuInit` return `CUDA_ERROR_NOT_INITIALIZED`, except those the real
//!   driver answers before it (`cuDriverGetVersion`, `cuGetProcAddress(_v2)`,
//!   `cuGetErrorName/String`) and `carveFakeDriverStats`. Null out-pointers, unknown device
//!   pointers (a free, a copy) and unknown pool, array or physical handles are
//!   `CUDA_ERROR_INVALID_VALUE`, as the real driver answers; an unknown stream is
//!   `CUDA_ERROR_INVALID_HANDLE`, an unknown context `CUDA_ERROR_INVALID_CONTEXT`.
//! - On a worker's simulated GPU the device's memory is the worker's ledger, outside the
//!   program (`device_ledger.rs`): every grant is asked of it, and `cuInit` fails with
//!   `CUDA_ERROR_NO_DEVICE` when it cannot be reached.
//! - Lenient where the guard does not care: allocations need no current context and
//!   `CUDA_VISIBLE_DEVICES` is ignored.
//!
//! One global mutex holds the whole state, and every export runs inside [`cuda_call`] or
//! its NVML counterpart, which catch panics so none unwinds into C.
//!
//! Loading a COPY of the library file (another inode) gives a second, independent driver in
//! the same process: the crate's tests do that to run in parallel without sharing state.

#![allow(unsafe_code)]

/// Defines C exports that share one signature and one body: a call and its twin under
/// another name (the per-thread-stream `_ptsz`/`_ptds` variant, or a `_v2` whose ABI did not
/// change), which the fake runs alike since everything it does is synchronous.
macro_rules! exports_alike {
    ($($name:ident),+ => $arguments:tt $body:block) => {
        $(
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name $arguments -> $crate::CUresult $body
        )+
    };
}

mod arrays;
mod context;
mod device_ledger;
mod errors;
mod host_memory;
mod memory;
mod nvml;
mod pools;
mod proc_address;
mod virtual_memory;

pub use device_ledger::{CONTAINER_DEVICE_PATH, ENV_DEVICE_SOCKET};

use std::collections::{BTreeMap, HashSet};
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// `CUresult`: a C enum the real header declares with only non-negative values.
pub type CUresult = u32;
/// `CUdeviceptr`: a device address (64 bits since CUDA 3.2).
pub type CUdeviceptr = u64;
/// `CUdevice`: a device ordinal.
pub type CUdevice = i32;
/// `CUcontext`, `CUstream`, `CUmemoryPool`, `CUarray`, `CUmipmappedArray`: opaque handles.
pub type Handle = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// The environment variable that sets the device's memory in bytes (decimal).
pub const ENV_TOTAL_BYTES: &str = "CARVE_FAKE_CUDA_TOTAL_BYTES";
/// The capacity without [`ENV_TOTAL_BYTES`]: 16 GiB.
pub const DEFAULT_TOTAL_BYTES: u64 = 16 << 30;
/// What `cuDriverGetVersion` answers.
pub const DRIVER_VERSION: i32 = 13000;
/// The device's name, as `cuDeviceGetName` writes it.
pub const DEVICE_NAME: &str = "Carve Fake GPU";
/// The device's uuid; as text `GPU-ca4fc0de-0000-4000-8000-00000000fa4e`.
pub const DEVICE_UUID: [u8; 16] = [
    0xca, 0x4f, 0xc0, 0xde, 0x00, 0x00, 0x40, 0x00, 0x80, 0x00, 0x00, 0x00, 0x00, 0x00, 0xfa, 0x4e,
];
/// The virtual-memory granularity `cuMemGetAllocationGranularity` answers: 2 MiB.
pub const GRANULARITY: u64 = 2 << 20;

/// What `carveFakeDriverStats` writes: the driver's truth, for tests to compare with what
/// the guard believes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CarveFakeDriverStats {
    /// Everything the driver holds against the capacity, pools' reserved bytes included.
    pub bytes_in_use: u64,
    /// The reserved bytes of all memory pools together (part of `bytes_in_use`).
    pub pool_reserved_bytes: u64,
    /// Live allocations: device pointers not yet freed (pool ones included), physical
    /// handles not yet released, arrays and mipmapped arrays not yet destroyed.
    pub allocation_count: u64,
    /// The device's memory (`CARVE_FAKE_CUDA_TOTAL_BYTES`).
    pub capacity: u64,
}

/// One device pointer handed out, by `cuMemAlloc*` or a pool.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Allocation {
    /// The bytes counted for it (for a pitched allocation, pitch times height).
    pub bytes: u64,
    /// The length of its host mapping.
    pub mapping_length: usize,
    /// The pool it came from; `None` for the synchronous allocations.
    pub pool: Option<u64>,
}

/// The whole driver, behind [`lock_state`].
#[derive(Debug)]
pub(crate) struct DriverState {
    pub initialized: bool,
    /// `Err` when `CARVE_FAKE_CUDA_TOTAL_BYTES` is set but not a number: `cuInit` fails.
    pub capacity: Result<u64, String>,
    pub allocations: BTreeMap<CUdeviceptr, Allocation>,
    /// Bytes of `allocations` that did not come from a pool (pools count their reserve).
    pub direct_bytes: u64,
    pub pools: pools::PoolTable,
    pub virtual_memory: virtual_memory::VirtualMemory,
    pub arrays: arrays::ArrayTable,
    pub contexts: HashSet<u64>,
    /// The primary context's handle (made at `cuInit`) and its retain count.
    pub primary_context: u64,
    pub primary_context_retains: u64,
    pub streams: HashSet<u64>,
    pub nvml_init_count: u64,
    /// The simulated device's memory outside the program, when the worker runs one
    /// (`device_ledger.rs`); `None`: this library's own count is the device.
    pub ledger: Option<device_ledger::DeviceLedger>,
    next_handle: u64,
}

impl DriverState {
    fn new() -> DriverState {
        DriverState {
            initialized: false,
            capacity: configured_capacity(),
            allocations: BTreeMap::new(),
            direct_bytes: 0,
            pools: pools::PoolTable::default(),
            virtual_memory: virtual_memory::VirtualMemory::default(),
            arrays: arrays::ArrayTable::default(),
            contexts: HashSet::new(),
            primary_context: 0,
            primary_context_retains: 0,
            streams: HashSet::new(),
            nvml_init_count: 0,
            ledger: device_ledger::configured_socket().map(device_ledger::DeviceLedger::new),
            // Handles are small non-null integers no one dereferences; starting high keeps
            // them apart from the special stream values 0, 1 and 2.
            next_handle: 0x1000,
        }
    }

    /// A fresh handle value for a context, stream, pool, array or physical allocation.
    pub fn new_handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        self.next_handle
    }

    pub fn capacity_bytes(&self) -> u64 {
        *self.capacity.as_ref().unwrap_or(&0)
    }

    /// Everything held against the capacity.
    pub fn bytes_in_use(&self) -> u64 {
        self.direct_bytes
            + self.pools.reserved_bytes()
            + self.virtual_memory.physical_bytes()
            + self.arrays.bytes()
    }

    /// Whether `more` bytes still fit in the capacity. With a ledger, the device grants
    /// them to this process (beside what every other process holds) before they are
    /// taken; [`DriverState::settle_ledger`] corrects the grant after the call.
    pub fn fits(&mut self, more: u64) -> bool {
        let Some(total) = self
            .bytes_in_use()
            .checked_add(more)
            .filter(|&total| total <= self.capacity_bytes())
        else {
            return false;
        };
        match &mut self.ledger {
            Some(ledger) => ledger.hold(total),
            None => true,
        }
    }

    /// The device's free memory: with a ledger, what no process of the device holds.
    pub fn free_bytes(&mut self) -> u64 {
        let capacity = self.capacity_bytes();
        match self.ledger.as_mut().map(|ledger| ledger.info()) {
            Some(Ok((_, used))) => capacity.saturating_sub(used),
            Some(Err(problem)) => {
                eprintln!("carve-fake-driver: {problem}");
                0
            }
            None => capacity.saturating_sub(self.bytes_in_use()),
        }
    }

    /// Tells the ledger, if any, what this process holds after a call.
    pub fn settle_ledger(&mut self) {
        let held = self.bytes_in_use();
        if let Some(ledger) = &mut self.ledger {
            ledger.settle(held);
        }
    }

    /// At `cuInit` or `nvmlInit` with a ledger: the device's capacity is the ledger's.
    pub fn connect_ledger(&mut self) -> Result<(), String> {
        let Some(ledger) = &mut self.ledger else {
            return Ok(());
        };
        let (capacity, _) = ledger.info()?;
        self.capacity = Ok(capacity);
        Ok(())
    }

    pub fn stats(&self) -> CarveFakeDriverStats {
        CarveFakeDriverStats {
            bytes_in_use: self.bytes_in_use(),
            pool_reserved_bytes: self.pools.reserved_bytes(),
            allocation_count: self.allocations.len() as u64
                + self.virtual_memory.live_handles()
                + self.arrays.count(),
            capacity: self.capacity_bytes(),
        }
    }

    /// Whether `stream` names a stream: the legacy (0, 1) or per-thread (2) default
    /// stream, or one `cuStreamCreate` made.
    pub fn is_stream(&self, stream: Handle) -> bool {
        let value = stream as usize as u64;
        value <= 2 || self.streams.contains(&value)
    }
}

fn configured_capacity() -> Result<u64, String> {
    match std::env::var(ENV_TOTAL_BYTES) {
        Err(std::env::VarError::NotPresent) => Ok(DEFAULT_TOTAL_BYTES),
        Err(error) => Err(format!("{ENV_TOTAL_BYTES}: {error}")),
        Ok(text) => text
            .trim()
            .parse::<u64>()
            .map_err(|error| format!("{ENV_TOTAL_BYTES}={text:?} is not a byte count: {error}")),
    }
}

/// The one lock over the driver. A panic while it was held (which [`cuda_call`] caught)
/// leaves the state as consistent as each function's order of updates makes it, so a
/// poisoned lock is used as is.
pub(crate) fn lock_state() -> MutexGuard<'static, DriverState> {
    static STATE: OnceLock<Mutex<DriverState>> = OnceLock::new();
    STATE
        .get_or_init(|| Mutex::new(DriverState::new()))
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs an export's body; a panic becomes `on_panic` instead of unwinding into C.
pub(crate) fn ffi_boundary<R>(on_panic: R, body: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(on_panic)
}

/// Runs a CUDA export's body that needs no `cuInit`.
pub(crate) fn cuda_call(body: impl FnOnce() -> CUresult) -> CUresult {
    ffi_boundary(CUDA_ERROR_UNKNOWN, body)
}

/// Runs a CUDA export's body with the state locked, after `cuInit`.
pub(crate) fn initialized_call(body: impl FnOnce(&mut DriverState) -> CUresult) -> CUresult {
    cuda_call(|| {
        let mut state = lock_state();
        if !state.initialized {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
        let result = body(&mut state);
        state.settle_ledger();
        result
    })
}

/// Runs a CUDA export after `cuInit` that answers one value through an out-pointer: a null
/// out-pointer is `CUDA_ERROR_INVALID_VALUE` (checked before anything is done), an `Err`
/// the body's code, and nothing is written unless the body succeeds.
pub(crate) fn answer_call<T>(
    out: *mut T,
    body: impl FnOnce(&mut DriverState) -> Result<T, CUresult>,
) -> CUresult {
    initialized_call(|state| {
        // SAFETY: CUDA's contract: an out-pointer is null or valid for writing a T.
        let Some(out) = (unsafe { out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match body(state) {
            Ok(value) => {
                *out = value;
                CUDA_SUCCESS
            }
            Err(code) => code,
        }
    })
}

/// A handle value as the opaque pointer C sees.
pub(crate) fn handle_pointer(value: u64) -> Handle {
    std::ptr::without_provenance_mut(value as usize)
}

/// An opaque pointer from C as the handle value it carries.
pub(crate) fn handle_value(handle: Handle) -> u64 {
    handle as usize as u64
}

/// Writes the driver's statistics; works before `cuInit`.
///
/// # Safety
/// `stats` is null or valid for writing one `CarveFakeDriverStats`.
#[allow(non_snake_case)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn carveFakeDriverStats(stats: *mut CarveFakeDriverStats) -> CUresult {
    cuda_call(|| {
        // SAFETY: the caller passes null or a pointer valid for writes (the function's contract).
        let Some(stats) = (unsafe { stats.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        *stats = lock_state().stats();
        CUDA_SUCCESS
    })
}
