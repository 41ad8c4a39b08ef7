//! Errors as one line for people: each cause once.

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

#[cfg(test)]
mod tests {
    use super::*;
    use ckpt_engine::EngineError;

    #[test]
    fn a_source_the_message_already_holds_is_said_once() {
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        let e = anyhow::Error::from(EngineError::io("tokens.bin", missing)).context("s.yaml");
        assert_eq!(one_line(&e), "s.yaml: tokens.bin: entity not found");
    }
}
