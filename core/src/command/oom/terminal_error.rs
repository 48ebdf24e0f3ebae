//! Which lines of a program's stderr are the error it ended with: only those can say it
//! died of an out-of-memory error. Frameworks print memory warnings they recover from
//! (TensorFlow's BFC "The caller indicates that this is not a failure", a device
//! allocation retried smaller) long before a program dies of something else; reading
//! the whole of stderr would call that death an OOM.
//!
//! With a Python traceback in the tail, the error is the exception text of the last
//! traceback, with every traceback chained to it ("During handling of the above
//! exception, another exception occurred:", "The above exception was the direct cause of
//! the following exception:"): an OOM re-raised as another error is still the cause.
//! Frames (the indented lines under "Traceback (most recent call last):") are the
//! program's code, not what it said, and are left out. Without a traceback (a C++
//! program, or a tail that lost the traceback's head) the error starts at the last line
//! that is an error or an out-of-memory message and runs to the end. A launcher's error
//! that only reports its child's failure (torchrun's `ChildFailedError`) stands for the
//! child's error, found the same way in the lines before it.

use super::messages::{is_error_line, oom_in_line};

/// The indices of the lines that are the error the program ended with, in order; empty
/// when no line is one (a program that exited non-zero saying nothing).
pub(super) fn terminal_error_lines(lines: &[&str]) -> Vec<usize> {
    match last_chain_start(lines) {
        Some(chain_start) => {
            let text = exception_text_lines(lines, chain_start);
            // A launcher reporting that its child failed (torchrun's ChildFailedError,
            // "Root Cause (first observed failure)"): the child's error is the one the
            // program ended with.
            if text
                .iter()
                .any(|&index| lines[index].contains("ChildFailedError"))
            {
                let child = terminal_error_lines(&lines[..chain_start]);
                if !child.is_empty() {
                    return child;
                }
            }
            text
        }
        None => match last_decisive_line(lines) {
            Some(start) => (start..lines.len()).collect(),
            None => Vec::new(),
        },
    }
}

/// Python's header of a traceback; IPython writes it after the exception's name
/// ("XlaRuntimeError          Traceback (most recent call last)").
fn is_traceback_header(line: &str) -> bool {
    line.contains("Traceback (most recent call last)")
}

/// The lines Python writes between two tracebacks of one chain.
fn is_chain_connector(line: &str) -> bool {
    let line = line.trim();
    line == "During handling of the above exception, another exception occurred:"
        || line == "The above exception was the direct cause of the following exception:"
}

/// The first line of the last chain of tracebacks that ended the program, if the tail
/// has a traceback header. A traceback Python prints for an exception it ignored (in a
/// destructor at shutdown: "Exception ignored in: ...") did not end the program.
fn last_chain_start(lines: &[&str]) -> Option<usize> {
    let mut last = None;
    for (index, line) in lines.iter().enumerate() {
        if is_traceback_header(line) && !follows_ignored_exception(lines, index) {
            last = Some(index);
        }
    }
    let mut start = last?;
    // Walk back over "During handling ..." to the tracebacks chained before.
    loop {
        let before = lines[..start]
            .iter()
            .rposition(|line| !line.trim().is_empty());
        match before {
            Some(connector) if is_chain_connector(lines[connector]) => {
                match lines[..connector]
                    .iter()
                    .rposition(|line| is_traceback_header(line))
                {
                    Some(previous) => start = previous,
                    None => return Some(start),
                }
            }
            _ => return Some(start),
        }
    }
}

fn follows_ignored_exception(lines: &[&str], header: usize) -> bool {
    lines[..header]
        .iter()
        .rev()
        .find(|line| !line.trim().is_empty())
        .is_some_and(|line| line.starts_with("Exception ignored in"))
}

/// The lines of each traceback from `chain_start` on that are not frames: after a
/// header, the indented lines are frames ("  File ...", the code, its carets) until the
/// first line at the margin, which starts the exception's text; the text runs to the
/// next header.
fn exception_text_lines(lines: &[&str], chain_start: usize) -> Vec<usize> {
    let mut in_frames = false;
    let mut text = Vec::new();
    for (index, line) in lines.iter().enumerate().skip(chain_start) {
        if is_traceback_header(line) {
            in_frames = true;
            continue;
        }
        if in_frames && (line.starts_with(char::is_whitespace) || line.is_empty()) {
            continue;
        }
        in_frames = false;
        text.push(index);
    }
    text
}

/// The last line that is an error or an out-of-memory message (the start of the error
/// a program without a traceback ended with).
fn last_decisive_line(lines: &[&str]) -> Option<usize> {
    (0..lines.len()).rev().find(|&index| {
        is_error_line(lines[index]) || oom_in_line(lines[index], &lines[index + 1..]).is_some()
    })
}
