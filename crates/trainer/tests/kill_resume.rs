//! Crash consistency of checkpoints, tested the hard way: the `headroom` command, saving every
//! step, is killed with SIGKILL at a random moment and then resumed; the resumed run must end
//! in exactly the state of an uninterrupted run (every byte of the final checkpoint), or be
//! refused with a typed error. A resume that finishes with a different state is a silent
//! mismatch, the one outcome that must never happen.
//!
//! `cargo test -p headroom-trainer --test integration -- kill_resume::` runs a few kills (CI); the campaign for
//! the results file sets `HEADROOM_KILLS` (e.g. 120), `HEADROOM_KILL_SEED` and `HEADROOM_BIN`,
//! and runs the test with `--nocapture` to see the summary.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: &str = "24";

fn headroom() -> Command {
    common::headroom_command()
}

fn train_args(dir: &Path) -> Vec<String> {
    [
        "train",
        "--steps",
        STEPS,
        "--batch",
        "8",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--no-progress",
        "--checkpoint-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([dir.display().to_string()])
    .collect()
}

/// Every file of the final checkpoint, by name.
fn final_state(root: &Path) -> Vec<(String, Vec<u8>)> {
    let dir = root.join(format!("step-{:08}", STEPS.parse::<usize>().unwrap()));
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[derive(Debug, Default)]
struct Tally {
    /// Killed before the first checkpoint was published; restarted from scratch.
    no_checkpoint_yet: usize,
    /// Resumed and ended bit-identical to the uninterrupted run.
    exact: usize,
    /// The resume was refused with a typed error.
    refused: usize,
    /// Resumed and ended in another state.
    silent_mismatch: usize,
    /// The run finished before the kill arrived.
    finished_before_kill: usize,
}

/// splitmix64: a reproducible kill schedule without a dependency.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[test]
fn killed_runs_resume_exactly_or_are_refused() {
    let kills: usize = std::env::var("HEADROOM_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let mut rng: u64 = std::env::var("HEADROOM_KILL_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20261123);
    let work = tempfile::tempdir().unwrap();

    // The uninterrupted reference, timed: kills land anywhere in a run of that length.
    let reference = work.path().join("reference");
    let t0 = Instant::now();
    let st = headroom()
        .args(train_args(&reference))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "reference run failed");
    let run_time = t0.elapsed();
    let want = final_state(&reference);

    let mut tally = Tally::default();
    for k in 0..kills {
        let dir: PathBuf = work.path().join(format!("kill-{k}"));
        let mut child = headroom()
            .args(train_args(&dir))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let at = Duration::from_nanos(next(&mut rng) % (run_time.as_nanos() as u64).max(1));
        std::thread::sleep(at);
        let finished = child.try_wait().unwrap().is_some();
        let _ = child.kill(); // SIGKILL
        let _ = child.wait();
        if finished {
            tally.finished_before_kill += 1;
        }
        let has_checkpoint = std::fs::read_dir(&dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .any(|e| e.file_name().to_string_lossy().starts_with("step-"))
            })
            .unwrap_or(false);
        let mut args = train_args(&dir);
        if has_checkpoint {
            args.extend(["--resume".to_string(), dir.display().to_string()]);
        } else {
            tally.no_checkpoint_yet += 1;
        }
        let out = headroom().args(&args).output().unwrap();
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("error: checkpoint") || err.contains("cannot resume"),
                "kill {k} at {at:?}: the resume failed without a checkpoint error:\n{err}"
            );
            tally.refused += 1;
            continue;
        }
        if final_state(&dir) == want {
            if has_checkpoint {
                tally.exact += 1;
            }
        } else {
            tally.silent_mismatch += 1;
            eprintln!("kill {k} at {at:?}: resumed to a different final state");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    eprintln!(
        "kill test: {kills} kills over a {run_time:?} run of {STEPS} steps, a checkpoint every \
         step: {tally:?}"
    );
    assert_eq!(tally.silent_mismatch, 0, "{tally:?}");
}
