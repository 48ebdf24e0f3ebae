//! The cases: each builds a `World`, runs probes under the guard and checks what they
//! printed, the account and the OOM record.

use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::command_programs::{
    command_example_programs_compile, standin_other_endings_for_the_classifier,
    standin_out_of_memory_then_resumed_with_accumulation,
    standin_simulated_memory_runs_out_against_the_slice,
    standin_under_the_limit_trains_every_step_at_the_global_batch,
};
use crate::harness::{MIB, World, exported_symbols, finish, guard_library, run, start};

type Case = fn();

/// Each case by its function's name.
macro_rules! cases {
    ($($case:ident),* $(,)?) => {
        &[$((stringify!($case), $case as Case)),*]
    };
}

const CASES: &[(&str, Case)] = cases![
    refused_past_the_limit_through_every_lookup_path,
    memory_info_and_nvml_report_the_slice,
    two_processes_share_one_account,
    an_exiting_process_gives_its_share_back,
    a_forked_child_registers_its_own_slot,
    virtual_memory_is_counted,
    pitched_and_managed_memory_are_counted,
    async_pools_are_counted_by_reserved_bytes,
    a_destroyed_pool_is_credited_as_its_allocations_are_freed,
    arrays_are_counted,
    unknown_frees_get_the_drivers_own_answer,
    legacy_entry_points_are_refused,
    fails_closed_without_a_usable_configuration,
    many_threads_never_exceed_the_limit_together,
    hook_table_agrees_with_the_exports,
    dlsym_passes_everything_else_through,
    a_program_without_cuda_never_loads_the_driver,
    standin_under_the_limit_trains_every_step_at_the_global_batch,
    standin_out_of_memory_then_resumed_with_accumulation,
    standin_simulated_memory_runs_out_against_the_slice,
    standin_other_endings_for_the_classifier,
    command_example_programs_compile,
];

/// Runs the cases whose name contains `filter`; the exit code.
pub fn run_all(filter: Option<&str>) -> i32 {
    let mut failed = Vec::new();
    for (name, case) in CASES
        .iter()
        .filter(|(name, _)| filter.is_none_or(|filter| name.contains(filter)))
    {
        let outcome = catch_unwind(AssertUnwindSafe(case));
        println!(
            "case {name} ... {}",
            if outcome.is_ok() { "ok" } else { "FAILED" }
        );
        if outcome.is_err() {
            failed.push(*name);
        }
    }
    if failed.is_empty() {
        0
    } else {
        println!("failed: {failed:?}");
        1
    }
}

const LOOKUPS: &[&str] = &[
    "dlsym",
    "default",
    "proc:11080",
    "proc:12000",
    "proc2:12000",
    "proc2:13000",
    "dlsym_ptsz",
    "proc:11080:ptsz",
    "proc2:12000:ptsz",
    "proc2:13000:ptsz",
];

fn refused_past_the_limit_through_every_lookup_path() {
    for lookup in LOOKUPS {
        let world = World::new(64 * MIB);
        let output = run(world.probe(&[
            lookup,
            "init",
            "ctx",
            "alloc:50331648",
            "alloc:33554432",
            "async:33554432",
            "info",
            "stats",
            "account",
        ]));
        assert!(output.success, "{lookup}: {output:#?}");
        assert_eq!(output.results("alloc"), [0, 2], "{lookup}: {output:#?}");
        assert_eq!(output.results("async"), [2], "{lookup}: {output:#?}");
        assert_eq!(output.number("info", 0, "total"), 64 * MIB, "{lookup}");
        assert_eq!(output.number("info", 0, "free"), 16 * MIB, "{lookup}");
        assert_eq!(output.number("account", 0, "in_use"), 48 * MIB, "{lookup}");
        assert_eq!(
            output.number("stats", 0, "bytes_in_use"),
            48 * MIB,
            "{lookup}"
        );
        let record = world.oom_record();
        let pid = output.number("start", 0, "pid") as u32;
        let async_name = if lookup.contains("ptsz") {
            "cuMemAllocAsync_ptsz"
        } else {
            "cuMemAllocAsync"
        };
        let entries: Vec<&str> = record
            .iter()
            .map(|line| line.entry_point.as_str())
            .collect();
        assert_eq!(
            entries,
            ["cuMemAlloc_v2", async_name],
            "{lookup}: {record:?}"
        );
        for line in &record {
            assert_eq!(
                (
                    line.requested_bytes,
                    line.in_use_bytes,
                    line.limit_bytes,
                    line.peak_bytes,
                    line.process_id
                ),
                (32 * MIB, 48 * MIB, 64 * MIB, 48 * MIB, pid),
                "{lookup}: {line:?}"
            );
            assert!(line.time_unix_ms > 1_600_000_000_000, "{line:?}");
        }
    }
}

fn memory_info_and_nvml_report_the_slice() {
    let world = World::new(100 * MIB);
    let output = run(world.probe(&[
        "proc2:12000",
        "init",
        "ctx",
        "alloc:31457280",
        "info",
        "total",
        "nvml",
    ]));
    assert!(output.success, "{output:#?}");
    assert_eq!(
        (
            output.number("info", 0, "total"),
            output.number("info", 0, "free")
        ),
        (100 * MIB, 70 * MIB)
    );
    assert_eq!(output.number("total", 0, "total"), 100 * MIB);
    assert_eq!(output.results("nvml"), [0]);
    for suffix in ["", "_v2"] {
        let field = |name: &str| output.number("nvml", 0, &format!("{name}{suffix}"));
        assert_eq!(
            (field("total"), field("used"), field("free")),
            (100 * MIB, 30 * MIB, 70 * MIB),
            "nvml{suffix}"
        );
    }
    // A slice larger than the device: the device's numbers stand.
    let mut world = World::new(4 << 30);
    world.fake_total_bytes = 1 << 30;
    let output = run(world.probe(&["dlsym", "init", "ctx", "info", "total"]));
    assert_eq!(
        (
            output.number("info", 0, "total"),
            output.number("total", 0, "total")
        ),
        (1 << 30, 1 << 30)
    );
}

fn two_processes_share_one_account() {
    let world = World::new(64 * MIB);
    let release = world.dir.path().join("release");
    let hold = format!("hold:{}", release.display());
    let first = start(world.probe(&[
        "proc2:12000",
        "init",
        "ctx",
        "alloc:41943040",
        &hold,
        "account",
    ]));
    first.wait_for("\"op\":\"alloc\"");
    let second = run(world.probe(&[
        "proc2:13000",
        "init",
        "ctx",
        "alloc:33554432",
        "alloc:16777216",
        "account",
    ]));
    assert_eq!(second.results("alloc"), [2, 0], "{second:#?}");
    assert_eq!(second.number("account", 0, "in_use"), 56 * MIB);
    assert_eq!(second.number("account", 0, "processes"), 2);
    assert_eq!(second.number("account", 0, "mine"), 16 * MIB);
    std::fs::write(&release, b"").expect("release the first probe");
    let first = finish(first.child);
    assert!(first.success, "{first:#?}");
}

fn a_forked_child_registers_its_own_slot() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&[
        "dlsym",
        "init",
        "ctx",
        "alloc:16777216",
        "fork:alloc:20971520+free:0+account",
        "account",
    ]));
    assert!(output.success, "{output:#?}");
    let child = output.number("child", 0, "pid");
    assert_ne!(child, output.number("start", 0, "pid"));
    // In the child: its own 20 MiB charged to its own slot; the parent's pointer (freed
    // by the child, unknown to it) went to the driver and credited nothing.
    assert_eq!(output.results("alloc"), [0, 0]);
    assert_eq!(output.results("free"), [0]);
    assert_eq!(output.number("account", 0, "mine"), 20 * MIB);
    assert_eq!(output.number("account", 0, "in_use"), 36 * MIB);
    assert_eq!(output.number("account", 0, "processes"), 2);
    // In the parent, afterwards: its own 16 MiB still its own.
    assert_eq!(output.number("account", 1, "mine"), 16 * MIB);
}

fn virtual_memory_is_counted() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&[
        "proc2:12000",
        "init",
        "ctx",
        "vmm:33554432",
        "vmm:41943040",
        "account",
        "release:0",
        "vmm:41943040",
        "account",
        "stats",
    ]));
    assert_eq!(output.results("vmm"), [0, 2, 0], "{output:#?}");
    assert_eq!(output.results("release"), [0]);
    assert_eq!(output.number("account", 0, "in_use"), 32 * MIB);
    assert_eq!(output.number("account", 1, "in_use"), 40 * MIB);
    assert_eq!(output.number("stats", 0, "bytes_in_use"), 40 * MIB);
    assert_eq!(world.oom_record()[0].entry_point, "cuMemCreate");
}

fn pitched_and_managed_memory_are_counted() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&[
        "proc:11080",
        "init",
        "ctx",
        "pitch:1000:1000",
        "managed:16777216",
        "stats",
        "account",
        "free:0",
        "free:1",
        "account",
    ]));
    assert_eq!(output.results("pitch"), [0], "{output:#?}");
    assert_eq!(output.results("managed"), [0]);
    let driver_holds = output.number("stats", 0, "bytes_in_use");
    assert!(driver_holds >= 16 * MIB + 1_000_000, "{driver_holds}");
    assert_eq!(
        output.number("account", 0, "in_use"),
        driver_holds,
        "pitch padding charged"
    );
    assert_eq!(output.number("account", 1, "in_use"), 0);
}

fn async_pools_are_counted_by_reserved_bytes() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&[
        "proc2:12000:ptsz",
        "init",
        "ctx",
        "async:33554432",
        "freeasync:0",
        "account", // freed but still reserved by the pool
        "async:33554432",
        "account", // served from the free reserve: no new charge
        "freeasync:1",
        "alloc:41943040", // reserved until sync: refused
        "sync",
        "account",
        "stats",
        "alloc:41943040", // credited after sync
        "frompool:16777216",
        "freeasync:3",
        "account",
        "trim:0",
        "account",
        "stats",
        "async:8388608",
        "free:4",
        "account", // a pool pointer freed the synchronous way: credited at once
    ]));
    assert!(output.success, "{output:#?}");
    assert_eq!(output.results("async"), [0, 0, 0], "{output:#?}");
    assert_eq!(output.results("alloc"), [2, 0], "{output:#?}");
    assert_eq!(output.results("frompool"), [0]);
    let in_use = |index| output.number("account", index, "in_use");
    assert_eq!(
        [in_use(0), in_use(1), in_use(2), in_use(3), in_use(4)],
        [32 * MIB, 32 * MIB, 0, 56 * MIB, 40 * MIB]
    );
    assert_eq!(output.number("stats", 0, "bytes_in_use"), 0);
    assert_eq!(output.number("stats", 1, "bytes_in_use"), 40 * MIB);
    assert_eq!(output.number("stats", 1, "pool_reserved"), 0);
    assert_eq!(in_use(5), 40 * MIB);
}

fn arrays_are_counted() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&[
        "proc2:13000",
        "init",
        "ctx",
        "array:1024:1024",
        "account", // 4 MiB of floats
        "array3d:256:256:64",
        "account", // 16 MiB
        "mipmap:1024:1024:11",
        "account",              // 4 MiB and its levels
        "array3d:1024:1024:16", // 64 MiB more: refused
        "array_destroy:0",
        "array_destroy:1",
        "mipmap_destroy:2",
        "account",
        "stats",
    ]));
    assert!(output.success, "{output:#?}");
    assert_eq!(output.results("array"), [0]);
    assert_eq!(output.results("array3d"), [0, 2], "{output:#?}");
    assert_eq!(output.results("mipmap"), [0]);
    assert_eq!(output.number("account", 0, "in_use"), 4 * MIB);
    assert_eq!(output.number("account", 1, "in_use"), 20 * MIB);
    let mip_levels: u64 = (0..11)
        .map(|level| (1024u64 >> level).max(1).pow(2) * 4)
        .sum();
    assert_eq!(output.number("account", 2, "in_use"), 20 * MIB + mip_levels);
    assert_eq!(output.number("account", 3, "in_use"), 0);
    assert_eq!(output.number("stats", 0, "allocations"), 0);
    assert_eq!(world.oom_record()[0].entry_point, "cuArray3DCreate_v2");
}

fn unknown_frees_get_the_drivers_own_answer() {
    let world = World::new(64 * MIB);
    let guarded = run(world.probe(&["dlsym", "init", "ctx", "free_unknown"]));
    let bare = run(world.bare_probe(&["dlsym", "init", "ctx", "free_unknown"]));
    let codes = guarded.results("free_unknown");
    assert_eq!(codes.len(), 5, "{guarded:#?}");
    assert!(codes.iter().all(|code| *code != 0), "{codes:?}");
    assert_eq!(codes, bare.results("free_unknown"));
}

fn legacy_entry_points_are_refused() {
    let world = World::new(64 * MIB);
    // CUDA 3.0 had no primary contexts; the fake allocates without a context.
    for lookup in ["dlsym", "proc:3000"] {
        let output = run(world.probe(&[lookup, "init", "legacy_alloc:1048576", "stats"]));
        assert_eq!(
            output.results("legacy_alloc"),
            [801],
            "{lookup}: {output:#?}"
        );
        assert_eq!(output.number("stats", 0, "allocations"), 0);
        assert!(
            output.stderr.contains("carve-guard: cuMemAlloc"),
            "{}",
            output.stderr
        );
    }
}

fn fails_closed_without_a_usable_configuration() {
    let world = World::new(64 * MIB);
    let no_directory = world.dir.path().join("missing/account");
    let settings: [(&str, Option<String>, Option<String>); 4] = [
        ("not set", None, None),
        ("not a positive number", Some("lots".into()), None),
        (
            "cannot open the account",
            Some((64 * MIB).to_string()),
            Some(no_directory.display().to_string()),
        ),
        (
            "cannot open the account",
            Some((32 * MIB).to_string()),
            None,
        ), // the account says 64 MiB
    ];
    run(world.probe(&["dlsym", "init"])); // creates the 64 MiB account
    for (message, limit, account) in settings {
        let mut command = world.probe(&["dlsym", "init", "alloc:1048576", "stats"]);
        match limit {
            Some(limit) => command.env(carve_guard_account::ENV_LIMIT_BYTES, limit),
            None => command.env_remove(carve_guard_account::ENV_LIMIT_BYTES),
        };
        if let Some(account) = account {
            command.env(carve_guard_account::ENV_ACCOUNT, account);
        }
        let output = run(command);
        assert_eq!(output.results("init"), [800], "{message}: {output:#?}");
        assert_eq!(output.results("alloc"), [800], "{message}");
        assert_eq!(
            output.stderr.matches("carve-guard: ").count(),
            1,
            "{message}: {}",
            output.stderr
        );
        assert!(
            output.stderr.contains(message),
            "{message}: {}",
            output.stderr
        );
    }
}

fn many_threads_never_exceed_the_limit_together() {
    let world = World::new(100 * MIB);
    let output = run(world.probe(&["proc2:12000", "init", "ctx", "threads:16:3145728"]));
    assert!(output.success, "{output:#?}");
    let granted = output.number("threads", 0, "granted");
    assert_eq!(granted, 99 * MIB, "33 blocks of 3 MiB fit in 100 MiB");
    assert_eq!(output.number("threads", 0, "refusals"), 16);
    assert_eq!(output.number("account", 0, "in_use"), granted);
    assert_eq!(output.number("stats", 0, "bytes_in_use"), granted);
    assert_eq!(output.number("account", 1, "in_use"), 0);
    assert_eq!(output.number("stats", 1, "bytes_in_use"), 0);
    assert_eq!(world.oom_record().len(), 16);
}

fn hook_table_agrees_with_the_exports() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&["dlsym", "hooks"]));
    assert!(output.success, "{output:#?}");
    let disagreeing: Vec<&str> = output
        .op("hook")
        .into_iter()
        .filter(|line| line.contains("\"agrees\":false"))
        .collect();
    assert!(disagreeing.is_empty(), "{disagreeing:#?}");
    assert_eq!(output.number("hooks", 0, "mismatches"), 0);
    let rows = output.number("hooks", 0, "rows") as usize;
    let table: Vec<String> = output
        .op("hook")
        .iter()
        .filter_map(|line| {
            line.split("\"export\":\"")
                .nth(1)?
                .split('"')
                .next()
                .map(str::to_owned)
        })
        .collect();
    for symbol in exported_symbols(&guard_library()) {
        if symbol.starts_with("cu") || symbol.starts_with("nvml") {
            assert!(
                table.contains(&symbol),
                "{symbol} is exported but not in the hook table"
            );
        }
    }
    assert!(
        rows >= table
            .iter()
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    );
}

fn dlsym_passes_everything_else_through() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&["dlsym", "init", "dlsym_edges"]));
    assert!(output.success, "{output:#?}");
    for field in [
        "missing_is_null",
        "missing_sets_error",
        "unhooked_is_the_drivers",
        "next_getpid_is_libc",
        "next_hooked_is_the_guards",
        "hooked_agree",
    ] {
        assert_eq!(
            output.number("dlsym_edges", 0, field),
            1,
            "{field}: {output:#?}"
        );
    }
}

fn a_destroyed_pool_is_credited_as_its_allocations_are_freed() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&[
        "proc2:12000",
        "init",
        "ctx",
        "pool_create",
        "custom:16777216",
        "custom:8388608",
        "freeasync:1",
        "account", // 16 MiB used and 8 MiB free in the pool's reserve
        "pool_destroy",
        "account", // the free reserve given back; the outstanding 16 MiB still held
        "freeasync:0",
        "sync",
        "account",
        "stats",
    ]));
    assert!(output.success, "{output:#?}");
    assert_eq!(output.results("custom"), [0, 0], "{output:#?}");
    assert_eq!(output.results("pool_destroy"), [0]);
    let in_use = |index| output.number("account", index, "in_use");
    assert_eq!([in_use(0), in_use(1), in_use(2)], [24 * MIB, 16 * MIB, 0]);
    assert_eq!(output.number("stats", 0, "bytes_in_use"), 0);
}

fn an_exiting_process_gives_its_share_back() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&["dlsym", "init", "ctx", "alloc:33554432", "account"]));
    assert_eq!(
        output.number("account", 0, "in_use"),
        32 * MIB,
        "{output:#?}"
    );
    let usage = carve_guard_account::Account::open(&world.account_path())
        .expect("account")
        .usage();
    assert_eq!((usage.in_use_bytes, usage.peak_bytes), (0, 32 * MIB));
}

fn a_program_without_cuda_never_loads_the_driver() {
    let world = World::new(64 * MIB);
    let output = run(world.probe(&["no_cuda"]));
    assert!(output.success, "{output:#?}");
    let field = |name: &str| output.number("no_cuda", 0, name);
    assert_eq!(
        [
            field("found_getpid"),
            field("found_hook"),
            field("libcuda_loaded"),
            field("nvml_loaded")
        ],
        [1, 1, 0, 0]
    );
    assert!(output.stderr.is_empty(), "{}", output.stderr);
}
