//! Tinker training runs (`create_model`): a LoRA adapter on the served base, one per
//! `{session_id}:train:{n}` (the id the SDK computes from its session and its count of training
//! clients), with what the client asked for. What the API knows of a run (its owner, its
//! settings) is here; its adapter, gradient and optimizer are the trainer thread's
//! (`online::runs`), which starts with the first run and keeps each run across restarts
//! (`online::runs::kept`); `restore` brings them back, with their sessions, at the first Tinker
//! call after a start.

use super::super::body::JsonBody;
use super::super::error::{clip, ApiError};
use super::super::openai::{type_error, Fields};
use super::super::state::{bearer_of, blocking, AppState};
use super::{check_type, required_str, string_map};
use crate::adapter::{
    AdapterBase, AdapterConfig, AdapterWeights, LoraConfig, Method, OftConfig, Target,
};
use crate::online::runs::kept::RunMeta;
use crate::train::optim::AdamW;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// LoRA's α for a run: Tinker does not expose it; 32, as Thinking Machines' "LoRA Without Regret"
/// trains with (the scale is α / rank).
pub const LORA_ALPHA: f32 = 32.0;

/// The largest rank a run may ask for.
pub const MAX_RANK: i128 = 256;

/// Training runs held at most.
pub const MAX_RUNS: usize = 64;

/// The runs together hold at most this many times the parameters one adapter may have
/// (`adapters.max_adapter_params`): by default two runs of the largest size, or many small ones.
pub const RUN_PARAMS_FACTOR: usize = 2;

/// What a run was made with (kept with it, as JSON).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// LoRA's rank, or OFT's block size.
    pub rank: usize,
    /// LoRA (else OFT).
    #[serde(default = "yes")]
    pub lora: bool,
    pub seed: u64,
    pub user_metadata: Map<String, Value>,
}

fn yes() -> bool {
    true
}

/// One training run.
pub struct Run {
    /// The hash of the key that made it (`super::key_hash`).
    pub owner: String,
    /// LoRA's rank, or OFT's block size.
    pub rank: usize,
    /// LoRA (else OFT: `is_lora` false, `lora_rank` null, the block size in `oft_block_size`).
    pub lora: bool,
    pub seed: u64,
    pub user_metadata: Map<String, Value>,
    /// The adapter's parameters.
    pub num_params: usize,
    /// When the run was last called (made, or a training or sampling call: Unix seconds, as f64
    /// bits).
    pub last_request: std::sync::atomic::AtomicU64,
}

impl Run {
    /// Run of the key hashed `owner`, made with `info`, of `num_params` parameters, called now.
    pub fn new(owner: String, info: RunInfo, num_params: usize) -> Run {
        Run {
            owner,
            rank: info.rank,
            lora: info.lora,
            seed: info.seed,
            user_metadata: info.user_metadata,
            num_params,
            last_request: crate::util::now_secs().to_bits().into(),
        }
    }

    /// A call on the run arrived now.
    pub fn touch(&self) {
        let now = crate::util::now_secs().to_bits();
        self.last_request
            .store(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// The run as the SDK's `TrainingRun` reads it.
    fn view(&self, id: &str, base_model: &str) -> Value {
        let last = f64::from_bits(self.last_request.load(std::sync::atomic::Ordering::Relaxed));
        json!({
            "training_run_id": id,
            "base_model": base_model,
            "model_owner": self.owner[..16],
            "is_lora": self.lora,
            "corrupted": false,
            "lora_rank": self.lora.then_some(self.rank),
            "oft_block_size": (!self.lora).then_some(self.rank),
            "last_request_time": last,
            "last_checkpoint": null,
            "last_sampler_checkpoint": null,
            "user_metadata": self.user_metadata,
        })
    }
}

/// The runs by id.
#[derive(Default)]
pub struct Runs {
    inner: Mutex<HashMap<String, Arc<Run>>>,
}

impl Runs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Run>>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Run `id` as `key` may see it.
    pub fn get(&self, id: &str, key: &str) -> Option<Arc<Run>> {
        let (g, owner) = (self.lock(), super::key_hash(key));
        g.get(id).filter(|r| r.owner == owner).cloned()
    }

    /// `key`'s runs, by id.
    pub fn of_key(&self, key: &str) -> Vec<(String, Arc<Run>)> {
        let (g, owner) = (self.lock(), super::key_hash(key));
        let mut v: Vec<(String, Arc<Run>)> = g
            .iter()
            .filter(|(_, r)| r.owner == owner)
            .map(|(id, r)| (id.clone(), r.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// The ids of session `session`'s runs (`key`'s), in order.
    pub fn of_session(&self, session: &str, key: &str) -> Vec<String> {
        let prefix = format!("{session}:train:");
        let (g, owner) = (self.lock(), super::key_hash(key));
        let mut ids: Vec<(u64, String)> = g
            .iter()
            .filter(|(id, r)| r.owner == owner && id.starts_with(&prefix))
            .filter_map(|(id, _)| Some((id[prefix.len()..].parse().ok()?, id.clone())))
            .collect();
        ids.sort();
        ids.into_iter().map(|(_, id)| id).collect()
    }

    /// End the runs of the sessions `sessions` (closed): their ids.
    pub fn end_sessions(&self, sessions: &[String]) -> Vec<String> {
        if sessions.is_empty() {
            return Vec::new();
        }
        let mut g = self.lock();
        let mut ended = Vec::new();
        g.retain(|id, _| {
            let session = id.rsplitn(3, ':').nth(2).unwrap_or("");
            let keep = !sessions.iter().any(|s| s == session);
            if !keep {
                ended.push(id.clone());
            }
            keep
        });
        ended
    }

    /// Forget run `id`.
    fn remove(&self, id: &str) {
        let mut g = self.lock();
        g.remove(id);
    }

    /// Add run `id` unless there is one, or the runs would hold more than `max_params`
    /// parameters together or number more than `MAX_RUNS`.
    pub(super) fn add(&self, id: &str, run: Run, max_params: usize) -> Result<(), ApiError> {
        let mut g = self.lock();
        if g.contains_key(id) {
            return Err(ApiError {
                code: Some("training_run_exists"),
                ..ApiError::conflict(
                    "model_seq_id",
                    format!("the session has a training run '{}' already", clip(id)),
                )
            });
        }
        let held: usize = g.values().map(|r| r.num_params).sum();
        let more = run.num_params;
        if g.len() >= MAX_RUNS || held + more > max_params {
            return Err(ApiError {
                code: Some("training_runs_full"),
                ..ApiError::status(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "this server holds {} training runs of {held} parameters; this one's {more} \
                         would pass its bound ({MAX_RUNS} runs, {max_params} parameters): end a \
                         session (its runs end with it) or ask for a smaller rank",
                        g.len()
                    ),
                )
            });
        }
        g.insert(id.to_string(), Arc::new(run));
        Ok(())
    }
}

/// What `lora_config` asks for: rank, seed, and the targets.
struct LoraRequest {
    rank: usize,
    seed: Option<u64>,
    targets: Vec<Target>,
}

/// `lora_config`: `{rank, seed?, train_mlp?, train_attn?, train_unembed?}` (the flags default to
/// true, as the SDK's; `train_unembed` is LoRA on the LM head, `lm_head` in PEFT's names).
fn parse_lora(v: Option<&Value>) -> Result<LoraRequest, ApiError> {
    let o = match v {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "lora_config",
                "'lora_config' is required: this server trains LoRA adapters on its base",
            ))
        }
        Some(Value::Object(o)) => o,
        Some(_) => return Err(type_error("lora_config", "an object")),
    };
    let inner = Value::Object(o.clone());
    let f = Fields::parse(&inner)?;
    let within = |e: ApiError| e.within("lora_config");
    let allowed = ["rank", "seed", "train_mlp", "train_attn", "train_unembed"];
    f.only(&allowed, "lora_config").map_err(within)?;
    let rank = f
        .int_in("rank", 1, MAX_RANK)
        .map_err(within)?
        .ok_or_else(|| ApiError::invalid("lora_config.rank", "'rank' is required"))?;
    let seed = f
        .int_in("seed", 0, u64::MAX as i128)
        .map_err(within)?
        .map(|s| s as u64);
    let flag = |k: &str| f.bool(k).map(|b| b.unwrap_or(true)).map_err(within);
    let (mlp, attn, unembed) = (
        flag("train_mlp")?,
        flag("train_attn")?,
        flag("train_unembed")?,
    );
    let mut targets = Vec::new();
    if attn {
        targets.extend([Target::Q, Target::K, Target::V, Target::O]);
    }
    if mlp {
        targets.extend([Target::Gate, Target::Up, Target::Down]);
    }
    if unembed {
        targets.push(Target::Head);
    }
    if targets.is_empty() {
        return Err(ApiError::invalid(
            "lora_config",
            "at least one of train_attn, train_mlp and train_unembed must be true",
        ));
    }
    Ok(LoraRequest {
        rank: rank as usize,
        seed,
        targets,
    })
}

/// The metadata key that asks for an OFT run (our extension; the SDK sends `user_metadata`
/// unchanged): `"oft"`, with `rank` as OFT's block size; `"lora"` or absent, LoRA.
pub const ADAPTER_KEY: &str = "flywheel.adapter";

/// The run's method: LoRA of `rank`, or OFT in blocks of `rank` when `user_metadata` asks for it
/// (on the projections only: OFT on the LM head is refused, naming `train_unembed`).
fn method_of(user_metadata: &Map<String, Value>, lora: &LoraRequest) -> Result<Method, ApiError> {
    match user_metadata.get(ADAPTER_KEY).and_then(Value::as_str) {
        None | Some("lora") => Ok(Method::Lora(LoraConfig {
            r: lora.rank,
            alpha: LORA_ALPHA,
            use_rslora: false,
        })),
        Some("oft") if lora.targets.contains(&Target::Head) => Err(ApiError::invalid(
            "lora_config.train_unembed",
            "an OFT run rotates the projections' inputs only: pass train_unembed=False",
        )),
        Some("oft") => Ok(Method::Oft(OftConfig {
            block_size: lora.rank,
            ..OftConfig::default()
        })),
        Some(other) => Err(ApiError::invalid(
            &format!("user_metadata.{ADAPTER_KEY}"),
            format!(
                "'{}' is not an adapter method here: \"lora\" or \"oft\"",
                clip(other)
            ),
        )),
    }
}

/// `optimizer_config`: AdamW (`{"type": "adamw"}`, the default) is the one optimizer here.
pub(super) fn check_optimizer(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("adamw") if o.len() == 1 => Ok(()),
            _ => Err(ApiError::invalid(
                "optimizer_config",
                format!(
                    "'optimizer_config' is {}; this server trains with {{\"type\": \"adamw\"}}",
                    Value::Object(o.clone())
                ),
            )),
        },
        Some(_) => Err(type_error("optimizer_config", "an object")),
    }
}

/// `POST /api/v1/create_model`: `{session_id, model_seq_id, base_model, lora_config,
/// user_metadata?, optimizer_config?}` -> a future (`{request_id, model_id}`) whose result is
/// `{"type": "create_model", "model_id"}`.
pub async fn create(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "create_model")?;
    let key = bearer_of(&headers).to_string();
    let session = required_str(&f, "session_id")?;
    let seq = f
        .int_in("model_seq_id", 0, i32::MAX as i128)?
        .ok_or_else(|| ApiError::invalid("model_seq_id", "'model_seq_id' is required"))?;
    super::check_base(ready, required_str(&f, "base_model")?)?;
    let lora = parse_lora(f.get("lora_config"))?;
    check_optimizer(f.get("optimizer_config"))?;
    let user_metadata = string_map(&f, "user_metadata")?;
    let id = format!("{session}:train:{seq}");
    let seed = lora.seed.unwrap_or_else(crate::util::random_u64);
    let config = AdapterConfig {
        method: method_of(&user_metadata, &lora)?,
        targets: lora
            .targets
            .into_iter()
            .filter(|t| ready.model.config.adapter_shape().has(*t))
            .collect(),
        base_model: ready.model_name.clone(),
    };
    let (registry, model) = (ready.registry.clone(), ready.model.clone());
    let weights = blocking(move || {
        let layout = registry
            .limits
            .layout(config, &model.config)
            .map_err(|e| ApiError::invalid("lora_config.rank", format!("'rank': {e}")))?;
        Ok(AdapterWeights::identity(Arc::new(layout), seed))
    })
    .await?;
    let made = NewRun {
        session,
        id: &id,
        key: &key,
        seed,
        user_metadata,
    };
    register(&state, made, weights, None).await?;
    let request_id = state
        .tinker_futures
        .done(&key, json!({"type": "create_model", "model_id": id}));
    Ok(Json(json!({"request_id": request_id, "model_id": id})))
}

/// A run about to be made: its session, id and owner, and what the client asked for.
pub(super) struct NewRun<'a> {
    pub session: &'a str,
    pub id: &'a str,
    pub key: &'a str,
    pub seed: u64,
    pub user_metadata: Map<String, Value>,
}

/// Record run `r` (a LoRA adapter: its rank from `weights`) within the bound and start it on the
/// trainer (started now if it was not) from `weights` and, when given, `opt`.
pub(super) async fn register(
    state: &AppState,
    r: NewRun<'_>,
    weights: AdapterWeights,
    opt: Option<AdamW>,
) -> Result<(), ApiError> {
    let ready = state.ready()?;
    if !ready.online.cfg().role.trains() {
        return Err(ApiError::invalid(
            "base_model",
            "this server is a serving replica (--role serve): training runs are made on the \
             trainer",
        ));
    }
    super::session::close_silent(state, crate::util::now_secs());
    super::session::require(state, r.session, r.key)?;
    let (lora, rank) = match &weights.layout.config.method {
        Method::Lora(l) => (true, l.r),
        Method::Oft(o) => (false, o.block_size),
    };
    let trainer = state.start_trainer().await?;
    let owner = super::key_hash(r.key);
    let info = RunInfo {
        rank,
        lora,
        seed: r.seed,
        user_metadata: r.user_metadata,
    };
    let meta = RunMeta {
        session: r.session.to_string(),
        owner: owner.clone(),
        info: serde_json::to_string(&info).unwrap_or_default(),
    };
    let run = Run::new(owner, info, weights.layout.num_params);
    let max_params = ready.registry.limits.max_params * RUN_PARAMS_FACTOR;
    state.tinker_runs.add(r.id, run, max_params)?;
    if let Err(e) = trainer.start_run(r.id, weights, opt, meta).await {
        state.tinker_runs.remove(r.id);
        return Err(e.into());
    }
    Ok(())
}

/// 404 for a run that is not there (or not the caller's).
pub(super) fn not_found(id: &str) -> ApiError {
    ApiError {
        param: Some("model_id".into()),
        code: Some("training_run_not_found"),
        ..ApiError::not_found(format!("no training run '{}'", clip(id)))
    }
}

/// `POST /api/v1/get_info`: `{model_id}` -> the run's model (architecture, name), optimizer and
/// LoRA rank, as the SDK's `GetInfoResponse`.
pub async fn info(
    State(state): State<AppState>,
    headers: HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let f = Fields::parse(&body)?;
    check_type(&f, "get_info")?;
    let id = required_str(&f, "model_id")?;
    let run = state
        .tinker_runs
        .get(id, bearer_of(&headers))
        .ok_or_else(|| not_found(id))?;
    let arch = ready
        .model
        .gguf
        .get_str("general.architecture")
        .unwrap_or_default();
    Ok(Json(json!({
        "type": "get_info",
        "model_id": id,
        "model_data": {"arch": arch, "model_name": ready.model_name,
                       "tokenizer_id": ready.model_name},
        "optimizer_config": {"type": "adamw"},
        "is_lora": run.lora,
        "lora_rank": run.lora.then_some(run.rank),
        "oft_block_size": (!run.lora).then_some(run.rank),
        "model_name": ready.model_name,
        "user_metadata": run.user_metadata,
        "seed": run.seed,
        "num_parameters": run.num_params,
    })))
}

/// `GET /api/v1/training_runs?limit&offset&access_scope`: the key's runs (in this process), by
/// id: `{training_runs: [TrainingRun], cursor: {offset, limit, total_count}}`.
pub async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    let q = super::check_query(&query, &["limit", "offset"])?;
    let (limit, offset) = (
        q.get("limit").copied().unwrap_or(20),
        q.get("offset").copied().unwrap_or(0),
    );
    let all = state.tinker_runs.of_key(bearer_of(&headers));
    let runs: Vec<Value> = all
        .iter()
        .skip(offset)
        .take(limit)
        .map(|(id, r)| r.view(id, &ready.model_name))
        .collect();
    Ok(Json(json!({
        "training_runs": runs,
        "cursor": {"offset": offset, "limit": limit, "total_count": all.len()},
    })))
}

/// `GET /api/v1/training_runs/{id}?access_scope`: one of the key's runs as a `TrainingRun`.
pub async fn get(
    State(state): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let ready = state.ready()?;
    super::check_query(&query, &[])?;
    let run = state
        .tinker_runs
        .get(&id, bearer_of(&headers))
        .ok_or_else(|| not_found(&id))?;
    Ok(Json(run.view(&id, &ready.model_name)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::{AdapterLimits, BaseShape};

    fn run(key: &str) -> Run {
        let shape = BaseShape {
            num_layers: 1,
            hidden: 8,
            q_dim: 8,
            kv_dim: 4,
            ffn: 16,
            head_dim: 4,
            vocab: 32,
            qk_rows_permuted: false,
        };
        let config = AdapterConfig {
            method: Method::Lora(LoraConfig {
                r: 2,
                alpha: LORA_ALPHA,
                use_rslora: false,
            }),
            targets: vec![Target::Q],
            base_model: "m".into(),
        };
        let layout = AdapterLimits::default().layout(config, &shape).unwrap();
        Run {
            owner: super::super::key_hash(key),
            rank: 2,
            lora: true,
            seed: 1,
            user_metadata: Map::new(),
            num_params: layout.num_params,
            last_request: 0u64.into(),
        }
    }

    /// Runs are listed by session in order, end with their session, and count against the bound.
    #[test]
    fn runs_belong_to_sessions_and_keys_and_are_bounded() {
        let runs = Runs::default();
        let max = usize::MAX;
        for id in [
            "session-a:train:1",
            "session-a:train:0",
            "session-b:train:0",
        ] {
            assert!(runs.add(id, run("k"), max).is_ok());
        }
        assert!(runs.add("session-a:train:0", run("k"), max).is_err());
        assert_eq!(
            runs.of_session("session-a", "k"),
            ["session-a:train:0", "session-a:train:1"]
        );
        assert!(runs.of_session("session-a", "other").is_empty());
        assert!(runs.get("session-b:train:0", "other").is_none());
        let mut ended = runs.end_sessions(&["session-a".to_string()]);
        ended.sort();
        assert_eq!(ended, ["session-a:train:0", "session-a:train:1"]);
        assert!(runs.of_session("session-a", "k").is_empty());
        assert!(runs.get("session-b:train:0", "k").is_some());
        // 32 parameters each (rank 2 on an 8 -> 8 projection): with one held, a second needs 64.
        let r = run("k");
        assert_eq!(r.num_params, 32);
        assert!(runs.add("session-c:train:0", r, 63).is_err());
        assert!(runs.add("session-c:train:0", run("k"), 64).is_ok());
    }
}
