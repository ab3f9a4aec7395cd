-- claim.lua: try to take the claim on one or more message keys (state: free -> claimed).
--
-- KEYS[2i-1] - the started key of message i (hash: next, owner, deadline, fp, orig)
-- KEYS[2i]   - the result key of message i  (hash: s, v, t, f, orig)
-- ARGV[1]    - lease in milliseconds
-- ARGV[2]    - retention in milliseconds: how long the started key (and with it the token
--              counter) outlives the lease
-- ARGV[2i+1] - payload fingerprint of message i ('' means "do not check")
-- ARGV[2i+2] - the original key of message i when the Redis key holds its hash, else ''
--
-- Returns four values per message, in order:
--   {1, token, false, false}            ACQUIRED: we own the claim under a new fencing token
--   {2, token, status, value}           DUPLICATE: an outcome is stored (status 'c' completed,
--                                       'o' completed with the body omitted, 'f' failed)
--   {3, owner_token, remaining_ms, false} IN_PROGRESS: a live lease is held by another token
--   {4, 0, false, false}                CONFLICT: the key was used with another fingerprint
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
local lease_ms = tonumber(ARGV[1])
local retention_ms = tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl_ms = math.max(lease_ms, retention_ms)
local out, n = {}, 0
for i = 1, #KEYS / 2 do
  local started, result = KEYS[2 * i - 1], KEYS[2 * i]
  local fp, orig = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local done = redis.call('HMGET', result, 's', 'v', 't', 'f')
  if done[1] then
    if fp ~= '' and done[4] and done[4] ~= '' and done[4] ~= fp then
      out[n + 1] = 4; out[n + 2] = 0; out[n + 3] = false; out[n + 4] = false; n = n + 4
    else
      out[n + 1] = 2; out[n + 2] = tonumber(done[3]) or 0; n = n + 2
      out[n + 1] = done[1]; out[n + 2] = done[2] or ''; n = n + 2
    end
  else
    local st = redis.call('HMGET', started, 'next', 'owner', 'deadline', 'fp')
    local owner = tonumber(st[2]) or 0
    local deadline = tonumber(st[3]) or 0
    if owner > 0 and deadline > now_ms then
      if fp ~= '' and st[4] and st[4] ~= '' and st[4] ~= fp then
        out[n + 1] = 4; out[n + 2] = 0; out[n + 3] = false; out[n + 4] = false; n = n + 4
      else
        out[n + 1] = 3; out[n + 2] = owner; n = n + 2
        out[n + 1] = deadline - now_ms; out[n + 2] = false; n = n + 2
      end
    else
      local token = math.max((tonumber(st[1]) or 0) + 1, now_us)
      redis.call('HSET', started, 'next', token, 'owner', token,
                 'deadline', now_ms + lease_ms, 'fp', fp)
      if orig ~= '' then redis.call('HSET', started, 'orig', orig) end
      redis.call('PEXPIRE', started, ttl_ms)
      out[n + 1] = 1; out[n + 2] = token; out[n + 3] = false; out[n + 4] = false; n = n + 4
    end
  end
end
return out
