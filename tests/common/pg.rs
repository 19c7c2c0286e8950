//! A throwaway PostgreSQL server for tests: `initdb` in a temporary folder, `postgres` on a free
//! loopback port (as the `postgres` user when the tests run as root, which PostgreSQL refuses),
//! stopped when dropped. The binaries come from `FLYWHEEL_PG_BIN`, `pg_config --bindir` or
//! Debian's /usr/lib/postgresql/*/bin; without them `Pg::start` says so and returns None (the
//! caller skips, with that message).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Pg {
    dir: tempfile::TempDir,
    bin: PathBuf,
    user: Option<(u32, u32)>,
    child: Option<Child>,
    pub port: u16,
    next_db: std::sync::atomic::AtomicUsize,
}

fn bin_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FLYWHEEL_PG_BIN") {
        return Some(PathBuf::from(d));
    }
    if let Ok(o) = Command::new("pg_config").arg("--bindir").output() {
        let d = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
        if d.join("initdb").exists() {
            return Some(d);
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|d| d.join("initdb").exists())
        .collect();
    found.sort();
    found.pop()
}

/// (uid, gid) of the `postgres` user when running as root.
fn postgres_user() -> Option<(u32, u32)> {
    let id = |args: &[&str]| -> Option<u32> {
        let o = Command::new("id").args(args).output().ok()?;
        String::from_utf8_lossy(&o.stdout).trim().parse().ok()
    };
    if id(&["-u"])? != 0 {
        return None;
    }
    Some((id(&["-u", "postgres"])?, id(&["-g", "postgres"])?))
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Pg {
    pub fn start() -> Option<Pg> {
        let Some(bin) = bin_dir() else {
            eprintln!(
                "skipped: no PostgreSQL binaries (install Debian's postgresql, or set \
                 FLYWHEEL_PG_BIN)"
            );
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let user = postgres_user();
        if let Some((uid, gid)) = user {
            chown(dir.path(), uid, gid);
        }
        let data = dir.path().join("data");
        let st = Pg::command(&bin, user, "initdb")
            .args([
                "-D",
                data.to_str().unwrap(),
                "-U",
                "flywheel",
                "--auth=trust",
            ])
            .args(["-E", "UTF8", "--no-sync"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&st.stderr)
        );
        let mut pg = Pg {
            dir,
            bin,
            user,
            child: None,
            port: free_port(),
            next_db: 0.into(),
        };
        pg.launch();
        Some(pg)
    }

    fn command(bin: &Path, user: Option<(u32, u32)>, name: &str) -> Command {
        let mut c = Command::new(bin.join(name));
        if let Some((uid, gid)) = user {
            c.uid(uid).gid(gid);
        }
        c
    }

    fn launch(&mut self) {
        let data = self.dir.path().join("data");
        let child = Pg::command(&self.bin, self.user, "postgres")
            .args(["-D", data.to_str().unwrap(), "-p", &self.port.to_string()])
            .args(["-k", self.dir.path().to_str().unwrap()])
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(["-c", "max_connections=200"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if postgres::Client::connect(&self.url("postgres"), postgres::NoTls).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "PostgreSQL did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stop the server (fast shutdown: sessions are cut, as in a restart).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-INT", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while c.try_wait().unwrap().is_none() {
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Stop and start again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        self.launch();
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://flywheel@127.0.0.1:{}/{db}", self.port)
    }

    /// A new, empty database: its URL.
    pub fn fresh_db(&self) -> String {
        let n = self
            .next_db
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("t{n}");
        let mut c = postgres::Client::connect(&self.url("postgres"), postgres::NoTls).unwrap();
        c.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        self.url(&name)
    }
}

fn chown(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
}

impl Drop for Pg {
    fn drop(&mut self) {
        self.stop();
    }
}
