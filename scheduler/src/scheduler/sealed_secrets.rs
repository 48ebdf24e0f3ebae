//! Tenants' secrets sealed at rest (issue 30): with a key (`--secrets-key-file`), a
//! secret's value is stored encrypted with AES-256-GCM, so the database, its backups and
//! whoever reads them hold no registry credential. The tenant and the secret's name are
//! the associated data: a sealed value copied to another row (another tenant's secret, or
//! another name) does not open. Each value has its own random nonce.
//!
//! Without a key, values are stored as they are, and the scheduler says so when it
//! starts. A value stored before the key was set still reads (it lacks the seal's
//! prefix); a sealed value read without the key is refused, naming the setting.
//!
//! Rotation: the new key is `--secrets-key-file`, the old one
//! `--secrets-previous-key-file`. Values open with either (GCM's tag tells which key
//! sealed a value), and at start the scheduler seals again with the new key every value
//! the old key sealed or none did ([`Sealing::value_to_seal_again`]); once it said so,
//! the old key can go.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

use crate::error::SchedulerError;
use crate::store::Store;
use carve_proto::ApiError;

/// What every sealed value starts with, then the nonce, the ciphertext and its tag.
const SEALED_PREFIX: &[u8] = b"carve-sealed-v1\0";

/// The key's length: 32 bytes, written in its file as 64 hexadecimal digits.
pub const SECRETS_KEY_BYTES: usize = 32;

/// The key secrets are sealed with. Its `Debug` never shows it.
#[derive(Clone)]
pub struct SecretsKey {
    bytes: [u8; SECRETS_KEY_BYTES],
}

impl std::fmt::Debug for SecretsKey {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("SecretsKey(..)")
    }
}

impl SecretsKey {
    /// The key in a key file's text: 64 hexadecimal digits (`openssl rand -hex 32`),
    /// surrounding white space ignored. The error never quotes the text.
    pub fn from_hex(text: &str) -> Result<SecretsKey, String> {
        let text = text.trim();
        if !text.is_ascii() {
            return Err("must be hexadecimal digits only".into());
        }
        if text.len() != SECRETS_KEY_BYTES * 2 {
            return Err(format!(
                "must be {} hexadecimal digits (`openssl rand -hex 32`); it has {} characters",
                SECRETS_KEY_BYTES * 2,
                text.len()
            ));
        }
        let mut bytes = [0u8; SECRETS_KEY_BYTES];
        for (index, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&text[index * 2..index * 2 + 2], 16)
                .map_err(|_| "must be hexadecimal digits only".to_string())?;
        }
        Ok(SecretsKey { bytes })
    }

    fn aead_key(&self) -> LessSafeKey {
        // A 32-byte key is what AES-256-GCM takes: it cannot be refused.
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &self.bytes).expect("a 32-byte AES-256 key"))
    }
}

/// The associated data of `tenant`'s secret `name`: a sealed value opens only in its row.
fn row_of(tenant: &str, name: &str) -> Vec<u8> {
    let mut row = Vec::with_capacity(tenant.len() + name.len() + 1);
    row.extend_from_slice(tenant.as_bytes());
    row.push(0);
    row.extend_from_slice(name.as_bytes());
    row
}

/// The keys a scheduler holds: the one it seals with and those it still opens with.
#[derive(Debug, Clone, Default)]
pub struct Sealing {
    pub key: Option<SecretsKey>,
    /// Keys replaced by `key`: values they sealed still open, and are sealed again.
    pub previous_keys: Vec<SecretsKey>,
}

impl Sealing {
    /// `value` as stored for `tenant`'s secret `name` ([`seal`] with the current key).
    pub fn seal(&self, tenant: &str, name: &str, value: &[u8]) -> Result<Vec<u8>, SchedulerError> {
        seal(self.key.as_ref(), tenant, name, value)
    }

    /// The value `stored` holds, opened with the current key or a previous one.
    pub fn open(&self, tenant: &str, name: &str, stored: &[u8]) -> Result<Vec<u8>, String> {
        let current = open(self.key.as_ref(), tenant, name, stored);
        if current.is_ok() || !stored.starts_with(SEALED_PREFIX) {
            return current;
        }
        self.previous_keys
            .iter()
            .find_map(|key| open(Some(key), tenant, name, stored).ok())
            .ok_or_else(|| current.unwrap_err())
    }

    /// The value `stored` holds when it should be sealed again with the current key: it
    /// opens, and not with that key (a previous key sealed it, or it is stored as it is).
    /// `None` without a current key, for a value it sealed, and for one no key opens.
    pub fn value_to_seal_again(&self, tenant: &str, name: &str, stored: &[u8]) -> Option<Vec<u8>> {
        let key = self.key.as_ref()?;
        if !stored.starts_with(SEALED_PREFIX) {
            return Some(stored.to_vec());
        }
        if open(Some(key), tenant, name, stored).is_ok() {
            return None;
        }
        self.previous_keys
            .iter()
            .find_map(|previous| open(Some(previous), tenant, name, stored).ok())
    }
}

/// Seals again with the current key every stored value that needs it
/// ([`Sealing::value_to_seal_again`]): after a rotation, or when a key was first set.
/// Returns how many it sealed again; a value its tenant replaced meanwhile is left to
/// that newer write, and one no key opens is left as it is (its reads say why).
pub async fn seal_again(store: &Store, sealing: &Sealing) -> Result<usize, SchedulerError> {
    if sealing.key.is_none() {
        return Ok(0);
    }
    let mut sealed_again = 0;
    for (tenant, name, stored) in store.secrets_with_values().await? {
        let Some(value) = sealing.value_to_seal_again(&tenant, &name, &stored) else {
            continue;
        };
        let resealed = sealing.seal(&tenant, &name, &value)?;
        if store
            .replace_secret_value_if(&tenant, &name, &stored, &resealed)
            .await?
        {
            sealed_again += 1;
        }
    }
    Ok(sealed_again)
}

/// `value` as stored for `tenant`'s secret `name`: sealed with `key`, or as it is without
/// one.
pub fn seal(
    key: Option<&SecretsKey>,
    tenant: &str,
    name: &str,
    value: &[u8],
) -> Result<Vec<u8>, SchedulerError> {
    let Some(key) = key else {
        return Ok(value.to_vec());
    };
    let mut nonce = [0u8; NONCE_LEN];
    SystemRandom::new().fill(&mut nonce).map_err(|_| {
        SchedulerError::Api(ApiError::Unavailable(
            "the system's random source failed; the secret was not stored".into(),
        ))
    })?;
    let mut sealed = value.to_vec();
    key.aead_key()
        .seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(row_of(tenant, name)),
            &mut sealed,
        )
        .map_err(|_| SchedulerError::Api(ApiError::Internal("sealing the secret failed".into())))?;
    let mut stored = Vec::with_capacity(SEALED_PREFIX.len() + NONCE_LEN + sealed.len());
    stored.extend_from_slice(SEALED_PREFIX);
    stored.extend_from_slice(&nonce);
    stored.extend_from_slice(&sealed);
    Ok(stored)
}

/// The value of `tenant`'s secret `name` as `stored`: opened with `key` when sealed, as it
/// is when not. The error says why (no key, or a value that does not open in this row
/// with this key) and never quotes the value.
pub fn open(
    key: Option<&SecretsKey>,
    tenant: &str,
    name: &str,
    stored: &[u8],
) -> Result<Vec<u8>, String> {
    let Some(sealed) = stored.strip_prefix(SEALED_PREFIX) else {
        return Ok(stored.to_vec());
    };
    let Some(key) = key else {
        return Err("it is sealed and this scheduler has no --secrets-key-file".into());
    };
    if sealed.len() < NONCE_LEN {
        return Err("its sealed value is cut short".into());
    }
    let (nonce, ciphertext) = sealed.split_at(NONCE_LEN);
    let nonce = Nonce::try_assume_unique_for_key(nonce)
        .map_err(|_| "its sealed value is cut short".to_string())?;
    let mut opened = ciphertext.to_vec();
    let plain = key
        .aead_key()
        .open_in_place(nonce, Aad::from(row_of(tenant, name)), &mut opened)
        .map_err(|_| {
            "it does not open with this scheduler's key in this tenant's secret of this name \
             (another key, or a value moved from another row)"
                .to_string()
        })?;
    Ok(plain.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    fn key() -> SecretsKey {
        SecretsKey::from_hex(KEY).unwrap()
    }

    #[test]
    fn a_sealed_value_holds_no_plain_text_and_opens_in_its_row() {
        let stored = seal(Some(&key()), "acme", "registry", b"carve:hunter2").unwrap();
        assert!(stored.starts_with(SEALED_PREFIX));
        assert!(!stored.windows(7).any(|window| window == b"hunter2"));
        assert_eq!(
            open(Some(&key()), "acme", "registry", &stored).unwrap(),
            b"carve:hunter2"
        );
        // Every seal its own nonce: the same value twice is stored two ways.
        let again = seal(Some(&key()), "acme", "registry", b"carve:hunter2").unwrap();
        assert_ne!(stored, again);
    }

    /// Someone who can write the database copies a tenant's sealed credential into
    /// another tenant's row (or under another name): it does not open there.
    #[test]
    fn a_sealed_value_moved_to_another_row_or_opened_with_another_key_is_refused() {
        let stored = seal(Some(&key()), "acme", "registry", b"carve:hunter2").unwrap();
        for (tenant, name) in [("mallory", "registry"), ("acme", "other")] {
            let refused = open(Some(&key()), tenant, name, &stored).unwrap_err();
            assert!(refused.contains("does not open"), "{refused}");
        }
        let other = SecretsKey::from_hex(&KEY.replace('0', "1")).unwrap();
        assert!(open(Some(&other), "acme", "registry", &stored).is_err());
        let refused = open(None, "acme", "registry", &stored).unwrap_err();
        assert!(refused.contains("--secrets-key-file"), "{refused}");
        let mut tampered = stored.clone();
        *tampered.last_mut().unwrap() ^= 1;
        assert!(open(Some(&key()), "acme", "registry", &tampered).is_err());
        assert!(open(Some(&key()), "acme", "registry", SEALED_PREFIX).is_err());
    }

    #[test]
    fn without_a_key_values_are_stored_as_they_are_and_old_ones_still_read() {
        assert_eq!(seal(None, "acme", "r", b"u:p").unwrap(), b"u:p");
        assert_eq!(open(Some(&key()), "acme", "r", b"u:p").unwrap(), b"u:p");
        assert_eq!(open(None, "acme", "r", b"u:p").unwrap(), b"u:p");
    }

    #[test]
    fn after_a_rotation_old_values_open_and_are_sealed_again_with_the_new_key() {
        let old = key();
        let new = SecretsKey::from_hex(&"ab".repeat(SECRETS_KEY_BYTES)).unwrap();
        let sealed_by_old = seal(Some(&old), "alice", "registry", b"robot:pw").unwrap();
        let plain = b"robot:pw".to_vec();
        let rotated = Sealing {
            key: Some(new.clone()),
            previous_keys: vec![old.clone()],
        };
        assert_eq!(
            rotated.open("alice", "registry", &sealed_by_old).unwrap(),
            b"robot:pw"
        );
        assert_eq!(
            rotated
                .value_to_seal_again("alice", "registry", &sealed_by_old)
                .unwrap(),
            b"robot:pw"
        );
        assert_eq!(
            rotated
                .value_to_seal_again("alice", "registry", &plain)
                .unwrap(),
            b"robot:pw"
        );
        let sealed_by_new = rotated.seal("alice", "registry", b"robot:pw").unwrap();
        assert!(
            rotated
                .value_to_seal_again("alice", "registry", &sealed_by_new)
                .is_none()
        );
        // The previous key opens only what it sealed, in its own row.
        assert!(rotated.open("bob", "registry", &sealed_by_old).is_err());
        let new_only = Sealing {
            key: Some(new),
            previous_keys: Vec::new(),
        };
        assert!(new_only.open("alice", "registry", &sealed_by_old).is_err());
        // A value no key opens is left alone, not sealed again as garbage.
        assert!(
            new_only
                .value_to_seal_again("alice", "registry", &sealed_by_old)
                .is_none()
        );
    }

    #[test]
    fn a_key_file_holds_sixty_four_hex_digits() {
        assert!(SecretsKey::from_hex(&format!("  {KEY}\n")).is_ok());
        let short = SecretsKey::from_hex("abcd").unwrap_err();
        assert!(short.contains("64 hexadecimal digits"), "{short}");
        let not_hex = SecretsKey::from_hex(&KEY.replace('a', "g")).unwrap_err();
        assert!(not_hex.contains("hexadecimal"), "{not_hex}");
        // Not ASCII: refused, never cut inside a character.
        let wide = SecretsKey::from_hex(&"é".repeat(32)).unwrap_err();
        assert!(wide.contains("hexadecimal"), "{wide}");
        assert_eq!(format!("{:?}", key()), "SecretsKey(..)");
    }
}
