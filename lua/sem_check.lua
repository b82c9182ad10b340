-- Semaphore permit check: whether a permit is still in place, by the
-- server's clock, and the limit stored with the semaphore. Sent by a
-- client that passes the permit between its threads without Redis, to
-- learn that it was lost (expired, released by id, the key deleted) or
-- that the limit was changed elsewhere (a handoff is an admission, which
-- the new limit must decide).
--
-- KEYS[1]  the semaphore hash
-- ARGV[1]  the permit's id
--
-- Returns {live, limit}:
--   live   1 when `p:<id>` is there and within its deadline, else 0
--   limit  the stored limit; 0 when none is stored (the key is gone), -1
--          when the key is a hash without one (another lock type's)
-- Errors with WRONGTYPE when the key is not a hash.
--
-- Reads only: safe to run twice, or late.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = tonumber(redis.call('HGET', KEYS[1], 'p:' .. ARGV[1]) or '0') or 0
local limit = redis.call('HGET', KEYS[1], 'limit')
if limit then
  limit = tonumber(limit) or -1
elseif redis.call('EXISTS', KEYS[1]) == 1 then
  limit = -1
else
  limit = 0
end
local live = 0
if deadline > now then live = 1 end
return {live, limit}
