//! Constrained decoding: a request's grammar (a JSON Schema, a regex, a choice of strings, a Lark
//! grammar) compiled by llguidance against the model's own vocabulary, and per choice a matcher
//! that says which tokens may come next and follows the tokens drawn.
//!
//! The engine asks a choice's matcher for its next mask while the forward pass that produces the
//! logits runs (on another thread, see `Engine::step`), so a constrained request costs the batch
//! it shares little. A constrained token is not a draw from the policy: such completions are
//! logged off-policy (`SamplingParams::constrained`).

pub use super::grammar_error::GrammarError;
use crate::model::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;

/// The tokens allowed next (a bit per vocabulary entry).
pub use llguidance::toktrie::SimpleVob as TokenMask;

/// llguidance's message without the parser state it appends.
fn library(e: impl std::fmt::Display) -> GrammarError {
    let e = e.to_string();
    let first = e.split("\n<state>").next().unwrap_or(&e).trim();
    GrammarError::Library(match first {
        "NoExtensionBias" => "no token of the vocabulary can continue it (NoExtensionBias)".into(),
        _ => first.to_string(),
    })
}

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON Schema (an object); generated JSON is compact: no newlines or indentation, one
    /// space after `,` and `:` (as Python's `json.dumps`), so a model cannot spend its budget on
    /// whitespace inside a valid value.
    Json(Value),
    /// A regular expression the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark syntax (which may embed JSON Schemas with `%json {...}`).
    Lark(String),
}

/// llguidance's JSON options for compact output.
fn compact_json() -> Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// `schema` as generated: objects closed (`close_objects`) and the compact-JSON options attached
/// (replacing any the caller set).
pub fn compact_schema(schema: &Value) -> Result<Value, GrammarError> {
    let mut s = schema.clone();
    close_objects(&mut s);
    let o = s.as_object_mut().ok_or(GrammarError::NotAnObject)?;
    o.insert("x-guidance".into(), compact_json());
    Ok(s)
}

/// Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
const ONE_SCHEMA: [&str; 9] = [
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
];
const SCHEMA_LISTS: [&str; 5] = ["anyOf", "oneOf", "allOf", "prefixItems", "items"];
const SCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];

/// The largest integer generated where a schema sets no bound: 2^53 − 1, the largest that JSON
/// readers hold exactly (I-JSON, RFC 7493; JavaScript's `MAX_SAFE_INTEGER`): 16 digits, as
/// llama.cpp's grammar converter allows (`[1-9][0-9]{0,15}`).
pub const INTEGER_BOUND: i64 = (1 << 53) - 1;

/// For generation, as llama.cpp's and vLLM's grammar converters do: an object schema that lists
/// `properties` admits only those unless it says `additionalProperties` (true or a schema) — a
/// small model otherwise writes keys until its budget ends (every LangChain `@tool`, most
/// hand-written tools, leave it out). Objects without `properties` stay free-form. An integer
/// without `minimum`/`maximum` gets ±`INTEGER_BOUND` (16 digits, as llama.cpp; numbers stay
/// free: a bound would also forbid exponents): greedy, a small
/// model otherwise writes `"limit": 1000000…` until `max_tokens`. Walks only schema positions
/// (never `const`, `enum`, `default` or `examples` data); JSON nests at most 128 levels, and so
/// does this.
pub fn close_objects(schema: &mut Value) {
    let Value::Object(o) = schema else {
        return;
    };
    if o.contains_key("properties") && !o.contains_key("additionalProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    bound_integer(o);
    for (k, v) in o.iter_mut() {
        let k = k.as_str();
        if SCHEMA_MAPS.contains(&k) {
            if let Value::Object(m) = v {
                m.values_mut().for_each(close_objects);
            }
        } else if SCHEMA_LISTS.contains(&k) && v.is_array() {
            if let Value::Array(a) = v {
                a.iter_mut().for_each(close_objects);
            }
        } else if ONE_SCHEMA.contains(&k) {
            close_objects(v);
        }
    }
}

/// Missing bounds of an integer-only schema (`type` "integer", or a list with "integer" and no
/// "number", which the bounds would also limit); a bound that would leave no value (a given
/// `minimum` above `INTEGER_BOUND`) is not added, nor one where `enum` or `const` lists the
/// values.
fn bound_integer(o: &mut serde_json::Map<String, Value>) {
    if o.contains_key("enum") || o.contains_key("const") {
        return;
    }
    let integer = match o.get("type") {
        Some(Value::String(t)) => t == "integer",
        Some(Value::Array(ts)) => {
            ts.iter().any(|t| t == "integer") && !ts.iter().any(|t| t == "number")
        }
        _ => false,
    };
    if !integer {
        return;
    }
    let given = |keys: [&str; 2]| -> Vec<f64> {
        keys.iter()
            .filter_map(|k| o.get(*k).and_then(Value::as_f64))
            .collect()
    };
    let (lows, highs) = (
        given(["minimum", "exclusiveMinimum"]),
        given(["maximum", "exclusiveMaximum"]),
    );
    let bound = INTEGER_BOUND as f64;
    let no_key = |keys: [&str; 2]| keys.iter().all(|k| !o.contains_key(*k));
    let (add_low, add_high) = (
        no_key(["minimum", "exclusiveMinimum"]) && highs.iter().all(|&h| h >= -bound),
        no_key(["maximum", "exclusiveMaximum"]) && lows.iter().all(|&l| l <= bound),
    );
    if add_low {
        o.insert("minimum".into(), Value::from(-INTEGER_BOUND));
    }
    if add_high {
        o.insert("maximum".into(), Value::from(INTEGER_BOUND));
    }
}

/// A regex matching `s` literally.
pub fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/\"".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The vocabulary as llguidance sees it: each token's bytes (control tokens marked as special,
/// so no grammar spells them out of text), ids padded to the logits' width.
struct Vocab {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.tok.encode_with(text, false).unwrap_or_default(),
            // Part of a character: the trie spells it (the tokenizer reads only text).
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    /// Not canonical for llguidance: grammars never force tokens (which would be tokenized here,
    /// possibly from part of a character, and not drawn by the model); every token is sampled
    /// under the mask.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles grammars for one model (built once: the vocabulary's token trie and llguidance's
/// precomputed slices take a moment).
pub struct Grammars {
    factory: ParserFactory,
    eos: u32,
}

impl Grammars {
    /// `vocab_size`: the logits' width (at least the tokenizer's vocabulary).
    pub fn new(tok: Arc<Tokenizer>, vocab_size: usize) -> Result<Grammars, GrammarError> {
        let n = vocab_size.max(tok.vocab_size());
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|i| {
                let b = tok.token_bytes(i);
                if tok.is_control(i) {
                    [&[TokTrie::SPECIAL_TOKEN_MARKER], b].concat()
                } else {
                    b.to_vec()
                }
            })
            .collect();
        // A grammar's end is "EOS" to llguidance; the engine maps it onto the request's end
        // tokens (EOS and its stop tokens).
        let eos = tok.eos_id.unwrap_or(0);
        let trie = TokTrie::from(&TokRxInfo::new(n as u32, eos), &words);
        let env: llguidance::toktrie::TokEnv = Arc::new(Vocab { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(library)?;
        factory.quiet();
        Ok(Grammars { factory, eos })
    }

    /// Compile `spec` into a fresh constraint; the library's message when it rejects it, or the
    /// bound it exceeds (`grammar_bounds`: checked first, since compiling recurses as deep as the
    /// grammar). Run it on a thread with `grammar_bounds::COMPILE_STACK` of stack.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        use super::grammar_bounds as bounds;
        match spec {
            GrammarSpec::Json(schema) => bounds::check_schema(schema)?,
            GrammarSpec::Regex(rx) => bounds::check_regex(rx)?,
            GrammarSpec::Choice(list) => bounds::check_choice(list)?,
            GrammarSpec::Lark(g) => bounds::check_lark(g)?,
        }
        let grammar = match spec {
            GrammarSpec::Json(schema) => TopLevelGrammar::from_json_schema(compact_schema(schema)?),
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Choice(list) => {
                if list.is_empty() {
                    return Err(GrammarError::EmptyChoice);
                }
                let alts: Vec<String> = list.iter().map(|s| regex_literal(s)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alts.join("|")))
            }
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let parser = self.factory.create_parser(grammar).map_err(library)?;
        let mut m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(library(e));
        }
        // A grammar that allows nothing at all is refused now rather than failing mid-request.
        m.compute_mask().map_err(library)?;
        Ok(Constraint { m, eos: self.eos })
    }
}

/// One choice's position in its grammar.
pub struct Constraint {
    m: Matcher,
    eos: u32,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            m: self.m.deep_clone(),
            eos: self.eos,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    /// The tokens allowed next; where the grammar may end, `end_tokens` are allowed too (only
    /// they, once it must end).
    pub fn mask(&mut self, end_tokens: &[u32]) -> Result<TokenMask, GrammarError> {
        let mut mask = self.m.compute_mask_or_eos().map_err(library)?;
        if mask.is_allowed(self.eos) {
            for &t in end_tokens {
                if (t as usize) < mask.len() {
                    mask.allow_token(t);
                }
            }
        }
        if mask.is_zero() {
            return Err(GrammarError::NoTokenAllowed);
        }
        Ok(mask)
    }

    /// Follow token `t` (drawn from the last mask).
    pub fn advance(&mut self, t: u32) -> Result<(), GrammarError> {
        self.m.consume_token(t).map_err(library)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_with_properties_are_closed_unless_they_say_otherwise() {
        let mut s = json!({"type": "object", "properties": {
            "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "b": {"type": "object"},
            "c": {"type": "object", "properties": {}, "additionalProperties": true},
            "d": {"type": "array", "items": {"properties": {"y": {}}}},
            "e": {"anyOf": [{"properties": {"z": {}}}, {"type": "null"}]},
            "f": {"const": {"properties": {"q": 1}}},
            "properties": {"type": "object", "properties": {"p": {}}}},
            "$defs": {"D": {"properties": {"w": {}}, "additionalProperties": {"type": "string"}}}});
        close_objects(&mut s);
        assert_eq!(s["additionalProperties"], false);
        let p = &s["properties"];
        assert_eq!(p["a"]["additionalProperties"], false);
        assert!(
            p["b"].get("additionalProperties").is_none(),
            "free-form stays free"
        );
        assert_eq!(p["c"]["additionalProperties"], true);
        assert_eq!(p["d"]["items"]["additionalProperties"], false);
        assert_eq!(p["e"]["anyOf"][0]["additionalProperties"], false);
        assert_eq!(
            p["f"],
            json!({"const": {"properties": {"q": 1}}}),
            "data untouched"
        );
        assert_eq!(p["properties"]["additionalProperties"], false);
        assert!(
            p.get("additionalProperties").is_none(),
            "a map of properties is no schema"
        );
        assert_eq!(
            s["$defs"]["D"]["additionalProperties"],
            json!({"type": "string"})
        );
    }

    #[test]
    fn integers_without_bounds_get_sixteen_digits() {
        let b = INTEGER_BOUND;
        let mut s = json!({"type": "object", "properties": {
            "free": {"type": "integer"},
            "low": {"type": "integer", "minimum": 3},
            "high": {"type": ["integer", "null"], "exclusiveMaximum": 10},
            "huge": {"type": "integer", "minimum": 1e17},
            "num": {"type": "number"},
            "either": {"type": ["integer", "number"]},
            "listed": {"type": "integer", "enum": [1, 2]}}});
        close_objects(&mut s);
        let p = &s["properties"];
        assert_eq!(
            (&p["free"]["minimum"], &p["free"]["maximum"]),
            (&json!(-b), &json!(b))
        );
        assert_eq!(
            (&p["low"]["minimum"], &p["low"]["maximum"]),
            (&json!(3), &json!(b))
        );
        assert_eq!(p["high"]["minimum"], json!(-b));
        assert!(p["high"].get("maximum").is_none(), "{}", p["high"]);
        assert!(p["huge"].get("maximum").is_none(), "no empty range");
        for k in ["num", "either", "listed"] {
            assert!(
                p[k].get("minimum").is_none() && p[k].get("maximum").is_none(),
                "{k}"
            );
        }
        assert_eq!(b.to_string().len(), 16);
        assert_eq!(b as f64 as i64, b, "exact as a JSON reader's f64");
    }
}
