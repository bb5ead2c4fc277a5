//! The ZeRO estimate against independent references: with one rank and stage 0 its state and
//! compute are the single-process estimator's (itself equal to the tracker's,
//! `tests/estimator.rs`; the ZeRO driver's own transients are checked against each rank's
//! tracker in `tests/zero_train.rs`), and its per-rank state follows the ZeRO paper's bytes
//! per parameter; the depth search returns a model that fits whose next size does not.

use headroom_offload::StatePrecision;
use headroom_trainer::estimate::estimate;
use headroom_trainer::model::{params, ModelConfig, Precision};
use headroom_trainer::techniques::Techniques;
use headroom_trainer::zero_estimate::{largest_fitting_depth, zero_estimate, zero_layers};
use headroom_zero::Stage;

fn cfgs() -> [ModelConfig; 2] {
    [ModelConfig::tiny(512), ModelConfig::llama_tiny(512)]
}

#[test]
fn one_rank_at_stage_0_is_the_single_process_state_and_compute() {
    use headroom_tensor::MemoryCategory as C;
    for cfg in cfgs() {
        let tech = Techniques::baseline();
        let single = estimate(&cfg, 32, 4, 4, &tech).unwrap();
        let z = zero_estimate(&cfg, 32, 4, 4, &tech, Stage::Zero0, 1).unwrap();
        // The same parameters, moments, kept activations and batch; ZeRO's driver adds its
        // per-part gradient buffers and weight copies on top (measured in tests/zero_train.rs).
        for c in [C::Parameters, C::OptimizerState, C::Activations, C::Data] {
            assert_eq!(z.device[c], single.device[c], "{} {c:?}", cfg.family_name());
        }
        assert!(z.device[C::Gradients] > single.device[C::Gradients]);
        assert!(z.device[C::Workspace] > single.device[C::Workspace]);
        assert_eq!(z.state.persistent(), 16 * single.parameter_count);
        let layers = zero_layers(&cfg);
        assert_eq!(layers.len(), cfg.layers + 2);
        assert_eq!(
            layers.iter().sum::<usize>(),
            params::param_infos(&cfg)
                .iter()
                .map(|i| i.shape.iter().product::<usize>())
                .sum::<usize>()
        );
    }
}

#[test]
fn per_rank_state_follows_the_paper() {
    for cfg in cfgs() {
        for (precision, paper) in [
            // bytes per parameter at stages 0..3, N = 4: fp32 16, 8+8/N, 4+12/N, 16/N;
            // mixed 16, 4+12/N, 2+14/N, 16/N.
            (Precision::Fp32, [16.0, 10.0, 7.0, 4.0]),
            (Precision::Bf16, [16.0, 7.0, 5.5, 4.0]),
        ] {
            let mut tech = Techniques::baseline();
            tech.model.precision = precision;
            for (stage, want) in [Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
                .into_iter()
                .zip(paper)
            {
                let z = zero_estimate(&cfg, 32, 4, 4, &tech, stage, 4).unwrap();
                let per_param = z.state.persistent() as f64 / z.parameter_count as f64;
                // Padding adds fewer than 4 elements per layer.
                assert!(
                    per_param >= want && per_param < want + 0.01,
                    "{} {precision:?} {stage:?}: {per_param} bytes/param, paper {want}",
                    cfg.family_name()
                );
            }
        }
    }
}

#[test]
fn the_depth_search_finds_the_edge_and_bad_setups_are_refused() {
    let cfg = ModelConfig::tiny(512);
    let tech = Techniques::baseline();
    let budget = zero_estimate(
        &ModelConfig { layers: 7, ..cfg },
        32,
        4,
        4,
        &tech,
        Stage::Zero3,
        4,
    )
    .unwrap()
    .device_peak;
    let (layers, e) = largest_fitting_depth(&cfg, 32, 4, 4, &tech, Stage::Zero3, 4, budget)
        .unwrap()
        .unwrap();
    assert!(layers >= 7 && e.device_peak <= budget);
    let next = zero_estimate(
        &ModelConfig {
            layers: layers + 1,
            ..cfg
        },
        32,
        4,
        4,
        &tech,
        Stage::Zero3,
        4,
    )
    .unwrap();
    assert!(next.device_peak > budget);
    assert!(
        largest_fitting_depth(&cfg, 32, 4, 4, &tech, Stage::Zero3, 4, 1)
            .unwrap()
            .is_none()
    );
    assert!(zero_estimate(&cfg, 32, 4, 4, &tech, Stage::Zero1, 0).is_err());
    let mut eight_bit = tech.clone();
    eight_bit.optimizer.state = StatePrecision::Float8;
    assert!(zero_estimate(&cfg, 32, 4, 4, &eight_bit, Stage::Zero1, 2).is_err());
}
