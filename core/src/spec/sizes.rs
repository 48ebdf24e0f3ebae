//! Sizes as job files write them: a slice request (`"auto"` or `"6GiB"`) and byte counts
//! (`"256MiB"` or a plain integer), read and written so a round trip keeps every byte.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::bytes::parse_byte_size;

/// How much GPU memory the job asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VramRequest {
    /// The slice is sized by the estimator.
    #[default]
    Auto,
    /// A fixed slice of this many bytes.
    Bytes(u64),
}

impl Serialize for VramRequest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            VramRequest::Auto => serializer.serialize_str("auto"),
            VramRequest::Bytes(bytes) => ByteSize(*bytes).serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for VramRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "\"auto\" or a size such as \"6GiB\"")]
        enum Written {
            Text(String),
            Bytes(u64),
        }
        match Written::deserialize(deserializer)? {
            Written::Text(text) if text.trim().eq_ignore_ascii_case("auto") => {
                Ok(VramRequest::Auto)
            }
            Written::Text(text) => parse_byte_size(&text)
                .map(VramRequest::Bytes)
                .map_err(serde::de::Error::custom),
            Written::Bytes(bytes) => Ok(VramRequest::Bytes(bytes)),
        }
    }
}

/// A byte count written as a size string (`"256MiB"`) or a plain integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        // Exact units only, so a round trip gives back the same number of bytes.
        let bytes = self.0;
        let text = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")]
            .iter()
            .find(|(shift, _)| bytes != 0 && bytes.is_multiple_of(1u64 << shift))
            .map(|(shift, unit)| format!("{}{unit}", bytes >> shift))
            .unwrap_or_else(|| format!("{bytes}B"));
        serializer.serialize_str(&text)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged, expecting = "a size such as \"256MiB\" or a number of bytes")]
        enum Written {
            Text(String),
            Bytes(u64),
        }
        match Written::deserialize(deserializer)? {
            Written::Text(text) => parse_byte_size(&text)
                .map(ByteSize)
                .map_err(serde::de::Error::custom),
            Written::Bytes(bytes) => Ok(ByteSize(bytes)),
        }
    }
}
