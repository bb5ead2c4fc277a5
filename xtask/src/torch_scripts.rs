//! Running the comparison scripts in `benches/torch/*.py` (protocol: `benches/torch/README.md`).
//!
//! Each script runs with `$HEADROOM_PYTHON` (else `python3`), `HEADROOM_BENCH_DIR` set, and
//! `--quick` on quick runs. Every stdout line that parses as a record is one; other lines are
//! echoed as log. Exit code 3 means "cannot run here" (no torch, no numpy): the reason on stderr
//! is printed as `skipped <script>: <reason>` and the run goes on. Any other failure stops it.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::error::{Error, Result};
use crate::records::Record;
use crate::workspace::describe_status;

/// The exit code by which a script says it cannot run on this machine.
pub const EXIT_CANNOT_RUN: i32 = 3;

/// What became of one script.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// It ran; these are its records.
    Ran(Vec<Record>),
    /// It could not run here, for this reason.
    Skipped(String),
}

/// The scripts to run, sorted: every `*.py` in `dir`, or with `only` those named `<only>.py`
/// or `<only>_*.py`.
pub fn find_scripts(dir: &Path, only: Option<&str>) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("listing", dir)(e)),
    };
    let mut scripts = Vec::new();
    for entry in entries {
        let path = entry.map_err(Error::io("listing", dir))?.path();
        if path.extension().is_none_or(|e| e != "py") {
            continue;
        }
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let selected = match only {
            None => true,
            Some(name) => {
                stem == name || stem.strip_prefix(name).is_some_and(|r| r.starts_with('_'))
            }
        };
        if selected {
            scripts.push(path);
        }
    }
    scripts.sort();
    Ok(scripts)
}

/// The Python to run scripts with.
pub fn python() -> PathBuf {
    std::env::var_os("HEADROOM_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| "python3".into())
}

/// A stdout line as a record, or `None` for a log line. A line that looks like JSON but is not
/// a record is logged with a warning rather than silently dropped.
fn parse_line(script: &str, line: &str) -> Option<Record> {
    let trimmed = line.trim();
    if !trimmed.starts_with('{') {
        println!("  [{script}] {line}");
        return None;
    }
    match serde_json::from_str(trimmed) {
        Ok(record) => Some(record),
        Err(e) => {
            println!("  [{script}] {line}");
            println!("  [{script}] warning: JSON line is not a record ({e}); ignored");
            None
        }
    }
}

/// Run one script with `python`.
pub fn run_script(python: &Path, script: &Path, bench_dir: &Path, quick: bool) -> Result<Outcome> {
    let name = script
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .env("HEADROOM_BENCH_DIR", bench_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if quick {
        cmd.arg("--quick");
    }
    println!(
        "==> {} {}{}",
        python.display(),
        script.display(),
        if quick { " --quick" } else { "" }
    );
    let mut child = match cmd.spawn() {
        Ok(child) => child,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Outcome::Skipped(format!("{} not found", python.display())))
        }
        Err(source) => {
            return Err(Error::Spawn {
                program: python.display().to_string(),
                source,
            })
        }
    };
    // stderr is drained on its own thread so a chatty script cannot block on a full pipe
    // while stdout is read here.
    let stderr = child.stderr.take();
    let stderr_reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut s) = stderr {
            // Partial stderr is still worth showing; a read error only truncates it.
            let _ = s.read_to_string(&mut text);
        }
        text
    });
    let mut records = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        for line in BufReader::new(stdout).lines() {
            let line = line.map_err(Error::io("reading the output of", script))?;
            records.extend(parse_line(&name, &line));
        }
    }
    let status = child.wait().map_err(Error::io("waiting for", script))?;
    let stderr = stderr_reader.join().unwrap_or_default();
    if status.code() == Some(EXIT_CANNOT_RUN) {
        let reason = stderr.trim();
        let reason = if reason.is_empty() {
            "no reason given"
        } else {
            reason
        };
        return Ok(Outcome::Skipped(reason.to_string()));
    }
    for line in stderr.lines() {
        eprintln!("  [{name}] {line}");
    }
    if !status.success() {
        return Err(Error::StepFailed {
            step: format!("{} {}", python.display(), script.display()),
            status: describe_status(status),
        });
    }
    Ok(Outcome::Ran(records))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tests drive the runner with `sh` standing in for Python, so they need no Python.
    fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    }

    #[test]
    fn records_are_collected_and_log_lines_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let s = script(
            dir.path(),
            "ok.py",
            r#"echo "warming up"
echo '{"bench":"attn/fwd/torch/1k","metric":"median_time","value":2.5,"unit":"ns","baseline":null,"baseline_value":null,"ratio":null,"better":"lower"}'
echo '{"not":"a record"}'
[ "$1" = "--quick" ] && [ -n "$HEADROOM_BENCH_DIR" ] && echo '{"bench":"q","metric":"m","value":1,"unit":"u","better":"higher"}'
exit 0
"#,
        );
        let out = run_script(Path::new("sh"), &s, dir.path(), true).unwrap();
        let Outcome::Ran(records) = out else {
            panic!("{out:?}")
        };
        let names: Vec<_> = records.iter().map(|r| r.bench.as_str()).collect();
        assert_eq!(
            names,
            ["attn/fwd/torch/1k", "q"],
            "--quick and HEADROOM_BENCH_DIR passed"
        );
    }

    #[test]
    fn exit_code_3_is_a_skip_with_the_stderr_reason() {
        let dir = tempfile::tempdir().unwrap();
        let s = script(
            dir.path(),
            "skip.py",
            "echo 'no module named torch' >&2\nexit 3\n",
        );
        let out = run_script(Path::new("sh"), &s, dir.path(), false).unwrap();
        assert_eq!(out, Outcome::Skipped("no module named torch".into()));
    }

    #[test]
    fn other_failures_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let s = script(dir.path(), "bad.py", "exit 1\n");
        let err = run_script(Path::new("sh"), &s, dir.path(), false).unwrap_err();
        assert!(err.to_string().contains("exit code 1"), "{err}");
    }

    #[test]
    fn a_missing_python_skips() {
        let dir = tempfile::tempdir().unwrap();
        let s = script(dir.path(), "x.py", "");
        let out = run_script(Path::new("/nonexistent/python3"), &s, dir.path(), false).unwrap();
        assert!(matches!(out, Outcome::Skipped(r) if r.contains("not found")));
    }

    #[test]
    fn only_selects_the_name_and_its_underscore_variants() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["attn.py", "attn_bwd.py", "attnx.py", "amp.py", "notes.txt"] {
            script(dir.path(), name, "");
        }
        let stems = |only| -> Vec<String> {
            find_scripts(dir.path(), only)
                .unwrap()
                .iter()
                .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(
            stems(None),
            ["amp.py", "attn.py", "attn_bwd.py", "attnx.py"]
        );
        assert_eq!(stems(Some("attn")), ["attn.py", "attn_bwd.py"]);
        assert!(find_scripts(&dir.path().join("absent"), None)
            .unwrap()
            .is_empty());
    }
}
