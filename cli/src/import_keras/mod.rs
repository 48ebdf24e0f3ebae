//! `carve import keras MODEL`: a Keras model (`.keras` file or `model.to_json()` JSON)
//! as a Carve job file, and its estimate. Only the model's configuration is read: no
//! Python, no pickles, no Lambda layers, no weights.

mod mapping;
mod zip;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use carve_core::estimator::estimate_job;
use carve_core::plan::RunConfig;
use carve_core::spec::{LayerEntry, LossKind, Precision};
use carve_core::validate::load_job_spec_toml;
use serde_json::Value;

pub use mapping::{ImportedModel, import_keras_json};

#[derive(Debug, clap::Args)]
pub struct ImportArguments {
    #[command(subcommand)]
    format: ImportFormat,
}

#[derive(Debug, clap::Subcommand)]
enum ImportFormat {
    /// A Keras model: a `.keras` file or the JSON of `model.to_json()`. Writes a job
    /// file (data left for you to fill in) and prints its estimate.
    Keras(KerasArguments),
}

#[derive(Debug, clap::Args)]
pub struct KerasArguments {
    /// The model: `name.keras` or a JSON file.
    model: PathBuf,
    /// Where to write the job file; defaults to the model's name with `.toml`.
    #[arg(short = 'o', long)]
    output: Option<PathBuf>,
    /// Replace the job file if it exists.
    #[arg(long)]
    force: bool,
    #[arg(long, default_value_t = 32)]
    batch_size: u64,
    #[arg(long, value_enum, default_value_t = Optimizer::Adam)]
    optimizer: Optimizer,
    #[arg(long, default_value_t = 0.001)]
    learning_rate: f64,
    /// fp32, fp16 or bf16.
    #[arg(long, default_value = "fp32", value_parser = parse_precision)]
    precision: Precision,
    /// The loss; by default softmax_cross_entropy when the model ends in a softmax, else mse.
    #[arg(long, value_parser = parse_loss)]
    loss: Option<LossKind>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Optimizer {
    Adam,
    Adamw,
    Sgd,
}

fn parse_precision(text: &str) -> Result<Precision, String> {
    Precision::from_name(text).ok_or_else(|| format!("`{text}` is not fp32, fp16 or bf16"))
}

fn parse_loss(text: &str) -> Result<LossKind, String> {
    match text {
        "softmax_cross_entropy" => Ok(LossKind::SoftmaxCrossEntropy),
        "mse" => Ok(LossKind::Mse),
        _ => Err(format!("`{text}` is not softmax_cross_entropy or mse")),
    }
}

/// The training settings a job file is written with.
#[derive(Debug, Clone)]
pub struct JobSettings {
    pub batch_size: u64,
    /// The optimizer's inline table, e.g. `{ adam = { learning_rate = 0.001 } }`.
    pub optimizer: String,
    pub precision: Precision,
}

pub fn run(arguments: ImportArguments) -> Result<ExitCode> {
    let ImportFormat::Keras(arguments) = arguments.format;
    let text = read_keras_model(&arguments.model)?;
    let mut model = import_keras_json(&text)
        .map_err(|reason| anyhow::anyhow!("{}: {reason}", arguments.model.display()))?;
    if let Some(loss) = arguments.loss {
        model.loss = loss;
        model.notes.retain(|note| !note.contains("loss"));
    }
    let optimizer = match arguments.optimizer {
        Optimizer::Adam => "adam",
        Optimizer::Adamw => "adamw",
        Optimizer::Sgd => "sgd",
    };
    let settings = JobSettings {
        batch_size: arguments.batch_size,
        optimizer: format!(
            "{{ {optimizer} = {{ learning_rate = {} }} }}",
            toml_float(arguments.learning_rate)
        ),
        precision: arguments.precision,
    };
    let source = arguments.model.display().to_string();
    let job_text = job_toml(&model, &settings, &source);
    let job = load_job_spec_toml(&job_text)
        .map_err(|error| anyhow::anyhow!("the imported model is not a valid Carve job: {error}"))?;
    let output = arguments
        .output
        .unwrap_or_else(|| PathBuf::from(format!("{}.toml", model.name)));
    if output.exists() && !arguments.force {
        bail!("{} exists; pass --force to replace it", output.display());
    }
    std::fs::write(&output, &job_text)
        .with_context(|| format!("cannot write {}", output.display()))?;
    let config = RunConfig::from_spec(&job.spec);
    let estimate = estimate_job(&job, &config).map_err(|error| anyhow::anyhow!("{error}"))?;
    let mut report = format!(
        "wrote {} from {source}: {} Carve layers, {} parameters ({} trainable)\n",
        output.display(),
        job.graph.layers.len(),
        job.graph.parameter_elements(),
        job.graph.trainable_parameter_elements()
    );
    for note in &model.notes {
        let _ = writeln!(report, "  note: {note}");
    }
    let _ = writeln!(
        report,
        "  [data] is synthetic until you fill it in (see the file)"
    );
    let _ = writeln!(report, "job {}: {}", job.spec.name, estimate.config);
    crate::estimate::write_estimate_report(&mut report, &job, &config, &estimate);
    print!("{report}");
    Ok(ExitCode::SUCCESS)
}

/// The model's JSON: `config.json` of a `.keras` file, or the file itself.
pub fn read_keras_model(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let json = if bytes.starts_with(b"PK") {
        zip::stored_entry(&bytes, "config.json")
            .map_err(|reason| anyhow::anyhow!("{}: {reason}", path.display()))?
    } else {
        bytes
    };
    String::from_utf8(json).with_context(|| format!("{} is not UTF-8 JSON", path.display()))
}

/// The job file: the model as imported, the training settings, and synthetic data marked
/// for the user to replace.
pub fn job_toml(model: &ImportedModel, settings: &JobSettings, source: &str) -> String {
    let mut text = String::new();
    let _ = writeln!(
        text,
        "# Imported by `carve import keras` from {source}\n# (Keras model \"{}\"). Only the model's configuration was read; nothing in it was run.",
        model.name
    );
    for note in &model.notes {
        let _ = writeln!(text, "# Note: {note}.");
    }
    let _ = writeln!(text, "name = {}\n\n[model]", toml_string(&model.name));
    let shape: Vec<String> = model.input_shape.iter().map(u64::to_string).collect();
    let _ = writeln!(text, "input_shape = [{}]", shape.join(", "));
    let loss = match model.loss {
        LossKind::SoftmaxCrossEntropy => "softmax_cross_entropy",
        LossKind::Mse => "mse",
    };
    let _ = writeln!(text, "loss = \"{loss}\"\nlayers = [");
    for entry in &model.layers {
        let _ = writeln!(text, "  {},", entry_toml(entry));
    }
    let _ = writeln!(
        text,
        "]\n\n[training]\nbatch_size = {}\nsteps = 100\noptimizer = {}\nprecision = \"{}\"\n",
        settings.batch_size, settings.optimizer, settings.precision
    );
    let _ = writeln!(
        text,
        "# FILL IN: your training data. Until then the job trains on synthetic data of the\n# model's shapes, enough to estimate it and try it. For example:\n#   format = \"npy\"\n#   train = {{ inputs = \"train_x.npy\", targets = \"train_y.npy\" }}\n[data]\nformat = \"synthetic\"\nsamples = 1024\ntest_samples = 256"
    );
    text
}

/// One layer entry as an inline table: the kind first, then its name and inputs.
fn entry_toml(entry: &LayerEntry) -> String {
    let kind = entry.layer.kind_name();
    let settings = serde_json::to_value(&entry.layer)
        .ok()
        .and_then(|value| value.get(kind).cloned())
        .unwrap_or(Value::Object(Default::default()));
    let mut text = format!("{{ {kind} = {}", value_toml(&settings));
    if let Some(name) = &entry.name {
        let _ = write!(text, ", name = {}", toml_string(name));
    }
    if let Some(inputs) = &entry.inputs {
        let names: Vec<String> = inputs.iter().map(|name| toml_string(name)).collect();
        let _ = write!(text, ", inputs = [{}]", names.join(", "));
    }
    text.push_str(" }");
    text
}

fn value_toml(value: &Value) -> String {
    match value {
        Value::Object(map) if map.is_empty() => "{}".to_string(),
        Value::Object(map) => {
            let fields: Vec<String> = map
                .iter()
                .filter(|(_, value)| !value.is_null())
                .map(|(key, value)| format!("{key} = {}", value_toml(value)))
                .collect();
            format!("{{ {} }}", fields.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(value_toml).collect();
            format!("[{}]", items.join(", "))
        }
        Value::String(text) => toml_string(text),
        Value::Number(number) if number.is_f64() => toml_float(number.as_f64().unwrap_or(0.0)),
        other => other.to_string(),
    }
}

/// A float TOML reads back as the same float (`6.0`, `0.001`, `1.001e-5`).
fn toml_float(value: f64) -> String {
    format!("{value:?}")
}

/// A TOML basic string: JSON's escapes are TOML's.
fn toml_string(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}
