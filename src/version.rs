//! What build this is: the package version and the commit it was built
//! from (build.rs), for `--version`, the start-up log, /status and metrics.

/// The package version, `0.1.0`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The commit, 12 hex digits (`-dirty` when built from a changed tree), or
/// `unknown` when neither git nor $GPUMEM_COMMIT said.
pub const COMMIT: &str = env!("GPUMEM_BUILD_COMMIT");

/// `0.1.0 (commit 1a2b3c4d5e6f)`, as `gpumem --version` prints it.
pub const LONG: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("GPUMEM_BUILD_COMMIT"),
    ")"
);

/// The first thing a daemon says, so its logs say what build wrote them.
pub fn log_start() {
    tracing::info!(version = VERSION, commit = COMMIT, "gpumem {LONG}");
}
