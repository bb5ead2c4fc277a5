//! One training step of the `small` GPT (6 layers, 6 heads, width 384, context 256, vocab
//! 50257) at batch 8×256, fp32 and bf16, flash attention, fused AdamW-equivalent: the median
//! step time next to PyTorch eager's (`benches/torch/trainer_gpt.py`, same model, batch and
//! thread count), measured in the same `cargo xtask bench` run.
//!
//! Not a criterion bench: a step takes seconds, so it times whole steps of a real run after
//! warm-up and records the median, as the PyTorch script does.

use headroom_attn::AttentionConfig;
use headroom_benches::{record, Better, Record};
use headroom_trainer::model::Precision;
use headroom_trainer::train::{train, TrainOptions};

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let warmup = 2;
    let timed = if quick { 3 } else { 8 };
    for precision in [Precision::Fp32, Precision::Bf16] {
        let mut o = TrainOptions::small_default();
        o.steps = warmup + timed;
        o.techniques.model.attention = AttentionConfig::flash();
        o.techniques.model.precision = precision;
        let report = match train(&o, |s| {
            eprintln!(
                "trainer/{}/small step {}: {:.3} s, loss {:.4}",
                precision.name(),
                s.step,
                s.seconds,
                s.loss
            )
        }) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("trainer bench failed: {e}");
                std::process::exit(1);
            }
        };
        let median = report.median_step_seconds(warmup);
        let p = precision.name();
        let tokens = (o.batch * o.seq) as f64;
        for (bench, metric, value, unit, better, baseline) in [
            (
                format!("trainer/step/headroom/{p}/small"),
                "step_seconds",
                median,
                "s",
                Better::Lower,
                format!("trainer/step/torch_eager/{p}/small"),
            ),
            (
                format!("trainer/tokens_per_s/headroom/{p}/small"),
                "tokens_per_s",
                tokens / median,
                "tokens/s",
                Better::Higher,
                format!("trainer/tokens_per_s/torch_eager/{p}/small"),
            ),
        ] {
            let r = Record {
                bench,
                metric: metric.into(),
                value,
                unit: unit.into(),
                baseline: Some(baseline),
                baseline_value: None,
                ratio: None,
                better,
            };
            if let Err(e) = record(&r) {
                eprintln!("cannot write the record: {e}");
                std::process::exit(1);
            }
        }
        println!(
            "trainer/{p}/small: median step {median:.3} s ({:.0} tokens/s)",
            tokens / median
        );
    }
}
