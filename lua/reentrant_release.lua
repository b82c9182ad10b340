-- Server-side reentrant release (seed 001): decrement the owner's hold
-- count; delete the key when it reaches zero.
--
-- KEYS[1]  the lock key (a hash)
-- ARGV[1]  the owner id
--
-- Returns:
--   nil  not the owner: the hash belongs to someone else (the articles' nil)
--    -1  the key is gone: the lease expired (the articles answer nil here too;
--        telling it apart lets the caller report "expired")
--     0  still held: the count is still above zero
--     1  released: the count reached zero and the key was deleted
-- Errors with WRONGTYPE when the key holds something other than a hash.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
elseif redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return nil
elseif redis.call('HINCRBY', KEYS[1], ARGV[1], -1) <= 0 then
  redis.call('DEL', KEYS[1])
  return 1
else
  return 0
end
