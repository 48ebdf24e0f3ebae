//! The demo's job in its own image (issue 30): `carve dev` writes a tiny OCI image into
//! its data directory, the host's static busybox and a shell stand-in for a training
//! program, as an image layout its worker reads before any registry; `--demo` runs a
//! command job in it. Images run only in contained attempts, and a dynamically linked
//! busybox would need the host's libc in the image: without either the demo says why
//! and skips the job.

use std::path::{Path, PathBuf};

use carve_worker::image::Compression;
use carve_worker::image::layout::{LayerToWrite, tar_of_files, write_image};

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

/// Whether `elf` is an ELF executable without a program interpreter (`PT_INTERP`): one
/// that runs in an image holding no dynamic loader or libc.
fn is_static_executable(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let read_u16 = |at: usize| {
        elf.get(at..at + 2)
            .map(|bytes| u16::from_le_bytes([bytes[0], bytes[1]]))
    };
    let read_u32 = |at: usize| {
        elf.get(at..at + 4)
            .map(|bytes| u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    };
    let read_u64 = |at: usize| {
        elf.get(at..at + 8)
            .map(|bytes| u64::from_le_bytes(bytes.try_into().unwrap_or_default()))
    };
    // A 64-bit little-endian ELF file, as on every node Carve runs on.
    if elf.get(..6) != Some(b"\x7fELF\x02\x01".as_slice()) {
        return false;
    }
    let (Some(table), Some(entry_size), Some(entries)) =
        (read_u64(0x20), read_u16(0x36), read_u16(0x38))
    else {
        return false;
    };
    (0..usize::from(entries)).all(|index| {
        let at = usize::try_from(table)
            .unwrap_or(usize::MAX)
            .saturating_add(index * usize::from(entry_size));
        read_u32(at).is_some_and(|kind| kind != PT_INTERP)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dynamically_linked_program_is_not_static() {
        // This test's own binary is linked dynamically (it has an interpreter).
        let own = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(!is_static_executable(&own));
        assert!(!is_static_executable(b"#!/bin/sh\n"));
        if let Ok(busybox) = std::fs::read(BUSYBOX) {
            // Debian's busybox-static, where CI installs it.
            let linked = std::process::Command::new("file").arg(BUSYBOX).output();
            if let Ok(output) = linked {
                let said = String::from_utf8_lossy(&output.stdout);
                if said.contains("statically linked") {
                    assert!(is_static_executable(&busybox), "{said}");
                }
            }
        }
    }
}
