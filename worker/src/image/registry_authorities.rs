//! `--registry-ca REGISTRY=FILE`: the certificate authority that signed a private
//! registry's certificate (a company CA no system trusts). Each one is trusted for its
//! registry alone: the registry client is made per request, and only a request to that
//! registry (host and port as the image reference writes them) carries it. A registry
//! named here is always reached over HTTPS, on loopback too: naming its CA says it
//! speaks TLS.

use std::path::Path;

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

/// The CA certificates (PEM) one registry's certificate is checked against, besides the
/// system's roots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryAuthority {
    /// `HOST[:PORT]`, as image references write it.
    pub registry: String,
    /// The file's PEM text: one certificate or more.
    pub certificates_pem: Vec<u8>,
}

/// Reads `REGISTRY=FILE`, refusing a file that holds no PEM certificate (or a bad one):
/// a worker told to trust a CA must not start trusting nothing instead.
pub fn read_registry_authority(argument: &str) -> Result<RegistryAuthority, String> {
    let (registry, file) = argument
        .split_once('=')
        .filter(|(registry, file)| !registry.is_empty() && !file.is_empty())
        .ok_or_else(|| format!("--registry-ca {argument:?}: write REGISTRY=FILE"))?;
    let certificates_pem = std::fs::read(Path::new(file))
        .map_err(|error| format!("--registry-ca {registry}: cannot read {file}: {error}"))?;
    let certificates = CertificateDer::pem_slice_iter(&certificates_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| format!("--registry-ca {registry}: {file} is not PEM: {error}"))?;
    if certificates.is_empty() {
        return Err(format!(
            "--registry-ca {registry}: {file} holds no certificate (-----BEGIN CERTIFICATE-----)"
        ));
    }
    Ok(RegistryAuthority {
        registry: registry.to_string(),
        certificates_pem,
    })
}

/// The authorities named for `registry`, as the registry client takes them.
pub fn authorities_for(
    authorities: &[RegistryAuthority],
    registry: &str,
) -> Vec<oci_client::client::Certificate> {
    authorities
        .iter()
        .filter(|authority| authority.registry == registry)
        .map(|authority| oci_client::client::Certificate {
            encoding: oci_client::client::CertificateEncoding::Pem,
            data: authority.certificates_pem.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_a_certificate_or_a_malformed_argument_is_refused() {
        let directory = tempfile::tempdir().unwrap();
        let empty = directory.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        for (argument, reason) in [
            (
                format!("registry.example.org={}", empty.display()),
                "holds no certificate",
            ),
            ("registry.example.org".to_string(), "write REGISTRY=FILE"),
            ("=ca.pem".to_string(), "write REGISTRY=FILE"),
            (
                format!(
                    "registry.example.org={}",
                    directory.path().join("missing").display()
                ),
                "cannot read",
            ),
        ] {
            let refused = read_registry_authority(&argument).unwrap_err();
            assert!(refused.contains(reason), "{argument}: {refused}");
        }
    }

    #[test]
    fn an_authority_serves_its_registry_alone() {
        let authorities = vec![RegistryAuthority {
            registry: "registry.example.org:5000".into(),
            certificates_pem: b"pem".to_vec(),
        }];
        assert_eq!(
            authorities_for(&authorities, "registry.example.org:5000").len(),
            1
        );
        assert!(authorities_for(&authorities, "registry.example.org").is_empty());
        assert!(authorities_for(&authorities, "other.example.org:5000").is_empty());
    }
}
