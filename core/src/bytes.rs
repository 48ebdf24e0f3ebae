//! Byte sizes as people write them (`"6GiB"`, `"512 MiB"`, `"1.5GB"`) and as Carve prints them.
//!
//! Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal units (KB, MB, GB, TB)
//! powers of 1000, because GPU memory is sold in GiB but people also type GB.

use std::fmt;

/// Why a byte size could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    #[error("empty size")]
    Empty,
    #[error("`{0}` is not a number of bytes (expected e.g. 512MiB, 6GiB, 1.5GB)")]
    NotANumber(String),
    #[error("unknown unit `{unit}` (expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")]
    UnknownUnit { unit: String },
    #[error("`{0}` is too large")]
    TooLarge(String),
    #[error("`{0}` is not a whole number of bytes")]
    Fractional(String),
}

/// Reads a size such as `6GiB`, `512 MiB`, `1.5GB` or a plain number of bytes.
pub fn parse_byte_size(text: &str) -> Result<u64, ByteSizeError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(ByteSizeError::Empty);
    }
    let split_at = trimmed
        .find(|character: char| {
            !(character.is_ascii_digit() || character == '.' || character == '_')
        })
        .unwrap_or(trimmed.len());
    let (number_text, unit_text) = trimmed.split_at(split_at);
    let number_text = number_text.replace('_', "");
    let unit = unit_text.trim();
    if number_text.is_empty() || number_text.chars().filter(|c| *c == '.').count() > 1 {
        return Err(ByteSizeError::NotANumber(trimmed.to_string()));
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(ByteSizeError::UnknownUnit {
                unit: unit.to_string(),
            });
        }
    };
    let (whole_text, fraction_text) = number_text.split_once('.').unwrap_or((&number_text, ""));
    let whole: u64 = if whole_text.is_empty() {
        0
    } else {
        whole_text
            .parse()
            .map_err(|_| ByteSizeError::TooLarge(trimmed.to_string()))?
    };
    let mut total = whole
        .checked_mul(multiplier)
        .ok_or_else(|| ByteSizeError::TooLarge(trimmed.to_string()))?;
    if !fraction_text.is_empty() {
        // Exact decimal arithmetic: 1.5GiB must be 1610612736, not a rounded float.
        let digits = fraction_text.len() as u32;
        if digits > 18 {
            return Err(ByteSizeError::NotANumber(trimmed.to_string()));
        }
        let fraction: u128 = fraction_text
            .parse()
            .map_err(|_| ByteSizeError::NotANumber(trimmed.to_string()))?;
        let scale = 10u128.pow(digits);
        let scaled = fraction * u128::from(multiplier);
        if !scaled.is_multiple_of(scale) {
            return Err(ByteSizeError::Fractional(trimmed.to_string()));
        }
        let extra = u64::try_from(scaled / scale)
            .map_err(|_| ByteSizeError::TooLarge(trimmed.to_string()))?;
        total = total
            .checked_add(extra)
            .ok_or_else(|| ByteSizeError::TooLarge(trimmed.to_string()))?;
    }
    Ok(total)
}

/// Displays a byte count with a binary unit, e.g. `15.8 GiB`, `512 MiB`, `256 B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanBytes(pub u64);

impl fmt::Display for HumanBytes {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let bytes = self.0;
        if bytes < 1024 {
            return write!(formatter, "{bytes} B");
        }
        let mut value = bytes as f64;
        let mut unit_index = 0;
        while value >= 1024.0 && unit_index < UNITS.len() - 1 {
            value /= 1024.0;
            unit_index += 1;
        }
        if value.fract() == 0.0 {
            write!(formatter, "{value:.0} {}", UNITS[unit_index])
        } else {
            write!(formatter, "{value:.2} {}", UNITS[unit_index])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_binary_and_decimal_units() {
        assert_eq!(parse_byte_size("6GiB"), Ok(6 << 30));
        assert_eq!(parse_byte_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_byte_size("1.5GiB"), Ok(1_610_612_736));
        assert_eq!(parse_byte_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("16g"), Ok(16 << 30));
    }

    #[test]
    fn rejects_what_is_not_a_size() {
        assert!(matches!(parse_byte_size(""), Err(ByteSizeError::Empty)));
        assert!(matches!(
            parse_byte_size("six GiB"),
            Err(ByteSizeError::NotANumber(_))
        ));
        assert!(matches!(
            parse_byte_size("6 parsecs"),
            Err(ByteSizeError::UnknownUnit { .. })
        ));
        assert!(matches!(
            parse_byte_size("99999999999TiB"),
            Err(ByteSizeError::TooLarge(_))
        ));
        assert!(matches!(
            parse_byte_size("1.5B"),
            Err(ByteSizeError::Fractional(_))
        ));
        assert!(matches!(
            parse_byte_size("1.2.3GiB"),
            Err(ByteSizeError::NotANumber(_))
        ));
    }

    #[test]
    fn prints_binary_units() {
        assert_eq!(HumanBytes(256).to_string(), "256 B");
        assert_eq!(HumanBytes(16 << 30).to_string(), "16 GiB");
        assert_eq!(HumanBytes(1_610_612_736).to_string(), "1.50 GiB");
    }
}
