//! The watchdog over attempts in containers: an attempt's processes are its cgroup's
//! members (a process that left its tree is still counted), a guard slot is matched by
//! the pid the process has in its container, and the readers of both on a node.

use super::*;

const CGROUP_PROCS: &str = "/sys/fs/cgroup/carve/job-a-2/cgroup.procs";

fn in_container(watched: WatchedAttempt) -> WatchedAttempt {
    WatchedAttempt {
        container_processes: Some(PathBuf::from(CGROUP_PROCS)),
        ..watched
    }
}

fn with_members(mut reading: WatchReading, members: &[u32]) -> WatchReading {
    reading.container_members.insert(
        PathBuf::from(CGROUP_PROCS),
        members.iter().copied().collect(),
    );
    reading
}

#[test]
fn a_process_that_left_the_tree_is_counted_through_its_container_and_stopped() {
    // 150 double-forked to init: it is no longer in the tree of 100, but it is still
    // in the container's cgroup. 200 is a neighbour outside the container.
    let parents = [(100, 1), (101, 100), (150, 1), (200, 1)];
    let on_gpu = vec![
        usage(101, 500 * MIB),
        usage(150, 1500 * MIB),
        usage(200, 10_000 * MIB),
    ];
    let without_container = [watched("job-a", "GPU-0", 100, 1024 * MIB)];
    let tree_only = first_round(&without_container, &reading(on_gpu.clone(), &parents));
    assert!(tree_only.is_empty(), "the tree misses 150: {tree_only:?}");

    let attempts = [in_container(watched("job-a", "GPU-0", 100, 1024 * MIB))];
    let listed = with_members(reading(on_gpu.clone(), &parents), &[100, 101, 150]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    let first = judge_round(&attempts, &listed, &mut memory, start);
    assert_eq!(overruns(&first)[0].used_bytes, 2000 * MIB);
    judge_round(&attempts, &listed, &mut memory, seconds(start, 1.0));
    let third = judge_round(&attempts, &listed, &mut memory, seconds(start, 2.0));
    assert_eq!(stops(&third).len(), 1, "{third:?}");
    assert!(stops(&third)[0].contains("held 1.95 GiB"), "{third:?}");

    // The cgroup's members are exactly the attempt's processes: 101 is in the tree of
    // 100 but, not listed, is not counted.
    let listed_without_101 = with_members(reading(on_gpu.clone(), &parents), &[100, 150]);
    assert_eq!(
        overruns(&first_round(&attempts, &listed_without_101))[0].used_bytes,
        1500 * MIB
    );
    // The container's list not read (starting, ending): its process tree again.
    let unlisted = first_round(&attempts, &reading(on_gpu, &parents));
    assert!(unlisted.is_empty(), "{unlisted:?}");
}

#[test]
fn a_container_process_is_matched_to_its_slot_by_its_pid_in_the_container() {
    // 4711 is pid 1 in its container, 4712 is pid 7. The account holds 1 (4711's) and
    // 4712, which inside the container is some other process's pid, not 4712's.
    let attempts = [in_container(guarded("job-a", 4700, 4096 * MIB))];
    let mut seen = with_slots(
        with_members(
            reading(vec![usage(4711, 500 * MIB), usage(4712, 400 * MIB)], &[]),
            &[4700, 4711, 4712],
        ),
        "job-a",
        &[1, 4712],
    );
    seen.innermost_pids = HashMap::from([(4711, 1), (4712, 7)]);
    let mut memory = WatchMemory::default();
    let start = Instant::now();
    assert!(judge_round(&attempts, &seen, &mut memory, start).is_empty());
    assert!(judge_round(&attempts, &seen, &mut memory, seconds(start, 1.0)).is_empty());
    let findings = judge_round(&attempts, &seen, &mut memory, seconds(start, 2.0));
    assert_eq!(
        stops(&findings),
        [
            "stopped by the worker: process 4712 (pid 7 in its container) of attempt job-a/2 \
          used the gpu without the guard (was LD_PRELOAD removed?): it held 400 MiB of device \
          memory with no slot in the attempt's guard account; the attempt had such a process \
          in 3 of its last 10 s of readings"
        ]
    );

    // Once 7 has its slot, neither is unguarded, reading after reading.
    let registered = with_slots(seen, "job-a", &[1, 7]);
    let mut memory = WatchMemory::default();
    for second in 0..12 {
        let findings = judge_round(
            &attempts,
            &registered,
            &mut memory,
            seconds(start, second as f64),
        );
        assert!(findings.is_empty(), "{findings:?}");
    }
}

#[test]
fn the_innermost_pid_is_the_last_field_of_nspid() {
    let status = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4711\nNgid:\t0\n\
                  Pid:\t4711\nPPid:\t4700\nTracerPid:\t0\nUid:\t1000\t1000\t1000\t1000\n\
                  NStgid:\t4711\t12\t1\nNSpid:\t4711\t12\t1\nNSpgid:\t4700\t1\t1\n\
                  NSsid:\t4700\t1\t1\nVmPeak:\t  123456 kB\n";
    assert_eq!(innermost_pid_from_status(status), Some(1));
    // Not in a container: the one field is the host pid.
    assert_eq!(
        innermost_pid_from_status("Pid:\t4711\nNSpid:\t4711\n"),
        Some(4711)
    );
    // A kernel before 4.1 has no such line; a torn one is no answer either.
    assert_eq!(innermost_pid_from_status("Pid:\t4711\nPPid:\t1\n"), None);
    assert_eq!(innermost_pid_from_status("NSpid:\t4711\t1"), Some(1));
    assert_eq!(innermost_pid_from_status("NSpid:\t4711\t"), Some(4711));
    assert_eq!(innermost_pid_from_status("NSpid:\n"), None);
}

#[test]
fn innermost_pids_are_read_from_a_proc_directory() {
    let proc_root = tempfile::tempdir().unwrap();
    for (process_id, status) in [
        (10, "Pid:\t10\nNSpid:\t10\t1\n"),
        // No NSpid line: its host pid.
        (11, "Pid:\t11\n"),
    ] {
        let directory = proc_root.path().join(process_id.to_string());
        std::fs::create_dir(&directory).unwrap();
        std::fs::write(directory.join("status"), status).unwrap();
    }
    // 12 ended before it was read: left out.
    assert_eq!(
        read_innermost_pids(proc_root.path(), [10, 11, 12]),
        HashMap::from([(10, 1), (11, 11)])
    );
    // This test runs in the pid namespace of the /proc it reads.
    let own = std::process::id();
    assert_eq!(
        read_innermost_pids(Path::new("/proc"), [own]),
        HashMap::from([(own, own)])
    );
}

#[test]
fn a_container_s_members_are_read_from_its_cgroup_and_the_cgroups_below_it() {
    assert_eq!(
        process_ids_from_cgroup_procs("4711\n4712\n\n"),
        HashSet::from([4711, 4712])
    );
    let cgroup = tempfile::tempdir().unwrap();
    std::fs::write(cgroup.path().join("cgroup.procs"), "10\n11\n").unwrap();
    std::fs::write(cgroup.path().join("memory.max"), "max\n").unwrap();
    // A child cgroup the container made, and one below that.
    let inner = cgroup.path().join("inner");
    std::fs::create_dir_all(inner.join("deeper")).unwrap();
    std::fs::write(inner.join("cgroup.procs"), "12\n").unwrap();
    std::fs::write(inner.join("deeper").join("cgroup.procs"), "13\n").unwrap();
    assert_eq!(
        read_cgroup_members(&cgroup.path().join("cgroup.procs")).unwrap(),
        HashSet::from([10, 11, 12, 13])
    );
    // The container's cgroup gone (or not made yet): an error, and the watchdog falls
    // back to the process tree.
    assert!(read_cgroup_members(&cgroup.path().join("gone").join("cgroup.procs")).is_err());
}

#[test]
fn a_round_reads_each_gpu_account_and_container_once() {
    let first = in_container(guarded("job-a", 100, 1024 * MIB));
    let second = WatchedAttempt {
        attempt: attempt("job-b"),
        ..first.clone()
    };
    let engine = watched("job-c", "GPU-1", 300, 1024 * MIB);
    assert_eq!(
        WatchTargets::of(&[first, second, engine]),
        WatchTargets {
            gpu_uuids: vec!["GPU-0".into(), "GPU-1".into()],
            guard_accounts: vec![PathBuf::from("/attempts/job-a/gpu-memory.account")],
            container_process_files: vec![PathBuf::from(CGROUP_PROCS)],
        }
    );
}
