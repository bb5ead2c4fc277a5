//! Loss masks (supervised fine-tuning's completion-only loss): a masked target adds nothing to
//! the loss or the gradient; a step's mean is over its counted targets whichever micro-batch or
//! rank holds them; data without a mask trains exactly as before; `data build --jsonl` masks
//! the prompts TRL masks. Blends (`--data 0.7 a 0.3 b`) of masked and unmasked files train,
//! resume and shard over ZeRO ranks as one process.

use headroom_ckpt::Schedule;
use headroom_mmap_data::{
    formats, loss_mask_path, write_loss_mask, DocumentBoundaries, LossMask, TokenFileFormat,
    TokenType,
};
use headroom_tensor::{Cpu, MemoryCategory};
use headroom_trainer::model::{
    counted_targets, params, Family, Geometry, LlamaShape, Model, ModelConfig, ModelOptions,
    IGNORE_TARGET,
};
use headroom_trainer::train::{train, DataSource, TrainOptions};
use headroom_trainer::zero_train::{train_zero, ZeroOptions};
use headroom_zero::Stage;
use proptest::prelude::*;

fn config(family: Family) -> ModelConfig {
    ModelConfig {
        vocab: 23,
        max_seq: 8,
        layers: 2,
        heads: 2,
        channels: 16,
        family,
    }
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
        ffn: 24,
        rope_theta: 10000.0,
        rope_scaling: Default::default(),
        class: Default::default(),
        norm_eps: 1e-5,
        tied_head: false,
    })
}

/// Loss and gradients of one batch with `targets`, each counted token's loss weighted 1.
fn loss_and_grads(
    model: &Model<Cpu>,
    cpu: &Cpu,
    tokens: &[u32],
    targets: &[u32],
) -> (f64, Vec<Vec<f32>>) {
    let cfg = model.cfg;
    let g = Geometry::new(2, 8);
    let mut grads = params::alloc_like_params(cpu, &cfg, MemoryCategory::Gradients).unwrap();
    let all = Schedule::store_all(cfg.layers).unwrap();
    let (mean, _) = model
        .forward_backward(tokens, targets, g, &mut grads, 1.0, &all)
        .unwrap();
    let grads = grads
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().to_vec())
        .collect();
    (mean as f64 * counted_targets(targets) as f64, grads)
}

fn masked(targets: &[u32], keep: impl Fn(usize) -> bool) -> Vec<u32> {
    targets
        .iter()
        .enumerate()
        .map(|(i, &t)| if keep(i) { t } else { IGNORE_TARGET })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Loss and gradient are sums over the counted targets: splitting the counted set in two
    /// adds up (a leaked masked row would add its own term twice or not at all), and a batch
    /// nobody counts has no loss and exactly no gradient.
    #[test]
    fn masked_targets_add_nothing(
        split in any::<u16>(),
        keep in any::<u16>(),
        llama_family in any::<bool>(),
    ) {
        let cpu = Cpu::new();
        let cfg = config(if llama_family { llama() } else { Family::Gpt2 });
        let model = Model::new(&cpu, cfg, ModelOptions::default(), 5).unwrap();
        let tokens: Vec<u32> = (0..16).map(|i| (i * 7 + 3) % 23).collect();
        let targets: Vec<u32> = (0..16).map(|i| (i * 5 + 1) % 23).collect();
        let kept = |i: usize| (keep >> i) & 1 == 1 || i == 0;
        let side = |i: usize| (split >> i) & 1 == 1;
        let whole = masked(&targets, kept);
        let a = masked(&targets, |i| kept(i) && side(i));
        let b = masked(&targets, |i| kept(i) && !side(i));
        let (lw, gw) = loss_and_grads(&model, &cpu, &tokens, &whole);
        let (la, ga) = loss_and_grads(&model, &cpu, &tokens, &a);
        let (lb, gb) = loss_and_grads(&model, &cpu, &tokens, &b);
        prop_assert!((lw - (la + lb)).abs() <= 1e-5 * lw.abs().max(1.0), "{lw} vs {la} + {lb}");
        for ((w, x), y) in gw.iter().zip(&ga).zip(&gb) {
            let scale = w.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            for ((&w, &x), &y) in w.iter().zip(x).zip(y) {
                prop_assert!((w - (x + y)).abs() <= 1e-5 * scale, "{w} vs {x} + {y}");
            }
        }
        // No counted target: exactly no gradient, and a loss of 0.
        let none = vec![IGNORE_TARGET; 16];
        let (l0, g0) = loss_and_grads(&model, &cpu, &tokens, &none);
        prop_assert_eq!(l0, 0.0);
        prop_assert!(g0.iter().flatten().all(|&v| v == 0.0));
    }
}

/// A token file and its mask: a Markov-ish stream, every third token not counted.
fn masked_file(dir: &std::path::Path, flags: impl Fn(usize) -> bool) -> std::path::PathBuf {
    let path = dir.join("sft.bin");
    let n = 4096;
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * i + 3 * i) % 61).collect();
    formats::write_tokens(&path, &tokens, TokenFileFormat::Raw(TokenType::U16)).unwrap();
    let flags: Vec<bool> = (0..n).map(flags).collect();
    write_loss_mask(loss_mask_path(&path), &flags).unwrap();
    path
}

fn options(path: &std::path::Path) -> TrainOptions {
    let mut o = TrainOptions::tiny_default();
    o.data = DataSource::File(path.to_path_buf());
    o.model = ModelConfig {
        vocab: 61,
        max_seq: 16,
        layers: 2,
        heads: 2,
        channels: 16,
        family: Family::Gpt2,
    };
    o.seq = 16;
    o.batch = 4;
    o.steps = 6;
    o.warmup = 1;
    o.grad_clip = f64::INFINITY;
    o.check_machine_memory = false;
    o
}

/// A Megatron pair of `count` documents, document `d` being `ids(d)`: the `.bin`'s path and the
/// token count.
fn documents_file(
    dir: &std::path::Path,
    count: u32,
    ids: impl Fn(u32) -> Vec<u32>,
) -> (std::path::PathBuf, usize) {
    let documents: Vec<Vec<u32>> = (0..count).map(ids).collect();
    let prefix = dir.join("docs");
    headroom_mmap_data::formats::megatron::write_megatron(&prefix, &documents, TokenType::U16)
        .unwrap();
    (
        prefix.with_extension("bin"),
        documents.iter().map(Vec::len).sum(),
    )
}

/// The losses of `o` run straight through, and of its steps after the third when it is stopped
/// there (checkpoint under `dir`) and resumed; and the resuming options.
fn straight_and_resumed(
    o: &TrainOptions,
    dir: &std::path::Path,
) -> (Vec<f32>, Vec<f32>, TrainOptions) {
    let straight = losses(o);
    let root = dir.join("run");
    let mut first = o.clone();
    first.save = Some((root.clone(), 3));
    first.stop_after = Some(3);
    train(&first, |_| {}).unwrap();
    let mut resumed = o.clone();
    resumed.resume_from = Some(root.join("step-00000003"));
    let rest = losses(&resumed);
    (straight, rest, resumed)
}

fn losses(o: &TrainOptions) -> Vec<f32> {
    train(o, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss)
        .collect()
}

#[test]
fn a_step_is_the_mean_over_its_counted_targets_whatever_the_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    // Uneven: whole windows of prompt (no counted target) next to mostly-counted ones.
    let path = masked_file(dir.path(), |i| (i / 40) % 3 != 0 && i % 5 != 0);
    let mut o = options(&path);
    let whole = losses(&o);
    o.techniques.micro_batch = Some(1);
    let micro = losses(&o);
    for (a, b) in whole.iter().zip(&micro) {
        assert!((a - b).abs() <= 2e-5 * a.abs(), "{whole:?} vs {micro:?}");
    }
    assert!(whole.iter().all(|l| l.is_finite()), "{whole:?}");
    // The masked run's losses are not the unmasked run's (the mask is read).
    std::fs::remove_file(loss_mask_path(&path)).unwrap();
    o.techniques.micro_batch = None;
    let unmasked = losses(&o);
    assert_ne!(whole, unmasked);
}

#[test]
fn a_mask_that_keeps_everything_is_no_mask_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |_| true);
    let mut o = options(&path);
    o.techniques.micro_batch = Some(2);
    let with = losses(&o);
    std::fs::remove_file(loss_mask_path(&path)).unwrap();
    let without = losses(&o);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&with), bits(&without));
}

#[test]
fn a_batch_of_prompts_only_is_a_skipped_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |i| i >= 3900);
    let o = options(&path);
    let r = train(&o, |_| {}).unwrap();
    // Windows are shuffled over the file; most batches hold no counted target.
    let skipped = r.steps.iter().filter(|s| !s.applied).count();
    assert!(skipped > 0, "expected some all-prompt batches");
    for s in &r.steps {
        assert_eq!(s.applied, s.counted_targets > 0, "{s:?}");
        assert_eq!(s.applied, s.loss.is_finite(), "{s:?}");
    }
    // The final loss is over the steps that had one (NaN when none had).
    let had: Vec<f64> = r
        .steps
        .iter()
        .filter(|s| s.applied)
        .map(|s| s.loss as f64)
        .collect();
    let want = had.iter().sum::<f64>() / had.len() as f64;
    let got = r.final_loss(r.steps.len());
    assert!(
        got == want || (got.is_nan() && had.is_empty()),
        "{got} vs {want}"
    );
}

#[test]
fn zero_ranks_weight_the_global_batch_by_its_counted_targets() {
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |i| (i / 24) % 4 != 0 && i % 3 != 0);
    let mut o = options(&path);
    o.techniques.micro_batch = Some(1);
    // Validation on the masked file too: the counted targets of 2 batches, every 3 steps.
    o.eval = Some(headroom_trainer::train::EvalOptions {
        sets: vec![DataSource::File(path.clone())],
        every: 3,
        batches: 2,
    });
    let single = train(&o, |_| {}).unwrap();
    let single_val: Vec<f32> = single.steps.iter().filter_map(|s| s.val_loss).collect();
    let single: Vec<f32> = single.steps.iter().map(|s| s.loss).collect();
    assert_eq!(single_val.len(), 2);
    let close = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 2e-5 * y.abs())
    };
    let mut by_stage = Vec::new();
    for stage in [Stage::Zero1, Stage::Zero3] {
        let r = train_zero(&o, ZeroOptions::new(stage, 2), |_| {}).unwrap();
        let l: Vec<f32> = r.steps.iter().map(|s| s.loss).collect();
        let v: Vec<f32> = r.steps.iter().filter_map(|s| s.val_loss).collect();
        assert!(close(&l, &single), "{stage}: {l:?} vs {single:?}");
        assert!(close(&v, &single_val), "{stage}: {v:?} vs {single_val:?}");
        by_stage.push((l, v));
    }
    assert_eq!(by_stage[0], by_stage[1], "stages agree bit for bit");
}

/// Packed documents under ZeRO: the ranks' losses and validation losses are one process's,
/// and the per-rank Data peak is the estimate's.
#[test]
fn zero_ranks_train_packed_documents_as_one_process() {
    use headroom_tensor::Device;
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = documents_file(dir.path(), 300, |d| {
        (0..2 + d % 13).map(|i| (i * 11 + d * 3) % 61).collect()
    });
    let mut o = options(&path);
    o.documents = Some(DocumentBoundaries::Index);
    o.techniques.micro_batch = Some(1);
    o.eval = Some(headroom_trainer::train::EvalOptions {
        sets: vec![DataSource::File(path.clone())],
        every: 3,
        batches: 2,
    });
    let single = train(&o, |_| {}).unwrap();
    let single_val: Vec<f32> = single.steps.iter().filter_map(|s| s.val_loss).collect();
    let single: Vec<f32> = single.steps.iter().map(|s| s.loss).collect();
    let mut plain = o.clone();
    plain.documents = None;
    let unpacked: Vec<f32> = train(&plain, |_| {})
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss)
        .collect();
    assert!(
        single
            .iter()
            .zip(&unpacked)
            .any(|(a, b)| (a - b).abs() > 1e-3),
        "{single:?} vs {unpacked:?}"
    );
    let close = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 2e-5 * y.abs())
    };
    for stage in [Stage::Zero1, Stage::Zero3] {
        let zero = ZeroOptions::new(stage, 2);
        let (e, _) = headroom_trainer::zero_train::estimate_run(&o, &zero).unwrap();
        let r = train_zero(&o, zero, |_| {}).unwrap();
        let l: Vec<f32> = r.steps.iter().map(|s| s.loss).collect();
        let v: Vec<f32> = r.steps.iter().filter_map(|s| s.val_loss).collect();
        assert!(close(&l, &single), "{stage}: {l:?} vs {single:?}");
        assert!(close(&v, &single_val), "{stage}: {v:?} vs {single_val:?}");
        for rank in &r.ranks {
            let dev = rank.memory.device(Device::Cpu).unwrap();
            assert_eq!(
                dev.peak[MemoryCategory::Data],
                e.device[MemoryCategory::Data],
                "{stage} rank {}",
                rank.rank
            );
        }
    }
}

#[test]
fn jsonl_examples_mask_their_prompts() {
    use headroom_trainer::tokenize::{build_prompt_completion, Tokenizer};
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("sft.jsonl");
    let examples = [
        ("Q: 2+2?\nA:", " 4"),
        ("Translate 'chat':", " cat"),
        ("", " no prompt at all"),
    ];
    let mut text = String::new();
    for (p, c) in examples {
        text += &serde_json::json!({"prompt": p, "completion": c}).to_string();
        text += "\n\n";
    }
    text += &serde_json::json!({"text": "plain text counts whole"}).to_string();
    std::fs::write(&input, text).unwrap();
    let tok = Tokenizer::from_name("gpt2").unwrap();
    let out = dir.path().join("sft.bin");
    let r = build_prompt_completion(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &out,
        false,
    )
    .unwrap();
    assert_eq!(r.examples, 4);
    let mut want_tokens = Vec::new();
    let mut want_flags = Vec::new();
    for (p, c) in examples {
        let prompt = tok.encode_sequence(p).unwrap();
        let whole = tok.encode_sequence(&format!("{p}{c}")).unwrap();
        assert!(whole.starts_with(&prompt));
        want_flags.extend((0..=whole.len()).map(|i| i >= prompt.len()));
        want_tokens.extend(whole);
        want_tokens.push(50256);
    }
    let plain = tok.encode_sequence("plain text counts whole").unwrap();
    want_flags.extend(std::iter::repeat_n(true, plain.len() + 1));
    want_tokens.extend(plain);
    want_tokens.push(50256);
    let ds = formats::open(&out, &Default::default()).unwrap();
    let got: Vec<u32> = (0..ds.total_tokens())
        .map(|i| ds.token(0, i).unwrap() as u32)
        .collect();
    assert_eq!(got, want_tokens);
    let mask = LossMask::open(loss_mask_path(&out)).unwrap();
    let flags: Vec<bool> = (0..mask.len()).map(|i| mask.get(i).unwrap()).collect();
    assert_eq!(flags, want_flags);
    assert_eq!(r.counted, mask.counted());
    assert_eq!(r.boundary_merges, 0);

    // Other keys are ignored (TRL drops other columns); conversational lines are refused.
    std::fs::write(
        &input,
        "{\"id\": 7, \"prompt\": \"a\", \"completion\": \"b\"}\n",
    )
    .unwrap();
    let out1 = dir.path().join("extra.bin");
    build_prompt_completion(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &out1,
        false,
    )
    .unwrap();
    std::fs::write(
        &input,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n",
    )
    .unwrap();
    let e = build_prompt_completion(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &out1,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("chat template"), "{e}");
    // A line that is neither form is refused with its line number, and nothing is left.
    std::fs::write(&input, "{\"prompt\": \"x\"}\n").unwrap();
    let out2 = dir.path().join("bad.bin");
    let e = build_prompt_completion(
        &input,
        &tok,
        TokenFileFormat::Raw(TokenType::U16),
        &out2,
        false,
    )
    .unwrap_err();
    assert!(e.to_string().contains("line 1"), "{e}");
    assert!(!out2.exists() && !loss_mask_path(&out2).exists());
}

#[test]
fn a_masked_run_resumes_bit_for_bit_and_not_under_another_mask() {
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |i| i % 4 != 1);
    let o = options(&path);
    let (straight, rest, resumed) = straight_and_resumed(&o, dir.path());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&straight[3..]));
    // The same tokens under another mask are other data: the saved position is refused.
    write_loss_mask(loss_mask_path(&path), &vec![true; 4096]).unwrap();
    let e = train(&resumed, |_| {}).unwrap_err().to_string();
    assert!(e.contains("different dataset"), "{e}");
}

/// A packed-documents run saved mid-way resumes bit for bit, and resuming it without
/// `--document-attention` (another computation of the same data) is refused by name.
#[test]
fn a_packed_documents_run_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = documents_file(dir.path(), 250, |d| {
        (0..1 + d % 11).map(|i| (i * 5 + d * 7) % 61).collect()
    });
    let mut o = options(&path);
    o.documents = Some(DocumentBoundaries::Index);
    let (straight, rest, resumed) = straight_and_resumed(&o, dir.path());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&straight[3..]));
    let mut unpacked = resumed.clone();
    unpacked.documents = None;
    let e = train(&unpacked, |_| {}).unwrap_err().to_string();
    assert!(e.contains("--document-attention"), "{e}");
}

/// Documents that each end with a separator, in an llm.c shard (no index), train and validate
/// bit for bit as the same documents do through a Megatron index; such a run resumes bit for
/// bit, and resuming it with another separator is refused by name.
#[test]
fn separator_ended_documents_train_as_their_index_does() {
    const SEPARATOR: u32 = 60;
    let dir = tempfile::tempdir().unwrap();
    let ids = |d: u32| -> Vec<u32> {
        (0..d % 13)
            .map(|i| (i * 7 + d * 5) % SEPARATOR)
            .chain([SEPARATOR])
            .collect()
    };
    let (indexed, _) = documents_file(dir.path(), 260, ids);
    let shard = dir.path().join("docs_llmc.bin");
    let stream: Vec<u32> = (0..260).flat_map(ids).collect();
    formats::write_tokens(
        &shard,
        &stream,
        TokenFileFormat::Llmc(headroom_mmap_data::LlmcFlavor::Gpt2),
    )
    .unwrap();
    let run = |path: &std::path::Path, documents| {
        let mut o = options(path);
        o.documents = Some(documents);
        o.eval = Some(headroom_trainer::train::EvalOptions {
            sets: vec![DataSource::File(path.to_path_buf())],
            every: 3,
            batches: 2,
        });
        o
    };
    let by_index = run(&indexed, DocumentBoundaries::Index);
    let by_separator = run(&shard, DocumentBoundaries::EndsWith(SEPARATOR));
    let bits = |o: &TrainOptions| -> Vec<(u32, Option<u32>)> {
        let r = train(o, |_| {}).unwrap();
        r.steps
            .iter()
            .map(|s| (s.loss.to_bits(), s.val_loss.map(f32::to_bits)))
            .collect()
    };
    let want = bits(&by_index);
    assert_eq!(bits(&by_separator), want);
    assert!(want.iter().any(|(_, v)| v.is_some()));
    // The documents do change the computation.
    let mut unpacked = by_separator.clone();
    unpacked.documents = None;
    assert_ne!(bits(&unpacked), want);

    let (straight, rest, resumed) = straight_and_resumed(&by_separator, dir.path());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&straight[3..]));
    let mut other = resumed.clone();
    other.documents = Some(DocumentBoundaries::EndsWith(SEPARATOR - 1));
    let e = train(&other, |_| {}).unwrap_err().to_string();
    assert!(e.contains("--document-separator"), "{e}");
    let mut outside = by_separator.clone();
    outside.documents = Some(DocumentBoundaries::EndsWith(61));
    let e = train(&outside, |_| {}).unwrap_err().to_string();
    assert!(
        e.contains("--document-separator") && e.contains("61"),
        "{e}"
    );
}

#[test]
fn the_estimate_counts_the_loaders_flags() {
    use headroom_tensor::Device;
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |i| i % 3 != 0);
    let o = options(&path);
    let micro = o.micro_batch().unwrap();
    let e = headroom_trainer::train::estimate_with_data(&o, micro, &o.techniques).unwrap();
    let plain =
        headroom_trainer::estimate::estimate(&o.model, o.seq, micro, o.batch, &o.techniques)
            .unwrap();
    assert_eq!(
        e.device[MemoryCategory::Data] - plain.device[MemoryCategory::Data],
        4 * (o.batch * o.seq) as u64,
        "one flag byte per target in each of the loader's four buffers"
    );
    let r = train(&o, |_| {}).unwrap();
    let dev = r.memory.device(Device::Cpu).unwrap();
    for c in MemoryCategory::ALL {
        assert_eq!(dev.peak[c], e.device[c], "{c:?}");
    }
    assert!(dev.peak_total <= e.device_peak);
}

/// Packed documents: the loader's position ids and flags are in the estimate, byte for byte,
/// with and without a loss mask beside the file.
#[test]
fn the_estimate_counts_the_loaders_positions() {
    use headroom_tensor::Device;
    for masked in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (path, n) = documents_file(dir.path(), 200, |d| {
            (0..3 + d % 17).map(|i| (i * 7 + d) % 61).collect()
        });
        if masked {
            let flags: Vec<bool> = (0..n).map(|i| i % 4 != 0).collect();
            write_loss_mask(loss_mask_path(&path), &flags).unwrap();
        }
        let mut o = options(&path);
        o.documents = Some(DocumentBoundaries::Index);
        let micro = o.micro_batch().unwrap();
        let e = headroom_trainer::train::estimate_with_data(&o, micro, &o.techniques).unwrap();
        let plain =
            headroom_trainer::estimate::estimate(&o.model, o.seq, micro, o.batch, &o.techniques)
                .unwrap();
        assert_eq!(
            e.device[MemoryCategory::Data] - plain.device[MemoryCategory::Data],
            4 * 5 * (o.batch * o.seq) as u64,
            "a flag byte and a 4-byte position per input in each of the loader's four buffers"
        );
        let r = train(&o, |_| {}).unwrap();
        let dev = r.memory.device(Device::Cpu).unwrap();
        for c in MemoryCategory::ALL {
            assert_eq!(dev.peak[c], e.device[c], "masked {masked}: {c:?}");
        }
        assert!(r.steps.iter().all(|s| s.loss.is_finite()));
    }
}

#[test]
fn zero_ranks_count_their_loaders_flags() {
    use headroom_tensor::Device;
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |i| i % 3 != 0);
    let mut o = options(&path);
    o.techniques.micro_batch = Some(1);
    let zero = ZeroOptions::new(Stage::Zero1, 2);
    let (e, _) = headroom_trainer::zero_train::estimate_run(&o, &zero).unwrap();
    let r = train_zero(&o, zero, |_| {}).unwrap();
    for rank in &r.ranks {
        let dev = rank.memory.device(Device::Cpu).unwrap();
        assert_eq!(
            dev.peak[MemoryCategory::Data],
            e.device[MemoryCategory::Data],
            "rank {}",
            rank.rank
        );
    }
}

/// Every way the trainer can run a step reads the mask: recomputation, a chunked loss,
/// host-offloaded optimizer and gradients, selective recomputation and micro-batches give the
/// plain masked run's losses (within f32 reordering), far from the unmasked run's.
#[test]
fn every_technique_trains_on_the_counted_targets() {
    use headroom_trainer::techniques::{CheckpointChoice, OptimizerChoice, OptimizerPlacement};
    let dir = tempfile::tempdir().unwrap();
    let path = masked_file(dir.path(), |i| (i / 9) % 3 == 0);
    let mut base = options(&path);
    base.model.layers = 4;
    let want = losses(&base);
    let mut runs = Vec::new();
    let mut o = base.clone();
    o.techniques.checkpoint = CheckpointChoice::SqrtN;
    o.techniques.model.loss_chunk = Some(24);
    runs.push(("sqrt-n + loss chunks", o));
    let mut o = base.clone();
    o.techniques.checkpoint = CheckpointChoice::Selective;
    o.techniques.micro_batch = Some(1);
    runs.push(("selective + micro-batches", o));
    let mut o = base.clone();
    o.techniques.optimizer = OptimizerChoice {
        placement: OptimizerPlacement::HostRam,
        ..OptimizerChoice::resident()
    };
    o.techniques.model.offload_grads = true;
    o.techniques.micro_batch = Some(2);
    runs.push(("offload ram + micro-batches", o));
    for (name, o) in runs {
        let got = losses(&o);
        for (a, b) in got.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-4 * b.abs(),
                "{name}: {got:?} vs {want:?}"
            );
        }
    }
    std::fs::remove_file(loss_mask_path(&path)).unwrap();
    let unmasked = losses(&base);
    let apart = unmasked
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(apart > 1e-2, "{unmasked:?} vs {want:?}");
}

/// A blend of a masked file and an unmasked one: the masked file's windows count only their
/// kept targets, the run resumes bit for bit, resuming it under other weights is refused, and
/// ZeRO ranks (which take the blend's windows in turn) train it as one process does.
#[test]
fn a_blend_of_masked_and_plain_files_trains_resumes_and_shards_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let masked = masked_file(dir.path(), |i| i % 3 != 0);
    let plain = dir.path().join("plain.bin");
    let tokens: Vec<u32> = (0..3000u32).map(|i| (i * 7 + i / 5) % 61).collect();
    formats::write_tokens(&plain, &tokens, TokenFileFormat::Raw(TokenType::U16)).unwrap();
    let mut o = options(&masked);
    o.data = DataSource::Blend(vec![(0.25, masked.clone()), (0.75, plain.clone())]);
    assert!(headroom_trainer::train::data_has_loss_mask(&o));
    // Validation on a blend too (the other way round): one loss, every 3 steps.
    o.eval = Some(headroom_trainer::train::EvalOptions {
        sets: vec![DataSource::Blend(vec![
            (3.0, masked.clone()),
            (1.0, plain.clone()),
        ])],
        every: 3,
        batches: 2,
    });
    let line = headroom_trainer::train::describe_blend(&o).unwrap();
    assert!(line.contains(" 25.0%") && line.contains(" 75.0%"), "{line}");
    // 6 steps of 4 windows of 16: 6 from the masked file (255 windows an epoch) and 18 from
    // the plain one (187).
    assert!(
        line.contains("this run reads 6 windows") && line.contains("reads 18 windows"),
        "{line}"
    );

    let single = train(&o, |_| {}).unwrap();
    let single_val: Vec<f32> = single.steps.iter().filter_map(|s| s.val_loss).collect();
    assert_eq!(single_val.len(), 2);
    let (straight, rest, resumed) = straight_and_resumed(&o, dir.path());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&rest), bits(&straight[3..]));
    // Validating on either file alone measures something else; both as two sets, each is
    // measured as it is alone, and the run's loss is over the two sets' counted targets.
    let mut alone_vals = Vec::new();
    for alone in [&masked, &plain] {
        let mut one = o.clone();
        if let Some(e) = one.eval.as_mut() {
            e.sets = vec![DataSource::File(alone.clone())];
        }
        let val: Vec<f32> = train(&one, |_| {})
            .unwrap()
            .steps
            .iter()
            .filter_map(|s| s.val_loss)
            .collect();
        assert_ne!(bits(&val), bits(&single_val), "{}", alone.display());
        alone_vals.push(val);
    }
    let mut two = o.clone();
    if let Some(e) = two.eval.as_mut() {
        e.sets = vec![
            DataSource::File(masked.clone()),
            DataSource::File(plain.clone()),
        ];
    }
    let report = train(&two, |_| {}).unwrap();
    let evaluated: Vec<&headroom_trainer::train::StepLog> = report
        .steps
        .iter()
        .filter(|s| s.val_loss.is_some())
        .collect();
    assert_eq!(evaluated.len(), 2);
    for (k, s) in evaluated.iter().enumerate() {
        assert_eq!(
            bits(&s.val_losses),
            bits(&[alone_vals[0][k], alone_vals[1][k]])
        );
    }
    // 2 batches of 4 × 16 targets: 2 of every 3 counted in the masked file, all in the plain.
    let names: Vec<(&str, u64)> = report
        .val_losses
        .iter()
        .map(|(name, _, n)| (name.rsplit('/').next().unwrap(), *n))
        .collect();
    let masked_counted = names[0].1;
    assert!(masked_counted > 0 && masked_counted < 128, "{names:?}");
    assert_eq!(names, [("sft.bin", masked_counted), ("plain.bin", 128)]);
    let (last_masked, last_plain) = (alone_vals[0][1] as f64, alone_vals[1][1] as f64);
    let overall =
        (last_masked * masked_counted as f64 + last_plain * 128.0) / (masked_counted + 128) as f64;
    let (v, n) = report.val_loss.unwrap();
    assert_eq!((v, n), (overall as f32, masked_counted + 128));
    // Either file alone trains otherwise.
    for alone in [&masked, &plain] {
        let mut one = o.clone();
        one.data = DataSource::File(alone.clone());
        assert_ne!(bits(&losses(&one)), bits(&straight), "{}", alone.display());
    }
    let mut reweighted = resumed.clone();
    reweighted.data = DataSource::Blend(vec![(0.5, masked.clone()), (0.5, plain.clone())]);
    let e = train(&reweighted, |_| {}).unwrap_err().to_string();
    assert!(e.contains("different dataset"), "{e}");

    let close = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| (x - y).abs() <= 2e-5 * y.abs())
    };
    let r = train_zero(&o, ZeroOptions::new(Stage::Zero1, 2), |_| {}).unwrap();
    let l: Vec<f32> = r.steps.iter().map(|s| s.loss).collect();
    let v: Vec<f32> = r.steps.iter().filter_map(|s| s.val_loss).collect();
    assert!(close(&l, &straight), "{l:?} vs {straight:?}");
    assert!(close(&v, &single_val), "{v:?} vs {single_val:?}");
    // Two sets over ranks: each set's loss and the overall one are one process's.
    let r = train_zero(&two, ZeroOptions::new(Stage::Zero1, 2), |_| {}).unwrap();
    for (zero, one) in r
        .steps
        .iter()
        .zip(&report.steps)
        .filter(|(s, _)| s.val_loss.is_some())
    {
        assert!(
            close(&zero.val_losses, &one.val_losses),
            "{zero:?} vs {one:?}"
        );
        assert!(close(&[zero.val_loss.unwrap()], &[one.val_loss.unwrap()]));
    }
}

/// Files listed without weights are one dataset: the same run, bit for bit, as the directory
/// that holds them read as shards.
#[test]
fn files_without_weights_train_as_their_directory_of_shards() {
    let dir = tempfile::tempdir().unwrap();
    let shards = dir.path().join("shards");
    std::fs::create_dir(&shards).unwrap();
    let mut files = Vec::new();
    for (i, n) in [(0u32, 1500u32), (1, 900)] {
        let path = shards.join(format!("part_{i}.bin"));
        let tokens: Vec<u32> = (0..n).map(|t| (t * 5 + i * 17 + t / 7) % 61).collect();
        formats::write_tokens(&path, &tokens, TokenFileFormat::Raw(TokenType::U16)).unwrap();
        files.push(path);
    }
    let mut listed = options(&files[0]);
    listed.data = DataSource::Files(files.clone());
    let mut directory = listed.clone();
    directory.data = DataSource::File(shards.clone());
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let listed_losses = losses(&listed);
    assert_eq!(bits(&listed_losses), bits(&losses(&directory)));
    let mut first = listed.clone();
    first.data = DataSource::File(files[0].clone());
    assert_ne!(bits(&listed_losses), bits(&losses(&first)));
}
