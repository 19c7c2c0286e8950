//! The Responses API's stored responses (`store`, `previous_response_id`, `GET
//! /v1/responses/{id}`): in memory, the newest `STORE_CAPACITY`, each readable only with the key
//! that made it (`api::owned`).

use serde_json::Value;

/// Stored responses kept at most (the oldest are forgotten).
pub const STORE_CAPACITY: usize = 1024;

/// A stored response: its body, and the conversation it continues (input items, its own output
/// last).
#[derive(Clone)]
pub struct Stored {
    pub body: Value,
    pub items: Vec<Value>,
}

pub type ResponseStore = super::owned::Owned<Stored>;
