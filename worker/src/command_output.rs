//! A command job's output as the worker reads it: lines of bounded length (a program
//! that prints a megabyte without a newline must not grow the worker's memory), the
//! `CARVE_PROGRESS key=value ...` lines a program may print for its progress, and the
//! bounded tail of stderr that tells an OOM from another failure.

use std::collections::VecDeque;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// The longest line kept, in bytes; the rest of a longer line is dropped and the kept part
/// ends with [`CUT_MARK`].
pub const MOST_LINE_BYTES: usize = 4096;

/// What a cut line ends with.
pub const CUT_MARK: &str = " [line cut]";

/// How many stderr lines are kept for classifying the end (a Python traceback with its
/// OOM message fits).
pub const STDERR_TAIL_LINES: usize = 50;

/// The word that starts a progress line.
pub const PROGRESS_MARK: &str = "CARVE_PROGRESS";

/// Lines of a stream, each cut at `most_bytes`. Cancel safe: what was read of a line
/// before a cancelled call stays for the next.
#[derive(Debug)]
pub struct BoundedLines<R> {
    reader: BufReader<R>,
    most_bytes: usize,
    line: Vec<u8>,
    cut: bool,
}

impl<R: AsyncRead + Unpin> BoundedLines<R> {
    pub fn new(stream: R, most_bytes: usize) -> BoundedLines<R> {
        BoundedLines {
            reader: BufReader::new(stream),
            most_bytes,
            line: Vec::new(),
            cut: false,
        }
    }

    /// The next line without its newline (invalid UTF-8 replaced); `None` at the end of
    /// the stream. A last line without a newline is a line.
    pub async fn next_line(&mut self) -> std::io::Result<Option<String>> {
        loop {
            let available = self.reader.fill_buf().await?;
            if available.is_empty() {
                if self.line.is_empty() && !self.cut {
                    return Ok(None);
                }
                return Ok(Some(self.take_line()));
            }
            let newline = available.iter().position(|byte| *byte == b'\n');
            let piece = &available[..newline.unwrap_or(available.len())];
            let room = self.most_bytes.saturating_sub(self.line.len());
            if piece.len() > room {
                self.cut = true;
            }
            self.line.extend_from_slice(&piece[..piece.len().min(room)]);
            let consumed = newline.map_or(available.len(), |at| at + 1);
            self.reader.consume(consumed);
            if newline.is_some() {
                return Ok(Some(self.take_line()));
            }
        }
    }

    fn take_line(&mut self) -> String {
        let bytes = std::mem::take(&mut self.line);
        let mut line = String::from_utf8_lossy(&bytes).into_owned();
        if line.ends_with('\r') {
            line.pop();
        }
        if std::mem::take(&mut self.cut) {
            line.push_str(CUT_MARK);
        }
        line
    }
}

/// The last lines of a stream, at most a fixed number.
#[derive(Debug, Clone)]
pub struct LineTail {
    lines: VecDeque<String>,
    most: usize,
}

impl LineTail {
    pub fn new(most: usize) -> LineTail {
        LineTail {
            lines: VecDeque::with_capacity(most),
            most,
        }
    }

    pub fn push(&mut self, line: String) {
        if self.lines.len() == self.most {
            self.lines.pop_front();
        }
        self.lines.push_back(line);
    }

    pub fn to_vec(&self) -> Vec<String> {
        self.lines.iter().cloned().collect()
    }
}

/// What one `CARVE_PROGRESS` line said; each key is optional.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProgressLine {
    pub step: Option<u64>,
    pub total_steps: Option<u64>,
    pub loss: Option<f64>,
    pub samples_per_second: Option<f64>,
    /// The program's own memory figures, used only when there is no guard account to
    /// read (a simulated GPU without the guard, where the program accounts for itself).
    pub memory_in_use_bytes: Option<u64>,
    pub memory_peak_bytes: Option<u64>,
}

impl ProgressLine {
    /// Takes what a later line says, key by key (a key it lacks keeps its value); the
    /// peak is the largest memory figure seen.
    pub fn merge(&mut self, later: &ProgressLine) {
        self.step = later.step.or(self.step);
        self.total_steps = later.total_steps.or(self.total_steps);
        self.loss = later.loss.or(self.loss);
        self.samples_per_second = later.samples_per_second.or(self.samples_per_second);
        self.memory_in_use_bytes = later.memory_in_use_bytes.or(self.memory_in_use_bytes);
        self.memory_peak_bytes = self
            .memory_peak_bytes
            .max(later.memory_peak_bytes)
            .max(later.memory_in_use_bytes);
    }
}

/// Reads a progress line: `CARVE_PROGRESS` (anywhere in the line, so that a logging
/// prefix such as `INFO:root:` is allowed) followed by space separated `key=value` pairs:
/// `step`, `total_steps`, `loss`, `samples_per_s`, `memory_in_use_bytes`,
/// `memory_peak_bytes`. Unknown keys and values that do not parse (or a loss that is not
/// finite) are ignored. `None` when the line is not a progress line.
pub fn parse_progress_line(line: &str) -> Option<ProgressLine> {
    let (_, rest) = line.split_once(PROGRESS_MARK)?;
    // `CARVE_PROGRESSED` or `CARVE_PROGRESS=1` are not the mark.
    if !(rest.is_empty() || rest.starts_with(char::is_whitespace)) {
        return None;
    }
    let mut progress = ProgressLine::default();
    for pair in rest.split_whitespace() {
        let Some((key, value)) = pair.split_once('=') else {
            continue;
        };
        let finite = || {
            value
                .parse::<f64>()
                .ok()
                .filter(|number| number.is_finite())
        };
        match key {
            "step" => progress.step = value.parse().ok().or(progress.step),
            "total_steps" => progress.total_steps = value.parse().ok().or(progress.total_steps),
            "loss" => progress.loss = finite().or(progress.loss),
            "samples_per_s" => {
                progress.samples_per_second = finite()
                    .filter(|rate| *rate >= 0.0)
                    .or(progress.samples_per_second);
            }
            "memory_in_use_bytes" => {
                progress.memory_in_use_bytes = value.parse().ok().or(progress.memory_in_use_bytes);
            }
            "memory_peak_bytes" => {
                progress.memory_peak_bytes = value.parse().ok().or(progress.memory_peak_bytes);
            }
            _ => {}
        }
    }
    Some(progress)
}

/// The message of an error starting a program, without the "(os error 2)" the standard
/// library adds: "No such file or directory".
pub fn start_error_text(error: &std::io::Error) -> String {
    let text = error.to_string();
    match text.rfind(" (os error ") {
        Some(at) if text.ends_with(')') => text[..at].to_string(),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn lines_of(input: &[u8], most: usize) -> Vec<String> {
        let mut lines = BoundedLines::new(input, most);
        let mut all = Vec::new();
        while let Some(line) = lines.next_line().await.unwrap() {
            all.push(line);
        }
        all
    }

    #[tokio::test]
    async fn lines_are_cut_at_the_bound_and_the_rest_is_dropped() {
        let mut input = b"short\r\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 10_000));
        input.extend(b"\nafter\nlast without newline");
        let lines = lines_of(&input, 16).await;
        assert_eq!(
            lines,
            vec![
                "short".to_string(),
                format!("{}{CUT_MARK}", "x".repeat(16)),
                "after".to_string(),
                format!("last without new{CUT_MARK}"),
            ]
        );
        assert_eq!(lines_of(b"", 16).await, Vec::<String>::new());
        assert_eq!(lines_of(b"\n\n", 16).await, vec!["", ""]);
        // Invalid UTF-8 is replaced, not an error.
        assert_eq!(lines_of(b"a\xffb\n", 16).await, vec!["a\u{fffd}b"]);
    }

    #[test]
    fn progress_lines_are_read_key_by_key() {
        let full = parse_progress_line(
            "CARVE_PROGRESS step=12 total_steps=100 loss=0.53 samples_per_s=812.5",
        )
        .unwrap();
        assert_eq!(
            full,
            ProgressLine {
                step: Some(12),
                total_steps: Some(100),
                loss: Some(0.53),
                samples_per_second: Some(812.5),
                memory_in_use_bytes: None,
                memory_peak_bytes: None,
            }
        );
        let partial =
            parse_progress_line("INFO:root:CARVE_PROGRESS loss=nan step=x total_steps=9 odd")
                .unwrap();
        assert_eq!(
            partial,
            ProgressLine {
                total_steps: Some(9),
                ..ProgressLine::default()
            }
        );
        assert_eq!(
            parse_progress_line("CARVE_PROGRESS memory_peak_bytes=4096")
                .unwrap()
                .memory_peak_bytes,
            Some(4096)
        );
        assert_eq!(
            parse_progress_line("CARVE_PROGRESS"),
            Some(ProgressLine::default())
        );
        assert_eq!(parse_progress_line("step=1 loss=2"), None);
        assert_eq!(parse_progress_line("CARVE_PROGRESSED step=1"), None);
    }

    #[test]
    fn merged_progress_keeps_the_latest_of_each_key_and_the_largest_memory() {
        let mut merged = ProgressLine::default();
        for line in [
            "CARVE_PROGRESS step=1 loss=2.0 memory_in_use_bytes=300",
            "CARVE_PROGRESS step=2 memory_in_use_bytes=100 memory_peak_bytes=200",
        ] {
            merged.merge(&parse_progress_line(line).unwrap());
        }
        assert_eq!(
            merged,
            ProgressLine {
                step: Some(2),
                total_steps: None,
                loss: Some(2.0),
                samples_per_second: None,
                memory_in_use_bytes: Some(100),
                memory_peak_bytes: Some(300),
            }
        );
    }

    #[test]
    fn the_tail_keeps_the_last_lines() {
        let mut tail = LineTail::new(2);
        for line in ["a", "b", "c"] {
            tail.push(line.to_string());
        }
        assert_eq!(tail.to_vec(), vec!["b", "c"]);
    }

    #[test]
    fn start_errors_read_without_the_os_error_number() {
        let missing = std::io::Error::from_raw_os_error(2);
        assert_eq!(start_error_text(&missing), "No such file or directory");
        let other = std::io::Error::other("the spawner is gone");
        assert_eq!(start_error_text(&other), "the spawner is gone");
    }
}
