//! What `carve-guard-bench` measures: alloc+free pairs a second through the CUDA driver
//! API, straight into the fake driver and with the guard preloaded, in one run.
//!
//! The parent ([`run_guard_benchmark`]) makes a directory of `libcuda.so.1` (and friends)
//! links to the fake driver and runs this same binary as a child ([`run_child`]), in turns
//! (`child_runs` times each, so drift on a busy machine hits both alike): plain, and with
//! `LD_PRELOAD` of the guard and the guard's environment (limit,
//! account, OOM record in a temporary directory). Each child loads the driver the way the
//! CUDA runtime and PyTorch do (`dlopen("libcuda.so.1")`, `dlsym` of
//! `cuGetProcAddress_v2`, then `cuMemAlloc`/`cuMemFree` through it), times rounds of
//! pairs, and then asks for more than the limit: under a guard that intercepts, that is
//! refused with `CUDA_ERROR_OUT_OF_MEMORY` and leaves a line in the OOM record. Without
//! that evidence the report says the guard did not intercept instead of giving a number.

#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::report::{MachineInfo, TargetCheck};

/// The target: the guard adds under this many nanoseconds per allocation (alloc + free).
pub const ADDED_NS_TARGET: f64 = 1_000.0;
/// The fake driver's device uuid, as the worker would put it in `CUDA_VISIBLE_DEVICES`.
pub const FAKE_DEVICE_UUID: &str = "GPU-ca4fc0de-0000-4000-8000-00000000fa4e";
/// The CUDA version the child asks `cuGetProcAddress_v2` for (a CUDA 12.8 runtime).
const CUDA_VERSION: c_int = 12080;
const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;

/// The settings of one run, the same for both children.
#[derive(Debug, Clone, Serialize)]
pub struct GuardBenchSettings {
    pub allocation_bytes: u64,
    pub pairs_per_round: u64,
    pub rounds: usize,
    /// The guard's slice (`CARVE_GUARD_LIMIT_BYTES`).
    pub limit_bytes: u64,
    /// Children run per side, alternating; the median is over all their rounds.
    pub child_runs: usize,
}

/// What a child prints (one JSON line on stdout).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildReport {
    /// `cuInit`'s result (the guard fails closed there).
    pub cu_init: u32,
    /// `cuMemGetInfo_v2`'s total: the device under the fake, the slice under the guard.
    pub reported_total_bytes: u64,
    /// Nanoseconds per alloc+free pair, per round.
    pub round_ns_per_pair: Vec<f64>,
    /// Pairs whose alloc or free did not succeed.
    pub failed_pairs: u64,
    /// The result of one allocation past the limit.
    pub over_limit_result: u32,
    /// What went wrong before the measurement, if anything.
    pub error: Option<String>,
}

/// One side of the comparison.
#[derive(Debug, Clone, Serialize)]
pub struct SideReport {
    /// Over every round of every run.
    pub median_ns_per_pair: f64,
    pub pairs_per_second: f64,
    pub runs: Vec<ChildReport>,
}

/// The run's result.
#[derive(Debug, Clone, Serialize)]
pub struct GuardBenchReport {
    pub machine: MachineInfo,
    pub settings: GuardBenchSettings,
    pub fake_driver_library: PathBuf,
    pub guard_library: PathBuf,
    pub direct: SideReport,
    pub guarded: SideReport,
    /// Whether the guard demonstrably sat in front of the driver: it refused the
    /// over-limit allocation and wrote the OOM record.
    pub guard_intercepted: bool,
    /// Why we believe it did or did not.
    pub interception_evidence: String,
    /// Guarded minus direct median, per allocation (alloc + free); only when it intercepted.
    pub added_ns_per_allocation: Option<f64>,
    pub guarded_to_direct_ratio: Option<f64>,
    pub targets: Vec<TargetCheck>,
}

/// The middle value (mean of the two middle ones for an even count); 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        count if count % 2 == 1 => sorted[count / 2],
        count => (sorted[count / 2 - 1] + sorted[count / 2]) / 2.0,
    }
}

/// `target/<profile>/deps/<file>` or `target/<profile>/<file>`, next to this binary.
pub fn library_next_to_binary(file_name: &str) -> Result<PathBuf, BenchError> {
    let executable = std::env::current_exe().map_err(|error| BenchError::Io(error.to_string()))?;
    let directory = executable
        .parent()
        .ok_or_else(|| BenchError::Io("the binary has no directory".into()))?;
    [directory.join("deps").join(file_name), directory.join(file_name)]
        .into_iter()
        .find(|candidate| candidate.exists())
        .ok_or_else(|| {
            BenchError::invalid_argument(
                file_name,
                format!(
                    "not found in {0}/deps or {0}: build with `cargo build --release -p carve-bench`, or pass the path",
                    directory.display()
                ),
            )
        })
}

type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> u32;
type InitFn = unsafe extern "C" fn(c_uint) -> u32;
type AllocFn = unsafe extern "C" fn(*mut u64, usize) -> u32;
type FreeFn = unsafe extern "C" fn(u64) -> u32;
type GetInfoFn = unsafe extern "C" fn(*mut usize, *mut usize) -> u32;
type RetainFn = unsafe extern "C" fn(*mut *mut c_void, c_int) -> u32;
type SetCurrentFn = unsafe extern "C" fn(*mut c_void) -> u32;

/// A driver function by base name through `cuGetProcAddress_v2`, as the CUDA runtime asks.
///
/// # Safety
/// `F` must be the signature of the export the driver maps `name` to at [`CUDA_VERSION`].
unsafe fn driver_function<F: Copy>(
    get_proc_address: GetProcAddressV2,
    name: &CStr,
) -> Result<F, String> {
    let mut address: *mut c_void = std::ptr::null_mut();
    let mut status: c_int = 0;
    // SAFETY: cuGetProcAddress_v2's signature; the name is NUL-terminated and the
    // out-pointers are valid.
    let code =
        unsafe { get_proc_address(name.as_ptr(), &mut address, CUDA_VERSION, 0, &mut status) };
    if code != 0 || address.is_null() {
        return Err(format!(
            "cuGetProcAddress_v2({name:?}) = {code}, status {status}"
        ));
    }
    // SAFETY: a non-null function address of signature F (the caller's promise).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

/// The child: loads libcuda from the library path, measures, tries past the limit.
pub fn run_child(settings: &GuardBenchSettings) -> ChildReport {
    let mut report = ChildReport {
        cu_init: u32::MAX,
        reported_total_bytes: 0,
        round_ns_per_pair: Vec::new(),
        failed_pairs: 0,
        over_limit_result: u32::MAX,
        error: None,
    };
    if let Err(error) = measure(settings, &mut report) {
        report.error = Some(error);
    }
    report
}

fn measure(settings: &GuardBenchSettings, report: &mut ChildReport) -> Result<(), String> {
    // SAFETY: dlopen of a NUL-terminated name; the library found is the fake driver (or a
    // real one), whose initializers are safe to run.
    let library = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) };
    if library.is_null() {
        return Err("dlopen(libcuda.so.1) failed: is LD_LIBRARY_PATH set?".into());
    }
    // SAFETY: dlsym on a live handle with a NUL-terminated name (the guard's dlsym hook, if
    // preloaded, answers here).
    let address = unsafe { libc::dlsym(library, c"cuGetProcAddress_v2".as_ptr()) };
    if address.is_null() {
        return Err("libcuda.so.1 has no cuGetProcAddress_v2".into());
    }
    // SAFETY: cuGetProcAddress_v2's signature (CUDA 12.0+).
    let get_proc_address = unsafe { std::mem::transmute::<*mut c_void, GetProcAddressV2>(address) };
    // SAFETY: here and in the driver_function calls below, the types are the signatures of
    // the exports the driver gives for these names at CUDA 12.8.
    let init: InitFn = unsafe { driver_function(get_proc_address, c"cuInit")? };
    // SAFETY: cuInit(unsigned int).
    report.cu_init = unsafe { init(0) };
    if report.cu_init != 0 {
        return Err(format!("cuInit = {}", report.cu_init));
    }
    // SAFETY: as above.
    let alloc: AllocFn = unsafe { driver_function(get_proc_address, c"cuMemAlloc")? };
    // SAFETY: as above.
    let free: FreeFn = unsafe { driver_function(get_proc_address, c"cuMemFree")? };
    // SAFETY: as above.
    let get_info: GetInfoFn = unsafe { driver_function(get_proc_address, c"cuMemGetInfo")? };
    // SAFETY: as above.
    let retain: RetainFn =
        unsafe { driver_function(get_proc_address, c"cuDevicePrimaryCtxRetain")? };
    // SAFETY: as above.
    let set_current: SetCurrentFn =
        unsafe { driver_function(get_proc_address, c"cuCtxSetCurrent")? };
    let mut context: *mut c_void = std::ptr::null_mut();
    // SAFETY: the signatures above, valid out-pointers.
    unsafe {
        if retain(&mut context, 0) != 0 || set_current(context) != 0 {
            return Err("no primary context".into());
        }
        let (mut free_bytes, mut total_bytes) = (0usize, 0usize);
        if get_info(&mut free_bytes, &mut total_bytes) == 0 {
            report.reported_total_bytes = total_bytes as u64;
        }
    }
    let bytes = settings.allocation_bytes as usize;
    let pair = |failed: &mut u64| {
        let mut pointer = 0u64;
        // SAFETY: cuMemAlloc_v2 / cuMemFree_v2 with a valid out-pointer and the pointer
        // just allocated.
        unsafe {
            if alloc(&mut pointer, bytes) != 0 || free(pointer) != 0 {
                *failed += 1;
            }
        }
    };
    // One warm-up round, not reported: first touches of the code and the driver's tables.
    let mut warm_up_failures = 0;
    for _ in 0..settings.pairs_per_round.min(10_000) {
        pair(&mut warm_up_failures);
    }
    for _ in 0..settings.rounds {
        let started = Instant::now();
        for _ in 0..settings.pairs_per_round {
            pair(&mut report.failed_pairs);
        }
        let elapsed = started.elapsed().as_nanos() as f64;
        report
            .round_ns_per_pair
            .push(elapsed / settings.pairs_per_round.max(1) as f64);
    }
    let mut pointer = 0u64;
    let over_limit = settings.limit_bytes + settings.allocation_bytes;
    // SAFETY: cuMemAlloc_v2 / cuMemFree_v2 as above.
    unsafe {
        report.over_limit_result = alloc(&mut pointer, over_limit as usize);
        if report.over_limit_result == 0 {
            free(pointer);
        }
    }
    Ok(())
}

/// A temporary directory with the fake driver under the names programs load.
fn driver_directory(fake_driver: &Path) -> Result<tempfile::TempDir, BenchError> {
    let io = |error: std::io::Error| BenchError::Io(error.to_string());
    let directory = tempfile::Builder::new()
        .prefix("carve-guard-bench-")
        .tempdir()
        .map_err(io)?;
    for name in [
        "libcuda.so.1",
        "libcuda.so",
        "libnvidia-ml.so.1",
        "libnvidia-ml.so",
    ] {
        std::os::unix::fs::symlink(fake_driver, directory.path().join(name)).map_err(io)?;
    }
    Ok(directory)
}

fn spawn_child(
    settings: &GuardBenchSettings,
    driver_directory: &Path,
    guard: Option<(&Path, &Path)>,
) -> Result<ChildReport, BenchError> {
    let executable = std::env::current_exe().map_err(|error| BenchError::Io(error.to_string()))?;
    let mut command = Command::new(executable);
    command
        .arg("child")
        .arg(format!("--bytes={}", settings.allocation_bytes))
        .arg(format!("--pairs={}", settings.pairs_per_round))
        .arg(format!("--rounds={}", settings.rounds))
        .arg(format!("--limit-bytes={}", settings.limit_bytes))
        .env("LD_LIBRARY_PATH", driver_directory)
        .env_remove("LD_PRELOAD")
        .env_remove("CARVE_FAKE_CUDA_TOTAL_BYTES")
        .env("CUDA_VISIBLE_DEVICES", FAKE_DEVICE_UUID);
    if let Some((guard_library, state_directory)) = guard {
        command
            .env("LD_PRELOAD", guard_library)
            .env("CARVE_GUARD_LIMIT_BYTES", settings.limit_bytes.to_string())
            .env("CARVE_GUARD_ACCOUNT", state_directory.join("account"))
            .env("CARVE_GUARD_OOM_RECORD", state_directory.join("oom.jsonl"));
    }
    let output = command
        .output()
        .map_err(|error| BenchError::Io(format!("running the child: {error}")))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().rev().find(|line| line.starts_with('{'));
    line.and_then(|line| serde_json::from_str(line).ok())
        .ok_or_else(|| {
            BenchError::Io(format!(
                "the child printed no report ({}); stderr: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        })
}

fn side(runs: Vec<ChildReport>) -> SideReport {
    let rounds: Vec<f64> = runs
        .iter()
        .flat_map(|run| run.round_ns_per_pair.iter().copied())
        .collect();
    let median_ns_per_pair = median(&rounds);
    SideReport {
        median_ns_per_pair,
        pairs_per_second: if median_ns_per_pair > 0.0 {
            1e9 / median_ns_per_pair
        } else {
            0.0
        },
        runs,
    }
}

/// The whole run: both children, the interception check, the comparison.
pub fn run_guard_benchmark(
    settings: &GuardBenchSettings,
    fake_driver_library: &Path,
    guard_library: &Path,
) -> Result<GuardBenchReport, BenchError> {
    let machine = MachineInfo::read();
    let drivers = driver_directory(fake_driver_library)?;
    let guard_state = tempfile::Builder::new()
        .prefix("carve-guard-bench-account-")
        .tempdir()
        .map_err(|error| BenchError::Io(error.to_string()))?;
    let (mut direct_runs, mut guarded_runs) = (Vec::new(), Vec::new());
    for _ in 0..settings.child_runs.max(1) {
        direct_runs.push(spawn_child(settings, drivers.path(), None)?);
        let guard = Some((guard_library, guard_state.path()));
        guarded_runs.push(spawn_child(settings, drivers.path(), guard)?);
    }
    let (direct, guarded) = (side(direct_runs), side(guarded_runs));
    let oom_lines = std::fs::read_to_string(guard_state.path().join("oom.jsonl"))
        .map(|text| text.lines().filter(|line| !line.trim().is_empty()).count())
        .unwrap_or(0);
    let (guard_intercepted, interception_evidence) =
        judge_interception(settings, &direct, &guarded, oom_lines);
    let mut report = GuardBenchReport {
        machine: MachineInfo {
            load_average_at_end: crate::report::load_average(),
            ..machine
        },
        settings: settings.clone(),
        fake_driver_library: fake_driver_library.to_path_buf(),
        guard_library: guard_library.to_path_buf(),
        direct,
        guarded,
        guard_intercepted,
        interception_evidence,
        added_ns_per_allocation: None,
        guarded_to_direct_ratio: None,
        targets: Vec::new(),
    };
    if guard_intercepted {
        let added = report.guarded.median_ns_per_pair - report.direct.median_ns_per_pair;
        report.added_ns_per_allocation = Some(added);
        report.guarded_to_direct_ratio =
            Some(report.guarded.median_ns_per_pair / report.direct.median_ns_per_pair.max(1e-9));
        report.targets.push(TargetCheck {
            name: "added per allocation (alloc + free)".into(),
            target: format!("< {ADDED_NS_TARGET:.0} ns"),
            measured: format!("{added:.0} ns"),
            met: added < ADDED_NS_TARGET,
        });
    }
    Ok(report)
}

/// Whether every guarded run shows the guard at work, and the evidence in words.
fn judge_interception(
    settings: &GuardBenchSettings,
    direct: &SideReport,
    guarded: &SideReport,
    oom_record_lines: usize,
) -> (bool, String) {
    if let Some(error) = guarded.runs.iter().find_map(|run| run.error.as_ref()) {
        return (false, format!("the guarded child failed: {error}"));
    }
    if let Some(run) = direct
        .runs
        .iter()
        .find(|run| run.error.is_some() || run.over_limit_result != 0)
    {
        return (
            false,
            format!(
                "the fake driver alone did not allow the over-limit allocation ({:?}, result {}), so the check means nothing",
                run.error, run.over_limit_result
            ),
        );
    }
    let results: Vec<u32> = guarded
        .runs
        .iter()
        .map(|run| run.over_limit_result)
        .collect();
    let totals: Vec<u64> = guarded
        .runs
        .iter()
        .map(|run| run.reported_total_bytes)
        .collect();
    let refused = !results.is_empty()
        && results
            .iter()
            .all(|result| *result == CUDA_ERROR_OUT_OF_MEMORY);
    let slice_shown = totals.iter().all(|total| *total == settings.limit_bytes);
    let evidence = format!(
        "over-limit allocation results {results:?} (2 = refused), OOM record lines: {oom_record_lines}, cuMemGetInfo totals {totals:?} (slice {})",
        settings.limit_bytes
    );
    if refused && oom_record_lines >= guarded.runs.len() {
        (true, evidence)
    } else {
        let slice_note = if slice_shown {
            ""
        } else {
            "; the slice is not shown either"
        };
        (
            false,
            format!("the guard did not intercept: {evidence}{slice_note}"),
        )
    }
}

/// The report as a plain-text table.
pub fn render_guard_report(report: &GuardBenchReport) -> String {
    let settings = &report.settings;
    let mut text = format!(
        "carve-guard-bench: {} runs x {} rounds x {} pairs of cuMemAlloc_v2+cuMemFree_v2 of {} bytes (median round)\n\
         machine: {} cpus, {}, load {:.2} -> {:.2}\n\n",
        settings.child_runs,
        settings.rounds,
        settings.pairs_per_round,
        settings.allocation_bytes,
        report.machine.cpus,
        report.machine.cpu_model,
        report.machine.load_average_at_start,
        report.machine.load_average_at_end,
    );
    text.push_str("| path | ns per alloc+free | pairs/s | rounds (ns) |\n|---|---:|---:|---|\n");
    for (name, side) in [
        ("fake driver", &report.direct),
        ("guard + fake driver", &report.guarded),
    ] {
        let rounds: Vec<String> = side
            .runs
            .iter()
            .flat_map(|run| run.round_ns_per_pair.iter())
            .map(|ns| format!("{ns:.0}"))
            .collect();
        text.push_str(&format!(
            "| {name} | {:.0} | {:.0} | {} |\n",
            side.median_ns_per_pair,
            side.pairs_per_second,
            rounds.join(", ")
        ));
    }
    text.push('\n');
    match (
        report.added_ns_per_allocation,
        report.guarded_to_direct_ratio,
    ) {
        (Some(added), Some(ratio)) => {
            text.push_str(&format!(
                "added by the guard: {added:.0} ns per allocation, ratio {ratio:.2}\n"
            ));
            for target in &report.targets {
                text.push_str(&format!(
                    "target {}: {} -> {} ({})\n",
                    target.name,
                    target.target,
                    target.measured,
                    if target.met { "met" } else { "NOT met" }
                ));
            }
        }
        _ => text.push_str("no overhead figure: the guard did not intercept\n"),
    }
    text.push_str(&format!("interception: {}\n", report.interception_evidence));
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    fn child(over_limit_result: u32, reported_total_bytes: u64) -> SideReport {
        side(vec![ChildReport {
            cu_init: 0,
            reported_total_bytes,
            round_ns_per_pair: vec![100.0],
            failed_pairs: 0,
            over_limit_result,
            error: None,
        }])
    }

    #[test]
    fn interception_needs_the_refusal_and_the_record() {
        let settings = GuardBenchSettings {
            allocation_bytes: 1 << 20,
            pairs_per_round: 10,
            rounds: 1,
            limit_bytes: 1 << 30,
            child_runs: 1,
        };
        let direct = child(0, 16 << 30);
        let (yes, _) = judge_interception(&settings, &direct, &child(2, 1 << 30), 1);
        assert!(yes);
        let (no, why) = judge_interception(&settings, &direct, &child(0, 16 << 30), 0);
        assert!(!no);
        assert!(why.starts_with("the guard did not intercept"), "{why}");
        let (no, _) = judge_interception(&settings, &direct, &child(2, 1 << 30), 0);
        assert!(!no, "a refusal without an OOM record is not the guard's");
    }
}
