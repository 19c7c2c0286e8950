//! Start `flywheel serve` on 127.0.0.1 port 0 as a child process, and a minimal blocking HTTP/1.1
//! client for talking to it. Every wait is bounded; the server is killed on drop.

use super::{write_tiny, TinySpec};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Server {
    pub child: Child,
    pub client: Client,
    pub stderr_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

/// Talks HTTP/1.1 to a server (one connection per request).
#[derive(Clone)]
pub struct Client {
    pub addr: String,
}

impl std::ops::Deref for Server {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.client
    }
}

impl Server {
    /// Start on `model` with a config file holding `config_toml` plus `extra_args`; wait until
    /// /health answers 200 (at most 30 s).
    pub fn start(model: &Path, config_toml: &str, extra_args: &[&str]) -> Server {
        Server::start_in(&[], model, config_toml, extra_args)
    }

    /// `start`, run through `wrapper` (a command that ends by exec'ing its arguments: say, one
    /// that joins a cgroup first); none: directly.
    pub fn start_in(
        wrapper: &[&str],
        model: &Path,
        config_toml: &str,
        extra_args: &[&str],
    ) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("serve.toml");
        std::fs::write(&cfg, config_toml).unwrap();
        let stderr_path = dir.path().join("stderr.log");
        let bin = server_binary();
        let mut cmd = match wrapper.split_first() {
            Some((w, rest)) => {
                let mut c = Command::new(w);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        let mut child = cmd
            .arg("serve")
            .arg("--model")
            .arg(model)
            .arg("--config")
            .arg(&cfg)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(extra_args)
            // Each server its own data directory unless the test names one (the default, ./data,
            // was shared by tests running at once: their migrations raced in one database).
            .args(
                (!extra_args.contains(&"--data-dir") && !config_toml.contains("data_dir"))
                    .then(|| ["--data-dir".into(), dir.path().join("data")])
                    .into_iter()
                    .flatten()
                    .collect::<Vec<std::path::PathBuf>>(),
            )
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .expect("start flywheel serve");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(a) = line.strip_prefix("listening on ") {
                    let _ = tx.send(a.to_string());
                }
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "server did not report its address: {}",
                    std::fs::read_to_string(&stderr_path).unwrap_or_default()
                );
            }
        };
        let s = Server {
            child,
            client: Client { addr },
            stderr_path,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = s.try_request("GET", "/health", None, &[]) {
                if r.status == 200 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "server not healthy: {}",
                s.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    pub fn client_for(addr: &str) -> Client {
        Client {
            addr: addr.to_string(),
        }
    }

    /// Send SIGTERM.
    pub fn terminate(&self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
    }
}

impl Client {
    pub fn try_request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<Response> {
        let mut s = self.connect(method, path, body, headers)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        if !raw.windows(4).any(|w| w == b"\r\n\r\n") {
            // The server went away before answering (a test that kills it).
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "no HTTP response",
            ));
        }
        Ok(Response::parse(&raw))
    }

    /// Send a request and return the open socket (for reading a stream by hand).
    pub fn connect(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<TcpStream> {
        let mut s = TcpStream::connect(&self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let body = body.unwrap_or("");
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes())?;
        Ok(s)
    }

    /// Send `raw` bytes as they are (a hand-made request) and read the whole answer.
    pub fn raw(&self, raw: &[u8]) -> std::io::Result<Response> {
        let mut s = TcpStream::connect(&self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        s.write_all(raw)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        Ok(Response::parse(&out))
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        self.try_request("POST", path, Some(&body.to_string()), &[])
            .expect("request")
    }

    pub fn get(&self, path: &str) -> Response {
        self.try_request("GET", path, None, &[]).expect("request")
    }

    /// The value of a metric line (first match of `name` with exactly these labels).
    pub fn metric(&self, name_and_labels: &str) -> f64 {
        let text = self.get("/metrics").body_text();
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name_and_labels)
                    .and_then(|r| r.strip_prefix(' '))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // A failing test says how the server ended and what it logged last (a crash otherwise
        // shows only as a refused connection).
        if std::thread::panicking() {
            let exit = self.child.try_wait();
            let log = self.stderr();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            eprintln!("server exit: {exit:?}; its stderr's last lines:");
            for l in tail.iter().rev() {
                eprintln!("  {l}");
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, String::from_utf8_lossy(&self.body))
    }
}

impl Response {
    pub fn parse(raw: &[u8]) -> Response {
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("header end");
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .expect("status line");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let mut body = raw[split + 4..].to_vec();
        if headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
        {
            body = dechunk(&body);
        }
        Response {
            status,
            headers,
            body,
        }
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body_text()))
    }

    /// The `data:` payloads of a server-sent event stream, in order.
    pub fn sse_data(&self) -> Vec<String> {
        self.body_text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    /// The stream's JSON chunks, after checking that it ends with `data: [DONE]`.
    pub fn sse_chunks(&self) -> Vec<serde_json::Value> {
        let data = self.sse_data();
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
        data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }
}

pub fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..nl]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = nl + 2;
        out.extend_from_slice(&b[start..(start + size).min(b.len())]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

// ---- Shared by the server test files: a tiny model served as "tiny", and checks. ----

pub const CONFIG: &str = r#"
[server]
served_model_name = "tiny"
[engine]
kv_cache_mb = 16
max_num_batched_tokens = 64
"#;

pub fn spec() -> TinySpec {
    TinySpec {
        ctx: 512,
        ..TinySpec::small()
    }
}

/// A long context, so that a generation can outlast what the test does meanwhile.
/// The tiny model with room for the generic format's tool descriptions and long grammars
/// (byte-level tokens).
pub fn wide() -> TinySpec {
    TinySpec {
        ctx: 2048,
        ..spec()
    }
}

pub fn start_wide() -> (tempfile::TempDir, Server) {
    let (dir, path) = write_tiny(&wide());
    let s = Server::start(&path, CONFIG, &[]);
    (dir, s)
}

pub fn start_long(config: &str) -> (tempfile::TempDir, Server) {
    let (dir, path) = write_tiny(&TinySpec {
        ctx: 8192,
        ..TinySpec::small()
    });
    let s = Server::start(&path, config, &[]);
    (dir, s)
}

pub fn start(config: &str, args: &[&str]) -> (tempfile::TempDir, Server) {
    let (dir, path) = write_tiny(&spec());
    let s = Server::start(&path, config, args);
    (dir, s)
}

/// The KV gauge is updated after the engine step that sent the last tokens: poll it (bounded).
pub fn wait_for_no_blocks(s: &Server) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("flywheel_kv_cache_blocks_used") > 0.0 {
        assert!(Instant::now() < deadline, "KV blocks still held");
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
    });
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

pub fn assert_error(r: &Response, status: u16, param: Option<&str>) -> Value {
    assert_eq!(r.status, status, "{}", r.body_text());
    let e = r.json();
    let err = &e["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(err.get(k).is_some(), "error body lacks {k}: {e}");
    }
    assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()));
    if let Some(p) = param {
        assert_eq!(err["param"], json!(p), "{e}");
    }
    e
}

/// `flywheel serve` with these arguments, expected to refuse to start: its stderr.
pub fn refused_start(model: &Path, args: &[&str]) -> String {
    let out = Command::new(server_binary())
        .args(["serve", "--model", model.to_str().unwrap()])
        .args(["--host", "127.0.0.1", "--port", "0"])
        .args(args)
        .output()
        .unwrap();
    assert!(!out.status.success(), "the server started");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The content of the first choice of chat request `b` (answered 200).
pub fn content_of(s: &Server, b: &Value) -> String {
    let r = s.post("/v1/chat/completions", b);
    assert_eq!(r.status, 200, "{}", r.body_text());
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The server binary the tests run: this build's, or FLYWHEEL_BIN's (the GPU proof runs these
/// tests against a CUDA build carried to the GPU machine).
pub fn server_binary() -> String {
    std::env::var("FLYWHEEL_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_flywheel").to_string())
}
