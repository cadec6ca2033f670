//! A small SVG line-chart writer for the bench plots: log-scale x, linear or log-scale y,
//! axes with ticks and labels, one polyline with markers per series, and a legend.
//!
//! Invariants: every coordinate written is finite (points that cannot be placed on a log
//! axis, i.e. <= 0, are left out); text is XML-escaped; the output is one standalone `<svg>`.

use std::fmt::Write as _;

/// One named line.
#[derive(Clone, Debug)]
pub(super) struct Series {
    /// Legend text.
    pub(super) name: String,
    /// `(x, y)` points, in drawing order.
    pub(super) points: Vec<(f64, f64)>,
}

/// A chart with a log-scale x axis.
#[derive(Clone, Debug)]
pub(super) struct Chart {
    /// Title above the plot.
    pub(super) title: String,
    /// Label under the x axis.
    pub(super) x_label: String,
    /// Label beside the y axis.
    pub(super) y_label: String,
    /// Log-scale y axis (otherwise linear from 0).
    pub(super) log_y: bool,
    /// The lines.
    pub(super) series: Vec<Series>,
}

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 48.0;
const BOTTOM: f64 = 64.0;
const COLORS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
];

/// One axis: maps data values to pixels.
struct Axis {
    log: bool,
    /// Data range (log10 of it on a log axis).
    lo: f64,
    hi: f64,
    /// Pixel range.
    from: f64,
    to: f64,
    ticks: Vec<f64>,
}

impl Axis {
    fn new(values: &[f64], log: bool, from: f64, to: f64) -> Axis {
        let (lo, hi, ticks) = if log {
            let logs: Vec<f64> = values
                .iter()
                .filter(|v| v.is_finite() && **v > 0.0)
                .map(|v| v.log10())
                .collect();
            let lo = logs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = logs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let (lo, hi) = if lo.is_finite() {
                (lo.floor(), hi.ceil().max(lo.floor() + 1.0))
            } else {
                (0.0, 1.0)
            };
            let ticks = (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect();
            (lo, hi, ticks)
        } else {
            let max = values
                .iter()
                .copied()
                .filter(|v| v.is_finite())
                .fold(0.0, f64::max);
            let step = nice_step(if max > 0.0 { max / 5.0 } else { 0.2 });
            let top = ((max / step).ceil() * step).max(step);
            let n = (top / step).round() as usize;
            (0.0, top, (0..=n).map(|i| i as f64 * step).collect())
        };
        Axis {
            log,
            lo,
            hi,
            from,
            to,
            ticks,
        }
    }

    /// Spacing of the ticks of a linear axis.
    fn step(&self) -> f64 {
        self.ticks.get(1).copied().unwrap_or(1.0)
    }

    /// Pixel of `v`, or None if it cannot be placed (<= 0 on a log axis, not finite).
    fn pixel(&self, v: f64) -> Option<f64> {
        let d = if self.log {
            (v > 0.0).then(|| v.log10())?
        } else {
            v
        };
        let p = self.from + (d - self.lo) / (self.hi - self.lo) * (self.to - self.from);
        p.is_finite().then_some(p)
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * mag)
}

/// A tick label with as many decimals as `step` (the tick spacing) needs, trailing zeros cut.
fn label(v: f64, step: f64) -> String {
    let decimals = if step > 0.0 && step < 1.0 {
        (-step.log10().floor()) as usize
    } else {
        0
    };
    let s = format!("{v:.decimals$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        s
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub(super) fn svg(&self) -> String {
        let xs: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .collect();
        let ys: Vec<f64> = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .collect();
        let x = Axis::new(&xs, true, LEFT, WIDTH - RIGHT);
        let y = Axis::new(&ys, self.log_y, HEIGHT - BOTTOM, TOP);
        let mut o = String::new();
        // `write!` into a String cannot fail.
        let _ = writeln!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            o,
            r#"<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            o,
            r#"<text x="{}" y="24" text-anchor="middle" font-size="15">{}</text>"#,
            (LEFT + WIDTH - RIGHT) / 2.0,
            escape(&self.title)
        );
        // Grid and ticks.
        let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP);
        for t in &x.ticks {
            if let Some(px) = x.pixel(*t) {
                let _ = writeln!(
                    o,
                    "<line x1=\"{px:.1}\" y1=\"{y1}\" x2=\"{px:.1}\" y2=\"{y0}\" stroke=\"#e0e0e0\"/>\n\
                     <line x1=\"{px:.1}\" y1=\"{y0}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
                     <text x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>",
                    y0 + 5.0,
                    y0 + 19.0,
                    label(*t, *t)
                );
            }
        }
        for t in &y.ticks {
            if let Some(py) = y.pixel(*t) {
                let _ = writeln!(
                    o,
                    "<line x1=\"{x0}\" y1=\"{py:.1}\" x2=\"{x1}\" y2=\"{py:.1}\" stroke=\"#e0e0e0\"/>\n\
                     <line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x0}\" y2=\"{py:.1}\" stroke=\"black\"/>\n\
                     <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                    x0 - 5.0,
                    x0 - 8.0,
                    py + 4.0,
                    label(*t, if y.log { *t } else { y.step() })
                );
            }
        }
        // Axes and their labels.
        let _ = writeln!(
            o,
            "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"black\"/>\n\
             <line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\" stroke=\"black\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
             <text x=\"18\" y=\"{:.1}\" text-anchor=\"middle\" transform=\"rotate(-90 18 {:.1})\">{}</text>",
            (x0 + x1) / 2.0,
            HEIGHT - 18.0,
            escape(&self.x_label),
            (y0 + y1) / 2.0,
            (y0 + y1) / 2.0,
            escape(&self.y_label)
        );
        // Lines, markers, legend.
        for (i, s) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = s
                .points
                .iter()
                .filter_map(|(px, py)| Some((x.pixel(*px)?, y.pixel(*py)?)))
                .collect();
            let path: Vec<String> = pts.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
            let _ = writeln!(
                o,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for (a, b) in &pts {
                let _ = writeln!(
                    o,
                    r#"<circle cx="{a:.1}" cy="{b:.1}" r="3.5" fill="{color}"/>"#
                );
            }
            let ly = TOP + 10.0 + 22.0 * i as f64;
            let lx = WIDTH - RIGHT + 16.0;
            let _ = writeln!(
                o,
                "<line x1=\"{lx}\" y1=\"{ly}\" x2=\"{:.1}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"2\"/>\n\
                 <circle cx=\"{:.1}\" cy=\"{ly}\" r=\"3.5\" fill=\"{color}\"/>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
                lx + 28.0,
                lx + 14.0,
                lx + 34.0,
                ly + 4.0,
                escape(&s.name)
            );
        }
        o.push_str("</svg>\n");
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chart(log_y: bool, points: Vec<(f64, f64)>) -> Chart {
        Chart {
            title: "t <&>".to_owned(),
            x_label: "x".to_owned(),
            y_label: "y".to_owned(),
            log_y,
            series: vec![
                Series {
                    name: "zmq-tcp".to_owned(),
                    points: points.clone(),
                },
                Series {
                    name: "zmq-ipc".to_owned(),
                    points,
                },
            ],
        }
    }

    #[test]
    fn steps_are_one_two_five() {
        assert_eq!(nice_step(0.17), 0.2);
        assert_eq!(nice_step(0.3), 0.5);
        assert_eq!(nice_step(1.0), 1.0);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(120.0), 200.0);
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(label(0.0, 0.5), "0");
        assert_eq!(label(0.01, 0.01), "0.01");
        assert_eq!(label(0.5, 0.5), "0.5");
        assert_eq!(label(1.0, 1.0), "1");
        assert_eq!(label(1.05, 0.05), "1.05");
        assert_eq!(label(1.2, 0.2), "1.2");
        assert_eq!(label(1000.0, 1000.0), "1000");
    }

    #[test]
    fn log_axis_spans_whole_decades_and_places_ends() {
        let a = Axis::new(&[0.125, 512.0], true, 0.0, 100.0);
        assert_eq!(a.ticks.first().copied(), Some(0.1));
        assert_eq!(a.ticks.last().copied(), Some(1000.0));
        assert_eq!(a.ticks.len(), 5);
        assert!((a.pixel(0.1).unwrap() - 0.0).abs() < 1e-9);
        assert!((a.pixel(1000.0).unwrap() - 100.0).abs() < 1e-9);
        assert!(a.pixel(0.0).is_none());
    }

    #[test]
    fn linear_axis_starts_at_zero_and_covers_the_max() {
        let a = Axis::new(&[0.3, 1.7], false, 400.0, 0.0);
        assert_eq!(a.ticks.first().copied(), Some(0.0));
        assert!(*a.ticks.last().unwrap() >= 1.7);
        assert_eq!(a.pixel(0.0), Some(400.0));
    }

    #[test]
    fn svg_is_one_document_with_a_line_per_series_and_escaped_text() {
        for log_y in [false, true] {
            let s = chart(log_y, vec![(0.125, 0.2), (2.0, 0.9), (512.0, 1.1)]).svg();
            assert!(s.starts_with("<svg "), "{s}");
            assert!(s.trim_end().ends_with("</svg>"));
            assert_eq!(s.matches("<polyline").count(), 2);
            assert!(s.contains("t &lt;&amp;&gt;"));
            assert!(s.contains(">zmq-ipc</text>"));
            assert!(!s.contains("NaN") && !s.contains("inf"), "{s}");
        }
    }

    #[test]
    fn empty_and_non_positive_data_still_draw() {
        let s = chart(true, vec![(0.0, 0.0)]).svg();
        assert!(s.starts_with("<svg ") && !s.contains("NaN"));
        let s = chart(false, Vec::new()).svg();
        assert!(s.starts_with("<svg ") && !s.contains("NaN"));
    }
}
