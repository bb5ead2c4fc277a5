//! Bad input is a typed error, and nothing is computed.

use headroom_attn::{Algorithm, AttentionBackend, AttentionConfig, AttnError, MAX_HEAD_DIM};
use headroom_tensor::{bf16, Backend, Cpu, CpuTensor};

fn f32s(cpu: &Cpu, shape: &[usize]) -> CpuTensor {
    let n = shape.iter().product();
    cpu.upload(&vec![0.5f32; n], shape.to_vec()).unwrap()
}

#[test]
fn shapes_dtypes_and_configs_are_checked() {
    let cpu = Cpu::new();
    let flash = AttentionConfig::flash();
    let q = f32s(&cpu, &[1, 4, 8, 16]);
    let kv = f32s(&cpu, &[1, 2, 8, 16]);
    let fwd = |q: &CpuTensor, k: &CpuTensor, v: &CpuTensor, c: &AttentionConfig| {
        cpu.attention_forward(q, k, v, c).map(|_| ())
    };
    assert!(fwd(&q, &kv, &kv, &flash).is_ok());

    let rank3 = f32s(&cpu, &[4, 8, 16]);
    assert!(matches!(
        fwd(&rank3, &kv, &kv, &flash),
        Err(AttnError::NotRank4 { tensor: "q", .. })
    ));
    let three_heads = f32s(&cpu, &[1, 3, 8, 16]);
    assert!(matches!(
        fwd(&q, &three_heads, &three_heads, &flash),
        Err(AttnError::HeadGrouping {
            q_heads: 4,
            kv_heads: 3
        })
    ));
    let zero_heads = f32s(&cpu, &[1, 0, 8, 16]);
    assert!(matches!(
        fwd(&q, &zero_heads, &zero_heads, &flash),
        Err(AttnError::HeadGrouping { .. })
    ));
    let other_dim = f32s(&cpu, &[1, 2, 8, 8]);
    assert!(matches!(
        fwd(&q, &other_dim, &other_dim, &flash),
        Err(AttnError::ShapeMismatch { tensor: "k", .. })
    ));
    let longer_v = f32s(&cpu, &[1, 2, 9, 16]);
    assert!(matches!(
        fwd(&q, &kv, &longer_v, &flash),
        Err(AttnError::ShapeMismatch { tensor: "v", .. })
    ));
    let big = f32s(&cpu, &[1, 1, 2, MAX_HEAD_DIM + 1]);
    assert!(matches!(
        fwd(&big, &big, &big, &flash),
        Err(AttnError::HeadDim { .. })
    ));
    let empty_dim = f32s(&cpu, &[1, 1, 2, 0]);
    assert!(matches!(
        fwd(&empty_dim, &empty_dim, &empty_dim, &flash),
        Err(AttnError::HeadDim { .. })
    ));

    let kv_bf16 = cpu
        .upload(&vec![bf16::ONE; 2 * 8 * 16], [1, 2, 8, 16])
        .unwrap();
    assert!(matches!(
        fwd(&q, &kv_bf16, &kv, &flash),
        Err(AttnError::DTypeMismatch { tensor: "k", .. })
    ));
    let ints = cpu.upload(&vec![1u16; 4 * 8 * 16], [1, 4, 8, 16]).unwrap();
    assert!(matches!(
        fwd(&ints, &ints, &ints, &flash),
        Err(AttnError::UnsupportedDType(_))
    ));

    for bad in [
        AttentionConfig::with_algorithm(Algorithm::Flash {
            block_q: 0,
            block_k: 8,
        }),
        AttentionConfig::with_algorithm(Algorithm::Chunked { chunk_size: 0 }),
        AttentionConfig::flash().softmax_scale(f32::NAN),
        AttentionConfig::flash().backward_segments(0),
    ] {
        assert!(
            matches!(fwd(&q, &kv, &kv, &bad), Err(AttnError::InvalidConfig(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn backward_checks_its_inputs_against_the_forward() {
    let cpu = Cpu::new();
    let q = f32s(&cpu, &[1, 2, 8, 16]);
    let kv = f32s(&cpu, &[1, 2, 8, 16]);
    let d_out = f32s(&cpu, &[1, 2, 8, 16]);
    let fwd = cpu
        .attention_forward(&q, &kv, &kv, &AttentionConfig::naive())
        .unwrap();
    assert!(cpu.attention_backward(&q, &kv, &kv, &fwd, &d_out).is_ok());

    let other_q = f32s(&cpu, &[1, 2, 9, 16]);
    assert!(matches!(
        cpu.attention_backward(&other_q, &kv, &kv, &fwd, &d_out),
        Err(AttnError::ForwardMismatch(_))
    ));
    let bad_grad = f32s(&cpu, &[1, 2, 8, 8]);
    assert!(matches!(
        cpu.attention_backward(&q, &kv, &kv, &fwd, &bad_grad),
        Err(AttnError::ShapeMismatch {
            tensor: "d_out",
            ..
        })
    ));
    let bf16_grad = cpu
        .upload(&vec![bf16::ONE; 2 * 8 * 16], [1, 2, 8, 16])
        .unwrap();
    assert!(matches!(
        cpu.attention_backward(&q, &kv, &kv, &fwd, &bf16_grad),
        Err(AttnError::DTypeMismatch {
            tensor: "d_out",
            ..
        })
    ));
    // Naive backward without the probabilities its forward saved.
    let mut stripped = fwd;
    stripped.probs = None;
    assert!(matches!(
        cpu.attention_backward(&q, &kv, &kv, &stripped, &d_out),
        Err(AttnError::ForwardMismatch(_))
    ));
}

#[test]
fn empty_dimensions_and_oversized_tiles_are_fine() {
    let cpu = Cpu::new();
    for (q_shape, kv_shape) in [
        ([0, 2, 8, 16], [0, 1, 8, 16]),
        ([1, 2, 0, 16], [1, 1, 8, 16]),
        ([1, 2, 5, 16], [1, 1, 0, 16]),
    ] {
        let q = f32s(&cpu, &q_shape);
        let kv = f32s(&cpu, &kv_shape);
        for config in [
            AttentionConfig::naive(),
            AttentionConfig::with_algorithm(Algorithm::Chunked {
                chunk_size: usize::MAX,
            }),
            AttentionConfig::with_algorithm(Algorithm::Flash {
                block_q: usize::MAX,
                block_k: usize::MAX,
            })
            .backward_segments(usize::MAX),
        ] {
            let fwd = cpu
                .attention_forward(&q, &kv, &kv, &config.causal(true))
                .unwrap();
            let out = cpu.download::<f32>(&fwd.output).unwrap();
            assert!(out.iter().all(|&x| x == 0.0), "{q_shape:?} {config:?}");
            let g = cpu.attention_backward(&q, &kv, &kv, &fwd, &q).unwrap();
            for t in [&g.dq, &g.dk, &g.dv] {
                assert!(cpu.download::<f32>(t).unwrap().iter().all(|&x| x == 0.0));
            }
        }
    }
    // Tiles far larger than the sequence still give the right answer.
    let q = cpu
        .upload(
            &(0..2 * 3 * 4).map(|i| (i as f32).sin()).collect::<Vec<_>>(),
            [1, 2, 3, 4],
        )
        .unwrap();
    let huge = AttentionConfig::with_algorithm(Algorithm::Flash {
        block_q: usize::MAX,
        block_k: usize::MAX,
    });
    let a = cpu.attention_forward(&q, &q, &q, &huge).unwrap();
    let b = cpu
        .attention_forward(&q, &q, &q, &AttentionConfig::naive())
        .unwrap();
    let (a, b) = (
        cpu.download::<f32>(&a.output).unwrap(),
        cpu.download::<f32>(&b.output).unwrap(),
    );
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6));
}
