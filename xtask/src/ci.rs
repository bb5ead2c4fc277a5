//! `cargo xtask ci`: the checks a change must pass, in the order that fails fastest.

use crate::error::Result;
use crate::workspace::{cargo, run_step, Workspace};

/// The steps, as cargo argument lists. The last one is the README's test command.
pub const STEPS: [&[&str]; 3] = [
    &["fmt", "--all", "--", "--check"],
    &[
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ],
    &["test", "--workspace", "--all-features"],
];

/// Run every step from the workspace root; stop at the first failure.
pub fn run(ws: &Workspace) -> Result<()> {
    for (i, args) in STEPS.iter().enumerate() {
        println!("[ci {}/{}]", i + 1, STEPS.len());
        run_step(cargo().args(*args).current_dir(&ws.root))?;
    }
    println!("ci: all {} steps passed", STEPS.len());
    Ok(())
}
