//! Where a model file's bytes live in memory (`model.weights` / `--weights`): read once into
//! 2 MB pages, or mapped. Either way the process holds one copy, in the file's own format.

use memmap2::Mmap;
use std::fs::File;

/// Where the weights live in memory (`model.weights` / `--weights`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightMemory {
    /// The file read once into anonymous memory in 2 MB pages (transparent huge pages) where the
    /// kernel offers them, else mapped: decode streams the whole model per token, and on 4 KB
    /// pages it takes a TLB miss every 4 KB and the hardware prefetchers stop at each page's end
    /// (batch-1 decode +15% on an AMD Zen 4: docs/proofs.md, "Memory, allocation, and every CPU's paths"). Still the one copy the
    /// process holds, in the file's own format; the page cache's pages stay the kernel's to drop.
    #[default]
    HugePages,
    /// The file mapped (`mmap`, 4 KB pages; the page cache is shared by every process mapping
    /// the file, e.g. several replicas on one host).
    Mapped,
}

impl std::str::FromStr for WeightMemory {
    type Err = String;
    fn from_str(s: &str) -> Result<WeightMemory, String> {
        match s {
            "huge_pages" => Ok(WeightMemory::HugePages),
            "mmap" => Ok(WeightMemory::Mapped),
            _ => Err(format!("'{s}': expected huge_pages or mmap")),
        }
    }
}

/// Why a file of `len` bytes is mapped rather than read into 2 MB pages (None: it is read):
/// the kernel offers no transparent huge pages (`offered`: `always` or `madvise`), or the file is
/// more than half the memory available (`available` bytes), where only a mapping lets the kernel
/// page it.
fn why_mapped(len: usize, offered: bool, available: Option<usize>) -> Option<String> {
    if !offered {
        return Some("the kernel offers no transparent huge pages".into());
    }
    match available {
        Some(a) if len > a / 2 => Some(format!(
            "the file ({} MB) is more than half the available memory ({} MB)",
            len >> 20,
            a >> 20
        )),
        _ => None,
    }
}

/// This machine's view for `why_mapped`: transparent huge pages offered, MemAvailable in bytes.
fn machine_memory() -> (bool, Option<usize>) {
    let offered = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false);
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        let kb = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        kb.split_whitespace().nth(1)?.parse::<usize>().ok()
    });
    (offered, available.map(|kb| kb << 10))
}

/// A file's bytes in memory, and how they got there.
pub(super) struct Placed {
    /// The bytes (an empty file's anonymous map has one byte more than `len`).
    pub bytes: Mmap,
    pub len: usize,
    /// Read into 2 MB pages (else mapped).
    pub huge_pages: bool,
    /// Why 2 MB pages were asked for and the file is mapped instead.
    pub why_mapped: Option<String>,
}

/// `file`'s bytes in `memory` (`HugePages` falls back to a mapping where `why_mapped` says so).
pub(super) fn place(file: &mut File, memory: WeightMemory) -> std::io::Result<Placed> {
    let len = file.metadata()?.len() as usize;
    let refused = match memory {
        WeightMemory::HugePages => {
            let (offered, available) = machine_memory();
            why_mapped(len, offered, available)
        }
        WeightMemory::Mapped => None,
    };
    if memory == WeightMemory::HugePages && refused.is_none() {
        let mut m = memmap2::MmapMut::map_anon(len.max(1))?;
        // Before the first touch, so that the pages are 2 MB ones from the start.
        m.advise(memmap2::Advice::HugePage)?;
        std::io::Read::read_exact(file, &mut m[..len])?;
        return Ok(Placed {
            bytes: m.make_read_only()?,
            len,
            huge_pages: true,
            why_mapped: None,
        });
    }
    // SAFETY: the file is opened read-only; we never write through the map. A file changed
    // under us by another process is outside what we can guard against.
    let bytes = unsafe { Mmap::map(&*file) }?;
    Ok(Placed {
        len: bytes.len(),
        bytes,
        huge_pages: false,
        why_mapped: refused,
    })
}

#[cfg(test)]
mod tests {
    use super::why_mapped;

    #[test]
    fn huge_pages_give_way_to_a_mapping_where_they_cannot_serve() {
        assert_eq!(why_mapped(100 << 20, true, Some(24 << 30)), None);
        assert_eq!(why_mapped(100 << 20, true, None), None);
        let off = why_mapped(100 << 20, false, Some(24 << 30)).unwrap();
        assert!(off.contains("no transparent huge pages"), "{off}");
        let big = why_mapped(13 << 30, true, Some(24 << 30)).unwrap();
        assert!(
            big.contains("13312 MB") && big.contains("24576 MB"),
            "{big}"
        );
    }
}
