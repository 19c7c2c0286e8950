//! A throwaway S3-compatible server for tests: moto's server mode (PyPI `moto[server]`) on a
//! free loopback port, one bucket created, killed when dropped. Without moto `S3::start` says
//! so and returns None (the caller skips, with that message).

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct S3 {
    child: Child,
    pub port: u16,
    pub bucket: String,
}

impl S3 {
    pub fn start() -> Option<S3> {
        let probe = Command::new("python3")
            .args(["-c", "import moto.server, flask"])
            .output();
        if !probe.is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: no moto server (pip install 'moto[server]')");
            return None;
        }
        let port = super::pg::free_port();
        let child = Command::new("python3")
            .args(["-c", "from moto.server import main; main()"])
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let s3 = S3 {
            child,
            port,
            bucket: "flywheel".into(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        // Creating the bucket is the readiness check.
        while s3.request("PUT", "/flywheel", b"").ok().map(|r| r.0) != Some(200) {
            assert!(Instant::now() < deadline, "moto did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(s3)
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `[online]` lines: the adapter store in this bucket under `prefix`, and its settings.
    pub fn online_config(&self, prefix: &str) -> String {
        format!(
            "adapter_store = \"s3://{}/{prefix}\"\n[online.adapter_store_options]\n\
             aws_endpoint = \"{}\"\naws_allow_http = \"true\"\naws_region = \"us-east-1\"\n\
             aws_access_key_id = \"test\"\naws_secret_access_key = \"test\"\n",
            self.bucket,
            self.endpoint()
        )
    }

    /// The object_store settings of `online_config`.
    pub fn options(&self) -> std::collections::BTreeMap<String, String> {
        [
            ("aws_endpoint", self.endpoint()),
            ("aws_allow_http", "true".into()),
            ("aws_region", "us-east-1".into()),
            ("aws_access_key_id", "test".into()),
            ("aws_secret_access_key", "test".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// An unsigned path-style request (moto does not check signatures; anonymous object access
    /// is refused): status and body.
    fn request(&self, method: &str, path: &str, body: &[u8]) -> std::io::Result<(u16, Vec<u8>)> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n",
            self.port,
            body.len()
        );
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        if !raw.windows(4).any(|w| w == b"\r\n\r\n") {
            return Err(std::io::Error::other("no response"));
        }
        let r = super::server::Response::parse(&raw);
        Ok((r.status, r.body))
    }

    /// Run `f` on an object_store client of the bucket (the test's own, beside the server's).
    fn with_client<T>(
        &self,
        f: impl AsyncFnOnce(&object_store::aws::AmazonS3) -> object_store::Result<T>,
    ) -> T {
        let mut b = object_store::aws::AmazonS3Builder::new().with_bucket_name(&self.bucket);
        for (k, v) in self.options() {
            b = b.with_config(k.parse().unwrap(), v);
        }
        let client = b.build().unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(f(&client)).unwrap()
    }

    /// Every object key in the bucket.
    pub fn keys(&self) -> Vec<String> {
        use futures_util::StreamExt;
        self.with_client(async |c| {
            let metas: Vec<_> = object_store::ObjectStore::list(c, None).collect().await;
            metas
                .into_iter()
                .map(|m| m.map(|m| m.location.to_string()))
                .collect()
        })
    }

    /// Delete the object `key`.
    pub fn delete(&self, key: &str) {
        use object_store::ObjectStoreExt;
        self.with_client(async |c| c.delete(&key.into()).await)
    }

    /// Overwrite the object `key` with `bytes`.
    pub fn overwrite(&self, key: &str, bytes: Vec<u8>) {
        use object_store::ObjectStoreExt;
        self.with_client(async |c| c.put(&key.into(), bytes.into()).await.map(|_| ()))
    }
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
