//! The policy's log-probs: log-softmax of the logits at a sampling temperature. The sampler reports
//! them and the trainer recomputes them with this one function, so that the log-probs a completion
//! was served with and those the trainer computes for it are equal to the bit (the train/serve
//! contract).

use flywheel_kernels::Cpu;

/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`): logits / T would overflow
/// f32 for T near 0 (1e-45 makes every log-prob NaN), so such a T means temperature 0.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// Greedy decoding: temperature 0, or below `MIN_TEMPERATURE`.
pub fn is_greedy(temperature: f32) -> bool {
    temperature < MIN_TEMPERATURE
}

/// log-softmax(logits / T) in place, as the sampler reports it (and as a trainer must recompute
/// it); plain log-softmax(logits) when greedy.
pub fn scale_and_normalize(cpu: &Cpu, logits: &mut [f32], temperature: f32) {
    if !is_greedy(temperature) && temperature != 1.0 {
        let inv = 1.0 / temperature;
        logits.iter_mut().for_each(|v| *v *= inv);
    }
    cpu.log_softmax(logits);
}

/// `scale_and_normalize` with the log-sum-exp `lse` of logits / T that a device's log-softmax
/// subtracted (the GPU's draw: `Gpu::normalize`), each log-prob logit·(1/T) − lse rounded as the
/// device rounds it (`reference::log_softmax_with`), so that a row the host samples gets the
/// device's log-probs bit for bit (and a trainer scoring on that device the same ones).
pub fn normalize_with(logits: &mut [f32], temperature: f32, lse: f32) {
    let inv = match !is_greedy(temperature) && temperature != 1.0 {
        true => 1.0 / temperature,
        false => 1.0,
    };
    flywheel_kernels::reference::log_softmax_with(logits, inv, lse);
}
