//! The report's plots as inline SVG, drawn with plotters' SVG backend: the loss curves of the
//! phases on one plot, the per-step memory timeline stacked by category, and the wall time
//! of each step.

use super::timeline::{phase_summary, Slot};
use crate::record::{Phase, PhaseRecord, RunRecord};
use anyhow::{anyhow, Result};
use ckpt_engine::memory::{human_bytes, Category};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Each category's colour, in [`Category::ALL`] order.
pub const CATEGORY_COLOURS: [RGBColor; 6] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];

/// The colours of the reference, `resume-mid` and `resume-end`.
const PHASE_COLOURS: [RGBColor; 3] = [
    RGBColor(0x9a, 0xa5, 0xb1),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x2f, 0x7e, 0xd8),
];

/// The colours of the later resumes of a chain (`resume-mid-2` on), in turn.
const CHAIN_COLOURS: [RGBColor; 3] = [
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0x9c, 0x75, 0x5f),
];

const FONT: &str = "sans-serif";

/// The grid's colour.
const GRID: RGBColor = RGBColor(0xe4, 0xe7, 0xec);

fn phase_colour(p: Phase) -> RGBColor {
    match p {
        Phase::Reference => PHASE_COLOURS[0],
        Phase::ResumeMid => PHASE_COLOURS[1],
        Phase::ResumeEnd => PHASE_COLOURS[2],
        Phase::ResumeChained(n) => {
            CHAIN_COLOURS[(n as usize).saturating_sub(2) % CHAIN_COLOURS.len()]
        }
    }
}

/// Draws with `draw` on an SVG of `size` and returns its text.
fn svg(
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<()>,
) -> Result<String> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, size).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        draw(&root)?;
        root.present().map_err(plot_error)?;
    }
    Ok(compact(&text))
}

/// `svg` without what the SVG defaults already say (`opacity="1"`, `stroke="none"`, a black
/// `fill`, a `stroke-width` of 1), with the font family said once on the `<svg>` element, which
/// its text inherits, and with font sizes to two decimals: the same drawing in about a third
/// fewer bytes, for a report of many trials to stay a page a browser opens quickly.
fn compact(svg: &str) -> String {
    let mut out = String::with_capacity(svg.len());
    let mut rest = svg;
    while let Some(at) = rest.find(" font-size=\"") {
        let (head, tail) = rest.split_at(at + " font-size=\"".len());
        out.push_str(head);
        let end = tail.find('"').unwrap_or(tail.len());
        match tail[..end].parse::<f64>() {
            Ok(size) => out.push_str(&format!("{size:.2}")),
            Err(_) => out.push_str(&tail[..end]),
        }
        rest = &tail[end..];
    }
    out.push_str(rest);
    let family = " font-family=\"sans-serif\"";
    let out = match out.contains(family) {
        true => out
            .replace(family, "")
            .replacen("<svg ", &format!("<svg{family} "), 1),
        false => out,
    };
    [
        " opacity=\"1\"",
        " stroke=\"none\"",
        " fill=\"#000000\"",
        " stroke-width=\"1\"",
    ]
    .iter()
    .fold(out, |svg, default| svg.replace(default, ""))
}

fn plot_error<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow!("cannot draw a plot: {e}")
}

/// `[lo, hi]` widened by 5% each way, and to a unit range when flat or empty.
fn padded(lo: f64, hi: f64) -> (f64, f64) {
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    let pad = if hi > lo {
        (hi - lo) * 0.05
    } else {
        lo.abs().max(1.0) * 0.05
    };
    (lo - pad, hi + pad)
}

/// Each evaluation of `p` that has a finite loss, where the loss plot draws it: between the
/// step it followed and the next.
fn evaluation_points(p: &PhaseRecord) -> Vec<(f64, f64)> {
    (p.evaluations.iter())
        .filter(|e| e.loss.is_finite())
        .map(|e| (e.step as f64 - 0.5, f64::from(e.loss)))
        .collect()
}

/// The loss of every step of every phase against the step, the resumed phases drawn over the
/// reference, each phase's evaluations of the validation split as circles, and `divergence` (a
/// phase and step) marked.
pub fn loss(r: &RunRecord, divergence: Option<(Phase, u64)>) -> Result<String> {
    let finite: Vec<(f64, f64)> = r
        .phases
        .iter()
        .flat_map(|p| &p.steps)
        .filter(|s| s.loss.is_finite())
        .map(|s| (s.step as f64, f64::from(s.loss)))
        .chain(r.phases.iter().flat_map(evaluation_points))
        .collect();
    let x_end = finite.iter().map(|p| p.0).fold(0.0, f64::max) + 1.0;
    let (lo, hi) = padded(
        finite.iter().map(|p| p.1).fold(f64::INFINITY, f64::min),
        finite.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max),
    );
    svg((640, 300), |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.5..x_end - 0.5, lo..hi)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .max_light_lines(0)
            .bold_line_style(GRID)
            .label_style((FONT, 12))
            .draw()
            .map_err(plot_error)?;
        for p in &r.phases {
            let colour = phase_colour(p.phase);
            let points: Vec<(f64, f64)> = p
                .steps
                .iter()
                .filter(|s| s.loss.is_finite())
                .map(|s| (s.step as f64, f64::from(s.loss)))
                .collect();
            let (width, dots) = if p.phase == Phase::Reference {
                (5, 0)
            } else {
                (1, 3)
            };
            let label = match p.steps.first() {
                Some(s) if p.phase != Phase::Reference => {
                    format!("{} from step {}", p.phase, s.step)
                }
                _ => p.phase.to_string(),
            };
            chart
                .draw_series(LineSeries::new(points, colour.stroke_width(width)).point_size(dots))
                .map_err(plot_error)?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(3))
                });
            let evaluations = evaluation_points(p);
            if !evaluations.is_empty() {
                let size = if p.phase == Phase::Reference { 5 } else { 3 };
                chart
                    .draw_series(
                        (evaluations.into_iter())
                            .map(|at| Circle::new(at, size, colour.stroke_width(2))),
                    )
                    .map_err(plot_error)?
                    .label(format!("{} validation", p.phase))
                    .legend(move |(x, y)| Circle::new((x + 8, y), 4, colour.stroke_width(2)));
            }
        }
        if let Some((phase, step)) = divergence {
            let x = step as f64;
            let red = RGBColor(0xd6, 0x27, 0x28);
            chart
                .draw_series([PathElement::new(
                    vec![(x, lo), (x, hi)],
                    red.stroke_width(2),
                )])
                .map_err(plot_error)?
                .label(format!("first divergence: {phase} step {step}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], red.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .label_font((FONT, 12))
            .draw()
            .map_err(plot_error)
    })
}

/// `bytes` on an axis: `1.5 MiB`.
fn axis_bytes(bytes: &f64) -> String {
    human_bytes(bytes.max(0.0) as u64)
}

/// A slot's label on the x axis: its step, `build` or `load`.
fn slot_label(s: &Slot) -> String {
    match (s.step, s.phase) {
        (Some(step), _) => step.to_string(),
        (None, Phase::Reference) => "build".into(),
        (None, _) => "load".into(),
    }
}

/// The x axis of a timeline: every slot's label where they fit.
fn x_label(slots: &[Slot], x: f64) -> String {
    let i = x.round();
    if (x - i).abs() > 1e-6 || i < 0.0 {
        return String::new();
    }
    slots.get(i as usize).map(slot_label).unwrap_or_default()
}

/// The width of a plot with a bar per slot.
fn slots_width(slots: &[Slot]) -> u32 {
    (160 + 14 * slots.len()).clamp(640, 1400) as u32
}

/// A chart with a bar place per slot, labelled by slot, from 0 to `top` on the y axis with
/// `y_labels` labels written by `y_label`.
fn slot_chart<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, Shift>,
    slots: &[Slot],
    top: f64,
    y_label: &dyn Fn(&f64) -> String,
    y_labels: usize,
) -> Result<ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>> {
    let n = slots.len() as f64;
    let mut chart = ChartBuilder::on(root)
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..n - 0.5, 0.0..top)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("step (build / load: the trainer's setup)")
        .x_labels(slots.len().min(40))
        .x_label_formatter(&|x| x_label(slots, *x))
        .y_label_formatter(y_label)
        .y_labels(y_labels)
        .max_light_lines(0)
        .bold_line_style(GRID)
        .label_style((FONT, 11))
        .draw()
        .map_err(plot_error)?;
    Ok(chart)
}

/// Where each phase's slots end on the x axis, with the phase.
fn phase_ends(slots: &[Slot]) -> Vec<(f64, Phase)> {
    (0..slots.len())
        .filter(|&i| {
            slots
                .get(i + 1)
                .is_none_or(|next| next.phase != slots[i].phase)
        })
        .map(|i| (i as f64 + 0.5, slots[i].phase))
        .collect()
}

/// The memory timeline: for each slot, the bytes at its peak stacked by category, the memory
/// model's estimate as an outlined bar beside it, the budget as a dashed line, and each phase's
/// start with what the phase before it reclaimed when its trainer was dropped.
pub fn memory(r: &RunRecord, slots: &[Slot]) -> Result<String> {
    let top = slots
        .iter()
        .flat_map(|s| [s.peak, s.estimate.unwrap_or(0)])
        .chain(r.budget)
        .max()
        .unwrap_or(1)
        .max(1) as f64
        * 1.15;
    let n = slots.len() as f64;
    svg((slots_width(slots), 340), |root| {
        let mut chart = slot_chart(root, slots, top, &axis_bytes, 10)?;
        for (c, colour) in Category::ALL.into_iter().zip(CATEGORY_COLOURS) {
            let bars = slots.iter().enumerate().filter_map(|(i, s)| {
                let below: u64 = Category::ALL
                    .iter()
                    .take_while(|&&d| d != c)
                    .map(|&d| s.at_peak.get(d))
                    .sum();
                let bytes = s.at_peak.get(c);
                (bytes > 0).then(|| {
                    let x = i as f64;
                    Rectangle::new(
                        [(x - 0.4, below as f64), (x + 0.15, (below + bytes) as f64)],
                        colour.filled(),
                    )
                })
            });
            chart.draw_series(bars).map_err(plot_error)?;
        }
        let estimates = slots.iter().enumerate().filter_map(|(i, s)| {
            s.estimate.map(|e| {
                let x = i as f64;
                Rectangle::new(
                    [(x + 0.17, 0.0), (x + 0.4, e as f64)],
                    BLACK.stroke_width(1),
                )
            })
        });
        chart.draw_series(estimates).map_err(plot_error)?;
        if let Some(budget) = r.budget {
            let y = budget as f64;
            let red = RGBColor(0xd6, 0x27, 0x28);
            let dashes = (0..(n as usize * 2 + 2)).map(|k| {
                let x = k as f64 * 0.5 - 0.5;
                PathElement::new(
                    vec![(x, y), ((x + 0.3).min(n - 0.5), y)],
                    red.stroke_width(2),
                )
            });
            chart.draw_series(dashes).map_err(plot_error)?;
            let style = (FONT, 11)
                .into_font()
                .color(&red)
                .pos(Pos::new(HPos::Left, VPos::Bottom));
            chart
                .draw_series([Text::new(
                    format!("budget {}", human_bytes(budget)),
                    (-0.4, y),
                    style,
                )])
                .map_err(plot_error)?;
        }
        let ends = phase_ends(slots);
        for (k, (x, phase)) in ends.into_iter().enumerate() {
            let grey = RGBColor(0x55, 0x55, 0x55);
            chart
                .draw_series([PathElement::new(
                    vec![(x, 0.0), (x, top)],
                    grey.stroke_width(1),
                )])
                .map_err(plot_error)?;
            let freed = r
                .phases
                .iter()
                .find(|p| p.phase == phase)
                .map_or(0, |p| phase_summary(p).reclaimed);
            let text = format!("{phase} freed {}", human_bytes(freed));
            let style = (FONT, 11)
                .into_font()
                .color(&grey)
                .pos(Pos::new(HPos::Right, VPos::Top));
            let y = top * if k % 2 == 0 { 0.995 } else { 0.955 };
            chart
                .draw_series([Text::new(text, (x - 0.1, y), style)])
                .map_err(plot_error)?;
        }
        Ok(())
    })
}

/// The wall time of each slot, coloured by phase.
pub fn time(slots: &[Slot]) -> Result<String> {
    let top = slots
        .iter()
        .map(|s| s.seconds)
        .fold(0.0, f64::max)
        .max(1e-6)
        * 1.1;
    svg((slots_width(slots), 180), |root| {
        let mut chart = slot_chart(root, slots, top, &|s| format!("{s:.3} s"), 4)?;
        let bars = slots.iter().enumerate().map(|(i, s)| {
            let x = i as f64;
            Rectangle::new(
                [(x - 0.4, 0.0), (x + 0.4, s.seconds)],
                phase_colour(s.phase).filled(),
            )
        });
        chart.draw_series(bars).map_err(plot_error)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::fixtures;
    use crate::report::html::timeline::slots;

    #[test]
    fn plots_leave_out_svg_defaults_and_round_font_sizes() {
        let text = compact(
            r##"<svg width="9"><text x="1" font-family="sans-serif" font-size="8.870967741935484" opacity="1" fill="#000000">a</text><rect fill="#FF0000" stroke="none" stroke-width="1" opacity="0.5"/><line stroke-width="2"/></svg>"##,
        );
        assert_eq!(
            text,
            r##"<svg font-family="sans-serif" width="9"><text x="1" font-size="8.87">a</text><rect fill="#FF0000" opacity="0.5"/><line stroke-width="2"/></svg>"##
        );
        let plot = loss(&fixtures::run(), None).unwrap();
        for default in [
            "opacity=\"1\"",
            "stroke=\"none\"",
            "fill=\"#000000\"",
            "stroke-width=\"1\"",
        ] {
            assert!(!plot.contains(default), "{default}");
        }
        assert!(plot.contains("<polyline") && plot.contains("font-size="));
        assert_eq!(plot.matches("font-family=").count(), 1);
        assert!(
            plot.starts_with("<svg font-family=\"sans-serif\" "),
            "{plot}"
        );
    }

    #[test]
    fn the_loss_plot_draws_each_phase_and_the_divergence() {
        let r = fixtures::validated(fixtures::run());
        let text = loss(&r, Some((Phase::ResumeMid, 3))).unwrap();
        assert!(text.starts_with("<svg"), "{text}");
        for label in [
            "reference",
            "resume-mid from step 2",
            "resume-end from step 4",
            "first divergence: resume-mid step 3",
            "reference validation",
            "resume-end validation",
        ] {
            assert!(text.contains(label), "{label}: {text}");
        }
    }

    #[test]
    fn each_resume_of_a_chain_is_drawn_in_its_own_colour() {
        let r = fixtures::chained();
        let text = loss(&r, None).unwrap();
        assert!(text.contains("resume-mid-2 from step 3"), "{text}");
        let colours: Vec<RGBColor> = r.phases.iter().map(|p| phase_colour(p.phase)).collect();
        for (i, c) in colours.iter().enumerate() {
            assert!(!colours[..i].contains(c), "phase {i} shares a colour");
        }
        assert_ne!(phase_colour(Phase::ResumeChained(3)), colours[2]);
    }

    #[test]
    fn the_memory_timeline_stacks_categories_and_draws_the_budget_and_phases() {
        let mut r = fixtures::run();
        r.budget = Some(9000);
        let text = memory(&r, &slots(&r)).unwrap();
        for label in [
            "budget 8.8 KiB",
            "reference freed 3.9 KiB",
            "resume-mid freed 3.9 KiB",
            "resume-end freed 3.9 KiB",
        ] {
            assert!(text.contains(label), "{label}: {text}");
        }
        for colour in ["#4E79A7", "#E15759"] {
            assert!(text.contains(colour), "{colour}: {text}");
        }
    }

    #[test]
    fn non_finite_losses_are_left_out_not_drawn() {
        let mut r = fixtures::run();
        r.phases[0].steps[3].loss = f32::NAN;
        let text = loss(&r, None).unwrap();
        assert!(!text.contains("NaN"), "{text}");
    }
}
