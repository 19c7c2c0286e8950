//! Chat templates render as transformers renders them (jinja2 with `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, `strftime_now`): a multi-line template in the style of
//! Llama 3's and Qwen's, rendered here and by Python's jinja2 with transformers' settings.

mod common;

use common::{python_json, write_tiny, TinySpec};
use flywheel::model::llama::Llama;
use flywheel::model::tokenizer::{ChatMessage, Tokenizer};

const TEMPLATE: &str = r#"{{- bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set rest = messages[1:] %}
{% else %}
    {% set system = "Today is " + strftime_now("%d %b %Y") + "." %}
    {% set rest = messages %}
{% endif %}
<|im_start|>system
{{ system }}<|im_end|>
{% for m in rest %}
    {% if m['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('roles must be user or assistant') }}
    {% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"#;

/// Python's jinja2 rendering with transformers' environment (None: no jinja2).
fn jinja2_render(messages: &str, add_generation_prompt: bool) -> Option<String> {
    let script = r#"
import datetime, json, sys
try:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.ext import loopcontrols
except ImportError:
    print("null"); sys.exit(0)
def raise_exception(m): raise ValueError(m)
def strftime_now(f): return datetime.datetime.now(datetime.timezone.utc).strftime(f)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now
t = env.from_string(sys.argv[1])
# The tiny vocabulary's BOS and EOS (ids 1 and 2, tests/common).
print(json.dumps(t.render(messages=json.loads(sys.argv[2]), bos_token="<|im_start|>",
                          eos_token="<|im_end|>", add_generation_prompt=sys.argv[3] == "1")))
"#;
    let gen = if add_generation_prompt { "1" } else { "0" };
    python_json(script, &[TEMPLATE, messages, gen])
}

#[test]
fn multi_line_templates_render_as_transformers_renders_them() {
    let (_dir, path) = write_tiny(&TinySpec {
        chat_template: Some(TEMPLATE),
        ..TinySpec::small()
    });
    let model = Llama::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&model.gguf).unwrap();
    let conversations = [
        r#"[{"role": "user", "content": "  hi there  "}]"#,
        r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]"#,
    ];
    for msgs in conversations {
        let parsed: Vec<ChatMessage> = serde_json::from_str(msgs).unwrap();
        for gen in [true, false] {
            let Some(want) = jinja2_render(msgs, gen) else {
                eprintln!("skipped: Python's jinja2 is not installed");
                return;
            };
            let got = tok.apply_chat_template(&parsed, gen).unwrap();
            assert_eq!(got, want, "{msgs} add_generation_prompt={gen}");
        }
    }
    // The template's own errors reach the caller.
    let bad: Vec<ChatMessage> =
        serde_json::from_str(r#"[{"role": "tool", "content": "x"}]"#).unwrap();
    let e = tok.apply_chat_template(&bad, true).unwrap_err().to_string();
    assert!(e.contains("roles must be user or assistant"), "{e}");
}
