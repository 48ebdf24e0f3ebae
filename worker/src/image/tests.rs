//! The cache over OCI layout sources: verification, one pull for concurrent requests,
//! eviction that spares held images, reopening.

use super::layout::{LayerToWrite, blob_path, tar_of_files, write_image};
use super::*;

fn settings(directory: &Path, layout: &Path, limit: u64) -> ImageSettings {
    ImageSettings {
        cache_directory: directory.join("cache"),
        cache_limit_bytes: limit,
        insecure_registries: Vec::new(),
        layout_directories: vec![layout.to_path_buf()],
        registry_authorities: Vec::new(),
        archives: Vec::new(),
    }
}

/// An image of one gzip layer holding `name` with `size` bytes, and one zstd layer
/// removing `doomed` from the first.
fn image(layout: &Path, ref_name: &str, name: &str, size: usize) -> layout::WrittenImage {
    let content = vec![b'x'; size];
    let lower = tar_of_files(
        &[
            (name, content.as_slice(), 0o644),
            ("doomed", b"gone", 0o644),
            ("bin/tool", b"#!/bin/sh\n", 0o755),
        ],
        &[("bin/sh", "tool")],
    );
    let upper = tar_of_files(&[(".wh.doomed", b"", 0o644)], &[]);
    write_image(
        layout,
        ref_name,
        &[
            LayerToWrite {
                tar: lower,
                compression: Compression::Gzip,
            },
            LayerToWrite {
                tar: upper,
                compression: Compression::Zstd,
            },
        ],
        &["PATH=/bin".to_string()],
        Some("/work"),
    )
    .unwrap()
}

pub(super) fn request(reference: &str) -> ImageRequest {
    ImageRequest {
        reference: reference.to_string(),
        pinned_digest: None,
        credential: None,
    }
}

#[tokio::test]
async fn a_layout_image_is_unpacked_verified_and_shared() {
    let directory = tempfile::tempdir().unwrap();
    let layout = directory.path().join("layout");
    let written = image(&layout, "carve.test/team/train:1", "data", 1000);
    let cache = ImageCache::open(&settings(directory.path(), &layout, 1 << 30)).unwrap();
    let held = cache
        .acquire(&request("carve.test/team/train:1"), None)
        .await
        .unwrap();
    assert!(held.pulled_now);
    assert_eq!(held.record.digest, written.manifest_digest);
    assert_eq!(held.record.env, ["PATH=/bin"]);
    assert_eq!(held.record.working_directory.as_deref(), Some("/work"));
    assert_eq!(std::fs::read(held.rootfs.join("data")).unwrap().len(), 1000);
    assert!(
        !held.rootfs.join("doomed").exists(),
        "the whiteout was not applied"
    );
    assert_eq!(
        std::fs::read_link(held.rootfs.join("bin/sh")).unwrap(),
        Path::new("tool")
    );
    // The same image by digest, and again by tag: no second pull.
    let by_digest = format!("carve.test/team/train@{}", written.manifest_digest);
    let again = cache.acquire(&request(&by_digest), None).await.unwrap();
    assert!(!again.pulled_now);
    assert_eq!(again.rootfs, held.rootfs);
    let pinned = ImageRequest {
        pinned_digest: Some(written.manifest_digest.clone()),
        ..request("carve.test/team/train:1")
    };
    assert!(!cache.acquire(&pinned, None).await.unwrap().pulled_now);
    assert_eq!(cache.pulls_done(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_for_one_image_pull_it_once() {
    let directory = tempfile::tempdir().unwrap();
    let layout = directory.path().join("layout");
    image(&layout, "carve.test/team/train:1", "data", 4 << 20);
    let cache = ImageCache::open(&settings(directory.path(), &layout, 1 << 30)).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let cache = cache.clone();
        tasks.push(tokio::spawn(async move {
            cache
                .acquire(&request("carve.test/team/train:1"), None)
                .await
                .map(|image| (image.pulled_now, image.rootfs.clone()))
        }));
    }
    let mut pulled = 0;
    for task in tasks {
        let (pulled_now, rootfs) = task.await.unwrap().unwrap();
        pulled += usize::from(pulled_now);
        assert!(rootfs.join("data").exists());
    }
    assert_eq!(pulled, 1);
    assert_eq!(cache.pulls_done(), 1);
}

#[tokio::test]
async fn a_corrupted_blob_and_a_wrong_pin_fail_as_digest_mismatches() {
    let directory = tempfile::tempdir().unwrap();
    let layout = directory.path().join("layout");
    let written = image(&layout, "carve.test/team/train:1", "data", 100);
    let cache = ImageCache::open(&settings(directory.path(), &layout, 1 << 30)).unwrap();

    let wrong = format!("sha256:{}", "0".repeat(64));
    let pinned_elsewhere = ImageRequest {
        pinned_digest: Some(wrong.clone()),
        ..request("carve.test/team/train:1")
    };
    let failure = cache.acquire(&pinned_elsewhere, None).await.unwrap_err();
    assert!(
        matches!(&failure, ImageFailure::DigestMismatch(reason) if reason.contains("first pull")),
        "{failure}"
    );

    let by_digest_and_pin = ImageRequest {
        pinned_digest: Some(wrong),
        ..request(&format!(
            "carve.test/team/train@{}",
            written.manifest_digest
        ))
    };
    let failure = cache.acquire(&by_digest_and_pin, None).await.unwrap_err();
    assert!(
        matches!(failure, ImageFailure::DigestMismatch(_)),
        "{failure}"
    );

    // One byte of the first layer changed: refused before anything is unpacked.
    let layer = blob_path(&layout, &written.manifest.layers[0].digest);
    let mut bytes = std::fs::read(&layer).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&layer, bytes).unwrap();
    let failure = cache
        .acquire(&request("carve.test/team/train:1"), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, ImageFailure::DigestMismatch(reason) if reason.contains("hashes to")),
        "{failure}"
    );
    assert!(cache.cached_digests().is_empty());
    assert_eq!(
        std::fs::read_dir(directory.path().join("cache/staging"))
            .unwrap()
            .count(),
        0,
        "a refused image left its staging directory"
    );
}

#[tokio::test]
async fn eviction_removes_the_least_recently_used_image_nobody_holds() {
    let directory = tempfile::tempdir().unwrap();
    let layout = directory.path().join("layout");
    for name in ["a", "b", "c"] {
        image(&layout, &format!("carve.test/team/{name}:1"), name, 40_000);
    }
    // Room for two images of about 40 KB.
    let cache = ImageCache::open(&settings(directory.path(), &layout, 100_000)).unwrap();
    let held_a = cache
        .acquire(&request("carve.test/team/a:1"), None)
        .await
        .unwrap();
    let b = cache
        .acquire(&request("carve.test/team/b:1"), None)
        .await
        .unwrap();
    let b_digest = b.record.digest.clone();
    drop(b);
    // c pushes the cache over: b is free, a is held, so b goes.
    let c = cache
        .acquire(&request("carve.test/team/c:1"), None)
        .await
        .unwrap();
    let cached = cache.cached_digests();
    assert!(cached.contains(&held_a.record.digest));
    assert!(cached.contains(&c.record.digest));
    assert!(!cached.contains(&b_digest));
    assert!(held_a.rootfs.join("a").exists());

    // Every image held: the cache goes over its limit rather than remove one in use.
    let b = cache
        .acquire(&request("carve.test/team/b:1"), None)
        .await
        .unwrap();
    assert!(b.pulled_now);
    assert_eq!(cache.cached_digests().len(), 3);
    assert!(cache.cached_bytes() > 100_000);
    for image in [&held_a, &b, &c] {
        assert!(image.rootfs.exists());
    }
    drop(c);
    drop(held_a);
    // The next use trims back down: c, released and least recently used, goes.
    let a_again = cache
        .acquire(&request("carve.test/team/a:1"), None)
        .await
        .unwrap();
    assert!(!a_again.pulled_now);
    assert_eq!(cache.cached_digests().len(), 2);
    assert!(cache.cached_bytes() <= 100_000);
    assert!(a_again.rootfs.join("a").exists() && b.rootfs.join("b").exists());

    // Reopened, the cache knows what it holds.
    drop((a_again, b));
    let reopened = ImageCache::open(&settings(directory.path(), &layout, 100_000)).unwrap();
    assert_eq!(reopened.cached_digests(), cache.cached_digests());
}

#[tokio::test]
async fn a_hostile_layer_is_refused_and_nothing_is_cached() {
    let directory = tempfile::tempdir().unwrap();
    let layout = directory.path().join("layout");
    let mut header = tar::Header::new_old();
    let name = b"../../../../../../../tmp/carve-image-escape";
    header.as_old_mut().name[..name.len()].copy_from_slice(name);
    header.set_entry_type(tar::EntryType::Regular);
    header.set_mode(0o644);
    header.set_size(5);
    header.set_cksum();
    let mut builder = tar::Builder::new(Vec::new());
    builder.append(&header, &b"pwned"[..]).unwrap();
    write_image(
        &layout,
        "carve.test/evil:1",
        &[LayerToWrite {
            tar: builder.into_inner().unwrap(),
            compression: Compression::Gzip,
        }],
        &[],
        None,
    )
    .unwrap();
    let cache = ImageCache::open(&settings(directory.path(), &layout, 1 << 30)).unwrap();
    let failure = cache
        .acquire(&request("carve.test/evil:1"), None)
        .await
        .unwrap_err();
    assert!(
        matches!(&failure, ImageFailure::Refused(reason) if reason.contains("climbs out")),
        "{failure}"
    );
    assert!(!failure.is_transient());
    assert!(!Path::new("/tmp/carve-image-escape").exists());
    assert!(cache.cached_digests().is_empty());
}

#[test]
fn a_dynamically_linked_program_or_a_script_is_not_a_static_executable() {
    // This test's own binary has an interpreter (it is linked dynamically).
    let own = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    assert!(!layout::is_static_executable(&own));
    assert!(!layout::is_static_executable(b"#!/bin/sh\n"));
}
