//! A command job's checkpoints, as its program tells of them: the line it prints once a
//! checkpoint is written, `CARVE_CHECKPOINT step=N path=REL`, with `REL` relative to its
//! `{checkpoint_dir}` (a file or a directory), and the variables that tell the job's next
//! attempt which checkpoint to resume from.
//!
//! The worker copies what such a line names to a place the program cannot write, and
//! only then reports it; the scheduler records that copy like an engine job's checkpoint,
//! and the next attempt gets it read-only as `CARVE_RESUME_FROM`, with the step it was
//! reported at as `CARVE_RESUME_STEP`. So the step a job resumes from is the step the
//! scheduler recorded, whatever a stopped or stale attempt wrote afterwards. The path is
//! the tenant's word: it is checked here to stay inside the directory by its spelling,
//! and the worker never follows a link while it copies.

/// The word that starts a checkpoint line.
pub const CHECKPOINT_MARK: &str = "CARVE_CHECKPOINT";

/// Where the next attempt finds the recorded checkpoint (read-only); set only when one
/// was recorded and is on the attempt's node.
pub const ENVIRONMENT_RESUME_FROM: &str = "CARVE_RESUME_FROM";
/// The step the recorded checkpoint was reported at; set with [`ENVIRONMENT_RESUME_FROM`].
pub const ENVIRONMENT_RESUME_STEP: &str = "CARVE_RESUME_STEP";

/// The longest `path=` a line may name, in bytes, and its most components.
pub const MOST_PATH_BYTES: usize = 1024;
pub const MOST_PATH_COMPONENTS: usize = 32;
/// A file system's limit on one name.
const MOST_COMPONENT_BYTES: usize = 255;

/// What one checkpoint line said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointLine {
    pub step: u64,
    /// The path's components below `{checkpoint_dir}`, each a plain name (no `.`, `..`,
    /// `/` or NUL).
    pub components: Vec<String>,
}

impl CheckpointLine {
    /// The path as the program wrote it, components joined by `/`.
    pub fn relative_path(&self) -> String {
        self.components.join("/")
    }
}

/// `None` when `line` is not a checkpoint line; else what it said, or why it cannot be
/// taken (a reason naming the key, for the job's log).
pub fn parse_checkpoint_line(line: &str) -> Option<Result<CheckpointLine, String>> {
    let rest = line.trim_start().strip_prefix(CHECKPOINT_MARK)?;
    // `CARVE_CHECKPOINTS` or `CARVE_CHECKPOINT=1` are not the mark.
    if !(rest.is_empty() || rest.starts_with(char::is_whitespace)) {
        return None;
    }
    let mut step = None;
    let mut path = None;
    for pair in rest.split_whitespace() {
        match pair.split_once('=') {
            Some(("step", value)) => step = Some(value),
            Some(("path", value)) => path = Some(value),
            _ => {}
        }
    }
    Some(checked_line(step, path))
}

fn checked_line(step: Option<&str>, path: Option<&str>) -> Result<CheckpointLine, String> {
    let step = step.ok_or("it has no step= (a whole number)")?;
    let step = step
        .parse::<u64>()
        .map_err(|_| format!("step={step} is not a whole number"))?;
    let path = path.ok_or("it has no path= (relative to {checkpoint_dir})")?;
    Ok(CheckpointLine {
        step,
        components: relative_components(path)?,
    })
}

/// The components of `path`, a path below `{checkpoint_dir}` by its spelling: relative,
/// at most [`MOST_PATH_BYTES`] and [`MOST_PATH_COMPONENTS`], every component a plain
/// name. Repeated and trailing slashes are read as one.
pub fn relative_components(path: &str) -> Result<Vec<String>, String> {
    if path.is_empty() {
        return Err("path= is empty".to_string());
    }
    if path.starts_with('/') {
        return Err(format!(
            "path={path} is absolute: it names a file or directory relative to {{checkpoint_dir}}"
        ));
    }
    if path.len() > MOST_PATH_BYTES {
        return Err(format!(
            "path= is {} bytes, more than {MOST_PATH_BYTES}",
            path.len()
        ));
    }
    let components: Vec<String> = path
        .split('/')
        .filter(|component| !component.is_empty())
        .map(str::to_string)
        .collect();
    if components.len() > MOST_PATH_COMPONENTS {
        return Err(format!(
            "path={path} has {} components, more than {MOST_PATH_COMPONENTS}",
            components.len()
        ));
    }
    for component in &components {
        if component == "." || component == ".." {
            return Err(format!(
                "path={path} holds {component:?}: it must stay inside {{checkpoint_dir}}"
            ));
        }
        if component.contains('\0') || component.len() > MOST_COMPONENT_BYTES {
            return Err(format!("path={path} holds a name no file system takes"));
        }
    }
    Ok(components)
}

/// The name of the recorded copy of attempt `attempt_number`'s checkpoint of `step`, a
/// directory beside the others of its job; [`parse_recorded_name`] reads it back.
pub fn recorded_name(attempt_number: u32, step: u64) -> String {
    format!("attempt-{attempt_number}.step-{step}")
}

/// `(attempt, step)` of a name [`recorded_name`] made, or `None`.
pub fn parse_recorded_name(name: &str) -> Option<(u32, u64)> {
    let (attempt, step) = name.strip_prefix("attempt-")?.split_once(".step-")?;
    let digits = |text: &str| !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit());
    if !digits(attempt) || !digits(step) {
        return None;
    }
    Some((attempt.parse().ok()?, step.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(line: &str) -> Result<CheckpointLine, String> {
        parse_checkpoint_line(line).expect("a checkpoint line")
    }

    #[test]
    fn a_checkpoint_line_names_its_step_and_a_path_below_the_directory() {
        let line = parsed("CARVE_CHECKPOINT step=120 path=checkpoints//epoch-3.pt").unwrap();
        assert_eq!(line.step, 120);
        assert_eq!(line.components, ["checkpoints", "epoch-3.pt"]);
        assert_eq!(line.relative_path(), "checkpoints/epoch-3.pt");
        assert_eq!(
            parsed("  CARVE_CHECKPOINT path=checkpoint-500/ step=500 extra=1")
                .unwrap()
                .components,
            ["checkpoint-500"]
        );
    }

    #[test]
    fn other_lines_are_not_checkpoint_lines() {
        for line in [
            "CARVE_CHECKPOINTS step=1 path=a",
            "CARVE_CHECKPOINT=1",
            "saved CARVE_CHECKPOINT step=1 path=a",
            "CARVE_PROGRESS step=1",
        ] {
            assert_eq!(parse_checkpoint_line(line), None, "{line}");
        }
    }

    #[test]
    fn a_path_that_could_leave_the_directory_is_refused_with_the_reason() {
        for (line, reason) in [
            ("CARVE_CHECKPOINT step=1 path=/etc/shadow", "absolute"),
            (
                "CARVE_CHECKPOINT step=1 path=../other-job/model.pt",
                "\"..\"",
            ),
            ("CARVE_CHECKPOINT step=1 path=a/../../b", "\"..\""),
            ("CARVE_CHECKPOINT step=1 path=./", "\".\""),
            ("CARVE_CHECKPOINT step=1", "no path="),
            ("CARVE_CHECKPOINT path=a", "no step="),
            ("CARVE_CHECKPOINT step=-1 path=a", "not a whole number"),
        ] {
            let refused = parsed(line).expect_err(line);
            assert!(refused.contains(reason), "{line}: {refused}");
        }
        let deep = vec!["d"; MOST_PATH_COMPONENTS + 1].join("/");
        assert!(relative_components(&deep).is_err());
        assert!(relative_components(&"x".repeat(MOST_PATH_BYTES + 1)).is_err());
        assert!(relative_components(&"x".repeat(256)).is_err());
    }

    #[test]
    fn recorded_names_read_back() {
        assert_eq!(
            parse_recorded_name(&recorded_name(3, 1200)),
            Some((3, 1200))
        );
        for name in [
            "attempt-3.step-",
            "attempt-.step-1",
            "attempt-3.step-1.partial",
            "x",
        ] {
            assert_eq!(parse_recorded_name(name), None, "{name}");
        }
    }
}
