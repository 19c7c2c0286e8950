//! Episodes in the rollout log (a multi-turn task rewarded once): each turn is a completion
//! tagged with the client's episode, scoped to its key; `episode_rewards` holds each episode's
//! reward, which every turn takes (turns logged later too, by `log_completions`).

use super::*;

impl SqliteLog {
    /// An episode as stored: the client's name scoped to the key that made it.
    pub(super) fn episode_key(&self, key_hash: &str, episode: &str) -> String {
        crate::online::store::records::episode_key(key_hash, episode)
    }

    /// Reward episode `episode` of `key` (every turn, and any turn logged later): Ok(true) when
    /// new, Ok(false) when it repeats the stored reward; one transaction.
    pub fn post_episode_reward(
        &self,
        episode: &str,
        reward: f64,
        key: &str,
        accepts: &Accepting,
    ) -> Result<bool, FeedbackError> {
        let ep = self.episode_key(&self.key_hash(key), episode);
        let mut c = self.conn()?;
        let tx = c.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let adapters: Vec<String> = {
            let mut st = tx.prepare_cached(
                "SELECT DISTINCT adapter FROM completions WHERE episode = ?1 ORDER BY adapter",
            )?;
            let rows = st.query_map(params![ep], |r| r.get(0))?;
            rows.collect::<Result<_, _>>()?
        };
        let old: Option<f64> = tx
            .query_row(
                "SELECT reward FROM episode_rewards WHERE episode = ?1",
                params![ep],
                |r| r.get(0),
            )
            .optional()?;
        if !judge_episode_reward(episode, reward, adapters, old, accepts)? {
            return Ok(false);
        }
        let now = now_secs();
        tx.execute(
            "INSERT INTO episode_rewards (episode, reward, rewarded_at) VALUES (?1, ?2, ?3)",
            params![ep, reward, now],
        )?;
        tx.execute(
            "UPDATE completions SET reward = ?2, rewarded_at = ?3
             WHERE episode = ?1 AND reward IS NULL",
            params![ep, reward, now],
        )?;
        tx.commit()?;
        Ok(true)
    }

    /// The last turn logged of episode `episode` of `key`: its prompt and completion token ids.
    pub fn last_turn(&self, episode: &str, key: &str) -> Result<Option<Turn>, LogError> {
        let ep = self.episode_key(&self.key_hash(key), episode);
        let c = self.conn()?;
        Ok(c.query_row(
            "SELECT prompt, completion FROM completions WHERE episode = ?1
             ORDER BY created DESC, id DESC, choice DESC LIMIT 1",
            params![ep],
            |r| {
                Ok((
                    u32s(&r.get::<_, Vec<u8>>(0)?),
                    u32s(&r.get::<_, Vec<u8>>(1)?),
                ))
            },
        )
        .optional()?)
    }

    /// The turns of episode `episode` of `key`: (completion id, what is stored for it), in the
    /// order they were logged, and the episode's reward (None: not rewarded yet).
    pub fn episode_feedback(&self, episode: &str, key: &str) -> Result<EpisodeFeedback, LogError> {
        let ep = self.episode_key(&self.key_hash(key), episode);
        let c = self.conn()?;
        let mut st = c.prepare_cached(&format!(
            "SELECT id, {CHOICE_INFO} FROM completions WHERE episode = ?1
             ORDER BY created, id, choice"
        ))?;
        let rows = st.query_map(params![ep], |r| {
            Ok((r.get::<_, String>(0)?, choice_info(r, 1)?))
        })?;
        let turns = rows.collect::<Result<_, _>>()?;
        let reward = c
            .query_row(
                "SELECT reward FROM episode_rewards WHERE episode = ?1",
                params![ep],
                |r| r.get(0),
            )
            .optional()?;
        Ok((turns, reward))
    }
}
