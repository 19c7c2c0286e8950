//! Every Prometheus metric in one place (prefix `flywheel_`, base units). Names follow vLLM's so
//! existing dashboards carry over.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
    pub num_requests_running: IntGauge,
    pub num_requests_waiting: IntGauge,
    pub kv_blocks_used: IntGauge,
    pub kv_blocks_total: IntGauge,
    /// The sliding-window layers' own pool (0 without one).
    pub kv_window_blocks_used: IntGauge,
    pub kv_window_blocks_total: IntGauge,
    pub kv_cache_usage_perc: prometheus::Gauge,
    pub prefix_cache_queries: IntCounter,
    pub prefix_cache_hits: IntCounter,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub request_success: IntCounterVec,
    pub num_preemptions: IntCounter,
    pub version_switches: IntCounter,
    pub version_switch_tokens: IntCounter,
    pub http_requests: IntCounterVec,
    pub adapter_version: IntGaugeVec,
    pub adapter_versions_alive: IntGauge,
    pub adapter_publishes: IntCounter,
    pub adapter_publish_seconds: Histogram,
    pub adapter_requests: IntCounterVec,
    pub adapter_generation_tokens: IntCounterVec,
    pub train_steps: IntCounterVec,
    pub train_step_seconds: HistogramVec,
    pub train_tokens: IntCounterVec,
    pub train_tokens_per_second: GaugeVec,
    /// Compute time by role (serve: engine steps; train: the trainer's kernels), from the pool's
    /// gate, set at scrape time.
    pub compute_busy_seconds: prometheus::CounterVec,
    /// The share in force (`online::share_policy`): training time granted per unit of serving
    /// time under load; with the policy's measurements of the last period and minute.
    pub train_share: prometheus::Gauge,
    pub train_itl_stretch: prometheus::Gauge,
    pub train_steps_per_minute: prometheus::Gauge,
    /// Completions trained on (beside `train_samples_dropped_total`).
    pub train_samples_trained: IntCounterVec,
    pub train_loss: GaugeVec,
    pub train_reward_mean: GaugeVec,
    pub train_reward_std: GaugeVec,
    pub train_kl: GaugeVec,
    pub train_clip_fraction: GaugeVec,
    pub train_masked_fraction: GaugeVec,
    pub train_grad_norm: GaugeVec,
    pub train_logprob_diff: GaugeVec,
    pub train_staleness: HistogramVec,
    pub train_groups_dropped: IntCounterVec,
    /// Decisions about learning adapters' versions (rollbacks, resumes), by reason.
    pub promotion_decisions: IntCounterVec,
    /// Evaluation scores of a learning adapter's versions: the one serving and the last candidate.
    pub eval_score: GaugeVec,
    pub eval_seconds: HistogramVec,
    pub train_pending_groups: IntGaugeVec,
    pub train_errors: IntCounterVec,
    /// 1 while the learner trains or may (running or paused), 0 once it has failed.
    pub train_learner_ok: IntGaugeVec,
    /// 1 while the rollout log's database is usable, 0 once it is not.
    pub rollout_log_ok: IntGauge,
    pub feedback_rewards: IntCounterVec,
    pub rollouts_logged: IntCounterVec,
    /// A serving replica: versions it is behind the trainer's newest checkpoint.
    pub replica_version_lag: IntGaugeVec,
    /// A serving replica: from the trainer's commit of a step to this replica serving it.
    pub replica_propagation_seconds: Histogram,
    /// Transfers of adapter versions to and from the adapter store (op: upload, fetch).
    pub adapter_store_seconds: HistogramVec,
}

fn buckets_seconds() -> Vec<f64> {
    vec![
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
    ]
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new_custom(Some("flywheel".into()), None).expect("registry");
        fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
            r.register(Box::new(m.clone())).expect("unique metric");
            m
        }
        let hist = |name: &str, help: &str| {
            reg(
                &registry,
                Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets_seconds()))
                    .expect("histogram"),
            )
        };
        let gauge =
            |name: &str, help: &str| reg(&registry, IntGauge::new(name, help).expect("gauge"));
        let counter =
            |name: &str, help: &str| reg(&registry, IntCounter::new(name, help).expect("counter"));
        let gauge_vec = |name: &str, help: &str| {
            reg(
                &registry,
                GaugeVec::new(Opts::new(name, help), &["adapter"]).expect("gauge vec"),
            )
        };
        Metrics {
            time_to_first_token: hist(
                "time_to_first_token_seconds",
                "From arrival to the first generated token.",
            ),
            inter_token_latency: hist(
                "inter_token_latency_seconds",
                "Between consecutive tokens of one sequence.",
            ),
            e2e_request_latency: hist(
                "e2e_request_latency_seconds",
                "From arrival to the last token of the request.",
            ),
            request_queue_time: hist(
                "request_queue_time_seconds",
                "From arrival to the first scheduled forward pass.",
            ),
            num_requests_running: gauge("num_requests_running", "Sequences in the running batch."),
            num_requests_waiting: gauge("num_requests_waiting", "Sequences waiting to run."),
            kv_blocks_used: gauge("kv_cache_blocks_used", "KV cache blocks in use."),
            kv_blocks_total: gauge("kv_cache_blocks", "KV cache blocks in all (used or free)."),
            kv_window_blocks_used: gauge(
                "kv_cache_window_blocks_used",
                "Blocks in use of the sliding-window layers' own KV pool.",
            ),
            kv_window_blocks_total: gauge(
                "kv_cache_window_blocks",
                "Blocks of the sliding-window layers' own KV pool (0: none).",
            ),
            kv_cache_usage_perc: reg(
                &registry,
                prometheus::Gauge::new("kv_cache_usage_perc", "KV cache use, 0 to 1.")
                    .expect("gauge"),
            ),
            prefix_cache_queries: counter(
                "prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache.",
            ),
            prefix_cache_hits: counter(
                "prefix_cache_hits_total",
                "Prompt tokens found in the prefix cache.",
            ),
            prompt_tokens: counter("prompt_tokens_total", "Prompt tokens received."),
            generation_tokens: counter("generation_tokens_total", "Tokens generated."),
            request_success: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("request_success_total", "Finished sequences by reason."),
                    &["finished_reason"],
                )
                .expect("counter vec"),
            ),
            num_preemptions: counter(
                "num_preemptions_total",
                "Sequences whose KV cache was dropped to be recomputed.",
            ),
            version_switches: counter(
                "version_switches_total",
                "Sequences moved to a newly published adapter version while generating \
                 (version_policy \"latest\").",
            ),
            version_switch_tokens: counter(
                "version_switch_recomputed_tokens_total",
                "Tokens whose K/V a version switch dropped, to be recomputed under the new \
                 version.",
            ),
            http_requests: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "http_requests_total",
                        "API requests by route and status (probes of /health and /metrics are \
                         not counted: /health answers 503 while the model loads).",
                    ),
                    &["route", "status"],
                )
                .expect("counter vec"),
            ),
            adapter_version: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new("adapter_version", "Current version of each adapter."),
                    &["adapter"],
                )
                .expect("gauge vec"),
            ),
            adapter_versions_alive: gauge(
                "adapter_versions_alive",
                "Adapter versions held in memory (current ones and those pinned by running requests).",
            ),
            adapter_publishes: counter("adapter_publishes_total", "Adapter versions published."),
            adapter_publish_seconds: reg(
                &registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "adapter_publish_seconds",
                        "From a built adapter version to its atomic swap into the slot.",
                    )
                    .buckets(vec![1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0]),
                )
                .expect("histogram"),
            ),
            adapter_requests: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("adapter_requests_total", "Requests by adapter ('' for the base)."),
                    &["adapter"],
                )
                .expect("counter vec"),
            ),
            adapter_generation_tokens: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "adapter_generation_tokens_total",
                        "Tokens generated by adapter ('' for the base).",
                    ),
                    &["adapter"],
                )
                .expect("counter vec"),
            ),
            train_steps: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("train_steps_total", "Training steps published as versions."),
                    &["adapter"],
                )
                .expect("counter vec"),
            ),
            train_step_seconds: reg(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new("train_step_seconds", "Forward, backward and AdamW of a step.")
                        .buckets(buckets_seconds()),
                    &["adapter"],
                )
                .expect("histogram vec"),
            ),
            train_tokens: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("train_tokens_total", "Completion tokens trained on."),
                    &["adapter"],
                )
                .expect("counter vec"),
            ),
            compute_busy_seconds: reg(
                &registry,
                prometheus::CounterVec::new(
                    Opts::new(
                        "compute_busy_seconds_total",
                        "Compute time since start by role: serve (engine steps) and train (the trainer's kernels); rate() of each is its share of the cores.",
                    ),
                    &["role"],
                )
                .expect("counter vec"),
            ),
            train_share: reg(
                &registry,
                prometheus::Gauge::with_opts(Opts::new(
                    "train_share",
                    "The training share in force (fixed or steered by the policy): training time granted per unit of serving time while serving is busy.",
                ))
                .expect("gauge"),
            ),
            train_itl_stretch: reg(
                &registry,
                prometheus::Gauge::with_opts(Opts::new(
                    "train_itl_stretch",
                    "Serving's steps with their waits for training over the same steps without them, last policy period (1 while serving is idle).",
                ))
                .expect("gauge"),
            ),
            train_steps_per_minute: reg(
                &registry,
                prometheus::Gauge::with_opts(Opts::new(
                    "train_steps_per_minute",
                    "Training steps per minute over the last minute (all learners).",
                ))
                .expect("gauge"),
            ),
            train_samples_trained: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("train_samples_trained_total", "Completions trained on."),
                    &["adapter"],
                )
                .expect("counter vec"),
            ),
            train_tokens_per_second: gauge_vec(
                "train_tokens_per_second",
                "Sequence tokens per second of the last step.",
            ),
            train_loss: gauge_vec("train_loss", "Loss of the last step."),
            train_reward_mean: gauge_vec("train_reward_mean", "Mean reward of the last step's samples."),
            train_reward_std: gauge_vec("train_reward_std", "Reward standard deviation of the last step's samples."),
            train_kl: gauge_vec("train_kl", "k3 KL to the base (adapter off) of the last step (0 unless kl_coef > 0)."),
            train_clip_fraction: gauge_vec("train_clip_fraction", "Clipped tokens of the last step."),
            train_masked_fraction: gauge_vec("train_masked_fraction", "Masked tokens of the last step."),
            train_grad_norm: gauge_vec("train_grad_norm", "Global gradient norm of the last step (before clipping)."),
            train_logprob_diff: gauge_vec(
                "train_logprob_diff",
                "Largest |training − sampling| log-prob over the last step's tokens sampled by the trained version (expected 0).",
            ),
            train_staleness: reg(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "train_staleness_versions",
                        "Versions between a sample's policy and the one it trained.",
                    )
                    .buckets(vec![0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0]),
                    &["adapter"],
                )
                .expect("histogram vec"),
            ),
            promotion_decisions: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "promotion_decisions_total",
                        "Decisions about a learning adapter's versions: rollback (by a guard: reward_drop, kl, entropy; or manual), resume, promote and hold (reason eval: the gate), pin and unpin.",
                    ),
                    &["adapter", "decision", "reason"],
                )
                .unwrap(),
            ),
            eval_score: reg(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "eval_score",
                        "A learning adapter's evaluation score in [0, 1]: of the version serving (which=\"served\") and of the last candidate (which=\"candidate\").",
                    ),
                    &["adapter", "which"],
                )
                .expect("gauge vec"),
            ),
            eval_seconds: reg(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new("eval_seconds", "Evaluating one version on its adapter's evaluation set.")
                        .buckets(buckets_seconds()),
                    &["adapter"],
                )
                .expect("histogram vec"),
            ),
            train_groups_dropped: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "train_samples_dropped_total",
                        "Completions not trained on, by reason (stale, no_variance, single, timeout, off_policy_sample, lineage, rolled_back).",
                    ),
                    &["adapter", "reason"],
                )
                .expect("counter vec"),
            ),
            train_pending_groups: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new("train_pending_groups", "Groups with rewards waiting to train."),
                    &["adapter"],
                )
                .expect("gauge vec"),
            ),
            train_errors: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "train_errors_total",
                        "Trainer errors, by kind: database, checkpoint, step, publish, panic, \
                         start.",
                    ),
                    &["adapter", "kind"],
                )
                .expect("counter vec"),
            ),
            train_learner_ok: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "train_learner_ok",
                        "1 while a learning adapter trains (or is paused), 0 once it has failed.",
                    ),
                    &["adapter"],
                )
                .expect("gauge vec"),
            ),
            rollout_log_ok: gauge(
                "rollout_log_ok",
                "1 while the rollout log's database is usable, 0 once it is not.",
            ),
            feedback_rewards: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("feedback_rewards_total", "Rewards posted, by outcome (new, repeat)."),
                    &["outcome"],
                )
                .expect("counter vec"),
            ),
            rollouts_logged: reg(
                &registry,
                IntCounterVec::new(
                    Opts::new("rollouts_logged_total", "Completions written to the rollout log."),
                    &["adapter"],
                )
                .expect("counter vec"),
            ),
            replica_version_lag: reg(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "replica_version_lag",
                        "A serving replica (--role serve): versions it is behind the trainer's \
                         newest checkpoint (0 once it serves it).",
                    ),
                    &["adapter"],
                )
                .expect("gauge vec"),
            ),
            replica_propagation_seconds: hist(
                "replica_propagation_seconds",
                "A serving replica: from the trainer's commit of a step to this replica \
                 serving its version (the two machines' clocks apart included).",
            ),
            adapter_store_seconds: reg(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "adapter_store_seconds",
                        "Adapter versions moved to (upload, by the trainer) and from (fetch, by a \
                         replica) the adapter store (--adapter-store).",
                    )
                    .buckets(buckets_seconds()),
                    &["op"],
                )
                .expect("histogram vec"),
            ),
            registry,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding");
        String::from_utf8(buf).expect("utf-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
