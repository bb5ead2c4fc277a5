//! Misuse of the engine is a typed error, never a panic, and leaves the engine usable.

mod common;

use common::{run_ranks, AdamW};
use headroom_tensor::Cpu;
use headroom_zero::{Precision, Stage, ZeroConfig, ZeroEngine, ZeroError};

#[test]
fn misuse_is_a_typed_error() {
    let results = run_ranks(2, |comm| {
        let sizes = vec![vec![3, 2], vec![5]];
        let mut zero =
            ZeroEngine::new(Cpu::new(), comm, &sizes, ZeroConfig::new(Stage::Zero3)).unwrap();
        let mut errors = vec![
            zero.params(0).unwrap_err(),
            zero.gather(2).unwrap_err(),
            zero.load_layer(0, &[&[1.0; 3]]).unwrap_err(),
            zero.load_layer(0, &[&[1.0; 3], &[1.0; 4]]).unwrap_err(),
            zero.step(&mut AdamW::default()).unwrap_err(),
        ];
        zero.push_grads(1, &[&[0.5; 5]]).unwrap();
        errors.push(zero.push_grads(1, &[&[0.5; 5]]).unwrap_err());
        errors.push(zero.step(&mut AdamW::default()).unwrap_err());
        zero.gather(0).unwrap();
        errors.push(zero.params_bf16(0).unwrap_err());
        errors.push(zero.tensor(0, 2).unwrap_err());
        // Still usable: finish the micro-batch and step.
        zero.push_grads(0, &[&[0.5; 3], &[0.5; 2]]).unwrap();
        zero.release(0).unwrap();
        zero.step(&mut AdamW::default()).unwrap();
        (errors, zero.steps())
    });
    for (errors, steps) in results {
        assert_eq!(steps, 1);
        let mut e = errors.iter();
        assert!(matches!(
            e.next(),
            Some(ZeroError::NotGathered { layer: 0 })
        ));
        assert!(matches!(
            e.next(),
            Some(ZeroError::LayerOutOfRange {
                layer: 2,
                layers: 2
            })
        ));
        assert!(matches!(
            e.next(),
            Some(ZeroError::Shape {
                expected: 2,
                got: 1,
                ..
            })
        ));
        assert!(matches!(
            e.next(),
            Some(ZeroError::Shape {
                expected: 2,
                got: 4,
                ..
            })
        ));
        assert!(matches!(e.next(), Some(ZeroError::NoGradients)));
        assert!(matches!(
            e.next(),
            Some(ZeroError::GradsPushedTwice { layer: 1 })
        ));
        assert!(
            matches!(e.next(), Some(ZeroError::IncompleteBackward { missing }) if missing == &[0])
        );
        assert!(matches!(
            e.next(),
            Some(ZeroError::Precision {
                wanted: Precision::MixedBf16,
                engine: Precision::Fp32
            })
        ));
        assert!(matches!(e.next(), Some(ZeroError::Shape { got: 2, .. })));
    }
}

#[test]
fn invalid_configurations_are_refused() {
    let results = run_ranks(1, |comm| {
        let mut config = ZeroConfig::new(Stage::Zero2);
        config.max_in_flight = 0;
        ZeroEngine::new(Cpu::new(), comm, &[vec![4]], config).unwrap_err()
    });
    assert!(matches!(results[0], ZeroError::InvalidConfig(_)));
    assert!(Stage::from_index(4).is_err());
    assert_eq!(Stage::from_index(3).unwrap(), Stage::Zero3);
}

#[test]
fn layers_without_parameters_are_skipped() {
    // A chain with a parameter-free layer in the middle (an activation) and an empty tensor.
    let results = run_ranks(3, |comm| {
        let sizes = vec![vec![7, 0], vec![], vec![4]];
        let mut zero = ZeroEngine::new(
            Cpu::new(),
            comm,
            &sizes,
            ZeroConfig::new(Stage::Zero3).with_bucket_bytes(0),
        )
        .unwrap();
        zero.load_layer(0, &[&[1.0; 7], &[]]).unwrap();
        zero.load_layer(2, &[&[2.0; 4]]).unwrap();
        let mut opt = AdamW::default();
        common::drive_step(&mut zero, &sizes, 2, &mut opt);
        zero.full_parameters().unwrap()
    });
    for params in &results {
        assert_eq!(params, &results[0]);
        assert_eq!(params[1].len(), 0);
        assert_eq!((params[0].len(), params[2].len()), (7, 4));
        assert!(
            params[0].iter().all(|&p| p < 1.0),
            "the step moved the parameters"
        );
    }
}
