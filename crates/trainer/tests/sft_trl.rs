//! `headroom data build --jsonl` against TRL: the token ids and loss flags of TRL's own
//! `SFTTrainer` (its prepared dataset's `input_ids` and `labels`, -100 where a token does not
//! count), written by `benches/torch/make_sft_fixture.py` with TRL 1.16 for a byte-level BPE
//! and a Llama-style tokenizer that adds `<s>`. The examples include an empty prompt, an empty
//! completion, non-ASCII text, and a prompt whose last token merges with the completion's
//! first under the byte-level BPE.

use std::path::{Path, PathBuf};

use headroom_mmap_data::{formats, loss_mask_path, LossMask, TokenFileFormat, TokenType};
use headroom_trainer::tokenize::{build_prompt_completion, Tokenizer};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn prompt_completion_examples_get_trls_ids_and_labels() {
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sft/trl_sft.json")).unwrap(),
    )
    .unwrap();
    let lines: Vec<String> = fixture["prompt_completion"]
        .as_array()
        .unwrap()
        .iter()
        .chain(fixture["text"].as_array().unwrap())
        .map(Value::to_string)
        .collect();
    let tokenizers = [
        ("bpe", fixtures().join("tokenizer/tokenizer.json")),
        ("llama", fixtures().join("sft/llama-tokenizer.json")),
    ];
    for (name, file) in tokenizers {
        let trl = &fixture["tokenizers"][name];
        let rows = trl["prompt_completion"]
            .as_array()
            .unwrap()
            .iter()
            .chain(trl["text"].as_array().unwrap());
        let (mut want_ids, mut want_flags) = (Vec::new(), Vec::new());
        let ids = |v: &Value| -> Vec<i64> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect()
        };
        for row in rows {
            let (input, labels) = (ids(&row["input_ids"]), ids(&row["labels"]));
            assert_eq!(input.len(), labels.len());
            for (&i, &l) in input.iter().zip(&labels) {
                assert!(l == -100 || l == i, "TRL's labels are the ids or -100");
                want_ids.push(i as u32);
                want_flags.push(l != -100);
            }
        }

        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("sft.jsonl");
        std::fs::write(&input, lines.join("\n")).unwrap();
        let tok = Tokenizer::from_name(file.to_str().unwrap()).unwrap();
        let out = dir.path().join("sft.bin");
        let format = TokenFileFormat::Raw(TokenType::U16);
        let report = build_prompt_completion(&input, &tok, format, &out, false).unwrap();
        let ds = formats::open(&out, &Default::default()).unwrap();
        let got: Vec<u32> = (0..ds.total_tokens())
            .map(|i| ds.token(0, i).unwrap() as u32)
            .collect();
        assert_eq!(got, want_ids, "{name}: ids");
        let mask = LossMask::open(loss_mask_path(&out)).unwrap();
        let flags: Vec<bool> = (0..mask.len()).map(|i| mask.get(i).unwrap()).collect();
        assert_eq!(flags, want_flags, "{name}: loss flags");
        assert_eq!(report.examples, lines.len() as u64);
        assert_eq!(
            report.counted,
            want_flags.iter().filter(|&&f| f).count() as u64
        );
        // The byte-level BPE merges "Hello wor" + "ld …" across the boundary (the flags above
        // show where TRL starts that completion); the Metaspace one cuts before "ld".
        let merges = if name == "bpe" { 1 } else { 0 };
        assert_eq!(report.boundary_merges, merges, "{name}: {report:?}");
    }
}
