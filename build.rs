//! The commit gpumem is built from, for `--version`, the start-up log,
//! `/status` and `gpumem_build_info`: git's when built from a checkout,
//! else $GPUMEM_COMMIT (image builds: .dockerignore leaves .git out), else
//! "unknown". Never fails the build.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=GPUMEM_COMMIT");
    let commit = from_git()
        .or_else(|| std::env::var("GPUMEM_COMMIT").ok().and_then(|c| clean(&c)))
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=GPUMEM_BUILD_COMMIT={commit}");
}

fn dir() -> PathBuf {
    PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| ".".into()))
}

/// git's answer, trimmed; `None` without git, outside a checkout, or on failure.
fn git(args: &[&str]) -> Option<String> {
    // No optional locks: `status` would otherwise refresh the index, which
    // is watched below, and rerun this script at every build.
    let out = Command::new("git")
        .arg("--no-optional-locks")
        .args(args)
        .current_dir(dir())
        .output()
        .ok()?;
    out.status.success().then_some(())?;
    Some(String::from_utf8(out.stdout).ok()?.trim().to_owned())
}

/// `1a2b3c4d5e6f`, with `-dirty` where tracked files differ from it.
fn from_git() -> Option<String> {
    let hash = clean(&git(&["rev-parse", "--short=12", "HEAD"])?)?;
    // Rerun when HEAD moves (a commit, a checkout) or the index changes
    // (staged edits, which make the tree dirty). Only files that exist:
    // cargo reruns at every build for one that does not. `--git-path`
    // resolves them in a worktree too.
    let branch = git(&["symbolic-ref", "-q", "HEAD"]);
    for name in ["HEAD", "index", "packed-refs"]
        .into_iter()
        .chain(branch.as_deref())
    {
        if let Some(path) = git(&["rev-parse", "--git-path", name]) {
            let path = dir().join(Path::new(&path));
            if path.is_file() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|changes| !changes.is_empty());
    Some(if dirty { format!("{hash}-dirty") } else { hash })
}

/// A commit as a label value may carry it: hex digits and the like, at
/// most 40 characters; `None` if nothing is left.
fn clean(commit: &str) -> Option<String> {
    let kept: String = commit
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
        .take(40)
        .collect();
    (!kept.is_empty()).then_some(kept)
}
