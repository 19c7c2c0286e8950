//! The group former: a pure decision, like the engine's scheduler. Given a learning adapter's
//! pending groups, its current version and lineage, and the clock, it says which groups are
//! ready to train, which members are dropped (and why), and how many groups still wait. No model,
//! no database: unit-tested on values.

use super::store::records::{Member, PendingGroup};
use crate::train::loss::{unit_advantages, LossConfig, LossName};
use std::collections::BTreeMap;

/// The rules a group is judged by (from `[online]`).
#[derive(Clone, Debug)]
pub struct Rules {
    /// Groups with a member sampled more than this many versions ago are dropped.
    pub max_off_policy_steps: u64,
    /// A group with at least two rewards trains after this long, even if incomplete.
    pub group_timeout_secs: f64,
    /// Train on members not drawn from the policy's own distribution.
    pub train_off_policy_samples: bool,
    /// Versions rolled back (inclusive ranges): what they sampled is not trained on.
    pub rolled_back: Vec<(u64, u64)>,
}

/// Why members are not trained on (stored with them and counted in the metrics).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum DropReason {
    /// Sampled with truncation, penalties, a bias or greedily: not the policy's distribution.
    OffPolicySample,
    /// Sampled by an earlier lineage of this name (deleted and re-created since).
    Lineage,
    /// Sampled too many versions ago.
    Stale,
    /// Not rewarded before the group timed out.
    Timeout,
    /// The only rewarded member of its group.
    Single,
    /// Every reward of the group is the same: no signal.
    NoVariance,
    /// Sampled by a version that was rolled back.
    RolledBack,
}

impl DropReason {
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::OffPolicySample => "off_policy_sample",
            DropReason::Lineage => "lineage",
            DropReason::Stale => "stale",
            DropReason::Timeout => "timeout",
            DropReason::Single => "single",
            DropReason::NoVariance => "no_variance",
            DropReason::RolledBack => "rolled_back",
        }
    }
}

/// What to do with the pending groups.
#[derive(Debug, Default)]
pub struct Plan {
    /// Groups to train on, oldest first, each with at least two rewarded members whose
    /// advantages are not all zero.
    pub ready: Vec<PendingGroup>,
    /// Members not to train on, by reason: (id, choice).
    pub dropped: BTreeMap<DropReason, Vec<(String, u32)>>,
    /// Groups still waiting for rewards.
    pub waiting: usize,
}

/// Decide. `current`: the adapter's version now; `first_version`: its lineage's first;
/// `loss`: the loss's name (its advantages decide whether a group carries a signal, the same
/// arithmetic the step uses, so a group is never consumed without being trained on).
pub fn form(
    pending: Vec<PendingGroup>,
    current: u64,
    first_version: u64,
    now: f64,
    rules: &Rules,
    loss: LossName,
) -> Plan {
    let mut plan = Plan::default();
    let key = |m: &Member| (m.id.clone(), m.choice);
    let drop = |plan: &mut Plan, reason: DropReason, members: &[Member]| {
        if !members.is_empty() {
            let d = plan.dropped.entry(reason).or_default();
            d.extend(members.iter().map(key));
        }
    };
    for mut g in pending {
        let (old, members): (Vec<Member>, Vec<Member>) = g
            .members
            .into_iter()
            .partition(|m| m.version < first_version);
        drop(&mut plan, DropReason::Lineage, &old);
        let undone = |v: u64| rules.rolled_back.iter().any(|&(a, b)| a <= v && v <= b);
        // A partial rollout is undone when any version that computed some of it was.
        let (undone, members): (Vec<Member>, Vec<Member>) = members
            .into_iter()
            .partition(|m| undone(m.version) || m.switches.iter().any(|s| undone(s.version)));
        drop(&mut plan, DropReason::RolledBack, &undone);
        g.members = members;
        if !rules.train_off_policy_samples {
            let (ok, off): (Vec<Member>, Vec<Member>) =
                g.members.into_iter().partition(|m| m.policy_sampled);
            drop(&mut plan, DropReason::OffPolicySample, &off);
            g.members = ok;
        }
        if g.members.is_empty() {
            continue;
        }
        // A version above `current` cannot be sampled by this lineage: count it as stale too.
        // (A partial rollout's staleness is its oldest version's, `version`.)
        let stale = g.members.iter().any(|m| {
            let newest = m.switches.last().map_or(m.version, |s| s.version);
            newest > current || current - m.version > rules.max_off_policy_steps
        });
        if stale {
            drop(&mut plan, DropReason::Stale, &g.members);
            continue;
        }
        // An episode's turns count once (a group's units are its episodes and its other
        // completions).
        let num_rewarded = units(g.members.iter().filter(|m| m.reward.is_some()));
        let oldest = g
            .members
            .iter()
            .filter_map(|m| m.rewarded_at)
            .fold(f64::INFINITY, f64::min);
        let timed_out = num_rewarded >= 2 && now - oldest > rules.group_timeout_secs;
        // A request's choices are logged together: all rewarded, the group is whole.
        let whole = num_rewarded == g.members.len() && g.group_size > 0;
        if !(whole || timed_out) {
            plan.waiting += 1;
            continue;
        }
        let (keep, late): (Vec<Member>, Vec<Member>) =
            g.members.into_iter().partition(|m| m.reward.is_some());
        drop(&mut plan, DropReason::Timeout, &late);
        g.members = keep;
        // Distillation's signal is the teacher's, per token: one sample is enough.
        let distill = loss == LossName::Distill;
        if !distill && units(g.members.iter()) < 2 {
            drop(&mut plan, DropReason::Single, &g.members);
            continue;
        }
        if !distill && !has_signal(&g, loss) {
            drop(&mut plan, DropReason::NoVariance, &g.members);
            continue;
        }
        plan.ready.push(g);
    }
    plan
}

/// How many units (episodes, and completions outside any) `members` hold.
fn units<'a>(members: impl Iterator<Item = &'a Member>) -> usize {
    let mut episodes = std::collections::BTreeSet::new();
    let mut others = 0;
    for m in members {
        match &m.episode {
            Some(e) => {
                episodes.insert(e.as_str());
            }
            None => others += 1,
        }
    }
    episodes.len() + others
}

/// Whether the group's advantages, computed as the step computes them (f32 rewards, an
/// episode's turns as one unit), carry a signal.
fn has_signal(g: &PendingGroup, loss: LossName) -> bool {
    let rewards: Vec<f32> = g
        .members
        .iter()
        .map(|m| m.reward.unwrap_or(0.0) as f32)
        .collect();
    let names: Vec<Option<&str>> = g.members.iter().map(|m| m.episode.as_deref()).collect();
    unit_advantages(&names, &rewards, LossConfig::advantage_kind(loss))
        .is_some_and(|a| a.iter().any(|x| *x != 0.0))
}

/// The finish reason of a choice the engine ended in a loop (`engine::repetition`).
pub const REPETITION: &str = "repetition";

/// Kimi k1.5's repetition penalty (`repetition_reward`): members that ended in a loop train with
/// `reward`, whatever was posted for them and whether or not anything was (the server saw the
/// loop); their posted reward stays in the log.
pub fn shape_repetition(pending: &mut [PendingGroup], reward: f64) {
    for m in pending.iter_mut().flat_map(|g| g.members.iter_mut()) {
        if m.finish_reason == REPETITION {
            m.reward = Some(reward);
            m.rewarded_at = m.rewarded_at.or(Some(m.created));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::online::store::records::VersionSpan;

    fn member(id: &str, choice: u32, version: u64, reward: Option<f64>, at: f64) -> Member {
        Member {
            id: id.into(),
            choice,
            version,
            prompt: vec![1],
            completion: vec![2],
            logprobs: vec![-1.0],
            temperature: 1.0,
            policy_sampled: true,
            reward,
            rewarded_at: reward.map(|_| at),
            created: 0.0,
            episode: None,
            forced: Vec::new(),
            finish_reason: "stop".into(),
            sampling: Vec::new(),
            switches: Vec::new(),
        }
    }

    fn group(id: &str, size: u32, members: Vec<Member>) -> PendingGroup {
        PendingGroup {
            group_id: id.into(),
            group_size: size,
            members,
        }
    }

    fn rules() -> Rules {
        Rules {
            rolled_back: Vec::new(),
            max_off_policy_steps: 2,
            group_timeout_secs: 10.0,
            train_off_policy_samples: false,
        }
    }

    /// What rolled-back versions sampled is dropped as such, whatever its rewards; the rest of
    /// its group still trains.
    #[test]
    fn samples_of_rolled_back_versions_are_dropped() {
        let pending = vec![group(
            "a",
            3,
            vec![
                member("a", 0, 5, Some(1.0), 0.0),
                member("a", 1, 5, Some(0.0), 0.0),
                member("a", 2, 4, Some(0.5), 0.0),
            ],
        )];
        let r = Rules {
            rolled_back: vec![(4, 4)],
            ..rules()
        };
        let p = form(pending, 5, 1, 0.0, &r, LossName::Grpo);
        assert_eq!(reasons(&p), [("rolled_back", 1)]);
        assert_eq!(p.ready.len(), 1);
        assert_eq!(p.ready[0].members.len(), 2);
    }

    /// A partial rollout (a generation that moved to newer versions) is as stale as its oldest
    /// version, and undone when any of its versions was rolled back.
    #[test]
    fn a_partial_rollout_counts_from_its_oldest_version() {
        let spans = |m: &mut Member, to: &[u64]| {
            m.switches = to
                .iter()
                .enumerate()
                .map(|(i, &version)| VersionSpan {
                    from_token: i as u32 + 1,
                    version,
                    exact: true,
                })
                .collect();
        };
        let mut moved = member("a", 0, 3, Some(1.0), 0.0);
        spans(&mut moved, &[5]);
        let pending = vec![group(
            "a",
            2,
            vec![moved, member("a", 1, 5, Some(0.0), 0.0)],
        )];
        // Current 6, bound 2: version 3 is three versions back, though the newest is 5.
        let p = form(pending.clone(), 6, 1, 0.0, &rules(), LossName::Grpo);
        assert_eq!(reasons(&p), [("stale", 2)]);
        assert_eq!(
            form(pending, 5, 1, 0.0, &rules(), LossName::Grpo)
                .ready
                .len(),
            1
        );
        let mut moved = member("b", 0, 4, Some(1.0), 0.0);
        spans(&mut moved, &[5, 6]);
        let pending = vec![group(
            "b",
            2,
            vec![moved, member("b", 1, 6, Some(0.0), 0.0)],
        )];
        let r = Rules {
            rolled_back: vec![(5, 5)],
            ..rules()
        };
        let p = form(pending, 6, 1, 0.0, &r, LossName::Grpo);
        // (Its partner, alone, is a single.)
        assert_eq!(reasons(&p), [("single", 1), ("rolled_back", 1)]);
    }

    fn reasons(p: &Plan) -> Vec<(&'static str, usize)> {
        p.dropped
            .iter()
            .map(|(r, m)| (r.as_str(), m.len()))
            .collect()
    }

    #[test]
    fn whole_groups_with_a_signal_are_ready_and_the_rest_wait_or_drop() {
        let pending = vec![
            group(
                "a",
                2,
                vec![
                    member("a", 0, 5, Some(1.0), 0.0),
                    member("a", 1, 5, Some(0.0), 0.0),
                ],
            ),
            // Not all rewarded, not timed out: waits.
            group(
                "b",
                2,
                vec![
                    member("b", 0, 5, Some(1.0), 0.0),
                    member("b", 1, 5, None, 0.0),
                ],
            ),
            // Equal rewards: no signal.
            group(
                "c",
                2,
                vec![
                    member("c", 0, 5, Some(1.0), 0.0),
                    member("c", 1, 5, Some(1.0), 0.0),
                ],
            ),
            // Sampled three versions ago with a bound of 2: stale.
            group(
                "d",
                2,
                vec![
                    member("d", 0, 3, Some(1.0), 0.0),
                    member("d", 1, 5, Some(0.0), 0.0),
                ],
            ),
        ];
        let p = form(pending, 6, 1, 1.0, &rules(), LossName::Grpo);
        assert_eq!(p.ready.len(), 1);
        assert_eq!(p.ready[0].group_id, "a");
        assert_eq!(p.waiting, 1);
        assert_eq!(reasons(&p), vec![("stale", 2), ("no_variance", 2)]);
    }

    #[test]
    fn a_timed_out_group_trains_on_its_rewarded_members() {
        let g = group(
            "a",
            3,
            vec![
                member("a", 0, 5, Some(1.0), 0.0),
                member("a", 1, 5, Some(0.0), 0.0),
                member("a", 2, 5, None, 0.0),
            ],
        );
        assert_eq!(
            form(vec![g.clone()], 5, 1, 5.0, &rules(), LossName::Grpo).waiting,
            1
        );
        let p = form(vec![g], 5, 1, 11.0, &rules(), LossName::Grpo);
        assert_eq!(p.ready[0].members.len(), 2);
        assert_eq!(reasons(&p), vec![("timeout", 1)]);
    }

    #[test]
    fn members_of_an_earlier_lineage_or_off_the_policy_are_dropped() {
        let mut off = member("a", 1, 9, Some(0.0), 0.0);
        off.policy_sampled = false;
        let pending = vec![
            group("a", 2, vec![member("a", 0, 9, Some(1.0), 0.0), off]),
            // Versions 3 and 4 were the lineage before (this one starts at 9).
            group(
                "b",
                2,
                vec![
                    member("b", 0, 3, Some(1.0), 0.0),
                    member("b", 1, 4, Some(0.0), 0.0),
                ],
            ),
        ];
        let p = form(pending, 9, 9, 1.0, &rules(), LossName::Grpo);
        assert!(p.ready.is_empty());
        assert_eq!(
            reasons(&p),
            vec![("off_policy_sample", 1), ("lineage", 2), ("single", 1)]
        );
        assert_eq!(p.waiting, 0);
    }

    #[test]
    fn a_version_newer_than_the_current_one_is_never_trained() {
        let g = group(
            "a",
            2,
            vec![
                member("a", 0, 7, Some(1.0), 0.0),
                member("a", 1, 7, Some(0.0), 0.0),
            ],
        );
        let p = form(vec![g], 5, 1, 1.0, &rules(), LossName::Grpo);
        assert!(p.ready.is_empty());
        assert_eq!(reasons(&p), vec![("stale", 2)]);
    }

    #[test]
    fn rewards_equal_in_f32_carry_no_signal() {
        // Different as f64, equal once rounded to f32 (what the step computes with).
        let (a, b) = (1.0, 1.0 + 1e-12);
        assert_ne!(a, b);
        let g = group(
            "a",
            2,
            vec![
                member("a", 0, 5, Some(a), 0.0),
                member("a", 1, 5, Some(b), 0.0),
            ],
        );
        let p = form(vec![g], 5, 1, 1.0, &rules(), LossName::Grpo);
        assert!(p.ready.is_empty());
        assert_eq!(reasons(&p), vec![("no_variance", 2)]);
    }

    #[test]
    fn episodes_count_once_and_their_turns_train_together() {
        let turn = |id: &str, ep: &str, r: f64| Member {
            episode: Some(ep.into()),
            ..member(id, 0, 5, Some(r), 0.0)
        };
        // Two turns of one episode are one unit: alone, no baseline, so the group waits for
        // another episode however long it takes (two rewarded completions would have trained).
        let one = vec![group(
            "g",
            0,
            vec![turn("a", "e1", 1.0), turn("b", "e1", 0.0)],
        )];
        let p = form(one, 5, 1, 100.0, &rules(), LossName::Grpo);
        assert_eq!((p.ready.len(), p.waiting), (0, 1));
        assert!(p.dropped.is_empty());
        // Two episodes with different rewards (3 turns and 1): all four turns train.
        let two = vec![group(
            "g",
            0,
            vec![
                turn("a", "e1", 1.0),
                turn("b", "e1", 1.0),
                turn("c", "e2", 0.0),
                turn("d", "e1", 1.0),
            ],
        )];
        let p = form(two, 5, 1, 100.0, &rules(), LossName::Grpo);
        assert_eq!(p.ready.len(), 1);
        assert_eq!(p.ready[0].members.len(), 4);
    }

    #[test]
    fn looped_members_take_the_repetition_reward_posted_or_not() {
        let looped = |id: &str, r: Option<f64>| Member {
            finish_reason: REPETITION.into(),
            ..member(id, 0, 5, r, 3.0)
        };
        let mut p = vec![group(
            "g",
            3,
            vec![
                member("a", 0, 5, Some(1.0), 3.0),
                looped("b", Some(1.0)),
                looped("c", None),
            ],
        )];
        shape_repetition(&mut p, -1.0);
        let r: Vec<Option<f64>> = p[0].members.iter().map(|m| m.reward).collect();
        assert_eq!(r, [Some(1.0), Some(-1.0), Some(-1.0)]);
        // The unrewarded one counts as rewarded when it was made (the group is complete now).
        let plan = form(p, 5, 1, 10.0, &rules(), LossName::Grpo);
        assert_eq!(plan.ready.len(), 1);
    }
}
