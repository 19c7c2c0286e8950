//! Serving while learning. `log` is the rollout log (completions, rewards) and `lineage` its
//! record of training (lineages, checkpoints); `groups` decides which rewarded groups train
//! (pure); `learner` is one learning adapter and its step, `checkpoint` its folders on disk; `trainer` is the thread that owns the
//! learners and the `TrainerHandle` the server talks to it with.

pub mod checkpoint;
pub mod config;
pub mod groups;
pub mod learner;
pub mod lineage;
pub mod log;
pub mod trainer;
