//! What a key made and only that key may read back, in memory: values by id, the newest
//! `capacity` kept (the oldest forgotten). The Responses API's stored responses and the Tinker
//! API's sessions and call results are kept this way.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

pub struct Owned<T> {
    capacity: usize,
    inner: Mutex<Entries<T>>,
}

/// id -> (key, value), and the ids oldest first.
type Entries<T> = (HashMap<String, (String, T)>, VecDeque<String>);

impl<T> Owned<T> {
    pub fn new(capacity: usize) -> Owned<T> {
        Owned {
            capacity,
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries<T>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keep `value`, made by `key`, under `id`: the ids forgotten to make room.
    pub fn put(&self, id: String, key: &str, value: T) -> Vec<String> {
        let mut g = self.lock();
        let (map, order) = &mut *g;
        if map.insert(id.clone(), (key.to_string(), value)).is_none() {
            order.push_back(id);
        }
        let mut forgotten = Vec::new();
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
                forgotten.push(old);
            }
        }
        forgotten
    }

    /// Value `id` as `key` may see it (another key's is not found).
    pub fn get(&self, id: &str, key: &str) -> Option<T>
    where
        T: Clone,
    {
        let g = self.lock();
        g.0.get(id)
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    /// Change value `id` of `key` with `f`; false when `key` has none such.
    pub fn update(&self, id: &str, key: &str, f: impl FnOnce(&mut T)) -> bool {
        let mut g = self.lock();
        match g.0.get_mut(id).filter(|(k, _)| k == key) {
            Some((_, v)) => {
                f(v);
                true
            }
            None => false,
        }
    }

    /// Forget the values for which `stale` holds: their ids.
    pub fn forget(&self, stale: impl Fn(&T) -> bool) -> Vec<String> {
        let mut g = self.lock();
        let (map, order) = &mut *g;
        let gone: Vec<String> = map
            .iter()
            .filter(|(_, (_, v))| stale(v))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &gone {
            map.remove(id);
        }
        order.retain(|id| map.contains_key(id));
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values are their key's alone, the oldest are forgotten past the capacity, and forgetting
    /// by a rule says what it forgot.
    #[test]
    fn values_are_their_keys_and_the_oldest_go_first() {
        let o = Owned::new(2);
        assert!(o.put("a".into(), "k", 1).is_empty());
        assert!(o.put("b".into(), "k", 2).is_empty());
        assert_eq!(o.get("a", "k"), Some(1));
        assert_eq!(o.get("a", "other"), None);
        assert!(!o.update("a", "other", |v| *v = 9));
        assert!(o.update("b", "k", |v| *v = 3));
        assert_eq!(o.put("c".into(), "k", 4), ["a"]);
        assert_eq!(o.get("a", "k"), None);
        assert_eq!(o.forget(|v| *v == 3), ["b"]);
        assert_eq!(o.get("c", "k"), Some(4));
        assert!(
            o.put("d".into(), "k", 5).is_empty(),
            "room was made by forgetting b"
        );
    }
}
