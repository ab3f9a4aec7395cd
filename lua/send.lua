-- send.lua: decide whether a producer publishes a message for a key (state: free -> sent;
-- every other answer changes nothing).
--
-- KEYS[1] - the started key (claim.lua's: owner, deadline, fp, next)
-- KEYS[2] - the stem        (complete.lua's outcome in record format 2)
-- KEYS[3] - the result key  (complete.lua's outcome in record format 1)
-- KEYS[4] - the send mark   (hash: id, until, fp, n)
-- ARGV[1] - the task id of this send (recorded in the mark when it publishes)
-- ARGV[2] - send TTL in milliseconds: how long the mark answers "queued" (countdown included)
-- ARGV[3] - keep in milliseconds: how long the mark's task id outlives that (the result TTL),
--           so a send after completion can still name the task that produced the outcome
-- ARGV[4] - payload fingerprint of this send ('' means "do not check")
--
-- Returns {code, token, a, b, task_id}:
--   {1, 0, send_ttl_ms, false, id}      PUBLISH: nothing holds the key; the mark now records id
--   {2, token, status, value, id}       DONE: an outcome is stored (status 'c', 'o' or 'f', as in
--                                       claim.lua); id is the mark's task id, '' when unknown
--   {3, owner_token, remaining_ms, false, id} RUNNING: a live lease holds the key and the mark
--                                       names the task sent for it
--   {4, 0, false, false, false}         CONFLICT: the claim, outcome or live mark carries
--                                       another fingerprint
--   {5, 0, remaining_ms, false, id}     QUEUED: a live mark, no claim yet (sent, not started)
--   an error reply 'UNREADABLE ...'     a record under the key's names is not one these scripts
--                                       write (claim.lua answers UNREADABLE for it)
--
-- The mark is a hint, never a lock: a live lease with no mark (the task was sent without this
-- check) answers PUBLISH, and a mark whose 'until' passed no longer answers QUEUED, so a message
-- lost in the broker or a worker killed before it claimed blocks sends for at most the send TTL.
-- A mark also records the started key's token counter ('next', '' when none) as 'n': once a
-- claim has been taken since (the counter moved), the task it names has been started, so when no
-- live lease holds the key it was released (a retryable failure) or its worker died, and the mark
-- no longer answers QUEUED: the send publishes. A publish that failed is taken back by unsend.lua.
-- The worker's claim still makes the body run once whatever this answers. Every record written
-- here expires (PEXPIREAT at until + keep); the started and result keys are only read, with the
-- fields claim.lua reads, so records of every release are understood. The fingerprint and the
-- counter are written only when non-empty (a missing field reads as '').
--
-- Up to the "per call" line the script only defines helpers: called as a function (FCALL), the
-- library defines them once, when it is loaded.
--
-- A record these scripts do not write (another program's key of another type, a format-2 string
-- shorter than its head) is answered with an error reply naming it, for this send alone, never a
-- Lua error: the producer publishes (this check is a hint) and the worker's claim.lua answers
-- UNREADABLE for the key.
local function unreadable(key)
  return redis.error_reply('UNREADABLE ' .. key .. ' holds a ' .. redis.call('TYPE', key)['ok']
                           .. ' that is not a record of ours')
end
-- The stored outcome in either format (see complete.lua): status, token, value, fingerprint
-- ('' for none); nil when no outcome is stored. Format 2 is a string at the stem, format 1 a hash
-- at the result key; at most one of them exists.
local function outcome(stem, result)
  local raw = redis.pcall('GET', stem)
  if type(raw) == 'table' then return false, unreadable(stem) end
  if not raw then
    local h = redis.pcall('HMGET', result, 's', 'v', 't', 'f')
    if h['err'] then return false, unreadable(result) end
    if not h[1] then return nil end
    return h[1], tonumber(h[3]) or 0, h[2] or '', h[4] or ''
  end
  if #raw < 9 then return false, unreadable(stem) end
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(raw, 2, 9)
  local token = ((((((b1 * 256 + b2) * 256 + b3) * 256 + b4) * 256 + b5) * 256 + b6) * 256 + b7) * 256 + b8
  local status = string.sub(raw, 1, 1)
  local lower = string.lower(status)
  if status == lower then return status, token, string.sub(raw, 10), '' end
  local fl = #raw >= 11 and string.byte(raw, 10) * 256 + string.byte(raw, 11) or #raw
  local ol = #raw >= 13 + fl and string.byte(raw, 12 + fl) * 256 + string.byte(raw, 13 + fl) or #raw
  if #raw < 13 + fl + ol then return false, unreadable(stem) end
  return lower, token, string.sub(raw, 14 + fl + ol), string.sub(raw, 12, 11 + fl)
end

-- per call
local fp = ARGV[4]
local status, token, value, stored_fp = outcome(KEYS[2], KEYS[3])
if status == false then return token end
if status then
  if fp ~= '' and stored_fp ~= '' and stored_fp ~= fp then return {4, 0, false, false, false} end
  return {2, token, status, value, redis.call('HGET', KEYS[4], 'id') or ''}
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local st = redis.pcall('HMGET', KEYS[1], 'owner', 'deadline', 'fp', 'next')
if st['err'] then return unreadable(KEYS[1]) end
local mark = redis.pcall('HMGET', KEYS[4], 'id', 'until', 'fp', 'n')
if mark['err'] then return unreadable(KEYS[4]) end
local counter = st[4] or ''
local owner = tonumber(st[1]) or 0
local deadline = tonumber(st[2]) or 0
if owner > 0 and deadline > now_ms then
  if fp ~= '' and st[3] and st[3] ~= '' and st[3] ~= fp then return {4, 0, false, false, false} end
  if mark[1] then return {3, owner, deadline - now_ms, false, mark[1]} end
else
  local until_ms = tonumber(mark[2]) or 0
  if mark[1] and until_ms > now_ms and (mark[4] or '') == counter then
    if fp ~= '' and mark[3] and mark[3] ~= '' and mark[3] ~= fp then return {4, 0, false, false, false} end
    return {5, 0, until_ms - now_ms, false, mark[1]}
  end
end
local ttl_ms = tonumber(ARGV[2])
local until_s = string.format('%d', now_ms + ttl_ms)
local fields = {'id', ARGV[1], 'until', until_s}
if fp ~= '' then fields[#fields + 1] = 'fp'; fields[#fields + 1] = fp end
if counter ~= '' then fields[#fields + 1] = 'n'; fields[#fields + 1] = counter end
redis.call('DEL', KEYS[4])  -- no field of an earlier mark survives (fp, n)
redis.call('HSET', KEYS[4], unpack(fields))
redis.call('PEXPIREAT', KEYS[4], string.format('%d', now_ms + ttl_ms + tonumber(ARGV[3])))
return {1, 0, ttl_ms, false, ARGV[1]}
