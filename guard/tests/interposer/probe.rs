//! The program under the guard. It loads the driver the way programs do, chosen by the
//! first argument:
//! - `dlsym` / `dlsym_ptsz`: `dlopen("libcuda.so.1")`, then `dlsym` of the versioned
//!   export (`cuMemAlloc_v2`, or `cuMemAllocAsync_ptsz`), as old code does;
//! - `default`: `dlsym(RTLD_DEFAULT, ..)`, as a program linked against libcuda binds;
//! - `proc:<version>[:ptsz]` / `proc2:<version>[:ptsz]`: `cuGetProcAddress` (4 arguments)
//!   or `cuGetProcAddress_v2` (5) with that CUDA version and flag, as the CUDA runtime
//!   and PyTorch do.
//!
//! Then it runs the operations in the other arguments (`name` or `name:arg:arg`) and
//! prints one JSON line per operation, after a first `{"op":"start","pid":..}` line.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

type Pointer = *mut c_void;

#[derive(Debug, Clone, Copy)]
enum Lookup {
    Dlsym {
        per_thread: bool,
    },
    Default,
    ProcAddress {
        version: c_int,
        per_thread: bool,
        with_status: bool,
    },
}

/// The loaded driver and how to find its functions.
struct Driver {
    handle: Pointer,
    lookup: Lookup,
}

// SAFETY: the handle is a dlopen handle, usable from any thread.
unsafe impl Send for Driver {}
// SAFETY: as for Send; the driver is only read.
unsafe impl Sync for Driver {}

const PER_THREAD_FLAG: u64 = 2;
const CU_AD_FORMAT_FLOAT: u32 = 0x20;

impl Driver {
    fn load(mode: &str) -> Driver {
        let parts: Vec<&str> = mode.split(':').collect();
        let per_thread = parts.contains(&"ptsz") || mode == "dlsym_ptsz";
        let lookup = match parts[0] {
            "dlsym" | "dlsym_ptsz" => Lookup::Dlsym { per_thread },
            "default" => Lookup::Default,
            "proc" | "proc2" => Lookup::ProcAddress {
                version: parts[1].parse().expect("version"),
                per_thread,
                with_status: parts[0] == "proc2",
            },
            other => panic!("unknown lookup {other}"),
        };
        // A program linked against libcuda has it in the global scope.
        let scope = if matches!(lookup, Lookup::Default) {
            libc::RTLD_GLOBAL
        } else {
            libc::RTLD_LOCAL
        };
        // SAFETY: a NUL-terminated literal; loading the (fake) driver.
        let handle = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | scope) };
        assert!(!handle.is_null(), "dlopen libcuda.so.1 failed");
        Driver { handle, lookup }
    }

    fn dlsym(&self, name: &str) -> Pointer {
        let name = CString::new(name).expect("name");
        // SAFETY: a dlopen handle and a NUL-terminated name.
        unsafe { libc::dlsym(self.handle, name.as_ptr()) }
    }

    /// The function a program would get for `base` (export `export`; `per_thread_export`
    /// when it has a `_ptsz` variant).
    fn find(&self, base: &str, export: &str, per_thread_export: Option<&str>) -> Pointer {
        match self.lookup {
            Lookup::Dlsym { per_thread } => {
                self.dlsym(per_thread_export.filter(|_| per_thread).unwrap_or(export))
            }
            Lookup::Default => {
                let name = CString::new(export).expect("name");
                // SAFETY: RTLD_DEFAULT and a NUL-terminated name.
                unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
            }
            Lookup::ProcAddress {
                version,
                per_thread,
                with_status,
            } => self.proc_address(
                base,
                version,
                if per_thread { PER_THREAD_FLAG } else { 0 },
                with_status,
            ),
        }
    }

    fn proc_address(&self, base: &str, version: c_int, flags: u64, with_status: bool) -> Pointer {
        let base = CString::new(base).expect("name");
        let mut function: Pointer = null_mut();
        let result = if with_status {
            type GetProcAddressV2 =
                unsafe extern "C" fn(*const c_char, *mut Pointer, c_int, u64, *mut c_int) -> u32;
            let mut status: c_int = -1;
            let get = self.dlsym("cuGetProcAddress_v2");
            assert!(!get.is_null());
            // SAFETY: cuGetProcAddress_v2's signature; valid out-pointers.
            unsafe {
                std::mem::transmute::<Pointer, GetProcAddressV2>(get)(
                    base.as_ptr(),
                    &mut function,
                    version,
                    flags,
                    &mut status,
                )
            }
        } else {
            type GetProcAddress =
                unsafe extern "C" fn(*const c_char, *mut Pointer, c_int, u64) -> u32;
            let get = self.dlsym("cuGetProcAddress");
            assert!(!get.is_null());
            // SAFETY: cuGetProcAddress's signature; a valid out-pointer.
            unsafe {
                std::mem::transmute::<Pointer, GetProcAddress>(get)(
                    base.as_ptr(),
                    &mut function,
                    version,
                    flags,
                )
            }
        };
        if result != 0 { null_mut() } else { function }
    }
}

/// Calls a driver function found through the probe's lookup.
macro_rules! call {
    ($driver:expr, $base:literal, $export:literal, $ptsz:expr, fn($($type:ty),*) ($($argument:expr),*)) => {{
        let found = $driver.find($base, $export, $ptsz);
        if found.is_null() {
            panic!("{} not found", $export);
        }
        // SAFETY: the export's cuda.h signature; the arguments are valid for it.
        unsafe { std::mem::transmute::<Pointer, unsafe extern "C" fn($($type),*) -> u32>(found)($($argument),*) }
    }};
}

fn emit(op: &str, fields: &[(&str, u64)]) {
    let mut line = format!("{{\"op\":\"{op}\"");
    for (key, value) in fields {
        line.push_str(&format!(",\"{key}\":{value}"));
    }
    line.push('}');
    println!("{line}");
}

/// The fake driver's own counters.
#[repr(C)]
#[derive(Default)]
struct FakeStats {
    bytes_in_use: u64,
    pool_reserved_bytes: u64,
    allocation_count: u64,
    capacity: u64,
}

/// Per-process state of the operations: handed-out pointers and handles, by index.
#[derive(Default)]
struct Held {
    pointers: Vec<u64>,
    /// The pool `pool_create` made.
    pool: u64,
}

pub fn run(arguments: &[String]) {
    if arguments[0] == "no_cuda" {
        no_cuda();
        return;
    }
    let driver = Driver::load(&arguments[0]);
    emit("start", &[("pid", u64::from(std::process::id()))]);
    let mut held = Held::default();
    for operation in &arguments[1..] {
        perform(&driver, &mut held, operation);
    }
}

fn argument(parts: &[&str], index: usize) -> u64 {
    parts
        .get(index)
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("argument {index} of {parts:?}"))
}

fn perform(driver: &Driver, held: &mut Held, operation: &str) {
    let parts: Vec<&str> = operation.split(':').collect();
    let op = parts[0];
    match op {
        "init" => {
            let result = call!(driver, "cuInit", "cuInit", None, fn(u32)(0));
            emit(op, &[("result", u64::from(result))]);
        }
        "ctx" => {
            let mut device: c_int = -1;
            let mut context: Pointer = null_mut();
            let first = call!(driver, "cuDeviceGet", "cuDeviceGet", None, fn(*mut c_int, c_int)(&mut device, 0));
            let second = call!(driver, "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", None, fn(*mut Pointer, c_int)(&mut context, device));
            let third =
                call!(driver, "cuCtxSetCurrent", "cuCtxSetCurrent", None, fn(Pointer)(context));
            emit(op, &[("result", u64::from(first.max(second).max(third)))]);
        }
        "alloc" | "managed" | "async" | "frompool" | "custom" | "vmm" | "pitch" | "array"
        | "array3d" | "mipmap" | "legacy_alloc" => {
            let (result, key) = allocate(driver, &parts, held.pool as Pointer);
            let index = held.pointers.len() as u64;
            if result == 0 {
                held.pointers.push(key);
            }
            emit(op, &[("result", u64::from(result)), ("index", index)]);
        }
        "free" | "freeasync" | "release" | "array_destroy" | "mipmap_destroy" => {
            let key = held.pointers[argument(&parts, 1) as usize];
            emit(op, &[("result", u64::from(free(driver, op, key)))]);
        }
        "free_unknown" => {
            for kind in [
                "free",
                "freeasync",
                "release",
                "array_destroy",
                "mipmap_destroy",
            ] {
                let result = free(driver, kind, 0xdead_0000);
                emit(op, &[("result", u64::from(result))]);
            }
        }
        "sync" => {
            let result = call!(driver, "cuStreamSynchronize", "cuStreamSynchronize", Some("cuStreamSynchronize_ptsz"), fn(Pointer)(null_mut()));
            emit(op, &[("result", u64::from(result))]);
        }
        "ctxsync" => {
            let result = call!(driver, "cuCtxSynchronize", "cuCtxSynchronize", None, fn()());
            emit(op, &[("result", u64::from(result))]);
        }
        "trim" => {
            let pool = default_pool(driver);
            let result = call!(driver, "cuMemPoolTrimTo", "cuMemPoolTrimTo", None, fn(Pointer, usize)(pool, argument(&parts, 1) as usize));
            emit(op, &[("result", u64::from(result))]);
        }
        "info" => {
            let (mut free, mut total) = (0usize, 0usize);
            let result = call!(driver, "cuMemGetInfo", "cuMemGetInfo_v2", None, fn(*mut usize, *mut usize)(&mut free, &mut total));
            emit(
                op,
                &[
                    ("result", u64::from(result)),
                    ("free", free as u64),
                    ("total", total as u64),
                ],
            );
        }
        "total" => {
            let mut total = 0usize;
            let result = call!(driver, "cuDeviceTotalMem", "cuDeviceTotalMem_v2", None, fn(*mut usize, c_int)(&mut total, 0));
            emit(
                op,
                &[("result", u64::from(result)), ("total", total as u64)],
            );
        }
        "nvml" => nvml(),
        "stats" => {
            let mut stats = FakeStats::default();
            let get = driver.dlsym("carveFakeDriverStats");
            assert!(!get.is_null());
            // SAFETY: carveFakeDriverStats(CarveFakeDriverStats*) and a valid out-pointer.
            let result = unsafe {
                std::mem::transmute::<Pointer, unsafe extern "C" fn(*mut FakeStats) -> u32>(get)(
                    &mut stats,
                )
            };
            emit(
                op,
                &[
                    ("result", u64::from(result)),
                    ("bytes_in_use", stats.bytes_in_use),
                    ("pool_reserved", stats.pool_reserved_bytes),
                    ("allocations", stats.allocation_count),
                ],
            );
        }
        "account" => {
            let path =
                std::env::var_os(carve_guard_account::ENV_ACCOUNT).expect("account variable");
            let usage = carve_guard_account::Account::open(std::path::Path::new(&path))
                .expect("open account")
                .usage();
            let mine = usage
                .processes
                .iter()
                .find(|process| process.process_id == std::process::id())
                .map_or(0, |process| process.in_use_bytes);
            emit(
                op,
                &[
                    ("in_use", usage.in_use_bytes),
                    ("peak", usage.peak_bytes),
                    ("mine", mine),
                    ("processes", usage.processes.len() as u64),
                ],
            );
        }
        "hold" => {
            let path = operation.split_once(':').expect("hold:<path>").1;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !std::path::Path::new(path).exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            emit(op, &[]);
        }
        "pool_create" => {
            // CUmemPoolProps: pinned, no handle types, device 0, the rest zero.
            let mut properties = [0u8; 128];
            properties[0] = 1;
            properties[8] = 1;
            let mut pool: Pointer = null_mut();
            let result = call!(driver, "cuMemPoolCreate", "cuMemPoolCreate", None, fn(*mut Pointer, *const u8)(&mut pool, properties.as_ptr()));
            held.pool = pool as u64;
            emit(op, &[("result", u64::from(result))]);
        }
        "pool_destroy" => {
            let pool = held.pool as Pointer;
            let result =
                call!(driver, "cuMemPoolDestroy", "cuMemPoolDestroy", None, fn(Pointer)(pool));
            emit(op, &[("result", u64::from(result))]);
        }
        "fork" => fork(driver, held, &operation["fork:".len()..]),
        "threads" => threads(driver, argument(&parts, 1), argument(&parts, 2)),
        "hooks" => hooks(driver),
        "bench" => bench(driver, argument(&parts, 1)),
        "dlsym_edges" => dlsym_edges(driver),
        other => panic!("unknown operation {other}"),
    }
}

fn default_pool(driver: &Driver) -> Pointer {
    let mut pool: Pointer = null_mut();
    let result = call!(driver, "cuDeviceGetDefaultMemPool", "cuDeviceGetDefaultMemPool", None, fn(*mut Pointer, c_int)(&mut pool, 0));
    assert_eq!(result, 0, "cuDeviceGetDefaultMemPool");
    pool
}

/// One allocation of the kind `parts[0]`; the pointer or handle it gave.
fn allocate(driver: &Driver, parts: &[&str], custom_pool: Pointer) -> (u32, u64) {
    let mut out: u64 = 0;
    let bytes = argument(parts, 1) as usize;
    let result = match parts[0] {
        "alloc" => {
            call!(driver, "cuMemAlloc", "cuMemAlloc_v2", None, fn(*mut u64, usize)(&mut out, bytes))
        }
        "legacy_alloc" => {
            call!(driver, "cuMemAlloc", "cuMemAlloc", None, fn(*mut u32, u32)((&raw mut out).cast(), bytes as u32))
        }
        "managed" => {
            call!(driver, "cuMemAllocManaged", "cuMemAllocManaged", None, fn(*mut u64, usize, u32)(&mut out, bytes, 1))
        }
        "async" => {
            call!(driver, "cuMemAllocAsync", "cuMemAllocAsync", Some("cuMemAllocAsync_ptsz"), fn(*mut u64, usize, Pointer)(&mut out, bytes, null_mut()))
        }
        "frompool" => {
            let pool = default_pool(driver);
            call!(driver, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", Some("cuMemAllocFromPoolAsync_ptsz"), fn(*mut u64, usize, Pointer, Pointer)(&mut out, bytes, pool, null_mut()))
        }
        "custom" => {
            call!(driver, "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", Some("cuMemAllocFromPoolAsync_ptsz"), fn(*mut u64, usize, Pointer, Pointer)(&mut out, bytes, custom_pool, null_mut()))
        }
        "vmm" => {
            // CUmemAllocationProp: pinned, no handle types, device 0.
            let mut prop = [0u8; 32];
            prop[0] = 1;
            prop[8] = 1;
            call!(driver, "cuMemCreate", "cuMemCreate", None, fn(*mut u64, usize, *const u8, u64)(&mut out, bytes, prop.as_ptr(), 0))
        }
        "pitch" => {
            let mut pitch = 0usize;
            let height = argument(parts, 2) as usize;
            call!(driver, "cuMemAllocPitch", "cuMemAllocPitch_v2", None, fn(*mut u64, *mut usize, usize, usize, u32)(&mut out, &mut pitch, bytes, height, 4))
        }
        "array" => {
            let descriptor = [
                bytes,
                argument(parts, 2) as usize,
                (1usize << 32) | CU_AD_FORMAT_FLOAT as usize,
            ];
            call!(driver, "cuArrayCreate", "cuArrayCreate_v2", None, fn(*mut u64, *const usize)(&mut out, descriptor.as_ptr()))
        }
        "array3d" | "mipmap" => {
            // CUDA_ARRAY3D_DESCRIPTOR: width, height, depth, format, channels, flags.
            let mut descriptor = [0usize; 5];
            descriptor[0] = bytes;
            descriptor[1] = argument(parts, 2) as usize;
            descriptor[2] = if parts[0] == "array3d" {
                argument(parts, 3) as usize
            } else {
                0
            };
            descriptor[3] = (1usize << 32) | CU_AD_FORMAT_FLOAT as usize;
            if parts[0] == "array3d" {
                call!(driver, "cuArray3DCreate", "cuArray3DCreate_v2", None, fn(*mut u64, *const usize)(&mut out, descriptor.as_ptr()))
            } else {
                let levels = argument(parts, 3) as u32;
                call!(driver, "cuMipmappedArrayCreate", "cuMipmappedArrayCreate", None, fn(*mut u64, *const usize, u32)(&mut out, descriptor.as_ptr(), levels))
            }
        }
        other => panic!("not an allocation: {other}"),
    };
    (result, out)
}

fn free(driver: &Driver, kind: &str, key: u64) -> u32 {
    let handle = key as Pointer;
    match kind {
        "free" => call!(driver, "cuMemFree", "cuMemFree_v2", None, fn(u64)(key)),
        "freeasync" => {
            call!(driver, "cuMemFreeAsync", "cuMemFreeAsync", Some("cuMemFreeAsync_ptsz"), fn(u64, Pointer)(key, null_mut()))
        }
        "release" => call!(driver, "cuMemRelease", "cuMemRelease", None, fn(u64)(key)),
        "array_destroy" => {
            call!(driver, "cuArrayDestroy", "cuArrayDestroy", None, fn(Pointer)(handle))
        }
        "mipmap_destroy" => {
            call!(driver, "cuMipmappedArrayDestroy", "cuMipmappedArrayDestroy", None, fn(Pointer)(handle))
        }
        other => panic!("not a free: {other}"),
    }
}

/// NVML's memory info (both versions) for device 0.
fn nvml() {
    // SAFETY: NUL-terminated literal.
    let library = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
    assert!(!library.is_null(), "dlopen libnvidia-ml.so.1");
    let find = |name: &CStr| {
        // SAFETY: a dlopen handle and a NUL-terminated name.
        let found = unsafe { libc::dlsym(library, name.as_ptr()) };
        assert!(!found.is_null(), "{name:?}");
        found
    };
    let mut device: Pointer = null_mut();
    let mut memory = [0u64; 3];
    let mut memory_v2 = [0u64; 5];
    memory_v2[0] = (2 << 24) | 40; // nvmlMemory_v2 version word: sizeof | 2 << 24
    // SAFETY: nvml.h signatures; valid out-pointers of the right sizes.
    let results = unsafe {
        let init =
            std::mem::transmute::<Pointer, unsafe extern "C" fn() -> u32>(find(c"nvmlInit_v2"))();
        let handle = std::mem::transmute::<Pointer, unsafe extern "C" fn(u32, *mut Pointer) -> u32>(
            find(c"nvmlDeviceGetHandleByIndex_v2"),
        )(0, &mut device);
        let info = std::mem::transmute::<Pointer, unsafe extern "C" fn(Pointer, *mut u64) -> u32>(
            find(c"nvmlDeviceGetMemoryInfo"),
        )(device, memory.as_mut_ptr());
        let info_v2 = std::mem::transmute::<Pointer, unsafe extern "C" fn(Pointer, *mut u64) -> u32>(
            find(c"nvmlDeviceGetMemoryInfo_v2"),
        )(device, memory_v2.as_mut_ptr());
        [init, handle, info, info_v2]
    };
    let worst = results.iter().copied().max().unwrap_or(0);
    emit(
        "nvml",
        &[
            ("result", u64::from(worst)),
            ("total", memory[0]),
            ("free", memory[1]),
            ("used", memory[2]),
            ("total_v2", memory_v2[1]),
            ("free_v2", memory_v2[3]),
            ("used_v2", memory_v2[4]),
        ],
    );
}

/// Runs `body` (operations separated by `+`) in a forked child; the parent waits.
fn fork(driver: &Driver, held: &mut Held, body: &str) {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // SAFETY: the probe is single-threaded here; the child only runs the operations and exits.
    let child = unsafe { libc::fork() };
    if child == 0 {
        emit("child", &[("pid", u64::from(std::process::id()))]);
        for operation in body.split('+') {
            perform(driver, held, operation);
        }
        let _ = std::io::stdout().flush();
        // SAFETY: ends the child without running the parent's exit handlers twice.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(child, &mut status, 0) };
    emit("forked", &[("status", status as u64)]);
}

/// `count` threads allocate `bytes` at a time, all starting together, until refused;
/// then the totals, and everything freed.
fn threads(driver: &Driver, count: u64, bytes: u64) {
    let driver = Arc::new(Driver {
        handle: driver.handle,
        lookup: driver.lookup,
    });
    let barrier = Arc::new(Barrier::new(count as usize));
    let granted = Arc::new(AtomicU64::new(0));
    let refusals = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..count)
        .map(|_| {
            let (driver, barrier, granted, refusals) = (Arc::clone(&driver), Arc::clone(&barrier), Arc::clone(&granted), Arc::clone(&refusals));
            std::thread::spawn(move || {
                barrier.wait();
                let mut mine = Vec::new();
                loop {
                    let mut out = 0u64;
                    let result = call!(driver, "cuMemAlloc", "cuMemAlloc_v2", None, fn(*mut u64, usize)(&mut out, bytes as usize));
                    if result != 0 {
                        assert_eq!(result, 2, "refusal code");
                        refusals.fetch_add(1, Ordering::Relaxed);
                        break;
                    }
                    granted.fetch_add(bytes, Ordering::Relaxed);
                    mine.push(out);
                }
                mine
            })
        })
        .collect();
    let pointers: Vec<u64> = workers
        .into_iter()
        .flat_map(|worker| worker.join().expect("worker"))
        .collect();
    emit(
        "threads",
        &[
            ("granted", granted.load(Ordering::Relaxed)),
            ("refusals", refusals.load(Ordering::Relaxed)),
        ],
    );
    let mut held = Held::default();
    perform(&driver, &mut held, "stats");
    perform(&driver, &mut held, "account");
    for pointer in pointers {
        assert_eq!(free(&driver, "free", pointer), 0);
    }
    perform(&driver, &mut held, "stats");
    perform(&driver, &mut held, "account");
}

/// Mirror of the guard's `HookEntryView`.
#[repr(C)]
struct HookEntryView {
    export: *const c_char,
    base: *const c_char,
    min_version: c_int,
    max_version: c_int,
    per_thread: c_int,
    function: *const c_void,
}

/// Checks every hook-table row: `dlsym` (on the driver's handle and RTLD_DEFAULT) and
/// `cuGetProcAddress(_v2)` all give the row's function. One line per row, then a total.
fn hooks(driver: &Driver) {
    type Entry = unsafe extern "C" fn(usize, *mut HookEntryView) -> c_int;
    // SAFETY: RTLD_DEFAULT and a NUL-terminated name.
    let entry = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"carve_guard_hook_entry".as_ptr()) };
    assert!(!entry.is_null(), "the guard is not preloaded");
    // SAFETY: the guard's carve_guard_hook_entry signature.
    let entry = unsafe { std::mem::transmute::<Pointer, Entry>(entry) };
    // SAFETY: NUL-terminated literal.
    let nvml = unsafe { libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW) };
    let (mut rows, mut mismatches) = (0u64, 0u64);
    for index in 0.. {
        let mut view = HookEntryView {
            export: std::ptr::null(),
            base: std::ptr::null(),
            min_version: 0,
            max_version: 0,
            per_thread: 0,
            function: std::ptr::null(),
        };
        // SAFETY: a valid out-pointer.
        if unsafe { entry(index, &mut view) } == 0 {
            break;
        }
        rows += 1;
        // SAFETY: the guard hands out NUL-terminated static names.
        let (export, base) = unsafe { (CStr::from_ptr(view.export), CStr::from_ptr(view.base)) };
        let export_text = export.to_string_lossy();
        if view.max_version == 0 {
            continue; // not a driver entry point (dlsym itself, this accessor)
        }
        let handle = if export_text.starts_with("nvml") {
            nvml
        } else {
            driver.handle
        };
        let mut check = |how: &str, found: Pointer| {
            let agrees = found.cast_const() == view.function;
            if !agrees {
                mismatches += 1;
            }
            println!(
                "{{\"op\":\"hook\",\"export\":\"{export_text}\",\"how\":\"{how}\",\"agrees\":{agrees}}}"
            );
        };
        // SAFETY: a dlopen handle / RTLD_DEFAULT and NUL-terminated names.
        let (by_handle, by_default) = unsafe {
            (
                libc::dlsym(handle, export.as_ptr()),
                libc::dlsym(libc::RTLD_DEFAULT, export.as_ptr()),
            )
        };
        check("default", by_default);
        if !by_handle.is_null() {
            check("handle", by_handle);
        }
        if !export_text.starts_with("cu") || export_text.starts_with("cuGetProcAddress") {
            continue;
        }
        let version = view.min_version.max(11030).min(view.max_version - 1);
        let flags = if view.per_thread != 0 {
            PER_THREAD_FLAG
        } else {
            0
        };
        let base = base.to_string_lossy();
        for with_status in [false, true] {
            let found = driver.proc_address(&base, version, flags, with_status);
            if !found.is_null() {
                check(if with_status { "proc2" } else { "proc" }, found);
            }
        }
    }
    emit("hooks", &[("rows", rows), ("mismatches", mismatches)]);
}

/// `pairs` allocations of 4 KiB, each freed at once: nanoseconds per pair (for comparing
/// the same run with and without the guard by hand; no case asserts a time).
fn bench(driver: &Driver, pairs: u64) {
    let allocate = driver.find("cuMemAlloc", "cuMemAlloc_v2", None);
    let free = driver.find("cuMemFree", "cuMemFree_v2", None);
    // SAFETY: the exports' cuda.h signatures.
    let (allocate, free) = unsafe {
        (
            std::mem::transmute::<Pointer, unsafe extern "C" fn(*mut u64, usize) -> u32>(allocate),
            std::mem::transmute::<Pointer, unsafe extern "C" fn(u64) -> u32>(free),
        )
    };
    let started = std::time::Instant::now();
    for _ in 0..pairs {
        let mut pointer = 0u64;
        // SAFETY: a valid out-pointer; the pointer freed is the one just allocated.
        unsafe {
            assert_eq!(allocate(&mut pointer, 4096), 0);
            assert_eq!(free(pointer), 0);
        }
    }
    let nanoseconds = started.elapsed().as_nanos() as u64 / pairs.max(1);
    emit("bench", &[("pairs", pairs), ("ns_per_pair", nanoseconds)]);
}

/// The file `address` belongs to, as the dynamic linker says.
fn library_of(address: Pointer) -> String {
    // SAFETY: an all-zero Dl_info is a valid out-value (null pointers, zero addresses).
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    if address.is_null() {
        return String::new();
    }
    // SAFETY: dladdr only reads its address argument and writes `info`.
    let found = unsafe { libc::dladdr(address, &mut info) } != 0;
    if !found || info.dli_fname.is_null() {
        return String::new();
    }
    // SAFETY: dladdr gave a NUL-terminated file name.
    unsafe { CStr::from_ptr(info.dli_fname) }
        .to_string_lossy()
        .into_owned()
}

/// What `dlsym` passes through: a missing name (NULL, with an error), an unhooked name
/// (the driver's own), `RTLD_NEXT` from the program (the C library's), and a hooked
/// name through `RTLD_NEXT` (the guard's).
fn dlsym_edges(driver: &Driver) {
    // SAFETY: clears any pending error; then lookups with NUL-terminated names.
    let (missing, error, unhooked, next_getpid, next_hooked, default_hooked) = unsafe {
        libc::dlerror();
        let missing = libc::dlsym(driver.handle, c"carve_no_such_symbol".as_ptr());
        let error = !libc::dlerror().is_null();
        (
            missing,
            error,
            libc::dlsym(driver.handle, c"cuDeviceGet".as_ptr()),
            libc::dlsym(libc::RTLD_NEXT, c"getpid".as_ptr()),
            libc::dlsym(libc::RTLD_NEXT, c"cuMemAlloc_v2".as_ptr()),
            libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr()),
        )
    };
    let flag = |condition: bool| u64::from(condition);
    emit(
        "dlsym_edges",
        &[
            ("missing_is_null", flag(missing.is_null())),
            ("missing_sets_error", flag(error)),
            (
                "unhooked_is_the_drivers",
                flag(library_of(unhooked).contains("libcuda")),
            ),
            (
                "next_getpid_is_libc",
                flag(library_of(next_getpid).contains("libc")),
            ),
            (
                "next_hooked_is_the_guards",
                flag(library_of(next_hooked).contains("libcarve_guard")),
            ),
            ("hooked_agree", flag(next_hooked == default_hooked)),
        ],
    );
}

/// A program that never uses CUDA but looks names up: the guard must not load the
/// driver or NVML into it.
fn no_cuda() {
    // SAFETY: RTLD_DEFAULT and NUL-terminated names; RTLD_NOLOAD never loads anything.
    let (getpid, hooked, cuda_loaded, nvml_loaded) = unsafe {
        (
            libc::dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()),
            libc::dlsym(libc::RTLD_DEFAULT, c"cuMemAlloc_v2".as_ptr()),
            libc::dlopen(
                c"libcuda.so.1".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            ),
            libc::dlopen(
                c"libnvidia-ml.so.1".as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD,
            ),
        )
    };
    let flag = |condition: bool| u64::from(condition);
    emit(
        "no_cuda",
        &[
            ("found_getpid", flag(!getpid.is_null())),
            ("found_hook", flag(!hooked.is_null())),
            ("libcuda_loaded", flag(!cuda_loaded.is_null())),
            ("nvml_loaded", flag(!nvml_loaded.is_null())),
        ],
    );
}
