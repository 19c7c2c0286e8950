//! The one mapping from failures to HTTP status + OpenAI error body
//! `{"error": {"message", "type", "param", "code"}}`.

use crate::online::learner::ErrorKind;
use crate::online::sessions::SessionRefusal;
use crate::online::store::records::{FeedbackError, Refusal};
use crate::online::trainer::CommandError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// The same error about a field nested in `parent` (its `param` becomes `parent.param`).
    pub fn within(mut self, parent: &str) -> ApiError {
        if let Some(p) = &self.param {
            self.param = Some(format!("{parent}.{p}"));
        }
        self
    }

    /// An error of the request as a whole with this status (413, 415, 408, 405).
    pub fn status(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError::new(status, "invalid_request_error", message)
    }

    pub fn bad_body(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong API key: send 'Authorization: Bearer <key>'",
            )
        }
    }

    /// 403 with `code` saying what was refused.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            code: Some(code),
            ..ApiError::new(StatusCode::FORBIDDEN, "permission_error", message)
        }
    }

    pub fn conflict(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(StatusCode::CONFLICT, "invalid_request_error", message)
        }
    }

    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model '{model}' does not exist"),
            )
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError {
            retry_after: Some(retry_after),
            code: Some("rate_limit_exceeded"),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            message,
        )
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The body, also sent as a `data:` line when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// The trainer's answers to commands, as HTTP errors.
impl From<CommandError> for ApiError {
    fn from(e: CommandError) -> ApiError {
        match e {
            CommandError::NotLearning(name) => ApiError {
                code: Some("adapter_not_learning"),
                ..ApiError::not_found(format!("'{name}' is not a learning adapter"))
            },
            CommandError::Conflict(m) => ApiError {
                code: Some("adapter_shape_fixed"),
                ..ApiError::conflict("method", m.to_string())
            },
            CommandError::Train(e) if e.kind == ErrorKind::Database => ApiError {
                code: Some("rollout_log_unavailable"),
                ..ApiError::unavailable(e.to_string())
            },
            CommandError::Train(e) if e.kind == ErrorKind::Rollback => ApiError {
                code: Some("rollback_refused"),
                ..ApiError::invalid("version", e.message)
            },
            CommandError::Train(e) => ApiError {
                code: Some("trainer_start_failed"),
                ..ApiError::internal(e.to_string())
            },
            CommandError::NoRun(id) => ApiError {
                code: Some("training_run_not_found"),
                ..ApiError::not_found(format!("no training run '{}'", clip(&id)))
            },
            CommandError::Run(e) => ApiError {
                code: Some("training_call_failed"),
                ..ApiError::internal(e.to_string())
            },
            CommandError::Stopped => ApiError::unavailable(CommandError::Stopped.to_string()),
        }
    }
}

/// The rollout log's errors: 503 once its database became unusable, 500 otherwise.
impl From<crate::online::store::records::LogError> for ApiError {
    fn from(e: crate::online::store::records::LogError) -> ApiError {
        use crate::online::store::records::LogError;
        match e {
            LogError::Broken(_) => ApiError {
                code: Some("rollout_log_unavailable"),
                ..ApiError::unavailable(format!("{e}; nothing more is recorded until a restart"))
            },
            // Out of space, read-only, I/O errors: the storage, not the request; retry later.
            LogError::Db(rusqlite::Error::SqliteFailure(f, _))
                if matches!(
                    f.code,
                    rusqlite::ErrorCode::DiskFull
                        | rusqlite::ErrorCode::ReadOnly
                        | rusqlite::ErrorCode::SystemIoFailure
                        | rusqlite::ErrorCode::CannotOpen
                ) =>
            {
                ApiError {
                    code: Some("rollout_log_storage"),
                    ..ApiError::unavailable(format!(
                        "the rollout log cannot write ({e}); nothing was recorded"
                    ))
                }
            }
            LogError::Db(e) => ApiError::internal(format!("the rollout log failed: {e}")),
            // PostgreSQL unreachable, restarted or timed out: nothing was recorded; retry.
            LogError::Pg(ref pg) if pg.as_db_error().is_none() || pg.is_closed() => ApiError {
                code: Some("rollout_log_unavailable"),
                ..ApiError::unavailable(format!("{e}; nothing was recorded"))
            },
            LogError::Pg(_) | LogError::Conflict(_) => {
                ApiError::internal(format!("the rollout log failed: {e}"))
            }
        }
    }
}

/// An id as echoed in a message: at most 80 characters (ids are 40; a client's may be anything).
pub fn clip(id: &str) -> String {
    match id.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &id[..i]),
        None => id.to_string(),
    }
}

/// A server-side error as a caller may see it: whole for the admin, without paths for others.
pub fn shown(why: &str, admin: bool) -> String {
    if admin {
        why.to_string()
    } else {
        crate::util::hide_paths(why)
    }
}

/// A session's reward the store refused, as the API says it.
fn session_refused(id: &str, why: SessionRefusal) -> ApiError {
    let what = format!("session '{}': {why}", clip(id));
    match why {
        SessionRefusal::NotFound => ApiError {
            code: Some("session_not_found"),
            ..ApiError::not_found(what)
        },
        SessionRefusal::Ended => ApiError {
            code: Some("session_ended"),
            ..ApiError::conflict("reward", what)
        },
        SessionRefusal::Conflict => ApiError::conflict("reward", what),
        SessionRefusal::Rewards(_) => ApiError::invalid("rewards", what),
    }
}

/// What a reward was posted for, as its errors name it.
pub enum Rewarded<'a> {
    /// Completions: `[i].id` in a list body, `id` in a single object.
    Completions {
        list: bool,
    },
    Episode(&'a str),
    /// An agent session (`api::sessions`).
    Session(&'a str),
}

impl ApiError {
    /// 404 for an episode this key has no completion of.
    pub fn episode_not_found(episode: &str) -> ApiError {
        ApiError {
            param: Some("episode".into()),
            code: Some("episode_not_found"),
            ..ApiError::not_found(format!(
                "no episode '{}' of this key (its completions are recorded once they finish)",
                clip(episode)
            ))
        }
    }

    /// A reward the rollout log did not record; `admin` sees a failed trainer's error whole.
    pub fn feedback(e: FeedbackError, of: Rewarded, admin: bool) -> ApiError {
        let list = matches!(of, Rewarded::Completions { list: true });
        let field = |index: usize, f: &str| {
            if list {
                format!("[{index}].{f}")
            } else {
                f.to_string()
            }
        };
        let noun = match of {
            Rewarded::Session(_) => "session",
            _ => "episode",
        };
        match (e, of) {
            (FeedbackError::Log(e), _) => ApiError::from(e),
            (FeedbackError::Session { id, why }, _) => session_refused(&id, why),
            (FeedbackError::EpisodeNotFound { episode }, Rewarded::Episode(_)) => {
                ApiError::episode_not_found(&episode)
            }
            (FeedbackError::EpisodeConflict { episode, old }, Rewarded::Episode(_)) => {
                ApiError::conflict(
                    "reward",
                    format!("episode '{}' already has the reward {old}", clip(&episode)),
                )
            }
            (
                FeedbackError::Refused {
                    adapter,
                    why: Refusal::Failed(why),
                    ..
                },
                Rewarded::Episode(episode) | Rewarded::Session(episode),
            ) => ApiError {
                param: Some(noun.into()),
                code: Some("trainer_failed"),
                ..ApiError::unavailable(format!(
                    "{noun} '{}' belongs to '{adapter}', whose trainer has failed ({}); the \
                     reward was not recorded",
                    clip(episode),
                    shown(&why, admin)
                ))
            },
            (
                FeedbackError::Refused { adapter, .. },
                Rewarded::Episode(episode) | Rewarded::Session(episode),
            ) => ApiError {
                code: Some("adapter_not_learning"),
                ..ApiError::conflict(
                    noun,
                    format!(
                        "{noun} '{}' belongs to '{adapter}', which no longer learns",
                        clip(episode)
                    ),
                )
            },
            (FeedbackError::NotFound { index, id, choice }, Rewarded::Completions { .. }) => {
                ApiError {
                    param: Some(field(index, "id")),
                    code: Some("completion_not_found"),
                    ..ApiError::not_found(format!(
                        "no completion '{}' with choice {choice} (a completion is recorded once \
                         all its choices have finished: before the response, or before a \
                         stream's chunk that finishes the last one)",
                        clip(&id)
                    ))
                }
            }
            (FeedbackError::Forbidden { index, id }, Rewarded::Completions { .. }) => ApiError {
                param: Some(field(index, "id")),
                ..ApiError::forbidden(
                    "not_owner",
                    format!(
                        "completion '{id}' was made with another key; only that key or the \
                         admin key may reward it"
                    ),
                )
            },
            (
                FeedbackError::Refused {
                    index,
                    id,
                    adapter,
                    why: Refusal::Failed(why),
                },
                Rewarded::Completions { .. },
            ) => ApiError {
                param: Some(field(index, "id")),
                code: Some("trainer_failed"),
                ..ApiError::unavailable(format!(
                    "completion '{id}' belongs to '{adapter}', whose trainer has failed ({}); \
                     the reward was not recorded. An operator resumes it with POST \
                     /v1/train/{adapter}/resume",
                    shown(&why, admin)
                ))
            },
            (
                FeedbackError::Refused {
                    index, id, adapter, ..
                },
                Rewarded::Completions { .. },
            ) => ApiError {
                code: Some("adapter_not_learning"),
                ..ApiError::conflict(
                    &field(index, "id"),
                    format!(
                        "completion '{id}' belongs to '{adapter}', which no longer learns \
                         (deleted or re-created since): the reward would not be trained on"
                    ),
                )
            },
            (
                FeedbackError::Conflict {
                    index,
                    id,
                    choice,
                    old,
                },
                Rewarded::Completions { .. },
            ) => ApiError::conflict(
                &field(index, "reward"),
                format!("completion '{id}' choice {choice} already has the reward {old}"),
            ),
            (FeedbackError::EpisodeTurn { index, id }, Rewarded::Completions { .. }) => {
                ApiError::invalid(
                    &field(index, "id"),
                    format!(
                        "completion '{}' is a turn of an episode: reward the episode \
                         ({{\"episode\", \"reward\"}})",
                        clip(&id)
                    ),
                )
            }
            // What the other route's log calls return: not this one's.
            (e, _) => ApiError::internal(e.to_string()),
        }
    }
}
