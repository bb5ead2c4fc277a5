//! Attention over a cache with room to grow (`attention_forward_cached`) on the CPU: keys and
//! values `[batch, kv_heads, capacity, head_dim]` of which the first `kv_len` rows per head
//! are read. The reference is the exact-length call on copies of those rows: every algorithm,
//! f32 and bf16, with and without a padding mask, must give its bits — with NaN in every row
//! past `kv_len`, so a read of one shows.

mod common;

use common::*;
use headroom_attn::{AttentionBackend, AttentionConfig, AttnError, BackendLimit, DocumentMask};
use headroom_tensor::{Backend, Cpu, DType};
use proptest::prelude::*;

/// `[heads, rows, hd]` host data laid into `[heads, capacity, hd]`, NaN past `rows`.
fn with_room(data: &[f32], heads: usize, rows: usize, capacity: usize, hd: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; heads * capacity * hd];
    for h in 0..heads {
        out[h * capacity * hd..][..rows * hd].copy_from_slice(&data[h * rows * hd..][..rows * hd]);
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn a_cache_with_room_gives_the_exact_length_calls_bits(
        (batch, kv_heads, group) in (1usize..=3, 1usize..=3, 1usize..=3),
        (q_len, extra, room) in (1usize..=12, 0usize..=30, 0usize..=9),
        head_dim in 1usize..=9,
        tiles in (1usize..=40, 1usize..=40, 1usize..=80),
        bf16 in any::<bool>(),
        padded in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let s = Sizes {
            batch,
            q_heads: kv_heads * group,
            kv_heads,
            q_len,
            kv_len: q_len + extra,
            head_dim,
        };
        let dtype = if bf16 { DType::BF16 } else { DType::F32 };
        let x = inputs(&s, seed, dtype);
        let capacity = s.kv_len + room;
        let cpu = Cpu::new();
        let q = upload(&cpu, &x.q, s.q_shape(), dtype);
        let k = upload(&cpu, &x.k, s.kv_shape(), dtype);
        let v = upload(&cpu, &x.v, s.kv_shape(), dtype);
        let roomy = [batch, kv_heads, capacity, head_dim];
        let heads = batch * kv_heads;
        let kr = upload(&cpu, &with_room(&x.k, heads, s.kv_len, capacity, head_dim), roomy, dtype);
        let vr = upload(&cpu, &with_room(&x.v, heads, s.kv_len, capacity, head_dim), roomy, dtype);
        // A padding mask hiding a middle range of each row's keys.
        let hidden: Vec<_> = (0..batch).map(|b| (b + 1).min(s.kv_len)..(2 * b + 2).min(s.kv_len)).collect();
        let mask = DocumentMask::padding(batch, q_len, &hidden).unwrap();
        for which in 0..3 {
            let config = AttentionConfig::with_algorithm(algorithm(which, tiles)).causal(true);
            let (want, got) = if padded {
                (
                    cpu.attention_forward_documents(&q, &k, &v, &config, &mask).unwrap().output,
                    cpu.attention_forward_cached(&q, &kr, &vr, s.kv_len, &config, Some(&mask)).unwrap(),
                )
            } else {
                (
                    cpu.attention_forward(&q, &k, &v, &config).unwrap().output,
                    cpu.attention_forward_cached(&q, &kr, &vr, s.kv_len, &config, None).unwrap(),
                )
            };
            let (want, got) = (download(&cpu, &want), download(&cpu, &got));
            prop_assert!(got.iter().all(|v| v.is_finite()), "a row past kv_len was read");
            prop_assert_eq!(
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{}", config.algorithm.name()
            );
        }
    }
}

#[test]
fn cached_calls_are_checked() {
    let cpu = Cpu::new();
    let q = cpu.upload(&[0.5f32; 4], [1, 1, 1, 4]).unwrap();
    let k = cpu.upload(&[0.5f32; 12], [1, 1, 3, 4]).unwrap();
    let config = AttentionConfig::flash().causal(true);
    assert!(matches!(
        cpu.attention_forward_cached(&q, &k, &k, 4, &config, None),
        Err(AttnError::InvalidConfig(_))
    ));
    assert!(cpu
        .attention_forward_cached(&q, &k, &k, 2, &config, None)
        .is_ok());
    // A packed-documents mask needs as many keys read as queries.
    let packed = DocumentMask::from_positions(1, 1, &[0]).unwrap();
    assert!(cpu
        .attention_forward_cached(&q, &k, &k, 2, &config, Some(&packed))
        .is_err());
    assert!(cpu
        .attention_forward_cached(&q, &k, &k, 1, &config, Some(&packed))
        .is_ok());
    // The trait's default refuses in words.
    let limit = BackendLimit::CachedKeys.to_string();
    assert!(limit.contains("cache"), "{limit}");
}
