//! `carve dev --demo`, the real binary: a scheduler and a worker in one process, the
//! demo examples submitted, trained by `carve attempt` processes, watched to the end and
//! summed up; the process must exit 0 with every demo job succeeded, and clean up.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The most the demo may take before the test kills it and fails.
const LIMIT: Duration = Duration::from_secs(240);

/// Runs `carve dev --demo` with `arguments` to its end (or kills it past `LIMIT`).
fn run_demo(data: &std::path::Path, arguments: &[&str]) -> (Option<i32>, String, String) {
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_carve"))
        .args(["dev", "--demo", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .args(arguments)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read both pipes on their own threads so a full pipe never blocks the child.
    let mut stdout_pipe = child.stdout.take().unwrap();
    let mut stderr_pipe = child.stderr.take().unwrap();
    let stdout_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout_pipe.read_to_string(&mut text);
        text
    });
    let stderr_reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr_pipe.read_to_string(&mut text);
        text
    });
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            let stdout = stdout_reader.join().unwrap();
            let stderr = stderr_reader.join().unwrap();
            panic!(
                "carve dev --demo ran past {}s\nstdout:\n{stdout}\nstderr:\n{stderr}",
                LIMIT.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "carve dev --demo {arguments:?} took {:.1}s",
        started.elapsed().as_secs_f64()
    );
    (
        status.code(),
        stdout_reader.join().unwrap(),
        stderr_reader.join().unwrap(),
    )
}

#[test]
fn real_gpus_run_the_demo_on_them_or_are_refused_with_the_reason() {
    let data = tempfile::tempdir().unwrap();
    let (code, stdout, stderr) = run_demo(data.path(), &["--real-gpus"]);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    match carve_worker::nvml::discover_nvml_gpus() {
        Ok(gpus) if !gpus.is_empty() => {
            assert_eq!(code, Some(0), "{context}");
            assert!(stdout.contains("this machine's GPUs"), "{context}");
        }
        // No NVML, or none of its GPUs: refused before anything starts.
        _ => {
            assert_eq!(code, Some(1), "{context}");
            assert!(stderr.contains("--real-gpus: "), "{context}");
            assert!(!stdout.contains("endpoint:"), "{context}");
        }
    }
    // Simulated and real GPUs are one choice or the other.
    let (code, _, stderr) = run_demo(data.path(), &["--real-gpus", "--sim-gpus", "1x8GiB"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}

#[test]
fn the_demo_trains_every_example_to_success_and_prints_a_summary() {
    let data = tempfile::tempdir().unwrap();
    let (code, stdout, stderr) = run_demo(data.path(), &[]);
    let context = format!("stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(code, Some(0), "{context}");

    // It told where the cluster is and gave a token.
    assert!(stdout.contains("endpoint:  http://127.0.0.1:"), "{context}");
    assert!(stdout.contains("token:     carve_"), "{context}");

    // The summary lists each demo job, succeeded.
    let header = stdout
        .lines()
        .position(|line| line.starts_with("JOB ") && line.contains("STATE"))
        .unwrap_or_else(|| panic!("no summary table\n{context}"));
    let rows: Vec<&str> = stdout
        .lines()
        .skip(header + 1)
        .take_while(|line| !line.trim().is_empty())
        .collect();
    for job in ["mnist-cnn", "tf-conv2d-128px-batch32"] {
        let row = rows
            .iter()
            .find(|row| row.split_whitespace().next() == Some(job))
            .unwrap_or_else(|| panic!("{job} is not in the summary\n{context}"));
        assert_eq!(
            row.split_whitespace().nth(1),
            Some("succeeded"),
            "{job}: {row}\n{context}"
        );
    }
    // The job in the demo's own image ran where attempts are contained (CI's machine);
    // elsewhere the demo said why it skipped it.
    match stdout
        .lines()
        .find(|line| line.starts_with("skipping the job in carve.local/dev/standin:1"))
    {
        Some(skipped) => assert!(
            std::env::var_os("CI").is_none(),
            "CI must run the image job: {skipped}\n{context}"
        ),
        None => {
            let row = rows
                .iter()
                .find(|row| row.starts_with("standin-in-an-image "))
                .unwrap_or_else(|| panic!("the image job is not in the summary\n{context}"));
            assert_eq!(row.split_whitespace().nth(1), Some("succeeded"), "{row}");
        }
    }
    // The 128 MiB example was shrunk into its slice, and the table says so.
    let shrunk = rows
        .iter()
        .find(|row| row.starts_with("tf-conv2d-128px-batch32"))
        .unwrap();
    assert!(shrunk.contains("128 MiB"), "{shrunk}");
    assert!(shrunk.contains("shrunk"), "{shrunk}");

    // Both stopped cleanly, and the database is where it was asked to be.
    assert!(stdout.trim_end().ends_with("stopped"), "{context}");
    assert!(data.path().join("carve.db").is_file(), "{context}");
}
