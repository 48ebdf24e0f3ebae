//! A real registry for the image tests: the Debian `docker-registry` package's binary
//! (distribution 2.8) on 127.0.0.1, open, behind htpasswd, or speaking only TLS, and
//! pushing test images to it with `oci-client`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use carve_worker::image::Compression;
use carve_worker::image::layout::{LayerToWrite, WrittenImage, tar_of_files};
use oci_client::Reference;
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::manifest::OCI_IMAGE_MEDIA_TYPE;
use oci_client::secrets::RegistryAuth;

const REGISTRY_BINARY: &str = "docker-registry";
pub const USER: &str = "carve";
pub const PASSWORD: &str = "carve-test-password";
/// bcrypt of PASSWORD (distribution's htpasswd takes bcrypt only).
const PASSWORD_BCRYPT: &str = "$2b$12$g4f1iZnow/LhgRpUyGQKcOOz.Z2yOSguKE9e5xMdTsCK0XmkpjTKi";

/// A registry process on 127.0.0.1, killed when dropped.
pub struct Registry {
    child: Child,
    pub address: String,
    _directory: tempfile::TempDir,
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn registry_binary() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|directory| directory.join(REGISTRY_BINARY))
            .find(|path| path.is_file())
    });
    match found {
        Some(path) => Some(path),
        None if std::env::var_os("CI").is_none() => {
            eprintln!(
                "skipped: no {REGISTRY_BINARY} on PATH (apt-get install docker-registry); CI fails here"
            );
            None
        }
        None => panic!("CI must have {REGISTRY_BINARY} (.ci/run installs it)"),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts a registry, private (htpasswd) or open, and waits until it answers.
pub fn start_registry(binary: &Path, private: bool) -> Registry {
    start(binary, private, None)
}

/// Starts an open registry that speaks only TLS, with `certificate` and `key` (PEM
/// files), and waits until it accepts connections.
pub fn start_tls_registry(binary: &Path, certificate: &Path, key: &Path) -> Registry {
    start(binary, false, Some((certificate, key)))
}

fn start(binary: &Path, private: bool, tls: Option<(&Path, &Path)>) -> Registry {
    let directory = tempfile::tempdir().unwrap();
    // The port is chosen free and then handed to the registry; a second try covers the
    // rare case of another process taking it meanwhile.
    for _ in 0..5 {
        let address = format!("127.0.0.1:{}", free_port());
        let mut config = format!(
            "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
             http:\n  addr: {address}\n  secret: carve-test\n",
            directory.path().join("data").display()
        );
        if let Some((certificate, key)) = tls {
            config.push_str(&format!(
                "  tls:\n    certificate: {}\n    key: {}\n",
                certificate.display(),
                key.display()
            ));
        }
        if private {
            let htpasswd = directory.path().join("htpasswd");
            std::fs::write(&htpasswd, format!("{USER}:{PASSWORD_BCRYPT}\n")).unwrap();
            config.push_str(&format!(
                "auth:\n  htpasswd:\n    realm: carve\n    path: {}\n",
                htpasswd.display()
            ));
        }
        let config_path = directory.path().join("config.yml");
        std::fs::write(&config_path, config).unwrap();
        let mut child = Command::new(binary)
            .arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        for _ in 0..200 {
            if std::net::TcpStream::connect(&address).is_ok() {
                return Registry {
                    child,
                    address,
                    _directory: directory,
                };
            }
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("{REGISTRY_BINARY} did not start");
}

/// A client that pushes over plain HTTP.
pub fn client() -> oci_client::Client {
    carve_worker::image::install_crypto_provider();
    oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..ClientConfig::default()
    })
}

/// Pushes `image` (its blobs, then its manifest's exact bytes) as `reference`.
/// A client that pushes over HTTPS, trusting `authority_pem` besides the system's roots.
pub fn tls_client(authority_pem: &str) -> oci_client::Client {
    carve_worker::image::install_crypto_provider();
    oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Https,
        extra_root_certificates: vec![Certificate {
            encoding: CertificateEncoding::Pem,
            data: authority_pem.as_bytes().to_vec(),
        }],
        ..ClientConfig::default()
    })
}

pub async fn push(
    client: &oci_client::Client,
    reference: &str,
    image: &WrittenImage,
    auth: &RegistryAuth,
) {
    let reference: Reference = reference.parse().unwrap();
    client
        .store_auth_if_needed(reference.resolve_registry(), auth)
        .await;
    client
        .auth(&reference, auth, oci_client::RegistryOperation::Push)
        .await
        .unwrap();
    let blobs = std::iter::once((&image.manifest.config, &image.config_bytes))
        .chain(image.manifest.layers.iter().zip(&image.layer_blobs));
    for (descriptor, bytes) in blobs {
        client
            .push_blob(&reference, bytes.clone(), &descriptor.digest)
            .await
            .unwrap();
    }
    push_manifest(
        client,
        &reference,
        image.manifest_bytes.clone(),
        OCI_IMAGE_MEDIA_TYPE,
    )
    .await;
}

pub async fn push_manifest(
    client: &oci_client::Client,
    reference: &Reference,
    bytes: Vec<u8>,
    media_type: &str,
) {
    client
        .push_manifest_raw(
            reference,
            bytes,
            http::HeaderValue::from_str(media_type).unwrap(),
        )
        .await
        .unwrap();
}

/// The test image: the static busybox as /bin/busybox with /bin/sh linked to it, and a
/// shell stand-in for a training program that prints what it sees.
pub fn test_image_layers() -> Vec<LayerToWrite> {
    let busybox = std::fs::read("/bin/busybox").ok();
    let busybox = busybox.as_deref().unwrap_or(b"#!not-busybox\n");
    let train = b"#!/bin/sh\necho \"training in $(cat /etc/carve-image)\"\n";
    vec![
        LayerToWrite {
            tar: tar_of_files(
                &[("bin/busybox", busybox, 0o755)],
                &[("bin/sh", "busybox"), ("bin/cat", "busybox")],
            ),
            compression: Compression::Gzip,
        },
        LayerToWrite {
            tar: tar_of_files(
                &[
                    ("etc/carve-image", b"carve test image\n", 0o644),
                    ("opt/train.sh", train, 0o755),
                ],
                &[],
            ),
            compression: Compression::Zstd,
        },
    ]
}
