//! Chat templates render as transformers renders them (jinja2 with `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, `strftime_now`): a multi-line template in the style of
//! Llama 3's and Qwen's, rendered here and by Python's jinja2 with transformers' settings.

mod common;

use common::{python_json, write_tiny, TinySpec};
use flywheel::model::decoder::Decoder;
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
    let model = Decoder::open(&path).unwrap();
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

/// Python's jinja2 rendering in transformers' environment (its `tojson`, `raise_exception`,
/// `strftime_now`), as `apply_chat_template(messages, tools=...)` renders: the text, or
/// {"error": message}; None without jinja2.
fn transformers_render(
    template: &str,
    messages: &str,
    tools: &str,
    add_generation_prompt: bool,
) -> Option<serde_json::Value> {
    let script = r#"
import datetime, json, sys
try:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.ext import loopcontrols
except ImportError:
    print("null"); sys.exit(0)
def raise_exception(m): raise jinja2.exceptions.TemplateError(m)
def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
def strftime_now(f): return datetime.datetime.now(datetime.timezone.utc).strftime(f)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now
try:
    t = env.from_string(sys.argv[1])
    out = t.render(messages=json.loads(sys.argv[2]), tools=json.loads(sys.argv[3]),
                   bos_token="<|im_start|>", eos_token="<|im_end|>",
                   add_generation_prompt=sys.argv[4] == "1")
    print(json.dumps(out))
except jinja2.exceptions.TemplateError as e:
    print(json.dumps({"error": str(e)}))
"#;
    let gen = if add_generation_prompt { "1" } else { "0" };
    python_json(script, &[template, messages, tools, gen])
}

/// The real templates of the families (tests/fixtures/templates): plain conversations, a system
/// prompt, and tool use (definitions with awkward characters and numbers, an assistant's tool
/// call, the tool's result, the answer), with and without the generation prompt, render as
/// transformers renders them; where the template refuses a conversation, so does Flywheel.
#[test]
fn the_families_own_templates_render_as_transformers_renders_them_tools_included() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates");
    let tools = r#"[{"type": "function", "function": {"name": "get_weather",
        "description": "Weather «now» for <city> & \"region\"\n(uses the API)",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "days": {"type": "integer", "minimum": 1, "maximum": 10.5, "default": 1e-05}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "now", "description": "The time",
         "parameters": {"type": "object", "properties": {}}}}]"#;
    let plain = r#"[{"role": "user", "content": "What's 2+2?"}]"#;
    let multi = r#"[{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  hi there\n"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "more"}]"#;
    let tool_use = r#"[{"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        {"role": "assistant", "content": "It is 21.5 °C and clear."},
        {"role": "user", "content": "Thanks"}]"#;
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("jinja") {
            continue;
        }
        let template = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let leaked: &'static str = Box::leak(template.clone().into_boxed_str());
        let (_d, gguf) = write_tiny(&TinySpec {
            chat_template: Some(leaked),
            ..TinySpec::small()
        });
        let model = Decoder::open(&gguf).unwrap();
        let tok = Tokenizer::from_gguf(&model.gguf).unwrap();
        for (msgs, tools) in [
            (plain, "null"),
            (multi, "null"),
            (plain, tools),
            (tool_use, tools),
        ] {
            for gen in [true, false] {
                let Some(want) = transformers_render(&template, msgs, tools, gen) else {
                    eprintln!("skipped: Python's jinja2 is not installed");
                    return;
                };
                let m: serde_json::Value = serde_json::from_str(msgs).unwrap();
                let t: serde_json::Value = serde_json::from_str(tools).unwrap();
                let got =
                    tok.render_chat(m.as_array().unwrap(), t.as_array().map(Vec::as_slice), gen);
                match (want.as_str(), got) {
                    (Some(w), Ok(g)) => assert_eq!(g, w, "{name}: {msgs} tools {tools}"),
                    (None, Err(e)) => {
                        let w = want["error"].as_str().unwrap();
                        assert!(e.to_string().contains(w), "{name}: {e} vs {w}");
                    }
                    (w, g) => panic!("{name}: transformers {w:?}, Flywheel {g:?}"),
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 5 * 4 * 2);
}

/// `flywheel export-tokenizer`'s files, read back by the `tokenizers` library as a Hugging Face
/// client would, encode every text as the server does; the config carries the chat template.
#[test]
fn exported_tokenizer_encodes_as_the_server() {
    let (_dir, path) = write_tiny(&TinySpec::small());
    let model = Decoder::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&model.gguf).unwrap();
    let (json, config) = tok.hf_files().unwrap();
    let hf: tokenizers::Tokenizer = json.parse().unwrap();
    for text in [
        "hello world",
        "  spaces  and\nnew lines\t",
        "<|im_start|>user\nhi<|im_end|>",
        "digits 12345 and ünïcode ✓",
    ] {
        let want = tok.encode_with(text, true).unwrap();
        let got = hf.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "{text:?}");
    }
    assert_eq!(config["chat_template"].as_str(), tok.chat_template());
    assert_eq!(config["add_bos_token"], serde_json::json!(tok.add_bos));
}
