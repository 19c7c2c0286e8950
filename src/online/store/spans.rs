//! A partial rollout's version spans (`version_policy = "latest"`): which adapter version
//! computed which tokens of a completion, as the rollout log stores them and the trainer reads
//! them (its train = serve check compares only its own version's tokens).

/// From completion token `from_token` on (until the next span), adapter version `version`
/// computed the tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct VersionSpan {
    pub from_token: u32,
    pub version: u64,
    /// Every K/V these tokens attended to was computed by `version` too (the switch recomputed
    /// them): exactly what that version computes for the whole sequence. False after a switch
    /// that kept the older versions' K/V (`version_switch = "keep"`): a mix no single version
    /// computes.
    pub exact: bool,
}

impl VersionSpan {
    /// Spans as stored: (u32 token, u64 version, u8 exact) little-endian, 13 bytes each.
    pub fn encode(spans: &[VersionSpan]) -> Vec<u8> {
        spans
            .iter()
            .flat_map(|s| {
                let mut b = s.from_token.to_le_bytes().to_vec();
                b.extend(s.version.to_le_bytes());
                b.push(s.exact as u8);
                b
            })
            .collect()
    }

    pub fn decode(b: &[u8]) -> Vec<VersionSpan> {
        b.chunks_exact(13)
            .map(|c| VersionSpan {
                from_token: u32::from_le_bytes(c[..4].try_into().expect("4 bytes")),
                version: u64::from_le_bytes(c[4..12].try_into().expect("8 bytes")),
                exact: c[12] != 0,
            })
            .collect()
    }

    /// Each span of a completion of `len` tokens (first version `first`, then `switches`) with
    /// the positions it covers.
    pub fn ranges(
        first: u64,
        switches: &[VersionSpan],
        len: usize,
    ) -> Vec<(VersionSpan, std::ops::Range<usize>)> {
        let all = VersionSpan::all(first, switches);
        let ends = all.iter().skip(1).map(|s| s.from_token as usize);
        all.iter()
            .zip(ends.chain([len]))
            .map(|(s, end)| (*s, (s.from_token as usize).min(len)..end.min(len)))
            .collect()
    }

    /// The positions of a completion of `len` tokens (first version `first`, then `switches`)
    /// that version `v` computed exactly (`exact`).
    pub fn positions_of(
        first: u64,
        switches: &[VersionSpan],
        len: usize,
        v: u64,
    ) -> Vec<std::ops::Range<usize>> {
        VersionSpan::ranges(first, switches, len)
            .into_iter()
            .filter(|(s, r)| s.version == v && s.exact && !r.is_empty())
            .map(|(_, r)| r)
            .collect()
    }

    /// Every span of a completion whose first version is `first` and later ones `switches`.
    pub fn all(first: u64, switches: &[VersionSpan]) -> Vec<VersionSpan> {
        let mut v = vec![VersionSpan {
            from_token: 0,
            version: first,
            exact: true,
        }];
        v.extend_from_slice(switches);
        v
    }
}
