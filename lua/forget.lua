#!lua flags=allow-oom
-- forget.lua: remove a key's records after an incident (state: any -> never seen).
-- The first line lets the script run at maxmemory (Redis 7 script flags, allow-oom): finishing
-- or giving back work must never be refused for memory. Redis 6 gets the script without it.
--
-- KEYS[1] - the started key
-- KEYS[2] - the stem: the outcome in record format 2
-- KEYS[3] - the result key: the outcome in record format 1
-- KEYS[4] - the notice list
-- KEYS[5] - optional: the send mark (send.lua). It lapses by itself and is left alone, unless a
--           record these scripts cannot read is removed (ARGV[2] '1'): then it goes too, as does
--           a mark of another type (which is such a record)
-- ARGV[1] - the token the caller expects the key to carry ('' = any): the owner of a live
--           lease, the token that stored the outcome, else the last token handed out; '0' is
--           what a record these scripts cannot read carries (none): with ARGV[2] '1' such a
--           record is removed, and a readable one (which carries a token) is refused with -2
-- ARGV[2] - '1' to free a live lease too, and to remove records these scripts cannot read;
--           else '0'
--
-- Returns {code, token} (and a third value, detail, with -3):
--   {1, token}   the records were removed (token: the one they carried, 0 when unreadable)
--   {0, 0}       there was nothing to remove
--   {-1, owner}  refused: a live lease holds the key and ARGV[2] is not '1' (nothing changed)
--   {-2, token}  refused: the key carries another token than ARGV[1] (nothing changed)
--   {-3, 0, detail} refused: a record under the key's names is not one these scripts write
--                (another type, a truncated or foreign format-2 string: claim.lua answers
--                UNREADABLE for it), and ARGV[2] is not '1' or ARGV[1] names a token, which
--                cannot be checked (nothing changed); with ARGV[2] '1' and ARGV[1] '' or '0',
--                whatever lies under the names is removed, whatever its type or shape
-- A record is read as claim.lua reads it, in both formats (the result hash's type and status
-- letter are checked even when the stem holds a readable string), so whatever claim.lua answers
-- UNREADABLE for, this script finds unreadable too.
-- Tokens stay increasing after a forget: the next claim's token comes from Redis' clock
-- (see claim.lua). A worker still running under a freed lease is fenced as after an expiry.
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local LETTERS = {c = true, o = true, f = true}
local function holds(key, expected)
  return key .. ' holds a ' .. redis.call('TYPE', key)['ok'] .. ', not a ' .. expected
end
-- The token of a stored outcome in either format (see complete.lua), else nil; false and what
-- was found for a record these scripts do not write (read with pcall and checked).
local function stored_token(stem, result)
  local h = redis.pcall('HMGET', result, 's', 't')
  if h['err'] then return false, holds(result, 'hash') end
  if h[1] and not LETTERS[h[1]] then return false, 'format-1 record ' .. result .. ' has an unknown status' end
  local raw = redis.pcall('GET', stem)
  if type(raw) == 'table' then return false, holds(stem, 'string') end
  if not raw then return tonumber(h[2]) end
  local size, status = #raw, string.sub(raw, 1, 1)
  if size < 9 or not LETTERS[string.lower(status)] then
    return false, stem .. ' holds a ' .. size .. '-byte string that is not a format-2 record'
  end
  if status ~= string.lower(status) then  -- the fingerprint and original key must fit, as claim.lua reads them
    local fl = size >= 11 and string.byte(raw, 10) * 256 + string.byte(raw, 11) or size
    local ol = size >= 13 + fl and string.byte(raw, 12 + fl) * 256 + string.byte(raw, 13 + fl) or size
    if size < 13 + fl + ol then return false, 'format-2 record ' .. stem .. ' is truncated (' .. size .. ' bytes)' end
  end
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(raw, 2, 9)
  return ((((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7) * 256 + b8
end
local done, detail = stored_token(KEYS[2], KEYS[3])
local st = redis.pcall('HMGET', KEYS[1], 'next', 'owner', 'deadline')
if st['err'] then done, detail = false, holds(KEYS[1], 'hash') end
if done ~= false and KEYS[5] then
  local kind = redis.call('TYPE', KEYS[5])['ok']
  if kind ~= 'none' and kind ~= 'hash' then done, detail = false, holds(KEYS[5], 'hash') end
end
if done == false then
  if ARGV[2] ~= '1' or (ARGV[1] ~= '' and ARGV[1] ~= '0') then return {-3, 0, detail} end
  if KEYS[5] then redis.call('DEL', KEYS[5]) end
  redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
  return {1, 0}
end
local owner = tonumber(st[2]) or 0
local live = owner > 0 and (tonumber(st[3]) or 0) > now_ms
local token = done or (live and owner) or tonumber(st[1]) or 0
-- nothing that names a token: removed all the same when a record of another shape lies there
if not done and not st[1] and redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3]) == 0 then return {0, 0} end
if ARGV[1] ~= '' and tonumber(ARGV[1]) ~= token then return {-2, token} end
if live and not done and ARGV[2] ~= '1' and ARGV[1] == '' then return {-1, owner} end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return {1, token}
