//! Training: policy-gradient losses as pure functions (`loss`), the optimizer (`optim`). The
//! backward through the frozen quantized base, the trainer loop and the rollout log follow.

pub mod loss;
pub mod optim;
