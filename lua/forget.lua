#!lua flags=allow-oom
-- forget.lua: remove a key's records after an incident (state: any -> never seen).
-- The first line lets the script run at maxmemory (Redis 7 script flags, allow-oom): finishing
-- or giving back work must never be refused for memory. Redis 6 gets the script without it.
--
-- KEYS[1] - the started key
-- KEYS[2] - the stem: the outcome in record format 2
-- KEYS[3] - the result key: the outcome in record format 1
-- KEYS[4] - the notice list
-- ARGV[1] - the token the caller expects the key to carry ('' = any): the owner of a live
--           lease, the token that stored the outcome, else the last token handed out
-- ARGV[2] - '1' to free a live lease too, else '0'
--
-- Returns {code, token}:
--   {1, token}   the records were removed (token: the one they carried)
--   {0, 0}       there was nothing to remove
--   {-1, owner}  refused: a live lease holds the key and ARGV[2] is not '1' (nothing changed)
--   {-2, token}  refused: the key carries another token than ARGV[1] (nothing changed)
-- Tokens stay increasing after a forget: the next claim's token comes from Redis' clock
-- (see claim.lua). A worker still running under a freed lease is fenced as after an expiry.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The token of a stored outcome in either format (see complete.lua), else nil.
local function stored_token(stem, result)
  local raw = redis.call('GET', stem)
  if not raw then return tonumber(redis.call('HGET', result, 't')) end
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(raw, 2, 9)
  return ((((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7) * 256 + b8
end
local done = stored_token(KEYS[2], KEYS[3])
local st = redis.call('HMGET', KEYS[1], 'next', 'owner', 'deadline')
local owner = tonumber(st[2]) or 0
local live = owner > 0 and (tonumber(st[3]) or 0) > now_ms
local token = done or (live and owner) or tonumber(st[1]) or 0
if not done and not st[1] then return {0, 0} end
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= token then return {-2, token} end
if live and not done and ARGV[2] ~= '1' and ARGV[1] == '' then return {-1, owner} end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return {1, token}
