//! A command job's image: the OCI image its program runs in (`command.image`), and the
//! tenant secret that holds the registry credential for a private one
//! (`command.image_pull_secret`).
//!
//! The reference is parsed by `oci-spec`'s distribution `Reference` (the grammar of the
//! distribution project, which registries and `docker pull` share), then narrowed to what
//! the worker can pull and verify: a tag or a `sha256:` digest in lowercase hex, no
//! longer than [`MAX_IMAGE_REFERENCE_LENGTH`]. A reference without a registry names
//! Docker Hub (`python:3.12` is `docker.io/library/python:3.12`) and one without a tag or
//! digest means `:latest`, as `docker pull` reads them; [`ImageReference::canonical`] is
//! that full form, which the scheduler stores and the worker pulls.
//!
//! The pull secret is never the credential itself: it names a secret the tenant stored
//! with the scheduler, which sends it only to the worker that pulls, and which no read
//! ever shows. So the field is a short name, and text that looks like a credential
//! (`user:password`, a token with `/` or `=`) is refused before it is stored anywhere.

use std::fmt;

use oci_spec::distribution::{ParseError, Reference};

use crate::error::FieldError;

/// The longest image reference accepted (registry, repository, tag and digest together).
pub const MAX_IMAGE_REFERENCE_LENGTH: usize = 512;

/// The longest name of a tenant secret.
pub const MAX_SECRET_NAME_LENGTH: usize = 63;

/// A checked image reference, always in its full form.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageReference {
    /// The registry's host (and port): `registry.example.org:5000`, `docker.io`.
    pub registry: String,
    /// The repository within it: `team/train`, `library/python`.
    pub repository: String,
    /// The tag, when the reference has one.
    pub tag: Option<String>,
    /// `sha256:` and 64 lowercase hex digits, when the reference pins one.
    pub digest: Option<String>,
}

impl ImageReference {
    /// The full reference: `registry/repository[:tag][@digest]`.
    pub fn canonical(&self) -> String {
        let mut text = format!("{}/{}", self.registry, self.repository);
        if let Some(tag) = &self.tag {
            text.push(':');
            text.push_str(tag);
        }
        if let Some(digest) = &self.digest {
            text.push('@');
            text.push_str(digest);
        }
        text
    }

    /// This image pinned to `digest` (a resolved manifest digest), its tag kept for
    /// people reading it.
    pub fn pinned(&self, digest: &str) -> Result<ImageReference, FieldError> {
        check_digest("digest", digest)?;
        Ok(ImageReference {
            digest: Some(digest.to_string()),
            ..self.clone()
        })
    }
}

impl fmt::Display for ImageReference {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.canonical())
    }
}

/// Reads `text`, the value of `field`, as an image reference the worker can pull.
pub fn parse_image_reference(field: &str, text: &str) -> Result<ImageReference, FieldError> {
    let refused = |reason: String| FieldError::new(field, format!("{text:?} {reason}"));
    if text.trim().is_empty() {
        return Err(FieldError::new(field, "must name an image, not be empty"));
    }
    if text.len() > MAX_IMAGE_REFERENCE_LENGTH {
        return Err(FieldError::new(
            field,
            format!(
                "is {} characters long; an image reference has at most {MAX_IMAGE_REFERENCE_LENGTH}",
                text.len()
            ),
        ));
    }
    if text.contains("://") {
        return Err(refused(
            "is a URL; name the image as registry/repository:tag (no scheme)".to_string(),
        ));
    }
    let reference = Reference::try_from(text).map_err(|error| {
        refused(match error {
            ParseError::ReferenceInvalidFormat if text.chars().any(char::is_uppercase) => {
                "is not an image reference: a repository name is lowercase \
                 (registry/repository:tag or @sha256:digest)"
                    .to_string()
            }
            ParseError::ReferenceInvalidFormat => "is not an image reference \
                 (registry/repository:tag or registry/repository@sha256:<64 hex digits>)"
                .to_string(),
            other => format!("is not an image reference: {other}"),
        })
    })?;
    if let Some(digest) = reference.digest() {
        check_digest(field, digest)?;
    }
    Ok(ImageReference {
        registry: reference.registry().to_string(),
        repository: reference.repository().to_string(),
        tag: reference.tag().map(str::to_string),
        digest: reference.digest().map(str::to_string),
    })
}

/// A manifest digest the worker can verify: `sha256:` and 64 lowercase hex digits.
pub fn check_digest(field: &str, digest: &str) -> Result<(), FieldError> {
    let Some(hex) = digest.strip_prefix("sha256:") else {
        return Err(FieldError::new(
            field,
            format!(
                "digest {digest:?} must be sha256:<64 hex digits> (the only algorithm workers verify)"
            ),
        ));
    };
    if hex.len() != 64
        || !hex
            .bytes()
            .all(|byte| matches!(byte, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Err(FieldError::new(
            field,
            format!("digest {digest:?} must be sha256: and 64 lowercase hex digits"),
        ));
    }
    Ok(())
}

/// A tenant secret's name (`command.image_pull_secret`, and what a tenant stores a
/// secret under): 1 to [`MAX_SECRET_NAME_LENGTH`] of `a-z 0-9 - _ .`, starting with a
/// letter or digit. The reason for a refusal never repeats the value, which may be a
/// credential pasted into the wrong field.
pub fn check_secret_name(field: &str, name: &str) -> Result<(), FieldError> {
    let well_formed = !name.is_empty()
        && name.len() <= MAX_SECRET_NAME_LENGTH
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|byte| matches!(byte, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.'));
    if well_formed {
        return Ok(());
    }
    Err(FieldError::new(
        field,
        format!(
            "must name a secret the tenant stored with the scheduler (1 to \
             {MAX_SECRET_NAME_LENGTH} of a-z 0-9 - _ ., starting with a letter or digit), \
             not hold a credential; the value is not repeated here in case it is one"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn references_are_read_in_their_full_form() {
        let image = parse_image_reference("command.image", "python:3.12").unwrap();
        assert_eq!(image.canonical(), "docker.io/library/python:3.12");
        let image =
            parse_image_reference("command.image", "registry.example.org:5000/team/train").unwrap();
        assert_eq!(image.registry, "registry.example.org:5000");
        assert_eq!(image.repository, "team/train");
        assert_eq!(image.tag.as_deref(), Some("latest"));
        let pinned = format!("127.0.0.1:5000/carve/busybox@{DIGEST}");
        let image = parse_image_reference("command.image", &pinned).unwrap();
        assert_eq!(image.tag, None);
        assert_eq!(image.digest.as_deref(), Some(DIGEST));
        assert_eq!(image.canonical(), pinned);
        let both = parse_image_reference(
            "command.image",
            &format!("127.0.0.1:5000/carve/busybox:1@{DIGEST}"),
        )
        .unwrap();
        assert_eq!(both.tag.as_deref(), Some("1"));
        assert_eq!(both.digest.as_deref(), Some(DIGEST));
    }

    #[test]
    fn bad_references_are_refused_naming_the_field() {
        for (text, expected) in [
            ("", "must name an image"),
            ("   ", "must name an image"),
            ("Team/Train:1", "lowercase"),
            ("https://registry.example.org/team/train:1", "is a URL"),
            ("team/train:1 && rm -rf /", "is not an image reference"),
            ("team/train:-bad", "is not an image reference"),
            (
                "user:password@registry.example.org/train",
                "is not an image reference",
            ),
            ("team/train@sha256:1234", "64 hex digits"),
            ("team/train@md5:0123456789abcdef0123456789abcdef", "digest"),
            (
                "team/train@sha256:0123456789ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef",
                "lowercase hex",
            ),
            (
                "team/train@sha512:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "only algorithm workers verify",
            ),
        ] {
            let error = parse_image_reference("command.image", text).unwrap_err();
            assert_eq!(error.field, "command.image", "{text:?}");
            assert!(
                error.reason.contains(expected),
                "{text:?}: {} lacks {expected:?}",
                error.reason
            );
        }
        let long = format!("registry.example.org/{}:1", "a".repeat(600));
        let error = parse_image_reference("command.image", &long).unwrap_err();
        assert!(error.reason.contains("at most 512"), "{}", error.reason);
    }

    #[test]
    fn pinning_keeps_the_tag_and_checks_the_digest() {
        let image = parse_image_reference("command.image", "127.0.0.1:5000/a/b:1").unwrap();
        let pinned = image.pinned(DIGEST).unwrap();
        assert_eq!(pinned.canonical(), format!("127.0.0.1:5000/a/b:1@{DIGEST}"));
        assert!(image.pinned("sha256:abc").is_err());
    }

    #[test]
    fn secret_names_are_short_names_and_a_credential_is_never_echoed() {
        check_secret_name("command.image_pull_secret", "team-registry").unwrap();
        check_secret_name("command.image_pull_secret", "ghcr.io_pull").unwrap();
        for credential in [
            "",
            "alice:hunter2",
            "ghp_AbCdEf0123456789",
            "dXNlcjpwYXNz==",
            "-leading-dash",
            &"a".repeat(64),
        ] {
            let error = check_secret_name("command.image_pull_secret", credential).unwrap_err();
            assert_eq!(error.field, "command.image_pull_secret");
            if !credential.is_empty() {
                assert!(!error.reason.contains(credential), "{}", error.reason);
            }
        }
    }
}
