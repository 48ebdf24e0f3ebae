//! A command job's stdout and stderr read as ONE sequence of lines, in the order their
//! bytes were read, each marked with its stream, each of bounded length (a program that
//! prints a megabyte without a newline must not grow the worker's memory).
//!
//! Why one reader: stdout and stderr are two pipes, and the order of their lines is only
//! the order in which the worker reads them. Two line readers each with its own buffer,
//! raced against each other, hand out lines already read from one pipe after lines read
//! later from the other (a traceback's lines on stderr overtaking the output printed
//! before it). Here every chunk read is split into lines at once and queued, so a line
//! never overtakes one that was read before it. What is written to both pipes between
//! two reads has no order the worker could know; a program that flushes each line is
//! read in its order as long as the worker keeps up. (Python's block-buffered stdout is
//! the other cause of such disorder: the worker sets `PYTHONUNBUFFERED=1` unless the job
//! sets it.)

use std::collections::VecDeque;

use tokio::io::{AsyncRead, AsyncReadExt};

/// The longest line kept, in bytes; the rest of a longer line is dropped and the kept part
/// ends with [`CUT_MARK`].
pub const MOST_LINE_BYTES: usize = 4096;

/// What a cut line ends with.
pub const CUT_MARK: &str = " [line cut]";

/// Bytes asked for by one read of a pipe.
const READ_BYTES: usize = 16 * 1024;

/// Which of the program's streams a line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputStream {
    Stdout,
    Stderr,
}

impl OutputStream {
    /// "stdout" or "stderr", as log lines mark it.
    pub fn name(self) -> &'static str {
        match self {
            OutputStream::Stdout => "stdout",
            OutputStream::Stderr => "stderr",
        }
    }
}

/// One line of the program's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputLine {
    pub stream: OutputStream,
    /// Without its newline (and a `\r` before it); invalid UTF-8 replaced.
    pub text: String,
}

/// The line being put together from a stream's chunks.
#[derive(Debug, Default)]
struct PartialLine {
    bytes: Vec<u8>,
    cut: bool,
}

impl PartialLine {
    /// Adds `chunk`, pushing every line it completes onto `lines`.
    fn take(
        &mut self,
        stream: OutputStream,
        mut chunk: &[u8],
        most_bytes: usize,
        lines: &mut VecDeque<OutputLine>,
    ) {
        while !chunk.is_empty() {
            let newline = chunk.iter().position(|byte| *byte == b'\n');
            let piece = &chunk[..newline.unwrap_or(chunk.len())];
            let room = most_bytes.saturating_sub(self.bytes.len());
            if piece.len() > room {
                self.cut = true;
            }
            self.bytes
                .extend_from_slice(&piece[..piece.len().min(room)]);
            match newline {
                Some(at) => {
                    lines.push_back(self.finish(stream));
                    chunk = &chunk[at + 1..];
                }
                None => chunk = &[],
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty() && !self.cut
    }

    fn finish(&mut self, stream: OutputStream) -> OutputLine {
        let bytes = std::mem::take(&mut self.bytes);
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        if text.ends_with('\r') {
            text.pop();
        }
        if std::mem::take(&mut self.cut) {
            text.push_str(CUT_MARK);
        }
        OutputLine { stream, text }
    }
}

/// One of the two pipes while it is open.
#[derive(Debug)]
struct Pipe<R> {
    reader: Option<R>,
    partial: PartialLine,
}

impl<R: AsyncRead + Unpin> Pipe<R> {
    /// Reads one chunk: `None` once the pipe is closed (or cannot be read).
    async fn read(reader: &mut Option<R>, buffer: &mut [u8]) -> Option<usize> {
        let reader = reader.as_mut()?;
        match reader.read(buffer).await {
            Ok(0) | Err(_) => None,
            Ok(read) => Some(read),
        }
    }

    /// What one read gave: its lines queued, or at the pipe's end its last partial line.
    fn took(
        &mut self,
        stream: OutputStream,
        read: Option<usize>,
        buffer: &[u8],
        most_bytes: usize,
        ready: &mut VecDeque<OutputLine>,
    ) {
        match read {
            Some(read) => self
                .partial
                .take(stream, &buffer[..read], most_bytes, ready),
            None => {
                self.reader = None;
                if !self.partial.is_empty() {
                    ready.push_back(self.partial.finish(stream));
                }
            }
        }
    }
}

/// Both streams of a program as one sequence of lines; see the module docs.
#[derive(Debug)]
pub struct ProgramOutput<Out, Err> {
    stdout: Pipe<Out>,
    stderr: Pipe<Err>,
    most_bytes: usize,
    /// Lines read and not handed out yet, in the order they were read.
    ready: VecDeque<OutputLine>,
    stdout_buffer: Box<[u8]>,
    stderr_buffer: Box<[u8]>,
}

impl<Out: AsyncRead + Unpin, Err: AsyncRead + Unpin> ProgramOutput<Out, Err> {
    /// `None` for a stream the program does not have (it is closed from the start).
    pub fn new(stdout: Option<Out>, stderr: Option<Err>, most_bytes: usize) -> Self {
        ProgramOutput {
            stdout: Pipe {
                reader: stdout,
                partial: PartialLine::default(),
            },
            stderr: Pipe {
                reader: stderr,
                partial: PartialLine::default(),
            },
            most_bytes,
            ready: VecDeque::new(),
            stdout_buffer: vec![0; READ_BYTES].into_boxed_slice(),
            stderr_buffer: vec![0; READ_BYTES].into_boxed_slice(),
        }
    }

    /// Whether both streams ended and every line was handed out.
    pub fn is_done(&self) -> bool {
        self.ready.is_empty() && self.stdout.reader.is_none() && self.stderr.reader.is_none()
    }

    /// The next line, in the order read; `None` once both streams ended. A last line
    /// without a newline is a line. Cancel safe: a read that completed is queued before
    /// anything can cancel, and a cancelled read took nothing from its pipe.
    pub async fn next_line(&mut self) -> Option<OutputLine> {
        loop {
            if let Some(line) = self.ready.pop_front() {
                return Some(line);
            }
            if self.stdout.reader.is_none() && self.stderr.reader.is_none() {
                return None;
            }
            // When both pipes hold bytes there is no telling which came first: stdout's
            // are taken first.
            let (stream, read) = tokio::select! {
                biased;
                read = Pipe::read(&mut self.stdout.reader, &mut self.stdout_buffer),
                    if self.stdout.reader.is_some() => (OutputStream::Stdout, read),
                read = Pipe::read(&mut self.stderr.reader, &mut self.stderr_buffer),
                    if self.stderr.reader.is_some() => (OutputStream::Stderr, read),
            };
            let most_bytes = self.most_bytes;
            match stream {
                OutputStream::Stdout => {
                    self.stdout.took(
                        stream,
                        read,
                        &self.stdout_buffer,
                        most_bytes,
                        &mut self.ready,
                    );
                }
                OutputStream::Stderr => {
                    self.stderr.took(
                        stream,
                        read,
                        &self.stderr_buffer,
                        most_bytes,
                        &mut self.ready,
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    async fn lines_of(input: &[u8], most: usize) -> Vec<String> {
        let mut output = ProgramOutput::new(Some(input), None::<&[u8]>, most);
        let mut all = Vec::new();
        while let Some(line) = output.next_line().await {
            assert_eq!(line.stream, OutputStream::Stdout);
            all.push(line.text);
        }
        assert!(output.is_done());
        all
    }

    #[tokio::test]
    async fn lines_are_cut_at_the_bound_and_the_rest_is_dropped() {
        let mut input = b"short\r\n".to_vec();
        input.extend(std::iter::repeat_n(b'x', 100_000));
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

    /// Lines already read from one pipe come out before lines read later from the other,
    /// however often it is tried (two racing line readers got this wrong about half the
    /// time).
    #[tokio::test]
    async fn a_line_never_overtakes_one_read_before_it() {
        for _ in 0..50 {
            let (mut stdout_writer, stdout) = tokio::io::duplex(1 << 16);
            let (mut stderr_writer, stderr) = tokio::io::duplex(1 << 16);
            let mut output = ProgramOutput::new(Some(stdout), Some(stderr), MOST_LINE_BYTES);
            stdout_writer.write_all(b"out 1\nout 2\n").await.unwrap();
            let first = output.next_line().await.unwrap();
            assert_eq!(first.text, "out 1");
            // Written after "out 2" was read: it comes after it.
            stderr_writer.write_all(b"err 1\n").await.unwrap();
            let second = output.next_line().await.unwrap();
            let third = output.next_line().await.unwrap();
            assert_eq!(
                [(second.stream, second.text), (third.stream, third.text)],
                [
                    (OutputStream::Stdout, "out 2".to_string()),
                    (OutputStream::Stderr, "err 1".to_string())
                ]
            );
            drop(stdout_writer);
            stderr_writer
                .write_all(b"tail without newline")
                .await
                .unwrap();
            drop(stderr_writer);
            let last = output.next_line().await.unwrap();
            assert_eq!(last.stream, OutputStream::Stderr);
            assert_eq!(last.text, "tail without newline");
            assert_eq!(output.next_line().await, None);
            assert!(output.is_done());
        }
    }
}
