//! The watchdog with real processes: a real attempt process stopped by a round, and a
//! program holding memory on a real GPU where this machine has one.

use super::*;

/// A real attempt process, as the worker starts them: `sh -c script` leading its own
/// process group, watched by [`watch_attempt_process`].
struct LiveAttempt {
    shell: u32,
    watcher: tokio::task::JoinHandle<()>,
    control: mpsc::UnboundedSender<AttemptControl>,
    reports: mpsc::UnboundedSender<Body>,
    sent: mpsc::UnboundedReceiver<Body>,
}

impl LiveAttempt {
    fn start(script: &str, environment: &[(&str, &str)]) -> LiveAttempt {
        let child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .envs(environment.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0)
            .spawn()
            .unwrap();
        let shell = child.id().unwrap();
        let (control, control_receiver) = mpsc::unbounded_channel();
        let (reports, sent) = mpsc::unbounded_channel();
        let watcher = tokio::spawn(watch_attempt_process(
            child,
            None,
            attempt("job-a"),
            reports.clone(),
            control_receiver,
            || {},
        ));
        LiveAttempt {
            shell,
            watcher,
            control,
            reports,
            sent,
        }
    }

    /// Waits for the stopped process to end; its final report.
    async fn finished(mut self) -> v1::worker_message::AttemptFinished {
        tokio::time::timeout(Duration::from_secs(20), self.watcher)
            .await
            .expect("the attempt process was stopped")
            .unwrap();
        std::iter::from_fn(|| self.sent.try_recv().ok())
            .find_map(|body| match body {
                Body::AttemptFinished(finished) => Some(finished),
                _ => None,
            })
            .expect("a final report")
    }
}

#[tokio::test]
async fn a_stopped_attempt_process_is_killed_and_ends_failed_with_the_watchdog_s_reason() {
    // A real process tree in its own group, as the worker starts attempts: a shell
    // whose child holds "device memory" (the scripted reading) over three readings.
    let live = LiveAttempt::start("sleep 60 & wait", &[]);
    let shell = live.shell;
    // The sleeping child is the one on the GPU; find it in /proc as the watchdog does.
    let mut sleeper = None;
    for _ in 0..100 {
        sleeper = read_process_parents(Path::new("/proc"))
            .into_iter()
            .find(|(_, parent)| *parent == shell)
            .map(|(process, _)| process);
        if sleeper.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let sleeper = sleeper.expect("the shell started its child");
    let reading = WatchReading {
        gpu_processes: HashMap::from([("GPU-0".to_string(), vec![usage(sleeper, 2048 * MIB)])]),
        parents: read_process_parents(Path::new("/proc")),
        ..Default::default()
    };
    let mut rounds = Rounds::new(
        FixedSource(reading),
        watched("job-a", "GPU-0", shell, 1024 * MIB),
        live.control.clone(),
        live.reports.clone(),
    );
    for time in [0.0, 1.0, 2.0] {
        rounds.at(time).await;
    }
    let finished = live.finished().await;
    assert_eq!(finished.outcome, v1::AttemptOutcome::Failed as i32);
    assert!(
        finished
            .message
            .starts_with("stopped by the worker: attempt job-a/2 held 2 GiB"),
        "{}",
        finished.message
    );
    // The whole group went: the sleeping child too.
    let sleeper = rustix::process::Pid::from_raw(sleeper as i32).unwrap();
    for _ in 0..100 {
        // Gone, or a zombie its new parent has not reaped yet.
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", sleeper.as_raw_nonzero()));
        let zombie =
            stat.is_ok_and(|stat| stat.rsplit(')').next().unwrap().trim().starts_with('Z'));
        if zombie || rustix::process::test_kill_process(sleeper).is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the attempt's child outlived the stop");
}

/// A program that takes 1 GiB of device memory through the driver alone (no framework
/// needed), says so, and holds it.
const GPU_HOLDER: &str = "import ctypes, time
cuda = ctypes.CDLL('libcuda.so.1')
assert cuda.cuInit(0) == 0
device = ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
context = ctypes.c_void_p()
assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
assert cuda.cuCtxSetCurrent(context) == 0
pointer = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(1 << 30)) == 0
print('ready', flush=True)
time.sleep(120)
";

/// On a machine with an NVIDIA GPU (and python3) this is the real check; elsewhere it
/// asserts what the worker meets there: NVML cannot be opened (no driver), or opens and
/// finds no GPU, so the worker starts no watchdog (see `run_worker`).
#[tokio::test]
async fn on_a_real_gpu_a_child_over_the_slice_is_seen_in_the_tree_and_stopped() {
    let nvml = match NvmlHandle::open() {
        Ok(nvml) => nvml,
        Err(error) => {
            assert!(matches!(error, WorkerError::Nvml(_)), "{error}");
            return;
        }
    };
    let mut gpus = nvml.discover().expect("nvml opened, so discovery works");
    if gpus.is_empty() {
        return;
    }
    let gpu = gpus.remove(0);
    // The holder is the shell's child, as a program's workers are the attempt's.
    let mut live = LiveAttempt::start(
        "python3 -c \"$CARVE_TEST_PROGRAM\"; exit 1",
        &[
            ("CARVE_TEST_PROGRAM", GPU_HOLDER),
            ("CUDA_VISIBLE_DEVICES", &gpu.uuid),
        ],
    );
    let shell = live.shell;
    let ready = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(body) = live.sent.recv().await {
            match body {
                Body::Log(line) if line.message == "ready" => return,
                Body::AttemptFinished(finished) => panic!("ended early: {finished:?}"),
                _ => {}
            }
        }
    });
    ready.await.expect("the holder took its memory");
    let source = SystemWatchSource::new(Some(nvml), Default::default());
    let reading = source.read(&WatchTargets {
        gpu_uuids: vec![gpu.uuid.clone()],
        ..Default::default()
    });
    let tree = process_tree(shell, &reading.parents);
    let on_gpu: Vec<ProcessUsage> = reading.gpu_processes[&gpu.uuid]
        .iter()
        .copied()
        .filter(|process| tree.contains(&process.process_id))
        .collect();
    let used_bytes: u64 = on_gpu.iter().map(|process| process.used_bytes).sum();
    println!(
        "gpu {} ({}): the tree of {shell} is {tree:?}; on the gpu {on_gpu:?}, {} in all \
         (1 GiB allocated: the rest is the context)",
        gpu.uuid,
        gpu.model_name,
        HumanBytes(used_bytes)
    );
    assert!(
        used_bytes >= 1 << 30,
        "NVML did not see the child in the tree"
    );
    assert!(!on_gpu.iter().any(|process| process.process_id == shell));
    // The holder runs in the worker's pid namespace: its innermost pid is its host pid.
    for process in &on_gpu {
        assert_eq!(
            reading.innermost_pids.get(&process.process_id),
            Some(&process.process_id)
        );
    }
    // A 256 MiB slice with a 128 MiB context allowance: over, and stopped at the third
    // reading.
    let watched = WatchedAttempt {
        context_bytes: 128 * MIB,
        ..watched("job-a", &gpu.uuid, shell, 256 * MIB)
    };
    let control = live.control.clone();
    let mut rounds = Rounds::new(source, watched, control, live.reports.clone());
    for time in [0.0, 1.0, 2.0] {
        rounds.at(time).await;
    }
    let finished = live.finished().await;
    println!("final report: {finished:?}");
    assert_eq!(finished.outcome, v1::AttemptOutcome::Failed as i32);
    assert!(
        finished
            .message
            .starts_with("stopped by the worker: attempt job-a/2 held")
    );
}
