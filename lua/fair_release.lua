-- Fair release: the owner-checked release of lua/release.lua for a lock
-- with a queue of waiters (lua/fair_acquire.lua), which wakes only the
-- waiter at the head of the queue: the message goes to that waiter's own
-- channel. Also how a waiter gives up its place ('q').
--
-- KEYS[1]  the lock key
-- KEYS[2]  the queue (sorted set of waiting tokens, by ticket)
-- KEYS[3]  the waiters' deadlines (sorted set, by deadline in ms)
-- KEYS[4]  (optional) this release's marker, {KEY}:released:<token>
-- ARGV[1]  the token
-- ARGV[2]  'r' to release the lock, 'q' to leave the queue (a waiter that
--          gives up: the lock key is not touched)
-- ARGV[3]  how long the marker lives, in milliseconds (a positive integer)
-- ARGV[4]  the waiters' channel prefix: a waiter's channel is the prefix
--          followed by its token's secret (the token up to its first '|')
-- ARGV[5]  (optional) 's': announce with SPUBLISH (Redis Cluster 7.0+),
--          else PUBLISH (also when the server refuses SPUBLISH)
--
-- Returns, for 'r', as lua/release.lua without the subscriber count:
--    1  released now
--    2  released by an earlier run of this same request (its marker)
--    0  not released: the key does not exist (the lease expired)
--   -1  not released: the key holds another owner's token
--   -2, -3  as 0 and -1, but the marker cannot be read
-- for 'q': 1 when the token had a place, 0 when it had none.
-- Whenever the lock is free afterwards and the queue has a head, the head
-- is told on its channel.
-- Errors with WRONGTYPE, changing nothing, when the key holds a non-string
-- value.
--
-- Safe to run twice: the key is deleted once (a second run finds it gone
-- and the marker there); a place is removed once; telling the head twice
-- only makes it ask once more.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local current = redis.call('GET', KEYS[1])
local result
if ARGV[2] == 'q' then
  result = redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[3], ARGV[1])
elseif current == ARGV[1] then
  redis.call('DEL', KEYS[1])
  current = false
  if KEYS[4] then
    redis.pcall('PSETEX', KEYS[4], ARGV[3], '1')
  end
  result = 1
else
  result = -1
  if current == false then result = 0 end
  if KEYS[4] then
    local marked = redis.pcall('EXISTS', KEYS[4])
    if marked == 1 then
      result = 2
    elseif type(marked) ~= 'number' then
      result = result - 2
    end
  end
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, token in ipairs(dead) do
  redis.call('ZREM', KEYS[2], token)
  redis.call('ZREM', KEYS[3], token)
end
if redis.call('ZCARD', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[2], KEYS[3])
elseif current == false then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  local channel = ARGV[4] .. string.match(head, '^[^|]*')
  local sent
  if ARGV[5] == 's' then
    sent = redis.pcall('SPUBLISH', channel, '')
  end
  if type(sent) ~= 'number' then
    redis.pcall('PUBLISH', channel, '')
  end
end
return result
