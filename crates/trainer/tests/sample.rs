//! Cached decoding against the full forward, and the sampler: a KV-cache step gives the logits
//! the whole sequence's forward gives at that position (both families, GQA and MHA, every
//! attention algorithm, batched, bf16), greedy generation equals the uncached argmax loop
//! (across the sliding window too), and the draw follows softmax(logits / T) within top-k.
//! The repetition penalty, temperature, top-k, top-p and min-p keep the tokens and give the
//! probabilities transformers' logits processors give (`fixtures/sampling.json`, written by
//! `benches/torch/make_sampling_fixture.py`), and greedy generation with a repetition penalty
//! on a Hugging Face fixture model emits transformers' `generate` tokens.

use std::sync::Arc;

use headroom_attn::AttentionConfig;
use headroom_mmap_data::rng::Xoshiro256;
use headroom_profiler::MemoryTracker;
use headroom_tensor::Backend;
use headroom_tensor::{Cpu, Device, MemoryCategory};
use headroom_trainer::model::finetune::{FinetuneBuilder, FinetuneSpec, QuantSpec};
use headroom_trainer::model::params;
use headroom_trainer::model::{
    Family, Geometry, LlamaShape, Model, ModelConfig, ModelOptions, Precision,
};
use headroom_trainer::sample::{
    generate, generate_cached, load_for_inference, load_model, load_model_with,
    next_token_distribution, pick, InferenceWeights, PromptCache, SampleOptions, Sampling,
};
use headroom_trainer::TrainError;
use headroom_trainer::{adapters, hf};
use proptest::prelude::*;

fn cfg(llama: Option<usize>, max_seq: usize) -> ModelConfig {
    let family = match llama {
        Some(kv_heads) => Family::Llama(LlamaShape {
            kv_heads,
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
        }),
        None => Family::Gpt2,
    };
    ModelConfig {
        vocab: 41,
        max_seq,
        layers: 2,
        heads: 4,
        channels: 32,
        family,
    }
}

fn tokens(n: usize, vocab: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 13 + 5 + seed * 7) % vocab) as u32)
        .collect()
}

/// The largest |a − b| relative to the largest |b| of each row of `v` logits.
fn worst_rel(a: &[f32], b: &[f32], v: usize) -> f32 {
    a.chunks(v)
        .zip(b.chunks(v))
        .map(|(x, y)| {
            let scale = y.iter().fold(1e-3f32, |m, q| m.max(q.abs()));
            x.iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max)
                / scale
        })
        .fold(0f32, f32::max)
}

/// Logits of every position of `b` sequences by the cache (a prompt of `prompt` tokens, then
/// one token a step) and by the full forward; returns the worst relative difference.
fn cached_vs_full(model: &Model, b: usize, t: usize, prompt: usize) -> f32 {
    let v = model.cfg.vocab;
    let seq = tokens(b * t, v, 3);
    let full = model.logits(&seq, Geometry::new(b, t)).unwrap();
    let mut cache = model.kv_cache(b);
    let mut worst = 0f32;
    let mut pos = 0;
    while pos < t {
        let step = if pos == 0 { prompt } else { 1 };
        let chunk: Vec<u32> = seq
            .chunks(t)
            .flat_map(|row| row[pos..pos + step].iter().copied())
            .collect();
        let got = model.decode(&mut cache, &chunk).unwrap();
        pos += step;
        assert_eq!(cache.len(), pos);
        let want: Vec<f32> = full
            .chunks(t * v)
            .flat_map(|seq_logits| seq_logits[(pos - 1) * v..pos * v].iter().copied())
            .collect();
        worst = worst.max(worst_rel(&got, &want, v));
    }
    worst
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    #[test]
    fn a_cached_step_gives_the_full_forwards_logits(
        family in 0usize..3,
        algo in 0usize..3,
        b in 1usize..3,
        t in 1usize..12,
        prompt_frac in 0.0f64..1.0,
    ) {
        let llama = [None, Some(2), Some(4)][family];
        let opts = ModelOptions {
            attention: [AttentionConfig::naive(), AttentionConfig::chunked(), AttentionConfig::flash()][algo],
            ..ModelOptions::default()
        };
        let model = Model::new(&Cpu::new(), cfg(llama, 16), opts, 5).unwrap();
        let prompt = 1 + ((t - 1) as f64 * prompt_frac) as usize;
        let worst = cached_vs_full(&model, b, t, prompt);
        // f32 summation order only: q·kᵀ over a cache is the same dot products as a row of
        // the full product, but the GEMM may block them differently.
        prop_assert!(worst <= 2e-5, "worst relative logit difference {worst}");
    }
}

#[test]
fn the_cache_agrees_in_bf16_and_holds_gqa_sized_tensors() {
    for llama in [None, Some(1)] {
        let opts = ModelOptions {
            precision: Precision::Bf16,
            ..ModelOptions::default()
        };
        let model = Model::new(&Cpu::new(), cfg(llama, 16), opts, 9).unwrap();
        // bf16 rounds every kept activation; the cached and full paths round the same values
        // unless a GEMM's blocking moves a result across a rounding boundary.
        let worst = cached_vs_full(&model, 2, 9, 4);
        assert!(worst <= 2e-2, "{llama:?}: {worst}");
        let mut cache = model.kv_cache(1);
        model.decode(&mut cache, &tokens(5, 41, 1)).unwrap();
        let kv_heads = llama.unwrap_or(4);
        // The prompt's last position found no room after the first four: the cache grew to
        // the model's context of 16 (KV_GROWTH is larger).
        assert_eq!((cache.len(), cache.capacity()), (5, 16));
        // k and v, 2 layers, 16 positions of room, head dim 8, 2 bytes (bf16).
        assert_eq!(cache.size_in_bytes(), 2 * 2 * kv_heads * 16 * 8 * 2);
    }
}

/// Logits of each row decoded alone: `prefix` then the row's `suffix` in one step, then one
/// `next` token a step.
fn decoded_alone(model: &Model, prefix: &[u32], suffix: &[u32], next: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.kv_cache(1);
    let prompt: Vec<u32> = prefix.iter().chain(suffix).copied().collect();
    let mut out = vec![model.decode(&mut cache, &prompt).unwrap()];
    for &t in next {
        out.push(model.decode(&mut cache, &[t]).unwrap());
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Prompts of different lengths decoded as one batch — a shared prefix computed once and
    /// repeated, each row's own tokens lined up by hidden padding — give every row the logits
    /// it gets decoded alone, at the first step and each step after.
    #[test]
    fn a_ragged_batch_decodes_each_row_as_it_decodes_alone(
        family in 0usize..3,
        algo in 0usize..3,
        bf16 in proptest::bool::ANY,
        prefix_len in 0usize..5,
        suffix_lens in proptest::collection::vec(1usize..8, 1..4),
        steps in 0usize..4,
        seed in 0usize..50,
    ) {
        let mut model = model_of(family, bf16, 24, 7);
        model.opts.attention =
            [AttentionConfig::naive(), AttentionConfig::chunked(), AttentionConfig::flash()][algo]
                .causal(true);
        let prefix = tokens(prefix_len, 41, seed);
        let suffixes: Vec<Vec<u32>> = suffix_lens
            .iter()
            .enumerate()
            .map(|(i, &n)| tokens(n, 41, seed + 3 * i + 1))
            .collect();
        let rows = suffixes.len();
        let next: Vec<Vec<u32>> = (0..steps).map(|s| tokens(rows, 41, seed + 17 * s + 2)).collect();

        let mut shared = model.kv_cache(1);
        if prefix_len > 0 {
            model.decode(&mut shared, &prefix).unwrap();
        }
        let mut cache = model.repeat_cache(&shared, rows).unwrap();
        let row_refs: Vec<&[u32]> = suffixes.iter().map(Vec::as_slice).collect();
        let mut batched = vec![model.decode_ragged(&mut cache, &row_refs).unwrap()];
        let longest = suffix_lens.iter().max().copied().unwrap_or(0);
        prop_assert_eq!(cache.len(), prefix_len + longest);
        prop_assert_eq!(cache.is_padded(), suffix_lens.iter().any(|&n| n < longest));
        if cache.is_padded() {
            prop_assert!(model.decode_ragged(&mut cache, &row_refs).is_err());
            prop_assert_eq!(cache.len(), prefix_len + longest);
        }
        for step in &next {
            batched.push(model.decode(&mut cache, step).unwrap());
        }

        let v = model.cfg.vocab;
        // f32: summation order only (the batch's GEMMs block rows differently, and the
        // padding shifts the attention tiles). bf16 rounds every kept activation, so a
        // different order can move a value across a rounding boundary.
        let tolerance = if bf16 { 2e-2 } else { 5e-5 };
        for (b, suffix) in suffixes.iter().enumerate() {
            let own_next: Vec<u32> = next.iter().map(|step| step[b]).collect();
            let alone = decoded_alone(&model, &prefix, suffix, &own_next);
            for (step, (got, want)) in batched.iter().zip(&alone).enumerate() {
                let worst = worst_rel(&got[b * v..(b + 1) * v], want, v);
                prop_assert!(
                    worst <= tolerance,
                    "row {b} step {step}: worst relative logit difference {worst}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A ragged batch that drops some rows decodes the rows it keeps to the bits the whole
    /// batch gives them, step after step (decoding batches take their rows one by one), with
    /// their padding, positions and room kept.
    #[test]
    fn kept_rows_decode_as_in_the_whole_batch(
        family in 0usize..3,
        bf16 in proptest::bool::ANY,
        suffix_lens in proptest::collection::vec(1usize..7, 2..6),
        keep_mask in 1u32..63,
        steps in 1usize..5,
        seed in 0usize..50,
    ) {
        let model = model_of(family, bf16, 24, 11);
        let rows = suffix_lens.len();
        let kept: Vec<usize> = (0..rows).filter(|&r| keep_mask & (1 << r) != 0).collect();
        prop_assume!(!kept.is_empty());
        let suffixes: Vec<Vec<u32>> = suffix_lens
            .iter()
            .enumerate()
            .map(|(i, &n)| tokens(n, 41, seed + 5 * i))
            .collect();
        let row_refs: Vec<&[u32]> = suffixes.iter().map(Vec::as_slice).collect();
        let next: Vec<Vec<u32>> = (0..steps).map(|s| tokens(rows, 41, seed + 13 * s + 1)).collect();
        let v = model.cfg.vocab;

        let mut whole = model.kv_cache(rows);
        let mut some = model.kv_cache(rows);
        model.decode_ragged(&mut whole, &row_refs).unwrap();
        model.decode_ragged(&mut some, &row_refs).unwrap();
        // A first step grows both caches' room; the drop keeps it.
        model.decode(&mut whole, &next[0]).unwrap();
        model.decode(&mut some, &next[0]).unwrap();
        let (capacity, bytes) = (some.capacity(), some.size_in_bytes());
        model.keep_rows(&mut some, &kept).unwrap();
        prop_assert_eq!((some.batch(), some.len(), some.capacity()), (kept.len(), whole.len(), capacity));
        prop_assert_eq!(some.size_in_bytes() * rows, bytes * kept.len());
        let padded = kept.iter().any(|&r| suffix_lens[r] < suffix_lens.iter().copied().max().unwrap());
        prop_assert_eq!(some.is_padded(), padded);
        for step in &next[1..] {
            let all = model.decode(&mut whole, step).unwrap();
            let own: Vec<u32> = kept.iter().map(|&r| step[r]).collect();
            let got = model.decode(&mut some, &own).unwrap();
            for (j, &r) in kept.iter().enumerate() {
                prop_assert!(
                    got[j * v..(j + 1) * v] == all[r * v..(r + 1) * v],
                    "kept row {} (row {} of {})", j, r, rows
                );
            }
        }
    }
}

#[test]
fn bad_kept_rows_are_refused_and_change_nothing() {
    let model = model_of(1, false, 12, 3);
    let mut cache = model.kv_cache(3);
    let rows = [tokens(2, 41, 1), tokens(4, 41, 2), tokens(3, 41, 3)];
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    model.decode_ragged(&mut cache, &refs).unwrap();
    let mut twin = model.kv_cache(3);
    model.decode_ragged(&mut twin, &refs).unwrap();
    for bad in [&[][..], &[1, 0], &[0, 0], &[0, 3], &[5]] {
        let e = model.keep_rows(&mut cache, bad).unwrap_err().to_string();
        assert!(e.contains("keep_rows"), "{e}");
        assert_eq!((cache.batch(), cache.len()), (3, 4));
    }
    // All rows kept: nothing to do.
    model.keep_rows(&mut cache, &[0, 1, 2]).unwrap();
    let step = [7, 8, 9];
    assert_eq!(
        model.decode(&mut cache, &step).unwrap(),
        model.decode(&mut twin, &step).unwrap()
    );
}

/// A cache that runs out of room moves to one `KV_GROWTH` positions larger and decodes on as
/// the full forward computes; at the context's end the room stops there.
#[test]
fn a_cache_past_its_room_grows_and_decodes_on() {
    use headroom_trainer::model::KV_GROWTH;
    for (llama, max_seq) in [(None, 2 * KV_GROWTH + 40), (Some(2), KV_GROWTH + 20)] {
        let model =
            Model::new(&Cpu::new(), cfg(llama, max_seq), ModelOptions::default(), 5).unwrap();
        // A prompt of 250 positions, then one a step across the first growth.
        let t = KV_GROWTH + 12;
        let worst = cached_vs_full(&model, 2, t, 250);
        assert!(worst <= 2e-5, "{llama:?}: {worst}");
        let mut cache = model.kv_cache(1);
        model.decode(&mut cache, &tokens(250, 41, 3)).unwrap();
        // The prompt's last position: room to the next multiple of KV_GROWTH.
        assert_eq!(
            (cache.len(), cache.capacity()),
            (250, KV_GROWTH.min(max_seq))
        );
        for i in 0..10 {
            model.decode(&mut cache, &tokens(1, 41, i)).unwrap();
        }
        assert_eq!(cache.capacity(), (2 * KV_GROWTH).min(max_seq));
    }
}

#[test]
fn repeated_caches_hold_exact_copies() {
    let model = model_of(1, false, 12, 3);
    let mut one = model.kv_cache(1);
    model.decode(&mut one, &tokens(5, 41, 4)).unwrap();
    let next = tokens(1, 41, 5);
    let mut alone = model.kv_cache(1);
    model.decode(&mut alone, &tokens(5, 41, 4)).unwrap();
    let want = model.decode(&mut alone, &next).unwrap();
    // Powers of two and the rest taken from the front.
    for copies in 1..=9 {
        let mut many = model.repeat_cache(&one, copies).unwrap();
        assert_eq!((many.batch(), many.len()), (copies, 5));
        // Copies of the positions in use, without the room `one` has.
        assert_eq!(many.capacity(), 5);
        assert_eq!(
            many.size_in_bytes() * one.capacity(),
            copies * one.size_in_bytes() * 5
        );
        let got = model.decode(&mut many, &vec![next[0]; copies]).unwrap();
        for row in got.chunks_exact(41) {
            let worst = worst_rel(row, &want, 41);
            assert!(worst <= 2e-5, "{copies} copies: {worst}");
        }
        // Every copy is the same bits as every other.
        assert!(
            got.chunks_exact(41).all(|r| r == &got[..41]),
            "{copies} copies"
        );
    }
}

#[test]
fn ragged_batches_are_checked_and_cut_back() {
    let model = model_of(1, false, 12, 3);
    let mut cache = model.kv_cache(2);
    let (short, long) = (tokens(2, 41, 1), tokens(5, 41, 2));
    // The wrong row count, an empty row, a row past the context: refused, nothing cached.
    assert!(model.decode_ragged(&mut cache, &[&short]).is_err());
    assert!(model.decode_ragged(&mut cache, &[&short, &[]]).is_err());
    let too_long = tokens(13, 41, 3);
    assert!(model
        .decode_ragged(&mut cache, &[&short, &too_long])
        .is_err());
    assert_eq!((cache.len(), cache.is_padded()), (0, false));

    model.decode_ragged(&mut cache, &[&short, &long]).unwrap();
    assert_eq!((cache.len(), cache.is_padded()), (5, true));
    // Padded once: a second ragged step is refused.
    assert!(model.decode_ragged(&mut cache, &[&short, &long]).is_err());
    // The short row's positions end 3 before the long row's: the context binds the long row.
    for _ in 0..7 {
        model.decode(&mut cache, &[1, 2]).unwrap();
    }
    assert!(model.decode(&mut cache, &[1, 2]).is_err());
    // Cut back into the padding, the rest of the padding stays hidden; before it, none is.
    model.truncate_cache(&mut cache, 2).unwrap();
    assert!(cache.is_padded());
    model.truncate_cache(&mut cache, 0).unwrap();
    assert!(!cache.is_padded());
}

fn model_of(family: usize, bf16: bool, max_seq: usize, seed: u64) -> Model {
    let opts = ModelOptions {
        precision: if bf16 {
            Precision::Bf16
        } else {
            Precision::Fp32
        },
        ..ModelOptions::default()
    };
    Model::new(
        &Cpu::new(),
        cfg([None, Some(2), Some(4)][family], max_seq),
        opts,
        seed,
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// A cache cut back to `cut` positions holds, bit for bit, what a cache built to `cut` by
    /// the same steps holds: decoding after either gives the same logits and bytes.
    #[test]
    fn a_cut_cache_decodes_as_one_built_to_the_cut(
        family in 0usize..3,
        bf16 in proptest::bool::ANY,
        n in 1usize..12,
        cut_frac in 0.0f64..=1.0,
        tail in 1usize..4,
        seed in 0usize..50,
    ) {
        let model = model_of(family, bf16, 16, 3);
        let a = tokens(n, 41, seed);
        let b = tokens(tail, 41, seed + 1);
        let cut = (n as f64 * cut_frac) as usize;
        let mut built = model.kv_cache(1);
        let mut cut_back = model.kv_cache(1);
        if cut > 0 {
            model.decode(&mut built, &a[..cut]).unwrap();
            model.decode(&mut cut_back, &a[..cut]).unwrap();
        }
        if cut < n {
            model.decode(&mut cut_back, &a[cut..]).unwrap();
        }
        prop_assert_eq!(cut_back.len(), n);
        prop_assert!(model.truncate_cache(&mut cut_back, n + 1).is_err());
        prop_assert_eq!(cut_back.len(), n);
        model.truncate_cache(&mut cut_back, cut).unwrap();
        prop_assert_eq!(cut_back.len(), cut);
        // A cut keeps no room past the cut; the other may have room from its growth.
        prop_assert_eq!(cut_back.capacity(), cut);
        prop_assert!(cut_back.size_in_bytes() <= built.size_in_bytes());
        let want = model.decode(&mut built, &b).unwrap();
        let got = model.decode(&mut cut_back, &b).unwrap();
        prop_assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        prop_assert_eq!(cut_back.size_in_bytes(), built.size_in_bytes());
    }

    /// A conversation's second turn through a kept cache generates what replaying the first
    /// turn's decode steps, cutting the cache at the shared prefix and running the rest
    /// generates, bit for bit, and reuses exactly that prefix; the second prompt either
    /// extends the first turn's tokens (a chat template appending the answer and the next
    /// message) or departs from them anywhere (an answer that re-tokenises differently).
    #[test]
    fn a_kept_cache_generates_what_replaying_its_steps_generates(
        family in 0usize..3,
        bf16 in proptest::bool::ANY,
        first in 1usize..8,
        answer in 0usize..6,
        depart in proptest::option::of(0.0f64..1.0),
        added in 1usize..5,
        seed in 0u64..1000,
        sampled in proptest::bool::ANY,
    ) {
        let model = model_of(family, bf16, 32, 7);
        let opts = |tokens: usize| SampleOptions {
            tokens,
            sampling: if sampled { tempered(1.0, Some(8)) } else { Sampling::greedy() },
            seed,
            ..SampleOptions::default()
        };
        let prompt1 = tokens(first, 41, seed as usize);
        let mut kept = PromptCache::new();
        let (gen1, reused1) =
            generate_cached(&model, &mut kept, &prompt1, &opts(answer), |_| {
                Ok(std::ops::ControlFlow::Continue(()))
            })
            .unwrap();
        prop_assert_eq!(reused1, 0);
        prop_assert_eq!(gen1.len(), answer);
        // What the cache holds: the prompt and every answer token but the last (never run);
        // nothing when no token was asked for.
        let fed: Vec<u32> = match answer {
            0 => vec![],
            _ => prompt1.iter().chain(&gen1[..answer - 1]).copied().collect(),
        };
        prop_assert_eq!(kept.len(), fed.len());

        let mut prompt2: Vec<u32> = prompt1.iter().chain(&gen1).copied().collect();
        prompt2.extend(tokens(added, 41, seed as usize + 5));
        if let Some(frac) = depart {
            let at = (frac * prompt2.len() as f64) as usize % prompt2.len();
            prompt2[at] = (prompt2[at] + 1) % 41;
        }
        let (gen2, reused2) =
            generate_cached(&model, &mut kept, &prompt2, &opts(4), |_| {
                Ok(std::ops::ControlFlow::Continue(()))
            })
            .unwrap();
        let shared = fed
            .iter()
            .zip(&prompt2)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt2.len() - 1);
        prop_assert_eq!(reused2, shared);

        // The replay: turn one's steps, the cut, the rest of the prompt, then the draws.
        let mut cache = model.kv_cache(1);
        if answer > 0 {
            model.decode(&mut cache, &prompt1).unwrap();
            for &t in &gen1[..answer - 1] {
                model.decode(&mut cache, &[t]).unwrap();
            }
        }
        model.truncate_cache(&mut cache, shared).unwrap();
        let mut rng = Xoshiro256::seed_from_u64(seed);
        let mut all = prompt2.clone();
        let mut pending = prompt2[shared..].to_vec();
        let mut want = vec![];
        for _ in 0..4 {
            let logits = model.decode(&mut cache, &pending).unwrap();
            let next = pick(&logits, &all, &opts(4).sampling, &mut rng).unwrap();
            all.push(next);
            want.push(next);
            pending = vec![next];
        }
        prop_assert_eq!(gen2, want);
    }
}

/// Kept across a sliding window: once a turn slid, the cache holds a later stretch of tokens
/// at positions 0.., which a longer conversation does not share, and the next turn runs as a
/// fresh one would, token for token.
#[test]
fn a_kept_cache_past_the_window_starts_over() {
    for family in 0..3 {
        let model = model_of(family, false, 8, 11);
        let opts = SampleOptions {
            tokens: 12,
            sampling: Sampling::greedy(),
            ..SampleOptions::default()
        };
        let prompt1 = tokens(5, 41, 1);
        let mut kept = PromptCache::new();
        let (gen1, _) = generate_cached(&model, &mut kept, &prompt1, &opts, |_| {
            Ok(std::ops::ControlFlow::Continue(()))
        })
        .unwrap();
        assert!(kept.len() <= 8);
        let prompt2: Vec<u32> = prompt1
            .iter()
            .chain(&gen1)
            .chain(&[3, 4])
            .copied()
            .collect();
        let (gen2, reused) = generate_cached(&model, &mut kept, &prompt2, &opts, |_| {
            Ok(std::ops::ControlFlow::Continue(()))
        })
        .unwrap();
        let fresh = generate(&model, &prompt2, &opts, |_| Ok(())).unwrap();
        if reused == 0 {
            assert_eq!(gen2, fresh, "family {family}");
        }
        // A failed call (a token past the vocabulary) leaves the kept cache empty.
        let bad: Vec<u32> = prompt2.iter().copied().chain([999]).collect();
        assert!(generate_cached(&model, &mut kept, &bad, &opts, |_| {
            Ok(std::ops::ControlFlow::Continue(()))
        })
        .is_err());
        assert!(kept.is_empty());
    }
}

/// The uncached reference of [`generate`] at temperature 0: the argmax of the full forward's
/// last row over the same sliding context.
fn greedy_reference(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let (v, window) = (model.cfg.vocab, model.cfg.max_seq);
    let mut all = prompt.to_vec();
    let mut start = all.len().saturating_sub(window);
    let mut out = vec![];
    for _ in 0..n {
        if all.len() - start > window {
            start = all.len() - window / 2;
        }
        let ctx = &all[start..];
        let logits = model.logits(ctx, Geometry::new(1, ctx.len())).unwrap();
        let last = &logits[(ctx.len() - 1) * v..];
        let mut best = 0;
        for (i, &l) in last.iter().enumerate() {
            if l > last[best] {
                best = i;
            }
        }
        all.push(best as u32);
        out.push(best as u32);
    }
    out
}

#[test]
fn greedy_generation_equals_the_uncached_argmax_across_the_window() {
    for llama in [None, Some(2)] {
        let model = Model::new(&Cpu::new(), cfg(llama, 8), ModelOptions::default(), 21).unwrap();
        let prompt = tokens(3, 41, 0);
        let opts = SampleOptions {
            tokens: 20,
            sampling: Sampling::greedy(),
            ..SampleOptions::default()
        };
        let mut seen = vec![];
        let got = generate(&model, &prompt, &opts, |t| {
            seen.push(t);
            Ok(())
        })
        .unwrap();
        assert_eq!(got, seen);
        assert_eq!(got, greedy_reference(&model, &prompt, 20), "{llama:?}");
        // A prompt longer than the window keeps its tail.
        let long = tokens(13, 41, 2);
        let got = generate(&model, &long, &opts, |_| Ok(())).unwrap();
        assert_eq!(
            got,
            greedy_reference(&model, &long, 20),
            "{llama:?}, long prompt"
        );
    }
}

#[test]
fn sampling_is_seeded_and_stops_at_the_end_token() {
    let model = Model::new(&Cpu::new(), cfg(Some(2), 16), ModelOptions::default(), 4).unwrap();
    let run = |seed| {
        let opts = SampleOptions {
            tokens: 12,
            sampling: tempered(1.5, Some(10)),
            seed,
            stop_tokens: Vec::new(),
            vocab_limit: None,
        };
        generate(&model, &[1, 2, 3], &opts, |_| Ok(())).unwrap()
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7), run(8), "the seed must matter");
    let first = run(7)[0];
    let opts = SampleOptions {
        tokens: 12,
        sampling: tempered(1.5, Some(10)),
        seed: 7,
        stop_tokens: vec![first],
        vocab_limit: None,
    };
    assert_eq!(
        generate(&model, &[1, 2, 3], &opts, |_| Ok(())).unwrap(),
        vec![first]
    );
    // Of several end tokens (transformers' list of `eos_token_id`s), the first one drawn
    // stops it; a listed id never drawn changes nothing.
    let all = run(7);
    let at = (1..all.len())
        .find(|&i| !all[..i].contains(&all[i]))
        .expect("a token not drawn before");
    let never = (0..4u32).find(|id| !all.contains(id)).unwrap_or(u32::MAX);
    let opts = SampleOptions {
        stop_tokens: vec![never, all[at]],
        ..opts
    };
    assert_eq!(
        generate(&model, &[1, 2, 3], &opts, |_| Ok(())).unwrap(),
        all[..=at]
    );
}

proptest! {
    #[test]
    fn a_draw_is_among_the_top_k(
        logits in prop::collection::vec(-20f32..20.0, 1..60),
        k in 1usize..8,
        temperature in 0.05f32..5.0,
        seed in any::<u64>(),
    ) {
        let mut rng = Xoshiro256::seed_from_u64(seed);
        let id = pick(&logits, &[], &tempered(temperature, Some(k)), &mut rng).unwrap() as usize;
        let above = logits.iter().filter(|&&l| l > logits[id]).count();
        prop_assert!(above < k, "id {id} has {above} larger logits, k = {k}");
    }

    #[test]
    fn temperature_zero_and_top_1_are_the_argmax(
        logits in prop::collection::vec(-20f32..20.0, 1..60),
        seed in any::<u64>(),
    ) {
        let mut rng = Xoshiro256::seed_from_u64(seed);
        let greedy = pick(&logits, &[], &Sampling::greedy(), &mut rng).unwrap() as usize;
        let top1 = pick(&logits, &[], &tempered(3.0, Some(1)), &mut rng).unwrap() as usize;
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let first_max = logits.iter().position(|&l| l == max).unwrap();
        prop_assert_eq!(greedy, first_max);
        // Top-1 keeps every token tied with the largest logit (transformers' rule).
        prop_assert_eq!(logits[top1], max);
    }
}

#[test]
fn draws_follow_the_tempered_softmax() {
    // p(1) = e^{ln 3 / T} / (1 + e^{ln 3 / T}): 0.75 at T = 1, 0.9 at T = 0.5.
    for (temperature, want) in [(1.0f32, 0.75f64), (0.5, 0.9)] {
        let mut rng = Xoshiro256::seed_from_u64(42);
        let n = 20_000;
        let ones = (0..n)
            .filter(|_| {
                pick(
                    &[0.0, 3f32.ln()],
                    &[],
                    &tempered(temperature, None),
                    &mut rng,
                )
                .unwrap()
                    == 1
            })
            .count();
        let p = ones as f64 / n as f64;
        // Five standard deviations of a binomial proportion (σ ≤ 0.0031 here).
        assert!((p - want).abs() < 0.016, "T = {temperature}: {p} vs {want}");
    }
}

#[test]
fn bad_requests_are_typed_errors() {
    let model = Model::new(&Cpu::new(), cfg(Some(2), 8), ModelOptions::default(), 4).unwrap();
    let mut rng = Xoshiro256::seed_from_u64(0);
    let bad = [
        tempered(f32::NAN, None),
        tempered(-1.0, None),
        tempered(f32::INFINITY, None),
        tempered(1.0, Some(0)),
        Sampling {
            top_p: Some(0.0),
            ..Sampling::default()
        },
        Sampling {
            top_p: Some(1.5),
            ..Sampling::default()
        },
        Sampling {
            top_p: Some(f32::NAN),
            ..Sampling::default()
        },
        Sampling {
            min_p: Some(-0.1),
            ..Sampling::default()
        },
        Sampling {
            min_p: Some(1.1),
            ..Sampling::default()
        },
        Sampling {
            repetition_penalty: Some(0.0),
            ..Sampling::default()
        },
        Sampling {
            repetition_penalty: Some(f32::INFINITY),
            ..Sampling::default()
        },
        // 2 / 1e-39 overflows f32: no finite largest score to normalise by.
        tempered(1e-39, None),
    ];
    for sampling in bad {
        assert!(
            matches!(
                pick(&[1.0, 2.0], &[0], &sampling, &mut rng),
                Err(TrainError::Input(_))
            ),
            "{sampling:?}"
        );
    }
    let opts = SampleOptions {
        sampling: bad[4],
        ..SampleOptions::default()
    };
    assert!(generate(&model, &[1], &opts, |_| Ok(())).is_err());
    assert!(matches!(
        pick(&[f32::NAN, 1.0], &[], &Sampling::default(), &mut rng),
        Err(TrainError::Input(_))
    ));
    assert!(pick(&[], &[], &Sampling::default(), &mut rng).is_err());
    let mut cache = model.kv_cache(1);
    // Past the context, an id outside the vocabulary, a ragged batch, nothing at all.
    assert!(model.decode(&mut cache, &tokens(9, 41, 0)).is_err());
    assert!(model.decode(&mut cache, &[41]).is_err());
    assert!(model.decode(&mut model.kv_cache(2), &[1, 2, 3]).is_err());
    assert!(model.decode(&mut cache, &[]).is_err());
    assert!(cache.is_empty(), "refused steps cache nothing");
    model.decode(&mut cache, &tokens(8, 41, 0)).unwrap();
    assert!(
        model.decode(&mut cache, &[1]).is_err(),
        "the window is full"
    );
    assert!(generate(&model, &[], &SampleOptions::default(), |_| Ok(())).is_err());
}

/// Temperature and top-k alone.
fn tempered(temperature: f32, top_k: Option<usize>) -> Sampling {
    Sampling {
        temperature,
        top_k,
        ..Sampling::default()
    }
}

fn fixture() -> serde_json::Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sampling.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn f32_list(v: &serde_json::Value) -> Vec<f32> {
    let list = v.as_array().unwrap();
    list.iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn u32_list(v: &serde_json::Value) -> Vec<u32> {
    let list = v.as_array().unwrap();
    list.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn opt_f32(v: &serde_json::Value) -> Option<f32> {
    v.as_f64().map(|x| x as f32)
}

/// transformers' processors keep exactly these tokens, with these probabilities: 48 random
/// cases, every setting alone and combined, ties at top-k's cut among them.
#[test]
fn the_kept_tokens_and_probabilities_are_transformers() {
    let fx = fixture();
    let cases = fx["warpers"].as_array().unwrap();
    assert!(cases.len() >= 40);
    let mut ties_kept = 0;
    for (n, case) in cases.iter().enumerate() {
        let sampling = Sampling {
            temperature: case["temperature"].as_f64().unwrap() as f32,
            top_k: case["top_k"].as_u64().map(|k| k as usize),
            top_p: opt_f32(&case["top_p"]),
            min_p: opt_f32(&case["min_p"]),
            repetition_penalty: opt_f32(&case["repetition_penalty"]),
        };
        let logits = f32_list(&case["logits"]);
        let got = next_token_distribution(&logits, &u32_list(&case["history"]), &sampling).unwrap();
        let mut kept: Vec<u32> = got.iter().map(|&(id, _)| id).collect();
        kept.sort_unstable();
        assert_eq!(kept, u32_list(&case["kept"]), "case {n}: {sampling:?}");
        if let Some(k) = sampling.top_k {
            ties_kept += usize::from(kept.len() > k);
        }
        let want = f32_list(&case["probs"]);
        for (&id, &p) in kept.iter().zip(&want) {
            let (_, q) = got.iter().find(|&&(g, _)| g == id).unwrap();
            // transformers' softmax is f32: a few ulps of the probability.
            assert!(
                (q - f64::from(p)).abs() <= 1e-6 * f64::from(p).max(1e-3),
                "case {n}, id {id}: {q} vs transformers' {p}"
            );
        }
        let total: f64 = got.iter().map(|&(_, p)| p).sum();
        assert!(
            (total - 1.0).abs() < 1e-12,
            "case {n}: probabilities sum to {total}"
        );
    }
    assert!(ties_kept > 0, "no case kept ties at the k-th score");
}

/// Greedy search with transformers' repetition penalty on the committed Llama fixture emits
/// the tokens `generate(do_sample=False, repetition_penalty=R)` emitted (and stops at the end
/// token where it did); the penalty changes what is generated.
#[test]
fn greedy_generation_with_a_repetition_penalty_is_transformers() {
    let fx = fixture();
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-llama-gqa-untied"
    );
    let model = load_model(std::path::Path::new(dir), &Cpu::new()).unwrap();
    let runs = fx["greedy"].as_array().unwrap();
    let mut changed = 0;
    let mut plain = Vec::new();
    for run in runs {
        let prompt = u32_list(&run["prompt"]);
        let penalty = opt_f32(&run["repetition_penalty"]);
        let opts = SampleOptions {
            tokens: 20,
            sampling: Sampling {
                repetition_penalty: penalty,
                ..Sampling::greedy()
            },
            stop_tokens: run["eos_token_id"]
                .as_u64()
                .map(|e| vec![e as u32])
                .unwrap_or_default(),
            ..SampleOptions::default()
        };
        let got = generate(&model, &prompt, &opts, |_| Ok(())).unwrap();
        let want = u32_list(&run["new_tokens"]);
        assert_eq!(got, want, "prompt {prompt:?}, penalty {penalty:?}");
        match penalty {
            None => plain = got,
            Some(_) => changed += usize::from(got != plain),
        }
    }
    assert!(changed >= 2, "the penalty changed only {changed} runs");
}

/// A model's `generation_config.json` with settings given beside it makes the sampler
/// transformers' `generate` builds (`tests/fixtures/sampling.json`): greedy or sampling, the
/// same steps with the same parameters (transformers' defaults filling what neither sets), the
/// same end ids; what transformers refuses is refused.
#[test]
fn generation_configs_make_the_sampler_transformers_generate_makes() {
    use headroom_trainer::sample::{GenerationConfig, SamplingRequest};
    let fx = fixture();
    let cases = fx["generation_configs"].as_array().unwrap();
    let (mut sampled, mut greedy, mut refused) = (0, 0, 0);
    for case in cases {
        let text = case["generation_config"].to_string();
        let config =
            GenerationConfig::parse(&text, std::path::Path::new("generation_config.json")).unwrap();
        let asked = &case["asked"];
        let request = SamplingRequest {
            temperature: opt_f32(&asked["temperature"]),
            top_k: asked["top_k"].as_u64().map(|k| k as usize),
            top_p: opt_f32(&asked["top_p"]),
            min_p: opt_f32(&asked["min_p"]),
            repetition_penalty: opt_f32(&asked["repetition_penalty"]),
        };
        let got = config.sampling(&request);
        if case.get("error").is_some() {
            assert!(
                got.is_err(),
                "{case}: transformers refused, headroom gave {got:?}"
            );
            refused += 1;
            continue;
        }
        let mut want = if case["sampling"].as_bool().unwrap() {
            sampled += 1;
            Sampling::default()
        } else {
            greedy += 1;
            Sampling::greedy()
        };
        for step in case["processors"].as_array().unwrap() {
            let value = step[1].as_f64().unwrap();
            match step[0].as_str().unwrap() {
                "RepetitionPenaltyLogitsProcessor" => want.repetition_penalty = Some(value as f32),
                "TemperatureLogitsWarper" => want.temperature = value as f32,
                "TopKLogitsWarper" => want.top_k = Some(value as usize),
                "TopPLogitsWarper" => want.top_p = Some(value as f32),
                "MinPLogitsWarper" => want.min_p = Some(value as f32),
                other => panic!("{case}: a step headroom does not have: {other}"),
            }
        }
        assert_eq!(got.unwrap(), want, "{case}");
        assert_eq!(
            config.eos_token_ids,
            u32_list(&case["eos_token_id"]),
            "{case}"
        );
    }
    assert!(
        sampled >= 8 && greedy >= 4 && refused >= 1,
        "{sampled} {greedy} {refused}"
    );
}

/// Stop strings fire after the tokens transformers' `StopStringCriteria` fires after
/// (`tests/fixtures/sampling.json`): the same token texts (a SentencePiece-style tokenizer's
/// word-initial spaces, a byte-level tokenizer's bytes, incomplete UTF-8 included) and the
/// same rule (the string reaches into the last token).
#[test]
fn stop_strings_fire_where_transformers_fires() {
    use headroom_trainer::sample::StopStrings;
    use headroom_trainer::tokenize::Tokenizer;
    let fx = fixture();
    let (mut cases, mut fired_total) = (0, 0);
    for case in fx["stop_strings"].as_array().unwrap() {
        let path = fixture_dir(case["tokenizer"].as_str().unwrap());
        let tok = Tokenizer::from_name(path.to_str().unwrap()).unwrap();
        let strings: Vec<String> = case["stop_strings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect();
        let mut stops = StopStrings::new(&strings).unwrap();
        let fired: Vec<u64> = u32_list(&case["ids"])
            .iter()
            .zip(1..)
            .filter_map(|(&id, n)| stops.push(&tok.token_bytes(id).unwrap()).then_some(n))
            .collect();
        match case["fired_after"].as_array() {
            Some(want) => {
                let want: Vec<u64> = want.iter().map(|n| n.as_u64().unwrap()).collect();
                assert_eq!(fired, want, "{strings:?} over {}", case["tokenizer"]);
            }
            // transformers refuses a string no token can end; it never fires here.
            None => assert!(fired.is_empty(), "{strings:?}"),
        }
        fired_total += fired.len();
        cases += 1;
    }
    assert!(
        cases >= 60 && fired_total >= 60,
        "{cases} cases, {fired_total} firings"
    );
}

/// Greedy generation with a stop string on the committed Llama and the story tokenizer emits
/// the tokens transformers' `generate(stop_strings=…)` emitted: it stops after the token that
/// completes the string (one ending inside a token, one starting in the prompt).
#[test]
fn generation_stops_at_a_stop_string_where_transformers_stops() {
    use headroom_trainer::sample::{generate_until, StopStrings};
    use headroom_trainer::tokenize::Tokenizer;
    let fx = fixture();
    let model = load_model(&fixture_dir("hf-llama-gqa-untied"), &Cpu::new()).unwrap();
    let path = fixture_dir("tokenizer/story/tokenizer.json");
    let tok = Tokenizer::from_name(path.to_str().unwrap()).unwrap();
    let mut early = 0;
    for run in fx["stop_string_generations"].as_array().unwrap() {
        let prompt = u32_list(&run["prompt"]);
        let stop = run["stop"].as_str().unwrap();
        let mut stops = StopStrings::new(&[stop]).unwrap();
        for &id in &prompt {
            stops.push(&tok.token_bytes(id).unwrap());
        }
        let opts = SampleOptions {
            tokens: 24,
            sampling: Sampling::greedy(),
            stop_tokens: vec![1, 2],
            vocab_limit: Some(tok.vocab_size()),
            ..SampleOptions::default()
        };
        let got = generate_until(&model, &prompt, &opts, |id| {
            let hit = stops.push(&tok.token_bytes(id)?);
            Ok(if hit {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            })
        })
        .unwrap();
        assert_eq!(
            got,
            u32_list(&run["new_tokens"]),
            "stop {stop:?} after {prompt:?}"
        );
        early += usize::from(got.len() < u32_list(&run["free"]).len());
    }
    assert!(early >= 10, "only {early} runs stopped early");
}

/// A damaged or hostile `generation_config.json` is a typed error naming the file.
#[test]
fn bad_generation_configs_are_refused() {
    use headroom_trainer::sample::GenerationConfig;
    let path = std::path::Path::new("dir/generation_config.json");
    for (text, why) in [
        ("[1]", "not a JSON object"),
        ("{", "not JSON"),
        (r#"{"eos_token_id": -1}"#, "not a token id"),
        (r#"{"eos_token_id": [2, "x"]}"#, "not a token id"),
        (r#"{"eos_token_id": 4294967296}"#, "not a token id"),
        (r#"{"top_k": 1.5}"#, "not a count"),
        (r#"{"temperature": "hot"}"#, "not a number"),
        (r#"{"temperature": 1e300}"#, "not a finite f32"),
        (r#"{"do_sample": 1}"#, "not true or false"),
    ] {
        let e = GenerationConfig::parse(text, path).unwrap_err().to_string();
        assert!(
            e.contains(why) && e.contains("generation_config.json"),
            "{text}: {e}"
        );
    }
    let many = format!(r#"{{"eos_token_id": [{}]}}"#, vec!["1"; 5000].join(","));
    assert!(GenerationConfig::parse(&many, path).is_err());
    // Values in range but out of the sampler's: refused when sampling would use them.
    use headroom_trainer::sample::SamplingRequest;
    let config = GenerationConfig::parse(r#"{"do_sample": true, "top_p": 1.5}"#, path).unwrap();
    assert!(config.sampling(&SamplingRequest::default()).is_err());
    let asked = SamplingRequest {
        temperature: Some(0.0),
        top_p: Some(2.0),
        ..SamplingRequest::default()
    };
    assert!(GenerationConfig::default().sampling(&asked).is_err());
}

/// transformers' steps done plainly (whole sort, top-p's mass dropped from the least likely
/// up): the kept ids in ascending order, and how close (relative to the total mass) any top-p
/// decision came to its threshold.
fn reference_kept(logits: &[f32], history: &[u32], s: &Sampling) -> (Vec<u32>, f64) {
    let mut scores = logits.to_vec();
    if let Some(r) = s.repetition_penalty {
        let mut ids = history.to_vec();
        ids.sort_unstable();
        ids.dedup();
        let n = scores.len();
        for i in ids.into_iter().map(|i| i as usize).filter(|&i| i < n) {
            scores[i] = if scores[i] < 0.0 {
                scores[i] * r
            } else {
                scores[i] / r
            };
        }
    }
    for x in &mut scores {
        *x /= s.temperature;
    }
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    order.sort_by(|a, b| {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    });
    let mut keep = order.len();
    if let Some(k) = s.top_k.filter(|&k| k < keep) {
        let kth = scores[order[k - 1] as usize];
        keep = order.iter().filter(|&&i| scores[i as usize] >= kth).count();
    }
    let top = f64::from(scores[order[0] as usize]);
    let w = |i: u32| (f64::from(scores[i as usize]) - top).exp();
    let mut margin = f64::INFINITY;
    if let Some(p) = s.top_p.filter(|&p| p < 1.0) {
        let total: f64 = order[..keep].iter().map(|&i| w(i)).sum();
        let limit = (1.0 - f64::from(p)) * total;
        let mut dropped = 0.0;
        while keep > 1 {
            let next = dropped + w(order[keep - 1]);
            margin = margin.min((next - limit).abs() / total);
            if next > limit {
                break;
            }
            dropped = next;
            keep -= 1;
        }
    }
    let mut kept: Vec<u32> = order[..keep].to_vec();
    if let Some(p) = s.min_p {
        kept.retain(|&i| w(i) >= f64::from(p));
    }
    kept.sort_unstable();
    (kept, margin)
}

proptest! {
    /// The selection (top-k by `select_nth`, top-p sorting only what it needs) keeps what the
    /// plain whole-sort steps keep, on vocabularies large enough for top-p to sort in rounds.
    #[test]
    fn the_partial_selection_keeps_what_a_whole_sort_keeps(
        logits in prop::collection::vec(-6f32..6.0, 1..3000),
        history in prop::collection::vec(0u32..3000, 0..40),
        temperature in 0.1f32..3.0,
        top_k in prop::option::of(1usize..2000),
        top_p in prop::option::of(0.01f32..=1.0),
        min_p in prop::option::of(0f32..=0.5),
        repetition_penalty in prop::option::of(0.5f32..2.0),
        ties in any::<bool>(),
    ) {
        // Rounded logits tie often: top-k's ties and equal weights at top-p's cut.
        let logits: Vec<f32> = if ties {
            logits.iter().map(|x| x.round()).collect()
        } else {
            logits
        };
        let sampling = Sampling { temperature, top_k, top_p, min_p, repetition_penalty };
        let got: Vec<u32> = next_token_distribution(&logits, &history, &sampling)
            .unwrap()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let (want, margin) = reference_kept(&logits, &history, &sampling);
        // Summed top-down here and bottom-up there: only a cut within rounding may differ.
        prop_assert!(got == want || margin < 1e-12, "{:?} vs {:?} (margin {})", got, want, margin);
    }

    /// Every cut keeps the most likely token, the kept tokens are the most likely ones in
    /// order, and a token with a larger score than a kept one is kept.
    #[test]
    fn the_cuts_keep_a_most_likely_prefix(
        logits in prop::collection::vec(-8f32..8.0, 1..80),
        history in prop::collection::vec(0u32..100, 0..10),
        temperature in 0.1f32..3.0,
        top_k in prop::option::of(1usize..20),
        top_p in prop::option::of(0.01f32..=1.0),
        min_p in prop::option::of(0f32..=1.0),
        repetition_penalty in prop::option::of(0.5f32..2.0),
    ) {
        let sampling = Sampling { temperature, top_k, top_p, min_p, repetition_penalty };
        let mut dist = next_token_distribution(&logits, &history, &sampling).unwrap();
        prop_assert!(!dist.is_empty());
        prop_assert!(dist.windows(2).all(|w| w[0].0 < w[1].0), "not in id order: {:?}", dist);
        dist.sort_by(|a, b| b.1.total_cmp(&a.1));
        for pair in dist.windows(2) {
            prop_assert!(pair[0].1 >= pair[1].1, "not most likely first: {:?}", dist);
        }
        if let Some(k) = top_k {
            // Beyond k only ties with the k-th.
            if dist.len() > k {
                prop_assert_eq!(dist[k - 1].1, dist[dist.len() - 1].1);
            }
        }
        if let Some(p) = min_p {
            let top = dist[0].1;
            for &(_, q) in &dist[1..] {
                prop_assert!(q >= f64::from(p) * top * (1.0 - 1e-12));
            }
        }
        let total: f64 = dist.iter().map(|&(_, p)| p).sum();
        prop_assert!((total - 1.0).abs() < 1e-9);
    }
}

fn fixture_dir(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn peft_adapter() -> std::path::PathBuf {
    // PEFT's adapter over this Llama fixture (q_proj, v_proj, down_proj; headroom-lora's
    // fixtures, written by benches/torch/make_lora_fixture.py).
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../lora/tests/fixtures/peft-llama-tiny")
}

fn nf4_double() -> QuantSpec {
    QuantSpec {
        quant_type: "nf4".into(),
        blocksize: 64,
        double_quant: true,
    }
}

/// What `load`'s allocations on a tracked CPU hold under `Parameters` once it returns, and
/// the tracked peak of the whole load (every category).
fn parameter_bytes_and_peak(load: impl FnOnce(&Cpu) -> Model) -> (Model, u64, u64) {
    let tracker = Arc::new(MemoryTracker::new());
    let cpu = Cpu::new().with_alloc_hook(tracker.clone());
    let model = load(&cpu);
    let snap = tracker.snapshot();
    let device = snap.device(Device::Cpu).unwrap();
    (
        model,
        device.live[MemoryCategory::Parameters],
        device.peak_total,
    )
}

/// A fine-tuning base read straight into bf16 (`hf::load_into`, the f32 values only streamed)
/// gives the builder the fingerprint and the model that pushing the f32 masters gives, bit
/// for bit, so a run resumes across the change; with and without 4-bit linears, Llama and
/// GPT-2 (whose transposed weights arrive in f32 first). A bf16 tensor pushed without its f32
/// values is refused: its fingerprint would be wrong.
#[test]
fn a_base_streamed_into_bf16_fingerprints_as_its_f32_masters() {
    let cpu = Cpu::new();
    let opts = ModelOptions {
        precision: Precision::Bf16,
        ..ModelOptions::default()
    };
    for dir in [
        fixture_dir("hf-llama-gqa-untied"),
        fixture_dir("hf-gpt2-sharded"),
    ] {
        let cfg = hf::read_config(&dir).unwrap();
        let targets = headroom_trainer::model::finetune::all_linear_targets(&cfg);
        for quantize in [None, Some(nf4_double())] {
            let spec = FinetuneSpec {
                lora: headroom_lora::LoraConfig::new(2, 4.0, targets.clone()),
                quantize,
            };
            let mut streamed = FinetuneBuilder::new(&cpu, cfg, opts, spec.clone()).unwrap();
            hf::load_into(&dir, &cpu, &mut streamed).unwrap();
            let mut pushed = FinetuneBuilder::new(&cpu, cfg, opts, spec).unwrap();
            hf::load_each(&dir, &cpu, |i, t| pushed.push(i, t)).unwrap();
            assert_eq!(
                streamed.fingerprint(),
                pushed.fingerprint(),
                "{}",
                dir.display()
            );
            let seq: Vec<u32> = tokens(8, cfg.vocab, 1);
            let g = Geometry::new(1, 8);
            assert_eq!(
                streamed.finish(None).unwrap().logits(&seq, g).unwrap(),
                pushed.finish(None).unwrap().logits(&seq, g).unwrap()
            );
        }
        let spec = FinetuneSpec {
            lora: headroom_lora::LoraConfig::new(2, 4.0, targets),
            quantize: None,
        };
        let mut b = FinetuneBuilder::new(&cpu, cfg, opts, spec).unwrap();
        let shape = params::param_infos(&cfg)[0].shape.clone();
        let bare = cpu.zeros(shape, headroom_tensor::DType::BF16).unwrap();
        let refused = b.push(0, bare).unwrap_err().to_string();
        assert!(refused.contains("without its f32 values"), "{refused}");
    }
}

/// `eval`'s loss a few rows at a time (`--loss-chunk`): the head holds a chunk of logits, not
/// all of them — the tracked peak falls with the chunk, by exactly one row of logits for a
/// chunk one row short of the batch — and the loss
/// is the whole-logits loss within f32 rounding.
#[test]
fn a_chunked_loss_holds_one_chunk_of_logits() {
    let dir = fixture_dir("hf-llama-gqa-untied");
    let g = Geometry::new(3, 16);
    let seq = tokens(g.b * g.t + 1, 41, 2);
    let (x, y) = (&seq[..g.b * g.t], &seq[1..]);
    let loss_and_peak = |chunk: Option<usize>| {
        let tracker = Arc::new(MemoryTracker::new());
        let cpu = Cpu::new().with_alloc_hook(tracker.clone());
        let mut model = load_for_inference(&dir, None, &cpu, &InferenceWeights::default()).unwrap();
        model.opts.loss_chunk = chunk;
        tracker.reset_peak();
        let loss = model.loss(x, y, g).unwrap();
        let peak = tracker.snapshot().device(Device::Cpu).unwrap().peak[MemoryCategory::Workspace];
        (loss, peak)
    };
    let (whole, whole_peak) = loss_and_peak(None);
    let vocab = hf::read_config(&dir).unwrap().vocab as u64;
    let n = g.b * g.t;
    let mut last = 0;
    for rows in [1, 5, 47] {
        let (loss, peak) = loss_and_peak(Some(rows));
        assert!(
            (loss - whole).abs() <= 1e-5 * whole.abs(),
            "{rows}: {loss} vs {whole}"
        );
        assert!(
            peak >= last && peak < whole_peak,
            "{rows} rows: {peak} vs {whole_peak} whole"
        );
        last = peak;
    }
    // One row fewer than the batch: the head's moment is the peak, one row of logits lower.
    assert_eq!(loss_and_peak(Some(n - 1)).1, whole_peak - vocab * 4);
}

/// `sample`/`eval` weights hold what they claim, counted by the tracker: 2 bytes per parameter
/// in bf16 (no f32 masters), and in 4 bits the block linears at bitsandbytes' packed size
/// beside bf16 embeddings, norms and head.
#[test]
fn inference_weights_hold_the_bytes_they_claim() {
    let dir = fixture_dir("hf-llama-gqa-untied");
    let infos = params::param_infos(&hf::read_config(&dir).unwrap());
    let total: usize = infos
        .iter()
        .map(|i| i.shape.iter().product::<usize>())
        .sum();
    let load_and_peak = |how: &InferenceWeights| {
        let (_, live, peak) =
            parameter_bytes_and_peak(|cpu| load_for_inference(&dir, None, cpu, how).unwrap());
        (live, peak)
    };
    assert_eq!(
        load_and_peak(&InferenceWeights::default()),
        (4 * total as u64, 4 * total as u64)
    );
    let bf16 = InferenceWeights {
        precision: Precision::Bf16,
        quantize: None,
    };
    // The peak too: every tensor is read from the f32 file straight into bf16, never through
    // an f32 copy.
    assert_eq!(load_and_peak(&bf16), (2 * total as u64, 2 * total as u64));
    let q = nf4_double();
    let qc = q.config().unwrap();
    let cfg = hf::read_config(&dir).unwrap();
    let targets = headroom_trainer::model::finetune::all_linear_targets(&cfg);
    let linear = |name: &str| targets.iter().any(|m| name.contains(*m));
    let want: usize = infos
        .iter()
        .map(|i| {
            let n: usize = i.shape.iter().product();
            if linear(&i.name) {
                qc.stored_bytes(n)
            } else {
                2 * n
            }
        })
        .sum();
    let four_bit = InferenceWeights {
        quantize: Some(q),
        ..bf16
    };
    let (live, peak) = load_and_peak(&four_bit);
    assert_eq!(live, want as u64);
    // A 4-bit linear is quantized from its f32 copy; nothing else passes through f32.
    let largest_linear = infos
        .iter()
        .filter(|i| linear(&i.name))
        .map(|i| i.shape.iter().product::<usize>())
        .max()
        .unwrap();
    assert!(
        peak <= live + 4 * largest_linear as u64,
        "4-bit load peaked at {peak} bytes for {live} of weights"
    );
    // Even at this fixture's size (16-wide linears, a 1 KiB code map per tensor) below bf16.
    assert!(
        want < 2 * total,
        "{want} bytes of 4-bit weights, {total} parameters"
    );
}

/// The inference models are the training models: fp32 and bf16 weights give the logits of an
/// fp32 and a bf16 training model bit for bit; a 4-bit base with a PEFT adapter applied unmerged gives the
/// logits of the QLoRA model `Model::finetune` builds (what a QLoRA run trains and checkpoints),
/// bit for bit; the adapter is applied (closer to the fp32 merged model than the bare base is);
/// and cached greedy decoding on the 4-bit model is its full forward's argmax.
#[test]
fn inference_models_compute_what_the_training_models_compute() {
    let dir = fixture_dir("hf-llama-gqa-untied");
    let adapter = peft_adapter();
    let cpu = Cpu::new();
    let cfg = hf::read_config(&dir).unwrap();
    let seq = tokens(24, cfg.vocab, 1);
    let g = Geometry::new(1, 24);
    let bf16 = InferenceWeights {
        precision: Precision::Bf16,
        quantize: None,
    };
    let opts = ModelOptions {
        precision: Precision::Bf16,
        ..ModelOptions::default()
    };
    // fp32: the frozen streamed model is load_model's, bit for bit.
    let fp32 = load_for_inference(&dir, None, &cpu, &InferenceWeights::default()).unwrap();
    assert_eq!(
        fp32.logits(&seq, g).unwrap(),
        load_model(&dir, &cpu).unwrap().logits(&seq, g).unwrap()
    );
    let frozen = load_for_inference(&dir, None, &cpu, &bf16).unwrap();
    let (_, masters) = hf::load(&dir, &cpu).unwrap();
    let trained = Model::from_masters(&cpu, cfg, opts, masters).unwrap();
    assert_eq!(
        frozen.logits(&seq, g).unwrap(),
        trained.logits(&seq, g).unwrap()
    );

    let four_bit = InferenceWeights {
        quantize: Some(nf4_double()),
        ..bf16.clone()
    };
    let qlora = load_for_inference(&dir, Some(&adapter), &cpu, &four_bit).unwrap();
    let lora = headroom_lora::LoraAdapter::load(&cpu, &adapter).unwrap();
    let tensors = adapters::unmerged_tensors(&cfg, &lora, &adapter).unwrap();
    let (_, base) = hf::load(&dir, &cpu).unwrap();
    let spec = FinetuneSpec {
        lora: lora.config().clone(),
        quantize: Some(nf4_double()),
    };
    let built = Model::finetune(&cpu, cfg, opts, base, spec, Some(&tensors)).unwrap();
    let got = qlora.logits(&seq, g).unwrap();
    assert_eq!(got, built.logits(&seq, g).unwrap());

    let merged = load_model_with(&dir, Some(&adapter), &cpu)
        .unwrap()
        .logits(&seq, g)
        .unwrap();
    let bare = load_for_inference(&dir, None, &cpu, &four_bit)
        .unwrap()
        .logits(&seq, g)
        .unwrap();
    let dist = |a: &[f32]| {
        a.iter()
            .zip(&merged)
            .map(|(x, y)| f64::from(x - y).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    assert!(
        dist(&got) < 0.5 * dist(&bare),
        "with the adapter {} from the merged fp32 model, without {}",
        dist(&got),
        dist(&bare)
    );

    let prompt = [1, 5, 9];
    let opts = SampleOptions {
        tokens: 12,
        sampling: Sampling::greedy(),
        ..SampleOptions::default()
    };
    assert_eq!(
        generate(&qlora, &prompt, &opts, |_| Ok(())).unwrap(),
        greedy_reference(&qlora, &prompt, 12)
    );
}

proptest! {
    /// Stop strings, holding only the bytes a match can reach, fire exactly where a search of
    /// the whole text finds a string reaching into the last token.
    #[test]
    fn stop_strings_fire_where_the_whole_text_says(
        strings in proptest::collection::vec(proptest::collection::vec(0u8..3, 1..5), 1..4),
        tokens in proptest::collection::vec(proptest::collection::vec(0u8..3, 0..4), 0..40),
    ) {
        use headroom_trainer::sample::StopStrings;
        // Strings over three bytes as text: every byte below 0x80 is one character.
        let text = |b: &[u8]| -> String { b.iter().map(|&x| char::from(b'a' + x)).collect() };
        let as_text: Vec<String> = strings.iter().map(|s| text(s)).collect();
        let mut stops = StopStrings::new(&as_text).unwrap();
        let mut whole = Vec::new();
        for token in &tokens {
            let bytes: Vec<u8> = text(token).into_bytes();
            let before = whole.len();
            whole.extend_from_slice(&bytes);
            let want = as_text.iter().any(|s| {
                let s = s.as_bytes();
                (0..=whole.len().saturating_sub(s.len()))
                    .any(|at| at + s.len() > before && whole[at..].starts_with(s))
            });
            prop_assert_eq!(stops.push(&bytes), want);
        }
    }
}
