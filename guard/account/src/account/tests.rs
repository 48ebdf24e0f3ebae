//! The account by example: limits, shares, dead processes, concurrent reservations and
//! files that are not accounts.

use super::*;

const MIB: u64 = 1 << 20;

fn new_account(limit_bytes: u64) -> (tempfile::TempDir, Account) {
    let directory = tempfile::tempdir().unwrap();
    let account =
        Account::create(&directory.path().join("gpu-memory.account"), limit_bytes).unwrap();
    (directory, account)
}

/// The id of a process that has exited and been reaped.
fn dead_process_id() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let process_id = child.id();
    child.wait().unwrap();
    process_id
}

#[test]
fn reservations_stop_at_the_limit_and_say_why() {
    let (_directory, account) = new_account(100 * MIB);
    let slot = account.register(std::process::id()).unwrap();
    let reserved = account.try_reserve(slot, 60 * MIB).unwrap();
    assert_eq!(reserved.in_use_bytes, 60 * MIB);
    assert_eq!(
        account.try_reserve(slot, 40 * MIB).unwrap().in_use_bytes,
        100 * MIB
    );
    let refused = account.try_reserve(slot, 1).unwrap_err();
    assert_eq!(
        refused,
        OverLimit {
            requested_bytes: 1,
            in_use_bytes: 100 * MIB,
            limit_bytes: 100 * MIB,
            peak_bytes: 100 * MIB,
        }
    );
    account.release(slot, 70 * MIB);
    let usage = account.usage();
    assert_eq!(
        (usage.in_use_bytes, usage.peak_bytes),
        (30 * MIB, 100 * MIB)
    );
    assert_eq!(
        usage.processes,
        vec![ProcessUsage {
            process_id: std::process::id(),
            in_use_bytes: 30 * MIB,
            peak_bytes: 100 * MIB,
        }]
    );
}

#[test]
fn a_request_that_would_overflow_is_refused_not_wrapped() {
    let (_directory, account) = new_account(u64::MAX);
    let slot = account.register(std::process::id()).unwrap();
    account.try_reserve(slot, u64::MAX - 5).unwrap();
    assert!(account.try_reserve(slot, 10).is_err());
}

#[test]
fn releasing_more_than_was_held_never_wraps_below_zero() {
    let (_directory, account) = new_account(100 * MIB);
    let first = account.register(std::process::id()).unwrap();
    let second = account.register(std::process::id() + 1_000_000).unwrap();
    account.try_reserve(first, 10 * MIB).unwrap();
    account.try_reserve(second, 20 * MIB).unwrap();
    account.release(first, 50 * MIB);
    let usage = account.usage();
    assert_eq!(
        usage.in_use_bytes,
        20 * MIB,
        "only the slot's own 10 MiB came back"
    );
    assert_eq!(usage.processes[0].in_use_bytes, 0);
}

#[test]
fn two_mappings_of_one_file_share_the_total() {
    let (directory, account) = new_account(100 * MIB);
    let other =
        Account::open_or_create(&directory.path().join("gpu-memory.account"), 100 * MIB).unwrap();
    let mine = account.register(std::process::id()).unwrap();
    let theirs = other.register(std::process::id() + 1_000_000).unwrap();
    account.try_reserve(mine, 70 * MIB).unwrap();
    assert_eq!(
        other
            .try_reserve(theirs, 40 * MIB)
            .unwrap_err()
            .in_use_bytes,
        70 * MIB
    );
    other.try_reserve(theirs, 30 * MIB).unwrap();
    assert_eq!(account.usage().in_use_bytes, 100 * MIB);
}

#[test]
fn registering_again_after_exec_starts_the_process_from_zero() {
    let (_directory, account) = new_account(100 * MIB);
    let slot = account.register(std::process::id()).unwrap();
    account.try_reserve(slot, 40 * MIB).unwrap();
    assert_eq!(account.register(std::process::id()).unwrap(), slot);
    assert_eq!(account.usage().in_use_bytes, 0);
}

#[test]
fn a_dead_process_share_is_taken_back_when_the_living_need_it() {
    let (_directory, account) = new_account(100 * MIB);
    let dead = account.register(dead_process_id()).unwrap();
    account.try_reserve(dead, 90 * MIB).unwrap();
    let living = account.register(std::process::id()).unwrap();
    let reserved = account.try_reserve(living, 50 * MIB).unwrap();
    assert_eq!(reserved.in_use_bytes, 50 * MIB);
    let usage = account.usage();
    assert_eq!(usage.processes.len(), 1, "the dead slot is free again");
}

#[test]
fn slots_of_dead_processes_are_reused_when_all_are_taken() {
    let (_directory, account) = new_account(100 * MIB);
    let dead = dead_process_id();
    for offset in 0..SLOT_COUNT as u32 {
        // Ids far above pid_max never exist, so every slot is held by a dead process.
        account.register(dead.max(5_000_000) + offset).unwrap();
    }
    assert!(account.register(std::process::id()).is_ok());
}

#[test]
fn threads_reserving_at_once_never_exceed_the_limit_together() {
    let (_directory, account) = new_account(64 * MIB);
    let account = std::sync::Arc::new(account);
    // Live processes to own the slots: a refusal reclaims dead owners' slots.
    let mut owners: Vec<_> = (0..8)
        .map(|_| {
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap()
        })
        .collect();
    let threads: Vec<_> = owners
        .iter()
        .map(|owner| {
            let account = account.clone();
            let owner_id = owner.id();
            std::thread::spawn(move || {
                let slot = account.register(owner_id).unwrap();
                let mut held = 0u64;
                let mut refusals = 0;
                for iteration in 0..10_000 {
                    match account.try_reserve(slot, MIB) {
                        Ok(_) => held += MIB,
                        Err(_) => refusals += 1,
                    }
                    if iteration % 3 == 0 && held > 0 {
                        account.release(slot, MIB);
                        held -= MIB;
                    }
                }
                (held, refusals)
            })
        })
        .collect();
    let results: Vec<(u64, u32)> = threads
        .into_iter()
        .map(|thread| thread.join().unwrap())
        .collect();
    for owner in &mut owners {
        owner.kill().unwrap();
        owner.wait().unwrap();
    }
    let held: u64 = results.iter().map(|(held, _)| held).sum();
    assert!(
        results.iter().any(|(_, refusals)| *refusals > 0),
        "the limit was reached"
    );
    let usage = account.usage();
    assert_eq!(usage.in_use_bytes, held);
    assert_eq!(usage.peak_bytes, 64 * MIB);
    let slots: u64 = usage
        .processes
        .iter()
        .map(|process| process.in_use_bytes)
        .sum();
    assert_eq!(
        slots, usage.in_use_bytes,
        "the total is the sum of the slots"
    );
}

#[test]
fn joining_with_another_limit_is_refused() {
    let (directory, _account) = new_account(100 * MIB);
    let error =
        Account::open_or_create(&directory.path().join("gpu-memory.account"), MIB).unwrap_err();
    assert!(
        matches!(error, AccountError::LimitMismatch { .. }),
        "{error}"
    );
}

#[test]
fn open_or_create_creates_a_missing_account_whole() {
    let directory = tempfile::tempdir().unwrap();
    let path = directory.path().join("gpu-memory.account");
    let account = Account::open_or_create(&path, 5 * MIB).unwrap();
    assert_eq!(account.limit_bytes(), 5 * MIB);
    let names: Vec<_> = std::fs::read_dir(directory.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("gpu-memory.account")]);
}

#[test]
fn files_that_are_not_accounts_are_refused_with_the_reason() {
    let directory = tempfile::tempdir().unwrap();
    let short = directory.path().join("short");
    std::fs::write(&short, b"hello").unwrap();
    let error = Account::open(&short).unwrap_err();
    assert!(
        error.to_string().contains("is not a Carve memory account"),
        "{error}"
    );
    let wrong_magic = directory.path().join("zeroes");
    std::fs::write(&wrong_magic, vec![0u8; FILE_BYTES]).unwrap();
    let error = Account::open(&wrong_magic).unwrap_err();
    assert!(error.to_string().contains("wrong magic"), "{error}");
    assert!(matches!(
        Account::open(&directory.path().join("missing")),
        Err(AccountError::Io { .. })
    ));
}

/// A job may write the directory its account is in; the worker, which opens and creates
/// accounts with more rights than the job, must never be led through a link it planted.
#[test]
fn an_account_is_never_opened_or_staged_through_a_link_the_job_planted() {
    let directory = tempfile::tempdir().unwrap();
    let (_other, other) = new_account(100 * MIB);
    let planted = directory.path().join("gpu-memory.account");
    std::os::unix::fs::symlink(other.path(), &planted).unwrap();
    let error = Account::open(&planted).unwrap_err().to_string();
    assert!(error.contains("gpu-memory.account"), "{error}");

    // The staged file's name is predictable; a link there to a file of the host must
    // not be written through, and the account is made all the same.
    let victim = directory.path().join("host-file");
    std::fs::write(&victim, "precious").unwrap();
    let account_path = directory.path().join("fresh.account");
    let staged = directory
        .path()
        .join(format!(".fresh.account.{}.new", std::process::id()));
    std::os::unix::fs::symlink(&victim, &staged).unwrap();
    let account = Account::create(&account_path, 10 * MIB).unwrap();
    assert_eq!(account.limit_bytes(), 10 * MIB);
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

    // Not a regular file: refused, not mapped.
    let error = Account::open(Path::new("/dev/zero"))
        .unwrap_err()
        .to_string();
    assert!(error.contains("not a regular file"), "{error}");
}
