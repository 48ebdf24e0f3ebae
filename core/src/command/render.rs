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
    "rank",
    "world_size",
    "master_addr",
    "master_port",
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

/// What `torch.distributed`'s env:// (and `torchrun`, JAX's multi-process start) read,
/// set for every member of a gang (issue 31) and for no other run.
pub const ENVIRONMENT_RANK: &str = "RANK";
pub const ENVIRONMENT_WORLD_SIZE: &str = "WORLD_SIZE";
pub const ENVIRONMENT_LOCAL_RANK: &str = "LOCAL_RANK";
pub const ENVIRONMENT_LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
pub const ENVIRONMENT_NODE_RANK: &str = "NODE_RANK";
pub const ENVIRONMENT_MASTER_ADDR: &str = "MASTER_ADDR";
pub const ENVIRONMENT_MASTER_PORT: &str = "MASTER_PORT";

/// One member's place in its gang (issue 31): the values of `{rank}`, `{world_size}`,
/// `{master_addr}`, `{master_port}` and of the variables above. A run without one is a
/// single process: `{rank}` is 0, `{world_size}` 1, and `{master_addr}`/`{master_port}`
/// have no value (an error naming the field).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangMemberPlace {
    pub rank: u32,
    pub world_size: u32,
    pub local_rank: u32,
    pub local_world_size: u32,
    pub node_rank: u32,
    pub master_addr: String,
    pub master_port: u16,
}

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
    render(job, config, checkpoint_dir, max_steps, None)
}

/// As [`render_command`], for one member of a gang: `config.batch_size` is still the
/// global batch, shared by all members, so each member runs `global_batch / (micro_batch
/// x world_size)` accumulation steps (`{accumulation_steps}`), and the `torch.distributed`
/// variables are set ([`ENVIRONMENT_RANK`] and the others, over the job's own `env`).
pub fn render_gang_member_command(
    job: &ValidatedCommandJob,
    config: &RunConfig,
    checkpoint_dir: &str,
    max_steps: Option<u64>,
    member: &GangMemberPlace,
) -> Result<RenderedCommand, FieldError> {
    render(job, config, checkpoint_dir, max_steps, Some(member))
}

fn render(
    job: &ValidatedCommandJob,
    config: &RunConfig,
    checkpoint_dir: &str,
    max_steps: Option<u64>,
    member: Option<&GangMemberPlace>,
) -> Result<RenderedCommand, FieldError> {
    let command = &job.spec.command;
    if !command.precisions.contains(&config.precision) {
        return Err(FieldError::new(
            "command.precisions",
            format!(
                "the program does not accept {} (it accepts {})",
                config.precision,
                command
                    .precisions
                    .iter()
                    .map(|precision| precision.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    if config.micro_batch_size == 0 || !config.batch_size.is_multiple_of(config.micro_batch_size) {
        return Err(FieldError::new(
            "command.global_batch",
            format!(
                "micro-batch {} does not divide the global batch {}",
                config.micro_batch_size, config.batch_size
            ),
        ));
    }
    let world_size = member.map_or(1, |member| u64::from(member.world_size));
    let per_member_samples = config.micro_batch_size.saturating_mul(world_size);
    if world_size == 0 || !config.batch_size.is_multiple_of(per_member_samples) {
        return Err(FieldError::new(
            "command.global_batch",
            format!(
                "micro-batch {} x {world_size} gang members does not divide the global batch {}",
                config.micro_batch_size, config.batch_size
            ),
        ));
    }
    let values = PlaceholderValues {
        micro_batch: config.micro_batch_size.to_string(),
        accumulation_steps: (config.batch_size / per_member_samples).to_string(),
        global_batch: config.batch_size.to_string(),
        precision: config.precision.name().to_string(),
        checkpoint_dir: checkpoint_dir.to_string(),
        max_steps: max_steps.or(command.steps).map(|steps| steps.to_string()),
        rank: member.map_or(0, |member| member.rank).to_string(),
        world_size: world_size.to_string(),
        master_addr: member.map(|member| member.master_addr.clone()),
        master_port: member.map(|member| member.master_port.to_string()),
    };
    let recompute_argv = command
        .recompute
        .as_ref()
        .filter(|_| config.recompute_segment_layers.is_some())
        .map(|recompute| recompute.argv.as_slice())
        .unwrap_or_default();
    let argv = command
        .argv
        .iter()
        .enumerate()
        .map(|(index, argument)| (format!("command.argv[{index}]"), argument))
        .chain(
            recompute_argv
                .iter()
                .enumerate()
                .map(|(index, argument)| (format!("command.recompute.argv[{index}]"), argument)),
        )
        .map(|(field, argument)| values.render(argument, &field))
        .collect::<Result<Vec<_>, _>>()?;
    let mut env = BTreeMap::new();
    for (name, value) in &command.env {
        env.insert(
            name.clone(),
            values.render(value, &format!("command.env.{name}"))?,
        );
    }
    let carve_variables = [
        (ENVIRONMENT_MICRO_BATCH, Some(&values.micro_batch)),
        (
            ENVIRONMENT_ACCUMULATION_STEPS,
            Some(&values.accumulation_steps),
        ),
        (ENVIRONMENT_GLOBAL_BATCH, Some(&values.global_batch)),
        (ENVIRONMENT_PRECISION, Some(&values.precision)),
        (ENVIRONMENT_CHECKPOINT_DIR, Some(&values.checkpoint_dir)),
        (ENVIRONMENT_MAX_STEPS, values.max_steps.as_ref()),
    ];
    for (name, value) in carve_variables {
        if let Some(value) = value {
            env.insert(name.to_string(), value.clone());
        }
    }
    let recompute = if config.recompute_segment_layers.is_some() {
        "1"
    } else {
        "0"
    };
    env.insert(ENVIRONMENT_RECOMPUTE.to_string(), recompute.to_string());
    if let Some(member) = member {
        let gang_variables = [
            (ENVIRONMENT_RANK, member.rank.to_string()),
            (ENVIRONMENT_WORLD_SIZE, member.world_size.to_string()),
            (ENVIRONMENT_LOCAL_RANK, member.local_rank.to_string()),
            (
                ENVIRONMENT_LOCAL_WORLD_SIZE,
                member.local_world_size.to_string(),
            ),
            (ENVIRONMENT_NODE_RANK, member.node_rank.to_string()),
            (ENVIRONMENT_MASTER_ADDR, member.master_addr.clone()),
            (ENVIRONMENT_MASTER_PORT, member.master_port.to_string()),
        ];
        for (name, value) in gang_variables {
            env.insert(name.to_string(), value);
        }
    }
    Ok(RenderedCommand {
        argv,
        env,
        working_directory: command.working_directory.clone(),
    })
}

/// What each placeholder renders to in one run.
struct PlaceholderValues {
    micro_batch: String,
    accumulation_steps: String,
    global_batch: String,
    precision: String,
    checkpoint_dir: String,
    /// `None` when the run has no step limit.
    max_steps: Option<String>,
    rank: String,
    world_size: String,
    /// `None` outside a gang.
    master_addr: Option<String>,
    master_port: Option<String>,
}

impl PlaceholderValues {
    /// `template` with its placeholders replaced; `field` names it in an error.
    fn render(&self, template: &str, field: &str) -> Result<String, FieldError> {
        let pieces = parse_template(template).map_err(|reason| FieldError::new(field, reason))?;
        let mut rendered = String::with_capacity(template.len());
        for piece in pieces {
            match piece {
                TemplatePiece::Text(text) => rendered.push_str(&text),
                TemplatePiece::Placeholder(name) => {
                    let value = match name {
                        "micro_batch" => &self.micro_batch,
                        "accumulation_steps" => &self.accumulation_steps,
                        "global_batch" => &self.global_batch,
                        "precision" => &self.precision,
                        "checkpoint_dir" => &self.checkpoint_dir,
                        "rank" => &self.rank,
                        "world_size" => &self.world_size,
                        "master_addr" | "master_port" => {
                            let value = if name == "master_addr" {
                                &self.master_addr
                            } else {
                                &self.master_port
                            };
                            value.as_ref().ok_or_else(|| {
                                FieldError::new(
                                    field,
                                    format!(
                                        "{{{name}}} has no value: this run is one process, \
                                         not a member of a gang"
                                    ),
                                )
                            })?
                        }
                        _ => self.max_steps.as_ref().ok_or_else(|| {
                            FieldError::new(
                                field,
                                "{max_steps} has no value: the run has no step limit and \
                                 command.steps is not set",
                            )
                        })?,
                    };
                    rendered.push_str(value);
                }
            }
        }
        Ok(rendered)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::validate::{ValidatedSpec, load_spec_toml};
    use crate::spec::Precision;

    const JOB: &str = r#"
name = "standin"
[command]
argv = ["python3", "train.py", "--micro-batch", "{micro_batch}",
        "--accumulation-steps", "{accumulation_steps}", "--global-batch={global_batch}",
        "--precision", "{precision}", "--checkpoint-dir", "{checkpoint_dir}",
        "--steps", "{max_steps}", "--json={{\"mb\": {micro_batch}}}"]
env = { TRAIN_NOTE = "mb {micro_batch} of {global_batch}" }
working_directory = "/srv/standin"
global_batch = 64
micro_batch = 16
steps = 100
precisions = ["fp32", "bf16"]
recompute = { argv = ["--recompute", "--segments={accumulation_steps}"] }
"#;

    fn job(text: &str) -> ValidatedCommandJob {
        match load_spec_toml(text).unwrap() {
            ValidatedSpec::Command(job) => job,
            ValidatedSpec::Model(_) => panic!("expected a command job"),
        }
    }

    #[test]
    fn renders_every_placeholder_and_the_escaped_braces() {
        let job = job(JOB);
        let rendered = render_command(&job, &job.initial_config(), "/ckpt/job-1", None).unwrap();
        assert_eq!(
            rendered.argv,
            [
                "python3",
                "train.py",
                "--micro-batch",
                "16",
                "--accumulation-steps",
                "4",
                "--global-batch=64",
                "--precision",
                "fp32",
                "--checkpoint-dir",
                "/ckpt/job-1",
                "--steps",
                "100",
                "--json={\"mb\": 16}",
            ]
        );
        assert_eq!(rendered.working_directory.as_deref(), Some("/srv/standin"));
        let expected_env: BTreeMap<String, String> = [
            ("TRAIN_NOTE", "mb 16 of 64"),
            ("CARVE_MICRO_BATCH", "16"),
            ("CARVE_ACCUMULATION_STEPS", "4"),
            ("CARVE_GLOBAL_BATCH", "64"),
            ("CARVE_PRECISION", "fp32"),
            ("CARVE_CHECKPOINT_DIR", "/ckpt/job-1"),
            ("CARVE_MAX_STEPS", "100"),
            ("CARVE_RECOMPUTE", "0"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();
        assert_eq!(rendered.env, expected_env);
    }

    const GANG_JOB: &str = r#"
name = "gang"
[command]
argv = ["python3", "dp.py", "--rank", "{rank}", "--world", "{world_size}",
        "--master={master_addr}:{master_port}", "--micro", "{micro_batch}",
        "--accumulation", "{accumulation_steps}", "--global", "{global_batch}"]
env = { RANK = "7", KEPT = "{rank} of {world_size}" }
global_batch = 64
micro_batch = 8
[resources]
vram = "1GiB"
"#;

    fn member(rank: u32) -> GangMemberPlace {
        GangMemberPlace {
            rank,
            world_size: 4,
            local_rank: rank % 2,
            local_world_size: 2,
            node_rank: rank / 2,
            master_addr: "10.0.0.5".into(),
            master_port: 29_501,
        }
    }

    #[test]
    fn a_gang_member_renders_its_rank_and_master_and_shares_the_global_batch() {
        let job = job(GANG_JOB);
        let config = job.initial_config();
        let rendered =
            render_gang_member_command(&job, &config, "/ckpt/job-1", None, &member(3)).unwrap();
        assert_eq!(
            rendered.argv[2..],
            [
                "--rank",
                "3",
                "--world",
                "4",
                "--master=10.0.0.5:29501",
                "--micro",
                "8",
                // 64 = 8 x 4 members x 2 accumulation steps.
                "--accumulation",
                "2",
                "--global",
                "64",
            ]
        );
        let expected = [
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.5"),
            ("MASTER_PORT", "29501"),
            ("KEPT", "3 of 4"),
            ("CARVE_ACCUMULATION_STEPS", "2"),
            ("CARVE_GLOBAL_BATCH", "64"),
        ];
        for (name, value) in expected {
            assert_eq!(rendered.env[name], value, "{name}");
        }
    }

    #[test]
    fn a_single_process_is_rank_0_of_1_and_has_no_master() {
        let gang = job(GANG_JOB);
        let error = render_command(&gang, &gang.initial_config(), "/ckpt", None).unwrap_err();
        assert_eq!(error.field, "command.argv[6]");
        assert!(
            error.reason.contains("{master_addr} has no value"),
            "{error}"
        );
        let without_master = GANG_JOB.replace("\"--master={master_addr}:{master_port}\", ", "");
        let single = job(&without_master);
        let rendered = render_command(&single, &single.initial_config(), "/ckpt", None).unwrap();
        assert_eq!(rendered.argv[3], "0");
        assert_eq!(rendered.argv[5], "1");
        assert_eq!(rendered.env["RANK"], "7", "the job's own env, untouched");
        assert!(!rendered.env.contains_key("MASTER_PORT"));
    }

    #[test]
    fn a_gang_whose_members_cannot_split_the_global_batch_is_refused_by_field() {
        let job = job(GANG_JOB);
        let config = RunConfig {
            micro_batch_size: 32,
            ..job.initial_config()
        };
        // 32 x 4 members is more than the global batch of 64.
        let error =
            render_gang_member_command(&job, &config, "/ckpt", None, &member(0)).unwrap_err();
        assert_eq!(error.field, "command.global_batch");
        assert!(error.reason.contains("4 gang members"), "{error}");
    }

    #[test]
    fn a_profile_run_renders_its_own_step_count() {
        let job = job(JOB);
        let rendered = render_command(&job, &job.initial_config(), "/scratch", Some(2)).unwrap();
        assert_eq!(rendered.argv[12], "2");
        assert_eq!(rendered.env["CARVE_MAX_STEPS"], "2");
    }

    #[test]
    fn recomputation_appends_its_arguments_and_a_shrunk_config_renders_again() {
        let job = job(JOB);
        let config = RunConfig {
            micro_batch_size: 4,
            precision: Precision::Bf16,
            recompute_segment_layers: Some(1),
            ..job.initial_config()
        };
        let rendered = render_command(&job, &config, "/ckpt", None).unwrap();
        assert_eq!(rendered.argv[3], "4");
        assert_eq!(rendered.argv[5], "16");
        assert_eq!(rendered.argv[8], "bf16");
        assert_eq!(
            rendered.argv[rendered.argv.len() - 2..],
            ["--recompute", "--segments=16"]
        );
        assert_eq!(rendered.env["CARVE_RECOMPUTE"], "1");
        assert_eq!(rendered.env["CARVE_PRECISION"], "bf16");
    }

    #[test]
    fn without_steps_there_is_no_step_limit_outside_the_profile() {
        let text = JOB
            .replace("steps = 100\n", "")
            .replace(r#""--steps", "{max_steps}", "#, "")
            .replace("[command]", "[resources]\nvram = \"4GiB\"\n[command]");
        let job = job(&text);
        let rendered = render_command(&job, &job.initial_config(), "/ckpt", None).unwrap();
        assert!(!rendered.env.contains_key("CARVE_MAX_STEPS"));
        let profile = render_command(&job, &job.initial_config(), "/ckpt", Some(3)).unwrap();
        assert_eq!(profile.env["CARVE_MAX_STEPS"], "3");
    }

    #[test]
    fn a_config_the_job_does_not_allow_is_refused() {
        let job = job(JOB);
        let fp16 = RunConfig {
            precision: Precision::Fp16,
            ..job.initial_config()
        };
        let error = render_command(&job, &fp16, "/ckpt", None).unwrap_err();
        assert_eq!(error.field, "command.precisions");
        let uneven = RunConfig {
            micro_batch_size: 24,
            ..job.initial_config()
        };
        let error = render_command(&job, &uneven, "/ckpt", None).unwrap_err();
        assert_eq!(error.field, "command.global_batch");
    }

    #[test]
    fn the_tokenizer_reads_text_placeholders_and_escapes() {
        assert_eq!(
            parse_template("a{micro_batch}b{{c}}").unwrap(),
            [
                TemplatePiece::Text("a".to_string()),
                TemplatePiece::Placeholder("micro_batch"),
                TemplatePiece::Text("b{c}".to_string()),
            ]
        );
        assert_eq!(parse_template("").unwrap(), []);
        assert_eq!(
            parse_template("{precision}{max_steps}").unwrap(),
            [
                TemplatePiece::Placeholder("precision"),
                TemplatePiece::Placeholder("max_steps"),
            ]
        );
        assert!(
            parse_template("{}")
                .unwrap_err()
                .contains("unknown placeholder `{}`")
        );
        assert!(
            parse_template("x{micro_batch")
                .unwrap_err()
                .contains("the `{` at character 2 is not closed")
        );
        assert!(
            parse_template("é{a{micro_batch}")
                .unwrap_err()
                .contains("character 2 is not closed")
        );
        assert!(
            parse_template("ab}")
                .unwrap_err()
                .contains("character 3 closes nothing")
        );
        assert_eq!(
            parse_template("{{{micro_batch}}}").unwrap(),
            [
                TemplatePiece::Text("{".to_string()),
                TemplatePiece::Placeholder("micro_batch"),
                TemplatePiece::Text("}".to_string()),
            ]
        );
    }

    #[test]
    fn display_line_quotes_what_a_shell_would_split() {
        let rendered = RenderedCommand {
            argv: [
                "python3",
                "train.py",
                "--note",
                "two words",
                "it's",
                "",
                "--lr=0.1",
                "$HOME",
            ]
            .map(String::from)
            .to_vec(),
            env: BTreeMap::new(),
            working_directory: None,
        };
        assert_eq!(
            rendered.display_line(),
            r#"python3 train.py --note 'two words' 'it'\''s' '' --lr=0.1 '$HOME'"#
        );
    }
}
