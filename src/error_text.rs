//! An error and its causes as one line of text, for logs and the messages
//! gpumem shows people.

use std::error::Error;

/// `err` and each of its sources, joined by `: `, each said once. gpumem's
/// errors put their cause in their own message, so they read whole wherever
/// they are shown; anyhow's `{:#}` would then print the cause a second
/// time. Other libraries' errors (kube's, hyper's) often say only their top
/// level ("client error (Connect)"): the sources say why.
pub fn one_line(err: &(dyn Error + 'static)) -> String {
    let mut line = String::new();
    let mut outer = String::new();
    for cause in std::iter::successors(Some(err), |&e| e.source()) {
        let text = cause.to_string();
        if !outer.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        outer = text;
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Terse(#[source] std::io::Error);

    #[test]
    fn each_cause_is_said_once() {
        let refused = || std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(one_line(&Repeats(refused())), "outer: refused");
        assert_eq!(
            one_line(&Terse(refused())),
            "client error (Connect): refused"
        );
    }
}
