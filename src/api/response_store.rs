//! The Responses API's stored responses (`store`, `previous_response_id`, `GET
//! /v1/responses/{id}`): in memory, the newest `STORE_CAPACITY`, each readable only with the key
//! that made it.

use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Stored responses kept at most (the oldest are forgotten).
pub const STORE_CAPACITY: usize = 1024;

/// A stored response: its body, the conversation it continues (input items, its own output
/// last), and whose key made it.
pub(super) struct Stored {
    pub body: Value,
    pub items: Vec<Value>,
    pub key: String,
}

/// The stored responses, oldest first out.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

impl ResponseStore {
    pub(super) fn put(&self, id: String, s: Stored) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (map, order) = &mut *g;
        if map.insert(id.clone(), s).is_none() {
            order.push_back(id);
        }
        while order.len() > STORE_CAPACITY {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// The stored response `id` as `key` may see it (another key's is not found).
    pub(super) fn get(&self, id: &str, key: &str) -> Option<(Value, Vec<Value>)> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.0.get(id)
            .filter(|s| s.key == key)
            .map(|s| (s.body.clone(), s.items.clone()))
    }
}
