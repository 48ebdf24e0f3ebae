//! Placeholders to the argv and environment of one run of a command job.
//!
//! One tokenizer, [`parse_template`], reads every templated string: validation runs it
//! to refuse an unknown placeholder or an unclosed brace with the field's path, and
//! rendering runs it again on the validated spec, so the two cannot disagree.

use std::collections::BTreeMap;

use crate::error::FieldError;
use crate::plan::RunConfig;

use super::validate::ValidatedCommandJob;

/// Every placeholder a command may use, written `{name}`; `{{` and `}}` stand for literal
/// braces.
pub const PLACEHOLDERS: &[&str] = &[
    "micro_batch",
    "accumulation_steps",
    "global_batch",
    "precision",
    "checkpoint_dir",
    "max_steps",
];

/// The environment variables the worker sets for every run of a command job, whether or
/// not the program reads them (the same values as the placeholders).
pub const ENVIRONMENT_MICRO_BATCH: &str = "CARVE_MICRO_BATCH";
pub const ENVIRONMENT_ACCUMULATION_STEPS: &str = "CARVE_ACCUMULATION_STEPS";
pub const ENVIRONMENT_GLOBAL_BATCH: &str = "CARVE_GLOBAL_BATCH";
pub const ENVIRONMENT_PRECISION: &str = "CARVE_PRECISION";
pub const ENVIRONMENT_CHECKPOINT_DIR: &str = "CARVE_CHECKPOINT_DIR";
/// Set only when the run has a step limit (the profile, or a spec with `steps`).
pub const ENVIRONMENT_MAX_STEPS: &str = "CARVE_MAX_STEPS";
/// "1" when recomputation is on, "0" otherwise.
pub const ENVIRONMENT_RECOMPUTE: &str = "CARVE_RECOMPUTE";

/// One run: the program, its arguments and the environment Carve adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedCommand {
    pub argv: Vec<String>,
    /// The spec's `env`, rendered, then the `CARVE_*` variables above.
    pub env: BTreeMap<String, String>,
    pub working_directory: Option<String>,
}

impl RenderedCommand {
    /// The argv as one line a person can read (and paste into a shell): arguments with
    /// spaces or quotes are quoted.
    pub fn display_line(&self) -> String {
        self.argv
            .iter()
            .map(|argument| shell_quoted(argument))
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// `argument` as a POSIX shell reads it back: as it is when it holds only characters no
/// shell treats specially, else in single quotes (a single quote inside written `'\''`).
fn shell_quoted(argument: &str) -> String {
    let plain = !argument.is_empty()
        && argument.chars().all(|character| {
            character.is_ascii_alphanumeric()
                || matches!(
                    character,
                    '-' | '_' | '.' | '/' | ':' | '=' | ',' | '+' | '@' | '%'
                )
        });
    if plain {
        argument.to_string()
    } else {
        format!("'{}'", argument.replace('\'', r"'\''"))
    }
}

/// A piece of a templated string: text to keep (literal braces already unescaped) or a
/// known placeholder's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TemplatePiece<'a> {
    Text(String),
    Placeholder(&'a str),
}

/// Splits `template` into text and placeholders. The error is the reason alone (the
/// caller knows the field): an unknown placeholder (listing the known ones), a `{` never
/// closed, a `}` that closes nothing.
pub(crate) fn parse_template(template: &str) -> Result<Vec<TemplatePiece<'_>>, String> {
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut characters = template.char_indices().peekable();
    while let Some((index, character)) = characters.next() {
        match character {
            '{' if characters.peek().is_some_and(|(_, next)| *next == '{') => {
                characters.next();
                text.push('{');
            }
            '}' if characters.peek().is_some_and(|(_, next)| *next == '}') => {
                characters.next();
                text.push('}');
            }
            '{' => {
                let start = index + 1;
                let end = template[start..]
                    .find(['{', '}'])
                    .map(|offset| start + offset)
                    .filter(|end| template[*end..].starts_with('}'))
                    .ok_or_else(|| {
                        format!(
                            "the `{{` at character {} is not closed; write `{{{{` for a literal brace",
                            template[..index].chars().count() + 1
                        )
                    })?;
                let name = &template[start..end];
                if !PLACEHOLDERS.contains(&name) {
                    return Err(format!(
                        "unknown placeholder `{{{name}}}`; the known ones are {}",
                        known_placeholders()
                    ));
                }
                if !text.is_empty() {
                    pieces.push(TemplatePiece::Text(std::mem::take(&mut text)));
                }
                pieces.push(TemplatePiece::Placeholder(name));
                // Skip the name and its closing brace.
                while characters
                    .next_if(|(position, _)| *position <= end)
                    .is_some()
                {}
            }
            '}' => {
                return Err(format!(
                    "the `}}` at character {} closes nothing; write `}}}}` for a literal brace",
                    template[..index].chars().count() + 1
                ));
            }
            other => text.push(other),
        }
    }
    if !text.is_empty() {
        pieces.push(TemplatePiece::Text(text));
    }
    Ok(pieces)
}

/// `{micro_batch}, {accumulation_steps}, ...`, for messages.
fn known_placeholders() -> String {
    PLACEHOLDERS
        .iter()
        .map(|name| format!("{{{name}}}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Renders `job` for a run with `config`. `max_steps` is the profile's step count in a
/// profile run and `None` in a full run (then `{max_steps}` renders the spec's `steps`).
/// Recomputation on (`config.recompute_segment_layers` set) appends the spec's
/// `recompute.argv`. Errors name the field (`command.argv[3]`) only for what validation
/// cannot rule out (a config the job does not allow: a precision not in `precisions`, a
/// micro-batch that does not divide `global_batch`).
pub fn render_command(
    job: &ValidatedCommandJob,
    config: &RunConfig,
    checkpoint_dir: &str,
    max_steps: Option<u64>,
) -> Result<RenderedCommand, FieldError> {
    let _ = (job, config, checkpoint_dir, max_steps);
    todo!()
}
