//! Every technique against the baseline: checkpoint schedules and selective recomputation give
//! bitwise the same loss and gradients as storing everything; micro-batching, the fused loss
//! and the attention algorithms agree within f32 summation-order tolerance; bf16/fp16 within
//! their rounding; the optimizer gives the same bits wherever its state lives.

use headroom_attn::AttentionConfig;
use headroom_ckpt::{Planner, Schedule};
use headroom_offload::StatePrecision;
use headroom_tensor::{Cpu, Device, MemoryCategory};
use headroom_trainer::estimate::estimate;
use headroom_trainer::model::{params, Geometry, Model, ModelConfig, ModelOptions, Precision};
use headroom_trainer::techniques::{
    CheckpointChoice, OptimizerChoice, OptimizerPlacement, Techniques,
};
use headroom_trainer::train::{train, TrainOptions};
use proptest::prelude::*;

struct Run {
    loss: f32,
    grads: Vec<Vec<f32>>,
}

fn batch(cfg: &ModelConfig, g: Geometry<'_>, seed: u32) -> (Vec<u32>, Vec<u32>) {
    let v = cfg.vocab as u32;
    let n = g.rows() as u32;
    let tok = (0..n).map(|i| (i * 7 + 3 + seed) % v).collect();
    let tgt = (0..n).map(|i| (i * 5 + 1 + 3 * seed) % v).collect();
    (tok, tgt)
}

fn run(
    cfg: ModelConfig,
    opts: ModelOptions,
    g: Geometry<'_>,
    schedule: &Schedule,
    micro: usize,
) -> Run {
    let cpu = Cpu::new();
    let gpt = Model::new(&cpu, cfg, opts, 11).unwrap();
    let mut grads = params::alloc_like_params(&cpu, &cfg, MemoryCategory::Gradients).unwrap();
    let (tok, tgt) = batch(&cfg, g, 0);
    let rows = micro * g.t;
    let mut loss = 0.0f64;
    for (t, y) in tok.chunks(rows).zip(tgt.chunks(rows)) {
        let mg = Geometry::new(micro, g.t);
        let (l, _) = gpt
            .forward_backward(t, y, mg, &mut grads, 1.0 / g.rows() as f32, schedule)
            .unwrap();
        loss += l as f64 * micro as f64 / g.b as f64;
    }
    Run {
        loss: loss as f32,
        grads: grads
            .iter()
            .map(|t| t.as_slice::<f32>().unwrap().to_vec())
            .collect(),
    }
}

fn assert_close(a: &Run, b: &Run, rel: f32, what: &str) {
    assert!(
        (a.loss - b.loss).abs() <= rel * b.loss.abs().max(1.0),
        "{what}: loss {} vs {}",
        a.loss,
        b.loss
    );
    // A tensor whose gradient is zero in exact arithmetic (q and k at one position: softmax
    // over a single key) still gets f32 cancellation noise from terms as large as the model's
    // other gradients, so each tensor's scale is floored at a thousandth of the largest
    // gradient anywhere, not at an absolute constant.
    let global = b.grads.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    let floor = (1e-3 * global).max(1e-6);
    for (i, (x, y)) in a.grads.iter().zip(&b.grads).enumerate() {
        let scale = y.iter().fold(floor, |m, v| m.max(v.abs()));
        let worst = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= rel * scale,
            "{what}: gradient {i} differs by {worst} (scale {scale})"
        );
    }
}

fn assert_bitwise(a: &Run, b: &Run, what: &str) {
    assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what}: loss");
    for (i, (x, y)) in a.grads.iter().zip(&b.grads).enumerate() {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "{what}: gradient tensor {i} differs"
        );
    }
}

fn small_cfg(layers: usize) -> ModelConfig {
    family_cfg(layers, false)
}

/// GPT-2, or a Llama of the same width with two query heads sharing one key/value head.
fn family_cfg(layers: usize, llama: bool) -> ModelConfig {
    use headroom_trainer::model::{Family, LlamaShape};
    let family = if llama {
        Family::Llama(LlamaShape {
            kv_heads: 1,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 40,
            rope_theta: 10_000.0,
            rope_scaling: Default::default(),
            class: Default::default(),
            norm_eps: 1e-5,
            tied_head: false,
        })
    } else {
        Family::Gpt2
    };
    ModelConfig {
        vocab: 37,
        max_seq: 16,
        layers,
        heads: 2,
        channels: 16,
        family,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any schedule (every-k, √n, a planned one under a random budget) and selective
    /// recomputation, in any precision and attention algorithm: bitwise the stored gradients.
    #[test]
    fn recomputation_is_bitwise_exact(
        layers in 1usize..6,
        k in 1usize..4,
        t in 1usize..12,
        b in 1usize..3,
        prec in 0usize..3,
        algo in 0usize..3,
        budget_frac in 0.0f64..1.0,
        llama in any::<bool>(),
    ) {
        let cfg = family_cfg(layers, llama);
        let g = Geometry::new(b, t);
        let opts = ModelOptions {
            attention: [AttentionConfig::naive(), AttentionConfig::chunked(), AttentionConfig::flash()][algo],
            precision: [Precision::Fp32, Precision::Bf16, Precision::Fp16][prec],
            ..ModelOptions::default()
        };
        let all = Schedule::store_all(layers).unwrap();
        let stored = run(cfg, opts, g, &all, b);
        let mut tech = Techniques::baseline();
        tech.model = opts;
        let est = estimate(&cfg, t, b, b, &tech).unwrap();
        let costs = est.block_chain_cost().unwrap();
        let min = headroom_ckpt::min_memory(&costs).unwrap().0;
        let full = all.simulate(&costs).unwrap().peak_saved_bytes;
        let budget = min + ((full - min) as f64 * budget_frac) as u64;
        let planned = Planner::default().optimal(&costs, budget).unwrap().schedule;
        for (name, s) in [
            ("every-k", Schedule::every_k(layers, k).unwrap()),
            ("sqrt-n", Schedule::sqrt_n(layers).unwrap()),
            ("planned", planned),
        ] {
            assert_bitwise(&run(cfg, opts, g, &s, b), &stored, name);
        }
        let selective = ModelOptions { selective: true, ..opts };
        assert_bitwise(&run(cfg, selective, g, &all, b), &stored, "selective");
    }

    /// k micro-batches of a batch give the big batch's gradient (f32 summation order aside).
    #[test]
    fn micro_batches_equal_the_big_batch(
        t in 1usize..12,
        micro in 1usize..4,
        k in 1usize..4,
        llama in any::<bool>(),
    ) {
        let cfg = family_cfg(2, llama);
        let g = Geometry::new(micro * k, t);
        let all = Schedule::store_all(2).unwrap();
        let opts = ModelOptions::default();
        assert_close(&run(cfg, opts, g, &all, micro), &run(cfg, opts, g, &all, g.b), 1e-5, "micro-batches");
    }

    /// The fused, chunked loss equals the materialised one.
    #[test]
    fn fused_loss_equals_the_materialised_loss(
        t in 1usize..12,
        b in 1usize..3,
        rows in 1usize..20,
        llama in any::<bool>(),
    ) {
        let cfg = family_cfg(2, llama);
        let g = Geometry::new(b, t);
        let all = Schedule::store_all(2).unwrap();
        let fused = ModelOptions { loss_chunk: Some(rows), ..ModelOptions::default() };
        assert_close(&run(cfg, fused, g, &all, b), &run(cfg, ModelOptions::default(), g, &all, b), 1e-5, "fused loss");
    }
}

#[test]
fn low_precision_gradients_track_fp32() {
    low_precision_tracks_fp32(small_cfg(3));
}

#[test]
fn llama_low_precision_gradients_track_fp32() {
    low_precision_tracks_fp32(family_cfg(3, true));
}

fn low_precision_tracks_fp32(cfg: ModelConfig) {
    let g = Geometry::new(2, 12);
    let all = Schedule::store_all(3).unwrap();
    let fp32 = run(cfg, ModelOptions::default(), g, &all, 2);
    // bf16 keeps 8 mantissa bits (relative rounding 2⁻⁹), fp16 11 (2⁻¹²); errors compound
    // through 3 blocks, so the bounds are a few dozen roundings.
    for (p, tol) in [(Precision::Bf16, 0.05), (Precision::Fp16, 0.01)] {
        let opts = ModelOptions {
            precision: p,
            ..ModelOptions::default()
        };
        let low = run(cfg, opts, g, &all, 2);
        assert_close(&low, &fp32, tol, p.name());
        // And it really is low precision: not bitwise fp32.
        assert_ne!(low.loss.to_bits(), fp32.loss.to_bits());
    }
}

fn tiny(steps: usize, tech: Techniques) -> TrainOptions {
    TrainOptions {
        steps,
        techniques: tech,
        ..TrainOptions::tiny_default()
    }
}

fn losses(o: &TrainOptions) -> Vec<u32> {
    train(o, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss.to_bits())
        .collect()
}

#[test]
fn the_optimizer_gives_the_same_bits_wherever_its_state_lives() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Techniques::baseline();
    t.model.precision = Precision::Bf16;
    let resident = losses(&tiny(6, t.clone()));
    for placement in [
        OptimizerPlacement::HostRam,
        OptimizerPlacement::File(dir.path().join("state.bin")),
    ] {
        let mut o = t.clone();
        o.optimizer.placement = placement.clone();
        assert_eq!(losses(&tiny(6, o)), resident, "{placement:?}");
    }
}

#[test]
fn offload_moves_state_and_masters_off_the_device() {
    let mut t = Techniques::baseline();
    t.model.precision = Precision::Bf16;
    let resident = train(&tiny(2, t.clone()), |_| {}).unwrap();
    t.optimizer.placement = OptimizerPlacement::HostRam;
    let off = train(&tiny(2, t), |_| {}).unwrap();
    let p = params::param_infos(&TrainOptions::tiny_default().model)
        .iter()
        .map(|i| i.shape.iter().product::<usize>() as u64)
        .sum::<u64>();
    let dev = |r: &headroom_trainer::train::TrainReport| r.memory.device(Device::Cpu).unwrap().peak;
    let host = off.host_memory.device(Device::Cpu).unwrap().peak;
    // Resident bf16: 4 (master) + 2 (working) + 4 (grad) + 8 (moments) bytes per parameter.
    assert_eq!(dev(&resident)[MemoryCategory::Parameters], 6 * p);
    assert_eq!(dev(&resident)[MemoryCategory::OptimizerState], 8 * p);
    // Offloaded: the device keeps the bf16 working copy and one part's f32 gradients at a
    // time — the embedding's (wte, wpe), the head's (wte, ln_f) or a block's, whichever is
    // largest (here a block's: 12C² + 13C); masters, gradients and moments are on the host.
    let c = TrainOptions::tiny_default().model;
    let embed = (c.vocab + c.max_seq) * c.channels;
    let head = c.vocab * c.channels + 2 * c.channels;
    let block = 12 * c.channels * c.channels + 13 * c.channels;
    let largest = embed.max(head).max(block);
    assert_eq!(largest, block);
    assert_eq!(dev(&off)[MemoryCategory::Parameters], 2 * p);
    assert_eq!(dev(&off)[MemoryCategory::OptimizerState], 0);
    assert_eq!(dev(&off)[MemoryCategory::Gradients], 4 * largest as u64);
    assert!(dev(&off)[MemoryCategory::Gradients] < dev(&resident)[MemoryCategory::Gradients]);
    assert_eq!(host[MemoryCategory::Parameters], 4 * p);
    assert_eq!(host[MemoryCategory::Gradients], 4 * p);
    assert_eq!(host[MemoryCategory::OptimizerState], 8 * p);
}

#[test]
fn every_combination_trains_and_8bit_state_tracks_f32() {
    let steps = 40;
    let f32_run = train(&tiny(steps, Techniques::baseline()), |_| {}).unwrap();
    let start = f32_run.steps[0].loss as f64;
    let end32 = f32_run.final_loss(5);
    assert!(
        end32 < start * 0.8,
        "fp32 did not learn: {start} -> {end32}"
    );
    let mut combos = Vec::new();
    let mut t = Techniques::baseline();
    t.optimizer.state = StatePrecision::Int8;
    combos.push(("8-bit AdamW, code book", t.clone(), 0.03));
    t.optimizer.state = StatePrecision::Float8;
    combos.push(("8-bit AdamW", t.clone(), 0.03));
    t.model.precision = Precision::Fp16;
    t.checkpoint = CheckpointChoice::EveryK(1);
    t.model.attention = AttentionConfig::flash();
    combos.push(("8-bit, fp16, every-1, flash", t.clone(), 0.05));
    let mut u = Techniques::baseline();
    u.model.precision = Precision::Bf16;
    u.checkpoint = CheckpointChoice::Selective;
    u.model.loss_chunk = Some(100);
    u.micro_batch = Some(4);
    u.optimizer = OptimizerChoice {
        state: StatePrecision::F32,
        placement: OptimizerPlacement::HostRam,
    };
    combos.push((
        "bf16, selective, fused loss, 4 micro-batches, offload",
        u,
        0.05,
    ));
    for (name, tech, tol) in combos {
        let r = train(&tiny(steps, tech), |_| {}).unwrap();
        check_combination(name, &r, end32, tol);
    }
}

fn check_combination(name: &str, r: &headroom_trainer::train::TrainReport, end32: f64, tol: f64) {
    let end = r.final_loss(5);
    assert!(
        r.steps.iter().all(|s| s.applied),
        "{name}: a step was skipped"
    );
    assert!(
        (end - end32).abs() <= tol * end32,
        "{name}: final loss {end} vs fp32's {end32}"
    );
}

/// The Llama preset trains under the full stack of techniques as GPT-2 does.
#[test]
fn llama_trains_with_every_technique() {
    let steps = 40;
    let llama = |tech: Techniques| TrainOptions {
        model: ModelConfig::llama_tiny(64),
        ..tiny(steps, tech)
    };
    let f32_run = train(&llama(Techniques::baseline()), |_| {}).unwrap();
    let (start, end32) = (f32_run.steps[0].loss as f64, f32_run.final_loss(5));
    assert!(
        end32 < start * 0.8,
        "fp32 did not learn: {start} -> {end32}"
    );
    let mut a = Techniques::baseline();
    a.optimizer.state = StatePrecision::Float8;
    a.model.precision = Precision::Fp16;
    a.checkpoint = CheckpointChoice::EveryK(1);
    a.model.attention = AttentionConfig::naive();
    let mut b = Techniques::baseline();
    b.model.precision = Precision::Bf16;
    b.checkpoint = CheckpointChoice::Selective;
    b.model.loss_chunk = Some(100);
    b.micro_batch = Some(4);
    b.optimizer.placement = OptimizerPlacement::HostRam;
    for (name, tech) in [
        ("llama: 8-bit, fp16, every-1, naive", a),
        (
            "llama: bf16, selective, fused loss, 4 micro-batches, offload",
            b,
        ),
    ] {
        let r = train(&llama(tech), |_| {}).unwrap();
        check_combination(name, &r, end32, 0.05);
    }
}

#[test]
fn resume_is_bit_for_bit_with_low_precision_and_offload() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = Techniques::baseline();
    t.model.precision = Precision::Fp16;
    t.checkpoint = CheckpointChoice::SqrtN;
    t.optimizer = OptimizerChoice {
        state: StatePrecision::Float8,
        placement: OptimizerPlacement::HostRam,
    };
    let base = tiny(8, t);
    let full = losses(&base);
    let resume_matches = |base: &TrainOptions, full: &[u32], ck: &std::path::Path| {
        let first = TrainOptions {
            save: Some((ck.to_path_buf(), 3)),
            stop_after: Some(5),
            ..base.clone()
        };
        train(&first, |_| {}).unwrap();
        let rest = losses(&TrainOptions {
            resume_from: Some(ck.to_path_buf()),
            ..base.clone()
        });
        assert_eq!(&full[3..], &rest[..]);
    };
    resume_matches(&base, &full, &dir.path().join("ram"));
    // The same with the moments in a memory-mapped file (its steps 4-5 overwrite it after the
    // checkpoint; the resume must restore the checkpoint's moments, not the file's).
    let mut in_file = base.clone();
    in_file.techniques.optimizer.placement = OptimizerPlacement::File(dir.path().join("m.bin"));
    resume_matches(&in_file, &full, &dir.path().join("file"));
    // State written with the code-book format (before the small-float one became the 8-bit
    // default) resumes in its own format: the checkpoint names it.
    let mut code_book = base.clone();
    code_book.techniques.optimizer.state = StatePrecision::Int8;
    resume_matches(
        &code_book,
        &losses(&code_book),
        &dir.path().join("code-book"),
    );
}

#[test]
fn optimal_schedule_needs_a_budget_and_fits_it() {
    let mut t = Techniques::baseline();
    t.checkpoint = CheckpointChoice::Optimal(None);
    let err = train(&tiny(1, t.clone()), |_| {}).unwrap_err();
    assert!(err.to_string().contains("budget"), "{err}");
    // A budget between the minimum and store-all: the planner's schedule recomputes, fits.
    let o = tiny(2, t);
    let e = estimate(&o.model, o.seq, o.batch, o.batch, &o.techniques).unwrap();
    let budget = e.device_total() - e.block_saved_bytes;
    let r = train(
        &TrainOptions {
            budget: Some(budget),
            ..o
        },
        |_| {},
    )
    .unwrap();
    assert!(r.memory.device(Device::Cpu).unwrap().peak_total <= budget);
    assert!(r.steps[0].block_forwards > TrainOptions::tiny_default().model.layers);
}

#[test]
fn the_ladder_fits_a_budget_the_baseline_cannot_with_4x_less_memory() {
    ladder_fits(false);
}

#[test]
fn the_llama_ladder_fits_a_budget_the_baseline_cannot_with_4x_less_memory() {
    ladder_fits(true);
}

fn ladder_fits(llama: bool) {
    use headroom_trainer::ladder::{ladder_table, run_ladder, standard_rungs};
    use headroom_trainer::train::{DataSource, SyntheticData};
    // A vocabulary large next to the width, as GPT-2's is, so the head matters.
    let data = SyntheticData {
        vocab: 2048,
        branching: 4,
        tokens: 1 << 15,
        seed: 3,
    };
    let base = TrainOptions {
        model: ModelConfig {
            vocab: 2048,
            max_seq: 64,
            layers: 4,
            heads: 4,
            channels: 64,
            family: if llama {
                ModelConfig::llama_tiny(2048).family
            } else {
                headroom_trainer::model::Family::Gpt2
            },
        },
        data: DataSource::Synthetic(data),
        steps: 2,
        batch: 8,
        seq: 64,
        ..TrainOptions::tiny_default()
    };
    let rungs = standard_rungs(base.batch);
    let last = rungs.last().unwrap();
    let full = estimate(&base.model, base.seq, 2, base.batch, &last.techniques).unwrap();
    let budget = full.device_total() + full.device_total() / 10;
    let results = run_ladder(&base, &rungs, budget, |_| {}).unwrap();
    eprintln!("{}", ladder_table(&results, budget));
    let (first, end) = (&results[0], results.last().unwrap());
    assert!(!first.fits && first.peak_total > budget);
    assert!(end.fits && end.peak_total <= budget);
    assert!(
        first.peak_total >= 4 * end.peak_total,
        "only {:.2}× lower",
        first.peak_total as f64 / end.peak_total as f64
    );
    for (r, rung) in results.iter().zip(&rungs) {
        // The estimator's simultaneous peak bounds the measured one from above.
        assert!(
            r.estimated_peak >= r.peak_total,
            "{}: estimate below the peak",
            r.name
        );
        // And each category's peak is the estimator's, byte for byte.
        let micro = rung.techniques.micro_batch.unwrap_or(base.batch);
        let e = estimate(&base.model, base.seq, micro, base.batch, &rung.techniques).unwrap();
        for c in MemoryCategory::ALL {
            assert_eq!(r.peak[c], e.device[c], "{}: {c:?}", r.name);
        }
        assert!(r.final_loss.is_finite());
    }
}

/// The case CI drew on an AVX-512 machine: one position, so the q and k gradients are zero in
/// exact arithmetic and only summation-order noise remains; it must pass on every ISA.
#[test]
fn micro_batches_at_one_position_on_llama() {
    let cfg = family_cfg(2, true);
    let g = Geometry::new(9, 1);
    let all = Schedule::store_all(2).unwrap();
    let opts = ModelOptions::default();
    let small = run(cfg, opts, g, &all, 3);
    let big = run(cfg, opts, g, &all, 9);
    let q_grad = big.grads[2].iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!("largest q gradient at t = 1: {q_grad:e}");
    assert_close(&small, &big, 1e-5, "micro-batches at t = 1");
}
