//! Wall-clock durations as a job file writes them (`resources.max_duration`: `"2h"`,
//! `"90m"`, `"1h30m"`, `"7d"`) and as the worker's `--attempt-max-duration` takes them:
//! reading one, with a reason that says what to write instead, and writing one back the
//! same way.

use std::time::Duration;

/// The units of a duration, longest first, with their seconds.
const DURATION_UNITS: [(char, u64); 4] = [('d', 86_400), ('h', 3_600), ('m', 60), ('s', 1)];

/// Reads a wall-clock duration as people write one: whole numbers each with its unit,
/// `d`, `h`, `m` or `s`, longest unit first (`"7d"`, `"48h"`, `"90m"`, `"1h30m"`,
/// `"1h 30m"`, `"2 h"`). The reason for a bad one says what to write instead.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err("is empty; write a duration such as 30s, 90m, 2h or 7d".into());
    }
    let mut seconds: u64 = 0;
    // The index in DURATION_UNITS the next unit must come after.
    let mut next_unit = 0;
    let mut rest = trimmed;
    while !rest.is_empty() {
        let digits = rest
            .find(|character: char| !character.is_ascii_digit())
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let after = after.trim_start();
        let Some(unit) = after.chars().next() else {
            return Err(format!(
                "{number} has no unit; write {number}s, {number}m, {number}h or {number}d"
            ));
        };
        if number.is_empty() {
            return Err(format!(
                "expected a whole number before {unit:?}; write a duration such as 30s, \
                 90m, 1h30m or 7d"
            ));
        }
        let Some(position) = DURATION_UNITS.iter().position(|(name, _)| *name == unit) else {
            return Err(format!(
                "unknown unit {unit:?} (expected d, h, m or s, e.g. 90m or 1h30m)"
            ));
        };
        if position < next_unit {
            return Err(format!(
                "{unit:?} comes after a shorter or the same unit; write the longest unit \
                 first, each once (e.g. 1h30m)"
            ));
        }
        next_unit = position + 1;
        let too_long = || "is too long".to_string();
        let count: u64 = number.parse().map_err(|_| too_long())?;
        seconds = count
            .checked_mul(DURATION_UNITS[position].1)
            .and_then(|part| seconds.checked_add(part))
            .ok_or_else(too_long)?;
        rest = after[unit.len_utf8()..].trim_start();
    }
    Ok(Duration::from_secs(seconds))
}

/// A duration as [`parse_duration`] reads it, in whole seconds (`"2h"`, `"1h30m"`,
/// `"1d2h3m4s"`, `"0s"`); what is under a second is dropped.
pub fn format_duration(duration: Duration) -> String {
    let mut left = duration.as_secs();
    if left == 0 {
        return "0s".into();
    }
    let mut text = String::new();
    for (unit, seconds) in DURATION_UNITS {
        if left >= seconds {
            text.push_str(&format!("{}{unit}", left / seconds));
            left %= seconds;
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        let hours = |hours: u64| Duration::from_secs(hours * 3_600);
        assert_eq!(parse_duration("7d"), Ok(hours(7 * 24)));
        assert_eq!(parse_duration("48h"), Ok(hours(48)));
        assert_eq!(parse_duration("90m"), Ok(Duration::from_secs(90 * 60)));
        assert_eq!(parse_duration(" 30s "), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5_400)));
        assert_eq!(
            parse_duration("1d 2h 3m 4s"),
            Ok(Duration::from_secs(93_784))
        );
        assert_eq!(parse_duration("2 h"), Ok(hours(2)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn a_bad_duration_says_what_to_write() {
        let reason = |text: &str| parse_duration(text).unwrap_err();
        assert!(reason("").contains("is empty"), "{}", reason(""));
        assert!(reason("90").contains("90 has no unit"), "{}", reason("90"));
        assert!(
            reason("2w").contains("unknown unit 'w'"),
            "{}",
            reason("2w")
        );
        assert!(
            reason("1.5h").contains("unknown unit '.'"),
            "{}",
            reason("1.5h")
        );
        assert!(
            reason("h").contains("whole number before 'h'"),
            "{}",
            reason("h")
        );
        assert!(
            reason("30m1h").contains("longest unit first"),
            "{}",
            reason("30m1h")
        );
        assert!(
            reason("1h1h").contains("longest unit first"),
            "{}",
            reason("1h1h")
        );
        assert!(reason("-1h").contains("whole number"), "{}", reason("-1h"));
        let too_long = format!("{}d", u64::MAX / 1_000);
        assert_eq!(reason(&too_long), "is too long");
        assert_eq!(reason("99999999999999999999999s"), "is too long");
    }

    #[test]
    fn a_formatted_duration_reads_back_the_same() {
        for seconds in [1, 59, 60, 61, 3_600, 5_400, 86_400, 93_784, 7 * 86_400] {
            let duration = Duration::from_secs(seconds);
            let text = format_duration(duration);
            assert_eq!(parse_duration(&text), Ok(duration), "{text}");
        }
        assert_eq!(format_duration(Duration::from_secs(7_200)), "2h");
        assert_eq!(format_duration(Duration::from_millis(2_900)), "2s");
        assert_eq!(format_duration(Duration::from_millis(300)), "0s");
    }
}
