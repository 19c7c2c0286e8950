//! Serving while learning: the rollout log (`log`), feedback, and the in-process trainer.

pub mod config;
pub mod log;
pub mod trainer;
