//! `headroom train --zero S --ranks N` against one process, as DeepSpeed and FSDP test ZeRO:
//! N in-process ranks over their shards of the data equal one process that runs the same
//! micro-batches (every rank's, concatenated) and sums their gradients in the order
//! [`Stage::reduction_order`] states — bit for bit, losses and final parameters, for stages
//! 0–3 and N = 2, 3, 4, with block checkpointing and gradient accumulation on and parameter
//! counts that N does not divide. bf16 (mixed precision: bf16 gradients reduced in bf16) is
//! compared with the fp32 run within a stated tolerance.

use headroom_ckpt::Schedule;
use headroom_mmap_data::{Loader, LoaderConfig, OutputType, SamplerConfig, SamplingMode, Shard};
use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::{Backend, Cpu, DType, Tensor};
use headroom_trainer::model::{
    params, Family, Geometry, LlamaShape, Model, ModelConfig, Part, Precision,
};
use headroom_trainer::techniques::CheckpointChoice;
use headroom_trainer::train::{open_data, DataSource, LrSchedule, SyntheticData, TrainOptions};
use headroom_trainer::zero_train::{estimate_run, train_zero, ZeroOptions};
use headroom_zero::Stage;

const SEQ: usize = 16;
const MICRO: usize = 2;
const ACCUM: usize = 2;

/// A 3-layer model of either family with a vocabulary of 61: no layer's parameter count is a
/// multiple of 3 or 4, and GPT-2's head is tied (its token embedding's gradient has two
/// sources).
fn options(family: Family, ranks: usize, steps: usize) -> TrainOptions {
    let mut o = TrainOptions::tiny_default();
    let vocab = 61;
    o.data = DataSource::Synthetic(SyntheticData {
        vocab: vocab as u32,
        branching: 4,
        tokens: 1 << 14,
        seed: 7,
    });
    o.model = ModelConfig {
        vocab,
        max_seq: SEQ,
        layers: 3,
        heads: 2,
        channels: 24,
        family,
    };
    o.steps = steps;
    o.warmup = 2;
    o.seq = SEQ;
    o.batch = ranks * MICRO * ACCUM;
    o.techniques.micro_batch = Some(MICRO);
    o.techniques.checkpoint = CheckpointChoice::EveryK(2);
    // Clipping's norm is summed in another order under sharding; parity is about the rest.
    o.grad_clip = f64::INFINITY;
    // Not the defaults: every rank's optimizer and the consolidated state must carry the
    // run's own.
    o.beta1 = 0.85;
    o.beta2 = 0.99;
    o.eps = 1e-6;
    o.lr_schedule = LrSchedule::Linear;
    o.check_machine_memory = false;
    o
}

fn llama() -> Family {
    Family::Llama(LlamaShape {
        kv_heads: 1,
        head_dim: None,
        sliding_window: None,
        no_rope_interval: None,
        query_pre_attn_scalar: None,
        multipliers: None,
        padding_idx: None,
        ffn: 40,
        rope_theta: 10000.0,
        rope_scaling: Default::default(),
        class: Default::default(),
        norm_eps: 1e-5,
        tied_head: false,
    })
}

/// Where a reference run starts other than from scratch: a checkpoint's contents.
struct Start {
    step: usize,
    params: Vec<Vec<f32>>,
    optimizer: headroom_offload::AdamWState,
    moments: Vec<u8>,
}

/// A reference run's outcome: each step's loss, the final parameters and AdamW moment bytes.
struct Outcome {
    losses: Vec<f32>,
    params: Vec<Vec<f32>>,
    moments: Vec<u8>,
}

/// One process: the same initial weights and batches, each micro-batch's gradient into its own
/// zeroed buffers, summed in `stage`'s order, then the trainer's AdamW on whole tensors.
/// Returns each step's loss and the final parameters.
fn reference(o: &TrainOptions, stage: Stage, ranks: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let r = reference_from(o, stage, ranks, None);
    (r.losses, r.params)
}

fn reference_from(o: &TrainOptions, stage: Stage, ranks: usize, start: Option<&Start>) -> Outcome {
    let cpu = Cpu::new();
    let cfg = o.model;
    let mut model = Model::new(&cpu, cfg, o.techniques.model, o.seed).unwrap();
    if let Some(s) = start {
        for (m, p) in model.masters_mut().iter_mut().zip(&s.params) {
            m.as_mut_slice::<f32>().unwrap().copy_from_slice(p);
        }
    }
    let first = start.map_or(0, |s| s.step);
    let (dataset, _) = open_data(o).unwrap();
    let mut loaders: Vec<Loader> = (0..ranks)
        .map(|r| {
            let mut lc = LoaderConfig::new(o.batch / ranks);
            lc.output = OutputType::U32;
            let sampler = SamplerConfig {
                mode: SamplingMode::EpochWindows,
                seq_len: SEQ as u64,
                seed: o.seed,
                shard: Shard::new(r as u32, ranks as u32).unwrap(),
            };
            let at = headroom_mmap_data::LoaderState {
                sampler,
                batch_size: (o.batch / ranks) as u64,
                next_batch: first as u64,
                epoch: 0,
                dataset_fingerprint: dataset.fingerprint(),
            };
            Loader::resume(dataset.clone(), &at, lc, None).unwrap()
        })
        .collect();
    let infos = params::param_infos(&cfg);
    let specs: Vec<ParamSpec> = infos
        .iter()
        .map(|i| ParamSpec {
            numel: i.shape.iter().product(),
            group: if i.shape.len() >= 2 { 0 } else { 1 },
        })
        .collect();
    let hyper = |wd| AdamWHyper {
        lr: o.lr,
        beta1: o.beta1,
        beta2: o.beta2,
        eps: o.eps,
        weight_decay: wd,
    };
    let mut opt = match start {
        Some(s) => CpuAdamW::restore(&s.optimizer, &cpu, &s.moments).unwrap(),
        None => CpuAdamW::new(
            vec![hyper(o.weight_decay), hyper(0.0)],
            &specs,
            StatePrecision::F32,
            StoreSpec::Ram(&cpu),
        )
        .unwrap(),
    };
    let schedule = Schedule::every_k(cfg.layers, 2).unwrap();
    let g = Geometry::new(MICRO, SEQ);
    let rows = MICRO * SEQ;
    let dloss = (1.0 / (o.batch * SEQ) as f64) as f32;
    let mut losses = Vec::new();
    for step in first..o.stop_after.unwrap_or(o.steps) {
        // grads[tensor][rank][micro-batch]
        let mut grads: Vec<Vec<Vec<Vec<f32>>>> = vec![vec![Vec::new(); ranks]; infos.len()];
        let mut loss_by_rank = Vec::new();
        for (r, loader) in loaders.iter_mut().enumerate() {
            let batch = loader.next_batch().unwrap();
            let tokens = batch.inputs_u32().unwrap().to_vec();
            let targets = batch.targets_u32().unwrap().to_vec();
            let mut loss_sum = 0.0f64;
            for (tok, tgt) in tokens.chunks(rows).zip(targets.chunks(rows)) {
                let mut gr: Vec<_> = infos
                    .iter()
                    .map(|i| cpu.zeros(i.shape.clone(), DType::F32).unwrap())
                    .collect();
                let (l, _) = model
                    .forward_backward(tok, tgt, g, &mut gr, dloss, &schedule)
                    .unwrap();
                loss_sum += l as f64 * rows as f64;
                for (t, x) in gr.iter().enumerate() {
                    grads[t][r].push(x.as_slice::<f32>().unwrap().to_vec());
                }
            }
            loss_by_rank.push(loss_sum);
        }
        let total: f64 = loss_by_rank.iter().sum();
        losses.push((total / (o.batch * SEQ) as f64) as f32);
        opt.set_lr(0, o.lr_at(step)).unwrap();
        opt.set_lr(1, o.lr_at(step)).unwrap();
        for (i, p) in model.masters_mut().iter_mut().enumerate() {
            let summed = stage.reduction_order().reduce(&grads[i]);
            opt.step(
                i,
                p.as_mut_slice::<f32>().unwrap(),
                FloatSlice::F32(&summed),
                None,
            )
            .unwrap();
        }
    }
    let params = model
        .masters()
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect();
    Outcome {
        losses,
        params,
        moments: opt.moments().to_vec(),
    }
}

fn run(o: &TrainOptions, stage: Stage, ranks: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut z = ZeroOptions::new(stage, ranks);
    z.collect_parameters = true;
    let report = train_zero(o, z, |_| {}).unwrap();
    let losses = report.steps.iter().map(|s| s.loss).collect();
    (losses, report.parameters.unwrap())
}

fn assert_bitwise(what: &str, got: &(Vec<f32>, Vec<Vec<f32>>), want: &(Vec<f32>, Vec<Vec<f32>>)) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got.0), bits(&want.0), "{what}: losses");
    assert_eq!(got.1.len(), want.1.len(), "{what}: tensor count");
    for (i, (a, b)) in got.1.iter().zip(&want.1).enumerate() {
        assert!(bits(a) == bits(b), "{what}: parameter {i} differs");
    }
}

#[test]
fn every_stage_on_2_3_4_ranks_equals_one_process_bit_for_bit() {
    for family in [Family::Gpt2, llama()] {
        for ranks in [2, 3, 4] {
            let o = options(family, ranks, 20);
            // Stages 0 and 1 sum alike, as do 2 and 3: one reference each.
            let mut refs = std::collections::HashMap::new();
            for stage in Stage::ALL {
                let want = refs
                    .entry(stage.reduction_order())
                    .or_insert_with(|| reference(&o, stage, ranks));
                let got = run(&o, stage, ranks);
                assert!(got.0[19] < got.0[0], "the loss falls");
                assert_bitwise(
                    &format!("{} {stage} on {ranks} ranks", o.model.family_name()),
                    &got,
                    want,
                );
            }
        }
    }
}

/// Qwen2's q/k/v biases with Llama 3's rescaled rotary embedding and a tied head, Qwen3's
/// query/key norms with heads 16 wide on a model 24 wide, Gemma 3's output norms, and OLMo 2's
/// projection-wide query/key norms without input norms: the biases and the norms' gains are
/// parts like any other, so every stage on 2 ranks is still one process bit for bit.
#[test]
fn qwen2_qwen3_gemma3_and_olmo2_under_every_stage_equal_one_process() {
    let qwen2 = LlamaShape {
        kv_heads: 1,
        head_dim: None,
        sliding_window: None,
        no_rope_interval: None,
        query_pre_attn_scalar: None,
        multipliers: None,
        padding_idx: None,
        ffn: 40,
        rope_theta: 10000.0,
        rope_scaling: headroom_trainer::model::RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8,
        },
        class: headroom_trainer::model::LlamaClass::Qwen2,
        norm_eps: 1e-6,
        tied_head: true,
    };
    let qwen3 = LlamaShape {
        head_dim: Some(16),
        rope_scaling: Default::default(),
        class: headroom_trainer::model::LlamaClass::Qwen3,
        ..qwen2
    };
    // Gemma 3: the output norms' gains are parts too, the embedding scaled, a window of 4
    // keys in every block but every second with its own rotary base.
    let gemma3 = LlamaShape {
        class: headroom_trainer::model::LlamaClass::Gemma3,
        sliding_window: Some(headroom_trainer::model::SlidingWindow {
            full_every: Some(2),
            rope_theta: Some(100.0),
            ..headroom_trainer::model::SlidingWindow::from_layer(4, 0)
        }),
        ..qwen3
    };
    // OLMo 2: no input norms, the projection-wide query and key norms' gains as parts.
    let olmo2 = LlamaShape {
        class: headroom_trainer::model::LlamaClass::Olmo2,
        ..qwen3
    };
    for (name, shape) in [
        ("qwen2", qwen2),
        ("qwen3", qwen3),
        ("gemma3", gemma3),
        ("olmo2", olmo2),
    ] {
        let o = options(Family::Llama(shape), 2, 8);
        let mut refs = std::collections::HashMap::new();
        for stage in Stage::ALL {
            let want = refs
                .entry(stage.reduction_order())
                .or_insert_with(|| reference(&o, stage, 2));
            let got = run(&o, stage, 2);
            assert!(got.0[7] < got.0[0], "{name}: the loss falls");
            assert_bitwise(&format!("{name} {stage} on 2 ranks"), &got, want);
        }
    }
}

#[test]
fn the_model_code_is_the_same_whoever_holds_the_weights() {
    // Part by part from a store, the single-process model's own forward and backward: one
    // rank of stage 0 is one process summing its micro-batches locally.
    for family in [Family::Gpt2, llama()] {
        let o = options(family, 1, 6);
        let want = reference(&o, Stage::Zero0, 1);
        let got = run(&o, Stage::Zero0, 1);
        assert_bitwise("one rank", &got, &want);
    }
}

#[test]
fn bf16_ranks_track_the_fp32_run() {
    // Mixed precision: bf16 working weights and gradients (reduced in bf16), fp32 masters.
    // Tolerance: the loss after 20 steps within 2% of the fp32 run's.
    for stage in [Stage::Zero0, Stage::Zero3] {
        let o32 = options(Family::Gpt2, 2, 20);
        let mut o16 = o32.clone();
        o16.techniques.model.precision = Precision::Bf16;
        let (l32, _) = run(&o32, stage, 2);
        let (l16, p16) = run(&o16, stage, 2);
        let (a, b) = (l32[19], l16[19]);
        assert!(
            ((a - b) / a).abs() < 0.02,
            "{stage}: fp32 loss {a}, bf16 loss {b}"
        );
        assert!(p16.iter().flatten().all(|x| x.is_finite()));
    }
}

#[test]
fn parts_cover_every_parameter_once() {
    for family in [Family::Gpt2, llama()] {
        let cfg = options(family, 2, 1).model;
        let mut seen = Vec::new();
        for p in Part::all(&cfg) {
            seen.extend(p.params(&cfg));
            assert_eq!(Part::all(&cfg)[p.index(&cfg)], p);
        }
        assert_eq!(
            seen,
            (0..params::param_infos(&cfg).len()).collect::<Vec<_>>()
        );
    }
}

#[test]
fn the_reference_tells_the_two_reduction_orders_apart() {
    // The bitwise comparison above means something: summing the same gradients in the other
    // stage family's order gives other bits.
    let o = options(Family::Gpt2, 3, 3);
    let a = reference(&o, Stage::Zero0, 3);
    let b = reference(&o, Stage::Zero3, 3);
    assert_ne!(a.1, b.1);
}

/// Each rank's bytes that outlive a step — parameters, gradients, optimizer state, read from
/// its tracker after the last step — are headroom-zero's layout of the model's parts: the
/// ZeRO paper's 16, 8 + 8/N, 4 + 12/N, 16/N bytes per parameter (fp32 Adam) and
/// 16, 4 + 12/N, 2 + 14/N, 16/N (bf16 with fp32 masters), plus fewer than N padding elements
/// per part from stage 1 on.
#[test]
fn per_rank_bytes_are_the_stage_formulas() {
    use headroom_tensor::{Device, MemoryCategory};
    use headroom_trainer::zero_train::part_sizes;
    use headroom_zero::{paper_bytes_per_param, per_rank_bytes, ZeroConfig};
    for (family, precision) in [
        (Family::Gpt2, Precision::Fp32),
        (llama(), Precision::Fp32),
        (Family::Gpt2, Precision::Bf16),
    ] {
        for ranks in [2, 3, 4] {
            let mut o = options(family, ranks, 2);
            o.techniques.model.precision = precision;
            let numels: Vec<usize> = part_sizes(&o.model)
                .iter()
                .map(|p| p.iter().sum())
                .collect();
            let psi: usize = numels.iter().sum();
            let zp = match precision {
                Precision::Fp32 => headroom_zero::Precision::Fp32,
                _ => headroom_zero::Precision::MixedBf16,
            };
            for stage in Stage::ALL {
                let want = per_rank_bytes(
                    stage,
                    &numels,
                    ranks,
                    zp,
                    8,
                    ZeroConfig::new(stage).bucket_bytes,
                )
                .unwrap();
                let report = train_zero(&o, ZeroOptions::new(stage, ranks), |_| {}).unwrap();
                for r in &report.ranks {
                    let d = r.memory.device(Device::Cpu).unwrap();
                    let what = format!(
                        "{} {precision:?} {stage} N={ranks} rank {}",
                        o.model.family_name(),
                        r.rank
                    );
                    assert_eq!(
                        d.live[MemoryCategory::Parameters],
                        want.parameters,
                        "{what}"
                    );
                    assert_eq!(d.live[MemoryCategory::Gradients], want.gradients, "{what}");
                    assert_eq!(
                        d.live[MemoryCategory::OptimizerState],
                        want.optimizer_state,
                        "{what}"
                    );
                    let per_param =
                        want.persistent() as f64 / (psi as f64 + want.padding_elements as f64);
                    let paper = paper_bytes_per_param(stage, ranks, zp, 8);
                    assert!(
                        (per_param - paper).abs() < 1e-9,
                        "{what}: {per_param} vs {paper}"
                    );
                    // Stage 3 holds at most the layer computing and the one prefetched.
                    if stage == Stage::Zero3 {
                        assert!(
                            d.peak[MemoryCategory::Parameters]
                                <= want.parameters + 2 * want.gathered_layer_max,
                            "{what}: parameter peak {} vs {} + 2 × {}",
                            d.peak[MemoryCategory::Parameters],
                            want.parameters,
                            want.gathered_layer_max
                        );
                    }
                }
            }
        }
    }
}

/// Bytes through each rank's collective in one step (the ring model's sent bytes), without
/// accumulation or recomputation: stage 0 all-reduces every gradient once (2Ψ(N-1)/N), stage 3
/// all-gathers every block twice (forward, backward) and the embeddings and head once, and
/// reduce-scatters every gradient (≈ 3Ψ(N-1)/N): the ZeRO paper's 1.5×.
#[test]
fn stage_3_moves_about_one_and_a_half_times_stage_0() {
    for family in [Family::Gpt2, llama()] {
        let mut o = options(family, 2, 2);
        o.techniques.micro_batch = None;
        o.techniques.checkpoint = CheckpointChoice::None;
        let sent = |stage| {
            let r = train_zero(&o, ZeroOptions::new(stage, 2), |_| {}).unwrap();
            r.ranks[0].last_step_comm.sent_bytes() as f64
        };
        let ratio = sent(Stage::Zero3) / sent(Stage::Zero0);
        assert!(
            (1.2..=1.6).contains(&ratio),
            "{}: stage 3 / stage 0 = {ratio}",
            family_name(family)
        );
    }
}

fn family_name(f: Family) -> &'static str {
    match f {
        Family::Gpt2 => "gpt2",
        Family::Llama(_) => "llama",
    }
}

/// A store over a model's own weights that records what it was asked for.
struct Recording<'a> {
    cpu: Cpu,
    cfg: ModelConfig,
    masters: &'a [headroom_tensor::CpuTensor],
    asked: std::cell::RefCell<Vec<Part>>,
    grads: std::cell::RefCell<Vec<Option<Vec<f32>>>>,
}

impl headroom_trainer::model::PartStore<Cpu> for Recording<'_> {
    fn weights(&self, part: Part) -> headroom_trainer::Result<Vec<headroom_tensor::CpuTensor>> {
        self.asked.borrow_mut().push(part);
        part.params(&self.cfg)
            .map(|i| {
                let m = &self.masters[i];
                let mut t = self.cpu.zeros(m.shape().clone(), DType::F32)?;
                t.as_mut_slice::<f32>()?
                    .copy_from_slice(m.as_slice::<f32>()?);
                Ok(t)
            })
            .collect()
    }
    fn grad_buffers(
        &self,
        part: Part,
    ) -> headroom_trainer::Result<Vec<headroom_tensor::CpuTensor>> {
        part.params(&self.cfg)
            .map(|i| {
                Ok(self
                    .cpu
                    .zeros(self.masters[i].shape().clone(), DType::F32)?)
            })
            .collect()
    }
    fn push_grads(
        &self,
        part: Part,
        grads: Vec<headroom_tensor::CpuTensor>,
    ) -> headroom_trainer::Result<()> {
        for (i, g) in part.params(&self.cfg).zip(grads) {
            let slot = &mut self.grads.borrow_mut()[i];
            assert!(slot.is_none(), "parameter {i} handed over twice");
            *slot = Some(g.as_slice::<f32>()?.to_vec());
        }
        Ok(())
    }
}

#[test]
fn parts_are_asked_for_in_access_order_and_give_the_models_bits() {
    let cpu = Cpu::new();
    for family in [Family::Gpt2, llama()] {
        let o = options(family, 1, 1);
        let cfg = o.model;
        let model = Model::new(&cpu, cfg, o.techniques.model, 5).unwrap();
        let tokens: Vec<u32> = (0..MICRO * SEQ).map(|i| (i * 7 % 61) as u32).collect();
        let targets: Vec<u32> = (0..MICRO * SEQ).map(|i| (i * 3 % 61) as u32).collect();
        let g = Geometry::new(MICRO, SEQ);
        for schedule in [
            Schedule::store_all(cfg.layers).unwrap(),
            Schedule::every_k(cfg.layers, 2).unwrap(),
        ] {
            let infos = params::param_infos(&cfg);
            let mut want: Vec<_> = infos
                .iter()
                .map(|i| cpu.zeros(i.shape.clone(), DType::F32).unwrap())
                .collect();
            let (l1, _) = model
                .forward_backward(&tokens, &targets, g, &mut want, 0.01, &schedule)
                .unwrap();
            let parts_only = Model::parts_only(&cpu, cfg, o.techniques.model).unwrap();
            let store = Recording {
                cpu: cpu.clone(),
                cfg,
                masters: model.masters(),
                asked: Default::default(),
                grads: std::cell::RefCell::new(vec![None; infos.len()]),
            };
            let (l2, _) = parts_only
                .forward_backward_parts(&store, &tokens, &targets, g, 0.01, &schedule)
                .unwrap();
            assert_eq!(l1.to_bits(), l2.to_bits());
            assert_eq!(
                store.asked.borrow().clone(),
                Part::access_order(&cfg, &schedule)
            );
            for (i, (w, got)) in want.iter().zip(store.grads.borrow().iter()).enumerate() {
                let got = got
                    .as_ref()
                    .unwrap_or_else(|| panic!("no gradient for {i}"));
                assert_eq!(w.as_slice::<f32>().unwrap(), &got[..], "gradient {i}");
            }
            // The model that holds no weights refuses the paths that read its own.
            assert!(parts_only.loss(&tokens, &targets, g).is_err());
        }
    }
}

/// A 2-rank ZeRO-1 checkpoint at step 6 of 12, consolidated, holds exactly what one process
/// summing in that stage's order holds at step 6 (parameters and moment bytes). Resumed on 3
/// ranks under ZeRO-3 it continues exactly as a 3-rank run from that state: losses and final
/// parameters bit for bit. Damaged checkpoints are refused.
#[test]
fn checkpoints_shard_per_rank_consolidate_and_reshard_exactly() {
    let root = std::env::temp_dir().join(format!("headroom-zero-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let mut o = options(Family::Gpt2, 2, 12);
    o.batch = 12; // 2 ranks × 3 micro-batches, or 3 ranks × 2
    o.save = Some((root.join("run"), 6));
    let mut first = o.clone();
    first.stop_after = Some(6);
    train_zero(&first, ZeroOptions::new(Stage::Zero1, 2), |_| {}).unwrap();
    let step6 = root.join("run").join("step-00000006");
    assert!(headroom_trainer::zero_checkpoint::is_zero_checkpoint(
        &step6
    ));
    for r in 0..2 {
        assert!(step6
            .join(headroom_trainer::zero_checkpoint::rank_file(r, 2))
            .is_file());
    }

    // Consolidation equals the single process.
    let consolidated =
        headroom_trainer::zero_checkpoint::consolidate(&step6, &root.join("one")).unwrap();
    let ck = headroom_trainer::checkpoint::load(&consolidated).unwrap();
    let single = reference_from(&first, Stage::Zero1, 2, None);
    assert_eq!(ck.state.step, 6);
    assert!(ck.params == single.params, "consolidated parameters");
    assert!(ck.moments == single.moments, "consolidated moments");
    // Consolidation streams the files a tensor at a time: every file is byte for byte what
    // saving the same values from memory writes.
    let cpu = Cpu::new();
    let infos = headroom_trainer::model::params::param_infos(&ck.state.config);
    let tensors: Vec<_> = infos
        .iter()
        .zip(&ck.params)
        .map(|(info, p)| cpu.upload(p, info.shape.clone()).unwrap())
        .collect();
    let from_memory =
        headroom_trainer::checkpoint::save(&root.join("mem"), &ck.state, &tensors, &ck.moments, 1)
            .unwrap();
    let mut names: Vec<_> = std::fs::read_dir(&consolidated)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert_eq!(names.len(), 5, "{names:?}");
    for name in names {
        let (a, b) = (consolidated.join(&name), from_memory.join(&name));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{name:?} differs"
        );
    }
    // A resumed rank reads the rank files a few tensors at a time: any range gives those
    // tensors of the whole, and nothing past the model.
    let zc = headroom_trainer::zero_checkpoint::load(&step6).unwrap();
    let n = ck.params.len();
    let all = zc.tensors(0..n).unwrap();
    assert!(all.params == ck.params);
    for i in 0..n {
        let one = zc.tensors(i..i + 1).unwrap();
        assert!(one.params[0] == all.params[i], "tensor {i}");
        assert!(one.exp_avg[0] == all.exp_avg[i] && one.exp_avg_sq[0] == all.exp_avg_sq[i]);
    }
    assert!(zc.tensors(n - 1..n + 1).is_err());

    // Re-sharded on 3 ranks: a 3-rank run from the same state.
    let mut resumed = o.clone();
    resumed.save = None;
    resumed.resume_from = Some(step6.clone());
    let mut z = ZeroOptions::new(Stage::Zero3, 3);
    z.collect_parameters = true;
    let report = train_zero(&resumed, z, |_| {}).unwrap();
    let got = (
        report.steps.iter().map(|s| s.loss).collect::<Vec<_>>(),
        report.parameters.unwrap(),
    );
    assert_eq!(report.steps[0].step, 6);
    let start = Start {
        step: 6,
        params: ck.params.clone(),
        optimizer: ck.state.optimizer.clone(),
        moments: ck.moments.clone(),
    };
    let want = reference_from(&o, Stage::Zero3, 3, Some(&start));
    assert_bitwise("2 → 3 ranks", &got, &(want.losses, want.params));

    // The ordinary checkpoint resumes under ZeRO too (and a ZeRO one is not an ordinary one).
    let mut from_single = resumed.clone();
    from_single.resume_from = Some(consolidated.clone());
    let mut z = ZeroOptions::new(Stage::Zero3, 3);
    z.collect_parameters = true;
    let again = train_zero(&from_single, z, |_| {}).unwrap();
    assert!(again.parameters.unwrap() == got.1);
    let e = headroom_trainer::checkpoint::load(&step6)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("consolidate"), "{e}");

    // A flipped byte in a shard, or a missing shard, is refused before anything is used.
    let shard = step6.join(headroom_trainer::zero_checkpoint::rank_file(1, 2));
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 1;
    std::fs::write(&shard, &bytes).unwrap();
    let e = train_zero(&resumed, ZeroOptions::new(Stage::Zero3, 3), |_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("rank-00001"), "{e}");
    std::fs::remove_file(&shard).unwrap();
    assert!(headroom_trainer::zero_checkpoint::load(&step6).is_err());
    // Another run's settings are refused by name.
    let mut other = resumed.clone();
    other.lr *= 2.0;
    other.resume_from = Some(consolidated);
    let e = train_zero(&other, ZeroOptions::new(Stage::Zero0, 2), |_| {})
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("--lr"), "{e}");
    let _ = std::fs::remove_dir_all(&root);
}

/// The ZeRO estimator against each rank's tracker, category by category: parameters (stage
/// 3's gathered layers included), gradients (part buffers and buckets included), optimizer
/// state, activations and the batch exactly; workspace from above.
#[test]
fn the_estimator_predicts_each_ranks_peaks() {
    use headroom_tensor::{Device, MemoryCategory};
    let exact = [
        MemoryCategory::Parameters,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::Activations,
        MemoryCategory::Data,
        MemoryCategory::Workspace,
    ];
    let mut failures = Vec::new();
    use headroom_trainer::techniques::{OptimizerPlacement, Techniques};
    fn plain(_: &mut Techniques) {}
    // The full stack: flash attention, the fused loss in chunks, ZeRO-Offload.
    fn full_stack(t: &mut Techniques) {
        t.model.attention = headroom_attn::AttentionConfig::flash();
        t.model.loss_chunk = Some(8);
        t.optimizer.placement = OptimizerPlacement::HostRam;
    }
    fn chunked_selective(t: &mut Techniques) {
        t.model.attention = headroom_attn::AttentionConfig::chunked();
        t.model.loss_chunk = Some(5);
    }
    /// A family, a precision, a schedule and what else to switch on.
    type SetUp = (Family, Precision, CheckpointChoice, fn(&mut Techniques));
    let setups: [SetUp; 6] = [
        (
            Family::Gpt2,
            Precision::Fp32,
            CheckpointChoice::EveryK(2),
            plain,
        ),
        (llama(), Precision::Fp32, CheckpointChoice::None, plain),
        (
            Family::Gpt2,
            Precision::Bf16,
            CheckpointChoice::SqrtN,
            plain,
        ),
        (llama(), Precision::Bf16, CheckpointChoice::EveryK(2), plain),
        (
            Family::Gpt2,
            Precision::Bf16,
            CheckpointChoice::SqrtN,
            full_stack,
        ),
        (
            llama(),
            Precision::Fp32,
            CheckpointChoice::Selective,
            chunked_selective,
        ),
    ];
    for (family, precision, checkpoint, extra) in setups {
        for ranks in [2, 3] {
            let mut o = options(family, ranks, 2);
            o.techniques.model.precision = precision;
            o.techniques.checkpoint = checkpoint;
            extra(&mut o.techniques);
            for stage in Stage::ALL {
                let what = format!(
                    "{} {precision:?} {checkpoint:?} {stage} N={ranks}",
                    o.model.family_name()
                );
                let (e, _) = estimate_run(&o, &ZeroOptions::new(stage, ranks)).unwrap();
                let report = train_zero(&o, ZeroOptions::new(stage, ranks), |_| {}).unwrap();
                for r in &report.ranks {
                    let d = r.memory.device(Device::Cpu).unwrap();
                    for c in exact {
                        if d.peak[c] != e.device[c] {
                            failures.push(format!(
                                "{what} rank {}: {c:?} measured {} predicted {}",
                                r.rank, d.peak[c], e.device[c]
                            ));
                        }
                    }
                    if d.peak_total > e.device_peak {
                        failures.push(format!(
                            "{what} rank {}: simultaneous peak {} above the bound {}",
                            r.rank, d.peak_total, e.device_peak
                        ));
                    }
                    eprintln!(
                        "{what} rank {}: peak {} bound {} ({:.1}% above), categories added {}",
                        r.rank,
                        d.peak_total,
                        e.device_peak,
                        100.0 * (e.device_peak as f64 / d.peak_total as f64 - 1.0),
                        e.per_rank_peak()
                    );
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn the_zero_ladder_measures_each_rung_against_the_estimator() {
    use headroom_trainer::ladder::{run_zero_ladder, zero_ladder_table};
    let mut o = options(Family::Gpt2, 2, 2);
    o.techniques.micro_batch = None;
    o.batch = 8;
    let rungs = [(Stage::Zero0, 1), (Stage::Zero3, 2), (Stage::Zero2, 4)];
    let results = run_zero_ladder(&o, &rungs, 1 << 30, |_| {}).unwrap();
    assert_eq!(results.len(), 3);
    for r in &results {
        assert!(r.fits);
        assert!(
            r.estimate_mismatches().is_empty(),
            "{:?}",
            r.estimate_mismatches()
        );
        assert!(r.peak_total <= r.estimate.device_peak);
    }
    // Sharding shrinks each rank's state.
    let state = |r: &headroom_trainer::ladder::ZeroRungResult| {
        use headroom_tensor::MemoryCategory as C;
        r.peak[C::OptimizerState]
    };
    assert!(state(&results[1]) < state(&results[0]));
    let table = zero_ladder_table(&results, 1 << 30);
    assert_eq!(
        table.lines().filter(|l| l.starts_with("| ZeRO-")).count(),
        3
    );
    // A budget no rank fits is reported, measured without it.
    let tight = run_zero_ladder(&o, &rungs[..1], 4096, |_| {}).unwrap();
    assert!(!tight[0].fits);
    assert!(tight[0].peak_total > 4096);
}

/// ZeRO-Offload: `--offload ram` keeps each rank's optimizer shard (and bf16's fp32 masters)
/// on its host ledger — the same bytes, none of them on the rank's device — with the same
/// bits as the resident run, and the estimator puts them there too.
#[test]
fn zero_offload_moves_the_optimizer_shard_to_the_host() {
    use headroom_tensor::{Device, MemoryCategory as C};
    use headroom_trainer::techniques::OptimizerPlacement;
    use headroom_trainer::zero_estimate::zero_estimate;
    for precision in [Precision::Fp32, Precision::Bf16] {
        let mut o = options(Family::Gpt2, 2, 4);
        o.techniques.model.precision = precision;
        let mut off = o.clone();
        off.techniques.optimizer.placement = OptimizerPlacement::HostRam;
        for stage in [Stage::Zero1, Stage::Zero3] {
            let mut z = ZeroOptions::new(stage, 2);
            z.collect_parameters = true;
            let resident = train_zero(&o, z, |_| {}).unwrap();
            let offloaded = train_zero(&off, z, |_| {}).unwrap();
            assert!(
                resident.parameters == offloaded.parameters,
                "{precision:?} {stage}"
            );
            let e = zero_estimate(
                &off.model,
                SEQ,
                MICRO,
                off.batch / 2,
                &off.techniques,
                stage,
                2,
            )
            .unwrap();
            for (r, f) in resident.ranks.iter().zip(&offloaded.ranks) {
                let dr = r.memory.device(Device::Cpu).unwrap();
                let df = f.memory.device(Device::Cpu).unwrap();
                let host = f.host_memory.device(Device::Cpu).unwrap();
                // Never on the device, not even while the engine is built.
                assert_eq!(df.peak[C::OptimizerState], 0, "{precision:?} {stage}");
                assert_eq!(host.live[C::OptimizerState], dr.live[C::OptimizerState]);
                assert_eq!(host.peak[C::OptimizerState], e.host[C::OptimizerState]);
                assert_eq!(e.device[C::OptimizerState], 0);
                assert!(df.peak_total < dr.peak_total);
            }
        }
    }
}

/// Validation during a ZeRO run: the same forward, with stage 3's weights gathered part by part.
/// Stages that sum gradients alike hold the same parameters, so they report the same
/// validation loss bit for bit — the gathered path included.
#[test]
fn validation_runs_on_every_stage_and_agrees_across_sharding() {
    use headroom_trainer::train::EvalOptions;
    let dir = std::env::temp_dir().join(format!("headroom-zero-val-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let val = dir.join("val.bin");
    let tokens: Vec<u8> = (0..4096u32)
        .map(|i| ((i * 17 + i / 7) % 61) as u16)
        .flat_map(|t: u16| t.to_le_bytes())
        .collect();
    std::fs::write(&val, tokens).unwrap();
    for family in [Family::Gpt2, llama()] {
        let mut o = options(family, 2, 4);
        o.eval = Some(EvalOptions {
            sets: vec![DataSource::File(val.clone())],
            every: 2,
            batches: 2,
        });
        let vals = |stage| {
            train_zero(&o, ZeroOptions::new(stage, 2), |_| {})
                .unwrap()
                .steps
                .iter()
                .filter_map(|s| s.val_loss)
                .map(f32::to_bits)
                .collect::<Vec<_>>()
        };
        let (v0, v1, v2, v3) = (
            vals(Stage::Zero0),
            vals(Stage::Zero1),
            vals(Stage::Zero2),
            vals(Stage::Zero3),
        );
        assert_eq!(v0.len(), 2, "after steps 2 and 4");
        assert!(v0.iter().all(|&b| f32::from_bits(b).is_finite()));
        assert_eq!(v0, v1);
        assert_eq!(v2, v3);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The ranks share the validation chunks (one each per round) and add the gathered losses in
/// chunk order: the reported loss is, bit for bit, one process's `Model::loss` over the same
/// chunks with the run's final parameters, whatever the rank count and stage.
#[test]
fn validation_is_dealt_out_to_the_ranks_and_equals_one_process() {
    use headroom_trainer::train::{validation_sets, EvalOptions};
    let dir = std::env::temp_dir().join(format!("headroom-zero-val1-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let val = dir.join("val.bin");
    let tokens: Vec<u8> = (0..4096u32)
        .map(|i| ((i * 13 + i / 5) % 61) as u16)
        .flat_map(|t: u16| t.to_le_bytes())
        .collect();
    std::fs::write(&val, tokens).unwrap();
    for (family, stage, ranks) in [
        (Family::Gpt2, Stage::Zero3, 2),
        (Family::Gpt2, Stage::Zero1, 4),
        (llama(), Stage::Zero2, 3),
    ] {
        let mut o = options(family, ranks, 3);
        o.eval = Some(EvalOptions {
            sets: vec![DataSource::File(val.clone())],
            every: 0,
            batches: 2,
        });
        let mut z = ZeroOptions::new(stage, ranks);
        z.collect_parameters = true;
        let report = train_zero(&o, z, |_| {}).unwrap();
        let got = report.steps.last().unwrap().val_loss.unwrap();

        let cpu = Cpu::new();
        let mut model = Model::new(&cpu, o.model, o.techniques.model, o.seed).unwrap();
        for (m, p) in model
            .masters_mut()
            .iter_mut()
            .zip(report.parameters.as_ref().unwrap())
        {
            m.as_mut_slice::<f32>().unwrap().copy_from_slice(p);
        }
        let rows = MICRO * SEQ;
        let g = Geometry::new(MICRO, SEQ);
        let (mut sum, mut n) = (0.0f64, 0usize);
        for b in &validation_sets(&o).unwrap()[0].batches {
            for (t, y) in b.tokens.chunks(rows).zip(b.targets.chunks(rows)) {
                sum += model.loss(t, y, g).unwrap() as f64;
                n += 1;
            }
        }
        assert_eq!(n, 2 * ranks * ACCUM, "two global batches of micro-batches");
        let want = (sum / n as f64) as f32;
        assert_eq!(
            got.to_bits(),
            want.to_bits(),
            "{stage:?} on {ranks} ranks: {got} vs one process {want}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stop request ends every rank after the same step with a checkpoint; resumed, the run ends
/// exactly as the uninterrupted one.
#[test]
fn a_stop_request_saves_and_the_resume_is_exact() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let root = std::env::temp_dir().join(format!("headroom-zero-stop-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let o = options(Family::Gpt2, 2, 6);
    let mut z = ZeroOptions::new(Stage::Zero3, 2);
    z.collect_parameters = true;
    let whole = train_zero(&o, z, |_| {}).unwrap();
    let mut first = o.clone();
    first.save = Some((root.clone(), 0));
    // Raised before the first step (a signal's timing relative to the ranks is the CLI test's
    // subject): every rank finishes step 0, they agree, save and stop.
    first.stop = Some(Arc::new(AtomicBool::new(true)));
    let stopped = train_zero(&first, ZeroOptions::new(Stage::Zero3, 2), |_| {}).unwrap();
    assert!(stopped.stopped);
    assert_eq!(stopped.steps.len(), 1);
    let ck = headroom_trainer::zero_checkpoint::load(&root).unwrap();
    assert_eq!(ck.state.step, 1);
    let mut rest = o.clone();
    rest.resume_from = Some(root.clone());
    let resumed = train_zero(&rest, z, |_| {}).unwrap();
    assert!(!resumed.stopped);
    assert!(resumed.parameters == whole.parameters);
    let _ = std::fs::remove_dir_all(&root);
}

/// A wsd run's stable-phase checkpoint, written by two ZeRO-1 ranks, extends to a longer run:
/// bit for bit the longer run trained from the start (on the same stage, whose reduction
/// order the bits depend on).
#[test]
fn a_wsd_stable_phase_extends_under_zero() {
    let dir = tempfile::tempdir().unwrap();
    let run = |steps: usize| {
        let mut o = options(Family::Gpt2, 2, steps);
        o.lr_schedule = LrSchedule::Wsd;
        o
    };
    // 5 steps turn at step 4; 3 are taken; 10 steps turn at 8.
    let mut first = run(5);
    first.save = Some((dir.path().to_path_buf(), 3));
    first.stop_after = Some(3);
    train_zero(&first, ZeroOptions::new(Stage::Zero1, 2), |_| {}).unwrap();
    let mut z = ZeroOptions::new(Stage::Zero1, 2);
    z.collect_parameters = true;
    let whole = train_zero(&run(10), z, |_| {}).unwrap();
    let mut longer = run(10);
    longer.resume_from = Some(dir.path().to_path_buf());
    let resumed = train_zero(&longer, z, |_| {}).unwrap();
    assert_eq!(resumed.steps.len(), 7);
    assert!(resumed.parameters == whole.parameters);
    // Linear after 2 warmup steps: step 3's rate depends on the length, so 4 steps taken are
    // refused.
    let mut linear = run(5);
    linear.lr_schedule = LrSchedule::Linear;
    let dir = tempfile::tempdir().unwrap();
    linear.save = Some((dir.path().to_path_buf(), 4));
    linear.stop_after = Some(4);
    train_zero(&linear, ZeroOptions::new(Stage::Zero2, 2), |_| {}).unwrap();
    linear.steps = 10;
    linear.stop_after = None;
    linear.save = None;
    linear.resume_from = Some(dir.path().to_path_buf());
    match train_zero(&linear, ZeroOptions::new(Stage::Zero2, 2), |_| {}) {
        Err(headroom_trainer::TrainError::ResumeMismatch { differences, .. }) => {
            assert!(
                differences[0].starts_with("--steps: checkpoint 5, this run 10"),
                "{differences:?}"
            );
        }
        other => panic!("expected ResumeMismatch, got {:?}", other.map(|_| ())),
    }
}

/// A 2-rank ZeRO-1 run of 4 steps saving every 2 steps into a fresh `root/run`: the
/// directory (removed on drop), the run's root and its options.
fn zero_run_with_steps_2_and_4() -> (tempfile::TempDir, std::path::PathBuf, TrainOptions) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run");
    let mut o = options(Family::Gpt2, 2, 4);
    o.save = Some((root.clone(), 2));
    train_zero(&o, ZeroOptions::new(Stage::Zero1, 2), |_| {}).unwrap();
    (dir, root, o)
}

fn steps_in(root: &std::path::Path) -> Vec<usize> {
    headroom_trainer::checkpoint::list(root)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

/// As the single-process trainer: a ZeRO resume from step 2 into a root that still holds step
/// 4 is refused (its own checkpoints would be pruned before step 4's, and a later resume of
/// the root would continue step 4's abandoned run); nothing is written or deleted.
#[test]
fn a_zero_resume_refuses_a_root_holding_checkpoints_past_its_start() {
    let (_dir, root, o) = zero_run_with_steps_2_and_4();
    assert_eq!(steps_in(&root), vec![2, 4]);
    let mut resumed = o.clone();
    resumed.resume_from = Some(root.join("step-00000002"));
    resumed.keep_checkpoints = 1;
    match train_zero(&resumed, ZeroOptions::new(Stage::Zero1, 2), |_| {}) {
        Err(headroom_trainer::TrainError::Checkpoint { path, reason }) => {
            assert_eq!(path, root);
            assert!(reason.contains("steps 4"), "{reason}");
        }
        other => panic!("expected a checkpoint error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(steps_in(&root), vec![2, 4]);
    // Nothing but the two checkpoints and the run's lock file.
    let others = std::fs::read_dir(&root)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name() != headroom_trainer::checkpoint::ROOT_LOCK)
        .count();
    assert_eq!(others, 2);
}

/// `consolidate` removes nothing: an older step consolidated beside a newer one is kept, as is
/// the newer one; an output root that already holds the step (the source's own root, or an
/// earlier consolidation) is refused rather than having that checkpoint replaced.
#[test]
fn consolidation_prunes_nothing_and_refuses_to_replace_a_checkpoint() {
    use headroom_trainer::zero_checkpoint::{consolidate, is_zero_checkpoint};
    let (dir, root, _) = zero_run_with_steps_2_and_4();
    let (step2, step4) = (root.join("step-00000002"), root.join("step-00000004"));
    let e = consolidate(&step2, &root).unwrap_err();
    assert!(
        matches!(&e, headroom_trainer::TrainError::Checkpoint { reason, .. }
            if reason.contains("step 2") && reason.contains("another output directory")),
        "{e}"
    );
    assert_eq!(steps_in(&root), vec![2, 4]);
    assert!(is_zero_checkpoint(&step2) && is_zero_checkpoint(&step4));

    let one = dir.path().join("one");
    let newer = consolidate(&step4, &one).unwrap();
    let older = consolidate(&step2, &one).unwrap();
    assert_eq!(older, one.join("step-00000002"));
    assert_eq!(steps_in(&one), vec![2, 4]);
    assert_eq!(
        headroom_trainer::checkpoint::load(&older)
            .unwrap()
            .state
            .step,
        2
    );
    assert_eq!(
        headroom_trainer::checkpoint::load(&newer)
            .unwrap()
            .state
            .step,
        4
    );
    let manifest = std::fs::read(older.join("manifest.json")).unwrap();
    assert!(consolidate(&root, &one).is_err(), "step 4 again");
    assert!(consolidate(&step2, &one).is_err(), "step 2 again");
    assert_eq!(
        std::fs::read(older.join("manifest.json")).unwrap(),
        manifest
    );
}

/// An ordinary checkpoint whose AdamW step counts lag its step (the single-process run skipped
/// an update, as for a non-finite gradient) cannot be continued by ZeRO's one count for every
/// parameter: the resume is refused by name, and the single-process trainer continues it.
#[test]
fn a_zero_resume_refuses_an_ordinary_checkpoint_whose_step_counts_lag() {
    use headroom_trainer::checkpoint::{Manifest, MANIFEST};
    let dir = tempfile::tempdir().unwrap();
    let mut o = options(Family::Gpt2, 2, 4);
    o.save = Some((dir.path().join("single"), 2));
    o.stop_after = Some(2);
    headroom_trainer::train::train(&o, |_| {}).unwrap();
    let step2 = dir.path().join("single").join("step-00000002");
    let lagging = dir.path().join("lagging").join("step-00000002");
    std::fs::create_dir_all(&lagging).unwrap();
    for e in std::fs::read_dir(&step2).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), lagging.join(e.file_name())).unwrap();
    }
    let mut state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(lagging.join("state.json")).unwrap()).unwrap();
    let steps = state["optimizer"]["steps"].as_array_mut().unwrap();
    assert!(steps.iter().all(|s| s == 2));
    steps[0] = serde_json::json!(1);
    let bytes = serde_json::to_vec_pretty(&state).unwrap();
    std::fs::write(lagging.join("state.json"), &bytes).unwrap();
    let mut m: Manifest =
        serde_json::from_slice(&std::fs::read(lagging.join(MANIFEST)).unwrap()).unwrap();
    let entry = m.files.iter_mut().find(|f| f.name == "state.json").unwrap();
    entry.bytes = bytes.len() as u64;
    entry.xxh3 = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes));
    std::fs::write(lagging.join(MANIFEST), serde_json::to_vec(&m).unwrap()).unwrap();

    let resume = |from: &std::path::Path| {
        let mut r = options(Family::Gpt2, 2, 4);
        r.resume_from = Some(from.to_path_buf());
        r
    };
    let zero = ZeroOptions::new(Stage::Zero1, 2);
    match train_zero(&resume(&lagging), zero, |_| {}) {
        Err(headroom_trainer::TrainError::Checkpoint { path, reason }) => {
            assert_eq!(path, lagging);
            assert!(
                reason.contains("step counts") && reason.contains("without --zero"),
                "{reason}"
            );
        }
        other => panic!("expected a checkpoint error, got {:?}", other.map(|_| ())),
    }
    assert_eq!(
        train_zero(&resume(&step2), zero, |_| {})
            .unwrap()
            .steps
            .len(),
        2
    );
    let single = headroom_trainer::train::train(&resume(&lagging), |_| {}).unwrap();
    assert_eq!(single.steps.len(), 2);
}

mod any_configuration {
    use super::*;
    use headroom_tensor::{Device, MemoryCategory};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        /// Whatever the family, precision, schedule, attention, loss chunking, optimizer
        /// placement, micro-batching, stage and rank count: every rank's peak of every category
        /// is `zero_estimate`'s, byte for byte.
        #[test]
        fn every_ranks_peaks_are_the_estimate(
            llama_family in any::<bool>(),
            bf16 in any::<bool>(),
            schedule in 0u8..5,
            attention in 0u8..3,
            loss_chunk in prop::option::of(1usize..40),
            offload in any::<bool>(),
            ranks in 2usize..5,
            accumulation in 1usize..3,
            stage in 0u8..4,
        ) {
            use headroom_trainer::techniques::OptimizerPlacement;
            let family = if llama_family { llama() } else { Family::Gpt2 };
            let mut o = options(family, ranks, 2);
            o.batch = ranks * MICRO * accumulation;
            let t = &mut o.techniques;
            t.model.precision = if bf16 { Precision::Bf16 } else { Precision::Fp32 };
            t.checkpoint = match schedule {
                0 => CheckpointChoice::None,
                1 => CheckpointChoice::EveryK(2),
                2 => CheckpointChoice::SqrtN,
                3 => CheckpointChoice::Selective,
                _ => CheckpointChoice::EveryK(1),
            };
            t.model.attention = match attention {
                0 => headroom_attn::AttentionConfig::naive(),
                1 => headroom_attn::AttentionConfig::chunked(),
                _ => headroom_attn::AttentionConfig::flash(),
            };
            t.model.loss_chunk = loss_chunk;
            if offload {
                t.optimizer.placement = OptimizerPlacement::HostRam;
            }
            let stage = Stage::ALL[usize::from(stage)];
            let (e, _) = estimate_run(&o, &ZeroOptions::new(stage, ranks)).unwrap();
            let report = train_zero(&o, ZeroOptions::new(stage, ranks), |_| {}).unwrap();
            for r in &report.ranks {
                let d = r.memory.device(Device::Cpu).unwrap();
                for c in MemoryCategory::ALL {
                    prop_assert_eq!(d.peak[c], e.device[c], "rank {} {:?}", r.rank, c);
                }
                prop_assert!(
                    d.peak_total <= e.device_peak,
                    "rank {}: simultaneous peak {} above the bound {}",
                    r.rank,
                    d.peak_total,
                    e.device_peak
                );
                let h = r.host_memory.device(Device::Cpu).map(|h| h.peak);
                for c in MemoryCategory::ALL {
                    let measured = h.as_ref().map_or(0, |p| p[c]);
                    prop_assert_eq!(measured, e.host[c], "rank {} host {:?}", r.rank, c);
                }
            }
        }
    }
}
