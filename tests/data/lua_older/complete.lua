-- complete.lua: record the outcome of claims we still own (state: claimed -> done).
--
-- KEYS[3i-2] - the started key of message i
-- KEYS[3i-1] - the result key of message i
-- KEYS[3i]   - the notice list of message i (see watch.lua)
-- ARGV[1]    - result TTL in milliseconds
-- ARGV[3i-1] - the fencing token of message i's claim
-- ARGV[3i]   - status of message i: 'c' completed, 'o' completed with the body omitted,
--              'f' failed permanently
-- ARGV[3i+1] - the serialised result (or error) of message i
--
-- Returns one value per message: 1 when the outcome was stored, 0 (LEASE_LOST) when the
-- token no longer owns the claim. A lost claim writes nothing, so a late worker can never
-- overwrite what its successor stored. The started key is deleted on success: once a
-- result exists every claim answers DUPLICATE, and the result keeps the final token.
-- When watch.lua counted waiters, one notice per waiter is pushed to the notice list (which
-- expires after NOTICE_TTL_MS); with no waiter nothing more is written.
-- A retry of a completion that already succeeded (its reply was lost in a failover or a
-- connection reset) answers 1 again: the stored result carries the same token.
local NOTICE_TTL_MS = 10000
local result_ttl_ms = tonumber(ARGV[1])
local out, n = {}, 0
for i = 1, #KEYS / 3 do
  local started, result, notice = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local token = ARGV[3 * i - 1]
  local st = redis.call('HMGET', started, 'owner', 'fp', 'orig', 'w')
  if st[1] and st[1] == token then
    redis.call('HSET', result, 's', ARGV[3 * i], 'v', ARGV[3 * i + 1], 't', token,
               'f', st[2] or '')
    if st[3] then redis.call('HSET', result, 'orig', st[3]) end
    redis.call('PEXPIRE', result, result_ttl_ms)
    redis.call('DEL', started)
    local waiters = tonumber(st[4]) or 0
    for _ = 1, waiters do redis.call('RPUSH', notice, token) end
    if waiters > 0 then redis.call('PEXPIRE', notice, NOTICE_TTL_MS) end
    out[n + 1] = 1; n = n + 1
  elseif not st[1] and redis.call('HGET', result, 't') == token then
    out[n + 1] = 1; n = n + 1
  else
    out[n + 1] = 0; n = n + 1
  end
end
return out
