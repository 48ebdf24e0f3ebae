//! The guard and the fake driver as this test binary's build wrote them (cargo writes
//! both to `target/<profile>/deps/` because the worker dev-depends on them), and a
//! directory where the fake driver is `libcuda.so.1`, for `LD_LIBRARY_PATH`. Included
//! with `#[path]` by the tests that run programs under the guard.

use std::path::{Path, PathBuf};

use carve_worker::guard_environment::check_guard_library;

/// The checked guard library, and the library directory made under `directory`.
pub fn guard_world(directory: &Path) -> (PathBuf, PathBuf) {
    let deps = std::env::current_exe()
        .unwrap()
        .parent()
        .expect("target/<profile>/deps")
        .to_path_buf();
    let fake = deps.join("libcarve_fake_driver.so");
    assert!(fake.exists(), "{} is missing", fake.display());
    let libraries = directory.join("lib");
    std::fs::create_dir_all(&libraries).unwrap();
    for name in ["libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1"] {
        std::os::unix::fs::symlink(&fake, libraries.join(name)).unwrap();
    }
    let guard = check_guard_library(&deps.join("libcarve_guard.so")).expect("the guard is built");
    (guard, libraries)
}
