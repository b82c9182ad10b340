-- Multi-key release: in one atomic step, delete every key of the set that
-- still holds our token (owner-checked, key by key), announce each on its
-- release channel, and leave a marker saying what this release did. No
-- reader ever sees part of the set released.
--
-- KEYS[1..n]  the lock keys (one hash slot on Redis Cluster)
-- KEYS[n+1]   (optional) this release's marker, {KEY}:released:<token> of
--             the first key, in the keys' slot
-- ARGV[1]  the token written by this owner's acquisition
-- ARGV[2]  n, how many lock keys
-- ARGV[3]  how long the marker lives, in milliseconds (a positive integer)
-- ARGV[4]  's': announce with SPUBLISH (Redis Cluster 7.0+), else PUBLISH
--          (also when the server refuses SPUBLISH)
-- ARGV[5..4+n]  each key's release channel, in the same order
--
-- Returns {code, index}:
--   {1, 0}    every key held the token and is released now
--   {2, 0}    released by an earlier run of this same request, whose reply
--             was lost (its marker is there)
--   {0, i}    key i (the first in order not released) was gone (its lease
--             expired); every key that still held the token is released
--   {-1, i}   key i held another owner's token; likewise
--   {-2, i}, {-3, i}  as 0 and -1, but the marker cannot be read (an ACL
--             refuses it): whether an earlier run released cannot be told
-- Errors with WRONGTYPE, before anything is deleted, when a key holds a
-- non-string value.
--
-- Safe to run twice: a run that deleted anything leaves a marker with its
-- answer; a second run finds the keys gone and answers from the marker
-- ({2, 0} for a whole release, else the first run's {code, i}). The marker
-- and the messages go through pcall, so an ACL that refuses them does not
-- turn a done release into an error.
local n = tonumber(ARGV[2])
local current = {}
for i = 1, n do
  current[i] = redis.call('GET', KEYS[i])
end
local code, index, deleted = 1, 0, 0
for i = 1, n do
  if current[i] == ARGV[1] then
    redis.call('DEL', KEYS[i])
    deleted = deleted + 1
    local sent
    if ARGV[4] == 's' then
      sent = redis.pcall('SPUBLISH', ARGV[4 + i], '')
    end
    if type(sent) ~= 'number' then
      redis.pcall('PUBLISH', ARGV[4 + i], '')
    end
  elseif code == 1 then
    index = i
    if current[i] == false then code = 0 else code = -1 end
  end
end
local marker = KEYS[n + 1]
if deleted > 0 then
  if marker then
    redis.pcall('PSETEX', marker, ARGV[3], code .. ',' .. index)
  end
  return {code, index}
end
if marker then
  local answer = redis.pcall('GET', marker)
  if type(answer) == 'string' then
    local c, i = string.match(answer, '^(-?%d+),(%d+)$')
    if c == '1' then return {2, 0} end
    if c then return {tonumber(c), tonumber(i)} end
  elseif type(answer) == 'table' and answer.err then
    code = code - 2
  end
end
return {code, index}
