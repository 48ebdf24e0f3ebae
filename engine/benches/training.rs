//! `cargo bench -p carve-engine`: training throughput of the example CNNs on the cpu
//! backend and, where CUDA is available, on the cuda backend, as a table to compare
//! across commits on the same machine. `engine/benches/pytorch_reference.py` measures
//! the ResNet-style example with PyTorch (cuDNN benchmark mode) for comparison.
//!
//! Each row trains a few steps of an example (synthetic data, its own batch size unless
//! noted) after one warm-up step and reports samples per second, the slice's peak and
//! whether it equals the estimate. The time runs from the end of the warm-up step to the
//! end of the last step, both ends after the step's loss was read back (which waits for
//! the GPU), so teardown and the warm-up's algorithm search are not in it: the same span
//! the PyTorch script times between two synchronizes.
//! The GPU rows train more steps, and resnet-cifar also at batch 128, the size the
//! PyTorch script compares at. `cargo bench -p carve-engine -- cuda` (or `-- cpu`)
//! runs one backend's rows only; `CARVE_CUDA_TUNING` (see `carve_engine::cuda::CudaTuning`)
//! turns the cuda backend's speed changes off one by one, and a word after the backend
//! (`-- cuda resnet-cifar`) keeps the rows whose example starts with it; a precision's
//! name (`fp32`, `fp16`, `bf16`) keeps that precision's rows and `b128` the batch-128
//! ones (`engine/benches/gpu_check.sh` times its table with them). The last column is the
//! slice each row ran in, which NVML's per-process reading is compared with.

use std::path::Path;
use std::time::Instant;

use carve_core::bytes::HumanBytes;
use carve_core::estimator::estimate_job;
use carve_core::plan::RunConfig;
use carve_core::spec::{DataFormat, Precision};
use carve_core::validate::{parse_job_spec_toml, validate_job_spec};
use carve_engine::cuda::{CudaBackend, train_on_cuda};
use carve_engine::data::open_data_sets;
use carve_engine::trainer::{TrainingOptions, train};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BenchBackend {
    Cpu,
    Cuda,
}

fn main() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let cpu_cases: &[(&str, u64, Precision, u64)] = &[
        ("mnist-cnn.toml", 64, Precision::Fp32, 8),
        ("mnist-cnn.toml", 64, Precision::Bf16, 8),
        ("resnet-cifar.toml", 32, Precision::Fp32, 3),
        ("resnet-cifar.toml", 32, Precision::Fp16, 3),
        ("tf-conv2d-128px-batch32.toml", 32, Precision::Fp32, 3),
    ];
    let cuda_cases: &[(&str, u64, Precision, u64)] = &[
        ("mnist-cnn.toml", 64, Precision::Fp32, 50),
        ("mnist-cnn.toml", 64, Precision::Bf16, 50),
        ("resnet-cifar.toml", 32, Precision::Fp32, 30),
        ("resnet-cifar.toml", 32, Precision::Fp16, 30),
        ("resnet-cifar.toml", 128, Precision::Fp32, 30),
        ("resnet-cifar.toml", 128, Precision::Fp16, 30),
        ("resnet-cifar.toml", 128, Precision::Bf16, 30),
        ("resnet18-cifar.toml", 128, Precision::Fp32, 20),
        ("resnet18-cifar.toml", 128, Precision::Fp16, 20),
        ("resnet18-cifar.toml", 128, Precision::Bf16, 20),
        ("tf-conv2d-128px-batch32.toml", 32, Precision::Fp32, 20),
    ];
    // `cargo bench` passes `--bench`; a plain word picks one backend's rows.
    let chosen: Vec<String> = std::env::args()
        .skip(1)
        .filter(|argument| !argument.starts_with('-'))
        .collect();
    let backends: Vec<&String> = chosen
        .iter()
        .filter(|choice| *choice == "cpu" || *choice == "cuda")
        .collect();
    let is_precision = |word: &str| ["fp32", "fp16", "bf16"].contains(&word);
    let precisions_chosen: Vec<&String> = chosen
        .iter()
        .filter(|choice| is_precision(choice))
        .collect();
    let batch_128_only = chosen.iter().any(|choice| choice == "b128");
    let examples_chosen: Vec<&String> = chosen
        .iter()
        .filter(|choice| {
            *choice != "cpu" && *choice != "cuda" && *choice != "b128" && !is_precision(choice)
        })
        .collect();
    let row_wanted = |batch_size: u64, precision: Precision| {
        (!batch_128_only || batch_size == 128)
            && (precisions_chosen.is_empty()
                || precisions_chosen
                    .iter()
                    .any(|choice| choice.as_str() == precision.name()))
    };
    let wanted = |name: &str| backends.is_empty() || backends.iter().any(|choice| *choice == name);
    let example_wanted = |file: &str| {
        examples_chosen.is_empty()
            || examples_chosen
                .iter()
                .any(|prefix| file.starts_with(prefix.as_str()))
    };
    let cuda = wanted("cuda")
        && match CudaBackend::available() {
            Ok(()) => true,
            Err(reason) => {
                println!("cuda: skipped: CUDA not available: {reason}");
                false
            }
        };
    if cuda {
        println!(
            "cuda tuning: {}={:?}",
            carve_engine::cuda::TUNING_VARIABLE,
            std::env::var(carve_engine::cuda::TUNING_VARIABLE).unwrap_or_default()
        );
    }
    println!(
        "{:<30} {:>7} {:>6} {:>9} {:>7} {:>12} {:>12} {:>16}",
        "example",
        "backend",
        "batch",
        "precision",
        "steps",
        "samples/s",
        "peak",
        "peak == estimate"
    );
    // Each row ends with its final loss and `slice=<bytes>`, without a header.
    if wanted("cpu") {
        for &(file, batch_size, precision, steps) in cpu_cases {
            if !example_wanted(file) || !row_wanted(batch_size, precision) {
                continue;
            }
            bench_case(
                &examples,
                BenchBackend::Cpu,
                file,
                batch_size,
                precision,
                steps,
            );
        }
    }
    if cuda {
        for &(file, batch_size, precision, steps) in cuda_cases {
            if !example_wanted(file) || !row_wanted(batch_size, precision) {
                continue;
            }
            bench_case(
                &examples,
                BenchBackend::Cuda,
                file,
                batch_size,
                precision,
                steps,
            );
        }
    }
}

fn bench_case(
    examples: &Path,
    backend: BenchBackend,
    file: &str,
    batch_size: u64,
    precision: Precision,
    steps: u64,
) {
    let text = std::fs::read_to_string(examples.join(file)).expect("example exists");
    let mut spec = parse_job_spec_toml(&text).expect("example parses");
    spec.training.batch_size = batch_size;
    spec.training.accumulation_steps = 1;
    spec.training.steps = Some(steps + 1);
    spec.training.epochs = None;
    spec.data.format = DataFormat::Synthetic;
    spec.data.samples = Some(batch_size * (steps + 1));
    spec.data.test_samples = None;
    spec.data.train = None;
    spec.data.test = None;
    let job = validate_job_spec(spec).expect("example validates");
    let config = RunConfig {
        precision,
        ..RunConfig::from_spec(&job.spec)
    };
    let options = TrainingOptions {
        config,
        slice_bytes: estimate_job(&job, &config)
            .expect("estimates")
            .required_bytes,
        checkpoint_path: None,
        resume_from: None,
        stop_after_steps: None,
        stop_requested: None,
    };
    let data = open_data_sets(&job, Path::new(".")).expect("synthetic data");
    let mut started: Option<Instant> = None;
    let mut seconds = f64::NAN;
    let mut on_progress = |progress: &carve_engine::trainer::Progress| {
        // The first step warms caches, the loader and cuDNN's algorithm search; time
        // the rest, up to the end of the last step.
        match started {
            None if progress.step == 1 => started = Some(Instant::now()),
            Some(at) if progress.step == steps + 1 => seconds = at.elapsed().as_secs_f64(),
            _ => {}
        }
    };
    let result = match backend {
        BenchBackend::Cpu => train(&job, &data, &options, &mut on_progress),
        BenchBackend::Cuda => {
            train_on_cuda(&job, &data, &options, 0, &mut on_progress).map(|(report, _)| report)
        }
    };
    let label = format!(
        "{:<30} {:>7} {:>6} {:>9} {:>7}",
        file.trim_end_matches(".toml"),
        match backend {
            BenchBackend::Cpu => "cpu",
            BenchBackend::Cuda => "cuda",
        },
        batch_size,
        precision.name(),
        steps,
    );
    // A failing row is reported and the table goes on: the other rows still measure.
    match result {
        Ok(report) => println!(
            "{label} {:>12.1} {:>12} {:>16} {:>10.4} slice={}",
            (steps * batch_size) as f64 / seconds,
            HumanBytes(report.peak_bytes).to_string(),
            if report.peak_bytes == report.estimate.peak_bytes {
                "yes".to_string()
            } else {
                format!("NO: {}", HumanBytes(report.estimate.peak_bytes))
            },
            report.final_loss,
            options.slice_bytes
        ),
        Err(error) => println!("{label} failed: {error}"),
    }
}
