//! What can go wrong with a request's grammar, typed: shared by the bounds checked before
//! compiling (`grammar_bounds`) and the compiled constraint (`constraint`).

/// Why a grammar is refused or stops: a bound of `grammar_bounds`, a malformed spec, or the
/// grammar library's own message. Its text is what a 400 (or a failed choice) says.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("the grammar is {bytes} bytes; at most {max} are accepted")]
    TooLarge { bytes: usize, max: usize },
    /// What nests too deep (the regular expression, the grammar, the JSON Schema, a chain of
    /// rules).
    #[error("{what} nests deeper than {max} levels, the most accepted")]
    TooDeep { what: &'static str, max: usize },
    #[error("the JSON Schema's $refs reach more than {max} schemas; simplify it")]
    SchemaTooWide { max: usize },
    #[error("the grammar's rules reach more than {max} others; simplify it")]
    RulesTooWide { max: usize },
    #[error("a JSON Schema must be an object")]
    NotAnObject,
    #[error("the choice list is empty")]
    EmptyChoice,
    /// llguidance refused the grammar or failed on a token (its message's first line).
    #[error("{0}")]
    Library(String),
    #[error("the grammar allows no token here")]
    NoTokenAllowed,
    #[error("grammar panicked: {0}")]
    Panicked(String),
}
