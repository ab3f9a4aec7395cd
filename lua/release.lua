-- release.lua: give up claims we still own after a retryable failure (state: claimed -> free).
--
-- KEYS[i]  - the started key of message i
-- ARGV[1]  - retention in milliseconds for the started key (keeps the token counter)
-- ARGV[i+1] - the fencing token of message i's claim
--
-- Returns one value per message: 1 when released, 0 when the token no longer owned the
-- claim (nothing is changed: the successor's lease stays). The token counter is kept, so
-- the next claimant gets a larger token than ours.
local retention_ms = tonumber(ARGV[1])
local out, n = {}, 0
for i = 1, #KEYS do
  local owner = redis.call('HGET', KEYS[i], 'owner')
  if owner and owner == ARGV[i + 1] then
    redis.call('HSET', KEYS[i], 'owner', 0, 'deadline', 0, 'fp', '')
    redis.call('PEXPIRE', KEYS[i], retention_ms)
    out[n + 1] = 1; n = n + 1
  else
    out[n + 1] = 0; n = n + 1
  end
end
return out
