//! What this machine offers headroom, as `headroom env` prints it (the role of DeepSpeed's
//! `ds_report`, `python -m bitsandbytes` and `torch.utils.collect_env`): the CPU's instruction
//! set and the path each of our kernels takes on it, memory, CUDA devices and NVRTC. Every
//! probe answers; none fails the report.
//!
//! ```
//! let lines = headroom_trainer::environment::report_lines();
//! assert!(lines.iter().any(|l| l.starts_with("cpu:")));
//! assert!(lines.iter().any(|l| l.starts_with("cuda:")));
//! ```

use headroom_tensor::isa::{self, IsaLevel};

/// The report, a line each (the MPI line is the command's: it knows how it was built).
pub fn report_lines() -> Vec<String> {
    let mut lines = vec![format!(
        "headroom {} ({}-{}, {} build)",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::ARCH,
        std::env::consts::OS,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    )];
    lines.push(format!(
        "cpu: {}, {} threads",
        isa::cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string()),
        rayon::current_num_threads()
    ));
    lines.push(if isa::active() < isa::detected() {
        format!("  instruction set: {}", isa::describe())
    } else {
        format!(
            "  instruction set: {} ({}=baseline, avx2 or avx512 would cap it)",
            isa::describe(),
            isa::ENV
        )
    });
    lines.push(format!(
        "  kernels: AdamW {}, 4-bit dequantization {}, softmax and cross-entropy rows {}, \
         bf16 weights' products {}",
        headroom_offload::Isa::detect().level(),
        headroom_quant::Isa::detect().name(),
        isa::vector_level(),
        if crate::ops::matmul::bf16_products() {
            "on AMX tiles (torch's bf16 matmul numerics)"
        } else {
            "widened to f32"
        }
    ));
    lines.push(format!(
        "  f32 GEMMs (the gemm crate, which picks its own kernels): {}",
        // The kernel gemm was seen to run (its depth blocks checked), which also tells a build
        // without gemm's `x86-v4` feature (scripts/avx2-emulation.sh) from an ordinary one.
        match crate::ops::matmul::gemm_f32_tile() {
            Some((64, 6)) => "avx512 (64x6 tiles)",
            Some((16, 6)) => "avx2 + fma (16x6 tiles)",
            _ => match isa::detected() {
                IsaLevel::Baseline => "scalar",
                IsaLevel::Avx2 => "avx2 + fma",
                IsaLevel::Avx512 | IsaLevel::Amx => "avx512",
            },
        }
    ));
    lines.push(memory_line());
    lines.push(cuda_line());
    lines.push(match headroom_cuda::nvrtc_version() {
        Ok((major, minor)) => format!("nvrtc: {major}.{minor} (CUDA kernels compile at run time)"),
        Err(e) => format!("nvrtc: {e}"),
    });
    lines.push(nccl_line());
    lines
}

/// Which libnccl `--dist nccl` would load, or why none.
fn nccl_line() -> String {
    #[cfg(feature = "cuda")]
    {
        match headroom_zero::nccl_version() {
            Ok((major, minor, patch)) => {
                format!("nccl: {major}.{minor}.{patch} (--dist nccl can run)")
            }
            // The backend's own message, without the collective error's preamble.
            Err(e) => match std::error::Error::source(&e) {
                Some(why) => format!("nccl: {why}"),
                None => format!("nccl: {e}"),
            },
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        "nccl: this build has none (the `cuda` feature)".to_string()
    }
}

/// Total and available memory (`/proc/meminfo`) and the transparent-huge-page mode the host
/// buffers' advice depends on.
fn memory_line() -> String {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| {
        info.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    let gib = |k: u64| k as f64 / (1024.0 * 1024.0);
    let sizes = match (kib("MemTotal:"), kib("MemAvailable:")) {
        (Some(t), Some(a)) => format!("{:.1} GiB, {:.1} GiB available", gib(t), gib(a)),
        (Some(t), None) => format!("{:.1} GiB", gib(t)),
        _ => "size unknown".into(),
    };
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let start = s.find('[')?;
            let end = s[start..].find(']')? + start;
            Some(s[start + 1..end].to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    format!("memory: {sizes}; transparent huge pages: {thp}")
}

/// Every CUDA device with its memory, or why there is none.
fn cuda_line() -> String {
    let count = headroom_cuda::device_count();
    if count == 0 {
        return match headroom_cuda::Cuda::new(0) {
            Err(e) => format!("cuda: {e}"),
            Ok(_) => "cuda: no device".into(),
        };
    }
    let mut line = format!("cuda: {count} device{}", if count == 1 { "" } else { "s" });
    for ordinal in 0..count {
        match headroom_cuda::Cuda::new(ordinal) {
            Ok(d) => {
                let (major, minor) = d.compute_capability();
                let memory = d.mem_info().map_or_else(
                    |_| String::new(),
                    |(free, total)| {
                        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
                        format!(", {:.1} GiB free of {:.1}", gib(free), gib(total))
                    },
                );
                let v = d.driver_version();
                line.push_str(&format!(
                    "; {ordinal}: {} (sm_{major}{minor}), driver {}.{}{memory}",
                    d.device_name(),
                    v / 1000,
                    v % 1000 / 10
                ));
            }
            Err(e) => line.push_str(&format!("; {ordinal}: {e}")),
        }
    }
    line
}
