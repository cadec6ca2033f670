//! The bench's plots as SVG, drawn with `plotters`: a log-scale x axis (room size), a linear or
//! log-scale y axis, one line with markers per series, and a legend.
//!
//! Points that cannot be placed (not finite, or <= 0 on a log axis) are left out; an empty
//! chart still draws its axes over a default range. Text goes out as SVG `<text>` elements
//! (plotters escapes it), so no font is loaded.

use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;

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

const SIZE: (u32, u32) = (720, 440);

/// The whole decades around the positive finite `values` (one decade when there are none).
fn decades(values: impl Iterator<Item = f64>) -> std::ops::Range<f64> {
    let logs = values.filter(|v| v.is_finite() && *v > 0.0).map(f64::log10);
    let (lo, hi) = logs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() {
        return 1.0..10.0;
    }
    let (lo, hi) = (lo.floor(), hi.ceil().max(lo.floor() + 1.0));
    10f64.powf(lo)..10f64.powf(hi)
}

/// A tick label: at most three decimals, trailing zeros cut.
fn label(v: &f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub(super) fn svg(&self) -> anyhow::Result<String> {
        let mut out = String::new();
        {
            let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
            root.fill(&WHITE)?;
            let points = || self.series.iter().flat_map(|s| s.points.iter().copied());
            let x = decades(points().map(|p| p.0)).log_scale();
            let mut builder = ChartBuilder::on(&root);
            builder
                .caption(&self.title, ("sans-serif", 20))
                .margin(16)
                .x_label_area_size(44)
                .y_label_area_size(64);
            if self.log_y {
                let y = decades(points().map(|p| p.1)).log_scale();
                self.draw(builder.build_cartesian_2d(x, y)?)?;
            } else {
                let max = points()
                    .map(|p| p.1)
                    .filter(|v| v.is_finite())
                    .fold(0.0, f64::max);
                let top = if max > 0.0 { max * 1.1 } else { 1.0 };
                self.draw(builder.build_cartesian_2d(x, 0.0..top)?)?;
            }
            root.present()?;
        }
        Ok(out)
    }

    /// Axes, lines, markers and legend on a chart whose y axis is `Y`.
    fn draw<'a, Y>(
        &self,
        mut chart: ChartContext<'a, SVGBackend<'a>, Cartesian2d<LogCoord<f64>, Y>>,
    ) -> anyhow::Result<()>
    where
        Y: Ranged<ValueType = f64> + ValueFormatter<f64>,
    {
        chart
            .configure_mesh()
            .x_desc(&self.x_label)
            .y_desc(&self.y_label)
            .x_label_formatter(&label)
            .y_label_formatter(&label)
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .draw()?;
        let placed = |(x, y): &(f64, f64)| {
            x.is_finite() && *x > 0.0 && y.is_finite() && (*y > 0.0 || !self.log_y)
        };
        for (i, s) in self.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> = s.points.iter().copied().filter(placed).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 2), (x + 20, y + 2)], color.filled())
                });
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()?;
        Ok(())
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
    fn axes_span_whole_decades_around_the_data() {
        let r = decades([0.125, 512.0, 0.0, f64::NAN].into_iter());
        assert!(
            (r.start - 0.1).abs() < 1e-12 && (r.end - 1000.0).abs() < 1e-9,
            "{r:?}"
        );
        assert_eq!(decades([].into_iter()), 1.0..10.0);
        // One value on a power of ten still spans a decade.
        assert_eq!(decades([10.0].into_iter()), 10.0..100.0);
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(label(&0.0), "0");
        assert_eq!(label(&0.5), "0.5");
        assert_eq!(label(&1.0), "1");
        assert_eq!(label(&1.05), "1.05");
        assert_eq!(label(&0.30000000000000004), "0.3");
        assert_eq!(label(&1000.0), "1000");
    }

    /// The trimmed contents of the document's `<text>` elements.
    fn texts(svg: &str) -> Vec<&str> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim()))
            .collect()
    }

    #[test]
    fn svg_is_one_document_with_a_line_per_series_and_escaped_text() {
        for log_y in [false, true] {
            let s = chart(log_y, vec![(0.125, 0.2), (2.0, 0.9), (512.0, 1.1)])
                .svg()
                .unwrap();
            assert!(s.starts_with("<svg "), "{s}");
            assert!(s.trim_end().ends_with("</svg>"));
            // The series' lines are the document's only 2-pixel polylines (axes and ticks
            // are 1 pixel), each with three markers.
            assert_eq!(s.matches(r#"stroke-width="2" points"#).count(), 2, "{s}");
            assert_eq!(s.matches("<circle").count(), 6, "{s}");
            let texts = texts(&s);
            for t in ["t &lt;&amp;&gt;", "zmq-tcp", "zmq-ipc", "x", "y", "1000"] {
                assert!(texts.contains(&t), "{t}: {texts:?}");
            }
            assert!(!s.contains("NaN") && !s.contains("inf"), "{s}");
        }
    }

    #[test]
    fn empty_and_non_positive_data_still_draw() {
        for (log_y, points) in [(true, vec![(0.0, 0.0)]), (false, Vec::new())] {
            let s = chart(log_y, points).svg().unwrap();
            assert!(s.starts_with("<svg ") && !s.contains("NaN"), "{s}");
            assert_eq!(s.matches("<circle").count(), 0, "{s}");
        }
    }
}
