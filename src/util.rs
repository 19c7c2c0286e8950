//! Small helpers every layer uses: the clock, random ids and seeds, a reproducible RNG, and
//! durable writes (write + fsync, directory fsync).

use std::io::Write;
use std::path::Path;

/// Seconds since the Unix epoch (the `created` fields).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Seconds since the Unix epoch, with the fraction.
pub fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// 64 bits from the OS's randomness.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("OS randomness");
    u64::from_le_bytes(b)
}

/// `prefix` + 128 random bits in hex: unguessable ids.
pub fn random_id(prefix: &str) -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("OS randomness");
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{prefix}{hex}")
}

/// xoshiro256** seeded through SplitMix64: small, fast, reproducible across platforms.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E3779B97F4A7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D049BB133111EB);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `v` as little-endian bytes (a copy per value, not a push per byte: about as fast as memcpy).
pub fn f32_le_bytes(v: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; v.len() * 4];
    for (c, x) in b.chunks_exact_mut(4).zip(v) {
        c.copy_from_slice(&x.to_le_bytes());
    }
    b
}

/// Write a file and fsync it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// fsync a directory (so a rename inside it is durable).
pub fn sync_dir(path: &Path) -> std::io::Result<()> {
    std::fs::File::open(path)?.sync_all()
}

/// `s` with every absolute file path replaced by `[path]`: an error as shown to callers who are
/// not the admin (a server's directories are the operator's to know).
pub fn hide_paths(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.char_indices().peekable();
    let mut prev: Option<char> = None;
    while let Some((i, c)) = chars.next() {
        let at_start = prev.is_none_or(|p| p.is_whitespace() || "\"'`([{=".contains(p));
        if c == '/' && at_start {
            let rest = &s[i..];
            let end = rest
                .find(|c: char| c.is_whitespace() || "\"'`)]},;".contains(c) || c == ':')
                .unwrap_or(rest.len());
            if rest[..end].len() > 1 {
                out.push_str("[path]");
                for _ in rest[..end].chars().skip(1) {
                    chars.next();
                }
                prev = Some('x');
                continue;
            }
        }
        out.push(c);
        prev = Some(c);
    }
    out
}

#[cfg(test)]
mod hide_paths_tests {
    use super::hide_paths;

    #[test]
    fn absolute_paths_are_hidden_and_the_rest_kept() {
        assert_eq!(
            hide_paths(
                "checkpoint /srv/data/adapters/x/v-00000002: /srv/data/adapters/x/.tmp-v-2/\
                 optimizer.safetensors: No space left on device (os error 28)"
            ),
            "checkpoint [path]: [path]: No space left on device (os error 28)"
        );
        assert_eq!(
            hide_paths("cannot open \"/var/lib/f.db\" (a/b stays, 1/2 too)"),
            "cannot open \"[path]\" (a/b stays, 1/2 too)"
        );
        assert_eq!(hide_paths("rate 3 / 4"), "rate 3 / 4");
    }
}
