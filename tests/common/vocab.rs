//! The tiny models' vocabularies: GPT-2's byte table, a byte-level BPE vocabulary with merges,
//! and a SentencePiece one.

/// GPT-2's byte-to-char table.
pub fn byte_chars() -> Vec<char> {
    let mut out = Vec::new();
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out.push(if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        });
    }
    out
}

/// Vocabulary: 3 control tokens, 256 byte tokens, and merged tokens for "he", "ll", "Ġt", "hell".
pub fn vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    let mut types = vec![3, 3, 3];
    for c in byte_chars() {
        tokens.push(c.to_string());
        types.push(1);
    }
    let merges = vec![
        "h e".to_string(),
        "l l".to_string(),
        "Ġ t".to_string(),
        "he ll".to_string(),
    ];
    for m in &merges {
        tokens.push(m.replace(' ', ""));
        types.push(1);
    }
    (tokens, types, merges)
}

/// A SentencePiece vocabulary: the three control tokens of `vocab`, `<unk>`, 256 byte tokens, a
/// user-defined token, then scored pieces (characters and merges, ties included, U+2581 for
/// spaces; no piece for most non-ASCII characters, which fall back to bytes).
pub fn spm_vocab() -> (Vec<String>, Vec<i32>, Vec<f32>) {
    let mut tokens: Vec<String> = vec![
        "<|endoftext|>".into(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
        "<unk>".into(),
    ];
    let mut types = vec![3, 3, 3, 2];
    let mut scores = vec![0.0f32; 4];
    for b in 0..256 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    tokens.push("<start_of_turn>".into());
    types.push(4);
    scores.push(0.0);
    let mut piece = |t: &str, score: f32| {
        tokens.push(t.replace(' ', "\u{2581}"));
        types.push(1);
        scores.push(score);
    };
    for c in (b'!'..=b'~').map(|b| b as char) {
        piece(&c.to_string(), -10.0);
    }
    for c in [" ", "\n", "é", "日"] {
        piece(c, -10.0);
    }
    for (t, s) in [
        (" t", -2.0),
        ("he", -3.0),
        (" the", -1.0),
        ("ll", -3.0),
        ("hell", -2.5),
        ("hello", -1.5),
        (" hello", -1.0),
        ("  ", -4.0),
        ("    ", -3.5),
        ("wor", -4.0),
        ("ld", -4.0),
        ("world", -2.0),
        (" world", -1.2),
        ("\n\n", -3.0),
        ("12", -5.0),
        ("123", -4.5),
        ("ab", -6.0),
        ("bc", -6.0),
        ("abc", -5.5),
        ("it", -4.0),
        ("'s", -4.0),
        (" it", -3.0),
        (" é", -2.0),
    ] {
        piece(t, s);
    }
    (tokens, types, scores)
}
