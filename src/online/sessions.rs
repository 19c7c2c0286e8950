//! Agent sessions, pure: an agent framework that never sends our `episode` field (the OpenAI
//! Agents SDK, LangGraph, ...) gets a session key from `POST /v1/sessions`; every call made with
//! it is a turn of the session's episode, rewarded at its end. Here: what a session is, how its
//! rewards become each turn's return, and when an idle one ends. The routes are `api::sessions`,
//! the rows the rollout store's (`agent_sessions`).

/// The prefix of every session key (what the auth layer looks up).
pub const KEY_PREFIX: &str = "fws_";

/// The prefix of every session id.
pub const ID_PREFIX: &str = "sess_";

/// The group of sessions created without one: the owner's other such sessions are their
/// baseline.
pub const DEFAULT_GROUP: &str = "sessions";

/// What a session's turns are logged under in place of a client's key: no HTTP header can carry
/// a NUL byte, so no client can send a turn as it, and ownership is the session's own check.
pub fn principal(id: &str) -> String {
    format!("\0session:{id}")
}

/// A session as created (and stored).
#[derive(Clone, Debug, PartialEq)]
pub struct AgentSession {
    pub id: String,
    /// The session key's stored form (a salted hash).
    pub key_hash: String,
    /// Who created it (the creator's key hash): they reward it, read it and end it.
    pub owner: String,
    /// The learning adapter its turns run on.
    pub adapter: String,
    /// The group its episode is compared in, scoped to the owner (sessions created without one
    /// share `DEFAULT_GROUP`).
    pub group: String,
    /// The turn discount γ of its returns.
    pub gamma: f64,
    pub max_turns: Option<u32>,
    /// Ended this long after its last turn (or its creation).
    pub idle_secs: f64,
    /// The final reward an idle session takes (None: its turns are dropped).
    pub idle_reward: Option<f64>,
    pub created: f64,
    pub state: SessionState,
    /// The turns' returns, once rewarded.
    pub returns: Option<Vec<f64>>,
    /// Its turns' `episode` in the completions table (the store's own encoding).
    pub episode: String,
}

/// Where a session is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionState {
    /// Taking turns.
    Open,
    /// Rewarded (by its owner, or by its idle reward): its turns train.
    Rewarded,
    /// Ended without a reward (by its owner, or idle): its turns are dropped.
    Ended,
}

impl SessionState {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Open => "open",
            SessionState::Rewarded => "rewarded",
            SessionState::Ended => "ended",
        }
    }

    pub fn parse(s: &str) -> SessionState {
        match s {
            "open" => SessionState::Open,
            "rewarded" => SessionState::Rewarded,
            _ => SessionState::Ended,
        }
    }
}

/// A session as read now: the row, its turns logged and its last activity (Unix seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct SessionView {
    pub session: AgentSession,
    pub turns: u32,
    pub last_active: f64,
}

impl SessionView {
    /// Idle past its timeout at `now`.
    pub fn idle(&self, now: f64) -> bool {
        self.session.state == SessionState::Open && now - self.last_active >= self.session.idle_secs
    }
}

/// How a session is rewarded.
#[derive(Clone, Debug, PartialEq)]
pub enum SessionReward {
    /// One reward at the end: the last turn's.
    Final(f64),
    /// One reward per turn, in order.
    PerTurn(Vec<f64>),
}

/// Each turn's return G_t = Σ_{k ≥ t} γ^(k−t) r_k over the turns' rewards r (a final reward R:
/// r = (0, …, 0, R), so G_t = γ^(T−t) R; with γ = 1 every turn takes R, as an episode's turns
/// do). Err: per-turn rewards whose count is not the turns'.
pub fn returns(reward: &SessionReward, turns: usize, gamma: f64) -> Result<Vec<f64>, String> {
    let r: Vec<f64> = match reward {
        SessionReward::Final(x) => {
            let mut r = vec![0.0; turns];
            if let Some(last) = r.last_mut() {
                *last = *x;
            }
            r
        }
        SessionReward::PerTurn(v) if v.len() == turns => v.clone(),
        SessionReward::PerTurn(v) => {
            return Err(format!(
                "'rewards' has {} values; the session has {turns} turns",
                v.len()
            ))
        }
    };
    let mut g = vec![0.0; turns];
    let mut acc = 0.0;
    for t in (0..turns).rev() {
        acc = r[t] + gamma * acc;
        g[t] = acc;
    }
    Ok(g)
}

/// Returns as stored (f64 little-endian: read back exactly, so a repeat compares equal).
pub fn returns_bytes(g: &[f64]) -> Vec<u8> {
    g.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn returns_of(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

/// Why a session's reward is refused.
#[derive(Clone, Debug, PartialEq)]
pub enum SessionRefusal {
    NotFound,
    /// Ended without a reward (by its owner or idle): its turns were dropped.
    Ended,
    /// Rewarded already, with other returns.
    Conflict,
    /// Rewards that do not fit its turns.
    Rewards(String),
}

impl std::fmt::Display for SessionRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionRefusal::NotFound => write!(f, "no such session of this key"),
            SessionRefusal::Ended => write!(f, "it ended without a reward; its turns were dropped"),
            SessionRefusal::Conflict => write!(f, "it was rewarded already, with other rewards"),
            SessionRefusal::Rewards(why) => write!(f, "{why}"),
        }
    }
}

/// What every store decides for reward `reward` of session `s` with `turns` turns logged:
/// Ok(Some(returns)) to record, Ok(None) a repeat of the returns recorded.
pub fn judge_reward(
    s: &AgentSession,
    reward: &SessionReward,
    turns: usize,
) -> Result<Option<Vec<f64>>, SessionRefusal> {
    match (s.state, &s.returns) {
        (SessionState::Open, _) => returns(reward, turns, s.gamma)
            .map(Some)
            .map_err(SessionRefusal::Rewards),
        (SessionState::Rewarded, Some(old)) => match returns(reward, old.len(), s.gamma) {
            Ok(g) if &g == old => Ok(None),
            _ => Err(SessionRefusal::Conflict),
        },
        _ => Err(SessionRefusal::Ended),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_discount_later_rewards_and_a_final_reward_reaches_every_turn() {
        let g = returns(&SessionReward::PerTurn(vec![1.0, 0.0, 2.0]), 3, 0.5).unwrap();
        assert_eq!(g, vec![1.0 + 0.5 * 0.0 + 0.25 * 2.0, 1.0, 2.0]);
        assert_eq!(
            returns(&SessionReward::Final(3.0), 3, 1.0).unwrap(),
            vec![3.0; 3]
        );
        assert_eq!(
            returns(&SessionReward::Final(4.0), 3, 0.5).unwrap(),
            vec![1.0, 2.0, 4.0]
        );
        assert_eq!(
            returns(&SessionReward::Final(4.0), 0, 0.5).unwrap(),
            Vec::<f64>::new()
        );
        let e = returns(&SessionReward::PerTurn(vec![1.0]), 2, 1.0).unwrap_err();
        assert!(e.contains("1 values") && e.contains("2 turns"), "{e}");
    }

    #[test]
    fn idle_counts_from_the_last_activity_and_rewards_are_judged_once() {
        let s = AgentSession {
            id: "sess_x".into(),
            key_hash: "h".into(),
            owner: "o".into(),
            adapter: "a".into(),
            group: DEFAULT_GROUP.into(),
            gamma: 1.0,
            max_turns: None,
            idle_secs: 10.0,
            idle_reward: None,
            created: 100.0,
            state: SessionState::Open,
            returns: None,
            episode: "e".into(),
        };
        let mut v = SessionView {
            session: s,
            turns: 1,
            last_active: 105.0,
        };
        assert!(!v.idle(114.0));
        assert!(v.idle(115.0));
        // Rewarded: a repeat is a no-op, other rewards a conflict; ended: refused.
        let g = judge_reward(&v.session, &SessionReward::Final(2.0), 2).unwrap();
        assert_eq!(g, Some(vec![2.0, 2.0]));
        v.session.state = SessionState::Rewarded;
        v.session.returns = g;
        assert!(!v.idle(1000.0));
        // (A turn logged since does not change what the reward meant.)
        assert_eq!(
            judge_reward(&v.session, &SessionReward::Final(2.0), 3),
            Ok(None)
        );
        assert_eq!(
            judge_reward(&v.session, &SessionReward::PerTurn(vec![0.0, 2.0]), 2),
            Ok(None)
        );
        assert_eq!(
            judge_reward(&v.session, &SessionReward::Final(1.0), 2),
            Err(SessionRefusal::Conflict)
        );
        v.session.state = SessionState::Ended;
        assert_eq!(
            judge_reward(&v.session, &SessionReward::Final(2.0), 2),
            Err(SessionRefusal::Ended)
        );
    }
}
