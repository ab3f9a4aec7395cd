-- inspect.lua: read the state of one message key without changing it (no transition).
--
-- KEYS[1] - the started key
-- KEYS[2] - the result key
--
-- Returns {state, token, remaining_ms_or_status, value}:
--   {2, token, status, value}        a stored outcome (status 'c', 'o' or 'f')
--   {3, owner_token, remaining_ms, false} a live lease is held
--   {0, last_token, 0, false}        free: never claimed, released, or its lease ran out
-- Read in one script so the two keys are seen at one instant.
local done = redis.call('HMGET', KEYS[2], 's', 'v', 't')
if done[1] then return {2, tonumber(done[3]) or 0, done[1], done[2] or ''} end
local st = redis.call('HMGET', KEYS[1], 'next', 'owner', 'deadline')
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = tonumber(st[2]) or 0
local deadline = tonumber(st[3]) or 0
if owner > 0 and deadline > now_ms then return {3, owner, deadline - now_ms, false} end
return {0, tonumber(st[1]) or 0, 0, false}
