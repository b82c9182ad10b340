-- Fair acquire: the lock goes to the waiters in the order they first asked
-- Redis for it. The lock key is a plain lock (the token in a string key,
-- as lua/acquire.lua writes it); beside it, in the key's slot, a queue of
-- waiters ordered by ticket and each waiter's deadline by the server's
-- clock. A waiter refreshes its deadline with every attempt; one that stops
-- asking (killed, partitioned) is dropped once its deadline passes, so a
-- dead waiter holds the queue up for at most its entry's ttl.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the queue: a sorted set of waiting tokens, scored by ticket
-- KEYS[3]  the waiters' deadlines: a sorted set of the same tokens, scored
--          by deadline (ms, server clock)
-- KEYS[4]  (optional) the key's fencing counter, in the same hash slot
-- ARGV[1]  this acquisition's token (a fresh secret, then the holder
--          metadata)
-- ARGV[2]  the lease in milliseconds (a positive integer)
-- ARGV[3]  how long this waiter's place lives without a new attempt, in
--          milliseconds (a positive integer)
-- ARGV[4]  '1': when refused, take (or keep) a place in the queue; '0': a
--          single attempt, which never queues
--
-- Returns {acquired, pttl, position, holder, number}:
--   {1, 0, 0, nil, fence}   acquired: the key holds ARGV[1] for ARGV[2] ms
--                  (it was free and nobody waited before this token); fence
--                  as lua/acquire.lua issues it (0 without KEYS[4])
--   {0, pttl, position, holder, ticket}  refused: the holder (nil when the
--                  key is free but others are ahead) has pttl ms left;
--                  position is this token's place in the queue (0: the
--                  head; -1: not queued); ticket is its place's number
--                  (the server's clock in microseconds when it first
--                  queued, strictly increasing per queue; 0 when not
--                  queued)
-- Errors (nothing changed but dropping dead waiters):
--   WRONGTYPE  the lock key holds a non-string value, or a queue key
--              another type
--   FENCE ...  the counter cannot be incremented (as lua/acquire.lua)
--
-- Safe to run twice: a run that finds the key holding ARGV[1] answers
-- acquired (an earlier run of this request took it; fence read back); a
-- waiter already queued keeps its ticket and only gets a later deadline.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, token in ipairs(dead) do
  redis.call('ZREM', KEYS[2], token)
  redis.call('ZREM', KEYS[3], token)
end
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  local fence = 0
  if KEYS[4] then fence = tonumber(redis.pcall('GET', KEYS[4])) or 0 end
  return {1, 0, 0, false, fence}
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
if current == false and (head == nil or head == ARGV[1]) then
  local fence = 0
  if KEYS[4] then
    fence = redis.pcall('INCR', KEYS[4])
    if type(fence) ~= 'number' then
      return redis.error_reply('FENCE ' .. (fence.err or 'the counter cannot be incremented'))
    end
    if fence < 1 then
      redis.call('DECR', KEYS[4])
      return redis.error_reply('FENCE the counter is negative')
    end
    if fence >= 9007199254740992 then
      redis.call('DECR', KEYS[4])
      return redis.error_reply('FENCE the counter is at 2^53 or above')
    end
    local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
    if fence < floor then
      fence = floor
      redis.call('SET', KEYS[4], string.format('%.0f', fence))
    end
  end
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
  if redis.call('ZCARD', KEYS[2]) == 0 then
    redis.call('DEL', KEYS[2], KEYS[3])
  end
  return {1, 0, 0, false, fence}
end
local ticket = 0
if ARGV[4] == '1' then
  ticket = tonumber(redis.call('ZSCORE', KEYS[2], ARGV[1]))
  if ticket == nil then
    ticket = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local last = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')[2]
    if last and tonumber(last) >= ticket then ticket = tonumber(last) + 1 end
    redis.call('ZADD', KEYS[2], string.format('%.0f', ticket), ARGV[1])
  end
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[3]), ARGV[1])
end
-- The queue lives as long as its last waiter's deadline.
local latest = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')[2]
if latest then
  redis.call('PEXPIREAT', KEYS[2], latest)
  redis.call('PEXPIREAT', KEYS[3], latest)
end
local position = redis.call('ZRANK', KEYS[2], ARGV[1]) or -1
local pttl = 0
if current then pttl = redis.call('PTTL', KEYS[1]) end
return {0, pttl, position, current, ticket}
