-- inspect.lua: read the state of one message key without changing it (no transition).
--
-- KEYS[1] - the started key
-- KEYS[2] - the stem: the outcome in record format 2
-- KEYS[3] - the result key: the outcome in record format 1
-- ARGV[1]  - optional: 'f' to also return the stored outcome's fingerprint (the replay's check)
--
-- Returns {state, token, remaining_ms_or_status, value}:
--   {2, token, status, value}        a stored outcome (status 'c', 'o' or 'f')
--   {2, token, status, value, fp}    the same with ARGV[1] 'f' (fp '' when the claim had none)
--   {3, owner_token, remaining_ms, false} a live lease is held
--   {0, last_token, 0, false}        free: never claimed, released, or its lease ran out
--   {5, 0, detail, false}            unreadable: a record under the key's names is not one these
--                                    scripts write (another type, a truncated or foreign format-2
--                                    string, a format-1 hash with an unknown status), as claim.lua
--                                    answers UNREADABLE; detail says which
-- Read in one script so the keys are seen at one instant. The outcome is read in both formats
-- complete.lua writes, with pcall and checked, as claim.lua reads it.
local LETTERS = {c = true, o = true, f = true}
local function holds(key, expected)
  return key .. ' holds a ' .. redis.call('TYPE', key)['ok'] .. ', not a ' .. expected
end
-- The stored outcome in either format (see complete.lua): status, token, value, fingerprint
-- ('' for none); nil when no outcome is stored; false and what was found for a record these
-- scripts do not write. Format 2 is a string at the stem, format 1 a hash at the result key; at
-- most one of them exists.
local function outcome(stem, result)
  local raw = redis.pcall('GET', stem)
  if type(raw) == 'table' then return false, holds(stem, 'string') end
  if not raw then
    local h = redis.pcall('HMGET', result, 's', 'v', 't', 'f')
    if h['err'] then return false, holds(result, 'hash') end
    if not h[1] then return nil end
    if not LETTERS[h[1]] then return false, 'format-1 record ' .. result .. ' has an unknown status' end
    return h[1], tonumber(h[3]) or 0, h[2] or '', h[4] or ''
  end
  local size = #raw
  local status = string.sub(raw, 1, 1)
  local lower = string.lower(status)
  if size < 9 or not LETTERS[lower] then
    return false, stem .. ' holds a ' .. size .. '-byte string that is not a format-2 record'
  end
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(raw, 2, 9)
  local token = ((((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7) * 256 + b8
  if status == lower then return status, token, string.sub(raw, 10), '' end
  local fl = size >= 11 and string.byte(raw, 10) * 256 + string.byte(raw, 11) or size
  local ol = size >= 13 + fl and string.byte(raw, 12 + fl) * 256 + string.byte(raw, 13 + fl) or size
  if size < 13 + fl + ol then return false, 'format-2 record ' .. stem .. ' is truncated (' .. size .. ' bytes)' end
  return lower, token, string.sub(raw, 14 + fl + ol), string.sub(raw, 12, 11 + fl)
end
local status, token, value, fp = outcome(KEYS[2], KEYS[3])
if status == false then return {5, 0, token, false} end
if status then
  if ARGV[1] == 'f' then return {2, token, status, value, fp} end
  return {2, token, status, value}
end
local st = redis.pcall('HMGET', KEYS[1], 'next', 'owner', 'deadline')
if st['err'] then return {5, 0, holds(KEYS[1], 'hash'), false} end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = tonumber(st[2]) or 0
local deadline = tonumber(st[3]) or 0
if owner > 0 and deadline > now_ms then return {3, owner, deadline - now_ms, false} end
return {0, tonumber(st[1]) or 0, 0, false}
