//! Reasoning models' thinking (`<think>…</think>`: Qwen3, QwQ, DeepSeek-R1) separated from the
//! answer as vLLM's reasoning parsers separate it: `reasoning_content` beside `content`, tool
//! calls read from the answer only. Only the response is split; what is logged and trained is
//! the sampled tokens, thinking included.

const START: &str = "<think>";
const END: &str = "</think>";

/// Whether a chat template is a reasoning model's (it writes or reads a thinking).
pub fn template_reasons(template: &str) -> bool {
    template.contains(START) || template.contains(END)
}

/// Whether a completion starts inside the thinking: the rendered prompt opened it (DeepSeek-R1's
/// template ends with `<think>\n`).
pub fn starts_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with(START)
}

/// The thinking and the answer of a whole completion. Without an opened thinking, text that
/// does not begin with `<think>` is all answer (vLLM's Qwen3 rule); a thinking never closed
/// (cut by `max_tokens`) is all thinking.
pub fn split(text: &str, thinking_at_start: bool) -> (Option<String>, String) {
    let body = if thinking_at_start {
        text
    } else {
        match text.trim_start().strip_prefix(START) {
            Some(rest) => rest,
            None => return (None, text.to_string()),
        }
    };
    match body.find(END) {
        Some(at) => (
            Some(body[..at].to_string()),
            body[at + END.len()..].to_string(),
        ),
        None => (Some(body.to_string()), String::new()),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not yet known whether the text opens a thinking.
    Before,
    Thinking,
    Answer,
}

/// [`split`] as the text streams: each piece becomes (thinking, answer) deltas, holding back
/// only what may be the start of a tag.
#[derive(Clone, Debug)]
pub struct ReasoningStream {
    state: State,
    held: String,
}

impl ReasoningStream {
    pub fn new(thinking_at_start: bool) -> ReasoningStream {
        ReasoningStream {
            state: if thinking_at_start {
                State::Thinking
            } else {
                State::Before
            },
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> (String, String) {
        self.held.push_str(text);
        let (mut thinking, mut answer) = (String::new(), String::new());
        loop {
            match self.state {
                State::Before => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(START) {
                        self.held = rest.to_string();
                        self.state = State::Thinking;
                    } else if START.starts_with(t) {
                        return (thinking, answer);
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Thinking => {
                    if let Some(at) = self.held.find(END) {
                        thinking.push_str(&self.held[..at]);
                        self.held = self.held[at + END.len()..].to_string();
                        self.state = State::Answer;
                    } else {
                        let keep = tag_prefix_len(&self.held, END);
                        let cut = self.held.len() - keep;
                        thinking.extend(self.held.drain(..cut));
                        return (thinking, answer);
                    }
                }
                State::Answer => {
                    answer.push_str(&std::mem::take(&mut self.held));
                    return (thinking, answer);
                }
            }
        }
    }

    /// The end of the text: what was held goes where it stands.
    pub fn finish(&mut self) -> (String, String) {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Thinking => (held, String::new()),
            State::Before | State::Answer => (String::new(), held),
        }
    }
}

/// The length of the longest end of `text` that begins `tag` (a tag that may be arriving).
fn tag_prefix_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && tag.starts_with(&text[text.len() - k..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_texts_split_as_vllms_parsers_split_them() {
        let t = "<think>\nplan a b\n</think>\n\nThe answer.";
        assert_eq!(
            split(t, false),
            (Some("\nplan a b\n".into()), "\n\nThe answer.".into())
        );
        assert_eq!(
            split("Plain answer.", false),
            (None, "Plain answer.".into())
        );
        assert_eq!(
            split("still thinking", true),
            (Some("still thinking".into()), String::new())
        );
        assert_eq!(
            split("plan</think>done", true),
            (Some("plan".into()), "done".into())
        );
        assert!(starts_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!starts_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
    }

    #[test]
    fn streams_give_what_whole_texts_give_however_the_text_is_cut() {
        let texts = [
            "<think>\nplan a b\n</think>\n\nThe answer.",
            "  <think>x</think>y",
            "Plain answer with </think> inside.",
            "<thin but not a tag",
            "<think>never closed </thi",
            "plan</think>done",
            "ünïcödé <think> mid</think>",
        ];
        for text in texts {
            for at_start in [false, true] {
                let (want_t, want_a) = split(text, at_start);
                let chars: Vec<char> = text.chars().collect();
                for size in 1..5 {
                    let mut s = ReasoningStream::new(at_start);
                    let (mut t, mut a) = (String::new(), String::new());
                    for piece in chars.chunks(size) {
                        let (dt, da) = s.push(&piece.iter().collect::<String>());
                        t.push_str(&dt);
                        a.push_str(&da);
                    }
                    let (dt, da) = s.finish();
                    t.push_str(&dt);
                    a.push_str(&da);
                    assert_eq!(a, want_a, "{text:?} {at_start} {size}");
                    assert_eq!(t, want_t.clone().unwrap_or_default(), "{text:?} {size}");
                }
            }
        }
    }
}
