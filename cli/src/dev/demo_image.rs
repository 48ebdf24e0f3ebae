//! The demo's job in its own image (issue 30): `carve dev` writes a tiny OCI image into
//! its data directory, the host's static busybox and a shell stand-in for a training
//! program, as an image layout its worker reads before any registry; `--demo` runs a
//! command job in it. Images run only in contained attempts, and a dynamically linked
//! busybox would need the host's libc in the image: without either the demo says why
//! and skips the job.

use std::path::{Path, PathBuf};

use carve_worker::image::Compression;
use carve_worker::image::layout::{LayerToWrite, is_static_executable, tar_of_files, write_image};

/// The demo image's name, which its layout gives it.
pub const DEMO_IMAGE: &str = "carve.local/dev/standin:1";

/// Where a static busybox is on Debian and Ubuntu (`busybox-static`) and most others.
const BUSYBOX: &str = "/bin/busybox";

/// A training loop's stand-in: its steps with a falling loss, a checkpoint every 5
/// steps (`CARVE_CHECKPOINT`), resuming from the recorded one (`CARVE_RESUME_FROM`).
const STANDIN: &str = r#"#!/bin/sh
steps=$1
step=0
if [ -n "$CARVE_RESUME_FROM" ]; then step=$(cat "$CARVE_RESUME_FROM"); fi
echo "training in $(cat /etc/carve-image) from step $step of $steps"
while [ "$step" -lt "$steps" ]; do
  step=$((step + 1))
  echo "CARVE_PROGRESS step=$step total_steps=$steps loss=$((1000 / step))"
  if [ $((step % 5)) -eq 0 ]; then
    echo "$step" > "$CARVE_CHECKPOINT_DIR/step"
    echo "CARVE_CHECKPOINT step=$step path=step"
  fi
  sleep 0.1
done
"#;

/// Writes the demo image into `data_dir/image-layout` and returns that layout; the error
/// says why this machine cannot have it.
pub fn write_demo_image(data_dir: &Path) -> Result<PathBuf, String> {
    let busybox = std::fs::read(BUSYBOX).map_err(|error| {
        format!("no static busybox at {BUSYBOX} ({error}); apt-get install busybox-static")
    })?;
    if !is_static_executable(&busybox) {
        return Err(format!(
            "{BUSYBOX} is linked dynamically; apt-get install busybox-static"
        ));
    }
    let layout = data_dir.join("image-layout");
    let layers = [
        LayerToWrite {
            tar: tar_of_files(
                &[("bin/busybox", busybox.as_slice(), 0o755)],
                &[
                    ("bin/sh", "busybox"),
                    ("bin/cat", "busybox"),
                    ("bin/sleep", "busybox"),
                ],
            ),
            compression: Compression::Gzip,
        },
        LayerToWrite {
            tar: tar_of_files(
                &[
                    ("etc/carve-image", b"carve's demo image".as_slice(), 0o644),
                    ("opt/train.sh", STANDIN.as_bytes(), 0o755),
                ],
                &[],
            ),
            compression: Compression::Gzip,
        },
    ];
    write_image(
        &layout,
        DEMO_IMAGE,
        &layers,
        &["PATH=/bin:/opt".to_string()],
        None,
    )
    .map_err(|error| {
        format!(
            "cannot write the demo image into {}: {error}",
            layout.display()
        )
    })?;
    Ok(layout)
}

/// The demo's image job: the stand-in for 20 steps in a 256 MiB slice.
pub fn demo_image_spec_json() -> String {
    serde_json::json!({
        "name": "standin-in-an-image",
        "command": {
            "argv": ["/opt/train.sh", "{max_steps}"],
            "image": DEMO_IMAGE,
            "global_batch": 8,
            "micro_batch": 8,
            "steps": 20,
        },
        "resources": { "vram": "256MiB" },
    })
    .to_string()
}
