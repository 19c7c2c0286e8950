//! Serving while learning: the rollout log (`log`), feedback, and the in-process trainer.

pub mod log;
