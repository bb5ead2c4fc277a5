//! A block reads its weights from the slice its caller passes (`Model::block_forward_with` /
//! `block_backward_with`), the hook for an owner that keeps the weights elsewhere (ZeRO-3's
//! gathered layer): copies of the model's own weights give the same bits as the model's, other
//! weights give other outputs, and a wrong number of tensors is a typed error.

use headroom_attn::AttentionConfig;
use headroom_tensor::{Backend, Cpu, DType, MemoryCategory, Tensor};
use headroom_trainer::model::{
    params, Family, Geometry, LlamaShape, Model, ModelConfig, ModelOptions,
};

fn configs() -> [ModelConfig; 2] {
    let base = ModelConfig {
        vocab: 11,
        max_seq: 7,
        layers: 2,
        heads: 4,
        channels: 16,
        family: Family::Gpt2,
    };
    let llama = ModelConfig {
        family: Family::Llama(LlamaShape {
            kv_heads: 2,
            head_dim: None,
            sliding_window: None,
            no_rope_interval: None,
            query_pre_attn_scalar: None,
            multipliers: None,
            padding_idx: None,
            ffn: 24,
            rope_theta: 100.0,
            rope_scaling: Default::default(),
            class: Default::default(),
            norm_eps: 1e-5,
            tied_head: false,
        }),
        ..base
    };
    [base, llama]
}

#[test]
fn blocks_compute_with_the_weights_they_are_given() {
    let cpu = Cpu::new();
    for cfg in configs() {
        let opts = ModelOptions {
            attention: AttentionConfig::naive(),
            ..ModelOptions::default()
        };
        let model = Model::new(&cpu, cfg, opts, 5).unwrap();
        let g = Geometry::new(2, 6);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 11).collect();
        let x = model.embed(&tokens, g).unwrap();
        let l = 1;
        let own = model.block_weights(l).unwrap();
        let copies: Vec<_> = own
            .iter()
            .map(|t| {
                let mut c = cpu.zeros(t.shape().clone(), DType::F32).unwrap();
                cpu.copy(t, &mut c).unwrap();
                c
            })
            .collect();
        let (want, saved) = model.block_forward(l, &x, g, true).unwrap();
        let (got, saved_with) = model.block_forward_with(l, &copies, &x, g, true).unwrap();
        let bits = |t: &headroom_tensor::CpuTensor| -> Vec<u32> {
            t.as_slice::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(bits(&got), bits(&want), "{:?} forward", cfg.family);

        let dout = {
            let mut d = cpu.zeros(want.shape().clone(), DType::F32).unwrap();
            d.as_mut_slice::<f32>()
                .unwrap()
                .iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v = (i as f32 * 0.37).sin());
            d
        };
        let grads = || {
            let _g = MemoryCategory::Gradients.enter();
            params::param_infos(&cfg)[params::layer_index(&cfg, l, 0)..][..params::per_layer(&cfg)]
                .iter()
                .map(|i| cpu.zeros(i.shape.clone(), DType::F32).unwrap())
                .collect::<Vec<_>>()
        };
        let (mut g0, mut g1) = (grads(), grads());
        let d0 = model
            .block_backward(l, &x, saved.unwrap(), &dout, &mut g0, g)
            .unwrap();
        let d1 = model
            .block_backward_with(l, &copies, &x, saved_with.unwrap(), &dout, &mut g1, g)
            .unwrap();
        assert_eq!(bits(&d1), bits(&d0), "{:?} input gradient", cfg.family);
        for (a, b) in g0.iter().zip(&g1) {
            assert_eq!(bits(a), bits(b), "{:?} weight gradients", cfg.family);
        }

        // Other weights, other output.
        let mut scaled = copies;
        for t in &mut scaled {
            cpu.scale(t, 1.5).unwrap();
        }
        let (other, _) = model.block_forward_with(l, &scaled, &x, g, false).unwrap();
        assert_ne!(bits(&other), bits(&want));

        // A short slice is refused, not a panic.
        let err = model.block_forward_with(l, &scaled[1..], &x, g, false);
        assert!(err.is_err());
    }
}
