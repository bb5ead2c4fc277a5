//! Where the workspace and its build outputs are, and how steps are run and echoed.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use serde::Deserialize;

use crate::error::{Error, Result};

/// The workspace xtask belongs to.
#[derive(Clone, Debug)]
pub struct Workspace {
    /// The directory holding the root `Cargo.toml`.
    pub root: PathBuf,
    /// Cargo's target directory as cargo itself resolves it (`CARGO_TARGET_DIR`, config, or
    /// `<root>/target`); criterion writes under it.
    pub target_dir: PathBuf,
}

impl Workspace {
    /// Find the workspace (xtask's parent directory) and ask cargo for its target directory.
    pub fn locate() -> Result<Workspace> {
        let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let root = manifest_dir
            .parent()
            .ok_or_else(|| Error::Cargo("xtask has no parent directory".into()))?
            .to_path_buf();

        #[derive(Deserialize)]
        struct Metadata {
            target_directory: PathBuf,
        }
        let output = cargo()
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .current_dir(&root)
            .output()
            .map_err(|source| Error::Spawn {
                program: "cargo metadata".into(),
                source,
            })?;
        if !output.status.success() {
            return Err(Error::StepFailed {
                step: "cargo metadata".into(),
                status: describe_status(output.status),
            });
        }
        let metadata: Metadata =
            serde_json::from_slice(&output.stdout).map_err(|source| Error::Json {
                what: "cargo metadata output".into(),
                source,
            })?;
        Ok(Workspace {
            root,
            target_dir: metadata.target_directory,
        })
    }

    /// `<root>/target/<name>`: fixed outputs (bench results, the device bundle) live in the
    /// workspace's own `target/` even when builds go to another `CARGO_TARGET_DIR`, so they
    /// are always found at the path the docs name.
    pub fn output_dir(&self, name: &str) -> PathBuf {
        self.root.join("target").join(name)
    }
}

/// A `cargo` command: the cargo that runs xtask (`$CARGO`) when there is one.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// The command line as a reader would type it (program name without its directory).
pub fn display_command(cmd: &Command) -> String {
    let program = Path::new(cmd.get_program())
        .file_name()
        .unwrap_or_else(|| cmd.get_program());
    std::iter::once(program)
        .chain(cmd.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Print `==> <command>`, run it with inherited output, and fail unless it exits with 0.
pub fn run_step(cmd: &mut Command) -> Result<()> {
    let line = display_command(cmd);
    println!("==> {line}");
    let status = cmd.status().map_err(|source| Error::Spawn {
        program: line.clone(),
        source,
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::StepFailed {
            step: line,
            status: describe_status(status),
        })
    }
}

/// "exit code 3" or "killed by a signal".
pub fn describe_status(status: ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exit code {code}"),
        None => "killed by a signal".into(),
    }
}

/// Create a directory and its parents.
pub fn create_dir_all(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path).map_err(Error::io("creating", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_command_drops_the_program_directory() {
        let mut cmd = Command::new("/usr/bin/cargo");
        cmd.args(["fmt", "--all", "--", "--check"]);
        assert_eq!(display_command(&cmd), "cargo fmt --all -- --check");
    }

    #[test]
    fn run_step_reports_the_failing_command() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "exit 7"]);
        match run_step(&mut cmd) {
            Err(Error::StepFailed { step, status }) => {
                assert_eq!(step, "sh -c exit 7");
                assert_eq!(status, "exit code 7");
            }
            other => panic!("expected StepFailed, got {other:?}"),
        }
        assert!(run_step(Command::new("true").arg("ignored")).is_ok());
    }

    #[test]
    fn missing_program_is_a_spawn_error() {
        let r = run_step(&mut Command::new("/nonexistent/headroom-no-such-program"));
        assert!(matches!(r, Err(Error::Spawn { .. })), "{r:?}");
    }
}
