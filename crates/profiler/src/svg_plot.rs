//! A stacked-area SVG plot of a [`Timeline`]: memory by category over time, phases as vertical
//! lines, the peak (and the budget, if given) as horizontal lines. Hand-written SVG, no
//! dependencies; it opens in any browser.

use std::fmt::Write as _;

use headroom_tensor::{Device, MemoryCategory};

use crate::per_category::{category_index, PerCategory};
use crate::timeline::{MarkKind, Timeline};
use crate::units::human_bytes;

/// Size and decorations of the plot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlotOptions {
    /// Width in pixels (at least 200 is used).
    pub width: u32,
    /// Height in pixels (at least 120 is used).
    pub height: u32,
    /// Title above the plot; defaults to `"memory on <device>"`.
    pub title: Option<String>,
    /// A budget to draw as a red line.
    pub budget: Option<u64>,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            width: 960,
            height: 420,
            title: None,
            budget: None,
        }
    }
}

/// Colour per category, in [`MemoryCategory::ALL`] order.
const COLOURS: [&str; 7] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
];

const MARGIN_LEFT: f64 = 80.0;
const MARGIN_RIGHT: f64 = 130.0;
const MARGIN_TOP: f64 = 30.0;
const MARGIN_BOTTOM: f64 = 40.0;

/// The replayed step function of `device`, reduced to at most `columns` samples by keeping, in
/// each column of time, the sample with the largest total — so the peak survives reduction
/// exactly. The first and last samples are always kept.
pub fn stacked_columns(
    timeline: &Timeline,
    device: Device,
    columns: usize,
) -> Vec<(u64, PerCategory<u64>)> {
    let samples = timeline.replay(device);
    if samples.len() <= columns.max(2) {
        return samples;
    }
    let duration = timeline.duration_ns().max(1);
    let columns = columns.max(2) as u64;
    let mut out: Vec<(u64, PerCategory<u64>)> = Vec::with_capacity(columns as usize + 2);
    let mut current_column = None;
    for (i, (t, live)) in samples.iter().enumerate() {
        let column = (u128::from(*t) * u128::from(columns) / u128::from(duration)) as u64;
        let last = i + 1 == samples.len();
        match out.last_mut() {
            Some(prev) if current_column == Some(column) && i != 1 && !last => {
                if live.total() > prev.1.total() {
                    *prev = (prev.0, *live);
                }
            }
            _ => {
                out.push((*t, *live));
                current_column = Some(column);
            }
        }
    }
    out
}

fn escape(text: &str) -> String {
    let mut s = String::with_capacity(text.len());
    for ch in text.chars() {
        match ch {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            '\'' => s.push_str("&apos;"),
            c => s.push(c),
        }
    }
    s
}

/// A tick step of 1, 2 or 5 × 10^k that gives about `target` ticks up to `max`.
fn nice_step(max: f64, target: f64) -> f64 {
    let raw = (max / target).max(f64::MIN_POSITIVE);
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

fn format_time(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.1} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// Render the stacked timeline of `device` as an SVG document.
pub fn stacked_timeline_svg(timeline: &Timeline, device: Device, options: &PlotOptions) -> String {
    let width = f64::from(options.width.max(200));
    let height = f64::from(options.height.max(120));
    let plot_w = width - MARGIN_LEFT - MARGIN_RIGHT;
    let plot_h = height - MARGIN_TOP - MARGIN_BOTTOM;
    let samples = stacked_columns(timeline, device, plot_w as usize);
    let duration = timeline.duration_ns().max(1) as f64;
    let peak = samples.iter().map(|(_, l)| l.total()).max().unwrap_or(0);
    let y_top = (peak.max(options.budget.unwrap_or(0)) as f64 * 1.05).max(1.0);
    let x_of = |t: u64| MARGIN_LEFT + t as f64 / duration * plot_w;
    let y_of = |bytes: u64| MARGIN_TOP + plot_h - bytes as f64 / y_top * plot_h;
    let title = options
        .title
        .clone()
        .unwrap_or_else(|| format!("memory on {device}"));

    let mut svg = String::new();
    // `write!` into a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{width}" height="{height}" fill="white"/><text x="{MARGIN_LEFT}" y="18" font-size="14">{}</text>"#,
        escape(&title)
    );

    // Stacked areas, bottom category first.
    let mut present = Vec::new();
    for category in MemoryCategory::ALL {
        let k = category_index(category);
        if samples.iter().all(|(_, l)| l[category] == 0) {
            continue;
        }
        present.push(category);
        let below = |l: &PerCategory<u64>| l.0[..k].iter().sum::<u64>();
        let mut points = String::new();
        for (i, (t, live)) in samples.iter().enumerate() {
            let next_t = samples.get(i + 1).map_or(duration as u64, |(n, _)| *n);
            let top = below(live) + live[category];
            let _ = write!(
                points,
                "{:.2},{:.2} {:.2},{:.2} ",
                x_of(*t),
                y_of(top),
                x_of(next_t),
                y_of(top)
            );
        }
        for (i, (t, live)) in samples.iter().enumerate().rev() {
            let next_t = samples.get(i + 1).map_or(duration as u64, |(n, _)| *n);
            let bottom = below(live);
            let _ = write!(
                points,
                "{:.2},{:.2} {:.2},{:.2} ",
                x_of(next_t),
                y_of(bottom),
                x_of(*t),
                y_of(bottom)
            );
        }
        let _ = writeln!(
            svg,
            r#"<polygon class="{}" fill="{}" fill-opacity="0.85" stroke="none" points="{}"/>"#,
            category.name(),
            COLOURS[k],
            points.trim_end()
        );
    }

    // Axes and ticks.
    let x0 = MARGIN_LEFT;
    let y0 = MARGIN_TOP + plot_h;
    let _ = writeln!(
        svg,
        r#"<line x1="{x0}" y1="{y0}" x2="{:.2}" y2="{y0}" stroke="black"/><line x1="{x0}" y1="{MARGIN_TOP}" x2="{x0}" y2="{y0}" stroke="black"/>"#,
        x0 + plot_w
    );
    let y_step = nice_step(y_top, 5.0);
    let mut tick = 0.0;
    while tick <= y_top {
        let y = MARGIN_TOP + plot_h - tick / y_top * plot_h;
        let _ = writeln!(
            svg,
            r#"<line x1="{:.2}" y1="{y:.2}" x2="{x0}" y2="{y:.2}" stroke="black"/><text x="{:.2}" y="{:.2}" text-anchor="end">{}</text>"#,
            x0 - 4.0,
            x0 - 6.0,
            y + 4.0,
            human_bytes(tick as u64)
        );
        tick += y_step;
    }
    let x_step = nice_step(duration, 6.0);
    let mut tick = 0.0;
    while tick <= duration {
        let x = MARGIN_LEFT + tick / duration * plot_w;
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.2}" y1="{y0}" x2="{x:.2}" y2="{:.2}" stroke="black"/><text x="{x:.2}" y="{:.2}" text-anchor="middle">{}</text>"#,
            y0 + 4.0,
            y0 + 16.0,
            format_time(tick)
        );
        tick += x_step;
    }

    // Peak and budget lines.
    let _ = writeln!(
        svg,
        r##"<line x1="{x0}" y1="{py:.2}" x2="{:.2}" y2="{py:.2}" stroke="#333" stroke-dasharray="4 3"/><text x="{:.2}" y="{:.2}" text-anchor="end">peak {}</text>"##,
        x0 + plot_w,
        x0 + plot_w,
        y_of(peak) - 3.0,
        human_bytes(peak),
        py = y_of(peak)
    );
    if let Some(budget) = options.budget {
        let _ = writeln!(
            svg,
            r##"<line x1="{x0}" y1="{by:.2}" x2="{:.2}" y2="{by:.2}" stroke="#d00" stroke-width="1.5"/><text x="{:.2}" y="{:.2}" fill="#d00">budget {}</text>"##,
            x0 + plot_w,
            x0 + 4.0,
            y_of(budget) - 3.0,
            human_bytes(budget),
            by = y_of(budget)
        );
    }

    // Phase marks.
    for m in timeline.marks.iter().filter(|m| m.kind != MarkKind::End) {
        let x = x_of(m.t_ns);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.2}" y1="{MARGIN_TOP}" x2="{x:.2}" y2="{y0}" stroke="#555" stroke-dasharray="2 3"/><text x="{:.2}" y="{:.2}" transform="rotate(-90 {:.2} {:.2})" fill="#555">{}</text>"##,
            x + 3.0,
            MARGIN_TOP + 4.0,
            x + 3.0,
            MARGIN_TOP + 4.0,
            escape(&m.name)
        );
    }

    // Legend, top category first so it reads like the stack.
    let lx = x0 + plot_w + 12.0;
    for (row, category) in present.iter().rev().enumerate() {
        let ly = MARGIN_TOP + 8.0 + row as f64 * 16.0;
        let _ = writeln!(
            svg,
            r#"<rect x="{lx:.2}" y="{:.2}" width="10" height="10" fill="{}"/><text x="{:.2}" y="{:.2}">{}</text>"#,
            ly - 9.0,
            COLOURS[category_index(*category)],
            lx + 14.0,
            ly,
            category.name()
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            escape(r#"a<b & "c">'"#),
            "a&lt;b &amp; &quot;c&quot;&gt;&apos;"
        );
    }

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(100.0, 5.0), 20.0);
        assert_eq!(nice_step(7.0, 5.0), 2.0);
        assert_eq!(nice_step(1000.0, 4.0), 500.0);
    }
}
