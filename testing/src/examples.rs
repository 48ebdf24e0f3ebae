//! The example job specs in the repository's `examples/` directory, which several crates'
//! tests run one by one (the cli's `carve estimate`, the engine's peak-equals-estimate).

use std::path::{Path, PathBuf};

/// The repository's `examples/` directory.
pub fn examples_directory() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Every `.toml` file in `examples/`, sorted by path.
pub fn example_spec_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(examples_directory())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "toml")
        })
        .collect();
    files.sort();
    files
}
