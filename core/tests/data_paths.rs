//! The check a scheduler makes of a submitted spec's data paths: every one absolute, since
//! a worker would read a relative one from its own directory. `carve run` reads relative
//! paths against the job file and does not make this check.

use carve_core::validate::{load_job_spec_toml, require_absolute_data_paths};

/// A valid spec of `format` with the data split lines `splits`.
fn spec(format: &str, splits: &str) -> String {
    format!(
        "name = \"paths\"\n[model]\ninput_shape = [32, 32, 3]\nloss = \"softmax_cross_entropy\"\n\
         layers = [{{ flatten = {{}} }}, {{ dense = {{ units = 10 }} }}]\n[training]\n\
         batch_size = 4\nsteps = 2\noptimizer = {{ sgd = {{ learning_rate = 0.1 }} }}\n\
         [data]\nformat = \"{format}\"\n{splits}\n"
    )
}

fn refusal(text: &str) -> (String, String) {
    let job = load_job_spec_toml(text).unwrap();
    let error = require_absolute_data_paths(&job.spec).unwrap_err();
    (error.field, error.reason)
}

#[test]
fn absolute_paths_and_synthetic_data_pass() {
    let absolute = spec(
        "idx",
        "train = { images = \"/data/train-images\", labels = \"/data/train-labels\" }\n\
         test = { images = \"/data/t10k-images\", labels = \"/data/t10k-labels\" }",
    );
    let job = load_job_spec_toml(&absolute).unwrap();
    require_absolute_data_paths(&job.spec).unwrap();
    let synthetic = spec("synthetic", "samples = 16");
    let job = load_job_spec_toml(&synthetic).unwrap();
    require_absolute_data_paths(&job.spec).unwrap();
}

#[test]
fn a_relative_path_is_refused_naming_its_field_and_why() {
    let (field, reason) = refusal(&spec(
        "idx",
        "train = { images = \"/data/train-images\", labels = \"digits/labels\" }",
    ));
    assert_eq!(field, "data.train.labels");
    assert_eq!(
        reason,
        "\"digits/labels\" is a relative path, which a worker would read from its own \
         directory, not the job file's: give an absolute path (carve submit makes a job \
         file's relative paths absolute)"
    );
    // Listed files are named by index, and the test split is checked too.
    let (field, _) = refusal(&spec(
        "cifar10",
        "train = { files = [\"/data/batch_1.bin\"] }\n\
         test = { files = [\"/data/test_1.bin\", \"test_2.bin\"] }",
    ));
    assert_eq!(field, "data.test.files[1]");
    let (field, _) = refusal(&spec(
        "npy",
        "train = { inputs = \"./inputs.npy\", targets = \"/data/targets.npy\" }",
    ));
    assert_eq!(field, "data.train.inputs");
}
