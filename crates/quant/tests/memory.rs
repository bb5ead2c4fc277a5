//! Memory, measured by headroom-profiler's tracker through the allocation hook: a quantized
//! weight is `Parameters` at its packed size (≈ 4.5 bits per parameter at block 64, ≈ 4.127
//! with double quantization), and the fused matmul's only extra memory is one dequantized
//! panel per task (`Workspace`), freed when it returns; no gradient bytes ever appear.

use std::sync::Arc;

use headroom_profiler::MemoryTracker;
use headroom_quant::{
    matmul_backward_input, matmul_forward, BlockSize, MatmulOptions, QuantConfig, QuantType,
    QuantizedTensor, Quantizer,
};
use headroom_tensor::{Cpu, Device, MemoryCategory};

const OUT: usize = 1024;
const IN: usize = 1024;

fn weight() -> Vec<f32> {
    (0..OUT * IN)
        .map(|i| ((i * 2_654_435_761) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn tracked(threads: usize) -> (Cpu, Arc<MemoryTracker>) {
    let tracker = Arc::new(MemoryTracker::new());
    let cpu = Cpu::with_threads(threads)
        .unwrap()
        .with_alloc_hook(tracker.clone());
    (cpu, tracker)
}

#[test]
fn packed_weights_are_parameters_at_their_real_size() {
    for (double, want_bits) in [
        (false, 4.5),
        (true, 4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0)),
    ] {
        let (cpu, tracker) = tracked(2);
        let config = QuantConfig {
            quant_type: QuantType::Nf4,
            blocksize: BlockSize::new(64).unwrap(),
            double_quant: double,
        };
        let q = QuantizedTensor::quantize(&cpu, &weight(), &[OUT, IN], config).unwrap();
        let snap = tracker.snapshot();
        let dev = snap.device(Device::Cpu).unwrap();
        let params = dev.live[MemoryCategory::Parameters];
        assert_eq!(params, q.stored_bytes() as u64);
        assert_eq!(
            dev.live_total, params,
            "nothing but parameters stays allocated"
        );
        let n = (OUT * IN) as f64;
        let bits = 8.0 * params as f64 / n;
        // The 256-entry code map (1 KiB) of the double quantization is the only extra.
        let map_bits = if double { 8.0 * 1024.0 / n } else { 0.0 };
        assert!(
            (bits - want_bits - map_bits).abs() < 1e-9,
            "double {double}: {bits} bits"
        );
        println!("double quant {double}: {bits:.4} bits/parameter ({params} bytes)");
        drop(q);
        assert_eq!(
            tracker.snapshot().device(Device::Cpu).unwrap().live_total,
            0
        );
    }
}

#[test]
fn fused_matmul_adds_one_panel_per_task_and_no_gradient() {
    for threads in [1usize, 2, 3] {
        let (cpu, tracker) = tracked(threads);
        let q =
            QuantizedTensor::quantize(&cpu, &weight(), &[OUT, IN], QuantConfig::qlora()).unwrap();
        let n = 16;
        let x = vec![0.25f32; n * IN];
        let mut y = vec![0f32; n * OUT];
        // Panels of 64 rows: 16 panels, so every thread holds one.
        let opts = MatmulOptions {
            panel_elements: 64 * IN,
            ..MatmulOptions::default()
        };
        tracker.reset_peak();
        matmul_forward(&cpu, &x, &q, &mut y, &opts).unwrap();
        let dev = tracker.snapshot().device(Device::Cpu).unwrap().clone();
        let panel = 64 * IN * 4;
        assert_eq!(
            opts.forward_workspace_bytes(OUT, IN, threads),
            threads * panel
        );
        // Tasks run concurrently or one after another; the peak is at most one panel each.
        let peak_ws = dev.peak[MemoryCategory::Workspace] as usize;
        assert!(
            peak_ws >= panel && peak_ws <= threads * panel,
            "threads {threads}: {peak_ws}"
        );
        assert_eq!(
            dev.allocs[MemoryCategory::Workspace],
            threads as u64,
            "one scratch per task"
        );
        assert_eq!(dev.live[MemoryCategory::Workspace], 0, "scratch freed");
        assert_eq!(dev.peak[MemoryCategory::Gradients], 0);
        assert_eq!(
            dev.peak_total,
            dev.live[MemoryCategory::Parameters] + peak_ws as u64
        );

        let mut dx = vec![0f32; n * IN];
        tracker.reset_peak();
        matmul_backward_input(&cpu, &y, &q, &mut dx, &opts).unwrap();
        let dev = tracker.snapshot().device(Device::Cpu).unwrap().clone();
        let strip = opts.backward_panel_cols(OUT, IN) * OUT * 4;
        let peak_ws = dev.peak[MemoryCategory::Workspace] as usize;
        assert!(
            peak_ws >= strip && peak_ws <= threads * strip,
            "threads {threads}: {peak_ws}"
        );
        assert_eq!(dev.peak[MemoryCategory::Gradients], 0, "no weight gradient");
        assert_eq!(dev.live[MemoryCategory::Workspace], 0);
        println!(
            "threads {threads}: forward panel {panel} B, backward strip {strip} B, weight {} B",
            q.stored_bytes()
        );
    }
}

/// `QuantConfig::stored_bytes` (what estimators use) equals what quantizing stores and the
/// tracker counts, for both code books, plain and double-quantized scales, several block
/// sizes and sizes with tails (a partial block, a partial group of 256 scales, an odd count).
#[test]
fn predicted_stored_bytes_equal_the_quantized_tensors() {
    for quant_type in [QuantType::Nf4, QuantType::Fp4] {
        for blocksize in [32u64, 64, 256, 4096] {
            for double_quant in [false, true] {
                for numel in [1usize, 31, 64, 1000, 64 * 257 + 3, 100_001] {
                    let config = QuantConfig {
                        quant_type,
                        blocksize: BlockSize::new(blocksize).unwrap(),
                        double_quant,
                    };
                    let (cpu, tracker) = tracked(1);
                    let data: Vec<f32> = (0..numel).map(|i| (i % 97) as f32 / 50.0 - 1.0).collect();
                    let q = QuantizedTensor::quantize(&cpu, &data, &[numel], config).unwrap();
                    let live = tracker.snapshot().device(Device::Cpu).unwrap().live
                        [MemoryCategory::Parameters];
                    assert_eq!(
                        config.stored_bytes(numel),
                        q.stored_bytes(),
                        "{config:?} {numel}"
                    );
                    assert_eq!(live as usize, q.stored_bytes(), "{config:?} {numel}");
                }
            }
        }
    }
}

/// Quantized a row at a time, a weight never exists in f32: the tracker's peak is the packed
/// result, plus — with double quantization — the f32 absmax values (one per block) that live
/// until their compressed form is allocated. Nothing else is tracked, and nothing stays.
#[test]
fn a_streamed_weight_peaks_at_its_packed_size_plus_the_f32_absmax_under_double_quant() {
    let w = weight();
    for double in [false, true] {
        let (cpu, tracker) = tracked(2);
        let config = QuantConfig {
            quant_type: QuantType::Nf4,
            blocksize: BlockSize::new(64).unwrap(),
            double_quant: double,
        };
        let mut quantizer = Quantizer::new(&cpu, &[OUT, IN], config).unwrap();
        for row in w.chunks(IN) {
            quantizer.push(row).unwrap();
        }
        let q = quantizer.finish().unwrap();
        let snap = tracker.snapshot();
        let dev = snap.device(Device::Cpu).unwrap();
        let stored = q.stored_bytes() as u64;
        assert_eq!(
            dev.live_total, stored,
            "double {double}: only the result stays"
        );
        let f32_absmax = if double {
            4 * (OUT * IN / 64) as u64
        } else {
            0
        };
        assert_eq!(dev.peak_total, stored + f32_absmax, "double {double}: peak");
        assert!(
            dev.peak_total < (OUT * IN) as u64,
            "below a quarter of the f32 copy"
        );
    }
}
