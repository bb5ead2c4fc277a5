//! `cargo xtask device-bundle`: the test and bench binaries, built with every feature in
//! release mode and stripped, in one folder with a `run.sh`, to copy to a GPU machine that has
//! no Rust toolchain.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::workspace::{cargo, create_dir_all, describe_status, display_command, Workspace};

/// The bundle must fit through the device machine's 64 MiB transfer limit.
pub const SIZE_LIMIT: u64 = 64 << 20;

/// The runner script copied into the bundle.
const RUN_SH: &str = include_str!("device_bundle_run.sh");

/// Which binaries of a build go into the bundle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Test harness binaries (`profile.test`): lib/bin unit tests and integration tests.
    Tests,
    /// Bench targets only (not the libraries' unit-test harnesses that `cargo bench` also
    /// builds: they hold no benchmarks on stable Rust).
    Benches,
    /// The workspace's programs (`headroom`), which the test build makes for the integration
    /// tests: on the device they run the command-line checks a test binary cannot.
    Programs,
}

impl Kind {
    fn dir_name(self) -> &'static str {
        match self {
            Kind::Tests => "tests",
            Kind::Benches => "benches",
            Kind::Programs => "bin",
        }
    }
}

#[derive(Debug, Deserialize)]
struct ArtifactTarget {
    name: String,
    kind: Vec<String>,
}

#[derive(Debug, Deserialize)]
struct ArtifactProfile {
    test: bool,
}

/// The fields of a `compiler-artifact` message xtask needs.
#[derive(Debug, Deserialize)]
struct Artifact {
    package_id: String,
    target: ArtifactTarget,
    profile: ArtifactProfile,
    executable: Option<PathBuf>,
}

#[derive(Deserialize)]
struct Message {
    reason: String,
}

/// An executable to bundle and the name it gets there.
#[derive(Debug, PartialEq)]
struct Binary {
    name: String,
    path: PathBuf,
}

/// The package name in a cargo package id, any format cargo has used:
/// `path+file:///w/crates/tensor#headroom-tensor@0.1.0`, `path+file:///w/xtask#0.1.0` (name =
/// last path segment), `registry+…#name@1.0`, and the old `name 0.1.0 (path+file:///…)`.
fn package_name(package_id: &str) -> &str {
    if let Some((name, _)) = package_id.split_once(' ') {
        return name;
    }
    let (url, fragment) = package_id.rsplit_once('#').unwrap_or((package_id, ""));
    match fragment.split_once('@') {
        Some((name, _)) => name,
        None => url.rsplit('/').next().unwrap_or(url),
    }
}

/// The bundled name of an artifact: `<package>--<kind>[-<target>]`, e.g.
/// `headroom-tensor--lib`, `headroom-tensor--test-cpu_primitives`, `headroom-benches--bench-tensor`.
fn binary_name(a: &Artifact) -> String {
    let package = package_name(&a.package_id);
    let kind = a.target.kind.first().map_or("bin", String::as_str);
    match kind {
        "lib" | "rlib" | "proc-macro" | "cdylib" | "dylib" | "staticlib" => {
            format!("{package}--lib")
        }
        _ => format!("{package}--{kind}-{}", a.target.name),
    }
}

fn wanted(a: &Artifact, kind: Kind) -> bool {
    a.executable.is_some()
        && match kind {
            Kind::Tests => a.profile.test,
            Kind::Benches => a.target.kind.iter().any(|k| k == "bench"),
            Kind::Programs => !a.profile.test && a.target.kind.iter().any(|k| k == "bin"),
        }
}

/// The binaries of `kind` among cargo's JSON messages (one per line; other lines ignored).
fn binaries_from_messages(
    lines: impl IntoIterator<Item = String>,
    kind: Kind,
) -> Result<Vec<Binary>> {
    let mut out = Vec::new();
    let mut names = BTreeSet::new();
    for line in lines {
        let Ok(message) = serde_json::from_str::<Message>(&line) else {
            continue;
        };
        if message.reason != "compiler-artifact" {
            continue;
        }
        let artifact: Artifact = serde_json::from_str(&line).map_err(|source| Error::Json {
            what: "a cargo compiler-artifact message".into(),
            source,
        })?;
        if !wanted(&artifact, kind) {
            continue;
        }
        let mut name = match kind {
            Kind::Programs => artifact.target.name.clone(),
            Kind::Tests | Kind::Benches => binary_name(&artifact),
        };
        // Two targets can only collide through odd naming; keep both rather than overwrite.
        let base = name.clone();
        let mut n = 2;
        while !names.insert(name.clone()) {
            name = format!("{base}-{n}");
            n += 1;
        }
        if let Some(path) = artifact.executable {
            out.push(Binary { name, path });
        }
    }
    Ok(out)
}

/// Run a cargo build that prints JSON messages and return those messages (one per line).
fn build(cmd: &mut Command) -> Result<Vec<String>> {
    let line = display_command(cmd);
    println!("==> {line}");
    let mut child = cmd
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            program: line.clone(),
            source,
        })?;
    let mut lines = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        for l in BufReader::new(stdout).lines() {
            lines.push(l.map_err(Error::io("reading the output of", "cargo"))?);
        }
    }
    let status = child.wait().map_err(Error::io("waiting for", "cargo"))?;
    if !status.success() {
        return Err(Error::StepFailed {
            step: line,
            status: describe_status(status),
        });
    }
    Ok(lines)
}

fn stripped_release_cargo(ws: &Workspace, subcommand: &[&str]) -> Command {
    let mut cmd = cargo();
    cmd.args(subcommand)
        .args([
            "--workspace",
            // xtask is a build tool; its tests need no device and would only take space.
            "--exclude",
            "xtask",
            "--all-features",
            "--no-run",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(&ws.root);
    // `cargo test --release` and `cargo bench` use the release and bench profiles; strip both
    // (no debug info is built at all, which also shortens the build).
    for profile in ["RELEASE", "BENCH"] {
        cmd.env(format!("CARGO_PROFILE_{profile}_STRIP"), "symbols")
            .env(format!("CARGO_PROFILE_{profile}_DEBUG"), "false");
    }
    cmd
}

/// Copy `binaries` into `dir` (created); returns their total size.
fn copy_binaries(binaries: &[Binary], dir: &Path) -> Result<u64> {
    create_dir_all(dir)?;
    let mut total = 0;
    for b in binaries {
        let dst = dir.join(&b.name);
        total += std::fs::copy(&b.path, &dst).map_err(Error::io("copying", &b.path))?;
        set_executable(&dst)?;
    }
    Ok(total)
}

#[cfg(unix)]
fn set_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(Error::io("setting permissions of", path))
}

#[cfg(not(unix))]
fn set_executable(_path: &Path) -> Result<()> {
    Ok(())
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Build, collect, write `run.sh`, check the size.
pub fn run(ws: &Workspace) -> Result<()> {
    let test_build = build(&mut stripped_release_cargo(ws, &["test", "--release"]))?;
    let tests = binaries_from_messages(test_build.iter().cloned(), Kind::Tests)?;
    let programs = binaries_from_messages(test_build, Kind::Programs)?;
    let benches = binaries_from_messages(
        build(&mut stripped_release_cargo(ws, &["bench"]))?,
        Kind::Benches,
    )?;

    let bundle = ws.output_dir("device-bundle");
    match std::fs::remove_dir_all(&bundle) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("removing", &bundle)(e)),
    }
    let mut total = copy_binaries(&tests, &bundle.join(Kind::Tests.dir_name()))?;
    total += copy_binaries(&benches, &bundle.join(Kind::Benches.dir_name()))?;
    total += copy_binaries(&programs, &bundle.join(Kind::Programs.dir_name()))?;
    let run_sh = bundle.join("run.sh");
    std::fs::write(&run_sh, RUN_SH).map_err(Error::io("writing", &run_sh))?;
    set_executable(&run_sh)?;
    total += RUN_SH.len() as u64;

    println!("\ndevice bundle: {}", bundle.display());
    for (kind, binaries) in [
        (Kind::Tests, &tests),
        (Kind::Benches, &benches),
        (Kind::Programs, &programs),
    ] {
        println!("  {}/ ({} binaries)", kind.dir_name(), binaries.len());
        for b in binaries.iter() {
            let size = std::fs::metadata(bundle.join(kind.dir_name()).join(&b.name))
                .map_err(Error::io("inspecting", &b.path))?
                .len();
            println!("    {:<48} {:>7.2} MiB", b.name, mib(size));
        }
    }
    println!(
        "  total {total} bytes ({:.2} MiB, limit {:.0} MiB)",
        mib(total),
        mib(SIZE_LIMIT)
    );
    let archive = write_archive(&bundle)?;
    println!(
        "  on the device: ./run.sh (tests, GPU ones included), ./run.sh bench, \
         ./run.sh compare (torch on the GPU), ./run.sh pack (one file back)"
    );
    check_size(total, archive.as_ref())
}

/// `<bundle>.tar.xz` beside the folder, via the system's `tar` and `xz`. The test binaries
/// share most of their code (std, rayon, the workspace crates), and xz's large window
/// deduplicates across files: the archive is about a tenth of the folder. `None` (with a
/// message) where tar or xz is missing; the folder is the bundle, the archive a convenience.
fn write_archive(bundle: &Path) -> Result<Option<(PathBuf, u64)>> {
    let (Some(parent), Some(name)) = (bundle.parent(), bundle.file_name()) else {
        return Ok(None);
    };
    let archive = parent.join(format!("{}.tar.xz", name.to_string_lossy()));
    let mut cmd = Command::new("tar");
    cmd.arg("-cJf")
        .arg(&archive)
        .arg("-C")
        .arg(parent)
        .arg(name)
        .env("XZ_OPT", "-6 -T0");
    let status = match cmd.status() {
        Ok(status) => status,
        Err(e) => {
            println!("  no archive: could not run tar ({e})");
            return Ok(None);
        }
    };
    if !status.success() {
        println!(
            "  no archive: tar -cJf failed ({})",
            describe_status(status)
        );
        // A partial archive must not be mistaken for a bundle.
        let _ = std::fs::remove_file(&archive);
        return Ok(None);
    }
    let size = std::fs::metadata(&archive)
        .map_err(Error::io("inspecting", &archive))?
        .len();
    println!("  archive {} ({:.2} MiB)", archive.display(), mib(size));
    println!(
        "    unpack with: tar -xJf {} (gives {}/)",
        archive.display(),
        name.to_string_lossy()
    );
    Ok(Some((archive, size)))
}

/// The bundle has to reach the device in at most `SIZE_LIMIT` bytes: the folder as it is, or
/// failing that the archive (with a warning saying to copy the archive).
fn check_size(folder: u64, archive: Option<&(PathBuf, u64)>) -> Result<()> {
    if folder <= SIZE_LIMIT {
        return Ok(());
    }
    match archive {
        Some((path, size)) if *size <= SIZE_LIMIT => {
            println!(
                "warning: the folder is over {:.0} MiB; copy {} instead",
                mib(SIZE_LIMIT),
                path.display()
            );
            Ok(())
        }
        _ => Err(Error::BundleTooLarge {
            bytes: folder,
            limit: SIZE_LIMIT,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(package_id: &str, name: &str, kind: &str, test: bool, exe: Option<&str>) -> String {
        serde_json::json!({
            "reason": "compiler-artifact",
            "package_id": package_id,
            "target": {"name": name, "kind": [kind], "src_path": "/x"},
            "profile": {"test": test, "opt_level": "3"},
            "executable": exe,
            "fresh": true,
        })
        .to_string()
    }

    const TENSOR: &str = "path+file:///w/crates/tensor#headroom-tensor@0.1.0";
    const BENCHES: &str = "path+file:///w/benches#headroom-benches@0.1.0";

    #[test]
    fn package_names_from_every_id_format() {
        assert_eq!(package_name(TENSOR), "headroom-tensor");
        assert_eq!(package_name("path+file:///w/xtask#0.1.0"), "xtask");
        assert_eq!(
            package_name("registry+https://github.com/rust-lang/crates.io-index#half@2.7.1"),
            "half"
        );
        assert_eq!(
            package_name("headroom-tensor 0.1.0 (path+file:///w/crates/tensor)"),
            "headroom-tensor"
        );
    }

    #[test]
    fn tests_are_test_harness_executables_only() {
        let lines = vec![
            "not json".to_string(),
            r#"{"reason":"build-script-executed","package_id":"x"}"#.to_string(),
            artifact(TENSOR, "headroom_tensor", "lib", false, None),
            artifact(
                TENSOR,
                "headroom_tensor",
                "lib",
                true,
                Some("/t/headroom_tensor-1"),
            ),
            artifact(
                TENSOR,
                "cpu_primitives",
                "test",
                true,
                Some("/t/cpu_primitives-2"),
            ),
            artifact(
                "path+file:///w/xtask#0.1.0",
                "xtask",
                "bin",
                false,
                Some("/t/xtask"),
            ),
            artifact(
                "path+file:///w/xtask#0.1.0",
                "xtask",
                "bin",
                true,
                Some("/t/xtask-3"),
            ),
            artifact(
                BENCHES,
                "headroom_benches",
                "example",
                false,
                Some("/t/example"),
            ),
        ];
        let bins = binaries_from_messages(lines, Kind::Tests).unwrap();
        let names: Vec<_> = bins.iter().map(|b| b.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "headroom-tensor--lib",
                "headroom-tensor--test-cpu_primitives",
                "xtask--bin-xtask"
            ]
        );
        assert_eq!(bins[1].path, Path::new("/t/cpu_primitives-2"));
    }

    #[test]
    fn benches_are_bench_targets_only() {
        let lines = vec![
            artifact(
                BENCHES,
                "headroom_benches",
                "lib",
                true,
                Some("/b/lib-harness"),
            ),
            artifact(BENCHES, "tensor", "bench", false, Some("/b/tensor-1")),
            artifact(BENCHES, "amp", "bench", true, Some("/b/amp-1")),
        ];
        let names: Vec<_> = binaries_from_messages(lines, Kind::Benches)
            .unwrap()
            .into_iter()
            .map(|b| b.name)
            .collect();
        assert_eq!(
            names,
            [
                "headroom-benches--bench-tensor",
                "headroom-benches--bench-amp"
            ]
        );
    }

    #[test]
    fn programs_are_the_non_test_bins_by_their_own_name() {
        let trainer = "path+file:///w/crates/trainer#headroom-trainer@0.1.0";
        let lines = vec![
            artifact(trainer, "headroom", "bin", false, Some("/t/headroom")),
            artifact(trainer, "headroom", "bin", true, Some("/t/headroom-7")),
            artifact(trainer, "headroom_trainer", "lib", false, None),
            artifact(trainer, "cli", "test", true, Some("/t/cli-2")),
        ];
        let programs = binaries_from_messages(lines, Kind::Programs).unwrap();
        assert_eq!(
            programs,
            [Binary {
                name: "headroom".into(),
                path: PathBuf::from("/t/headroom")
            }]
        );
    }

    #[test]
    fn colliding_names_are_kept_apart() {
        let lines = vec![
            artifact(TENSOR, "a", "test", true, Some("/t/a-1")),
            artifact(TENSOR, "a", "test", true, Some("/t/a-2")),
        ];
        let names: Vec<_> = binaries_from_messages(lines, Kind::Tests)
            .unwrap()
            .into_iter()
            .map(|b| b.name)
            .collect();
        assert_eq!(
            names,
            ["headroom-tensor--test-a", "headroom-tensor--test-a-2"]
        );
    }

    #[test]
    fn size_limit_applies_to_the_folder_or_else_the_archive() {
        let archive = |size| Some((PathBuf::from("b.tar.xz"), size));
        assert!(check_size(SIZE_LIMIT, None).is_ok());
        assert!(matches!(
            check_size(SIZE_LIMIT + 1, None),
            Err(Error::BundleTooLarge { .. })
        ));
        assert!(check_size(SIZE_LIMIT + 1, archive(SIZE_LIMIT).as_ref()).is_ok());
        assert!(check_size(SIZE_LIMIT + 1, archive(SIZE_LIMIT + 1).as_ref()).is_err());
    }

    #[test]
    fn a_malformed_artifact_message_is_an_error() {
        let lines = vec![r#"{"reason":"compiler-artifact","package_id":3}"#.to_string()];
        assert!(binaries_from_messages(lines, Kind::Tests).is_err());
    }

    /// run.sh runs every test binary with --include-ignored, goes on after a failure, writes
    /// logs under $OUT, summarises, and exits non-zero when any binary failed.
    #[cfg(unix)]
    #[test]
    fn run_sh_runs_everything_and_reports_failures() {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle");
        let out = dir.path().join("out");
        std::fs::create_dir_all(bundle.join("tests")).unwrap();
        std::fs::create_dir_all(bundle.join("benches")).unwrap();
        let write = |path: PathBuf, body: &str| {
            std::fs::write(&path, body).unwrap();
            set_executable(&path).unwrap();
        };
        write(bundle.join("run.sh"), RUN_SH);
        // Fails unless given --include-ignored; records its args.
        write(
            bundle.join("tests/a--lib"),
            "#!/bin/sh\necho \"a $*\"\n[ \"$1\" = --include-ignored ]\n",
        );
        write(
            bundle.join("tests/b--lib"),
            "#!/bin/sh\necho b failing\nexit 4\n",
        );
        write(
            bundle.join("benches/c--bench-c"),
            "#!/bin/sh\necho \"c $1 $CRITERION_HOME\"\n[ \"$1\" = --bench ]\n",
        );

        let run = |mode: &str| {
            Command::new("bash")
                .arg(bundle.join("run.sh"))
                .arg(mode)
                .env("OUT", &out)
                .output()
                .unwrap()
        };
        let tests = run("test");
        let stdout = String::from_utf8_lossy(&tests.stdout);
        assert_eq!(tests.status.code(), Some(1), "{stdout}");
        assert!(stdout.contains("1 passed, 1 failed"), "{stdout}");
        assert!(stdout.contains("pass  tests/a--lib"), "{stdout}");
        assert!(stdout.contains("FAIL  tests/b--lib (exit 4)"), "{stdout}");
        assert!(
            !stdout.contains("c --bench"),
            "benches only on request: {stdout}"
        );
        let log = std::fs::read_to_string(out.join("logs/tests/a--lib.log")).unwrap();
        assert_eq!(log.trim(), "a --include-ignored");

        let benches = run("bench");
        let stdout = String::from_utf8_lossy(&benches.stdout);
        assert!(benches.status.success(), "{stdout}");
        assert!(
            stdout.contains(&format!("c --bench {}", out.join("criterion").display())),
            "{stdout}"
        );

        assert_eq!(run("nonsense").status.code(), Some(2));
    }

    /// `compare` runs only the scripts that take `--device`, with `--device cuda`, keeping their
    /// JSON lines as records; `pack` leaves one archive holding everything in $OUT.
    #[cfg(unix)]
    #[test]
    fn run_sh_compares_with_device_scripts_and_packs_out() {
        let dir = tempfile::tempdir().unwrap();
        let (bundle, out, scripts) = (
            dir.path().join("bundle"),
            dir.path().join("out"),
            dir.path().join("torch"),
        );
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::create_dir_all(&scripts).unwrap();
        std::fs::write(bundle.join("run.sh"), RUN_SH).unwrap();
        std::fs::write(scripts.join("gpu.py"), "# takes --device\n").unwrap();
        std::fs::write(scripts.join("cpu_only.py"), "# no device option\n").unwrap();
        // The fake Python prints a log line and a record naming the script and its arguments.
        let python = dir.path().join("python");
        std::fs::write(
            &python,
            "#!/bin/sh\necho \"log line\"\necho \"{\\\"bench\\\": \\\"$(basename $1) $2 $3\\\"}\"\n",
        )
        .unwrap();
        set_executable(&python).unwrap();

        let run = |mode: &str| {
            Command::new("bash")
                .arg(bundle.join("run.sh"))
                .arg(mode)
                .env("OUT", &out)
                .env("HEADROOM_TORCH_SCRIPTS", &scripts)
                .env("HEADROOM_PYTHON", &python)
                .output()
                .unwrap()
        };
        let compare = run("compare");
        let stdout = String::from_utf8_lossy(&compare.stdout);
        assert!(compare.status.success(), "{stdout}");
        assert!(stdout.contains("1 passed, 0 failed"), "{stdout}");
        let records = std::fs::read_to_string(out.join("headroom-bench/records.jsonl")).unwrap();
        assert_eq!(records.trim(), r#"{"bench": "gpu.py --device cuda"}"#);
        let log = std::fs::read_to_string(out.join("headroom-bench/gpu.log")).unwrap();
        assert!(log.contains("log line"), "{log}");

        let pack = run("pack");
        assert!(pack.status.success(), "{pack:?}");
        let left: Vec<_> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["device-run.tar.gz"]);
        let listing = Command::new("tar")
            .arg("-tzf")
            .arg(out.join("device-run.tar.gz"))
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        assert!(
            listing.contains("headroom-bench/records.jsonl"),
            "{listing}"
        );
    }
}
