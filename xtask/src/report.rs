//! The readable side of a bench run: `report.md`, one table per crate.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::records::{Better, Record};

/// Context printed above the tables.
pub struct Header {
    /// The command that produced the report.
    pub command: String,
    /// When it ran, UTC, `YYYY-MM-DD HH:MM:SS`.
    pub when: String,
    /// The machine, in words.
    pub machine: String,
}

/// The markdown report: crates in name order, records in the order given within each crate.
pub fn render(header: &Header, records: &[Record]) -> String {
    let mut by_crate: BTreeMap<&str, Vec<&Record>> = BTreeMap::new();
    for r in records {
        by_crate.entry(r.crate_name()).or_default().push(r);
    }
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# headroom benchmark report\n");
    let _ = writeln!(out, "- command: `{}`", header.command);
    let _ = writeln!(out, "- when: {} UTC", header.when);
    let _ = writeln!(out, "- machine: {}", header.machine);
    let _ = writeln!(
        out,
        "- ratio = value / baseline value, measured in the same run; ↑ higher is better, ↓ lower is better"
    );
    if records.is_empty() {
        let _ = writeln!(out, "\nNo results were recorded.");
    }
    for (name, records) in by_crate {
        let _ = writeln!(out, "\n## {name}\n");
        let _ = writeln!(out, "| bench | value | unit | baseline | ratio |");
        let _ = writeln!(out, "|---|---:|---|---|---:|");
        for r in records {
            let arrow = match r.better {
                Better::Higher => "↑",
                Better::Lower => "↓",
            };
            let baseline = r
                .baseline
                .as_deref()
                .map(|b| shorten(&r.bench, b))
                .unwrap_or_default();
            let ratio = r.ratio.map(|x| format!("{x:.2}")).unwrap_or_default();
            let _ = writeln!(
                out,
                "| {} | {} {arrow} | {} | {} | {} |",
                r.bench,
                format_value(r.value),
                r.unit,
                baseline,
                ratio
            );
        }
    }
    out
}

/// The baseline id without the group prefix it shares with the bench, so a row reads
/// `tensor/cast/headroom/64MiB | … | baseline_copy/64MiB`.
fn shorten(bench: &str, baseline: &str) -> String {
    let common: usize = bench
        .split_inclusive('/')
        .zip(baseline.split_inclusive('/'))
        .take_while(|(a, b)| a == b && a.ends_with('/'))
        .map(|(a, _)| a.len())
        .sum();
    if common == 0 || common == baseline.len() {
        baseline.to_string()
    } else {
        format!("…/{}", &baseline[common..])
    }
}

/// Three significant digits for small values, whole numbers for large ones.
pub fn format_value(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        format!("{v}")
    } else if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// `YYYY-MM-DD HH:MM:SS` of seconds since the Unix epoch (UTC; civil-from-days, Howard Hinnant's
/// algorithm, valid for any date after 1970).
pub fn utc_timestamp(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// CPU model (from `/proc/cpuinfo` where there is one), thread count and instruction set: the
/// widest level the CPU has, and the one headroom's kernels run at when `HEADROOM_CPU_ISA`
/// caps it (the benches inherit the variable).
pub fn machine_description() -> String {
    let threads = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model =
        headroom_tensor::isa::cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string());
    format!(
        "{model}, {threads} threads available, ISA {}",
        headroom_tensor::isa::describe()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_line_names_the_instruction_set() {
        let line = machine_description();
        let level = headroom_tensor::isa::active().to_string();
        assert!(line.contains(&format!("ISA {level}")), "{line}");
    }

    fn rec(bench: &str, value: f64, baseline: Option<&str>, ratio: Option<f64>) -> Record {
        Record {
            bench: bench.into(),
            metric: "bandwidth".into(),
            value,
            unit: "GB/s".into(),
            baseline: baseline.map(Into::into),
            baseline_value: ratio.map(|r| value / r),
            ratio,
            better: Better::Higher,
        }
    }

    #[test]
    fn one_table_per_crate_with_ratios() {
        let header = Header {
            command: "cargo xtask bench --quick".into(),
            when: "2026-01-01 00:00:00".into(),
            machine: "test".into(),
        };
        let records = [
            rec(
                "tensor/cast/headroom/64MiB",
                12.345,
                Some("tensor/cast/baseline_copy/64MiB"),
                Some(1.234),
            ),
            rec("tensor/cast/baseline_copy/64MiB", 10.0, None, None),
            rec("amp/scaler/headroom", 0.5, None, None),
        ];
        let md = render(&header, &records);
        let amp = md.find("## amp").unwrap();
        let tensor = md.find("## tensor").unwrap();
        assert!(amp < tensor, "crates in name order");
        assert!(
            md.contains(
                "| tensor/cast/headroom/64MiB | 12.35 ↑ | GB/s | …/baseline_copy/64MiB | 1.23 |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| tensor/cast/baseline_copy/64MiB | 10.00 ↑ | GB/s |  |  |"),
            "{md}"
        );
        assert!(md.contains("cargo xtask bench --quick"));
    }

    #[test]
    fn empty_run_says_so() {
        let header = Header {
            command: "c".into(),
            when: "w".into(),
            machine: "m".into(),
        };
        assert!(render(&header, &[]).contains("No results"));
    }

    #[test]
    fn shorten_keeps_unrelated_baselines_whole() {
        assert_eq!(
            shorten("attn/fwd/headroom/1k", "torch/attn/1k"),
            "torch/attn/1k"
        );
        assert_eq!(shorten("a/b/c", "a/b/d"), "…/d");
    }

    #[test]
    fn values_are_formatted_by_magnitude() {
        assert_eq!(format_value(123456.7), "123457");
        assert_eq!(format_value(123.45), "123.5");
        assert_eq!(format_value(1.2345), "1.23");
        assert_eq!(format_value(0.012345), "0.012");
    }

    #[test]
    fn timestamps_are_utc_calendar_dates() {
        assert_eq!(utc_timestamp(0), "1970-01-01 00:00:00");
        assert_eq!(utc_timestamp(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc_timestamp(1_798_761_599), "2026-12-31 23:59:59");
    }
}
