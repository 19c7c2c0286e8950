//! Adapter routes: `GET /v1/adapters`, `GET /v1/adapters/{name}` (API key); `POST /v1/adapters`
//! (load a PEFT folder or create an identity adapter; an existing name gets a new version),
//! `POST /v1/adapters/{name}/export`, `DELETE /v1/adapters/{name}`, and vLLM's
//! `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (admin key). Loading and building
//! run on the blocking pool, never on the engine thread; publishing is one atomic swap.

use super::body::JsonBody;
use super::error::ApiError;
use super::openai::Fields;
use super::state::{blocking, AppState, Ready};
use crate::adapter::registry::{RegistryError, Slot};
use crate::adapter::{
    peft, AdapterBase, AdapterConfig, AdapterError, AdapterWeights, LoraConfig, Method, OftConfig,
    Target,
};
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;

/// What clients see of an adapter (the list shows the same without `versions`).
fn info(r: &Ready, slot: &Slot, detail: bool) -> Value {
    let cur = slot.current();
    let layout = &cur.weights.layout;
    let mut v = json!({
        "id": slot.name.as_ref(),
        "object": "adapter",
        "created": slot.created,
        "kind": layout.config.method.kind(),
        "version": cur.version,
        "parent_version": cur.parent,
        "version_created": cur.created,
        "base_model": r.model_name,
        "targets": layout.config.targets.iter().map(|t| t.peft_name()).collect::<Vec<_>>(),
        "num_parameters": layout.num_params,
        "config": peft::config_json(&layout.config),
        "canary": slot.canary().map(|(v, f)| json!({"version": v, "fraction": f})),
    });
    if detail {
        v["versions"] = slot
            .versions_alive()
            .iter()
            .map(|a| {
                json!({
                    "version": a.version,
                    "parent_version": a.parent,
                    "created": a.created,
                    "current": a.version == cur.version,
                    "requests_in_flight": a.num_in_flight(),
                })
            })
            .collect();
    }
    v
}

pub async fn list(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let r = state.ready()?;
    let data: Vec<Value> = r
        .registry
        .list()
        .iter()
        .map(|s| info(r, s, false))
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

pub async fn show(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let r = state.ready()?;
    let slot = r
        .registry
        .get(&name)
        .ok_or_else(|| adapter_not_found(&name))?;
    Ok(Json(info(r, &slot, true)))
}

fn adapter_not_found(name: &str) -> ApiError {
    ApiError {
        code: Some("adapter_not_found"),
        ..ApiError::not_found(format!("the adapter '{name}' does not exist"))
    }
}

fn adapter_error(param: &str, e: AdapterError) -> ApiError {
    ApiError::invalid(param, format!("invalid adapter: {e}"))
}

/// A new adapter's settings refused: the request field the error is about.
fn new_adapter_error(e: AdapterError) -> ApiError {
    let param = match &e {
        AdapterError::Config { key, .. } if key == "num_parameters" => "r",
        AdapterError::Config { key, .. } if key == "target_modules" => "targets",
        AdapterError::Config { key, .. } if key == "oft_block_size" || key == "r" => key.as_str(),
        _ => "kind",
    }
    .to_string();
    ApiError::invalid(&param, format!("invalid adapter: {e}"))
}

fn registry_error(e: RegistryError) -> ApiError {
    match e {
        RegistryError::BadName(..) => ApiError::invalid("name", e.to_string()),
        RegistryError::Adapter(a) => adapter_error("path", a),
        RegistryError::Learning(_) | RegistryError::Gone(_) => ApiError {
            code: Some("adapter_is_learning"),
            ..ApiError::conflict("name", e.to_string())
        },
    }
}

/// How to make the new version: from a PEFT folder, or a fresh identity adapter.
enum Source {
    Path(PathBuf),
    New(AdapterConfig, u64),
}

/// Build off the engine thread, then publish; 201 for a new name, 200 for a new version.
async fn build_and_publish(
    state: &AppState,
    name: String,
    source: Source,
    name_param: &'static str,
) -> Result<(StatusCode, Value), ApiError> {
    let r = state.ready()?;
    r.registry
        .check_name(&name)
        .map_err(|e| ApiError::invalid(name_param, e.to_string()))?;
    if r.registry.get(&name).is_some_and(|s| s.owner().is_some()) {
        return Err(registry_error(RegistryError::Learning(name)));
    }
    let (reg, model) = (r.registry.clone(), r.model.clone());
    let name2 = name.clone();
    let is_new = blocking(move || {
        let weights = match source {
            Source::Path(p) => peft::load_within(&p, &model.config, &reg.limits)
                .map_err(|e| adapter_error("path", e))?,
            Source::New(cfg, seed) => {
                let layout = reg
                    .limits
                    .layout(cfg, &model.config)
                    .map_err(new_adapter_error)?;
                AdapterWeights::identity(Arc::new(layout), seed)
            }
        };
        let (v, is_new) = reg.publish(&name2, weights).map_err(registry_error)?;
        tracing::info!(adapter = %v.name, version = v.version, "adapter version published");
        Ok(is_new)
    })
    .await?;
    let slot = r
        .registry
        .get(&name)
        .ok_or_else(|| adapter_not_found(&name))?;
    let status = if is_new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, info(r, &slot, true)))
}

/// `{"name", "path"}` loads a PEFT folder; `{"name", "kind": "oft"|"lora", "targets"?,
/// "oft_block_size"?, "r"?, "lora_alpha"?, "use_rslora"?, "seed"?}` creates an identity adapter.
pub async fn create(
    State(state): State<AppState>,
    JsonBody(v): JsonBody,
) -> Result<Response, ApiError> {
    let f = Fields::parse(&v)?;
    let name = f
        .str("name")?
        .ok_or_else(|| ApiError::invalid("name", "'name' is required"))?
        .to_string();
    let source = match (f.str("path")?, f.str("kind")?) {
        (Some(p), None) => Source::Path(PathBuf::from(p)),
        (None, Some(kind)) => Source::New(
            new_config(&f, kind, &state)?,
            f.int_in("seed", 0, u64::MAX as i128)?.unwrap_or(0) as u64,
        ),
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "kind",
                "give either 'path' or 'kind', not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "path",
                "give 'path' (a PEFT folder) or 'kind' (\"oft\" or \"lora\") to create one",
            ))
        }
    };
    let (status, body) = build_and_publish(&state, name, source, "name").await?;
    Ok((status, Json(body)).into_response())
}

fn new_config(f: &Fields, kind: &str, state: &AppState) -> Result<AdapterConfig, ApiError> {
    let targets = match f.get("targets") {
        None => state
            .ready()?
            .model
            .config
            .adapter_shape()
            .default_targets(),
        Some(Value::Array(a)) => {
            let mut t = Vec::new();
            for x in a {
                let s = x
                    .as_str()
                    .ok_or_else(|| ApiError::invalid("targets", "must be a list of strings"))?;
                let tg = Target::parse(s).ok_or_else(|| {
                    ApiError::invalid(
                        "targets",
                        format!("unknown target '{s}' (q, k, v, o, gate, up, down, or their _proj names; lm_head for LoRA)"),
                    )
                })?;
                if !t.contains(&tg) {
                    t.push(tg);
                }
            }
            if t.is_empty() {
                return Err(ApiError::invalid("targets", "must not be empty"));
            }
            t.sort();
            t
        }
        Some(_) => return Err(ApiError::invalid("targets", "must be a list of strings")),
    };
    let method = match kind {
        "oft" => Method::Oft(OftConfig {
            block_size: f.int_in("oft_block_size", 1, 1 << 20)?.unwrap_or(32) as usize,
            ..OftConfig::default()
        }),
        "lora" => {
            let r = f.int_in("r", 1, 1 << 20)?.unwrap_or(16) as usize;
            let alpha = f
                .f32_in("lora_alpha", -1e6, 1e6, true)?
                .unwrap_or(2.0 * r as f32);
            Method::Lora(LoraConfig {
                r,
                alpha,
                use_rslora: f.bool("use_rslora")?.unwrap_or(false),
            })
        }
        other => {
            return Err(ApiError::invalid(
                "kind",
                format!("'{other}' is not an adapter kind (\"oft\" or \"lora\")"),
            ))
        }
    };
    Ok(AdapterConfig {
        method,
        targets,
        base_model: state.ready()?.model_name.clone(),
    })
}

/// Remove `name`; a learning adapter's lineage ends with it (its trainer stops, its versions
/// are never reused). False: no such adapter.
async fn remove(r: &Ready, name: &str) -> Result<bool, ApiError> {
    let learning = r.registry.get(name).is_some_and(|s| s.owner().is_some());
    match r.learning(name) {
        Some(l) if learning => {
            l.trainer.remove(name).await.map(|_| true).map_err(|e| {
                ApiError::unavailable(format!("the trainer could not end '{name}': {e}"))
            })
        }
        _ => Ok(r.registry.remove(name)),
    }
}

pub async fn delete(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
) -> Result<Json<Value>, ApiError> {
    let r = state.ready()?;
    if !remove(r, &name).await? {
        return Err(adapter_not_found(&name));
    }
    tracing::info!(adapter = %name, "adapter deleted");
    Ok(Json(
        json!({"id": name, "object": "adapter", "deleted": true}),
    ))
}

/// `{"path"}`: write the current version as a PEFT folder (atomically; the path must not exist).
pub async fn export(
    State(state): State<AppState>,
    UrlPath(name): UrlPath<String>,
    JsonBody(v): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let f = Fields::parse(&v)?;
    let path = PathBuf::from(
        f.str("path")?
            .ok_or_else(|| ApiError::invalid("path", "'path' is required"))?,
    );
    let r = state.ready()?;
    let slot = r
        .registry
        .get(&name)
        .ok_or_else(|| adapter_not_found(&name))?;
    let cur = slot.current();
    if path.exists() {
        return Err(ApiError::conflict(
            "path",
            format!("{} already exists", path.display()),
        ));
    }
    let (p2, c2) = (path.clone(), cur.clone());
    blocking(move || {
        peft::save(&c2.weights, &p2)
            .map_err(|e| ApiError::invalid("path", format!("export failed: {e}")))
    })
    .await?;
    Ok(Json(json!({
        "id": name,
        "object": "adapter",
        "version": cur.version,
        "path": path.display().to_string(),
    })))
}

/// vLLM's `{"lora_name", "lora_path"}`: an existing name gets a new version (vLLM's load_inplace).
pub async fn load_lora(
    State(state): State<AppState>,
    JsonBody(v): JsonBody,
) -> Result<Response, ApiError> {
    let f = Fields::parse(&v)?;
    let name = f
        .str("lora_name")?
        .ok_or_else(|| ApiError::invalid("lora_name", "'lora_name' is required"))?
        .to_string();
    let path = f
        .str("lora_path")?
        .ok_or_else(|| ApiError::invalid("lora_path", "'lora_path' is required"))?;
    let (_, info) = build_and_publish(&state, name.clone(), Source::Path(path.into()), "lora_name")
        .await
        .map_err(|mut e| {
            if e.param.as_deref() == Some("path") {
                e.param = Some("lora_path".into());
            }
            e
        })?;
    Ok((
        StatusCode::OK,
        format!(
            "Success: LoRA adapter '{name}' added successfully (version {}).",
            info["version"]
        ),
    )
        .into_response())
}

pub async fn unload_lora(
    State(state): State<AppState>,
    JsonBody(v): JsonBody,
) -> Result<Response, ApiError> {
    let f = Fields::parse(&v)?;
    let name = f
        .str("lora_name")?
        .ok_or_else(|| ApiError::invalid("lora_name", "'lora_name' is required"))?;
    let r = state.ready()?;
    if !remove(r, name).await? {
        return Err(ApiError {
            param: Some("lora_name".into()),
            ..adapter_not_found(name)
        });
    }
    Ok((
        StatusCode::OK,
        format!("Success: LoRA adapter '{name}' removed successfully."),
    )
        .into_response())
}
