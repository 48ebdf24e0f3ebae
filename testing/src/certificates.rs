//! Certificates for tests: a private certificate authority and the leaf certificates it
//! signs (a server's, with its names as subjectAltNames; a client's, for mTLS), shaped
//! as real deployments shape them: the CA is marked a CA, the leaves are not, since
//! rustls refuses a CA certificate used as a server's own ("CaUsedAsEndEntity").

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

use crate::TestingError;

/// A certificate and its private key, PEM-encoded.
#[derive(Debug, Clone)]
pub struct PemPair {
    pub certificate_pem: String,
    pub private_key_pem: String,
}

/// A certificate authority that exists only in this test.
#[derive(Debug)]
pub struct TestAuthority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

fn failed(what: &str) -> impl FnOnce(rcgen::Error) -> TestingError + '_ {
    move |error| TestingError(format!("{what}: {error}"))
}

impl TestAuthority {
    /// A fresh CA named `common_name`.
    pub fn new(common_name: &str) -> Result<TestAuthority, TestingError> {
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(failed("the CA's parameters"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let key = KeyPair::generate().map_err(failed("the CA's key"))?;
        let issuer =
            CertifiedIssuer::self_signed(params, key).map_err(failed("the CA's certificate"))?;
        Ok(TestAuthority { issuer })
    }

    /// The CA's certificate, which clients (or servers, for client certificates) trust.
    pub fn certificate_pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for `names` (DNS names or IP addresses).
    pub fn issue_server(&self, names: &[&str]) -> Result<PemPair, TestingError> {
        self.issue(names, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate whose common name (and only subjectAltName) is `name`.
    pub fn issue_client(&self, name: &str) -> Result<PemPair, TestingError> {
        self.issue(&[name], ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn issue(
        &self,
        names: &[&str],
        purpose: ExtendedKeyUsagePurpose,
    ) -> Result<PemPair, TestingError> {
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        let mut params =
            CertificateParams::new(names.clone()).map_err(failed("the leaf's parameters"))?;
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, first);
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![purpose];
        let key = KeyPair::generate().map_err(failed("the leaf's key"))?;
        let certificate = params
            .signed_by(&key, &self.issuer)
            .map_err(failed("the leaf's certificate"))?;
        Ok(PemPair {
            certificate_pem: certificate.pem(),
            private_key_pem: key.serialize_pem(),
        })
    }
}
