//! Reading criterion's own output and turning it into records.
//!
//! criterion 0.8 writes, per benchmark, `<criterion home>/<group>/<function>/<parameter>/new/`
//! with `benchmark.json` (the ids as given, the throughput) and `estimates.json` (statistics of
//! the time per iteration in ns). Directory names are the ids made filename-safe (`/` becomes
//! `_`), so ids are taken from `benchmark.json`, never from the path. `benchmark.json` is
//! written last, after the estimates; only files modified since the run started are read, so
//! results of benches that did not run this time are never reported.

use std::cmp::Ordering;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::records::{ratio, Better, Record};

/// Functions whose name starts with this are baselines of the other functions of their group
/// and parameter.
pub const BASELINE_PREFIX: &str = "baseline_";

/// What one iteration processes, as criterion serialises `Throughput`.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
pub enum Throughput {
    /// Bytes (reported in binary units by criterion).
    Bytes(u64),
    /// Bytes (reported in decimal units by criterion).
    BytesDecimal(u64),
    /// Bits.
    Bits(u64),
    /// Elements.
    Elements(u64),
    /// Both; the bytes are used.
    ElementsAndBytes {
        /// Elements per iteration.
        elements: u64,
        /// Bytes per iteration.
        bytes: u64,
    },
}

/// One finished criterion benchmark.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// `group_id`.
    pub group: String,
    /// `function_id`.
    pub function: Option<String>,
    /// `value_str`, the parameter.
    pub parameter: Option<String>,
    /// The throughput set for it, if any.
    pub throughput: Option<Throughput>,
    /// Median time per iteration, ns.
    pub median_ns: f64,
}

impl Measurement {
    /// criterion's full id: the present parts joined by `/`.
    pub fn id(&self) -> String {
        [
            Some(&self.group),
            self.function.as_ref(),
            self.parameter.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("/")
    }

    fn is_baseline(&self) -> bool {
        self.function
            .as_deref()
            .is_some_and(|f| f.starts_with(BASELINE_PREFIX))
    }

    /// (metric, value, unit, better) from the median: bandwidth in GB/s (10⁹ bytes/s) for byte
    /// throughputs, Melem/s for element throughputs, otherwise the median time in ns.
    pub fn metric(&self) -> (&'static str, f64, &'static str, Better) {
        let per_ns = |amount: u64| amount as f64 / self.median_ns;
        match self.throughput {
            Some(Throughput::Bytes(b) | Throughput::BytesDecimal(b)) => {
                ("bandwidth", per_ns(b), "GB/s", Better::Higher)
            }
            Some(Throughput::ElementsAndBytes { bytes, .. }) => {
                ("bandwidth", per_ns(bytes), "GB/s", Better::Higher)
            }
            Some(Throughput::Bits(bits)) => {
                ("bandwidth", per_ns(bits) / 8.0, "GB/s", Better::Higher)
            }
            Some(Throughput::Elements(e)) => {
                ("throughput", per_ns(e) * 1e3, "Melem/s", Better::Higher)
            }
            None => ("median_time", self.median_ns, "ns", Better::Lower),
        }
    }
}

#[derive(Deserialize)]
struct BenchmarkJson {
    group_id: String,
    function_id: Option<String>,
    value_str: Option<String>,
    throughput: Option<Throughput>,
}

#[derive(Deserialize)]
struct Estimate {
    point_estimate: f64,
}

#[derive(Deserialize)]
struct EstimatesJson {
    median: Estimate,
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(Error::io("reading", path))?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        what: path.display().to_string(),
        source,
    })
}

/// Every `new/benchmark.json` under `dir`, recursively.
fn benchmark_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("listing", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(Error::io("listing", dir))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(Error::io("inspecting", &path))?;
        if kind.is_dir() {
            benchmark_files(&path, out)?;
        } else if entry.file_name() == "benchmark.json"
            && dir.file_name().is_some_and(|d| d == "new")
        {
            out.push(path);
        }
    }
    Ok(())
}

/// The benchmarks criterion finished under `criterion_dir` since `since`.
pub fn read_measurements(criterion_dir: &Path, since: SystemTime) -> Result<Vec<Measurement>> {
    let mut files = Vec::new();
    benchmark_files(criterion_dir, &mut files)?;
    let mut out = Vec::new();
    for file in files {
        let modified = std::fs::metadata(&file)
            .and_then(|m| m.modified())
            .map_err(Error::io("inspecting", &file))?;
        if modified < since {
            continue;
        }
        let id: BenchmarkJson = read_json(&file)?;
        let estimates: EstimatesJson = read_json(&file.with_file_name("estimates.json"))?;
        out.push(Measurement {
            group: id.group_id,
            function: id.function_id,
            parameter: id.value_str,
            throughput: id.throughput,
            median_ns: estimates.median.point_estimate,
        });
    }
    out.sort_by(compare_measurements);
    Ok(out)
}

/// Report order: by group, then parameter by size (`1MiB` < `64MiB` < `1GiB`), then the
/// functions under test before their baselines.
fn compare_measurements(a: &Measurement, b: &Measurement) -> Ordering {
    a.group
        .cmp(&b.group)
        .then_with(|| compare_parameters(a.parameter.as_deref(), b.parameter.as_deref()))
        .then_with(|| a.is_baseline().cmp(&b.is_baseline()))
        .then_with(|| a.function.cmp(&b.function))
}

/// Size labels compare by their byte count; any other parameters compare with digit runs as
/// numbers, so `seq_512` < `seq_1024`.
fn compare_parameters(a: Option<&str>, b: Option<&str>) -> Ordering {
    match (a, b) {
        (Some(a), Some(b)) => match (size_in_bytes(a), size_in_bytes(b)) {
            (Some(x), Some(y)) => x.cmp(&y).then_with(|| a.cmp(b)),
            _ => natural_key(a).cmp(&natural_key(b)),
        },
        (a, b) => a.cmp(&b),
    }
}

/// `"64MiB"` → 64·2²⁰; `None` for anything that is not a number followed by B/KiB/MiB/GiB.
fn size_in_bytes(label: &str) -> Option<u128> {
    let digits = label.len() - label.trim_start_matches(|c: char| c.is_ascii_digit()).len();
    let (number, unit) = label.split_at(digits);
    let shift = match unit {
        "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return None,
    };
    number.parse::<u128>().ok().map(|n| n << shift)
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Piece<'a> {
    Number(u128),
    Text(&'a str),
}

fn natural_key(s: &str) -> Vec<Piece<'_>> {
    let mut pieces = Vec::new();
    let mut rest = s;
    while let Some(first) = rest.chars().next() {
        let digit = first.is_ascii_digit();
        let end = rest
            .find(|c: char| c.is_ascii_digit() != digit)
            .unwrap_or(rest.len());
        let (piece, tail) = rest.split_at(end);
        pieces.push(match piece.parse() {
            Ok(n) if digit => Piece::Number(n),
            _ => Piece::Text(piece),
        });
        rest = tail;
    }
    pieces
}

/// One record per measurement; a function's baseline is the `baseline_*` function of the same
/// group and parameter (the first by name if a group has several), compared only when both
/// report the same metric.
pub fn to_records(measurements: &[Measurement]) -> Vec<Record> {
    measurements
        .iter()
        .map(|m| {
            let (metric, value, unit, better) = m.metric();
            let baseline = (!m.is_baseline())
                .then(|| {
                    measurements.iter().find(|b| {
                        b.is_baseline()
                            && b.group == m.group
                            && b.parameter == m.parameter
                            && b.metric().0 == metric
                    })
                })
                .flatten();
            let baseline_value = baseline.map(|b| b.metric().1);
            Record {
                bench: m.id(),
                metric: metric.into(),
                value,
                unit: unit.into(),
                baseline: baseline.map(Measurement::id),
                baseline_value,
                ratio: baseline_value.and_then(|b| ratio(value, b)),
                better,
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    fn m(
        function: &str,
        parameter: &str,
        throughput: Option<Throughput>,
        median_ns: f64,
    ) -> Measurement {
        Measurement {
            group: "tensor/cast".into(),
            function: Some(function.into()),
            parameter: Some(parameter.into()),
            throughput,
            median_ns,
        }
    }

    /// Write the two files criterion 0.8 writes for one benchmark (layout and JSON copied from
    /// a real run of benches/benches/tensor.rs).
    pub(crate) fn write_criterion_benchmark(
        root: &Path,
        group: &str,
        function: &str,
        value: &str,
        median: f64,
    ) {
        let dir = root
            .join(group.replace('/', "_"))
            .join(function)
            .join(value)
            .join("new");
        std::fs::create_dir_all(&dir).unwrap();
        let estimate = |v: f64| {
            format!(
                r#"{{"confidence_interval":{{"confidence_level":0.95,"lower_bound":{v},"upper_bound":{v}}},"point_estimate":{v},"standard_error":1.0}}"#
            )
        };
        std::fs::write(
            dir.join("estimates.json"),
            format!(
                r#"{{"mean":{},"median":{},"median_abs_dev":{},"slope":null,"std_dev":{}}}"#,
                estimate(median * 1.1),
                estimate(median),
                estimate(1.0),
                estimate(2.0)
            ),
        )
        .unwrap();
        std::fs::write(
            dir.join("benchmark.json"),
            format!(
                r#"{{"group_id":"{group}","function_id":"{function}","value_str":"{value}","throughput":{{"Bytes":100663296}},"full_id":"{group}/{function}/{value}","directory_name":"x","title":"x"}}"#
            ),
        )
        .unwrap();
    }

    #[test]
    fn reads_criterion_08_layout_and_pairs_baselines() {
        let dir = tempfile::tempdir().unwrap();
        let g = "tensor/cast_f32_to_bf16";
        write_criterion_benchmark(dir.path(), g, "headroom", "64MiB", 10_000_000.0);
        write_criterion_benchmark(
            dir.path(),
            g,
            "baseline_copy_from_slice",
            "64MiB",
            20_000_000.0,
        );
        write_criterion_benchmark(dir.path(), g, "headroom", "1MiB", 50_000.0);
        // A `base/` copy (criterion's saved baseline) must be ignored.
        std::fs::create_dir_all(dir.path().join("x/headroom/1MiB/base")).unwrap();
        std::fs::write(
            dir.path().join("x/headroom/1MiB/base/benchmark.json"),
            "not json",
        )
        .unwrap();

        let since = SystemTime::now() - Duration::from_secs(60);
        let ms = read_measurements(dir.path(), since).unwrap();
        assert_eq!(ms.len(), 3);
        assert_eq!(
            ms[0].parameter.as_deref(),
            Some("1MiB"),
            "sizes in numeric order"
        );
        assert_eq!(
            ms[1].function.as_deref(),
            Some("headroom"),
            "function before baseline"
        );
        assert_eq!(ms[1].median_ns, 10_000_000.0, "the median, not the mean");

        let rs = to_records(&ms);
        let headroom = &rs[1];
        assert_eq!(headroom.bench, "tensor/cast_f32_to_bf16/headroom/64MiB");
        assert_eq!(headroom.metric, "bandwidth");
        assert_eq!(headroom.unit, "GB/s");
        assert!((headroom.value - 10.0663296).abs() < 1e-9);
        assert_eq!(
            headroom.baseline.as_deref(),
            Some("tensor/cast_f32_to_bf16/baseline_copy_from_slice/64MiB")
        );
        assert!((headroom.ratio.unwrap() - 2.0).abs() < 1e-12);
        assert_eq!(rs[0].baseline, None, "no baseline measured at 1MiB");
        assert_eq!(rs[2].baseline, None, "a baseline has no baseline");

        let later = SystemTime::now() + Duration::from_secs(60);
        assert!(
            read_measurements(dir.path(), later).unwrap().is_empty(),
            "stale files skipped"
        );
    }

    #[test]
    fn missing_criterion_dir_is_no_measurements() {
        let dir = tempfile::tempdir().unwrap();
        let ms = read_measurements(&dir.path().join("criterion"), SystemTime::UNIX_EPOCH).unwrap();
        assert!(ms.is_empty());
    }

    #[test]
    fn corrupt_benchmark_json_is_an_error_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("g/f/p/new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(new.join("benchmark.json"), "{").unwrap();
        let err = read_measurements(dir.path(), SystemTime::UNIX_EPOCH).unwrap_err();
        assert!(err.to_string().contains("benchmark.json"), "{err}");
    }

    #[test]
    fn throughput_json_forms_parse() {
        let parse = |s: &str| serde_json::from_str::<Throughput>(s).unwrap();
        assert_eq!(parse(r#"{"Bytes":8}"#), Throughput::Bytes(8));
        assert_eq!(parse(r#"{"Elements":8}"#), Throughput::Elements(8));
        assert_eq!(
            parse(r#"{"ElementsAndBytes":{"elements":2,"bytes":8}}"#),
            Throughput::ElementsAndBytes {
                elements: 2,
                bytes: 8
            }
        );
    }

    #[test]
    fn metrics_follow_the_throughput_kind() {
        let (metric, value, unit, better) =
            m("f", "p", Some(Throughput::Elements(2_000)), 1_000.0).metric();
        assert_eq!(
            (metric, unit, better),
            ("throughput", "Melem/s", Better::Higher)
        );
        assert!(
            (value - 2_000.0).abs() < 1e-9,
            "2000 elements per µs = 2000 Melem/s"
        );
        let (metric, value, unit, better) = m("f", "p", None, 42.0).metric();
        assert_eq!(
            (metric, value, unit, better),
            ("median_time", 42.0, "ns", Better::Lower)
        );
        let (_, value, _, _) = m("f", "p", Some(Throughput::Bits(80)), 10.0).metric();
        assert!((value - 1.0).abs() < 1e-12);
    }

    #[test]
    fn baselines_with_another_metric_are_not_compared() {
        let ms = [
            m("headroom", "1", Some(Throughput::Bytes(10)), 1.0),
            m("baseline_x", "1", None, 1.0),
        ];
        assert_eq!(to_records(&ms)[0].baseline, None);
    }

    #[test]
    fn parameters_order_by_size_then_naturally() {
        let mut ps = ["256MiB", "1MiB", "64MiB", "512KiB", "1GiB"];
        ps.sort_by(|a, b| compare_parameters(Some(a), Some(b)));
        assert_eq!(ps, ["512KiB", "1MiB", "64MiB", "256MiB", "1GiB"]);
        let mut ps = ["seq_1024", "seq_512", "seq_64x2", "b"];
        ps.sort_by(|a, b| compare_parameters(Some(a), Some(b)));
        assert_eq!(ps, ["b", "seq_64x2", "seq_512", "seq_1024"]);
        assert_eq!(compare_parameters(None, Some("1MiB")), Ordering::Less);
    }
}
