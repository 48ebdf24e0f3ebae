//! Layers as a hostile tenant writes them: each test builds the tar by hand (names the
//! tar crate's builder would refuse included) and checks what landed where.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use super::*;

/// One tar entry, its name written as raw bytes so `..` and absolute names get through.
enum Entry<'a> {
    File(&'a str, &'a [u8], u32),
    Directory(&'a str),
    Symlink(&'a str, &'a str),
    HardLink(&'a str, &'a str),
    Device(&'a str),
}

fn header(name: &str, kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut header = tar::Header::new_old();
    let bytes = name.as_bytes();
    header.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
    header.set_entry_type(kind);
    header.set_mode(mode);
    header.set_size(size);
    header
}

fn set_link(header: &mut tar::Header, target: &str) {
    let bytes = target.as_bytes();
    header.as_old_mut().linkname[..bytes.len()].copy_from_slice(bytes);
}

fn tar_of(entries: &[Entry]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for entry in entries {
        let (mut header, data): (tar::Header, &[u8]) = match entry {
            Entry::File(name, data, mode) => (
                header(name, tar::EntryType::Regular, *mode, data.len() as u64),
                data,
            ),
            Entry::Directory(name) => (header(name, tar::EntryType::Directory, 0o755, 0), &[]),
            Entry::Symlink(name, target) => {
                let mut header = header(name, tar::EntryType::Symlink, 0o777, 0);
                set_link(&mut header, target);
                (header, &[])
            }
            Entry::HardLink(name, target) => {
                let mut header = header(name, tar::EntryType::Link, 0o644, 0);
                set_link(&mut header, target);
                (header, &[])
            }
            Entry::Device(name) => (header(name, tar::EntryType::Char, 0o666, 0), &[]),
        };
        header.set_cksum();
        builder.append(&header, data).unwrap();
    }
    builder.into_inner().unwrap()
}

fn write_layer(directory: &Path, name: &str, compression: Compression, tar: &[u8]) -> PathBuf {
    let path = directory.join(name);
    let bytes = match compression {
        Compression::None => tar.to_vec(),
        Compression::Gzip => {
            let mut encoder =
                flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            encoder.write_all(tar).unwrap();
            encoder.finish().unwrap()
        }
        Compression::Zstd => zstd::encode_all(tar, 3).unwrap(),
    };
    std::fs::write(&path, bytes).unwrap();
    path
}

struct World {
    _directory: tempfile::TempDir,
    root: PathBuf,
    blobs: PathBuf,
    /// A host directory outside the root that an escaping entry would write.
    outside: PathBuf,
}

fn world() -> World {
    let directory = tempfile::tempdir().unwrap();
    let root = directory.path().join("rootfs");
    let blobs = directory.path().join("blobs");
    let outside = directory.path().join("outside");
    for path in [&root, &blobs, &outside] {
        std::fs::create_dir(path).unwrap();
    }
    std::fs::write(outside.join("secret"), "host secret").unwrap();
    World {
        _directory: directory,
        root,
        blobs,
        outside,
    }
}

impl World {
    fn apply(&self, name: &str, entries: &[Entry]) -> Result<UnpackSummary, UnpackError> {
        let layer = write_layer(&self.blobs, name, Compression::None, &tar_of(entries));
        apply_layer(&self.root, &layer, Compression::None, u64::MAX)
    }

    fn outside_is_untouched(&self) {
        let names: Vec<_> = std::fs::read_dir(&self.outside)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret"], "something was written outside the root");
        assert_eq!(
            std::fs::read_to_string(self.outside.join("secret")).unwrap(),
            "host secret"
        );
    }
}

#[test]
fn gzip_zstd_and_plain_layers_unpack_files_directories_and_links() {
    let world = world();
    let first = tar_of(&[
        Entry::Directory("./bin/"),
        Entry::File("./bin/busybox", b"#!busybox", 0o755),
        Entry::Symlink("./bin/sh", "busybox"),
        Entry::File("etc/os-release", b"ID=carve-test\n", 0o644),
    ]);
    let second = tar_of(&[
        Entry::HardLink("bin/ls", "bin/busybox"),
        Entry::File("/etc/motd", b"hello\n", 0o644),
    ]);
    let third = tar_of(&[Entry::File("usr/share/z", b"zstd", 0o600)]);
    for (name, compression, tar) in [
        ("gzip", Compression::Gzip, &first),
        ("plain", Compression::None, &second),
        ("zstd", Compression::Zstd, &third),
    ] {
        let layer = write_layer(&world.blobs, name, compression, tar);
        let media_type = "application/octet-stream";
        assert_eq!(
            Compression::of_layer(media_type, &layer).unwrap(),
            compression
        );
        apply_layer(&world.root, &layer, compression, u64::MAX).unwrap();
    }
    let root = &world.root;
    assert_eq!(
        std::fs::read(root.join("bin/busybox")).unwrap(),
        b"#!busybox"
    );
    assert_eq!(
        std::fs::read_link(root.join("bin/sh")).unwrap(),
        Path::new("busybox")
    );
    assert_eq!(
        std::fs::metadata(root.join("bin/ls")).unwrap().ino(),
        std::fs::metadata(root.join("bin/busybox")).unwrap().ino()
    );
    assert_eq!(std::fs::read(root.join("etc/motd")).unwrap(), b"hello\n");
    assert_eq!(std::fs::read(root.join("usr/share/z")).unwrap(), b"zstd");
    let mode = std::fs::metadata(root.join("bin/busybox")).unwrap().mode();
    assert_eq!(mode & 0o7777, 0o755);
}

#[test]
fn whiteouts_remove_lower_entries_and_opaque_directories_empty_them() {
    let world = world();
    world
        .apply(
            "lower",
            &[
                Entry::File("a/x", b"x", 0o644),
                Entry::File("a/y", b"y", 0o644),
                Entry::Directory("a/deep/"),
                Entry::File("a/deep/z", b"z", 0o644),
                Entry::File("b", b"b", 0o644),
                Entry::File("c/kept", b"kept", 0o644),
            ],
        )
        .unwrap();
    // The opaque marker comes after this layer's own a/new: it still hides only the
    // lower layers' entries.
    world
        .apply(
            "upper",
            &[
                Entry::File("a/new", b"new", 0o644),
                Entry::File("a/.wh..wh..opq", b"", 0o644),
                Entry::File(".wh.b", b"", 0o644),
                Entry::File("c/.wh.missing", b"", 0o644),
                Entry::File("nowhere/.wh.x", b"", 0o644),
            ],
        )
        .unwrap();
    let mut names: Vec<_> = std::fs::read_dir(world.root.join("a"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["new"]);
    assert!(!world.root.join("b").exists());
    assert!(world.root.join("c/kept").exists());
    assert!(!world.root.join("nowhere").exists());
    assert!(!world.root.join(".wh.b").exists());
}

#[test]
fn an_entry_with_dot_dot_is_refused_and_nothing_lands_outside() {
    let world = world();
    let depth = world.root.components().count();
    let climb = "../".repeat(depth) + world.outside.strip_prefix("/").unwrap().to_str().unwrap();
    for name in [
        "../outside/pwned",
        &format!("{climb}/pwned"),
        "a/../../pwned",
    ] {
        let error = world
            .apply("dotdot", &[Entry::File(name, b"pwned", 0o644)])
            .unwrap_err();
        assert!(
            matches!(&error, UnpackError::Refused(reason) if reason.contains("climbs out")),
            "{name}: {error}"
        );
    }
    world.outside_is_untouched();
}

#[test]
fn a_symlink_to_a_host_directory_is_followed_inside_the_root_only() {
    let world = world();
    let outside = world.outside.to_str().unwrap();
    // One layer makes the links, the next writes through them, as an attacker would.
    world
        .apply(
            "links",
            &[
                Entry::Symlink("escape", outside),
                Entry::Symlink("up", "../../../../../../../../.."),
                Entry::Symlink("loop", "loop"),
            ],
        )
        .unwrap();
    world
        .apply(
            "writes",
            &[
                Entry::File("escape/pwned", b"pwned", 0o644),
                Entry::File(
                    &format!("up/{}/pwned-relative", outside.trim_start_matches('/')),
                    b"pwned",
                    0o644,
                ),
                // The last component is replaced, not followed.
                Entry::File("escape", b"replaced the link", 0o644),
            ],
        )
        .unwrap();
    world.outside_is_untouched();
    // Both landed in the image's own copy of that path.
    let inside = world.root.join(outside.trim_start_matches('/'));
    assert_eq!(std::fs::read(inside.join("pwned")).unwrap(), b"pwned");
    assert_eq!(
        std::fs::read(inside.join("pwned-relative")).unwrap(),
        b"pwned"
    );
    assert_eq!(
        std::fs::read(world.root.join("escape")).unwrap(),
        b"replaced the link"
    );
    let error = world
        .apply("loop", &[Entry::File("loop/x", b"x", 0o644)])
        .unwrap_err();
    assert!(matches!(error, UnpackError::Refused(reason) if reason.contains("symbolic links")));
}

#[test]
fn a_hard_link_to_a_host_file_is_refused() {
    let world = world();
    let secret = world.outside.join("secret");
    let secret = secret.to_str().unwrap();
    world
        .apply(
            "dir-link",
            &[Entry::Symlink("hostdir", world.outside.to_str().unwrap())],
        )
        .unwrap();
    for (name, target) in [
        ("absolute", secret),
        ("through-link", "hostdir/secret"),
        ("dotdot", "../outside/secret"),
    ] {
        let error = world
            .apply(name, &[Entry::HardLink(name, target)])
            .unwrap_err();
        assert!(matches!(error, UnpackError::Refused(_)), "{name}: {error}");
        assert!(!world.root.join(name).exists(), "{name} was linked");
    }
    assert_eq!(std::fs::metadata(secret).unwrap().nlink(), 1);
    world.outside_is_untouched();
}

#[test]
fn device_nodes_are_skipped_and_setuid_bits_dropped() {
    let world = world();
    let summary = world
        .apply(
            "special",
            &[
                Entry::Device("dev/sda"),
                Entry::File("bin/su", b"su", 0o4755),
                Entry::File("bin/wall", b"wall", 0o2755),
            ],
        )
        .unwrap();
    assert_eq!(summary.skipped_special_files, 1);
    assert!(std::fs::symlink_metadata(world.root.join("dev/sda")).is_err());
    for name in ["bin/su", "bin/wall"] {
        let mode = std::fs::metadata(world.root.join(name))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o6000, 0, "{name} kept a set-id bit: {mode:o}");
        assert_eq!(mode & 0o777, 0o755);
    }
}

#[test]
fn a_layer_past_the_byte_budget_is_refused() {
    let world = world();
    let big = vec![0_u8; 64 * 1024];
    let layer = write_layer(
        &world.blobs,
        "bomb",
        Compression::Gzip,
        &tar_of(&[Entry::File("zeros", &big, 0o644)]),
    );
    // Compressed it is a few hundred bytes; unpacked it is over the budget.
    assert!(std::fs::metadata(&layer).unwrap().len() < 1024);
    let error = apply_layer(&world.root, &layer, Compression::Gzip, 32 * 1024).unwrap_err();
    assert!(matches!(error, UnpackError::Refused(reason) if reason.contains("more than 32768")));
}
