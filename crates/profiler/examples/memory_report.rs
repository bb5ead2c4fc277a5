//! A simulated training step of a small GPT-shaped model on the CPU backend, tracked: prints the
//! summary table and writes `memory_trace.json` (open in ui.perfetto.dev) and `memory.svg` into
//! the directory given as the first argument (default: the current directory).
//!
//! `cargo run -p headroom-profiler --example memory_report -- /tmp/out`

use std::sync::Arc;

use headroom_profiler::{
    label, memory_summary, stacked_timeline_svg, write_chrome_trace, MemoryTracker, PlotOptions,
    ReportContext,
};
use headroom_tensor::{Backend, Cpu, DType, Device, MemoryCategory};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| ".".into()));
    let tracker = Arc::new(MemoryTracker::new());
    let cpu = Cpu::new().with_alloc_hook(tracker.clone());
    tracker.start_timeline();
    let (layers, width, tokens) = (4usize, 256usize, 512usize);

    let params: Vec<_> = {
        let _c = MemoryCategory::Parameters.enter();
        (0..layers)
            .map(|_| cpu.zeros([12 * width * width], DType::F32))
            .collect::<Result<_, _>>()?
    };
    let optimizer_state: Vec<_> = {
        let _c = MemoryCategory::OptimizerState.enter();
        (0..2 * layers)
            .map(|_| cpu.zeros([12 * width * width], DType::F32))
            .collect::<Result<_, _>>()?
    };
    for step in 0..2 {
        tracker.mark(&format!("step {step}"));
        let batch = {
            let _c = MemoryCategory::Data.enter();
            cpu.zeros([2, tokens], DType::U32)?
        };
        let mut saved = Vec::new();
        {
            let _phase = tracker.phase("forward");
            let _c = MemoryCategory::Activations.enter();
            for block in 0..layers {
                let _l = label(&format!("block {block}"));
                {
                    let _a = label("attn");
                    saved.push(cpu.zeros([tokens, 3 * width], DType::F32)?);
                    saved.push(cpu.zeros([tokens, width], DType::F32)?);
                }
                let _m = label("mlp");
                saved.push(cpu.zeros([tokens, 4 * width], DType::F32)?);
                saved.push(cpu.zeros([tokens, 4 * width], DType::F32)?);
            }
        }
        let mut grads = Vec::new();
        {
            let _phase = tracker.phase("backward");
            for _block in (0..layers).rev() {
                let scratch = {
                    let _w = MemoryCategory::Workspace.enter();
                    cpu.zeros([tokens, 8 * width], DType::F32)?
                };
                {
                    let _g = MemoryCategory::Gradients.enter();
                    grads.push(cpu.zeros([12 * width * width], DType::F32)?);
                }
                for _ in 0..4 {
                    saved.pop();
                }
                drop(scratch);
            }
        }
        {
            let _phase = tracker.phase("optimizer");
            grads.clear();
        }
        drop(batch);
    }
    let snapshot = tracker.snapshot();
    println!(
        "{}",
        memory_summary(&snapshot, &ReportContext::with_process_memory())
    );
    let timeline = tracker.stop_timeline().ok_or("timeline was recording")?;
    std::fs::create_dir_all(&out)?;
    write_chrome_trace(
        &timeline,
        std::fs::File::create(out.join("memory_trace.json"))?,
    )?;
    std::fs::write(
        out.join("memory.svg"),
        stacked_timeline_svg(&timeline, Device::Cpu, &PlotOptions::default()),
    )?;
    println!("wrote {}/memory_trace.json and memory.svg", out.display());
    drop((params, optimizer_state));
    Ok(())
}
