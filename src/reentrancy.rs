//! Thread-local hold counts, modelled on the `ThreadLocal<Map<String, Integer>>`
//! counter of the Jedis article (seed 002).
//!
//! Each thread keeps, per client and key, a weak reference to the lease it
//! holds. The guards of one hold share the lease through an `Rc`, so the
//! hold count is the number of live guards: it cannot be corrupted by guards
//! dropped in any order, and the lease is released in Redis when the last
//! guard goes. Keeping the table per thread is why guards are `!Send`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

use crate::guard::Lease;

type Holds = HashMap<u64, HashMap<String, Weak<Lease>>>;

thread_local! {
    static HOLDS: RefCell<Holds> = RefCell::new(HashMap::new());
}

/// The live lease this thread holds on `key` through client `client_id`, if
/// any and if its local validity has not run out.
pub(crate) fn current(client_id: u64, key: &str) -> Option<Rc<Lease>> {
    let lease = HOLDS
        .try_with(|holds| {
            let holds = holds.try_borrow().ok()?;
            holds.get(&client_id)?.get(key)?.upgrade()
        })
        .ok()
        .flatten()?;
    // A lease whose time is up is not re-entered: the caller acquires anew
    // (and the new lease replaces this one in the table).
    (!lease.is_released() && !lease.validity().is_zero()).then_some(lease)
}

/// Records `lease` as this thread's hold on its key.
pub(crate) fn enter(client_id: u64, key: &str, lease: &Rc<Lease>) {
    let _ = HOLDS.try_with(|holds| {
        if let Ok(mut holds) = holds.try_borrow_mut() {
            holds
                .entry(client_id)
                .or_default()
                .insert(key.to_owned(), Rc::downgrade(lease));
        }
    });
}

/// Forgets `lease` as this thread's hold on `key`, unless a newer lease has
/// already taken its place. Safe to call during thread teardown.
pub(crate) fn leave(client_id: u64, key: &str, lease: *const Lease) {
    let _ = HOLDS.try_with(|holds| {
        let Ok(mut holds) = holds.try_borrow_mut() else {
            return;
        };
        let Some(keys) = holds.get_mut(&client_id) else {
            return;
        };
        if keys.get(key).is_some_and(|weak| weak.as_ptr() == lease) {
            keys.remove(key);
            if keys.is_empty() {
                holds.remove(&client_id);
            }
        }
    });
}
