//! Where a command's job spec comes from: the file it names, or stdin when that name is
//! `-` (`generate-spec | carve submit -`). Shared by estimate, run and submit so the three
//! read, name and resolve a spec the same way.

use std::io::Read as _;
use std::path::Path;

use carve_core::validate::ValidatedJob;

fn is_stdin(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// The spec's text: the file at `path`, or all of stdin for `-`.
pub fn read_job_spec_text(path: &Path) -> std::io::Result<String> {
    if is_stdin(path) {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        Ok(text)
    } else {
        std::fs::read_to_string(path)
    }
}

/// How messages name the spec: its path, or `<stdin>`.
pub fn job_spec_name(path: &Path) -> String {
    if is_stdin(path) {
        "<stdin>".to_string()
    } else {
        path.display().to_string()
    }
}

/// The folder relative data paths resolve against: the spec file's, or the current one
/// for a spec from stdin (it has no folder of its own).
pub fn data_base_directory(path: &Path) -> &Path {
    if is_stdin(path) {
        return Path::new(".");
    }
    path.parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Shows a validated spec's warnings on stderr, named as its errors are; the job goes on.
pub fn print_job_spec_warnings(job: &ValidatedJob, spec_name: &str) {
    for warning in job.warnings() {
        eprintln!("{spec_name}: warning: {warning}");
    }
}
