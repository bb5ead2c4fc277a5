//! A stacked-area SVG plot of a [`Timeline`]: memory by category over time (or over the
//! allocation events, so that backward and the peak stay visible when most of the wall time is
//! compute), with axis titles, round ticks, a legend, phase names along the top, the peak
//! marked with its value, budget refusals, and an optional budget line. Hand-written SVG, no
//! dependencies; it opens in any browser.
//!
//! Every text is placed by a small layout pass that estimates its box from the font size
//! ([`GLYPH_WIDTH`] × size per character) and drops or moves labels that would overlap (phase
//! names that do not fit are left out; their lines stay).

use std::fmt::Write as _;

use headroom_tensor::{Device, MemoryCategory};

use crate::per_category::{category_index, PerCategory};
use crate::timeline::{MarkKind, Timeline};
use crate::units::human_bytes;

/// What the x axis counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum XAxis {
    /// Wall time since the recording started.
    #[default]
    Time,
    /// The device's allocation and free events, in order (event 0 is the starting state).
    /// Every event gets the same width, so short phases full of allocations (backward, the
    /// optimizer step) are as readable as long compute-bound ones.
    EventIndex,
}

/// Size and decorations of the plot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlotOptions {
    /// Width in pixels (at least 320 is used).
    pub width: u32,
    /// Height in pixels (at least 200 is used).
    pub height: u32,
    /// Title above the plot; defaults to `"memory on <device>"`.
    pub title: Option<String>,
    /// A budget to draw as a red line.
    pub budget: Option<u64>,
    /// Time or allocation events along the x axis.
    pub x_axis: XAxis,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            width: 960,
            height: 440,
            title: None,
            budget: None,
            x_axis: XAxis::Time,
        }
    }
}

/// Colour per category, in [`MemoryCategory::ALL`] order (Tableau 10, as PyTorch's memory
/// viewer uses).
const COLOURS: [&str; 7] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1",
];

/// Estimated advance of one character, as a fraction of the font size (generous for a
/// sans-serif face, so estimated boxes contain the drawn text).
pub const GLYPH_WIDTH: f64 = 0.6;

const TITLE_SIZE: f64 = 14.0;
const AXIS_TITLE_SIZE: f64 = 12.0;
const TICK_SIZE: f64 = 11.0;
const PHASE_SIZE: f64 = 10.0;
const LEGEND_SIZE: f64 = 11.0;
const MARGIN_TOP: f64 = 62.0;
const MARGIN_BOTTOM: f64 = 50.0;
const LEGEND_ROW: f64 = 17.0;

/// The replayed step function of `device`, reduced to at most `columns` samples by keeping, in
/// each column of time, the sample with the largest total — so the peak survives reduction
/// exactly. The first and last samples are always kept.
pub fn stacked_columns(
    timeline: &Timeline,
    device: Device,
    columns: usize,
) -> Vec<(u64, PerCategory<u64>)> {
    let samples = timeline.replay(device);
    let duration = timeline.duration_ns().max(1);
    reduce_columns(&samples, duration, columns)
}

/// Keep, per column of `x` (in `0..=x_max`), the sample with the largest total.
fn reduce_columns(
    samples: &[(u64, PerCategory<u64>)],
    x_max: u64,
    columns: usize,
) -> Vec<(u64, PerCategory<u64>)> {
    if samples.len() <= columns.max(2) {
        return samples.to_vec();
    }
    let columns = columns.max(2) as u64;
    let x_max = x_max.max(1);
    let mut out: Vec<(u64, PerCategory<u64>)> = Vec::with_capacity(columns as usize + 2);
    let mut current_column = None;
    for (i, (x, live)) in samples.iter().enumerate() {
        let column = (u128::from(*x) * u128::from(columns) / u128::from(x_max)) as u64;
        let last = i + 1 == samples.len();
        match out.last_mut() {
            Some(prev) if current_column == Some(column) && i != 1 && !last => {
                if live.total() > prev.1.total() {
                    *prev = (prev.0, *live);
                }
            }
            _ => {
                out.push((*x, *live));
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
            // Characters XML 1.0 does not allow at all.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => s.push('\u{fffd}'),
            c => s.push(c),
        }
    }
    s
}

/// Round ticks from 0 covering `0..=max`: a step of 1, 2 or 5 × 10^k, the smallest that
/// needs at most `max_ticks` ticks (0 included). The last tick is ≥ `max`.
#[derive(Clone, Debug, PartialEq)]
struct Ticks {
    step: f64,
    values: Vec<f64>,
}

impl Ticks {
    fn new(max: f64, max_ticks: usize) -> Ticks {
        let max = if max.is_finite() && max > 0.0 {
            max
        } else {
            1.0
        };
        let intervals = max_ticks.max(2) as f64 - 1.0;
        let raw = max / intervals;
        let mut magnitude = 10f64.powf(raw.log10().floor());
        let step = loop {
            if let Some(m) = [1.0, 2.0, 5.0]
                .iter()
                .map(|m| m * magnitude)
                .find(|s| (max / s - 1e-9).ceil() <= intervals)
            {
                break m;
            }
            magnitude *= 10.0;
        };
        let n = (max / step - 1e-9).ceil().max(1.0) as usize;
        Ticks {
            step,
            values: (0..=n).map(|i| i as f64 * step).collect(),
        }
    }

    fn top(&self) -> f64 {
        self.values.last().copied().unwrap_or(1.0)
    }

    /// A tick value with as many decimals as the step needs.
    fn label(&self, value: f64) -> String {
        let decimals = if self.step >= 1.0 {
            0
        } else {
            (-self.step.log10().floor()) as usize
        };
        format!("{value:.decimals$}")
    }
}

/// A byte unit that makes `max_bytes` read as a number ≥ 1.
fn byte_unit(max_bytes: u64) -> (&'static str, f64) {
    const UNITS: [(&str, f64); 5] = [
        ("TiB", 1_099_511_627_776.0),
        ("GiB", 1_073_741_824.0),
        ("MiB", 1_048_576.0),
        ("KiB", 1024.0),
        ("B", 1.0),
    ];
    UNITS
        .into_iter()
        .find(|(_, scale)| max_bytes as f64 >= *scale)
        .unwrap_or(("B", 1.0))
}

/// A time unit that makes `max_ns` read as a number ≥ 1.
fn time_unit(max_ns: u64) -> (&'static str, f64) {
    const UNITS: [(&str, f64); 4] = [("s", 1e9), ("ms", 1e6), ("µs", 1e3), ("ns", 1.0)];
    UNITS
        .into_iter()
        .find(|(_, scale)| max_ns as f64 >= *scale)
        .unwrap_or(("ns", 1.0))
}

/// How text is anchored at its `x`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Anchor {
    Start,
    Middle,
    End,
}

/// An axis-aligned box: `(left, top, right, bottom)`.
type TextBox = (f64, f64, f64, f64);

/// The estimated box of `text` drawn at baseline `(x, y)` with `size`, rotated by -90° about
/// its anchor point when `vertical`.
fn text_box(text: &str, x: f64, y: f64, size: f64, anchor: Anchor, vertical: bool) -> TextBox {
    let width = text.chars().count() as f64 * GLYPH_WIDTH * size;
    let (before, after) = match anchor {
        Anchor::Start => (0.0, width),
        Anchor::Middle => (width / 2.0, width / 2.0),
        Anchor::End => (width, 0.0),
    };
    if vertical {
        // Rotated -90°: the text runs upwards from (x, y); its height extends to the left.
        (x - size, y - after, x + 0.25 * size, y + before)
    } else {
        (x - before, y - size, x + after, y + 0.25 * size)
    }
}

fn overlaps(a: &TextBox, b: &TextBox) -> bool {
    a.0 < b.2 && b.0 < a.2 && a.1 < b.3 && b.1 < a.3
}

/// The texts of the plot, placed so that none overlaps another.
#[derive(Default)]
struct Texts {
    placed: Vec<(TextBox, String)>,
}

impl Texts {
    /// Place `text` at the first candidate position `(x, y, anchor)` whose box overlaps no
    /// placed text and lies inside `bounds`; `false` if none does.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        text: &str,
        size: f64,
        candidates: &[(f64, f64, Anchor)],
        bounds: TextBox,
        vertical: bool,
        attrs: &str,
    ) -> bool {
        for &(x, y, anchor) in candidates {
            let b = text_box(text, x, y, size, anchor, vertical);
            let inside = b.0 >= bounds.0 && b.1 >= bounds.1 && b.2 <= bounds.2 && b.3 <= bounds.3;
            if inside && !self.placed.iter().any(|(p, _)| overlaps(p, &b)) {
                let anchor = match anchor {
                    Anchor::Start => "start",
                    Anchor::Middle => "middle",
                    Anchor::End => "end",
                };
                let transform = if vertical {
                    format!(r#" transform="rotate(-90 {x:.2} {y:.2})""#)
                } else {
                    String::new()
                };
                self.placed.push((
                    b,
                    format!(
                        r#"<text x="{x:.2}" y="{y:.2}" font-size="{size}" text-anchor="{anchor}"{transform}{attrs}>{}</text>"#,
                        escape(text)
                    ),
                ));
                return true;
            }
        }
        false
    }
}

/// Render the stacked timeline of `device` as an SVG document.
pub fn stacked_timeline_svg(timeline: &Timeline, device: Device, options: &PlotOptions) -> String {
    let width = f64::from(options.width.max(320));
    let height = f64::from(options.height.max(200));
    let budget = options.budget;

    // Samples along x: nanoseconds, or event numbers.
    let replay = timeline.replay(device);
    let event_times: Vec<u64> = timeline.device_events(device).map(|e| e.t_ns).collect();
    let (samples, x_max): (Vec<(u64, PerCategory<u64>)>, u64) = match options.x_axis {
        XAxis::Time => (replay, timeline.duration_ns().max(1)),
        XAxis::EventIndex => {
            let n = replay.len() as u64;
            (
                replay
                    .into_iter()
                    .enumerate()
                    .map(|(i, (_, l))| (i as u64, l))
                    .collect(),
                n.max(1),
            )
        }
    };
    // Where a moment in time falls on the x axis.
    let x_value = |t_ns: u64| -> u64 {
        match options.x_axis {
            XAxis::Time => t_ns,
            XAxis::EventIndex => event_times.partition_point(|t| *t <= t_ns) as u64,
        }
    };

    let present: Vec<MemoryCategory> = MemoryCategory::ALL
        .into_iter()
        .filter(|c| samples.iter().any(|(_, l)| l[*c] > 0))
        .collect();
    let peak_sample = samples
        .iter()
        .enumerate()
        .max_by(|(ia, a), (ib, b)| a.1.total().cmp(&b.1.total()).then(ib.cmp(ia)))
        .map(|(_, s)| *s);
    let peak = peak_sample.map_or(0, |(_, l)| l.total());
    let peak_x = peak_sample.map_or(0, |(x, _)| x);
    let refusals: Vec<_> = timeline
        .refusals
        .iter()
        .filter(|r| r.device == device)
        .collect();

    // Legend lines (top category first, as the stack reads) decide the right margin.
    let mut legend: Vec<(String, Option<&str>)> = present
        .iter()
        .rev()
        .map(|c| (c.name().to_owned(), Some(COLOURS[category_index(*c)])))
        .collect();
    legend.push((format!("peak {}", human_bytes(peak)), None));
    if !refusals.is_empty() {
        legend.push((format!("{} refused", refusals.len()), Some("#d00")));
    }
    let legend_chars = legend
        .iter()
        .map(|(t, _)| t.chars().count())
        .max()
        .unwrap_or(0);
    let margin_right = 30.0 + legend_chars as f64 * GLYPH_WIDTH * LEGEND_SIZE;

    // y axis: unit by magnitude, round ticks in that unit.
    let y_data_max = peak.max(budget.unwrap_or(0));
    let (y_unit, y_scale) = byte_unit(y_data_max);
    let plot_h_guess = height - MARGIN_TOP - MARGIN_BOTTOM;
    let y_ticks = Ticks::new(
        y_data_max as f64 / y_scale,
        ((plot_h_guess / (TICK_SIZE * 2.2)) as usize).clamp(2, 9),
    );
    let y_label_chars = y_ticks
        .values
        .iter()
        .map(|v| y_ticks.label(*v).chars().count())
        .max()
        .unwrap_or(1);
    let margin_left = 30.0 + y_label_chars as f64 * GLYPH_WIDTH * TICK_SIZE + 10.0;
    let plot_w = (width - margin_left - margin_right).max(40.0);
    let plot_h = plot_h_guess;
    let x0 = margin_left;
    let y0 = MARGIN_TOP + plot_h;
    let x1 = x0 + plot_w;
    let y_top = y_ticks.top() * y_scale;
    let y_of = |bytes: u64| y0 - (bytes as f64 / y_top).min(1.0) * plot_h;

    // x axis: unit by magnitude (time) or plain counts, as many ticks as fit their labels.
    let (x_title, x_scale) = match options.x_axis {
        XAxis::Time => {
            let (unit, scale) = time_unit(x_max);
            (format!("time ({unit})"), scale)
        }
        XAxis::EventIndex => ("allocation event #".to_owned(), 1.0),
    };
    let x_ticks = (2..=12)
        .rev()
        .map(|n| Ticks::new(x_max as f64 / x_scale, n))
        .find(|t| {
            let widest = t
                .values
                .iter()
                .map(|v| t.label(*v).chars().count())
                .max()
                .unwrap_or(1) as f64
                * GLYPH_WIDTH
                * TICK_SIZE;
            let spacing = plot_w / (t.values.len().max(2) - 1) as f64;
            spacing >= widest + 12.0
        })
        .unwrap_or_else(|| Ticks::new(x_max as f64 / x_scale, 2));
    let x_top = x_ticks.top() * x_scale;
    let x_of = |x: u64| x0 + (x as f64 / x_top).min(1.0) * plot_w;

    let columns = plot_w as usize;
    let samples = reduce_columns(&samples, x_max, columns);
    let title = options
        .title
        .clone()
        .unwrap_or_else(|| format!("memory on {device}"));

    let mut svg = String::new();
    // `write!` into a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{width}" height="{height}" fill="white"/>"#
    );

    // Stacked areas, bottom category first.
    for category in &present {
        let k = category_index(*category);
        let below = |l: &PerCategory<u64>| l.0[..k].iter().fold(0u64, |a, b| a.saturating_add(*b));
        let mut points = String::new();
        for (i, (x, live)) in samples.iter().enumerate() {
            let next = samples.get(i + 1).map_or(x_max, |(n, _)| *n);
            let top = below(live).saturating_add(live[*category]);
            let _ = write!(
                points,
                "{:.2},{:.2} {:.2},{:.2} ",
                x_of(*x),
                y_of(top),
                x_of(next),
                y_of(top)
            );
        }
        for (i, (x, live)) in samples.iter().enumerate().rev() {
            let next = samples.get(i + 1).map_or(x_max, |(n, _)| *n);
            let bottom = below(live);
            let _ = write!(
                points,
                "{:.2},{:.2} {:.2},{:.2} ",
                x_of(next),
                y_of(bottom),
                x_of(*x),
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

    let mut texts = Texts::default();
    let everywhere = (0.0, 0.0, width, height);

    // Title.
    texts.place(
        &title,
        TITLE_SIZE,
        &[(x0, 20.0, Anchor::Start), (4.0, 20.0, Anchor::Start)],
        everywhere,
        false,
        r#" font-weight="bold""#,
    );

    // Axes, ticks and grid lines.
    let _ = writeln!(
        svg,
        r#"<line x1="{x0:.2}" y1="{y0:.2}" x2="{x1:.2}" y2="{y0:.2}" stroke="black"/><line x1="{x0:.2}" y1="{MARGIN_TOP:.2}" x2="{x0:.2}" y2="{y0:.2}" stroke="black"/>"#
    );
    for v in &y_ticks.values {
        let y = y0 - v / y_ticks.top() * plot_h;
        let _ = writeln!(
            svg,
            r##"<line x1="{:.2}" y1="{y:.2}" x2="{x1:.2}" y2="{y:.2}" stroke="#000" stroke-opacity="0.12"/><line x1="{:.2}" y1="{y:.2}" x2="{x0:.2}" y2="{y:.2}" stroke="black"/>"##,
            x0,
            x0 - 4.0,
        );
        texts.place(
            &y_ticks.label(*v),
            TICK_SIZE,
            &[(x0 - 7.0, y + TICK_SIZE * 0.35, Anchor::End)],
            everywhere,
            false,
            "",
        );
    }
    for v in &x_ticks.values {
        let x = x0 + v / x_ticks.top() * plot_w;
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.2}" y1="{y0:.2}" x2="{x:.2}" y2="{:.2}" stroke="black"/>"#,
            y0 + 4.0
        );
        texts.place(
            &x_ticks.label(*v),
            TICK_SIZE,
            &[(x, y0 + 17.0, Anchor::Middle)],
            everywhere,
            false,
            "",
        );
    }
    texts.place(
        &x_title,
        AXIS_TITLE_SIZE,
        &[(x0 + plot_w / 2.0, y0 + 38.0, Anchor::Middle)],
        everywhere,
        false,
        "",
    );
    texts.place(
        &format!("memory ({y_unit})"),
        AXIS_TITLE_SIZE,
        &[(16.0, MARGIN_TOP + plot_h / 2.0, Anchor::Middle)],
        everywhere,
        true,
        "",
    );

    // Legend, top category first so it reads like the stack; then the peak and refusals.
    let lx = x1 + 14.0;
    for (row, (text, colour)) in legend.iter().enumerate() {
        let ly = MARGIN_TOP + 10.0 + row as f64 * LEGEND_ROW;
        if let Some(colour) = colour {
            let _ = writeln!(
                svg,
                r#"<rect x="{lx:.2}" y="{:.2}" width="10" height="10" fill="{colour}"/>"#,
                ly - 9.0,
            );
        }
        texts.place(
            text,
            LEGEND_SIZE,
            &[(lx + 15.0, ly, Anchor::Start)],
            everywhere,
            false,
            "",
        );
    }

    // Budget line and label.
    let plot_area = (x0, MARGIN_TOP, x1, y0);
    if let Some(budget) = budget {
        let by = y_of(budget);
        let _ = writeln!(
            svg,
            r##"<line x1="{x0:.2}" y1="{by:.2}" x2="{x1:.2}" y2="{by:.2}" stroke="#d00" stroke-width="1.5"/>"##
        );
        let text = format!("budget {}", human_bytes(budget));
        texts.place(
            &text,
            TICK_SIZE,
            &[
                (x0 + 4.0, by - 4.0, Anchor::Start),
                (x0 + 4.0, by + TICK_SIZE + 2.0, Anchor::Start),
                (x1 - 4.0, by - 4.0, Anchor::End),
                (x1 - 4.0, by + TICK_SIZE + 2.0, Anchor::End),
            ],
            plot_area,
            false,
            r##" fill="#d00""##,
        );
    }

    // The peak: a marker with its value beside it, where it fits (it is in the legend anyway).
    if peak > 0 {
        let (px, py) = (x_of(peak_x), y_of(peak));
        let _ = writeln!(
            svg,
            r##"<line x1="{x0:.2}" y1="{py:.2}" x2="{x1:.2}" y2="{py:.2}" stroke="#333" stroke-dasharray="4 3"/><circle cx="{px:.2}" cy="{py:.2}" r="3.5" fill="#111"/>"##
        );
        let text = format!("peak {}", human_bytes(peak));
        let s = TICK_SIZE;
        texts.place(
            &text,
            s,
            &[
                (px + 6.0, py - 5.0, Anchor::Start),
                (px - 6.0, py - 5.0, Anchor::End),
                (px + 6.0, py + s + 3.0, Anchor::Start),
                (px - 6.0, py + s + 3.0, Anchor::End),
                (x1 - 4.0, py - 5.0, Anchor::End),
                (x0 + 4.0, py - 5.0, Anchor::Start),
                (x1 - 4.0, py + s + 3.0, Anchor::End),
                (x0 + 4.0, py + s + 3.0, Anchor::Start),
            ],
            plot_area,
            false,
            r#" font-weight="bold""#,
        );
    }

    // Refused allocations: red ticks along the top of the plot.
    for r in &refusals {
        let x = x_of(x_value(r.t_ns));
        let _ = writeln!(
            svg,
            r##"<path d="M{:.2},{:.2} l4,-7 l-8,0 z" fill="#d00"><title>{}</title></path>"##,
            x,
            MARGIN_TOP,
            escape(&format!(
                "out of budget: {} for {}",
                human_bytes(r.bytes),
                r.category
            ))
        );
    }

    // Phases and marks: a dashed line each (at most one per pixel column), names in two rows
    // above the plot where they fit.
    let band = (x0 - 2.0, 26.0, width - 2.0, MARGIN_TOP);
    let mut last_column = None;
    for m in timeline.marks.iter().filter(|m| m.kind != MarkKind::End) {
        let x = x_of(x_value(m.t_ns));
        let column = x.round() as i64;
        if last_column != Some(column) {
            last_column = Some(column);
            let dash = if m.kind == MarkKind::Begin {
                "4 3"
            } else {
                "1 3"
            };
            let _ = writeln!(
                svg,
                r##"<line x1="{x:.2}" y1="{MARGIN_TOP:.2}" x2="{x:.2}" y2="{y0:.2}" stroke="#555" stroke-dasharray="{dash}"><title>{}</title></line>"##,
                escape(&m.name)
            );
        }
        texts.place(
            &m.name,
            PHASE_SIZE,
            &[
                (x + 2.0, MARGIN_TOP - 4.0, Anchor::Start),
                (x + 2.0, MARGIN_TOP - 18.0, Anchor::Start),
            ],
            band,
            false,
            r##" fill="#444""##,
        );
    }

    for (_, text) in &texts.placed {
        svg.push_str(text);
        svg.push('\n');
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::label::LabelId;
    use crate::timeline::{EventKind, MemoryEvent, PhaseMark, Refusal};

    #[test]
    fn escapes_markup() {
        assert_eq!(
            escape("a<b & \"c\">'\u{1}"),
            "a&lt;b &amp; &quot;c&quot;&gt;&apos;\u{fffd}"
        );
    }

    #[test]
    fn ticks_are_round_cover_the_range_and_are_few() {
        for max in [
            0.0, 0.3, 1.0, 7.0, 9.99, 10.0, 10.01, 99.0, 123.4, 1000.0, 1024.0, 3.7e6, 1e-3,
        ] {
            for max_ticks in 2..12 {
                let t = Ticks::new(max, max_ticks);
                // 1, 2 or 5 times a power of ten.
                let mantissa = t.step / 10f64.powf(t.step.log10().floor());
                assert!(
                    [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
                    "step {} for {max}",
                    t.step
                );
                assert_eq!(t.values[0], 0.0);
                assert!(t.top() >= max, "{max}: top {}", t.top());
                assert!(
                    t.values.len() <= max_ticks.max(2),
                    "{max}/{max_ticks}: {:?}",
                    t
                );
                // The smallest such step: one step smaller would need too many ticks.
                if max > 0.0 && t.values.len() > 2 {
                    assert!(t.top() - t.step < max + 1e-9);
                }
                for (i, v) in t.values.iter().enumerate() {
                    assert!((v - i as f64 * t.step).abs() < 1e-9);
                }
            }
        }
        assert_eq!(
            Ticks::new(100.0, 6).values,
            [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]
        );
        assert_eq!(Ticks::new(7.0, 5).step, 2.0);
        assert_eq!(Ticks::new(1000.0, 5).step, 500.0);
        let small = Ticks::new(0.3, 4);
        assert_eq!(small.step, 0.1);
        assert_eq!(small.label(0.30000000000000004), "0.3");
        assert_eq!(Ticks::new(2000.0, 3).label(1000.0), "1000");
    }

    #[test]
    fn units_follow_magnitude() {
        assert_eq!(byte_unit(100).0, "B");
        assert_eq!(byte_unit(2048).0, "KiB");
        assert_eq!(byte_unit(5 << 20).0, "MiB");
        assert_eq!(byte_unit(3 << 30).0, "GiB");
        assert_eq!(time_unit(999).0, "ns");
        assert_eq!(time_unit(2_000_000).0, "ms");
        assert_eq!(time_unit(12_000_000_000).0, "s");
    }

    /// A timeline with `n` alloc/free pairs on the CPU, phases and marks.
    fn sample_timeline(n: u64, label: &str) -> Timeline {
        let label = LabelId::intern(label);
        let mut t = Timeline::default();
        let mut live = PerCategory::<u64>::default();
        let mut time = 0;
        for i in 0..n {
            for (kind, category, bytes) in [
                (EventKind::Alloc, MemoryCategory::Parameters, 3 << 20),
                (EventKind::Alloc, MemoryCategory::Activations, (i + 1) << 20),
                (EventKind::Free, MemoryCategory::Activations, (i + 1) << 20),
            ] {
                time += 1000 + i * 10_000;
                match kind {
                    EventKind::Alloc => live[category] += bytes,
                    EventKind::Free => live[category] -= bytes,
                }
                t.events.push(MemoryEvent {
                    t_ns: time,
                    kind,
                    device: Device::Cpu,
                    category,
                    label,
                    bytes,
                    category_live: live[category],
                    device_live: live.total(),
                });
            }
            t.marks.push(PhaseMark {
                t_ns: time,
                name: format!("step {i} <&>"),
                kind: MarkKind::Instant,
            });
        }
        t.marks.insert(
            0,
            PhaseMark {
                t_ns: 0,
                name: "forward".into(),
                kind: MarkKind::Begin,
            },
        );
        t.refusals.push(Refusal {
            t_ns: time / 2,
            device: Device::Cpu,
            category: MemoryCategory::Activations,
            label,
            bytes: 1 << 30,
            device_live: 5 << 20,
            budget: 64 << 20,
        });
        t
    }

    /// A small XML well-formedness check: balanced, properly nested tags; quoted attributes;
    /// no raw `<` or stray `&` in text or attribute values.
    fn check_xml(doc: &str) -> Result<usize, String> {
        let valid_entity = |rest: &str| -> bool {
            ["amp;", "lt;", "gt;", "quot;", "apos;"]
                .iter()
                .any(|e| rest.starts_with(e))
                || (rest.starts_with('#') && rest.find(';').is_some_and(|i| i > 1 && i < 10))
        };
        let check_text = |text: &str| -> Result<(), String> {
            for (i, _) in text.match_indices('&') {
                if !valid_entity(&text[i + 1..]) {
                    return Err(format!("stray & in {text:?}"));
                }
            }
            if text.contains('<') || text.contains('>') {
                return Err(format!("raw markup character in {text:?}"));
            }
            Ok(())
        };
        let mut stack: Vec<String> = Vec::new();
        let mut rest = doc;
        let mut elements = 0;
        while let Some(open) = rest.find('<') {
            check_text(&rest[..open])?;
            let close = rest[open..].find('>').ok_or("unterminated tag")? + open;
            let tag = &rest[open + 1..close];
            rest = &rest[close + 1..];
            if let Some(name) = tag.strip_prefix('/') {
                let top = stack.pop().ok_or(format!("</{name}> with nothing open"))?;
                if top != name.trim() {
                    return Err(format!("</{name}> closes <{top}>"));
                }
                continue;
            }
            let self_closing = tag.ends_with('/');
            let body = tag.trim_end_matches('/');
            let name_end = body.find(char::is_whitespace).unwrap_or(body.len());
            let name = &body[..name_end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
                return Err(format!("bad tag name {name:?}"));
            }
            // Attributes: name="value" pairs.
            let mut attrs = body[name_end..].trim();
            while !attrs.is_empty() {
                let eq = attrs
                    .find('=')
                    .ok_or(format!("attribute without value in <{name}>"))?;
                let value = attrs[eq + 1..]
                    .strip_prefix('"')
                    .ok_or(format!("unquoted attribute in <{name}>"))?;
                let end = value.find('"').ok_or("unterminated attribute")?;
                check_text(&value[..end])?;
                attrs = value[end + 1..].trim_start();
            }
            elements += 1;
            if !self_closing {
                stack.push(name.to_owned());
            }
        }
        check_text(rest.trim())?;
        if !stack.is_empty() {
            return Err(format!("unclosed {stack:?}"));
        }
        Ok(elements)
    }

    /// The boxes of every `<text>` in `svg`, estimated from its attributes.
    fn text_boxes(svg: &str) -> Vec<(TextBox, String)> {
        let attr = |tag: &str, name: &str| -> Option<String> {
            let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
            let end = tag[start..].find('"')? + start;
            Some(tag[start..end].to_owned())
        };
        let mut boxes = Vec::new();
        for piece in svg.split("<text ").skip(1) {
            let tag_end = piece.find('>').unwrap();
            let tag = format!(" {}", &piece[..tag_end]);
            let content = &piece[tag_end + 1..piece.find("</text>").unwrap()];
            let unescaped = content
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&quot;", "\"")
                .replace("&apos;", "'")
                .replace("&amp;", "&");
            let num = |n: &str| attr(&tag, n).unwrap().parse::<f64>().unwrap();
            let anchor = match attr(&tag, "text-anchor").as_deref() {
                Some("middle") => Anchor::Middle,
                Some("end") => Anchor::End,
                _ => Anchor::Start,
            };
            let vertical = attr(&tag, "transform").is_some_and(|t| t.starts_with("rotate(-90"));
            boxes.push((
                text_box(
                    &unescaped,
                    num("x"),
                    num("y"),
                    num("font-size"),
                    anchor,
                    vertical,
                ),
                unescaped,
            ));
        }
        boxes
    }

    fn assert_readable(svg: &str, width: f64, height: f64) {
        check_xml(svg).unwrap_or_else(|e| panic!("not well-formed: {e}\n{svg}"));
        let boxes = text_boxes(svg);
        for (i, (a, ta)) in boxes.iter().enumerate() {
            assert!(
                a.0 >= -0.01 && a.1 >= -0.01 && a.2 <= width + 0.01 && a.3 <= height + 0.01,
                "{ta:?} leaves the picture: {a:?}"
            );
            for (b, tb) in &boxes[i + 1..] {
                assert!(!overlaps(a, b), "{ta:?} {a:?} overlaps {tb:?} {b:?}");
            }
        }
    }

    #[test]
    fn plot_is_well_formed_and_no_text_overlaps() {
        for (n, label, width, height, axis) in [
            (3, "block <0> & \"x\"", 960, 440, XAxis::Time),
            (40, "l", 960, 440, XAxis::EventIndex),
            (200, "l", 320, 200, XAxis::Time),
            (12, "l", 600, 300, XAxis::EventIndex),
            (0, "l", 960, 440, XAxis::Time),
        ] {
            let t = sample_timeline(n, label);
            let options = PlotOptions {
                width,
                height,
                title: Some("run <1> & co".into()),
                budget: Some(64 << 20),
                x_axis: axis,
            };
            let svg = stacked_timeline_svg(&t, Device::Cpu, &options);
            assert_readable(&svg, f64::from(width), f64::from(height));
            assert!(svg.contains(">run &lt;1&gt; &amp; co</text>"));
            assert!(svg.contains(">memory (MiB)</text>"), "{svg}");
            let x_title = match axis {
                XAxis::Time => "time (",
                XAxis::EventIndex => ">allocation event #</text>",
            };
            assert!(svg.contains(x_title));
            if n > 0 {
                assert!(svg.contains(r#"class="params""#));
                assert!(svg.contains("1 refused"));
                // The peak: 3 MiB of parameters per step plus the largest activation.
                let peak = (3 * n + n) << 20;
                assert!(
                    svg.contains(&format!("peak {}", human_bytes(peak))),
                    "{svg}"
                );
            }
        }
    }

    #[test]
    fn phase_names_that_do_not_fit_are_left_out() {
        let t = sample_timeline(200, "l");
        let svg = stacked_timeline_svg(&t, Device::Cpu, &PlotOptions::default());
        let shown = svg.matches("\"#444\">step ").count();
        assert!(shown > 0 && shown < 200, "{shown} of 200 step names shown");
        // Every line stays, one per pixel column at most.
        assert!(svg.matches("stroke-dasharray=\"1 3\"").count() > shown);
    }

    #[test]
    fn event_index_mode_spaces_events_evenly() {
        // Two events close together after a long pause: by time the second one is squeezed
        // into the last pixels; by event index each gets the same share of the width.
        let label = LabelId::intern("x");
        let mut t = Timeline::default();
        for (i, (t_ns, kind, live)) in [
            (1_000_000_000u64, EventKind::Alloc, 100u64),
            (1_000_000_100, EventKind::Alloc, 300),
            (1_000_000_200, EventKind::Free, 100),
        ]
        .into_iter()
        .enumerate()
        {
            t.events.push(MemoryEvent {
                t_ns,
                kind,
                device: Device::Cpu,
                category: MemoryCategory::Activations,
                label,
                bytes: if i == 1 { 200 } else { 100 },
                category_live: live,
                device_live: live,
            });
        }
        let options = PlotOptions {
            x_axis: XAxis::EventIndex,
            ..PlotOptions::default()
        };
        let svg = stacked_timeline_svg(&t, Device::Cpu, &options);
        assert_readable(&svg, 960.0, 440.0);
        // Event numbers on the x axis: ticks 0..=4 (4 samples), peak marked.
        assert!(svg.contains(">allocation event #</text>"));
        assert!(svg.contains("peak 300 B"));
        let polygon = svg.split("points=\"").nth(1).unwrap();
        let xs: Vec<f64> = polygon
            .split('"')
            .next()
            .unwrap()
            .split_whitespace()
            .map(|p| p.split(',').next().unwrap().parse().unwrap())
            .collect();
        let mut distinct = xs.clone();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        let gaps: Vec<f64> = distinct.windows(2).map(|w| w[1] - w[0]).collect();
        let (lo, hi) = gaps
            .iter()
            .fold((f64::MAX, 0f64), |(l, h), g| (l.min(*g), h.max(*g)));
        assert!(hi - lo < 0.05, "uneven event spacing {gaps:?}");
        // By time the same events collapse into a sliver at the right edge.
        let by_time = stacked_timeline_svg(&t, Device::Cpu, &PlotOptions::default());
        assert!(by_time.contains(">time (s)</text>"), "{by_time}");
    }

    #[test]
    fn xml_checker_catches_errors() {
        assert!(check_xml("<a><b/></a>").is_ok());
        assert!(check_xml("<a>x &amp; y</a>").is_ok());
        assert!(check_xml("<a><b></a>").is_err());
        assert!(check_xml("<a>x & y</a>").is_err());
        assert!(check_xml("<a x=1/>").is_err());
        assert!(check_xml("<a x=\"<\"/>").is_err());
        assert!(check_xml("<a>").is_err());
    }
}
