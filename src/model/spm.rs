//! SentencePiece-style vocabularies (`tokenizer.ggml.model = "llama"`: Gemma, Llama 2, Mistral):
//! llama.cpp's SPM tokenizer, written here because the `tokenizers` crate has no model that
//! merges by piece score with byte fallback the way SentencePiece's BPE does.
//!
//! A text is split at control and user-defined tokens (each such token its id); every other
//! fragment gets a leading space if the model asks for one (`add_space_prefix`) and the fragment
//! starts the text or follows a token, its spaces become U+2581, and then, starting from single
//! characters, the adjacent pair whose concatenation is the best-scoring piece of the vocabulary
//! is merged, repeatedly (the leftmost pair on a tie), until no pair forms a piece. A character
//! that is no piece is written as its UTF-8 bytes (`<0xNN>` tokens).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// GGUF token types (llama.cpp's `llama_token_type`).
pub const TOKEN_TYPE_CONTROL: i64 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i64 = 4;
pub const TOKEN_TYPE_BYTE: i64 = 6;

/// SentencePiece's whitespace marker.
const SPACE: char = '\u{2581}';

pub struct Spm {
    pieces: HashMap<String, u32>,
    scores: Vec<f32>,
    /// `<0xNN>` token of each byte (None where the vocabulary lacks it).
    bytes: [Option<u32>; 256],
    /// Control and user-defined tokens, matched in the text as written.
    specials: HashMap<String, u32>,
    /// The distinct lengths (bytes) of `specials`, longest first.
    special_lens: Vec<usize>,
    add_space_prefix: bool,
    unk: Option<u32>,
}

/// A candidate merge of symbols `left` and `left`'s next, scored by the piece it makes.
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// The max-heap pops the best score, and the leftmost pair among equal scores.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

/// A run of the text (bytes `start..start + len`), linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    pub fn new(
        tokens: &[String],
        scores: &[f32],
        types: &[i64],
        add_space_prefix: bool,
        unk: Option<u32>,
    ) -> Spm {
        let mut pieces = HashMap::with_capacity(tokens.len());
        let mut specials = HashMap::new();
        let mut bytes = [None; 256];
        for (i, t) in tokens.iter().enumerate() {
            let id = i as u32;
            match types[i] {
                TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED if !t.is_empty() => {
                    specials.insert(t.clone(), id);
                }
                TOKEN_TYPE_BYTE => {
                    if let Some(b) = parse_byte(t) {
                        bytes[b as usize] = Some(id);
                    }
                }
                _ => {}
            }
            // The first id of a text wins (as llama.cpp's map keeps the first).
            pieces.entry(t.clone()).or_insert(id);
        }
        let mut special_lens: Vec<usize> = specials.keys().map(String::len).collect();
        special_lens.sort_unstable_by(|a, b| b.cmp(a));
        special_lens.dedup();
        Spm {
            pieces,
            scores: scores.to_vec(),
            bytes,
            specials,
            special_lens,
            add_space_prefix,
            unk,
        }
    }

    /// The bytes token `text` (of type `ty`) stands for: U+2581 as a space, `<0xNN>` as its
    /// byte, control and user-defined tokens as written.
    pub fn token_bytes(text: &str, ty: i64) -> Vec<u8> {
        match ty {
            TOKEN_TYPE_BYTE => {
                parse_byte(text).map_or_else(|| text.as_bytes().to_vec(), |b| vec![b])
            }
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED => text.as_bytes().to_vec(),
            _ => text.replace(SPACE, " ").into_bytes(),
        }
    }

    pub fn encode(&self, text: &str, out: &mut Vec<u32>) {
        let mut after_special = true;
        let mut raw_start = 0;
        let mut i = 0;
        let b = text.as_bytes();
        while i < b.len() {
            match self.special_at(text, i) {
                Some((id, len)) => {
                    if raw_start < i {
                        self.encode_fragment(&text[raw_start..i], after_special, out);
                    }
                    out.push(id);
                    after_special = true;
                    i += len;
                    raw_start = i;
                }
                None => {
                    i += 1;
                    while i < b.len() && !text.is_char_boundary(i) {
                        i += 1;
                    }
                }
            }
        }
        if raw_start < b.len() {
            self.encode_fragment(&text[raw_start..], after_special, out);
        }
    }

    /// The longest control or user-defined token starting at byte `i`.
    fn special_at(&self, text: &str, i: usize) -> Option<(u32, usize)> {
        if self.specials.is_empty() {
            return None;
        }
        for &len in &self.special_lens {
            if let Some(s) = text.get(i..i + len) {
                if let Some(&id) = self.specials.get(s) {
                    return Some((id, len));
                }
            }
        }
        None
    }

    fn encode_fragment(&self, raw: &str, after_special: bool, out: &mut Vec<u32>) {
        let mut text = String::with_capacity(raw.len() + 3);
        if self.add_space_prefix && after_special {
            text.push(SPACE);
        }
        text.extend(raw.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let mut symbols: Vec<Symbol> = Vec::new();
        for (start, c) in text.char_indices() {
            let n = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: n.checked_sub(1),
                next: None,
            });
            if n > 0 {
                symbols[n - 1].next = Some(n);
            }
        }
        let mut heap = BinaryHeap::new();
        for i in 1..symbols.len() {
            self.push_bigram(&text, &symbols, i - 1, i, &mut heap);
        }
        while let Some(bg) = heap.pop() {
            let (l, r) = (symbols[bg.left], symbols[bg.right]);
            // Stale: one side was merged away or has grown since.
            if l.len == 0 || r.len == 0 || l.len + r.len != bg.len || l.next != Some(bg.right) {
                continue;
            }
            symbols[bg.left].len += r.len;
            symbols[bg.left].next = r.next;
            symbols[bg.right].len = 0;
            if let Some(n) = r.next {
                symbols[n].prev = Some(bg.left);
            }
            if let Some(p) = symbols[bg.left].prev {
                self.push_bigram(&text, &symbols, p, bg.left, &mut heap);
            }
            if let Some(n) = symbols[bg.left].next {
                self.push_bigram(&text, &symbols, bg.left, n, &mut heap);
            }
        }
        let mut at = Some(0).filter(|_| !symbols.is_empty());
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.pieces.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &byte in piece.as_bytes() {
                        out.extend(self.bytes[byte as usize].or(self.unk));
                    }
                }
            }
            at = s.next;
        }
    }

    fn push_bigram(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        heap: &mut BinaryHeap<Bigram>,
    ) {
        let (l, r) = (symbols[left], symbols[right]);
        let s = &text[l.start..r.start + r.len];
        if let Some(&id) = self.pieces.get(s) {
            heap.push(Bigram {
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                left,
                right,
                len: s.len(),
            });
        }
    }
}

/// The byte of a `<0xNN>` token.
fn parse_byte(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}
