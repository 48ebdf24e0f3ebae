//! The worker's side of the guard (`libcarve_guard.so`, the CUDA driver interposer in
//! `guard/`) for one attempt whose program runs under it: the attempt's account file, the
//! environment the program must get, and reading the account and the OOM record while
//! and after it runs. The contract itself (variables, files, why each is there) is in
//! ARCHITECTURE.md, "The guard's contract with the worker"; its names are
//! `carve_guard_account`'s constants, shared with the guard.
//!
//! The guard is the limit. The framework variables set beside it are cooperative: they
//! only make a framework fail cleanly inside its own allocator, or use its slice well,
//! before the guard has to refuse a driver call.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use carve_guard_account::{
    Account, AccountError, AccountUsage, ENV_ACCOUNT, ENV_LIMIT_BYTES, ENV_OOM_RECORD,
    OomRecordLine,
};

use crate::error::WorkerError;
use crate::gpus::WorkerGpu;

/// The guard's file name, looked for next to the worker's own executable by default.
pub const GUARD_LIBRARY_FILE_NAME: &str = "libcarve_guard.so";
/// The account file in the attempt's directory.
pub const ACCOUNT_FILE_NAME: &str = "gpu-memory.account";
/// The OOM record in the attempt's directory.
pub const OOM_RECORD_FILE_NAME: &str = "gpu-oom.jsonl";

/// JAX's share of the memory it sees. Under the guard JAX sees the slice as the GPU's
/// total, so this keeps 5% of the slice for what XLA's allocator does not hold (cuDNN and
/// cuBLAS workspaces, the runtime's own buffers), which would otherwise fail with a bare
/// status code instead of JAX's RESOURCE_EXHAUSTED.
pub const XLA_MEMORY_FRACTION: &str = ".95";

/// What the worker adds to PyTorch's allocator options (`PYTORCH_CUDA_ALLOC_CONF`), each
/// only where the job's own options do not name it. Expandable segments let PyTorch's
/// caching allocator grow one mapped segment page by page (`cuMemCreate`/`cuMemMap`,
/// which the guard counts) and give pages back, instead of keeping whole cached blocks
/// that fragment: in a slice, fragmentation makes PyTorch run out of memory well before
/// the slice is used, and its OOM message then blames "reserved but unallocated" memory.
/// Not added: `per_process_memory_fraction`, PyTorch's own cap, because PyTorch before 2.9
/// rejects an option it does not know at its first CUDA allocation ("Unrecognized
/// CachingAllocator option"), and it adds nothing to the guard here: PyTorch already sees
/// the slice as the GPU's total, and turns the guard's refusal into its normal
/// `torch.OutOfMemoryError` after emptying its cache and retrying.
/// `garbage_collection_threshold` acts only with that fraction set, so it is not added
/// either.
pub const PYTORCH_ALLOCATOR_OPTIONS: [(&str, &str); 1] = [("expandable_segments", "True")];

/// The default place of the guard: `libcarve_guard.so` next to the worker's executable,
/// where a release puts both.
pub fn default_guard_library(worker_program: &Path) -> PathBuf {
    worker_program
        .parent()
        .unwrap_or_else(|| Path::new("."))
        .join(GUARD_LIBRARY_FILE_NAME)
}

/// Checks the guard library (`--guard-library`) and returns its absolute path, as
/// `LD_PRELOAD` needs it (the program's working directory is not the worker's). The
/// worker calls this when it starts, and only when the guard will be needed: on a worker
/// with real GPUs. A worker with only simulated GPUs never runs a program under the guard
/// and never checks it, so it starts without the library.
pub fn check_guard_library(path: &Path) -> Result<PathBuf, WorkerError> {
    let invalid = |reason: String| WorkerError::invalid_setting("--guard-library", reason);
    let absolute = std::fs::canonicalize(path).map_err(|error| {
        invalid(format!(
            "cannot find the guard {} ({error}); build it with `cargo build --release -p \
             carve-guard` and put {GUARD_LIBRARY_FILE_NAME} next to carve-worker, or name it",
            path.display()
        ))
    })?;
    if !absolute.is_file() {
        return Err(invalid(format!("{} is not a file", absolute.display())));
    }
    // LD_PRELOAD splits its list on spaces and colons: such a path would preload pieces.
    let text = absolute.to_string_lossy();
    if text.contains(':') || text.chars().any(char::is_whitespace) {
        return Err(invalid(format!(
            "{text}: LD_PRELOAD cannot carry a path with a colon or a space"
        )));
    }
    Ok(absolute)
}

/// The guard library, checked when the worker starts and will need it: with a real GPU
/// to run programs on (`gpus`). A worker with only simulated GPUs never checks it. A
/// library named with `--guard-library` (`named`) that fails the check stops the worker
/// (a typo must not go unnoticed); the default one next to `worker_program` missing is
/// a warning only, since the engine's attempts do not run under the guard.
pub fn find_guard_library(
    named: Option<&Path>,
    worker_program: &Path,
    gpus: &[WorkerGpu],
) -> Result<Option<PathBuf>, WorkerError> {
    if gpus.iter().all(|gpu| gpu.simulated) {
        return Ok(None);
    }
    let path = named.map_or_else(|| default_guard_library(worker_program), Path::to_path_buf);
    match check_guard_library(&path) {
        Ok(library) => {
            tracing::info!(library = %library.display(), "the guard is ready for programs run under it");
            Ok(Some(library))
        }
        Err(error) if named.is_some() => Err(error),
        Err(error) => {
            tracing::warn!(%error, "no guard: programs cannot run under it on this worker");
            Ok(None)
        }
    }
}

/// The guard for command jobs on simulated GPUs: the library named with
/// `--guard-library`, or the default one next to `worker_program`, when it passes the
/// check. Never an error: without it such programs run without the guard (`carve dev
/// --demo`), and a named one that fails the check is a warning.
pub fn find_simulated_guard_library(
    named: Option<&Path>,
    worker_program: &Path,
) -> Option<PathBuf> {
    let path = named.map_or_else(|| default_guard_library(worker_program), Path::to_path_buf);
    match check_guard_library(&path) {
        Ok(library) => Some(library),
        Err(error) => {
            if named.is_some() {
                tracing::warn!(%error, "command jobs on simulated gpus run without the guard");
            }
            None
        }
    }
}

/// The guard set up for one attempt: its account exists, and [`AttemptGuard::environment`]
/// says what the program must be started with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptGuard {
    library: PathBuf,
    limit_bytes: u64,
    account_file: PathBuf,
    oom_record_file: PathBuf,
    gpu_uuid: String,
}

impl AttemptGuard {
    /// Creates the attempt's account (`{attempt_directory}/gpu-memory.account`, empty,
    /// limited to `slice_bytes`, replacing one a previous run left) and removes a stale
    /// OOM record, so that everything the worker reads later is this attempt's.
    /// `library` is the checked path from [`check_guard_library`]; `gpu_uuid` NVML's
    /// `GPU-...` uuid of the slice's GPU.
    pub fn prepare(
        library: &Path,
        attempt_directory: &Path,
        slice_bytes: u64,
        gpu_uuid: &str,
    ) -> Result<AttemptGuard, WorkerError> {
        let account_file = attempt_directory.join(ACCOUNT_FILE_NAME);
        let oom_record_file = attempt_directory.join(OOM_RECORD_FILE_NAME);
        Account::create(&account_file, slice_bytes).map_err(guard_error)?;
        match std::fs::remove_file(&oom_record_file) {
            Ok(()) => {}
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                return Err(WorkerError::io(
                    format!("cannot remove {}", oom_record_file.display()),
                    error,
                ));
            }
        }
        Ok(AttemptGuard {
            library: library.to_path_buf(),
            limit_bytes: slice_bytes,
            account_file,
            oom_record_file,
            gpu_uuid: gpu_uuid.to_string(),
        })
    }

    pub fn account_file(&self) -> &Path {
        &self.account_file
    }

    pub fn oom_record_file(&self) -> &Path {
        &self.oom_record_file
    }

    /// The variables to set on the program, after the job's own environment
    /// (`job_environment`) so that these win: the guard's variables can never be
    /// overridden by the job. The job's own `LD_PRELOAD` is kept, after the guard (the
    /// guard must be first to see every driver call); the job's own values of the
    /// cooperative framework variables are kept as they are, and PyTorch's options are
    /// added to where the job sets some (see [`PYTORCH_ALLOCATOR_OPTIONS`]).
    pub fn environment(&self, job_environment: &BTreeMap<String, String>) -> Vec<(String, String)> {
        let job = |name: &str| job_environment.get(name).map(String::as_str);
        let library = self.library.to_string_lossy().into_owned();
        let preload = match job("LD_PRELOAD").map(str::trim) {
            Some(theirs) if !theirs.is_empty() => format!("{library}:{theirs}"),
            _ => library,
        };
        let mut variables = vec![
            ("LD_PRELOAD".to_string(), preload),
            (ENV_LIMIT_BYTES.to_string(), self.limit_bytes.to_string()),
            (ENV_ACCOUNT.to_string(), path_text(&self.account_file)),
            (ENV_OOM_RECORD.to_string(), path_text(&self.oom_record_file)),
            // The uuid names the slice's GPU whatever order CUDA would number devices in;
            // the program sees it as its only device, ordinal 0.
            ("CUDA_VISIBLE_DEVICES".to_string(), self.gpu_uuid.clone()),
        ];
        let cooperative = [
            // TensorFlow otherwise maps nearly all the memory it sees at start.
            ("TF_FORCE_GPU_ALLOW_GROWTH", "true"),
            // JAX otherwise preallocates 75% of the memory it sees at start.
            ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
            ("XLA_PYTHON_CLIENT_MEM_FRACTION", XLA_MEMORY_FRACTION),
        ];
        for (name, value) in cooperative {
            if job(name).is_none() {
                variables.push((name.to_string(), value.to_string()));
            }
        }
        // Newer PyTorch also reads PYTORCH_ALLOC_CONF, and versions differ in which of the
        // two wins: a job that sets only that one keeps its options in ours too.
        let theirs = job("PYTORCH_CUDA_ALLOC_CONF").or_else(|| job("PYTORCH_ALLOC_CONF"));
        variables.push((
            "PYTORCH_CUDA_ALLOC_CONF".to_string(),
            pytorch_allocator_options(theirs),
        ));
        variables
    }

    /// The program's whole environment: the job's own with the guard's over it, each
    /// name once, so the guard's win (see [`AttemptGuard::environment`]) whoever reads
    /// the list (a container's list with a name twice would give the first).
    pub fn program_environment(
        &self,
        job_environment: &BTreeMap<String, String>,
    ) -> BTreeMap<String, String> {
        let mut merged = job_environment.clone();
        merged.extend(self.environment(job_environment));
        merged
    }

    /// The guard library the program preloads.
    pub fn library(&self) -> &Path {
        &self.library
    }

    /// The account now: in use and peak for the attempt and per process, for progress
    /// reports. `None` while there is no account file.
    pub fn read_usage(&self) -> Result<Option<AccountUsage>, WorkerError> {
        read_account_usage(&self.account_file)
    }

    /// Every allocation the guard refused so far; empty while there is no record.
    pub fn read_oom_record(&self) -> Result<Vec<OomRecordLine>, WorkerError> {
        read_oom_record(&self.oom_record_file)
    }
}

/// The job's PyTorch allocator options with [`PYTORCH_ALLOCATOR_OPTIONS`] added where it
/// does not name them. An empty value the job sets is kept empty: it is how a job on a
/// PyTorch too old for an option (expandable segments came in 2.1) asks for PyTorch's
/// defaults. With `backend:cudaMallocAsync` nothing is added: that allocator ignores the
/// native allocator's options and warns about each.
fn pytorch_allocator_options(theirs: Option<&str>) -> String {
    let theirs = theirs.map(str::trim);
    if theirs == Some("") {
        return String::new();
    }
    let theirs = theirs.unwrap_or_default();
    // Options are `name:value` separated by commas; a bracketed list value holds commas
    // too, but its pieces never start with an option's name.
    let value_of = |wanted: &str| {
        theirs.split(',').find_map(|option| {
            let (name, value) = option.split_once(':')?;
            (name.trim() == wanted).then(|| value.trim())
        })
    };
    if value_of("backend") == Some("cudaMallocAsync") {
        return theirs.to_string();
    }
    let mut options: Vec<String> = (!theirs.is_empty())
        .then(|| theirs.to_string())
        .into_iter()
        .collect();
    for (name, value) in PYTORCH_ALLOCATOR_OPTIONS {
        if value_of(name).is_none() {
            options.push(format!("{name}:{value}"));
        }
    }
    options.join(",")
}

fn path_text(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

fn guard_error(error: AccountError) -> WorkerError {
    WorkerError::Guard(error.to_string())
}

/// Whether an account error means only that the file is not there (yet).
fn is_missing(error: &AccountError) -> bool {
    matches!(error, AccountError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}

/// An attempt's account now (see [`AttemptGuard::read_usage`]); `None` without a file.
pub fn read_account_usage(account_file: &Path) -> Result<Option<AccountUsage>, WorkerError> {
    match Account::open(account_file) {
        Ok(account) => Ok(Some(account.usage())),
        Err(error) if is_missing(&error) => Ok(None),
        Err(error) => Err(guard_error(error)),
    }
}

/// The process ids holding a slot in an account: the processes the guard has seen. For
/// the watchdog, which wants the reason as text when the account cannot be read.
pub fn account_process_ids(account_file: &Path) -> Result<HashSet<u32>, String> {
    match read_account_usage(account_file) {
        Ok(Some(usage)) => Ok(usage
            .processes
            .iter()
            .map(|process| process.process_id)
            .collect()),
        Ok(None) => Err(format!("{} does not exist", account_file.display())),
        Err(error) => Err(error.to_string()),
    }
}

/// The most of an OOM record the worker reads: thousands of lines, far more than the
/// first refusal it needs, and a bound on what a job can make the worker hold.
pub const MOST_OOM_RECORD_BYTES: u64 = 1 << 20;

/// The lines of an OOM record (see [`AttemptGuard::read_oom_record`]); empty without a
/// file. The record is in a directory the job may write, so the worker reads it never
/// through a symbolic link (to another job's file, or one of the host's), only as a
/// regular file, and at most [`MOST_OOM_RECORD_BYTES`] of it, whole lines only.
pub fn read_oom_record(path: &Path) -> Result<Vec<OomRecordLine>, WorkerError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let cannot_read = |error| WorkerError::io(format!("cannot read {}", path.display()), error);
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
    {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(cannot_read(error)),
    };
    if !file.metadata().map_err(cannot_read)?.is_file() {
        return Err(WorkerError::Guard(format!(
            "{}: not a regular file",
            path.display()
        )));
    }
    let mut bytes = Vec::new();
    file.take(MOST_OOM_RECORD_BYTES)
        .read_to_end(&mut bytes)
        .map_err(cannot_read)?;
    let whole_lines = bytes
        .iter()
        .rposition(|byte| *byte == b'\n')
        .map_or(0, |last| last + 1);
    let text = String::from_utf8_lossy(&bytes[..whole_lines]);
    OomRecordLine::parse_record(&text)
        .map_err(|error| WorkerError::Guard(format!("{}: {error}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn prepared(directory: &Path) -> AttemptGuard {
        AttemptGuard::prepare(
            Path::new("/opt/carve/libcarve_guard.so"),
            directory,
            3 * GIB,
            "GPU-1234",
        )
        .unwrap()
    }

    /// A prepared guard (in a temporary directory, kept alive by the caller) and the
    /// variables it sets for a job with `job`'s environment, each set once.
    fn environment_of(
        job: &[(&str, &str)],
    ) -> (tempfile::TempDir, AttemptGuard, BTreeMap<String, String>) {
        let directory = tempfile::tempdir().unwrap();
        let guard = prepared(directory.path());
        let job: BTreeMap<String, String> = job
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        let variables = guard.environment(&job);
        let names: HashSet<&String> = variables.iter().map(|(name, _)| name).collect();
        assert_eq!(
            names.len(),
            variables.len(),
            "a variable set twice: {variables:?}"
        );
        (directory, guard, variables.into_iter().collect())
    }

    /// The record is in the job's directory: a link the job planted there (to a file of
    /// the host) is not read through, a device is not read at all, and a huge record is
    /// read only to its bound.
    #[test]
    fn a_planted_oom_record_is_not_followed_and_a_huge_one_is_bounded() {
        let directory = tempfile::tempdir().unwrap();
        let secret = directory.path().join("host-secret");
        std::fs::write(&secret, "{\"not\": \"yours\"}\n").unwrap();
        let planted = directory.path().join(OOM_RECORD_FILE_NAME);
        std::os::unix::fs::symlink(&secret, &planted).unwrap();
        assert!(read_oom_record(&planted).is_err());
        assert!(read_oom_record(Path::new("/dev/zero")).is_err());

        let huge = directory.path().join("huge.jsonl");
        let line = OomRecordLine {
            entry_point: "cuMemAlloc_v2".into(),
            requested_bytes: 1,
            in_use_bytes: 2,
            limit_bytes: 3,
            peak_bytes: 2,
            process_id: 7,
            time_unix_ms: 0,
        }
        .to_json_line();
        let repeats = (2 * MOST_OOM_RECORD_BYTES as usize) / line.len();
        std::fs::write(&huge, line.repeat(repeats)).unwrap();
        let lines = read_oom_record(&huge).unwrap();
        assert!(!lines.is_empty());
        assert!(lines.len() < repeats, "read only to the bound");
    }

    #[test]
    fn the_environment_carries_the_guard_and_the_cooperative_caps() {
        let (directory, _guard, environment) = environment_of(&[]);
        let account = directory.path().join("gpu-memory.account");
        let record = directory.path().join("gpu-oom.jsonl");
        let expected: BTreeMap<String, String> = [
            ("LD_PRELOAD", "/opt/carve/libcarve_guard.so"),
            ("CARVE_GUARD_LIMIT_BYTES", "3221225472"),
            ("CARVE_GUARD_ACCOUNT", account.to_str().unwrap()),
            ("CARVE_GUARD_OOM_RECORD", record.to_str().unwrap()),
            ("CUDA_VISIBLE_DEVICES", "GPU-1234"),
            ("TF_FORCE_GPU_ALLOW_GROWTH", "true"),
            ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
            ("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95"),
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();
        assert_eq!(environment, expected);
    }

    #[test]
    fn the_job_cannot_override_the_guard_and_its_own_preload_comes_after_it() {
        let (_directory, guard, environment) = environment_of(&[
            ("LD_PRELOAD", "libjemalloc.so.2 /lib/libtcmalloc.so"),
            ("CARVE_GUARD_LIMIT_BYTES", "999999999999"),
            ("CARVE_GUARD_ACCOUNT", "/tmp/elsewhere"),
            ("CARVE_GUARD_OOM_RECORD", "/dev/null"),
            ("CUDA_VISIBLE_DEVICES", "0,1,2,3"),
        ]);
        assert_eq!(
            environment["LD_PRELOAD"],
            "/opt/carve/libcarve_guard.so:libjemalloc.so.2 /lib/libtcmalloc.so"
        );
        assert_eq!(
            environment["CARVE_GUARD_LIMIT_BYTES"],
            (3 * GIB).to_string()
        );
        assert_eq!(
            Path::new(&environment["CARVE_GUARD_ACCOUNT"]),
            guard.account_file()
        );
        assert_eq!(
            Path::new(&environment["CARVE_GUARD_OOM_RECORD"]),
            guard.oom_record_file()
        );
        assert_eq!(environment["CUDA_VISIBLE_DEVICES"], "GPU-1234");
        // A blank LD_PRELOAD leaves the guard alone, without a dangling separator.
        let (_directory, _guard, blank) = environment_of(&[("LD_PRELOAD", "  ")]);
        assert_eq!(blank["LD_PRELOAD"], "/opt/carve/libcarve_guard.so");
    }

    #[test]
    fn merged_with_the_job_s_the_guard_s_variables_win() {
        let directory = tempfile::tempdir().unwrap();
        let guard = prepared(directory.path());
        let job = BTreeMap::from([
            ("CARVE_GUARD_LIMIT_BYTES".to_string(), "1".to_string()),
            ("MY_SETTING".to_string(), "kept".to_string()),
        ]);
        let set = guard.program_environment(&job);
        assert_eq!(set["CARVE_GUARD_LIMIT_BYTES"], (3 * GIB).to_string());
        assert_eq!(set["MY_SETTING"], "kept");
        assert_eq!(set["LD_PRELOAD"], "/opt/carve/libcarve_guard.so");
    }

    #[test]
    fn the_job_s_framework_settings_are_kept() {
        let (_directory, _guard, environment) = environment_of(&[
            ("TF_FORCE_GPU_ALLOW_GROWTH", "false"),
            ("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5"),
            ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
        ]);
        // Set by the job: left out, so the job's own value stands.
        assert!(!environment.contains_key("TF_FORCE_GPU_ALLOW_GROWTH"));
        assert!(!environment.contains_key("XLA_PYTHON_CLIENT_MEM_FRACTION"));
        assert_eq!(environment["XLA_PYTHON_CLIENT_PREALLOCATE"], "false");
        assert_eq!(
            environment["PYTORCH_CUDA_ALLOC_CONF"],
            "max_split_size_mb:128,expandable_segments:True"
        );
    }

    #[test]
    fn pytorch_options_the_job_names_are_never_changed() {
        let cases = [
            (None, "expandable_segments:True"),
            (
                Some("expandable_segments:False"),
                "expandable_segments:False",
            ),
            (
                Some(" expandable_segments : False,max_split_size_mb:64"),
                "expandable_segments : False,max_split_size_mb:64",
            ),
            (Some("backend:cudaMallocAsync"), "backend:cudaMallocAsync"),
            (
                Some("backend:native,roundup_power2_divisions:[256:1,512:2]"),
                "backend:native,roundup_power2_divisions:[256:1,512:2],expandable_segments:True",
            ),
            // Empty: the job asks for PyTorch's own defaults.
            (Some(""), ""),
        ];
        for (theirs, expected) in cases {
            assert_eq!(pytorch_allocator_options(theirs), expected, "{theirs:?}");
        }
        let (_directory, _guard, generic) =
            environment_of(&[("PYTORCH_ALLOC_CONF", "backend:cudaMallocAsync")]);
        assert_eq!(
            generic["PYTORCH_CUDA_ALLOC_CONF"],
            "backend:cudaMallocAsync"
        );
    }

    #[test]
    fn preparing_creates_the_account_with_the_slice_as_its_limit() {
        let directory = tempfile::tempdir().unwrap();
        std::fs::write(directory.path().join("gpu-oom.jsonl"), "stale\n").unwrap();
        let guard = prepared(directory.path());
        let usage = guard.read_usage().unwrap().expect("the account exists");
        assert_eq!(usage.limit_bytes, 3 * GIB);
        assert_eq!(usage.in_use_bytes, 0);
        assert!(usage.processes.is_empty());
        // A previous run's record is gone: everything read later is this attempt's.
        assert!(guard.read_oom_record().unwrap().is_empty());
        // What the guard will do in the program: the worker reads it live.
        let account = Account::open(guard.account_file()).unwrap();
        let slot = account.register(4242).unwrap();
        account.try_reserve(slot, GIB).unwrap();
        let usage = guard.read_usage().unwrap().unwrap();
        assert_eq!((usage.in_use_bytes, usage.peak_bytes), (GIB, GIB));
        assert_eq!(usage.processes.len(), 1);
        assert_eq!(usage.processes[0].process_id, 4242);
        assert_eq!(
            account_process_ids(guard.account_file()).unwrap(),
            HashSet::from([4242])
        );
    }

    #[test]
    fn missing_files_read_as_nothing_yet() {
        let directory = tempfile::tempdir().unwrap();
        assert_eq!(
            read_account_usage(&directory.path().join("gpu-memory.account")).unwrap(),
            None
        );
        assert!(
            read_oom_record(&directory.path().join("gpu-oom.jsonl"))
                .unwrap()
                .is_empty()
        );
        let error = account_process_ids(&directory.path().join("gpu-memory.account")).unwrap_err();
        assert!(error.contains("does not exist"), "{error}");
    }

    #[test]
    fn the_oom_record_reads_back_what_the_guard_appends() {
        let directory = tempfile::tempdir().unwrap();
        let guard = prepared(directory.path());
        let line = OomRecordLine {
            entry_point: "cuMemAlloc_v2".into(),
            requested_bytes: 2 * GIB,
            in_use_bytes: 2 * GIB,
            limit_bytes: 3 * GIB,
            peak_bytes: 2 * GIB,
            process_id: 4242,
            time_unix_ms: 1_700_000_000_000,
        };
        carve_guard_account::append_oom_record(guard.oom_record_file(), &line).unwrap();
        assert_eq!(guard.read_oom_record().unwrap(), vec![line]);
        std::fs::write(guard.oom_record_file(), "{not json\n").unwrap();
        let error = guard.read_oom_record().unwrap_err().to_string();
        assert!(error.contains("gpu-oom.jsonl"), "{error}");
    }

    #[test]
    fn the_guard_library_is_checked_for_ld_preload() {
        let directory = tempfile::tempdir().unwrap();
        let library = directory.path().join(GUARD_LIBRARY_FILE_NAME);
        let missing = check_guard_library(&library).unwrap_err().to_string();
        assert!(
            missing.starts_with("--guard-library: cannot find"),
            "{missing}"
        );
        std::fs::write(&library, b"\x7fELF").unwrap();
        let checked = check_guard_library(&library).unwrap();
        assert!(checked.is_absolute());
        assert_eq!(checked, std::fs::canonicalize(&library).unwrap());
        let directory_itself = check_guard_library(directory.path()).unwrap_err();
        assert!(directory_itself.to_string().contains("not a file"));
        let spaced = directory.path().join("with space.so");
        std::fs::write(&spaced, b"\x7fELF").unwrap();
        let error = check_guard_library(&spaced).unwrap_err().to_string();
        assert!(error.contains("colon or a space"), "{error}");
        assert_eq!(
            default_guard_library(Path::new("/opt/carve/bin/carve-worker")),
            Path::new("/opt/carve/bin/libcarve_guard.so")
        );
    }

    fn gpu(simulated: bool) -> WorkerGpu {
        WorkerGpu {
            uuid: "GPU-1234".into(),
            index: 0,
            total_bytes: 16 * GIB,
            context_bytes: GIB / 2,
            simulated,
            model_name: String::new(),
            compute_capability: String::new(),
            mig_enabled: None,
        }
    }

    #[test]
    fn the_guard_library_is_looked_for_only_with_a_real_gpu() {
        let directory = tempfile::tempdir().unwrap();
        let worker_program = directory.path().join("carve-worker");
        let missing = directory.path().join("nowhere.so");
        // Simulated GPUs only: never checked, even when named and missing.
        assert_eq!(
            find_guard_library(Some(&missing), &worker_program, &[gpu(true)]).unwrap(),
            None
        );
        let real = [gpu(true), gpu(false)];
        // The default one missing: the worker starts without the guard.
        assert_eq!(
            find_guard_library(None, &worker_program, &real).unwrap(),
            None
        );
        // One named and missing: the worker does not start.
        let error = find_guard_library(Some(&missing), &worker_program, &real).unwrap_err();
        assert!(error.to_string().contains("nowhere.so"), "{error}");
        let library = directory.path().join(GUARD_LIBRARY_FILE_NAME);
        std::fs::write(&library, b"\x7fELF").unwrap();
        let found = find_guard_library(None, &worker_program, &real).unwrap();
        assert_eq!(found, Some(std::fs::canonicalize(&library).unwrap()));
    }
}
