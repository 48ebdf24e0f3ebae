//! How carve-scheduler and carve-worker log (feature `logging`): to stderr, filtered by
//! `RUST_LOG` (default `info`), as text for people or one JSON object a line for log
//! pipelines (`--log-format json`). Text is coloured only on a terminal, so a log
//! redirected to a file or read by journald carries no escape codes.

use std::fmt;
use std::io::IsTerminal;
use std::str::FromStr;

use tracing_subscriber::EnvFilter;

/// What `--log-format` (`CARVE_LOG_FORMAT`) takes: `text` or `json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// Lines for people; coloured on a terminal.
    #[default]
    Text,
    /// One JSON object a line, never coloured.
    Json,
}

impl FromStr for LogFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("{other:?} is not a log format (text or json)")),
        }
    }
}

impl fmt::Display for LogFormat {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        })
    }
}

/// Installs the process's tracing subscriber; call once, first thing.
pub fn init_logging(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_formats_parse_and_print_as_the_flag_spells_them() {
        for format in [LogFormat::Text, LogFormat::Json] {
            assert_eq!(format.to_string().parse::<LogFormat>(), Ok(format));
        }
        assert_eq!(LogFormat::default(), LogFormat::Text);
        let refused = "JSON".parse::<LogFormat>().unwrap_err();
        assert!(refused.contains("text or json"), "{refused}");
    }
}
