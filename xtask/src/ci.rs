//! `cargo xtask ci`: the checks a change must pass, in the order that fails fastest.

use crate::error::Result;
use crate::workspace::{cargo, run_step, Workspace};

/// The steps, as cargo argument lists. The last one is the README's test command.
pub const STEPS: [&[&str]; 4] = [
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
    // Run with RUSTDOCFLAGS=-D warnings (see `run`): broken intra-doc links are errors.
    &["doc", "--workspace", "--no-deps", "--all-features"],
    &["test", "--workspace", "--all-features"],
];

/// Run every step from the workspace root; stop at the first failure.
pub fn run(ws: &Workspace) -> Result<()> {
    for (i, args) in STEPS.iter().enumerate() {
        println!("[ci {}/{}]", i + 1, STEPS.len());
        let mut cmd = cargo();
        cmd.args(*args).current_dir(&ws.root);
        if args.first() == Some(&"doc") {
            // Only for this step: in `cargo test` the same flags would also apply to doctests.
            cmd.env("RUSTDOCFLAGS", "-D warnings");
        }
        run_step(&mut cmd)?;
    }
    println!("ci: all {} steps passed", STEPS.len());
    Ok(())
}
