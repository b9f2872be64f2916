//! An error and its causes as one line of text, for logs and the messages
//! gpumem shows people.

use std::error::Error;
use std::fmt;

/// Shows an error and each of its sources, joined by `: `: gpumem's errors
/// say only their own level and leave the cause to `source()`, so wherever
/// one is shown to people (logs, stderr, gRPC statuses, HTTP bodies,
/// Events) it goes through this, or the cause is lost.
///
/// A cause whose text its outer error already holds is skipped: kube's
/// errors (`#[error("HyperError: {0}")]` over `#[source]`) print their
/// source inside their own message and return it from `source()` too.
/// hyper's say only their top level ("client error (Connect)"): their
/// sources complete them.
#[derive(Clone, Copy)]
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut outer = self.0.to_string();
        f.write_str(&outer)?;
        for cause in std::iter::successors(self.0.source(), |&e| e.source()) {
            let text = cause.to_string();
            if !outer.contains(&text) {
                write!(f, ": {text}")?;
            }
            outer = text;
        }
        Ok(())
    }
}

/// `err` with its causes, for `%chain(&err)` in a log field or `{}` in a
/// message.
pub fn chain<'a>(err: &'a (dyn Error + 'static)) -> Chain<'a> {
    Chain(err)
}

/// [`Chain`] as a `String`, where a message is kept or sent on.
pub fn one_line(err: &(dyn Error + 'static)) -> String {
    Chain(err).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kube's shape: the cause inside the message, and from `source()`.
    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Repeats(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("client error (Connect)")]
    struct Terse(#[source] std::io::Error);

    fn refused() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused")
    }

    #[test]
    fn each_cause_is_said_once() {
        assert_eq!(one_line(&Repeats(refused())), "outer: refused");
        assert_eq!(
            one_line(&Terse(refused())),
            "client error (Connect): refused"
        );
        assert_eq!(
            chain(&Terse(refused())).to_string(),
            "client error (Connect): refused"
        );
    }

    #[test]
    fn kube_errors_that_repeat_their_source_say_it_once() {
        let err = kube::Error::ReadEvents(refused());
        assert_eq!(err.to_string(), "Error reading events stream: refused");
        assert_eq!(one_line(&err), "Error reading events stream: refused");
    }

    #[test]
    fn gpumem_errors_say_their_level_and_chain_their_cause() {
        use crate::isolation::cdi::CdiError;
        let err = CdiError::Write {
            path: "/var/run/cdi/gpumem.json".into(),
            source: std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied"),
        };
        assert!(!err.to_string().contains("denied"), "{err}");
        assert_eq!(
            one_line(&err),
            "cannot write the CDI spec /var/run/cdi/gpumem.json (--cdi-spec-dir): denied"
        );

        // Two gpumem levels above a system error: each said once, in order.
        use crate::isolation::install::ShimError;
        use crate::ops::exec::ExecError;
        let err = ExecError::NotShim {
            flag: "--shim",
            error: ShimError::Read {
                path: "/opt/libgpumem_shim.so".into(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "absent"),
            },
        };
        assert_eq!(err.to_string(), "--shim");
        assert_eq!(
            format!("{}", chain(&err)),
            "--shim: cannot read the shim /opt/libgpumem_shim.so: absent"
        );
    }
}
