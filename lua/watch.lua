-- watch.lua: register a waiter on a key held by a live lease (state: claimed -> claimed, +1 waiter).
--
-- KEYS[1] - the started key
-- KEYS[2] - the stem: the outcome in record format 2
-- KEYS[3] - the result key: the outcome in record format 1
-- ARGV    - none
--
-- Returns {held, remaining_ms}:
--   {1, remaining_ms}  a live lease holds the key: one waiter is counted in the started key's
--                      'w' field, so complete.lua or release.lua will push one notice for it to
--                      the key's notice list; block on that list for at most remaining_ms
--   {0, 0}             an outcome is stored, no live lease holds the key, or a record under its
--                      names is not one of ours (claim.lua answers UNREADABLE for it): claim
--                      again now
-- A waiter never holds the claim; it only asks to be told. complete.lua and release.lua push one
-- notice per counted waiter and reset the count; a waiter that gave up leaves a notice behind,
-- which expires with the list (a later waiter woken by it just claims again).
if redis.call('EXISTS', KEYS[2], KEYS[3]) > 0 then return {0, 0} end
local st = redis.pcall('HMGET', KEYS[1], 'owner', 'deadline')
if st['err'] then return {0, 0} end  -- another type: claim.lua says what it is
local owner = tonumber(st[1]) or 0
local deadline = tonumber(st[2]) or 0
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if owner == 0 or deadline <= now_ms then return {0, 0} end
-- a count that is not an integer was not kept by these scripts: it restarts at this waiter
if type(redis.pcall('HINCRBY', KEYS[1], 'w', 1)) == 'table' then redis.call('HSET', KEYS[1], 'w', '1') end
return {1, deadline - now_ms}
