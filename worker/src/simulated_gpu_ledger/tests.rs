use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use super::*;

/// One request and its answer line.
fn ask(connection: &mut BufReader<UnixStream>, request: &str) -> String {
    connection
        .get_mut()
        .write_all(format!("{request}\n").as_bytes())
        .unwrap();
    let mut answer = String::new();
    connection.read_line(&mut answer).unwrap();
    answer.trim_end().to_string()
}

fn connect(ledger: &SimulatedGpuLedger) -> BufReader<UnixStream> {
    BufReader::new(UnixStream::connect(ledger.socket()).unwrap())
}

/// Polls `condition` (the ledger's task runs on its own) for at most 10 s.
async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

#[test]
fn the_constants_are_the_fake_drivers() {
    assert_eq!(
        SIMULATED_GPU_DEVICE_PATH,
        carve_fake_driver::CONTAINER_DEVICE_PATH
    );
    assert_eq!(
        ENV_SIMULATED_GPU_SOCKET,
        carve_fake_driver::ENV_DEVICE_SOCKET
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_is_charged_as_the_kernel_names_it_within_the_devices_capacity() {
    let directory = tempfile::tempdir().unwrap();
    let ledger = SimulatedGpuLedger::bind(&directory.path().join("gpu.sock"), 150).unwrap();
    let (mut first, mut second) = tokio::task::spawn_blocking({
        let socket = ledger.socket().to_path_buf();
        move || {
            let mut first = BufReader::new(UnixStream::connect(&socket).unwrap());
            let mut second = BufReader::new(UnixStream::connect(&socket).unwrap());
            assert_eq!(ask(&mut first, "info"), "150 0");
            assert_eq!(ask(&mut first, "hold 100"), "ok");
            // The device holds 150 across its processes: 100 + 100 does not fit.
            assert_eq!(ask(&mut second, "hold 100"), "out-of-memory");
            assert_eq!(ask(&mut second, "hold 50"), "ok");
            assert_eq!(ask(&mut first, "info"), "150 150");
            // Giving back is always granted.
            assert_eq!(ask(&mut first, "hold 60"), "ok");
            (first, second)
        }
    })
    .await
    .unwrap();
    // Both connections are this process, by the pid the kernel gave, not one it sent.
    assert_eq!(
        ledger.usage(),
        vec![ProcessUsage {
            process_id: std::process::id(),
            used_bytes: 110,
        }]
    );
    let _ = ask(&mut second, "hold 0");
    drop(second);
    // A connection's holding ends with it, as a process's memory ends with it.
    let _ = ask(&mut first, "hold 40");
    drop(first);
    eventually("both connections' holdings end", || {
        ledger.usage().is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_it_does_not_know_or_too_long_ends_the_connection() {
    let directory = tempfile::tempdir().unwrap();
    let ledger = SimulatedGpuLedger::bind(&directory.path().join("gpu.sock"), 1 << 30).unwrap();
    let closed = tokio::task::spawn_blocking({
        let mut unknown = connect(&ledger);
        let mut endless = connect(&ledger);
        move || {
            unknown.get_mut().write_all(b"hold -5\n").unwrap();
            let mut answer = String::new();
            let unknown_closed = unknown.read_line(&mut answer).unwrap() == 0;
            // A line without its end, past the longest request: never buffered whole.
            let _ = endless.get_mut().write_all(&[b'7'; 4096]);
            let endless_closed = endless.read_line(&mut answer).unwrap_or(0) == 0;
            (unknown_closed, endless_closed)
        }
    })
    .await
    .unwrap();
    assert_eq!(closed, (true, true));
    assert!(ledger.usage().is_empty());
}

/// A process that hands its connection to a child and exits leaves nothing held, and its
/// child cannot hold anything through it: the device's memory ends with the process
/// that holds it, as the driver frees a process's memory when it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holding_ends_with_its_process_even_while_its_connection_lives_on() {
    let has_python = std::process::Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|output| output.status.success());
    if !has_python {
        eprintln!("skipped: needs python3 (CI has it)");
        assert!(std::env::var_os("CI").is_none(), "CI runs this test");
        return;
    }
    let directory = tempfile::tempdir().unwrap();
    let ledger = SimulatedGpuLedger::bind(&directory.path().join("gpu.sock"), 1 << 30).unwrap();
    // The parent holds 100 bytes, forks a child that keeps the connection, and exits;
    // the child then asks for more through the inherited connection.
    let program = r#"
import os, socket, sys, time
connection = socket.socket(socket.AF_UNIX)
connection.connect(sys.argv[1])
connection.sendall(b"hold 100\n")
assert connection.recv(64) == b"ok\n"
read_end, write_end = os.pipe()
if os.fork() == 0:
    os.close(write_end)
    os.read(read_end, 1)  # until the parent has exited
    time.sleep(0.5)
    connection.sendall(b"hold 200\n")
    print("child:", connection.recv(64), flush=True)
    os._exit(0)
sys.stdin.readline()  # until the test has seen what the parent holds
os._exit(0)
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", program])
        .arg(ledger.socket())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let parent_id = child.id();
    eventually("the parent holds its 100 bytes", || {
        ledger.usage()
            == vec![ProcessUsage {
                process_id: parent_id,
                used_bytes: 100,
            }]
    })
    .await;
    let output = tokio::task::spawn_blocking(move || {
        drop(child.stdin.take());
        child.wait().unwrap();
        child.stdout.take().unwrap()
    })
    .await
    .unwrap();
    // The parent has exited (and is reaped): its holding is gone, though its
    // connection is still open in the child.
    assert!(ledger.usage().is_empty(), "{:?}", ledger.usage());
    let lines: Vec<String> = tokio::task::spawn_blocking(move || {
        BufReader::new(output)
            .lines()
            .map_while(Result::ok)
            .collect()
    })
    .await
    .unwrap();
    // The child learns nothing was granted: the connection ends without an answer.
    assert!(lines.iter().any(|line| line == "child: b''"), "{lines:?}");
    assert!(ledger.usage().is_empty(), "{:?}", ledger.usage());
}
