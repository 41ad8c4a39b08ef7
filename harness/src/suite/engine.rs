//! `engine: {command, resume, env, timeout_seconds}`: another trainer, run as a command for each
//! phase instead of the built-in engine, writing a `ckpt-record/1` record that the checks judge.
//! The command is split into words as a POSIX shell would (quotes and backslashes; no
//! expansions, pipes or redirections: write `sh -c '...'` for those), then each word's
//! `{placeholders}` are filled per phase, so a value with spaces stays one word.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Every placeholder a command may hold, and what it becomes.
pub const PLACEHOLDERS: [(&str, &str); 10] = [
    (
        "phase",
        "the phase: reference, resume-mid, resume-mid-N, resume-end",
    ),
    (
        "record",
        "the file the phase appends its record lines to (also $CKPT_RECORD)",
    ),
    (
        "run_dir",
        "the phase's own directory, where it saves its checkpoints",
    ),
    ("device", "the device the trial names: cpu or cuda"),
    (
        "total_steps",
        "the step the phase stops before: max_steps + extra_steps",
    ),
    (
        "horizon",
        "the schedule's horizon, max_steps, the same in every phase",
    ),
    (
        "save_steps",
        "the steps after which the phase saves, comma-separated (may be empty)",
    ),
    (
        "resume_step",
        "the step of the checkpoint the phase resumes from (0 in the reference)",
    ),
    (
        "resume_dir",
        "the run_dir of the phase that saved that checkpoint (empty in the reference)",
    ),
    (
        "resume_arg",
        "`resume` filled in, in a resumed phase; nothing in the reference",
    ),
];

/// Another trainer to judge: the command each phase runs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CommandEngine {
    /// The command, split into words as a shell would, with placeholders ([`PLACEHOLDERS`]).
    pub command: String,
    /// What `{resume_arg}` becomes in a resumed phase.
    #[serde(default = "default_resume")]
    pub resume: String,
    /// Environment variables set for the command, beside `CKPT_RECORD`, `CKPT_PHASE` and
    /// `CKPT_RUN_DIR`.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How long one phase may run before it is stopped and the trial fails.
    #[serde(default = "default_timeout")]
    pub timeout_seconds: u64,
}

fn default_resume() -> String {
    "--resume {resume_dir} --resume-step {resume_step}".into()
}

fn default_timeout() -> u64 {
    3600
}

/// The words of `text` as a shell splits them; none where its quotes do not balance
/// ([`CommandEngine::problem`] refuses such a text at validation).
fn split(text: &str) -> Vec<String> {
    shlex::split(text).unwrap_or_default()
}

/// `template` with each `{name}` replaced by `values[name]`; `Err` names the first placeholder
/// `values` lacks.
pub fn fill(template: &str, values: &BTreeMap<&str, String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            return Err(format!("an unclosed `{{` in {template:?}"));
        };
        let name = &after[..close];
        let value = values
            .get(name)
            .ok_or_else(|| format!("unknown placeholder {{{name}}}"))?;
        out.push_str(value);
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

impl CommandEngine {
    /// Why the command cannot run whatever the phase: empty, a zero timeout, or a placeholder
    /// that is not one of [`PLACEHOLDERS`] (in `command` or `resume`); `None` when it can.
    pub fn problem(&self) -> Option<String> {
        for (key, text) in [("command", &self.command), ("resume", &self.resume)] {
            if shlex::split(text).is_none() {
                return Some(format!(
                    "engine.{key}: unbalanced quotes or a trailing backslash in {text:?}"
                ));
            }
        }
        if split(&self.command).is_empty() {
            return Some("engine.command is empty: name the program to run".into());
        }
        if self.timeout_seconds == 0 {
            return Some("engine.timeout_seconds is 0: give each phase at least a second".into());
        }
        let any: BTreeMap<&str, String> = PLACEHOLDERS
            .iter()
            .map(|(name, _)| (*name, String::new()))
            .collect();
        for (key, text) in [("command", &self.command), ("resume", &self.resume)] {
            if let Err(e) = fill(text, &any) {
                let known: Vec<String> = PLACEHOLDERS
                    .iter()
                    .map(|(n, _)| format!("{{{n}}}"))
                    .collect();
                return Some(format!(
                    "engine.{key}: {e}; the placeholders are {}",
                    known.join(", ")
                ));
            }
        }
        None
    }

    /// The program and its arguments for one phase: the command's words with `values` filled
    /// in, `{resume_arg}` alone as a word giving the `resume` words (none in the reference);
    /// words left empty are dropped.
    pub fn words(
        &self,
        values: &BTreeMap<&str, String>,
        resumed: bool,
    ) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        for word in split(&self.command) {
            if word == "{resume_arg}" {
                if resumed {
                    for w in split(&self.resume) {
                        out.push(fill(&w, values)?);
                    }
                }
                continue;
            }
            out.push(fill(&word, values)?);
        }
        out.retain(|w| !w.is_empty());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(command: &str) -> CommandEngine {
        CommandEngine {
            command: command.into(),
            resume: default_resume(),
            env: BTreeMap::new(),
            timeout_seconds: 10,
        }
    }

    fn values() -> BTreeMap<&'static str, String> {
        BTreeMap::from([
            ("total_steps", "8".to_string()),
            ("resume_dir", "/w/run-reference".to_string()),
            ("resume_step", "3".to_string()),
            ("save_steps", String::new()),
        ])
    }

    #[test]
    fn a_phase_s_words_have_its_values_and_the_resume_only_when_resumed() {
        let e = engine("python 'train.py' --steps {total_steps} {resume_arg} --save={save_steps}");
        assert_eq!(
            e.words(&values(), false).unwrap(),
            ["python", "train.py", "--steps", "8", "--save="]
        );
        assert_eq!(
            e.words(&values(), true).unwrap(),
            [
                "python",
                "train.py",
                "--steps",
                "8",
                "--resume",
                "/w/run-reference",
                "--resume-step",
                "3",
                "--save="
            ]
        );
    }

    #[test]
    fn unknown_placeholders_empty_commands_and_zero_timeouts_are_problems() {
        assert_eq!(engine("train {total_steps} {record}").problem(), None);
        let p = engine("train {steps}").problem().unwrap();
        assert!(
            p.starts_with("engine.command: unknown placeholder {steps}; the placeholders are {phase}, {record}"),
            "{p}"
        );
        let mut e = engine("train");
        e.resume = "--from {checkpoint".into();
        assert!(e
            .problem()
            .unwrap()
            .starts_with("engine.resume: an unclosed `{`"));
        assert!(engine("  ").problem().unwrap().contains("is empty"));
        let p = engine("sh -c 'echo").problem().unwrap();
        assert!(p.starts_with("engine.command: unbalanced quotes"), "{p}");
        let mut with_record = values();
        with_record.insert("record", "/r/a b.jsonl".into());
        assert_eq!(
            engine("sh -c 'cat \"{record}\"' {record}").words(&with_record, false),
            Ok(vec![
                "sh".into(),
                "-c".into(),
                "cat \"/r/a b.jsonl\"".into(),
                "/r/a b.jsonl".into()
            ])
        );
        let mut e = engine("train");
        e.timeout_seconds = 0;
        assert!(e.problem().unwrap().contains("timeout_seconds is 0"));
    }
}
