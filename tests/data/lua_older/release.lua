-- release.lua: give up claims we still own after a retryable failure (state: claimed -> free).
--
-- KEYS[2i-1] - the started key of message i
-- KEYS[2i]   - the notice list of message i (see watch.lua)
-- ARGV[1]    - retention in milliseconds for the started key (keeps the token counter)
-- ARGV[i+1]  - the fencing token of message i's claim
--
-- Returns one value per message: 1 when released, 0 when the token no longer owned the
-- claim (nothing is changed: the successor's lease stays). The token counter is kept, so
-- the next claimant gets a larger token than ours. Waiters counted by watch.lua get one
-- notice each (they claim again at once); with no waiter nothing more is written.
local NOTICE_TTL_MS = 10000
local retention_ms = tonumber(ARGV[1])
local out, n = {}, 0
for i = 1, #KEYS / 2 do
  local started, notice = KEYS[2 * i - 1], KEYS[2 * i]
  local st = redis.call('HMGET', started, 'owner', 'w')
  if st[1] and st[1] == ARGV[i + 1] then
    redis.call('HSET', started, 'owner', 0, 'deadline', 0, 'fp', '')
    redis.call('PEXPIRE', started, retention_ms)
    local waiters = tonumber(st[2]) or 0
    if waiters > 0 then
      for _ = 1, waiters do redis.call('RPUSH', notice, ARGV[i + 1]) end
      redis.call('PEXPIRE', notice, NOTICE_TTL_MS)
      redis.call('HSET', started, 'w', 0)
    end
    out[n + 1] = 1; n = n + 1
  else
    out[n + 1] = 0; n = n + 1
  end
end
return out
