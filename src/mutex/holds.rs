//! Thread-local hold counts, modelled on the `ThreadLocal<Map<String, Integer>>`
//! counter of the Jedis reentrancy article ("Redis series 13: distributed locks").
//!
//! Each thread keeps, per client and key, a weak reference to the lease it
//! holds. The guards of one hold share the lease through an `Rc`, so the
//! hold count is the number of live guards: it cannot be corrupted by guards
//! dropped in any order, and the lease is released in Redis when the last
//! guard goes. Keeping the table per thread is why guards are `!Send`.
//!
//! Generic over the lease type (any `'static` type), so this table depends
//! on nothing and the lease may call it without a cycle.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};
use std::sync::Arc;

/// Per client, per key (shared with the lease, so entering copies no
/// string).
type Holds = HashMap<u64, HashMap<Arc<str>, Weak<dyn Any>>>;

/// A thread keeps the (empty) tables of up to this many clients, so an
/// uncontended lock cycle does not allocate one each time.
const KEPT_CLIENTS: usize = 8;

thread_local! {
    static HOLDS: RefCell<Holds> = RefCell::new(HashMap::new());
}

/// The lease this thread holds on `key` through client `client_id`, if any
/// is still alive and of type `T`.
pub(crate) fn current<T: Any>(client_id: u64, key: &str) -> Option<Rc<T>> {
    let lease = HOLDS
        .try_with(|holds| {
            let holds = holds.try_borrow().ok()?;
            holds.get(&client_id)?.get(key)?.upgrade()
        })
        .ok()
        .flatten()?;
    lease.downcast::<T>().ok()
}

/// Records `lease` as this thread's hold on its key.
pub(crate) fn enter<T: Any>(client_id: u64, key: &Arc<str>, lease: &Rc<T>) {
    let weak: Weak<dyn Any> = Rc::downgrade(lease) as Weak<dyn Any>;
    let _ = HOLDS.try_with(|holds| {
        if let Ok(mut holds) = holds.try_borrow_mut() {
            holds
                .entry(client_id)
                .or_default()
                .insert(key.clone(), weak);
        }
    });
}

/// Forgets `lease` as this thread's hold on `key`, unless a newer lease has
/// already taken its place. Safe to call during thread teardown.
pub(crate) fn leave<T>(client_id: u64, key: &str, lease: *const T) {
    let _ = HOLDS.try_with(|holds| {
        let Ok(mut holds) = holds.try_borrow_mut() else {
            return;
        };
        let clients = holds.len();
        let Some(keys) = holds.get_mut(&client_id) else {
            return;
        };
        if keys
            .get(key)
            .is_some_and(|weak| std::ptr::addr_eq(weak.as_ptr(), lease))
        {
            keys.remove(key);
            if keys.is_empty() && clients > KEPT_CLIENTS {
                holds.remove(&client_id);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_are_per_client_key_and_type_and_end_with_their_lease() {
        let lease = Rc::new(7_u32);
        let k: Arc<str> = Arc::from("k");
        enter(1, &k, &lease);
        assert_eq!(current::<u32>(1, "k").as_deref(), Some(&7));
        assert!(current::<u32>(2, "k").is_none(), "another client");
        assert!(current::<u64>(1, "k").is_none(), "another type");
        let newer = Rc::new(8_u32);
        enter(1, &k, &newer);
        leave(1, "k", Rc::as_ptr(&lease));
        assert_eq!(
            current::<u32>(1, "k").as_deref(),
            Some(&8),
            "a newer hold stays"
        );
        leave(1, "k", Rc::as_ptr(&newer));
        assert!(current::<u32>(1, "k").is_none());
        enter(1, &k, &lease);
        drop(lease);
        assert!(
            current::<u32>(1, "k").is_none(),
            "a dropped lease is no hold"
        );
    }
}
