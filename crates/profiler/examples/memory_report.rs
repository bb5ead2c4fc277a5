//! A simulated training step of a small GPT-shaped model on the CPU backend, tracked: prints the
//! summary table and writes `memory_trace.json` (open in ui.perfetto.dev), `memory.svg` (by
//! time), `memory_events.svg` (by allocation event) and `memory_snapshot.pickle` (open at
//! pytorch.org/memory_viz) into the directory given as the first argument (default: the current
//! directory). A last step under a budget is refused, and the summary at the failure printed.
//!
//! `cargo run -p headroom-profiler --example memory_report -- /tmp/out`

use std::sync::Arc;

use headroom_profiler::{
    label, memory_summary, stacked_timeline_svg, validate_chrome_trace, write_chrome_trace,
    write_torch_snapshot, MemoryTracker, OutOfBudget, PlotOptions, ReportContext,
    TorchSnapshotOptions, XAxis,
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
    // A step that does not fit a budget: the refusal names what was live.
    let budget = tracker.live_bytes(Device::Cpu) + (4 << 20);
    tracker.set_budget(Device::Cpu, Some(budget));
    let refused = {
        let _phase = tracker.phase("forward");
        let _c = MemoryCategory::Activations.enter();
        let _l = label("block 0 / attn");
        cpu.zeros([tokens, 12 * width], DType::F32).err()
    };
    if let Some(oob) = refused.as_ref().and_then(|e| OutOfBudget::find(e)) {
        println!("{}", oob.summary(5));
    }
    let timeline = tracker.stop_timeline().ok_or("timeline was recording")?;
    std::fs::create_dir_all(&out)?;
    write_chrome_trace(
        &timeline,
        std::fs::File::create(out.join("memory_trace.json"))?,
    )?;
    let trace: serde_json::Value =
        serde_json::from_reader(std::fs::File::open(out.join("memory_trace.json"))?)?;
    let stats = validate_chrome_trace(&trace)?;
    let plot = PlotOptions {
        budget: Some(budget),
        title: Some("simulated GPT step (4 layers, 512 tokens)".into()),
        ..PlotOptions::default()
    };
    std::fs::write(
        out.join("memory.svg"),
        stacked_timeline_svg(&timeline, Device::Cpu, &plot),
    )?;
    let by_event = PlotOptions {
        x_axis: XAxis::EventIndex,
        ..plot
    };
    std::fs::write(
        out.join("memory_events.svg"),
        stacked_timeline_svg(&timeline, Device::Cpu, &by_event),
    )?;
    let info = write_torch_snapshot(
        &timeline,
        &TorchSnapshotOptions::default(),
        std::io::BufWriter::new(std::fs::File::create(out.join("memory_snapshot.pickle"))?),
    )?;
    println!(
        "wrote {dir}/memory_trace.json ({} events, valid), memory.svg, memory_events.svg and \
         memory_snapshot.pickle ({} trace entries; devices {:?})",
        stats.events,
        info.trace_entries,
        info.devices,
        dir = out.display()
    );
    drop((params, optimizer_state));
    Ok(())
}
