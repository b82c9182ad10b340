-- Semaphore renewal: gives a permit still present a new deadline, by the
-- server's clock. Never re-creates a permit that is gone (expired, or
-- released), so a late renewal cannot take capacity back.
--
-- KEYS[1]  the semaphore hash
-- ARGV[1]  the permit's id
-- ARGV[2]  the new lease in milliseconds, from now (>= 1)
--
-- Returns 1 renewed, 0 not held (gone or past its deadline).
-- Errors with WRONGTYPE, changing nothing, when the key is not a hash, or a
-- hash without a limit (another lock type's).
--
-- Safe to run twice: a second run sets the same kind of deadline again
-- (now + lease), which a resend within the lease cannot shorten much.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local mine = 'p:' .. ARGV[1]
if tonumber(redis.call('HGET', KEYS[1], mine) or '0') <= now then
  if not redis.call('HGET', KEYS[1], 'limit') and redis.call('EXISTS', KEYS[1]) == 1 then
    return redis.error_reply('WRONGTYPE the key is a hash without a limit: another lock type, not a semaphore')
  end
  return 0
end
local deadline = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], mine, deadline)
-- The key lives as long as its latest permit (PTTL: the commands the
-- README's ACL rules already allow).
if deadline > now + redis.call('PTTL', KEYS[1]) then
  redis.call('PEXPIREAT', KEYS[1], deadline)
end
return 1
