//! `fork()`: a child gets a copy of its parent's memory (clients, guards,
//! thread-local holds, the reentrant owner id) but none of its threads.
//! The child's locks must be its own: a fresh client works there, and
//! nothing inherited acts as the child's. One test in its own binary, so
//! no other test's thread holds a lock at the moment of the fork.
#![cfg(unix)]

use redmutex_test_support as support;

use redmutex::{DistributedLock, Error, LockClient, ReentrantLock, Unlocked};
use support::{RedisServer, get};

/// What the child checks; its exit code is the first that failed (0: none).
fn in_child(server: &RedisServer, inherited: &LockClient) -> i32 {
    // A fresh client: its own connection-opening threads and owner id.
    let fresh = match LockClient::open(&server.url()) {
        Ok(client) => client,
        Err(_) => return 10,
    };
    match ReentrantLock::new(&fresh, "fork:reentrant").try_lock() {
        Ok(None) => {}
        Ok(Some(_)) => return 11, // the parent's hold taken as the child's
        Err(_) => return 12,
    }
    // No connection for a client built in the child: 13.
    match DistributedLock::new(&fresh, "fork:child").lock() {
        Ok(guard) => {
            if guard.unlock().is_err() {
                return 13;
            }
        }
        Err(_) => return 13,
    }
    // The inherited client: never a nested guard of the parent's lease.
    match DistributedLock::new(inherited, "fork:plain").try_lock() {
        Err(Error::InvalidArgument(message)) if message.contains("fork") => {}
        Ok(Some(_)) => return 14,
        _ => return 15,
    }
    match ReentrantLock::new(inherited, "fork:reentrant").try_lock() {
        Err(Error::InvalidArgument(_)) => {}
        _ => return 16,
    }
    0
}

#[test]
fn a_forked_child_has_its_own_identity_and_threads_and_never_the_parents_locks() {
    let server = RedisServer::start();
    let client = server.lock_client();
    let plain = DistributedLock::new(&client, "fork:plain")
        .lock()
        .expect("plain");
    let reentrant = ReentrantLock::new(&client, "fork:reentrant")
        .lock()
        .expect("reentrant");
    let token = plain.token().to_owned();

    // SAFETY: the child uses the crate as a program would after fork (no
    // lock of the parent's threads is needed: the crate makes its own
    // threads again), and ends with _exit, running no destructor of the
    // parent's copy but the guard it drops on purpose.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        let mut code = in_child(&server, &client);
        // Dropping the inherited guards must change nothing in Redis.
        drop(plain);
        drop(reentrant);
        if code == 0 && get(&server, "fork:plain").as_deref() != Some(token.as_str()) {
            code = 17;
        }
        // SAFETY: ends the child without the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: reaps our own child.
    let reaped = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(reaped, child);
    assert!(libc::WIFEXITED(status), "the child ended by a signal");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's first failed check"
    );

    assert_eq!(get(&server, "fork:plain").as_deref(), Some(token.as_str()));
    plain.unlock().expect("the parent's lock is still its own");
    assert!(matches!(reentrant.unlock(), Ok(Unlocked::Released)));
    assert!(
        !support::exists(&server, "fork:reentrant"),
        "released, not StillHeld"
    );
}
