//! Read a Parquet or Arrow IPC file's rows and say how long it took:
//! `cargo run --release -p headroom-parquet --example read_rows -- FILE [COLUMN…]`.
//!
//! Prints the row count, the row groups (record batches), and the median of 5 reads of the
//! columns asked for (all of them by default), a group at a time as `data build` reads a
//! corpus, with the UTF-8 bytes of the text decoded; `--first N` prints the first N rows as
//! JSON instead.

use std::time::Instant;

use headroom_parquet::{ReadOptions, TableFile};

fn text_bytes(value: &serde_json::Value) -> usize {
    match value {
        serde_json::Value::String(s) => s.len(),
        serde_json::Value::Array(items) => items.iter().map(text_bytes).sum(),
        serde_json::Value::Object(map) => map.values().map(text_bytes).sum(),
        _ => 0,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let first = match args.iter().position(|a| a == "--first") {
        Some(i) => {
            let n: usize = args.get(i + 1).ok_or("--first N")?.parse()?;
            args.drain(i..i + 2);
            Some(n)
        }
        None => None,
    };
    let path = args
        .first()
        .ok_or("usage: read_rows FILE [COLUMN…] [--first N]")?;
    let bytes = std::fs::read(path)?;
    let file = TableFile::parse(&bytes)?;
    let options = ReadOptions {
        columns: (args.len() > 1).then(|| args[1..].to_vec()),
        ..ReadOptions::default()
    };
    println!(
        "{path}: {}, {} rows in {} {}, fields {}",
        file.describe(),
        file.num_rows(),
        file.num_groups(),
        file.groups_name(),
        file.fields().join(", ")
    );
    if let Some(n) = first {
        for row in file.rows(&options)?.into_iter().take(n) {
            println!("{}", serde_json::Value::Object(row));
        }
        return Ok(());
    }
    let mut times = Vec::new();
    let mut text = 0;
    for _ in 0..5 {
        let start = Instant::now();
        text = 0;
        for g in 0..file.num_groups() {
            for row in file.group(g, &options)? {
                text += row.values().map(text_bytes).sum::<usize>();
            }
        }
        times.push(start.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    println!(
        "read in {median:.3} s (median of 5: {times:.3?}), {:.1} MB of text, {:.0} MB/s of file",
        text as f64 / 1e6,
        bytes.len() as f64 / 1e6 / median
    );
    Ok(())
}
