-- claim.lua: try to take the claim on one or more message keys (state: free -> claimed).
--
-- KEYS[3i-2] - the started key of message i (hash: next, owner, deadline, fp, orig, w)
-- KEYS[3i-1] - the stem of message i: where record format 2 keeps the outcome (complete.lua's
--              compact string)
-- KEYS[3i]   - the result key of message i: where record format 1 keeps the outcome (the hash
--              of every release: s, v, t, f, orig)
-- ARGV[1]    - lease in milliseconds
-- ARGV[2]    - retention in milliseconds: how long the started key (and with it the token
--              counter) outlives the lease
-- ARGV[2i+1] - payload fingerprint of message i ('' means "do not check")
-- ARGV[2i+2] - the original key of message i when the Redis key holds its hash, else ''
-- ARGV[2n+3] - optional, after the last message: '2' when this worker writes record format 2 (a
--              stored outcome is then looked for at the stem first, else at the result key first)
--
-- Returns four values per message, in order:
--   {1, token, reclaimed, false}        ACQUIRED: we own the claim under a new fencing token;
--                                       reclaimed is 1 when the key was claimed before (its
--                                       token counter existed: a crash, an outage, a lost lease
--                                       or a release), false on a first claim
--   {2, token, status, value}           DUPLICATE: an outcome is stored (status 'c' completed,
--                                       'o' completed with the body omitted, 'f' failed)
--   {3, owner_token, remaining_ms, false} IN_PROGRESS: a live lease is held by another token
--   {4, 0, false, false}                CONFLICT: the key was used with another fingerprint
--   {5, 0, detail, false}               UNREADABLE: a record under the key's names is not one
--                                       these scripts write (another program's key of another
--                                       type, a truncated or foreign format-2 string, a format-1
--                                       hash with an unknown status); detail says which. Nothing
--                                       is written for that key, and the other keys of the call
--                                       are answered as usual
--
-- The lease deadline is taken from Redis' own clock (TIME) and kept as a field, so the
-- started key outlives its lease and the fencing token never goes backwards while the
-- key's records live.
--
-- Tokens survive a failover. A new token is max(next + 1, now in microseconds on Redis'
-- clock): strictly larger than the last one this primary handed out for the key (as before),
-- and also larger than any token an earlier primary handed out, even one whose writes the
-- promoted replica never received, as long as the new primary's clock is not behind the old
-- one's by more than the failover took (a failover takes seconds; NTP keeps clocks within
-- milliseconds). Why not an epoch bumped on failover: nothing in a script can tell that a
-- failover happened, and a lost write can take the epoch with it. Microseconds since 1970
-- stay below 2^53 until the year 2255, so JSON, Lua numbers and SQL bigint hold them exactly.
--
-- Records are shared with workers running other releases of these scripts (rolling upgrades;
-- tests/test_lua_compat.py): a field that is missing means what its empty value meant, so empty
-- ones are not written (fp and orig here), and a free lease is one whose owner is 0 or missing,
-- whatever its deadline. An outcome is read in both formats complete.lua writes (a release before
-- this one reads only format 1's hash, which is why format 2 is switched on only once every worker
-- runs this release). The cost is Redis' own time per key, so the common case is cheapest: a key
-- with no record at all (one EXISTS of its three keys) is claimed with one HSET of three fields
-- and a PEXPIREAT; a duplicate is one EXISTS and one read (GET of the stem or HMGET of the result
-- key: the format this worker writes first).
--
-- Up to the "per call" line the script only defines helpers, which take what they need as
-- arguments: called as a function (FCALL), the library defines them once, when it is loaded.
--
-- Redis' clock: now in milliseconds, in microseconds and the latter as a string, then the
-- lease's deadline and the started key's expiry (the lease, or the retention when longer) as
-- strings (Redis formats every number argument of every call, so shared values are made once).
local function clock(lease_ms, retention_ms)
  local t = redis.call('TIME')
  local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  return now_ms, tonumber(t[1]) * 1000000 + tonumber(t[2]), t[1] .. string.rep('0', 6 - #t[2]) .. t[2],
    string.format('%d', now_ms + lease_ms), string.format('%d', now_ms + math.max(lease_ms, retention_ms))
end

-- The stored outcome in either format: status, token, value, fingerprint ('' for none); nil when
-- no outcome is stored; false and what was found for a record these scripts do not write (read
-- with pcall and checked, so one foreign record answers UNREADABLE for its key instead of failing
-- the whole call). Format 2 (complete.lua), a string at the stem: a status letter, the token
-- as 8 bytes big-endian, the value; after an upper-case letter the value is preceded by the
-- fingerprint and the original key, each after its 2-byte length. Format 1, the hash at the
-- result key: s, v, t, f, orig.
local LETTERS = {c = true, o = true, f = true}
local function holds(key, expected)
  return key .. ' holds a ' .. redis.call('TYPE', key)['ok'] .. ', not a ' .. expected
end
local function from_hash(result)
  local h = redis.pcall('HMGET', result, 's', 'v', 't', 'f')
  if h['err'] then return false, holds(result, 'hash') end
  if not h[1] then return nil end
  if not LETTERS[h[1]] then return false, 'format-1 record ' .. result .. ' has an unknown status' end
  return h[1], tonumber(h[3]) or 0, h[2] or '', h[4] or ''
end
local function from_string(stem, raw)
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
-- strings_first: this worker writes format 2, so a stored outcome is looked for at the stem first.
local function outcome(stem, result, strings_first)
  if not strings_first then  -- the format this worker writes is looked for first
    local status, token, value, fp = from_hash(result)
    if status ~= nil then return status, token, value, fp end
  end
  local raw = redis.pcall('GET', stem)
  if type(raw) == 'table' then return false, holds(stem, 'string') end
  if not raw then
    if strings_first then return from_hash(result) end
    return nil
  end
  return from_string(stem, raw)
end

-- The claim's fields, one HSET, and the started key's expiry. An empty fingerprint or original
-- key is not written (a missing field reads as ''), so a first claim without them writes three
-- fields.
local function take(started, token, fp, orig, deadline, expire_at)
  if fp == '' and orig == '' then
    redis.call('HSET', started, 'next', token, 'owner', token, 'deadline', deadline)
  elseif orig == '' then
    redis.call('HSET', started, 'next', token, 'owner', token, 'deadline', deadline, 'fp', fp)
  elseif fp == '' then
    redis.call('HSET', started, 'next', token, 'owner', token, 'deadline', deadline, 'orig', orig)
  else
    redis.call('HSET', started, 'next', token, 'owner', token, 'deadline', deadline, 'fp', fp, 'orig', orig)
  end
  redis.call('PEXPIREAT', started, expire_at)
end

-- per call
local lease_ms, retention_ms = tonumber(ARGV[1]), tonumber(ARGV[2])
local strings_first = #ARGV == 2 * #KEYS / 3 + 3 and ARGV[#ARGV] == '2'
-- Redis' clock, read at the first key that is not a duplicate (a duplicate needs no clock).
local now_ms, now_us, now_us_s, deadline, expire_at
local out, n = {}, 0
for i = 1, #KEYS / 3 do
  local started, stem, result = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local fp, orig = ARGV[2 * i + 1], ARGV[2 * i + 2]
  if redis.call('EXISTS', started, stem, result) == 0 then
    if not now_ms then
      now_ms, now_us, now_us_s, deadline, expire_at = clock(lease_ms, retention_ms)
    end
    -- Never claimed (or its records expired): the token is the clock, max(0 + 1, now_us).
    take(started, now_us_s, fp, orig, deadline, expire_at)
    out[n + 1] = 1; out[n + 2] = now_us; out[n + 3] = false; out[n + 4] = false; n = n + 4
  else
    local status, stored_token, value, stored_fp = outcome(stem, result, strings_first)
    local st = status == nil and redis.pcall('HMGET', started, 'next', 'owner', 'deadline', 'fp')
    if st and st['err'] then status, stored_token = false, holds(started, 'hash') end
    if status == false then
      out[n + 1] = 5; out[n + 2] = 0; out[n + 3] = stored_token; out[n + 4] = false; n = n + 4
    elseif status then
      if fp ~= '' and stored_fp ~= '' and stored_fp ~= fp then
        out[n + 1] = 4; out[n + 2] = 0; out[n + 3] = false; out[n + 4] = false; n = n + 4
      else
        out[n + 1] = 2; out[n + 2] = stored_token; out[n + 3] = status; out[n + 4] = value; n = n + 4
      end
    else
      if not now_ms then
        now_ms, now_us, now_us_s, deadline, expire_at = clock(lease_ms, retention_ms)
      end
      local owner = tonumber(st[2]) or 0
      local until_ms = tonumber(st[3]) or 0
      if owner > 0 and until_ms > now_ms then
        if fp ~= '' and st[4] and st[4] ~= '' and st[4] ~= fp then
          out[n + 1] = 4; out[n + 2] = 0; out[n + 3] = false; out[n + 4] = false; n = n + 4
        else
          out[n + 1] = 3; out[n + 2] = owner; n = n + 2
          out[n + 1] = until_ms - now_ms; out[n + 2] = false; n = n + 2
        end
      else
        local next_token = (tonumber(st[1]) or 0) + 1
        local token, token_s = now_us, now_us_s
        if next_token > now_us then token, token_s = next_token, string.format('%.0f', next_token) end
        -- the fingerprint of the claim this one takes over is not ours
        if fp == '' and st[4] and st[4] ~= '' then redis.call('HDEL', started, 'fp') end
        take(started, token_s, fp, orig, deadline, expire_at)
        out[n + 1] = 1; out[n + 2] = token; out[n + 3] = 1; out[n + 4] = false; n = n + 4
      end
    end
  end
end
return out
