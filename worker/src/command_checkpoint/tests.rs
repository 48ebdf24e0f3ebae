use std::os::unix::fs::symlink;

use carve_core::command::checkpoint::parse_checkpoint_line;

use super::*;

fn line(text: &str) -> CheckpointLine {
    parse_checkpoint_line(text)
        .expect("a checkpoint line")
        .expect("a valid one")
}

/// A job's directory `job-1` and its recorded directory, in a fresh temporary directory.
fn directories() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let root = tempfile::tempdir().unwrap();
    let job = root.path().join("job-1");
    std::fs::create_dir(&job).unwrap();
    let recorded = recorded_directory(&job);
    (root, job, recorded)
}

/// Every file's text under `directory`, by its path below it.
fn texts_under(directory: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut pending = vec![directory.to_path_buf()];
    while let Some(next) = pending.pop() {
        for entry in std::fs::read_dir(&next).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                let below = path.strip_prefix(directory).unwrap().display().to_string();
                found.push((below, std::fs::read_to_string(&path).unwrap_or_default()));
            }
        }
    }
    found.sort();
    found
}

#[test]
fn the_recorded_directory_is_beside_the_jobs() {
    assert_eq!(
        recorded_directory(Path::new("/var/lib/carve/job-1")),
        Path::new("/var/lib/carve/job-1.recorded")
    );
}

#[test]
fn a_reported_file_is_copied_and_keeps_its_step_when_the_program_rewrites_it() {
    let (_root, job, recorded) = directories();
    std::fs::create_dir(job.join("checkpoints")).unwrap();
    std::fs::write(job.join("checkpoints/model.pt"), "step 100").unwrap();
    let location = record_reported_checkpoint(
        &job,
        &recorded,
        2,
        &line("CARVE_CHECKPOINT step=100 path=checkpoints/model.pt"),
    )
    .unwrap();
    assert_eq!(
        location,
        recorded.join("attempt-2.step-100/checkpoints/model.pt")
    );
    // The program writes its next checkpoint in place, as torch.save does.
    std::fs::write(job.join("checkpoints/model.pt"), "step 200").unwrap();
    assert_eq!(std::fs::read_to_string(&location).unwrap(), "step 100");
    assert_eq!(
        resume_checkpoint(&recorded, &location.to_string_lossy()),
        Some(location)
    );
}

#[test]
fn a_reported_directory_is_copied_whole() {
    let (_root, job, recorded) = directories();
    std::fs::create_dir_all(job.join("checkpoint-500/optimizer")).unwrap();
    std::fs::write(job.join("checkpoint-500/model.safetensors"), "weights").unwrap();
    std::fs::write(job.join("checkpoint-500/optimizer/state.pt"), "moments").unwrap();
    let location = record_reported_checkpoint(
        &job,
        &recorded,
        1,
        &line("CARVE_CHECKPOINT step=500 path=checkpoint-500/"),
    )
    .unwrap();
    assert_eq!(
        texts_under(&location),
        [
            ("model.safetensors".to_string(), "weights".to_string()),
            ("optimizer/state.pt".to_string(), "moments".to_string()),
        ]
    );
}

/// A tenant names a link to what it must not read (another tenant's data, the worker's
/// token): at the end of its path, on the way, or inside a reported directory. Nothing is
/// recorded, and nothing of the secret lands where the job's next attempt would read it.
/// With the links followed (no `O_NOFOLLOW`, a `statat` that follows), each copy holds
/// the secret.
#[test]
fn a_link_anywhere_in_a_reported_checkpoint_is_refused_never_followed() {
    let (root, job, recorded) = directories();
    let secret = root.path().join("other-tenant");
    std::fs::create_dir(&secret).unwrap();
    std::fs::write(secret.join("token"), "the secret").unwrap();
    symlink(secret.join("token"), job.join("model.pt")).unwrap();
    symlink(&secret, job.join("via")).unwrap();
    std::fs::create_dir(job.join("checkpoint-7")).unwrap();
    symlink(secret.join("token"), job.join("checkpoint-7/weights")).unwrap();
    for (text, reason) in [
        ("CARVE_CHECKPOINT step=1 path=model.pt", "symbolic link"),
        (
            "CARVE_CHECKPOINT step=2 path=via/token",
            "not a directory of the job's own",
        ),
        ("CARVE_CHECKPOINT step=3 path=checkpoint-7", "symbolic link"),
    ] {
        let refused = record_reported_checkpoint(&job, &recorded, 1, &line(text)).expect_err(text);
        assert!(refused.contains(reason), "{text}: {refused}");
    }
    let leaked: Vec<_> = texts_under(&recorded)
        .into_iter()
        .filter(|(_, text)| text.contains("the secret"))
        .collect();
    assert!(leaked.is_empty(), "the secret was copied: {leaked:?}");
    assert!(
        texts_under(&recorded).is_empty(),
        "{:?}",
        texts_under(&recorded)
    );
}

#[test]
fn a_fifo_is_refused_without_being_opened() {
    let (_root, job, recorded) = directories();
    let fifo = job.join("model.pt");
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &fifo,
        FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    // Opening a FIFO for reading would wait for a writer that never comes.
    let refused = record_reported_checkpoint(
        &job,
        &recorded,
        1,
        &line("CARVE_CHECKPOINT step=1 path=model.pt"),
    )
    .unwrap_err();
    assert!(
        refused.contains("neither a file nor a directory"),
        "{refused}"
    );
}

#[test]
fn a_missing_checkpoint_is_refused_and_leaves_no_partial_copy() {
    let (_root, job, recorded) = directories();
    let refused = record_reported_checkpoint(
        &job,
        &recorded,
        1,
        &line("CARVE_CHECKPOINT step=1 path=nothing/here.pt"),
    )
    .unwrap_err();
    assert!(refused.contains("nothing"), "{refused}");
    assert_eq!(std::fs::read_dir(&recorded).unwrap().count(), 0);
}

#[test]
fn a_recorded_copy_supersedes_older_attempts_and_earlier_steps_only() {
    let (_root, _job, recorded) = directories();
    for name in [
        "attempt-1.step-900",
        "attempt-2.step-100",
        "attempt-2.step-200",
        "attempt-2.step-300",
        "attempt-1.step-950.partial",
        "attempt-2.step-400.partial",
        "unrelated",
    ] {
        std::fs::create_dir_all(recorded.join(name)).unwrap();
        std::fs::write(recorded.join(name).join("model.pt"), name).unwrap();
    }
    let mut deleted =
        delete_superseded_copies(&recorded, &recorded.join("attempt-2.step-200/model.pt"));
    deleted.sort();
    assert_eq!(
        deleted,
        [
            recorded.join("attempt-1.step-900"),
            recorded.join("attempt-1.step-950.partial"),
            recorded.join("attempt-2.step-100"),
        ]
    );
    // A location elsewhere deletes nothing.
    assert!(
        delete_superseded_copies(&recorded, Path::new("/elsewhere/attempt-9.step-1")).is_empty()
    );
}

#[test]
fn only_a_recorded_copy_on_this_node_is_resumed_from() {
    let (_root, _job, recorded) = directories();
    std::fs::create_dir_all(recorded.join("attempt-1.step-5")).unwrap();
    std::fs::write(recorded.join("attempt-1.step-5/model.pt"), "5").unwrap();
    let inside = recorded.join("attempt-1.step-5/model.pt");
    assert_eq!(
        resume_checkpoint(&recorded, &inside.to_string_lossy()),
        Some(inside)
    );
    for location in [
        recorded.join("attempt-1.step-6/model.pt"),
        recorded.join("attempt-1.step-5/../../job-1/model.pt"),
        recorded.join("other/model.pt"),
        PathBuf::from("/etc/passwd"),
    ] {
        assert_eq!(
            resume_checkpoint(&recorded, &location.to_string_lossy()),
            None,
            "{}",
            location.display()
        );
    }
}
