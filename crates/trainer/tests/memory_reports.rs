//! The profiler inside the trainer: every allocation labelled, the three report files written
//! (also when the run fails out of budget), and the out-of-memory diagnosis of the command.

use crate::common;

use headroom_trainer::train::{train, MemoryOutputs, TrainOptions};

fn full_stack_tiny(dir: &std::path::Path) -> TrainOptions {
    let mut o = TrainOptions {
        steps: 2,
        batch: 4,
        ..TrainOptions::tiny_default()
    };
    let t = &mut o.techniques;
    t.model.precision = headroom_trainer::model::Precision::Bf16;
    t.model.loss_chunk = Some(32);
    t.checkpoint = headroom_trainer::techniques::CheckpointChoice::SqrtN;
    t.optimizer.placement = headroom_trainer::techniques::OptimizerPlacement::HostRam;
    t.micro_batch = Some(2);
    o.memory_outputs = MemoryOutputs {
        trace: Some(dir.join("trace.json")),
        svg: Some(dir.join("memory.svg")),
        svg_by_event: true,
        snapshot: Some(dir.join("snapshot.pickle")),
    };
    o
}

#[test]
fn a_full_stack_run_writes_a_valid_trace_a_plot_and_a_labelled_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let o = full_stack_tiny(dir.path());
    let report = train(&o, |_| {}).unwrap();
    // Nothing the trainer allocates is unlabelled.
    assert!(
        !report.memory_table.contains("(unlabelled)"),
        "{}",
        report.memory_table
    );
    assert!(
        report.memory_table.contains("block."),
        "{}",
        report.memory_table
    );

    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    let stats = headroom_profiler::validate_chrome_trace(&trace).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let names: Vec<&str> = events.iter().filter_map(|e| e["name"].as_str()).collect();
    for needle in ["step 0", "step 1", "forward+backward", "optimizer"] {
        assert!(names.contains(&needle), "trace lacks {needle}: {stats:?}");
    }

    let svg = std::fs::read_to_string(dir.path().join("memory.svg")).unwrap();
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "{}",
        &svg[..80]
    );
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("allocation event"), "the x axis is by event");

    let snapshot = std::fs::read(dir.path().join("snapshot.pickle")).unwrap();
    // Pickle protocol 2+ starts with PROTO; the labels are stored as UTF-8 strings.
    assert_eq!(snapshot[0], 0x80);
    let text = String::from_utf8_lossy(&snapshot);
    for label in [
        "block.0.mlp.fc",
        "head.logits[chunk]",
        "device_traces",
        "segments",
    ] {
        assert!(text.contains(label), "snapshot lacks {label}");
    }
}

/// Under ZeRO each rank records its own timeline and writes its own files (`.rank{r}` before the
/// extension); the trace's largest total is the rank's peak as its tracker reports it.
#[test]
fn zero_ranks_write_a_trace_a_plot_and_a_snapshot_each() {
    use headroom_trainer::zero_train::{rank_path, train_zero, ZeroOptions};
    assert_eq!(
        rank_path(std::path::Path::new("out/mem.json"), 1),
        std::path::Path::new("out/mem.rank1.json")
    );
    assert_eq!(
        rank_path(std::path::Path::new("mem"), 0),
        std::path::Path::new("mem.rank0")
    );
    let dir = tempfile::tempdir().unwrap();
    let mut o = full_stack_tiny(dir.path());
    // ZeRO-Offload keeps the optimizer shard on a host ledger of its own; the trace is the
    // rank's device ledger.
    o.techniques.optimizer.placement = headroom_trainer::techniques::OptimizerPlacement::Resident;
    o.check_machine_memory = false;
    let report = train_zero(&o, ZeroOptions::new(headroom_zero::Stage::Zero3, 2), |_| {}).unwrap();
    for rank in 0..2 {
        let file = |name: &str| rank_path(&dir.path().join(name), rank);
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(file("trace.json")).unwrap()).unwrap();
        headroom_profiler::validate_chrome_trace(&trace).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = events.iter().filter_map(|e| e["name"].as_str()).collect();
        for needle in ["step 0", "step 1", "forward+backward", "optimizer"] {
            assert!(
                names.contains(&needle),
                "rank {rank}'s trace lacks {needle}"
            );
        }
        // The largest sum over categories at one instant is the tracker's peak.
        let mut now = std::collections::BTreeMap::<String, f64>::new();
        let mut top = 0.0f64;
        for e in events.iter().filter(|e| e["ph"] == "C") {
            for (k, v) in e["args"].as_object().unwrap() {
                now.insert(format!("{}/{k}", e["name"]), v.as_f64().unwrap());
            }
            top = top.max(now.values().sum());
        }
        let peak = report.ranks[rank]
            .memory
            .device(headroom_tensor::Device::Cpu)
            .unwrap()
            .peak_total;
        assert_eq!(top as u64, peak, "rank {rank}");

        let svg = std::fs::read_to_string(file("memory.svg")).unwrap();
        assert!(svg.contains(&format!("ZeRO-3 rank {rank} of 2")));
        let snapshot = std::fs::read(file("snapshot.pickle")).unwrap();
        assert_eq!(snapshot[0], 0x80);
    }
    assert!(!dir.path().join("trace.json").exists());
}

#[test]
fn an_out_of_budget_run_still_writes_its_reports_up_to_the_failure() {
    let dir = tempfile::tempdir().unwrap();
    let o = TrainOptions {
        budget: Some(600 << 10),
        ..full_stack_tiny(dir.path())
    };
    let e = train(&o, |_| {}).unwrap_err();
    assert!(headroom_profiler::OutOfBudget::find(&e).is_some(), "{e}");
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("trace.json")).unwrap()).unwrap();
    headroom_profiler::validate_chrome_trace(&trace).unwrap();
    assert!(dir.path().join("snapshot.pickle").is_file());
}

#[test]
fn the_command_explains_an_out_of_memory_and_suggests_what_fits() {
    let o = common::headroom_command()
        .args([
            "train",
            "--model",
            "small",
            "--steps",
            "1",
            "--budget-mib",
            "300",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    for needle in [
        "largest live",
        "predicted to fit 300.0 MiB",
        "--offload ram",
        "caused by",
    ] {
        assert!(err.contains(needle), "stderr lacks {needle}:\n{err}");
    }
}
