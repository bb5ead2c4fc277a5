//! The synthetic Markov source (entropy rate, stationarity, determinism) and byte tokenisation.

use headroom_mmap_data::text::{tokenize_text_file, BYTE_VOCAB};
use headroom_mmap_data::{
    formats, DataError, MarkovChain, OpenOptions, TokenFileFormat, TokenType,
};

#[test]
fn empirical_entropy_over_a_million_tokens_is_within_one_percent() {
    let chain = MarkovChain::random(512, 8, 11).unwrap();
    let tokens = chain.generate(1_000_000, 5);
    // Plug-in estimate from bigram counts: H ≈ Σ n_ij/N · ln(n_i / n_ij). Uses nothing from
    // the chain but its output.
    let v = chain.vocab_size() as usize;
    let mut bigrams = std::collections::HashMap::<(u32, u32), u64>::new();
    let mut from = vec![0u64; v];
    for w in tokens.windows(2) {
        *bigrams.entry((w[0], w[1])).or_default() += 1;
        from[w[0] as usize] += 1;
    }
    let n = (tokens.len() - 1) as f64;
    let plug_in: f64 = bigrams
        .iter()
        .map(|(&(i, _), &c)| c as f64 / n * (from[i as usize] as f64 / c as f64).ln())
        .sum();
    // Model cross-entropy of the sample: what a perfect model's loss would average.
    let nll: f64 = tokens
        .windows(2)
        .map(|w| -chain.probability(w[0], w[1]).ln())
        .sum::<f64>()
        / n;
    let h = chain.entropy_rate();
    assert!(h > 0.5 && h < (8f64).ln(), "rate {h}");
    assert!(
        (plug_in - h).abs() / h < 0.01,
        "plug-in {plug_in} vs exact {h}"
    );
    assert!((nll - h).abs() / h < 0.01, "nll {nll} vs exact {h}");
}

#[test]
fn stationary_distribution_is_a_fixed_point() {
    let chain = MarkovChain::random(100, 3, 2).unwrap();
    let pi = chain.stationary();
    assert!((pi.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    for j in 0..100u32 {
        let inflow: f64 = (0..100u32)
            .map(|i| pi[i as usize] * chain.probability(i, j))
            .sum();
        assert!((inflow - pi[j as usize]).abs() < 1e-12, "state {j}");
    }
    for i in 0..100u32 {
        let row: f64 = (0..100u32).map(|j| chain.probability(i, j)).sum();
        assert!((row - 1.0).abs() < 1e-12);
    }
    assert!(
        (chain.entropy_rate_bits() - chain.entropy_rate() / std::f64::consts::LN_2).abs() < 1e-12
    );
}

#[test]
fn generation_is_deterministic_and_in_vocab() {
    let a = MarkovChain::random(300, 4, 9).unwrap();
    let b = MarkovChain::random(300, 4, 9).unwrap();
    assert_eq!(a.entropy_rate(), b.entropy_rate());
    let ta = a.generate(10_000, 1);
    assert_eq!(ta, b.generate(10_000, 1));
    assert_ne!(ta, a.generate(10_000, 2));
    assert!(ta.iter().all(|&t| t < 300));
    assert!(ta.windows(2).all(|w| a.probability(w[0], w[1]) > 0.0));
    let ds = a.dataset(5000, 1).unwrap();
    assert_eq!(ds.vocab_size(), 300);
    ds.validate_tokens().unwrap();
    assert!(MarkovChain::random(1, 1, 0).is_err());
    assert!(MarkovChain::random(10, 11, 0).is_err());
}

#[test]
fn synthetic_writes_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let chain = MarkovChain::random(1000, 4, 3).unwrap();
    let want = chain.generate(2000, 4);
    for (name, f) in [
        ("raw.bin", TokenFileFormat::Raw(TokenType::U16)),
        (
            "llmc.bin",
            TokenFileFormat::Llmc(headroom_mmap_data::LlmcFlavor::Gpt2),
        ),
        (
            "mega",
            TokenFileFormat::Megatron {
                token_type: TokenType::U16,
                document_len: 500,
            },
        ),
    ] {
        let p = dir.path().join(name);
        chain.write(&p, 2000, 4, f).unwrap();
        let ds = formats::open(&p, &OpenOptions::default()).unwrap();
        let got: Vec<u32> = (0..2000).map(|i| ds.token(0, i).unwrap() as u32).collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn text_is_tokenised_byte_by_byte() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("in.txt");
    std::fs::write(&text, "héllo\n").unwrap();
    let out = dir.path().join("out.bin");
    let n = tokenize_text_file(&text, &out, TokenFileFormat::Raw(TokenType::U16)).unwrap();
    assert_eq!(n, 7);
    let ds = formats::open(&out, &OpenOptions::default())
        .unwrap()
        .with_vocab_size(BYTE_VOCAB);
    ds.validate_tokens().unwrap();
    let got: Vec<u8> = (0..7).map(|i| ds.token(0, i).unwrap() as u8).collect();
    assert_eq!(got, "héllo\n".as_bytes());

    std::fs::write(&text, [b'a', 0xFF, b'b']).unwrap();
    assert!(matches!(
        tokenize_text_file(&text, &out, TokenFileFormat::Raw(TokenType::U16)),
        Err(DataError::InvalidUtf8 { offset: 1, .. })
    ));
    std::fs::write(&text, b"").unwrap();
    assert!(matches!(
        tokenize_text_file(&text, &out, TokenFileFormat::Raw(TokenType::U16)),
        Err(DataError::Empty { .. })
    ));
}
