#!lua flags=allow-oom
-- complete.lua: record the outcome of claims we still own (state: claimed -> done).
-- The first line lets the script run at maxmemory (Redis 7 script flags, allow-oom): finishing
-- or giving back work must never be refused for memory. Redis 6 gets the script without it.
--
-- KEYS[4i-3] - the started key of message i
-- KEYS[4i-2] - the stem of message i: where record format 2 keeps the outcome
-- KEYS[4i-1] - the result key of message i: where record format 1 keeps the outcome
-- KEYS[4i]   - the notice list of message i (see watch.lua)
-- ARGV[1]    - result TTL in milliseconds
-- ARGV[3i-1] - the fencing token of message i's claim
-- ARGV[3i]   - status of message i: 'c' completed, 'o' completed with the body omitted,
--              'f' failed permanently
-- ARGV[3i+1] - the serialised result (or error) of message i; in record format 2 the whole
--              compact record instead (the status letter, the token as 8 bytes, the value: built
--              by the caller, so the common case is stored as it came)
-- ARGV[3n+2] - optional, after the last message: '2' writes results in the compact format
--              (record format 2), anything else or nothing the hash (record format 1)
--
-- Returns one value per message: 1 when the outcome was stored, 0 (LEASE_LOST) when the
-- token no longer owns the claim, which includes a started key or a format-1 result key that
-- another program's value of another type took over (read with pcall: such a key answers 0 for
-- its message, never an error for the whole call; claim.lua then answers UNREADABLE for it).
-- A lost claim writes nothing, so a late worker can never
-- overwrite what its successor stored. The started key is deleted on success: once a
-- result exists every claim answers DUPLICATE, and the result keeps the final token.
-- When watch.lua counted waiters, one notice per waiter is pushed to the notice list (which
-- expires after NOTICE_TTL_MS); with no waiter nothing more is written.
-- A retry of a completion that already succeeded (its reply was lost in a failover or a
-- connection reset) answers 1 again: the stored result carries the same token.
--
-- The two formats of a result (every reader of this release reads both; a reader of an earlier
-- release knows only format 1 and would take a key whose outcome is in format 2 for a new one, so
-- format 2 is switched on only once no worker of an earlier release is left):
--   format 1, a hash at the result key (<stem>:result): s (status), v (value), t (token); f (the
--             claim's fingerprint) and orig only when the claim had them (a missing field reads
--             as '')
--   format 2, a string at the stem itself, written with one SET ... PX: the status letter, the
--             token as 8 bytes big-endian, the value. When the claim had a fingerprint or an
--             original key the letter is upper case and the value is preceded by the fingerprint
--             and the original key, each after its length in 2 bytes big-endian. The stem is the
--             shortest name a key can have, so this costs what a plain SET of it does.
--
-- Up to the "per call" line the script only defines helpers and constants, which take what they
-- need as arguments: called as a function (FCALL), the library defines them once, when it is
-- loaded.
local NOTICE_TTL_MS = 10000

local function length(s)
  return string.char(math.floor(#s / 256), #s % 256)
end

-- The token a stored result carries, in either format ('' when none is stored, or when what is
-- stored is not a record these scripts write); the format this worker writes is looked for first
-- (compact: format 2).
local function hashed_token(result)
  local t = redis.pcall('HGET', result, 't')
  if type(t) ~= 'string' then return '' end
  return t
end
local function stored_token(stem, result, compact)
  if not compact then
    local t = hashed_token(result)
    if t ~= '' then return t end
  end
  local raw = redis.pcall('GET', stem)
  if type(raw) ~= 'string' then
    if compact then return hashed_token(result) end
    return ''
  end
  if #raw < 9 then return '' end
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(raw, 2, 9)
  return string.format('%.0f', ((((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7) * 256 + b8)
end

-- One notice per counted waiter (at most MAX_NOTICES: a count this large is not one watch.lua
-- kept, and a waiter not told wakes at its own deadline). A notice list of another type is
-- replaced: its name is ours, and only waiters read it.
local MAX_NOTICES = 10000
local function notify(notice, waiters, token)
  if waiters <= 0 then return end
  if redis.call('TYPE', notice)['ok'] ~= 'list' then redis.call('DEL', notice) end
  for _ = 1, math.min(waiters, MAX_NOTICES) do redis.call('RPUSH', notice, token) end
  redis.call('PEXPIRE', notice, NOTICE_TTL_MS)
end

-- per call
local result_ttl_ms = ARGV[1]  -- passed on as the string it is: Redis formats number arguments
local compact = #ARGV == 3 * #KEYS / 4 + 2 and ARGV[#ARGV] == '2'
local out, n = {}, 0
for i = 1, #KEYS / 4 do
  local started, stem, result, notice = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local token = ARGV[3 * i - 1]
  local st = redis.pcall('HMGET', started, 'owner', 'fp', 'orig', 'w')
  if st['err'] then st = {} end  -- another type: not a claim of ours
  if st[1] and st[1] == token then
    local status, value, fp, orig = ARGV[3 * i], ARGV[3 * i + 1], st[2], st[3]
    if fp == '' then fp = nil end
    if compact then
      if not fp and not orig then
        redis.call('SET', stem, value, 'PX', result_ttl_ms)
      else  -- the claim's fingerprint and original key go between the token and the value
        fp, orig = fp or '', orig or ''
        redis.call('SET', stem, string.upper(status) .. string.sub(value, 2, 9) .. length(fp) .. fp
                   .. length(orig) .. orig .. string.sub(value, 10), 'PX', result_ttl_ms)
      end
    else
      local written
      if not fp and not orig then
        written = redis.pcall('HSET', result, 's', status, 'v', value, 't', token)
      elseif not orig then
        written = redis.pcall('HSET', result, 's', status, 'v', value, 't', token, 'f', fp)
      elseif not fp then
        written = redis.pcall('HSET', result, 's', status, 'v', value, 't', token, 'orig', orig)
      else
        written = redis.pcall('HSET', result, 's', status, 'v', value, 't', token, 'f', fp, 'orig', orig)
      end
      if type(written) == 'table' then status = nil end  -- the result key holds another type
      if status then redis.call('PEXPIRE', result, result_ttl_ms) end
    end
    if status then
      redis.call('DEL', started)
      notify(notice, tonumber(st[4]) or 0, token)
      out[n + 1] = 1; n = n + 1
    else
      out[n + 1] = 0; n = n + 1
    end
  elseif not st[1] and stored_token(stem, result, compact) == token then
    out[n + 1] = 1; n = n + 1
  else
    out[n + 1] = 0; n = n + 1
  end
end
return out
