//! `mpirun -n N headroom-mpi train --zero S --dist mpi` — one rank per process — against the
//! same binary's in-process ranks (`--ranks N`, which the trainer's own tests pin to one process
//! bit for bit): the same losses and the same consolidated checkpoint, byte for byte. And a
//! rank killed mid-run ends the job with a non-zero status within the time-out, never a hang.
//!
//! Needs `mpirun` (Open MPI) on the PATH; `.ci/run` installs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_headroom-mpi");

fn mpirun(n: usize) -> Command {
    let mut c = Command::new("mpirun");
    // CI runs as root; Open MPI refuses that unless told it is intended.
    c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args(["-n", &n.to_string(), "--oversubscribe", BIN]);
    c
}

fn run(mut c: Command) -> String {
    let o = c.output().expect("start");
    assert!(
        o.status.success(),
        "{:?} failed: {}\n{}",
        c,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The run's settings: a model the ranks do not divide evenly, accumulation, no clipping
/// (its norm is summed in another order), a checkpoint at the end.
fn train_args(stage: &str, out: &Path) -> Vec<String> {
    [
        "train",
        "--zero",
        stage,
        "--steps",
        "4",
        "--batch",
        "12",
        "--micro-batch",
        "2",
        "--grad-clip",
        "inf",
        "--checkpoint-every",
        "4",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        "--metrics".into(),
        out.join("metrics.jsonl").display().to_string(),
        "--checkpoint-dir".into(),
        out.join("ck").display().to_string(),
    ])
    .collect()
}

fn losses(out: &Path) -> Vec<String> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: Vec<&str> = l.split(',').filter(|f| f.contains("\"loss\"")).collect();
            v.concat()
        })
        .collect()
}

fn consolidated(out: &Path) -> PathBuf {
    let one = out.join("one");
    let mut c = Command::new(BIN);
    c.args(["checkpoint", "consolidate"])
        .arg(out.join("ck"))
        .arg(&one);
    run(c);
    one.join("step-00000004")
}

#[test]
fn mpi_processes_equal_in_process_ranks_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    for (ranks, stage) in [(2, "3"), (3, "1")] {
        let threads = dir.path().join(format!("threads-{ranks}"));
        let procs = dir.path().join(format!("mpi-{ranks}"));
        std::fs::create_dir_all(&threads).unwrap();
        std::fs::create_dir_all(&procs).unwrap();
        let mut c = Command::new(BIN);
        c.args(train_args(stage, &threads))
            .args(["--ranks", &ranks.to_string()]);
        run(c);
        let mut c = mpirun(ranks);
        c.args(train_args(stage, &procs)).args(["--dist", "mpi"]);
        let stdout = run(c);
        assert!(stdout.contains("(MPI processes)"), "{stdout}");
        let (a, b) = (losses(&threads), losses(&procs));
        assert_eq!(a.len(), 4);
        assert_eq!(a, b, "ZeRO-{stage} on {ranks} ranks: losses");
        let (a, b) = (consolidated(&threads), consolidated(&procs));
        for file in ["model.safetensors", "optimizer.bin"] {
            let same = std::fs::read(a.join(file)).unwrap() == std::fs::read(b.join(file)).unwrap();
            assert!(same, "ZeRO-{stage} on {ranks} ranks: {file} differs");
        }
    }
}

/// The pids of live processes whose command line contains `marker`.
fn pids_with(marker: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(BIN) && cmd.contains(marker) && !cmd.starts_with("mpirun") {
            out.push(pid);
        }
    }
    out
}

#[test]
fn a_killed_rank_ends_the_job_non_zero_within_the_time_out() {
    let dir = tempfile::tempdir().unwrap();
    let marker = format!("{}", 900_000 + std::process::id() % 99_999);
    let mut c = mpirun(3);
    c.args([
        "train", "--zero", "3", "--dist", "mpi", "--batch", "12", "--steps", "100000", "--seed",
        &marker,
    ])
    .current_dir(dir.path())
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut child = c.spawn().expect("mpirun");
    let start = Instant::now();
    // Wait for the three ranks, let them train a little, then kill one.
    let victims = loop {
        let p = pids_with(&marker);
        if p.len() == 3 || start.elapsed() > Duration::from_secs(60) {
            break p;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(victims.len(), 3, "the three ranks did not start");
    std::thread::sleep(Duration::from_secs(2));
    let killed = Command::new("kill")
        .args(["-9", &victims[2].to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > Duration::from_secs(120) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let Some(status) = status else {
        let _ = child.kill();
        for p in pids_with(&marker) {
            let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
        }
        panic!("the job hung for 120 s after a rank was killed");
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    assert!(!status.success(), "a killed rank must fail the job: {err}");
    // Open MPI names the rank that died (or the survivors report the lost peer).
    assert!(
        err.contains("signal") || err.contains("killed") || err.contains("ZeRO rank"),
        "{err}"
    );
    eprintln!(
        "job ended {:.1} s after the kill: {status}",
        t0.elapsed().as_secs_f64()
    );
}
