//! `cargo xtask bench`: run the criterion benches and the comparison scripts, then write
//! `results.json` and `report.md`.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::criterion_results;
use crate::error::{Error, Result};
use crate::records::{self, Record};
use crate::report;
use crate::torch_scripts::{self, Outcome};
use crate::workspace::{cargo, create_dir_all, run_step, Workspace};

/// The package whose bench targets are run.
pub const BENCH_PACKAGE: &str = "headroom-benches";

/// Criterion settings of a quick run: long enough for a stable median of memory-bound loops,
/// short enough that every bench together takes a few minutes on two cores. Fewer bootstrap
/// resamples cut criterion's analysis time, which otherwise rivals the measurement itself.
pub const QUICK_CRITERION_ARGS: [&str; 9] = [
    "--warm-up-time",
    "0.3",
    "--measurement-time",
    "1",
    "--sample-size",
    "10",
    "--nresamples",
    "10000",
    "--noplot",
];

/// Command-line options of `cargo xtask bench`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Options {
    /// Short measurements.
    pub quick: bool,
    /// Only this bench target (and the scripts named after it).
    pub only: Option<String>,
    /// Extra arguments for criterion, after `--`.
    pub criterion_args: Vec<String>,
}

impl Options {
    /// Parse `[--quick] [--only NAME] [-- ARGS...]`.
    pub fn parse(args: &[String]) -> Result<Options> {
        let mut options = Options::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--quick" => options.quick = true,
                "--only" => {
                    let name = it
                        .next()
                        .ok_or_else(|| Error::Usage("--only needs a bench name".into()))?;
                    options.only = Some(name.clone());
                }
                "--" => {
                    options.criterion_args = it.cloned().collect();
                    break;
                }
                other => match other.strip_prefix("--only=") {
                    Some(name) => options.only = Some(name.to_string()),
                    None => return Err(Error::Usage(format!("`bench` does not take `{other}`"))),
                },
            }
        }
        if options.only.as_deref() == Some("") {
            return Err(Error::Usage("--only needs a bench name".into()));
        }
        Ok(options)
    }

    fn command_line(&self) -> String {
        let mut line = String::from("cargo xtask bench");
        if self.quick {
            line.push_str(" --quick");
        }
        if let Some(only) = &self.only {
            line.push_str(&format!(" --only {only}"));
        }
        if !self.criterion_args.is_empty() {
            line.push_str(&format!(" -- {}", self.criterion_args.join(" ")));
        }
        line
    }
}

/// `$HEADROOM_BENCH_DIR`, else `<workspace>/target/headroom-bench`.
pub fn bench_dir(ws: &Workspace) -> PathBuf {
    std::env::var_os("HEADROOM_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| ws.output_dir("headroom-bench"))
}

/// Where criterion writes: `$CRITERION_HOME`, else `<cargo target dir>/criterion` (criterion's
/// own rule).
fn criterion_dir(ws: &Workspace) -> PathBuf {
    std::env::var_os("CRITERION_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| ws.target_dir.join("criterion"))
}

/// Run everything, then write the results.
pub fn run(ws: &Workspace, options: &Options) -> Result<()> {
    let bench_dir = bench_dir(ws);
    // Absolute, so benches and scripts (run from other directories) agree on it.
    let bench_dir = if bench_dir.is_absolute() {
        bench_dir
    } else {
        ws.root.join(bench_dir)
    };
    create_dir_all(&bench_dir)?;
    let records_file = bench_dir.join("records.jsonl");
    match std::fs::remove_file(&records_file) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("removing", &records_file)(e)),
    }
    // Criterion output older than this belongs to earlier runs. The margin absorbs coarse
    // file-system timestamps; nothing of an earlier run is written within it in practice.
    let started = SystemTime::now() - Duration::from_secs(1);

    let mut cmd = cargo();
    // Bench targets only: a plain `cargo bench -p` would also run the library's unit-test
    // harness in bench mode, which rejects criterion's arguments.
    cmd.args(["bench", "-p", BENCH_PACKAGE, "--bench"])
        .arg(options.only.as_deref().unwrap_or("*"));
    cmd.arg("--");
    if options.quick {
        cmd.args(QUICK_CRITERION_ARGS);
    }
    cmd.args(&options.criterion_args)
        .env("HEADROOM_BENCH_DIR", &bench_dir)
        .current_dir(&ws.root);
    run_step(&mut cmd)?;

    let mut all: Vec<Record> = criterion_results::to_records(
        &criterion_results::read_measurements(&criterion_dir(ws), started)?,
    );
    all.extend(records::read_jsonl(&records_file)?);

    let python = torch_scripts::python();
    for script in torch_scripts::find_scripts(
        &ws.root.join("benches").join("torch"),
        options.only.as_deref(),
    )? {
        match torch_scripts::run_script(&python, &script, &bench_dir, options.quick)? {
            Outcome::Ran(records) => all.extend(records),
            Outcome::Skipped(reason) => {
                println!("skipped {}: {reason}", display_relative(&script, &ws.root))
            }
        }
    }

    warn_about(&mut all);
    write_results(&bench_dir, &all, &options.command_line())
}

/// `cargo xtask bench-report OUT [--to DIR]`: results and report from what `run.sh bench` of
/// the device bundle left in `OUT` (`OUT/criterion/`, `OUT/headroom-bench/records.jsonl`),
/// written to `DIR` (default `<workspace>/target/headroom-bench-device`). Everything in `OUT`
/// comes from that one device run, so no file is treated as stale.
pub fn report_from_device(ws: &Workspace, args: &[String]) -> Result<()> {
    let mut device_out = None;
    let mut to = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--to" => {
                let dir = it
                    .next()
                    .ok_or_else(|| Error::Usage("--to needs a directory".into()))?;
                to = Some(PathBuf::from(dir));
            }
            other if other.starts_with("--") => {
                return Err(Error::Usage(format!(
                    "`bench-report` does not take `{other}`"
                )))
            }
            other if device_out.is_none() => device_out = Some(PathBuf::from(other)),
            other => return Err(Error::Usage(format!("unexpected argument `{other}`"))),
        }
    }
    let device_out = device_out.ok_or_else(|| {
        Error::Usage("bench-report needs the directory run.sh bench wrote ($OUT)".into())
    })?;
    let to = to.unwrap_or_else(|| ws.output_dir("headroom-bench-device"));
    let command = format!("cargo xtask bench-report {}", device_out.display());
    collect_device_results(&device_out, &to, &command)
}

fn collect_device_results(device_out: &Path, to: &Path, command: &str) -> Result<()> {
    let measurements = criterion_results::read_measurements(
        &device_out.join("criterion"),
        SystemTime::UNIX_EPOCH,
    )?;
    let mut all = criterion_results::to_records(&measurements);
    all.extend(records::read_jsonl(
        &device_out.join("headroom-bench").join("records.jsonl"),
    )?);
    if all.is_empty() {
        return Err(Error::Usage(format!(
            "no criterion output or records under {}",
            device_out.display()
        )));
    }
    warn_about(&mut all);
    create_dir_all(to)?;
    write_results(to, &all, command)
}

/// Fill baselines, and say which records cannot be compared.
fn warn_about(all: &mut [Record]) {
    for name in records::fill_baselines(all) {
        println!("warning: baseline `{name}` was named but not measured in this run");
    }
    for r in all.iter().filter(|r| !r.value.is_finite()) {
        println!(
            "warning: `{}` recorded a non-finite value ({})",
            r.bench, r.value
        );
    }
}

fn display_relative(path: &Path, root: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// Write `results.json` and `report.md` into `dir` and say where they are.
pub fn write_results(dir: &Path, records: &[Record], command: &str) -> Result<()> {
    let json_path = dir.join("results.json");
    let json = serde_json::to_string_pretty(records).map_err(|source| Error::Json {
        what: "results".into(),
        source,
    })?;
    std::fs::write(&json_path, json + "\n").map_err(Error::io("writing", &json_path))?;

    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let header = report::Header {
        command: command.to_string(),
        when: report::utc_timestamp(now),
        machine: report::machine_description(),
    };
    let markdown = report::render(&header, records);
    let md_path = dir.join("report.md");
    std::fs::write(&md_path, &markdown).map_err(Error::io("writing", &md_path))?;

    println!("\n{markdown}");
    println!("{} results written to:", records.len());
    println!("  {}", json_path.display());
    println!("  {}", md_path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &[&str]) -> Vec<String> {
        s.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn options_parse() {
        assert_eq!(Options::parse(&[]).unwrap(), Options::default());
        let o = Options::parse(&args(&["--quick", "--only", "tensor", "--", "cast"])).unwrap();
        assert!(o.quick);
        assert_eq!(o.only.as_deref(), Some("tensor"));
        assert_eq!(o.criterion_args, ["cast"]);
        assert_eq!(
            o.command_line(),
            "cargo xtask bench --quick --only tensor -- cast"
        );
        assert_eq!(
            Options::parse(&args(&["--only=amp"]))
                .unwrap()
                .only
                .as_deref(),
            Some("amp")
        );
    }

    #[test]
    fn bad_options_are_usage_errors() {
        for bad in [&["--only"][..], &["--only="], &["--fast"]] {
            assert!(
                matches!(Options::parse(&args(bad)), Err(Error::Usage(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn device_results_are_collected_from_out() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let g = "tensor/cast_f32_to_bf16";
        criterion_results::tests::write_criterion_benchmark(
            &out.join("criterion"),
            g,
            "headroom",
            "1MiB",
            1e5,
        );
        criterion_results::tests::write_criterion_benchmark(
            &out.join("criterion"),
            g,
            "baseline_copy_from_slice",
            "1MiB",
            5e4,
        );
        create_dir_all(&out.join("headroom-bench")).unwrap();
        std::fs::write(
            out.join("headroom-bench/records.jsonl"),
            r#"{"bench":"amp/x","metric":"m","value":1,"unit":"u","better":"lower"}"#,
        )
        .unwrap();
        let to = dir.path().join("report");
        collect_device_results(&out, &to, "cargo xtask bench-report out").unwrap();
        let back: Vec<Record> =
            serde_json::from_str(&std::fs::read_to_string(to.join("results.json")).unwrap())
                .unwrap();
        assert_eq!(back.len(), 3);
        assert_eq!(back[0].ratio, Some(0.5), "{back:?}");
        assert_eq!(back[2].bench, "amp/x");
        let empty = dir.path().join("empty");
        assert!(collect_device_results(&empty, &to, "c").is_err());
    }

    #[test]
    fn results_are_written_as_a_json_list_and_a_report() {
        let dir = tempfile::tempdir().unwrap();
        let text = r#"{"bench":"amp/x/headroom","metric":"peak_bytes","value":5,"unit":"bytes","baseline":"amp/x/baseline","better":"lower"}
{"bench":"amp/x/baseline","metric":"peak_bytes","value":10,"unit":"bytes","better":"lower"}"#;
        let mut rs = records::parse_jsonl(text, "t").unwrap();
        assert!(records::fill_baselines(&mut rs).is_empty());
        write_results(dir.path(), &rs, "cargo xtask bench").unwrap();
        let back: Vec<Record> = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("results.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(back, rs);
        assert_eq!(back[0].ratio, Some(0.5));
        let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
        assert!(
            md.contains("| amp/x/headroom | 5.00 ↓ | bytes | …/baseline | 0.50 |"),
            "{md}"
        );
    }
}
