//! Errors as one line for people, each cause once; and text read from files made safe to print
//! on a terminal.

/// `e` and its causes as `what: why: why`, leaving out a cause whose text ends the line already
/// (an engine error such as `file: No such file or directory` prints its source itself).
pub fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// `text` with every control character but the line feed and the tab written as an escape
/// (`\u{1b}`), so that text read from a file (a verdict, a trial's name) cannot clear the
/// screen, retitle the terminal or hide what follows it.
pub fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_engine::EngineError;

    #[test]
    fn control_characters_are_printed_as_escapes() {
        assert_eq!(
            printable("a\u{1b}[2J\u{1b}]0;T\u{7}b\u{9b}c\n\td é"),
            "a\\u{1b}[2J\\u{1b}]0;T\\u{7}b\\u{9b}c\n\td é"
        );
    }

    #[test]
    fn a_source_the_message_already_holds_is_said_once() {
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = anyhow::Error::from(EngineError::io("tokens.bin", missing)).context("s.yaml");
        assert_eq!(one_line(&e), "s.yaml: tokens.bin: entity not found");
    }
}
