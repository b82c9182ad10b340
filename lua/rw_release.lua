-- Read-write lock release: remove only this holder's own field, owner-checked,
-- then keep the hash's expiry at its latest remaining deadline and tell
-- waiters. A reader can never remove another reader's field.
--
-- KEYS[1]  the lock hash
-- ARGV[1]  this holder's token
-- ARGV[2]  'r' (a reader), 'w' (the writer) or 'q' (a writer gives up waiting)
-- ARGV[3]  the release channel to PUBLISH on
--
-- Returns:
--    1  released
--    0  not released: this holder's field is gone (the lease expired)
--   -1  not released: another writer holds the write lock
-- Errors with WRONGTYPE when the key is not a hash.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local result = 0
if ARGV[2] == 'w' then
  local writer = redis.call('HGET', KEYS[1], 'w')
  local deadline = tonumber(redis.call('HGET', KEYS[1], 'wexp') or '0')
  if writer == ARGV[1] then
    redis.call('HDEL', KEYS[1], 'w', 'wexp')
    if deadline > now then result = 1 end
  elseif writer then
    result = -1
  end
else
  local field = ARGV[2] .. ':' .. ARGV[1]
  local deadline = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if redis.call('HDEL', KEYS[1], field) == 1 and deadline > now then
    result = 1
  end
end
-- Recompute the hash's expiry from what is left.
local fields = redis.call('HGETALL', KEYS[1])
local latest = nil
for i = 1, #fields, 2 do
  if fields[i] ~= 'w' then
    local deadline = tonumber(fields[i + 1])
    if deadline and (latest == nil or deadline > latest) then latest = deadline end
  end
end
if latest == nil or latest <= now then
  redis.call('DEL', KEYS[1])
else
  redis.call('PEXPIREAT', KEYS[1], latest)
end
if result == 1 and ARGV[2] ~= 'q' then
  redis.call('PUBLISH', ARGV[3], '')
end
return result
