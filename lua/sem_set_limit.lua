-- Semaphore limit change: the explicit way to give a semaphore another
-- number of permits while permits are out (an acquire with another number
-- is refused with LIMIT instead). Permits already out stay out; a smaller
-- limit admits nobody new until enough of them are released.
--
-- KEYS[1]  the semaphore hash
-- ARGV[1]  the new limit (>= 1)
--
-- Returns the previous limit, or 0 when the semaphore has no state (no
-- permit out: the next acquire sets its own limit anyway).
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or
-- a hash without a limit (another lock type's).
--
-- Safe to run twice: the second run sets the same limit again.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local previous = redis.call('HGET', KEYS[1], 'limit')
if not previous then
  return redis.error_reply('WRONGTYPE the key is a hash without a limit: another lock type, not a semaphore')
end
previous = tonumber(previous) or 0
redis.call('HSET', KEYS[1], 'limit', ARGV[1])
return previous
