-- Semaphore status: the limit and the permits still within their deadline,
-- by the server's clock, read in one step (what `redmutex status` shows).
--
-- KEYS[1]  the semaphore hash
--
-- Returns {limit, {{id, ms, fence}, ...}}:
--   limit  the stored limit; 0 when the key does not exist (no permit out);
--          -1 when the key is a hash without a limit (not a semaphore:
--          a reentrant or read-write lock, say; the caller reports it as
--          the wrong type)
--   id     a live permit's id, ms its time left, fence its fencing token
--          (0 when it has none)
-- Errors with WRONGTYPE when the key is not a hash.
--
-- Reads only (expired permits are skipped, not purged): safe to run twice.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local fields = redis.call('HGETALL', KEYS[1])
if #fields == 0 then
  return {0, {}}
end
local values = {}
for i = 1, #fields, 2 do
  values[fields[i]] = fields[i + 1]
end
local limit = tonumber(values['limit'] or '')
if limit == nil then
  return {-1, {}}
end
local live = {}
for name, value in pairs(values) do
  if string.sub(name, 1, 2) == 'p:' then
    local deadline = tonumber(value)
    if deadline ~= nil and deadline > now then
      local id = string.sub(name, 3)
      live[#live + 1] = {id, deadline - now, tonumber(values['f:' .. id] or '0') or 0}
    end
  end
end
return {limit, live}
