//! Serving while learning. `store` is the rollout store's trait (completions, rewards,
//! episodes, and the record of training: lineages, checkpoints), implemented on SQLite by
//! `store::sqlite` and on PostgreSQL by `store::postgres`; `groups` decides which rewarded groups train
//! (pure); `learner` is one learning adapter in its role (a `Learner` that trains, or a serving
//! replica's `Follower`), `checkpoint` its folders on disk, `adapter_store` their copies in
//! object storage (shared by a trainer and serving replicas); `trainer` is the thread that owns
//! the learners and the `TrainerHandle` the server talks to it with; `start` is the online side
//! as the server holds it (started with the server or on first use); `share_policy` is how the
//! trainer splits the cores with serving (fixed or steered); `runs` are the training runs a client
//! drives itself (the Tinker API), also owned by the trainer thread; `guard` judges a learning
//! adapter's steps and says when to roll back; `eval` scores a version on its evaluation set;
//! `promotion` decides whether a candidate version serves.

pub mod adapter_store;
pub mod checkpoint;
pub mod config;
pub mod eval;
pub mod groups;
pub mod guard;
pub mod learner;
pub mod promotion;
pub mod runs;
pub mod sessions;
pub mod share_policy;
pub mod start;
pub mod store;
pub mod trainer;
