//! The runner: feeds every input of a campaign to a target on a worker thread, catches panics,
//! detects hangs with a per-input time limit, and counts what happened.
//!
//! # How hangs are caught
//!
//! The target runs on one worker thread; the runner hands it one input at a time and waits for
//! the answer with a timeout ([`FuzzConfig::timeout`]). An input that does not finish in time
//! is a hang: it is recorded, the stuck worker is abandoned (a thread cannot be killed; it keeps
//! running until it finishes or the process exits) and a fresh worker takes the next input.
//! After [`FuzzConfig::max_hangs`] hangs the campaign stops, so at most that many threads are
//! ever left behind, and a test that asserts [`FuzzReport::is_clean`] then fails and ends the
//! process, taking them with it.
//!
//! # What cannot be caught in-process
//!
//! An abort — a failed allocation (`memory allocation of N bytes failed`), a stack overflow,
//! `std::process::abort`, a signal such as SIGBUS from a truncated memory map — kills the whole
//! process. That is still a detection, but only if someone looks at the exit status: long
//! campaigns must run each target as its own process and check how it ended
//! (`scripts/fuzz-long.sh` does that). Running under a virtual-memory limit (`ulimit -v`) turns
//! an over-large allocation that the OS would otherwise overcommit into such an abort.

use std::any::Any;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Once};
use std::thread;
use std::time::{Duration, Instant};

use crate::mutate::{systematic, Field, Mutated, Mutator};
use crate::rng::{hash_name, Rng};

/// Random inputs per campaign when `HEADROOM_FUZZ_ITERS` is not set (see [`iterations`]).
pub const DEFAULT_ITERATIONS: u64 = 1000;
/// The campaign seed when `HEADROOM_FUZZ_SEED` is not set.
pub const DEFAULT_SEED: u64 = 0x6865_6164_726F_6F6D;
/// The per-input time limit when `HEADROOM_FUZZ_TIMEOUT_MS` is not set: generous, because a
/// loaded CI machine can stall a thread for seconds; an infinite loop is caught all the same.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Environment variable: random inputs per campaign.
pub const ENV_ITERATIONS: &str = "HEADROOM_FUZZ_ITERS";
/// Environment variable: campaign seed (decimal or `0x` hex).
pub const ENV_SEED: &str = "HEADROOM_FUZZ_SEED";
/// Environment variable: per-input time limit in milliseconds.
pub const ENV_TIMEOUT_MS: &str = "HEADROOM_FUZZ_TIMEOUT_MS";
/// Environment variable: a directory where every panicking or hanging input is written whole.
pub const ENV_ARTIFACTS: &str = "HEADROOM_FUZZ_ARTIFACTS";
/// Environment variable: run only this input number (from a report) to reproduce it.
pub const ENV_ONLY: &str = "HEADROOM_FUZZ_ONLY";

/// Prefix of the one-line summary every campaign prints to stderr (for scripts).
pub const SUMMARY_PREFIX: &str = "FUZZKIT-SUMMARY";

const WORKER_PREFIX: &str = "fuzzkit-worker:";

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim().replace('_', "");
    match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Random inputs to run: `HEADROOM_FUZZ_ITERS` if set (and a number), else `default`. Tests
/// pass a small default so CI stays fast; long campaigns set the variable.
pub fn iterations(default: u64) -> u64 {
    env_u64(ENV_ITERATIONS).unwrap_or(default)
}

/// A valid input to mutate, with the header fields known inside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seed {
    /// A name shown in recipes (`"gpt2 shard"`).
    pub name: String,
    /// The valid input, typically written by the crate's own writer.
    pub bytes: Vec<u8>,
    /// Header fields to set to extreme values.
    pub fields: Vec<Field>,
}

impl Seed {
    /// A seed with no known fields.
    pub fn new(name: impl Into<String>, bytes: impl Into<Vec<u8>>) -> Self {
        Seed {
            name: name.into(),
            bytes: bytes.into(),
            fields: Vec::new(),
        }
    }

    /// The same seed with `fields` added.
    pub fn with_fields(mut self, fields: impl IntoIterator<Item = Field>) -> Self {
        self.fields.extend(fields);
        self
    }
}

/// How a campaign runs. [`FuzzConfig::from_env`] reads the `HEADROOM_FUZZ_*` variables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuzzConfig {
    /// Random mutated inputs, after the systematic ones.
    pub iterations: u64,
    /// Run the systematic inputs first (every field at every extreme value, every cut inside
    /// the header; see [`crate::systematic`]).
    pub systematic: bool,
    /// Campaign seed; combined with the campaign name, so two targets get different streams.
    pub seed: u64,
    /// Per-input time limit: an input that runs longer is a hang.
    pub timeout: Duration,
    /// Stop the campaign after this many hangs (each one leaves a stuck thread behind).
    pub max_hangs: u64,
    /// Panicking and hanging inputs kept in the report (the counts are always complete).
    pub max_findings: usize,
    /// Write every panicking or hanging input here, whole, as `<name>-<input>.bin`.
    pub artifacts: Option<PathBuf>,
    /// Run only this input number (to reproduce a finding).
    pub only: Option<u64>,
    /// The mutator's settings.
    pub mutator: Mutator,
}

impl Default for FuzzConfig {
    fn default() -> Self {
        FuzzConfig {
            iterations: DEFAULT_ITERATIONS,
            systematic: true,
            seed: DEFAULT_SEED,
            timeout: DEFAULT_TIMEOUT,
            max_hangs: 3,
            max_findings: 8,
            artifacts: None,
            only: None,
            mutator: Mutator::default(),
        }
    }
}

impl FuzzConfig {
    /// Defaults overridden by `HEADROOM_FUZZ_ITERS`, `HEADROOM_FUZZ_SEED`,
    /// `HEADROOM_FUZZ_TIMEOUT_MS`, `HEADROOM_FUZZ_ARTIFACTS` and `HEADROOM_FUZZ_ONLY` where set.
    pub fn from_env() -> Self {
        let d = FuzzConfig::default();
        FuzzConfig {
            iterations: iterations(d.iterations),
            seed: env_u64(ENV_SEED).unwrap_or(d.seed),
            timeout: env_u64(ENV_TIMEOUT_MS).map_or(d.timeout, Duration::from_millis),
            artifacts: std::env::var_os(ENV_ARTIFACTS).map(PathBuf::from),
            only: env_u64(ENV_ONLY),
            ..d
        }
    }

    /// The same configuration with `iterations` random inputs.
    pub fn with_iterations(mut self, iterations: u64) -> Self {
        self.iterations = iterations;
        self
    }

    /// The same configuration with a per-input time limit of `timeout`.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// Every input of a campaign, by number: the systematic inputs first, then random ones. A pure
/// function of (configuration, name, seeds), so a report's input number reproduces the input.
#[derive(Clone, Debug)]
pub struct Campaign {
    seeds: Vec<Seed>,
    /// (seed index, systematic input) in order.
    systematic: Vec<(usize, Mutated)>,
    stream: u64,
    mutator: Mutator,
    iterations: u64,
}

impl Campaign {
    /// The campaign `name` over `seeds` under `config`.
    pub fn new(config: &FuzzConfig, name: &str, seeds: &[Seed]) -> Self {
        let systematic = if config.systematic {
            seeds
                .iter()
                .enumerate()
                .flat_map(|(i, s)| {
                    systematic(&s.bytes, &s.fields, &config.mutator)
                        .into_iter()
                        .map(move |m| (i, m))
                })
                .collect()
        } else {
            Vec::new()
        };
        Campaign {
            seeds: seeds.to_vec(),
            systematic,
            stream: config.seed ^ hash_name(name),
            mutator: config.mutator,
            iterations: config.iterations,
        }
    }

    /// Number of systematic inputs.
    pub fn systematic_len(&self) -> u64 {
        self.systematic.len() as u64
    }

    /// Total inputs: systematic plus random.
    pub fn len(&self) -> u64 {
        self.systematic_len().saturating_add(self.iterations)
    }

    /// True when the campaign has no input (no seeds, or nothing to run).
    pub fn is_empty(&self) -> bool {
        self.seeds.is_empty() || self.len() == 0
    }

    /// Input number `n` and the recipe that made it (`None` without seeds).
    pub fn input(&self, n: u64) -> Option<Mutated> {
        if let Some((seed, m)) = usize::try_from(n).ok().and_then(|i| self.systematic.get(i)) {
            let name = self.seeds.get(*seed).map_or("", |s| s.name.as_str());
            let mut steps = vec![format!("seed {name:?}")];
            steps.extend(m.steps.iter().cloned());
            return Some(Mutated {
                bytes: m.bytes.clone(),
                steps,
            });
        }
        let mut rng = Rng::for_iteration(self.stream, n);
        let seed = self.seeds.get(rng.index(self.seeds.len()))?;
        let mut steps = vec![format!("seed {:?}", seed.name)];
        let mut base = seed.bytes.clone();
        if self.seeds.len() > 1 && rng.chance(1, 8) {
            // Splice: the head of this seed, the tail of another.
            let other = &self.seeds[rng.index(self.seeds.len())];
            let cut = rng.index(base.len() + 1);
            let from = rng.index(other.bytes.len() + 1);
            base.truncate(cut);
            base.extend_from_slice(&other.bytes[from..]);
            steps.push(format!("splice at {cut} with {:?} from {from}", other.name));
        }
        let m = self.mutator.mutate(&base, &seed.fields, &mut rng);
        steps.extend(m.steps);
        Some(Mutated {
            bytes: m.bytes,
            steps,
        })
    }
}

/// Whether a finding is a panic or a hang.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FindingKind {
    /// The target panicked.
    Panic,
    /// The target did not finish within the time limit.
    Hang,
}

/// One panicking or hanging input, kept for the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// Panic or hang.
    pub kind: FindingKind,
    /// The input number: rerun it with `HEADROOM_FUZZ_ONLY=<input>` (same seed).
    pub input: u64,
    /// How the input was made from its seed, one step per entry.
    pub recipe: Vec<String>,
    /// The panic message and location, or the time limit that was exceeded.
    pub message: String,
    /// Length of the input in bytes.
    pub input_len: usize,
    /// The first bytes of the input in hex (at most 128 bytes).
    pub input_hex: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FindingKind::Panic => "panic",
            FindingKind::Hang => "hang",
        };
        writeln!(f, "{kind} on input #{}: {}", self.input, self.message)?;
        writeln!(f, "    recipe: {}", self.recipe.join("; "))?;
        write!(
            f,
            "    input ({} bytes): {}",
            self.input_len, self.input_hex
        )
    }
}

/// Lowercase hex of the first `max` bytes, with `…` when there is more.
pub fn hex_preview(bytes: &[u8], max: usize) -> String {
    let mut s: String = bytes.iter().take(max).map(|b| format!("{b:02x}")).collect();
    if bytes.len() > max {
        s.push('…');
    }
    s
}

/// What a campaign found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FuzzReport {
    /// The campaign name.
    pub name: String,
    /// The campaign seed (before mixing in the name).
    pub seed: u64,
    /// Systematic inputs run.
    pub systematic_inputs: u64,
    /// Random inputs run.
    pub random_inputs: u64,
    /// Inputs the target accepted (`Ok`).
    pub ok: u64,
    /// Inputs the target refused with a typed error (`Err`).
    pub errors: u64,
    /// Inputs that made the target panic.
    pub panics: u64,
    /// Inputs that did not finish within the time limit.
    pub hangs: u64,
    /// Errors counted by kind: the leading identifier of the error's `Debug` output (an enum
    /// variant name such as `Truncated`).
    pub error_kinds: BTreeMap<String, u64>,
    /// The first panicking and hanging inputs ([`FuzzConfig::max_findings`] at most).
    pub findings: Vec<Finding>,
    /// Longest time one input took (hangs excluded).
    pub slowest: Duration,
    /// The number of that input.
    pub slowest_input: u64,
    /// The per-input time limit used.
    pub timeout: Duration,
    /// Wall time of the whole campaign.
    pub wall: Duration,
    /// Why the campaign stopped before its last input, if it did (too many hangs).
    pub stopped_early: Option<String>,
}

impl FuzzReport {
    /// Inputs run.
    pub fn inputs(&self) -> u64 {
        self.systematic_inputs + self.random_inputs
    }

    /// No panic, no hang, and the campaign ran to the end.
    pub fn is_clean(&self) -> bool {
        self.panics == 0 && self.hangs == 0 && self.stopped_early.is_none()
    }

    /// Panic with the whole report unless [`is_clean`](Self::is_clean): the assertion a fuzz
    /// test ends with.
    #[track_caller]
    pub fn assert_clean(&self) {
        assert!(self.is_clean(), "fuzz campaign failed:\n{self}");
    }

    /// One `key=value` line (prefixed [`SUMMARY_PREFIX`]) that scripts parse.
    pub fn summary_line(&self) -> String {
        format!(
            "{SUMMARY_PREFIX} name={} inputs={} systematic={} random={} ok={} errors={} panics={} hangs={} slowest_ms={:.3} wall_s={:.3} seed={:#x} complete={}",
            self.name,
            self.inputs(),
            self.systematic_inputs,
            self.random_inputs,
            self.ok,
            self.errors,
            self.panics,
            self.hangs,
            self.slowest.as_secs_f64() * 1e3,
            self.wall.as_secs_f64(),
            self.seed,
            self.stopped_early.is_none(),
        )
    }
}

impl fmt::Display for FuzzReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "fuzz {}: {} inputs ({} systematic + {} random), seed {:#x}, {:.2} s",
            self.name,
            self.inputs(),
            self.systematic_inputs,
            self.random_inputs,
            self.seed,
            self.wall.as_secs_f64()
        )?;
        write!(
            f,
            "  ok {}, typed errors {}, panics {}, hangs {} (limit {:.1} s); slowest input #{} took {:.3} ms",
            self.ok,
            self.errors,
            self.panics,
            self.hangs,
            self.timeout.as_secs_f64(),
            self.slowest_input,
            self.slowest.as_secs_f64() * 1e3
        )?;
        if !self.error_kinds.is_empty() {
            let kinds: Vec<String> = self
                .error_kinds
                .iter()
                .map(|(k, n)| format!("{k} {n}"))
                .collect();
            write!(f, "\n  errors by kind: {}", kinds.join(", "))?;
        }
        if let Some(why) = &self.stopped_early {
            write!(f, "\n  stopped early: {why}")?;
        }
        for finding in &self.findings {
            write!(f, "\n  {finding}")?;
        }
        Ok(())
    }
}

/// What the worker reports for one input.
enum Outcome {
    Ok,
    Err(String),
    Panic(String),
}

struct Done {
    outcome: Outcome,
    elapsed: Duration,
}

struct Worker {
    jobs: mpsc::Sender<Arc<[u8]>>,
    done: mpsc::Receiver<Done>,
    handle: thread::JoinHandle<()>,
}

impl Worker {
    /// Close the job queue and wait for the thread, so what the target owns (a temporary
    /// directory, say) is dropped before the campaign returns. Only for a worker that is not
    /// stuck: an abandoned one is never joined.
    fn finish(self) {
        drop(self.jobs);
        let _ = self.handle.join();
    }
}

thread_local! {
    /// The last panic message and location seen by the hook on this (worker) thread.
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn payload_text(payload: &dyn Any) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Install (once per process) a panic hook that keeps worker panics quiet and records their
/// location; panics on any other thread go to the previous hook as before.
fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            let on_worker = thread::current()
                .name()
                .is_some_and(|n| n.starts_with(WORKER_PREFIX));
            if !on_worker {
                previous(info);
                return;
            }
            let at = info
                .location()
                .map(|l| format!(" at {}:{}:{}", l.file(), l.line(), l.column()))
                .unwrap_or_default();
            let text = format!("{}{at}", payload_text(info.payload()));
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(text));
        }));
    });
}

/// The kind of an error: the leading identifier of its `Debug` text (an enum variant), or for
/// anything else (a string error) the first 60 characters of that text without quotes.
fn error_kind<E: fmt::Debug>(e: &E) -> String {
    let text = format!("{e:?}");
    let ident: String = text
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if ident.is_empty() {
        text.trim_matches('"').chars().take(60).collect()
    } else {
        ident
    }
}

fn spawn_worker<F, E>(name: &str, target: Arc<F>) -> std::io::Result<Worker>
where
    F: Fn(&[u8]) -> Result<(), E> + Send + Sync + 'static,
    E: fmt::Debug,
{
    let (jobs, job_rx) = mpsc::channel::<Arc<[u8]>>();
    let (done_tx, done) = mpsc::channel::<Done>();
    let handle = thread::Builder::new()
        .name(format!("{WORKER_PREFIX}{name}"))
        .spawn(move || {
            for input in job_rx {
                let start = Instant::now();
                // The error is classified inside the unwind guard: a panicking Debug impl is
                // a finding too.
                let result = panic::catch_unwind(AssertUnwindSafe(|| {
                    target(&input).map_err(|e| error_kind(&e))
                }));
                let elapsed = start.elapsed();
                let outcome = match result {
                    Ok(Ok(())) => Outcome::Ok,
                    Ok(Err(kind)) => Outcome::Err(kind),
                    Err(payload) => Outcome::Panic(
                        LAST_PANIC
                            .with(|p| p.borrow_mut().take())
                            .unwrap_or_else(|| payload_text(payload.as_ref())),
                    ),
                };
                if done_tx.send(Done { outcome, elapsed }).is_err() {
                    break; // The runner gave up on this worker.
                }
            }
        })?;
    Ok(Worker { jobs, done, handle })
}

/// Fuzz `target` with mutations of `seeds`, all sharing the header `fields`: the systematic
/// inputs, then `iterations` random ones (pass [`iterations`]`(default)` to let
/// `HEADROOM_FUZZ_ITERS` scale it). The other settings come from [`FuzzConfig::from_env`].
///
/// `target` gets each input's bytes and returns `Ok` (accepted) or a typed `Err` (refused);
/// a panic or an input running past the time limit is a finding. Prints
/// [`FuzzReport::summary_line`] to stderr. See the module docs for hang detection and aborts.
pub fn fuzz<S, F, E>(
    name: &str,
    seeds: &[S],
    fields: &[Field],
    iterations: u64,
    target: F,
) -> FuzzReport
where
    S: AsRef<[u8]>,
    F: Fn(&[u8]) -> Result<(), E> + Send + Sync + 'static,
    E: fmt::Debug,
{
    let seeds: Vec<Seed> = seeds
        .iter()
        .enumerate()
        .map(|(i, s)| Seed::new(format!("seed {i}"), s.as_ref()).with_fields(fields.to_vec()))
        .collect();
    let config = FuzzConfig::from_env().with_iterations(iterations);
    run(&config, name, &seeds, target)
}

/// Like [`fuzz`], with each seed carrying its own fields (formats whose field offsets depend
/// on the file, such as an index whose arrays follow a count).
pub fn fuzz_seeds<F, E>(name: &str, seeds: &[Seed], iterations: u64, target: F) -> FuzzReport
where
    F: Fn(&[u8]) -> Result<(), E> + Send + Sync + 'static,
    E: fmt::Debug,
{
    let config = FuzzConfig::from_env().with_iterations(iterations);
    run(&config, name, seeds, target)
}

/// Run the campaign `name` over `seeds` under `config` (the general form of [`fuzz`]).
pub fn run<F, E>(config: &FuzzConfig, name: &str, seeds: &[Seed], target: F) -> FuzzReport
where
    F: Fn(&[u8]) -> Result<(), E> + Send + Sync + 'static,
    E: fmt::Debug,
{
    install_panic_hook();
    let started = Instant::now();
    let campaign = Campaign::new(config, name, seeds);
    let target = Arc::new(target);
    let mut report = FuzzReport {
        name: name.to_string(),
        seed: config.seed,
        systematic_inputs: 0,
        random_inputs: 0,
        ok: 0,
        errors: 0,
        panics: 0,
        hangs: 0,
        error_kinds: BTreeMap::new(),
        findings: Vec::new(),
        slowest: Duration::ZERO,
        slowest_input: 0,
        timeout: config.timeout,
        wall: Duration::ZERO,
        stopped_early: None,
    };
    let numbers: Box<dyn Iterator<Item = u64>> = match config.only {
        Some(n) => Box::new(std::iter::once(n)),
        None => Box::new(0..campaign.len()),
    };
    let mut worker: Option<Worker> = None;
    for n in numbers {
        let Some(input) = campaign.input(n) else {
            break;
        };
        if worker.is_none() {
            match spawn_worker(name, Arc::clone(&target)) {
                Ok(w) => worker = Some(w),
                Err(e) => {
                    report.stopped_early = Some(format!("cannot start a worker thread: {e}"));
                    break;
                }
            }
        }
        let Some(w) = worker.as_ref() else { break };
        let bytes: Arc<[u8]> = input.bytes.into();
        let answer = match w.jobs.send(Arc::clone(&bytes)) {
            Ok(()) => w.done.recv_timeout(config.timeout),
            Err(_) => Err(RecvTimeoutError::Disconnected),
        };
        if n < campaign.systematic_len() {
            report.systematic_inputs += 1;
        } else {
            report.random_inputs += 1;
        }
        let finding = |kind, message| Finding {
            kind,
            input: n,
            recipe: input.steps.clone(),
            message,
            input_len: bytes.len(),
            input_hex: hex_preview(&bytes, 128),
        };
        let found = match answer {
            Ok(done) => {
                if done.elapsed > report.slowest {
                    report.slowest = done.elapsed;
                    report.slowest_input = n;
                }
                match done.outcome {
                    Outcome::Ok => {
                        report.ok += 1;
                        None
                    }
                    Outcome::Err(kind) => {
                        report.errors += 1;
                        *report.error_kinds.entry(kind).or_insert(0) += 1;
                        None
                    }
                    Outcome::Panic(message) => {
                        report.panics += 1;
                        Some(finding(FindingKind::Panic, message))
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                report.hangs += 1;
                worker = None; // Abandon the stuck thread; the next input gets a new one.
                Some(finding(
                    FindingKind::Hang,
                    format!("no answer within {:.1} s", config.timeout.as_secs_f64()),
                ))
            }
            Err(RecvTimeoutError::Disconnected) => {
                report.panics += 1;
                worker = None;
                Some(finding(
                    FindingKind::Panic,
                    "the worker thread died".to_string(),
                ))
            }
        };
        if let Some(f) = found {
            if let Some(dir) = &config.artifacts {
                let path = dir.join(format!("{name}-{n}.bin"));
                // Best effort: a report is still produced if the directory is not writable.
                let _ = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(path, &*bytes));
            }
            if report.findings.len() < config.max_findings {
                report.findings.push(f);
            }
        }
        if report.hangs >= config.max_hangs.max(1) {
            report.stopped_early = Some(format!(
                "{} hangs (each leaves a stuck thread behind)",
                report.hangs
            ));
            break;
        }
    }
    if let Some(w) = worker.take() {
        w.finish();
    }
    report.wall = started.elapsed();
    eprintln!("\n{}", report.summary_line());
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn header_seed() -> Seed {
        // magic "HDR1", then a u32 count, then `count` bytes.
        let mut b = b"HDR1".to_vec();
        b.extend(8u32.to_le_bytes());
        b.extend([1, 2, 3, 4, 5, 6, 7, 8]);
        Seed::new("hdr", b).with_fields([Field::new("count", 4, 4)])
    }

    /// A careful reader of the toy format.
    fn careful(b: &[u8]) -> Result<(), String> {
        let magic = b.get(..4).ok_or("short")?;
        if magic != b"HDR1" {
            return Err("BadMagic".into());
        }
        let count = b.get(4..8).ok_or("short")?;
        let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]) as usize;
        let body = b.get(8..).ok_or("short")?;
        if body.len() != count {
            return Err("Length".into());
        }
        Ok(())
    }

    fn quick() -> FuzzConfig {
        FuzzConfig {
            iterations: 300,
            timeout: Duration::from_secs(5),
            ..FuzzConfig::default()
        }
    }

    #[test]
    fn a_careful_reader_is_clean() {
        let report = run(&quick(), "careful", &[header_seed()], careful);
        report.assert_clean();
        assert!(report.ok > 0 && report.errors > 0, "{report}");
        assert_eq!(report.inputs(), report.ok + report.errors);
        assert_eq!(report.random_inputs, 300);
        assert!(report.systematic_inputs > 0);
        assert!(report.error_kinds.contains_key("Length"), "{report}");
        assert!(report.summary_line().contains("panics=0 hangs=0"));
    }

    #[test]
    fn a_panicking_reader_is_counted_and_recorded() {
        // Trusts the count: slices past the end when it is too large.
        let trusting = |b: &[u8]| -> Result<(), String> {
            let head = b.get(..8).ok_or("short")?;
            let count = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
            let body = &b[8..8 + count];
            std::hint::black_box(body);
            Ok(())
        };
        let report = run(&quick(), "trusting", &[header_seed()], trusting);
        assert!(!report.is_clean());
        assert!(report.panics > 0, "{report}");
        assert_eq!(report.inputs(), report.ok + report.errors + report.panics);
        let first = &report.findings[0];
        assert_eq!(first.kind, FindingKind::Panic);
        assert!(first.message.contains("runner.rs"), "{}", first.message);
        assert!(!first.input_hex.is_empty() || first.input_len == 0);
        assert!(report.to_string().contains("panic on input #"));
        let shown = std::panic::catch_unwind(|| report.assert_clean());
        assert!(shown.is_err());
        // The recorded input number reproduces the same input.
        let again = Campaign::new(&quick(), "trusting", &[header_seed()]).input(first.input);
        assert_eq!(again.map(|m| m.bytes.len()), Some(first.input_len));
    }

    static RELEASE: AtomicBool = AtomicBool::new(false);

    #[test]
    fn a_looping_reader_is_a_hang_and_the_campaign_stops() {
        // Loops (sleeping, so the stuck threads cost no CPU) when the count is 0; the loop is
        // released at the end of the test so no thread outlives it.
        let looping = |b: &[u8]| -> Result<(), String> {
            if b.get(4..8) == Some(&[0, 0, 0, 0]) {
                while !RELEASE.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            careful(b)
        };
        let config = FuzzConfig {
            timeout: Duration::from_millis(100),
            max_hangs: 2,
            ..quick()
        };
        let report = run(&config, "looping", &[header_seed()], looping);
        RELEASE.store(true, Ordering::Relaxed);
        assert_eq!(report.hangs, 2, "{report}");
        assert!(report.stopped_early.is_some());
        assert!(!report.is_clean());
        assert_eq!(report.findings[0].kind, FindingKind::Hang);
        assert!(report.inputs() < Campaign::new(&config, "looping", &[header_seed()]).len());
        // Inputs after the first hang ran on a fresh worker.
        assert!(report.ok + report.errors > 0);
    }

    #[test]
    fn only_runs_one_input_and_artifacts_are_written() {
        let dir = std::env::temp_dir().join(format!("fuzzkit-artifacts-{}", std::process::id()));
        let config = FuzzConfig {
            only: Some(3),
            artifacts: Some(dir.clone()),
            ..quick()
        };
        let report = run(
            &config,
            "only",
            &[header_seed()],
            |_: &[u8]| -> Result<(), ()> { panic!("always") },
        );
        assert_eq!((report.inputs(), report.panics), (1, 1));
        assert_eq!(report.findings[0].input, 3);
        assert!(report.findings[0].message.starts_with("always"));
        assert!(dir.join("only-3.bin").is_file());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn what_the_target_owns_is_dropped_before_run_returns() {
        let owned = Arc::new(());
        let held = Arc::clone(&owned);
        let report = run(&quick(), "owner", &[header_seed()], move |b: &[u8]| {
            let _keep = &held;
            careful(b)
        });
        report.assert_clean();
        assert_eq!(Arc::strong_count(&owned), 1, "the worker was not joined");
    }

    #[test]
    fn campaigns_are_deterministic_per_name_and_seed() {
        let c = quick();
        let a = Campaign::new(&c, "x", &[header_seed()]);
        let b = Campaign::new(&c, "x", &[header_seed()]);
        let other = Campaign::new(&c, "y", &[header_seed()]);
        let n = a.systematic_len() + 5;
        assert_eq!(a.input(n), b.input(n));
        let differs = (n..n + 20).any(|i| a.input(i) != other.input(i));
        assert!(differs);
        assert!(Campaign::new(&c, "x", &[]).is_empty());
        assert_eq!(Campaign::new(&c, "x", &[]).input(500), None);
    }

    #[test]
    fn the_fuzz_entry_point_shares_fields_between_seeds() {
        let seed = header_seed();
        let report = fuzz(
            "entry",
            std::slice::from_ref(&seed.bytes),
            &seed.fields,
            50,
            careful,
        );
        report.assert_clean();
        assert_eq!(report.random_inputs, 50);
        assert_eq!(hex_preview(&[1, 0xAB, 3], 2), "01ab…");
        assert_eq!(error_kind(&"x y"), "x y");
        assert_eq!(error_kind(&std::fmt::Error), "Error");
    }
}
