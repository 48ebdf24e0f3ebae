use super::super::layout::{oci_architecture, tar_of_files, write_image};
use super::super::tests::request;
use super::super::{ImageCache, ImageSettings};
use super::*;

fn sha256_hex(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// A tarball of `files` (path, bytes), as `docker save` writes one.
fn tarball(path: &Path, files: &[(String, Vec<u8>)]) {
    let mut builder = tar::Builder::new(std::fs::File::create(path).unwrap());
    for (name, bytes) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, bytes.as_slice())
            .unwrap();
    }
    builder.finish().unwrap();
}

/// A `docker save` archive of Docker before version 25: `manifest.json`, the config as
/// `<hex>.json`, each layer as `<hex>/layer.tar` (a plain tar), named `tag`.
fn legacy_docker_archive(path: &Path, tag: &str, marker: &str, layer_path: &str) {
    let layer = tar_of_files(&[("etc/carve-image", marker.as_bytes(), 0o644)], &[]);
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "config": { "Env": ["PATH=/bin"] },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{}", sha256_hex(&layer))] },
    }))
    .unwrap();
    let config_name = format!("{}.json", sha256_hex(&config));
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": config_name,
        "RepoTags": [tag],
        "Layers": [layer_path],
    }]))
    .unwrap();
    tarball(
        path,
        &[
            ("manifest.json".to_string(), manifest),
            (config_name, config),
            (layer_path.to_string(), layer),
        ],
    );
}

fn cache(
    directory: &Path,
    archives: Vec<PathBuf>,
) -> Result<ImageCache, super::super::ImageFailure> {
    ImageCache::open(&ImageSettings {
        cache_directory: directory.join("cache"),
        cache_limit_bytes: 1 << 30,
        insecure_registries: Vec::new(),
        layout_directories: Vec::new(),
        registry_authorities: Vec::new(),
        archives,
    })
}

#[tokio::test]
async fn a_docker_save_archive_and_an_oci_archive_are_read_as_layouts() {
    let directory = tempfile::tempdir().unwrap();
    let legacy = directory.path().join("train.tar");
    legacy_docker_archive(
        &legacy,
        "train:1",
        "from a docker save",
        &format!("{}/layer.tar", "a".repeat(64)),
    );
    // An OCI layout in a tarball (`skopeo copy ... oci-archive:`), no manifest.json.
    let layout = directory.path().join("oci");
    write_image(
        &layout,
        "registry.example.org/team/tool:2",
        &[super::super::layout::LayerToWrite {
            tar: tar_of_files(&[("etc/carve-image", b"from an oci archive", 0o644)], &[]),
            compression: super::super::Compression::Gzip,
        }],
        &[],
        None,
    )
    .unwrap();
    let oci = directory.path().join("tool.tar");
    let mut builder = tar::Builder::new(std::fs::File::create(&oci).unwrap());
    builder.append_dir_all(".", &layout).unwrap();
    builder.finish().unwrap();

    let images = cache(directory.path(), vec![legacy.clone(), oci]).unwrap();
    // Docker's "train:1" is Docker Hub's library/train:1, however the job writes it.
    for reference in ["train:1", "docker.io/library/train:1"] {
        let image = images.acquire(&request(reference), None).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(image.rootfs.join("etc/carve-image")).unwrap(),
            "from a docker save"
        );
    }
    let tool = images
        .acquire(&request("registry.example.org/team/tool:2"), None)
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(tool.rootfs.join("etc/carve-image")).unwrap(),
        "from an oci archive"
    );

    // Opened again with the archive unchanged: not unpacked again; changed: it is.
    let unpacked = archive_layout(&legacy, &directory.path().join("cache/archives")).unwrap();
    let marker = unpacked.join("marker");
    std::fs::write(&marker, "").unwrap();
    archive_layout(&legacy, &directory.path().join("cache/archives")).unwrap();
    assert!(marker.exists(), "unpacked again though unchanged");
    std::thread::sleep(std::time::Duration::from_millis(20));
    legacy_docker_archive(
        &legacy,
        "train:1",
        "saved again",
        &format!("{}/layer.tar", "b".repeat(64)),
    );
    let again = archive_layout(&legacy, &directory.path().join("cache/archives")).unwrap();
    assert!(
        !again.join("marker").exists(),
        "not unpacked again though changed"
    );
}

#[test]
fn an_archive_naming_a_file_outside_it_or_holding_no_image_is_refused() {
    let directory = tempfile::tempdir().unwrap();
    let archives = directory.path().join("archives");
    let escaping = directory.path().join("escaping.tar");
    legacy_docker_archive(&escaping, "train:1", "x", "layer.tar");
    // Rewritten to name a layer outside the archive.
    let manifest = serde_json::to_vec(&serde_json::json!([{
        "Config": "../../../etc/passwd",
        "RepoTags": ["train:1"],
        "Layers": ["layer.tar"],
    }]))
    .unwrap();
    tarball(&escaping, &[("manifest.json".to_string(), manifest)]);
    let refused = archive_layout(&escaping, &archives).unwrap_err();
    assert!(refused.contains("outside the archive"), "{refused}");

    let empty = directory.path().join("empty.tar");
    tarball(&empty, &[("README".to_string(), b"nothing".to_vec())]);
    let refused = archive_layout(&empty, &archives).unwrap_err();
    assert!(
        refused.contains("neither a docker save archive"),
        "{refused}"
    );
    let refused = cache(directory.path(), vec![directory.path().join("missing.tar")])
        .map(|_| ())
        .expect_err("a missing archive is refused at start")
        .to_string();
    assert!(refused.contains("missing.tar"), "{refused}");
}
