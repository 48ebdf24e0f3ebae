//! Checkpoint names, promotion, and what a recorded checkpoint supersedes.

use std::path::Path;

use super::{
    CheckpointName, delete_superseded, is_superseded, parse_checkpoint_name, promote, promoted_path,
};

const JOB: &str = "job-0123";

fn name(attempt_number: u32, step: Option<u64>) -> CheckpointName {
    CheckpointName {
        attempt_number,
        step,
    }
}

#[test]
fn names_are_read_strictly_for_their_job() {
    assert_eq!(
        parse_checkpoint_name(JOB, "job-0123.attempt-2.ckpt"),
        Some(name(2, None))
    );
    assert_eq!(
        parse_checkpoint_name(JOB, "job-0123.attempt-2.step-40.ckpt"),
        Some(name(2, Some(40)))
    );
    for other in [
        "job-01234.attempt-2.ckpt",
        "job-0123.attempt-.ckpt",
        "job-0123.attempt-2.step-.ckpt",
        "job-0123.attempt-2.step-4x.ckpt",
        "job-0123.attempt-+2.ckpt",
        "job-0123.attempt-2.ckpt.partial",
        "job-0123.attempt-2.run",
        "job-9.attempt-2.ckpt",
    ] {
        assert_eq!(parse_checkpoint_name(JOB, other), None, "{other}");
    }
}

#[test]
fn a_recorded_checkpoint_supersedes_older_attempts_and_its_own_earlier_steps_only() {
    let recorded = name(3, Some(40));
    assert!(is_superseded(name(1, None), recorded));
    assert!(is_superseded(name(2, Some(90)), recorded));
    assert!(is_superseded(name(3, Some(20)), recorded));
    assert!(!is_superseded(name(3, Some(40)), recorded));
    assert!(!is_superseded(name(3, Some(60)), recorded));
    assert!(
        !is_superseded(name(3, None), recorded),
        "the trainer writes there"
    );
    assert!(!is_superseded(name(4, Some(1)), recorded));
    assert!(!is_superseded(name(4, None), recorded));
}

#[test]
fn a_promoted_checkpoint_keeps_its_content_when_the_working_file_is_replaced() {
    let directory = tempfile::tempdir().unwrap();
    let working = directory.path().join(format!("{JOB}.attempt-1.ckpt"));
    std::fs::write(&working, b"step 10").unwrap();
    let promoted = promote(&working, 10).unwrap();
    assert_eq!(promoted, promoted_path(&working, 10));
    assert_eq!(
        promoted.file_name().unwrap().to_str().unwrap(),
        "job-0123.attempt-1.step-10.ckpt"
    );
    // The trainer's next checkpoint: a new file renamed over the working name, as a
    // stale attempt would keep doing.
    let next = directory.path().join("next.tmp");
    std::fs::write(&next, b"step 450").unwrap();
    std::fs::rename(&next, &working).unwrap();
    assert_eq!(std::fs::read(&promoted).unwrap(), b"step 10");
    // Promoting the same step again replaces the file, whatever was there.
    std::fs::write(&working, b"step 10 again").unwrap();
    promote(&working, 10).unwrap();
    assert_eq!(std::fs::read(&promoted).unwrap(), b"step 10 again");
}

#[test]
fn deleting_superseded_files_touches_only_this_jobs_older_checkpoints() {
    let directory = tempfile::tempdir().unwrap();
    let path = |file: &str| directory.path().join(file);
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("precious");
    std::fs::write(&target, b"keep").unwrap();
    for file in [
        "job-0123.attempt-1.ckpt",
        "job-0123.attempt-1.step-5.ckpt",
        "job-0123.attempt-2.step-5.ckpt",
        "job-0123.attempt-2.step-10.ckpt",
        "job-0123.attempt-2.step-15.ckpt",
        "job-0123.attempt-2.ckpt",
        "job-0999.attempt-1.ckpt",
        "notes.txt",
    ] {
        std::fs::write(path(file), file).unwrap();
    }
    // A link with a checkpoint's name (a hostile program's) is removed, not followed.
    std::os::unix::fs::symlink(&target, path("job-0123.attempt-0.ckpt")).unwrap();
    // A directory with such a name is left.
    std::fs::create_dir(path("job-0123.attempt-1.step-1.ckpt")).unwrap();

    let recorded = path("job-0123.attempt-2.step-10.ckpt");
    let mut deleted = delete_superseded(directory.path(), JOB, &recorded);
    deleted.sort();
    let mut expected = vec![
        path("job-0123.attempt-0.ckpt"),
        path("job-0123.attempt-1.ckpt"),
        path("job-0123.attempt-1.step-5.ckpt"),
        path("job-0123.attempt-2.step-5.ckpt"),
    ];
    expected.sort();
    assert_eq!(deleted, expected);
    for kept in [
        "job-0123.attempt-2.step-10.ckpt",
        "job-0123.attempt-2.step-15.ckpt",
        "job-0123.attempt-2.ckpt",
        "job-0999.attempt-1.ckpt",
        "notes.txt",
        "job-0123.attempt-1.step-1.ckpt",
    ] {
        assert!(path(kept).exists(), "{kept} was deleted");
    }
    assert_eq!(std::fs::read(&target).unwrap(), b"keep");
    // An unknown layout deletes nothing.
    assert!(delete_superseded(directory.path(), JOB, Path::new("/elsewhere/x.ckpt")).is_empty());
}
