//! headroom's developer tasks, run as `cargo xtask <task>` (an alias in `.cargo/config.toml`).
//!
//! ```text
//! cargo xtask ci                                  fmt check, clippy -D warnings, the test suite
//! cargo xtask bench [--quick] [--only NAME] [-- CRITERION_ARGS...]
//!                                                 criterion benches + benches/torch/*.py
//!                                                 → target/headroom-bench/{results.json,report.md}
//! cargo xtask bench-report OUT [--to DIR]        the same report from a device run's $OUT
//! cargo xtask device-bundle                       stripped release test + bench binaries (cuda
//!                                                 feature on) → target/device-bundle/ + run.sh
//! ```
//!
//! ## Invariants
//! - xtask depends on no headroom crate, so it builds (and can report) even while a crate is
//!   broken; its `Record` mirrors `headroom_benches::Record` field for field.
//! - Every step prints what it runs; the first failing step stops the task with a non-zero exit.
//! - Bench results only come from files written during the current run: stale criterion output
//!   from earlier runs is never reported.

mod bench;
mod ci;
mod criterion_results;
mod device_bundle;
mod error;
mod records;
mod report;
mod torch_scripts;
mod workspace;

use std::process::ExitCode;

use error::{Error, Result};

const USAGE: &str = "\
usage: cargo xtask <task>

tasks:
  ci                      cargo fmt --check, clippy -D warnings (all targets, all features),
                          cargo test --workspace --all-features
  bench [--quick] [--only NAME] [-- CRITERION_ARGS...]
                          run the criterion benches of headroom-benches (only bench target NAME
                          with --only) and the comparison scripts benches/torch/*.py (only
                          NAME.py and NAME_*.py with --only); write results.json and report.md
                          under $HEADROOM_BENCH_DIR (default target/headroom-bench)
  bench-report OUT [--to DIR]
                          results.json and report.md from what the device bundle's
                          `run.sh bench` wrote under $OUT (default DIR:
                          target/headroom-bench-device)
  device-bundle           build the release test and bench binaries with every feature (CUDA
                          included), stripped, into target/device-bundle/ with a run.sh
  help                    this text
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Error::Usage(msg)) => {
            eprintln!("xtask: {msg}\n\n{USAGE}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("xtask: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<()> {
    let Some((task, rest)) = args.split_first() else {
        return Err(Error::Usage("no task given".into()));
    };
    match task.as_str() {
        "ci" => {
            expect_no_args("ci", rest)?;
            ci::run(&workspace::Workspace::locate()?)
        }
        "bench" => {
            let options = bench::Options::parse(rest)?;
            bench::run(&workspace::Workspace::locate()?, &options)
        }
        "bench-report" => bench::report_from_device(&workspace::Workspace::locate()?, rest),
        "device-bundle" => {
            expect_no_args("device-bundle", rest)?;
            device_bundle::run(&workspace::Workspace::locate()?)
        }
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => Err(Error::Usage(format!("unknown task `{other}`"))),
    }
}

fn expect_no_args(task: &str, rest: &[String]) -> Result<()> {
    match rest.first() {
        None => Ok(()),
        Some(arg) => Err(Error::Usage(format!(
            "`{task}` takes no argument, got `{arg}`"
        ))),
    }
}
