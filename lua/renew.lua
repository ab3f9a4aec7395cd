#!lua flags=allow-oom
-- renew.lua: extend the lease of claims we still own (state: claimed -> claimed, later deadline).
-- The first line lets the script run at maxmemory (Redis 7 script flags, allow-oom): finishing
-- or giving back work must never be refused for memory. Redis 6 gets the script without it.
--
-- KEYS[i]   - the started key of message i
-- ARGV[1]   - new lease in milliseconds, counted from now on Redis' clock
-- ARGV[2]   - retention in milliseconds for the started key
-- ARGV[i+2] - the fencing token of message i's claim
--
-- Returns one value per message: 1 when the lease was extended, 0 when the token no longer
-- owns the claim (completed, released, or taken over by a larger token after expiry).
-- A lease that ran out but was not yet taken by anyone is still ours and is extended. A started
-- key of another type (another program's value) answers 0 for its message (read with pcall),
-- never an error for the whole call.
local lease_ms = tonumber(ARGV[1])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Made once as strings: Redis formats every number argument of every call.
local deadline = string.format('%d', now_ms + lease_ms)
local expire_at = string.format('%d', now_ms + math.max(lease_ms, tonumber(ARGV[2])))
local out, n = {}, 0
for i = 1, #KEYS do
  local owner = redis.pcall('HGET', KEYS[i], 'owner')
  if type(owner) == 'string' and owner == ARGV[i + 2] then
    redis.call('HSET', KEYS[i], 'deadline', deadline)
    redis.call('PEXPIREAT', KEYS[i], expire_at)
    out[n + 1] = 1; n = n + 1
  else
    out[n + 1] = 0; n = n + 1
  end
end
return out
