//! Bench records: the lines of `results.json`, read from benches' `records.jsonl` and from
//! comparison scripts, and the pass that pairs each record with its baseline.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Whether a larger or a smaller value is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Better {
    /// Throughput-like metrics.
    Higher,
    /// Time-like and memory-like metrics.
    Lower,
}

/// One measurement. Same fields and JSON as `headroom_benches::Record` (xtask does not depend
/// on the benches crate so it never needs the whole workspace to build).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Benchmark id, `"<crate>/<what>/<variant>/<size>"`.
    pub bench: String,
    /// What was measured (`"bandwidth"`, `"median_time"`, `"peak_bytes"`, …).
    pub metric: String,
    /// The measured value. JSON has no NaN: serde_json writes a NaN as `null`, so `null`
    /// reads back as NaN (and shows as such in the report) instead of losing the record.
    #[serde(deserialize_with = "null_as_nan")]
    pub value: f64,
    /// Unit of `value`.
    pub unit: String,
    /// The baseline's benchmark id, when there is one.
    #[serde(default)]
    pub baseline: Option<String>,
    /// The baseline's value in the same unit, measured in the same run.
    #[serde(default)]
    pub baseline_value: Option<f64>,
    /// `value / baseline_value`.
    #[serde(default)]
    pub ratio: Option<f64>,
    /// Which direction is better.
    pub better: Better,
}

impl Record {
    /// The crate a record belongs to: the first segment of its id.
    pub fn crate_name(&self) -> &str {
        self.bench.split('/').next().unwrap_or(&self.bench)
    }
}

fn null_as_nan<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// `value / baseline`, when that is a meaningful number.
pub fn ratio(value: f64, baseline: f64) -> Option<f64> {
    let r = value / baseline;
    (baseline != 0.0 && r.is_finite()).then_some(r)
}

/// Parse records, one JSON object per non-empty line; `what` names the source in errors.
pub fn parse_jsonl(text: &str, what: &str) -> Result<Vec<Record>> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).map_err(|source| Error::Json {
                what: format!("{what} line {}", i + 1),
                source,
            })
        })
        .collect()
}

/// The records a run's benches appended to `records.jsonl`; none when the file is absent.
pub fn read_jsonl(path: &Path) -> Result<Vec<Record>> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse_jsonl(&text, &path.display().to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(Error::io("reading", path)(e)),
    }
}

/// Fill `baseline_value` and `ratio` of records that name a baseline measured in the same run
/// (possibly by another tool: a Rust bench against a PyTorch script). A baseline with the same
/// metric and unit is preferred; one with only the same unit is accepted. Returns the ids of
/// baselines that were named but not found, so the caller can say so.
pub fn fill_baselines(records: &mut [Record]) -> Vec<String> {
    let mut missing = Vec::new();
    for i in 0..records.len() {
        let Some(name) = records[i].baseline.clone() else {
            continue;
        };
        if let (Some(b), None) = (records[i].baseline_value, records[i].ratio) {
            records[i].ratio = ratio(records[i].value, b);
            continue;
        }
        if records[i].baseline_value.is_some() {
            continue;
        }
        let (metric, unit) = (&records[i].metric, &records[i].unit);
        let same_metric = records
            .iter()
            .find(|r| r.bench == name && &r.metric == metric && &r.unit == unit);
        let same_unit = || records.iter().find(|r| r.bench == name && &r.unit == unit);
        match same_metric.or_else(same_unit).map(|r| r.value) {
            Some(b) => {
                records[i].baseline_value = Some(b);
                records[i].ratio = ratio(records[i].value, b);
            }
            None => missing.push(name),
        }
    }
    missing.sort();
    missing.dedup();
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(bench: &str, metric: &str, value: f64, unit: &str, baseline: Option<&str>) -> Record {
        Record {
            bench: bench.into(),
            metric: metric.into(),
            value,
            unit: unit.into(),
            baseline: baseline.map(Into::into),
            baseline_value: None,
            ratio: None,
            better: Better::Lower,
        }
    }

    #[test]
    fn json_matches_the_benches_crate_format() {
        let line = r#"{"bench":"amp/x","metric":"peak_bytes","value":10.0,"unit":"bytes","baseline":null,"baseline_value":null,"ratio":null,"better":"lower"}"#;
        let r = &parse_jsonl(line, "test").unwrap()[0];
        assert_eq!(r.bench, "amp/x");
        assert_eq!(r.better, Better::Lower);
        assert_eq!(serde_json::to_string(r).unwrap(), line);
    }

    #[test]
    fn optional_fields_may_be_omitted_and_blank_lines_are_skipped() {
        let text = "\n{\"bench\":\"a/b\",\"metric\":\"m\",\"value\":1,\"unit\":\"u\",\"better\":\"higher\"}\n\n";
        let rs = parse_jsonl(text, "t").unwrap();
        assert_eq!(rs.len(), 1);
        assert_eq!(rs[0].baseline, None);
        assert_eq!(rs[0].better, Better::Higher);
    }

    #[test]
    fn a_null_value_reads_as_nan() {
        let line = r#"{"bench":"a/b","metric":"m","value":null,"unit":"u","better":"lower"}"#;
        assert!(parse_jsonl(line, "t").unwrap()[0].value.is_nan());
    }

    #[test]
    fn malformed_line_names_its_line_number() {
        let err = parse_jsonl("{\"bench\":1}\n", "records.jsonl").unwrap_err();
        assert!(err.to_string().contains("records.jsonl line 1"), "{err}");
    }

    #[test]
    fn missing_file_is_no_records() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read_jsonl(&dir.path().join("records.jsonl"))
            .unwrap()
            .is_empty());
    }

    #[test]
    fn baselines_are_filled_from_records_of_the_same_run() {
        let mut rs = vec![
            rec(
                "attn/fwd/headroom/1k",
                "median_time",
                30.0,
                "ns",
                Some("attn/fwd/torch/1k"),
            ),
            rec("attn/fwd/torch/1k", "peak_bytes", 99.0, "bytes", None),
            rec("attn/fwd/torch/1k", "median_time", 60.0, "ns", None),
            rec(
                "attn/fwd/headroom/2k",
                "median_time",
                1.0,
                "ns",
                Some("attn/fwd/torch/2k"),
            ),
        ];
        let missing = fill_baselines(&mut rs);
        assert_eq!(rs[0].baseline_value, Some(60.0), "same metric preferred");
        assert_eq!(rs[0].ratio, Some(0.5));
        assert_eq!(rs[3].baseline_value, None);
        assert_eq!(missing, ["attn/fwd/torch/2k"]);
    }

    #[test]
    fn a_given_baseline_value_is_kept_and_only_its_ratio_computed() {
        let mut rs = vec![
            rec("a/x", "m", 3.0, "u", Some("a/y")),
            rec("a/y", "m", 1.0, "u", None),
        ];
        rs[0].baseline_value = Some(2.0);
        assert!(fill_baselines(&mut rs).is_empty());
        assert_eq!(rs[0].baseline_value, Some(2.0));
        assert_eq!(rs[0].ratio, Some(1.5));
    }

    #[test]
    fn ratio_against_zero_is_none() {
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(ratio(0.0, 0.0), None);
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
    }

    #[test]
    fn crate_name_is_the_first_segment() {
        assert_eq!(
            rec("tensor/cast/x", "m", 1.0, "u", None).crate_name(),
            "tensor"
        );
        assert_eq!(rec("solo", "m", 1.0, "u", None).crate_name(), "solo");
    }
}
