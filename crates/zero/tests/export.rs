//! What a checkpoint writer reads: [`ZeroEngine::export_piece`] lends each piece of a rank's
//! shard from the engine's own memory (no copy for f32 values of record), the pieces of all
//! ranks reassemble every tensor exactly once, the moments appear after the first step, and a
//! piece the geometry does not list is a typed error.

mod common;

use std::borrow::Cow;

use common::{drive_step, run_ranks, AdamW};
use headroom_tensor::Cpu;
use headroom_zero::{Precision, Stage, ZeroConfig, ZeroEngine, ZeroError};

fn sizes() -> Vec<Vec<usize>> {
    vec![vec![7, 3], vec![5], vec![11, 2, 1]]
}

fn value(l: usize, t: usize, i: usize) -> f32 {
    (l * 100 + t * 10) as f32 + i as f32 / 16.0
}

#[test]
fn pieces_are_lent_and_reassemble_every_tensor_once() {
    for stage in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3] {
        for precision in [Precision::Fp32, Precision::MixedBf16] {
            for world in [2, 3] {
                let per_rank = run_ranks(world, move |comm| {
                    let sizes = sizes();
                    let config = ZeroConfig::new(stage).with_precision(precision);
                    let mut zero = ZeroEngine::new(Cpu::new(), comm, &sizes, config).unwrap();
                    for (l, layer) in sizes.iter().enumerate() {
                        let values: Vec<Vec<f32>> = layer
                            .iter()
                            .enumerate()
                            .map(|(t, &n)| (0..n).map(|i| value(l, t, i)).collect())
                            .collect();
                        let refs: Vec<&[f32]> = values.iter().map(|v| &v[..]).collect();
                        zero.load_layer(l, &refs).unwrap();
                    }
                    let mut out = Vec::new();
                    for l in 0..sizes.len() {
                        let geometry = zero.export_geometry(l).unwrap();
                        for (j, (tensor, range)) in geometry.iter().enumerate() {
                            let p = zero.export_piece(l, j).unwrap();
                            assert_eq!((p.tensor, &p.tensor_range), (*tensor, range));
                            assert!(
                                matches!(p.params, Cow::Borrowed(_)),
                                "{stage:?} {precision:?}: f32 values of record are lent"
                            );
                            assert!(p.state.is_empty(), "no moments before the first step");
                            out.push((l, p.tensor, p.tensor_range.clone(), p.params.to_vec()));
                        }
                        let past = zero.export_piece(l, geometry.len()).unwrap_err();
                        assert!(matches!(past, ZeroError::Shape { .. }), "{past}");
                    }
                    drive_step(&mut zero, &sizes, 1, &mut AdamW::default());
                    for l in 0..sizes.len() {
                        for j in 0..zero.export_geometry(l).unwrap().len() {
                            let p = zero.export_piece(l, j).unwrap();
                            assert_eq!(p.state.len(), 2 * p.params.len(), "m and v after a step");
                        }
                    }
                    out
                });
                for (l, layer) in sizes().iter().enumerate() {
                    for (t, &n) in layer.iter().enumerate() {
                        let mut seen = vec![0u32; n];
                        for (pl, pt, range, params) in per_rank.iter().flatten() {
                            if (*pl, *pt) != (l, t) {
                                continue;
                            }
                            for (i, v) in range.clone().zip(params) {
                                seen[i] += 1;
                                assert_eq!(v.to_bits(), value(l, t, i).to_bits());
                            }
                        }
                        assert!(
                            seen.iter().all(|&c| c == 1),
                            "{stage:?} {precision:?} x{world}: layer {l} tensor {t}: {seen:?}"
                        );
                    }
                }
            }
        }
    }
}
