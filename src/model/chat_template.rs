//! Chat templates rendered as transformers renders them: jinja with `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (minijinja's pycompat), and the functions and filter
//! transformers gives templates: `raise_exception`, `strftime_now`, and a `tojson` that writes
//! what Python's `json.dumps` writes (the real templates print tool schemas and tool-call
//! arguments with it, so its spacing, key order and escapes are part of the prompt).

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};

/// Instructions one rendering may run: a template from a request is the client's code, so its
/// loops are bounded. The real templates (Qwen2.5, Qwen3, Llama 3.1/3.2, Gemma 3, with tools and
/// tool histories) render under it in tests/chat_templates.rs; how far under was not measured.
const FUEL: u64 = 20_000_000;

/// Templates `--chat-template NAME` names, for GGUF files without one (base models) or to replace
/// the file's. Written here from each format's description (the tokens and turn layout each
/// family's instruct models were trained with); none handles tools.
pub const BUILTIN: [(&str, &str); 6] = [
    (
        "chatml",
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}\
         {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    ),
    (
        "llama3",
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + \
         '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}\
         {% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    ),
    (
        "gemma",
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' \
         else 'user' %}{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}\
         {% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
    ),
    (
        "phi3",
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}\
         {% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ),
    (
        "zephyr",
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}\
         {% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ),
    (
        "mistral",
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}\
         {{ ' ' + m['content'] + eos_token }}{% elif m['role'] == 'system' %}{{ '[INST] ' + \
         m['content'] + '\\n\\n' }}{% else %}{% if loop.previtem is defined and \
         loop.previtem['role'] == 'system' %}{{ m['content'] + ' [/INST]' }}{% else %}\
         {{ '[INST] ' + m['content'] + ' [/INST]' }}{% endif %}{% endif %}{% endfor %}",
    ),
];

/// `--chat-template VALUE` / `model.chat_template`: one of [`BUILTIN`]'s names, a file holding a
/// template, or the template itself (text with `{{` or `{%`), as vLLM's `--chat-template` reads
/// it.
pub fn resolve(value: &str) -> Result<String, TemplateSourceError> {
    if let Some((_, t)) = BUILTIN.iter().find(|(n, _)| *n == value) {
        return Ok((*t).to_string());
    }
    let path = std::path::Path::new(value);
    if path.is_file() {
        return std::fs::read_to_string(path).map_err(|source| TemplateSourceError::Read {
            path: path.to_path_buf(),
            source,
        });
    }
    if value.contains("{{") || value.contains("{%") {
        return Ok(value.to_string());
    }
    Err(TemplateSourceError::Unknown {
        value: value.to_string(),
        names: BUILTIN
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Why `--chat-template` names no template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateSourceError {
    #[error("chat template file {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("'{value}' is neither a file, a jinja template nor a built-in template ({names})")]
    Unknown { value: String, names: String },
}

/// Render `template` with `ctx` (messages, tools, special tokens, add_generation_prompt).
pub fn render(template: &str, ctx: Value) -> Result<String, Error> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    minijinja_contrib::add_to_environment(&mut env);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("strftime_now", |fmt: String| {
        strftime(&fmt, crate::util::unix_now())
    });
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_filter("tojson", tojson);
    env.add_template("chat", template)?;
    env.get_template("chat")?.render(ctx)
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`:
/// `json.dumps` with those arguments (no HTML escaping, Python's separators and float repr).
fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) => match (i.as_str(), i64::try_from(i.clone())) {
            (Some(s), _) => Some(s.to_string()),
            (None, Ok(n)) => Some(" ".repeat(n.max(0) as usize)),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: bad indent",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be (item, key)",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(&v, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

fn write_json(v: &Value, o: &JsonOpts, level: usize, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match i128::try_from(v.clone()) {
            Ok(i) if v.is_integer() => out.push_str(&i.to_string()),
            _ => out.push_str(&py_float(f64::try_from(v.clone())?)),
        },
        ValueKind::String => write_str(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, o, level, '[', ']', &items, |x, out| {
                write_json(x, o, level + 1, out)
            })?;
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort_by_key(|k| k.to_string());
            }
            write_container(out, o, level, '{', '}', &keys, |k, out| {
                // Python writes non-string keys as strings.
                match k.as_str() {
                    Some(s) => write_str(s, o.ensure_ascii, out),
                    None => write_str(&k.to_string(), o.ensure_ascii, out),
                }
                out.push_str(&o.key_sep);
                write_json(&v.get_item(k)?, o, level + 1, out)
            })?;
        }
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: an undefined value is not JSON serializable",
            ))
        }
        _ => write_str(&v.to_string(), o.ensure_ascii, out),
    }
    Ok(())
}

/// A list or object: Python's layout with and without `indent`.
fn write_container(
    out: &mut String,
    o: &JsonOpts,
    level: usize,
    open: char,
    close: char,
    items: &[Value],
    mut item: impl FnMut(&Value, &mut String) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    let newline = |out: &mut String, n: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            for _ in 0..n {
                out.push_str(ind);
            }
        }
    };
    for (i, x) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&o.item_sep);
        }
        newline(out, level + 1);
        item(x, out)?;
    }
    newline(out, level);
    out.push(close);
    Ok(())
}

/// A JSON string as Python writes it (`ensure_ascii`: non-ASCII as \uXXXX, surrogate pairs).
fn write_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a float (as `json.dumps` writes it): the shortest digits that round-trip,
/// fixed notation for exponents −4..15, else d.ddde±XX.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sci = format!("{x:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let mut out = String::from(if neg { "-" } else { "" });
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            let padded = format!("{digits:0<int_len$}");
            let (int, frac) = padded.split_at(int_len);
            out.push_str(int);
            out.push('.');
            out.push_str(if frac.is_empty() { "0" } else { frac });
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push_str(&format!(
            "e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        ));
    }
    out
}

/// `fmt` at Unix second `t` (UTC), for the codes chat templates use: %d %m %Y %y %b %B %a %A
/// %H %M %S %%. Other codes are kept as written.
pub(crate) fn strftime(fmt: &str, t: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = (t / 86400) as i64;
    let secs = t % 86400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (month, weekday) = (MONTHS[(m - 1) as usize], DAYS[days.rem_euclid(7) as usize]);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&weekday[..3]),
            Some('A') => out.push_str(weekday),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{py_float, strftime};

    #[test]
    fn strftime_writes_the_dates_python_writes() {
        // Python's datetime.fromtimestamp(t, utc).strftime(...) for each t.
        let fmt = "%d %m %Y %y %b %B %a %A %H %M %S %%";
        for (t, want) in [
            (0, "01 01 1970 70 Jan January Thu Thursday 00 00 00 %"),
            (
                951_782_400,
                "29 02 2000 00 Feb February Tue Tuesday 00 00 00 %",
            ),
            (
                1_732_410_123,
                "24 11 2024 24 Nov November Sun Sunday 01 02 03 %",
            ),
            (
                4_102_444_799,
                "31 12 2099 99 Dec December Thu Thursday 23 59 59 %",
            ),
        ] {
            assert_eq!(strftime(fmt, t), want, "{t}");
        }
    }

    #[test]
    fn floats_are_written_as_python_writes_them() {
        // Python's repr of each.
        for (x, want) in [
            (1.0, "1.0"),
            (-0.5, "-0.5"),
            (0.1, "0.1"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (123456.789, "123456.789"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (9999999999999998.0, "9999999999999998.0"),
            (2.5e-7, "2.5e-07"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(py_float(x), want, "{x}");
        }
    }
}
