//! Estimate against measurement: per category, the predicted peak beside the tracker's measured
//! peak, with the relative error — how the trainer checks the estimator (target: within 10%).

use std::fmt::Write as _;

use headroom_tensor::MemoryCategory;
use serde::Serialize;

use crate::per_category::PerCategory;
use crate::units::human_bytes;

/// One category's predicted and measured peak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CategoryComparison {
    /// The category.
    pub category: MemoryCategory,
    /// Predicted peak bytes.
    pub estimated: u64,
    /// Measured peak bytes.
    pub measured: u64,
}

impl CategoryComparison {
    /// `(estimated − measured) / measured`; `None` when nothing was measured.
    pub fn relative_error(&self) -> Option<f64> {
        (self.measured > 0)
            .then(|| (self.estimated as f64 - self.measured as f64) / self.measured as f64)
    }

    /// Whether the estimate is within `tolerance` (0.1 = 10%) of the measurement. Zero
    /// predicted for zero measured counts as within; anything predicted for nothing measured
    /// does not.
    pub fn within(&self, tolerance: f64) -> bool {
        match self.relative_error() {
            Some(e) => e.abs() <= tolerance,
            None => self.estimated == 0,
        }
    }
}

/// Pair each category's `estimated` peak with its `measured` peak (for example
/// [`crate::DeviceSnapshot::peak`]), in report order.
pub fn compare_with_measured(
    estimated: &PerCategory<u64>,
    measured: &PerCategory<u64>,
) -> Vec<CategoryComparison> {
    MemoryCategory::ALL
        .iter()
        .map(|c| CategoryComparison {
            category: *c,
            estimated: estimated[*c],
            measured: measured[*c],
        })
        .collect()
}

/// A text table of a comparison: category, estimated, measured, error.
pub fn comparison_table(rows: &[CategoryComparison]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:>12} {:>12} {:>8}",
        "category", "estimated", "measured", "error"
    );
    for r in rows {
        let error = r
            .relative_error()
            .map_or_else(|| "-".to_owned(), |e| format!("{:+.1}%", e * 100.0));
        let _ = writeln!(
            out,
            "{:<12} {:>12} {:>12} {:>8}",
            r.category.name(),
            human_bytes(r.estimated),
            human_bytes(r.measured),
            error
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_and_tolerance() {
        let mut est = PerCategory::<u64>::default();
        let mut meas = PerCategory::<u64>::default();
        est[MemoryCategory::Parameters] = 110;
        meas[MemoryCategory::Parameters] = 100;
        est[MemoryCategory::Activations] = 80;
        meas[MemoryCategory::Activations] = 100;
        est[MemoryCategory::Workspace] = 5;
        let rows = compare_with_measured(&est, &meas);
        assert_eq!(rows.len(), 7);
        let p = rows[0];
        assert_eq!(p.relative_error(), Some(0.1));
        assert!(p.within(0.1) && !p.within(0.05));
        let a = rows[3];
        assert_eq!(a.relative_error(), Some(-0.2));
        assert!(!a.within(0.1));
        assert!(
            !rows[4].within(0.5),
            "predicted memory that never showed up"
        );
        assert!(rows[6].within(0.0), "zero for zero");
        let table = comparison_table(&rows);
        assert!(
            table.contains("+10.0%") && table.contains("-20.0%"),
            "{table}"
        );
        assert_eq!(table.lines().count(), 8);
    }
}
