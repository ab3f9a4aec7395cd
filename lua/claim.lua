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
-- key's records live: after an expiry or a release the next claimant gets next + 1.
local lease_ms = tonumber(ARGV[1])
local retention_ms = tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl_ms = math.max(lease_ms, retention_ms)
local out = {}
for i = 1, #KEYS / 2 do
  local started, result = KEYS[2 * i - 1], KEYS[2 * i]
  local fp, orig = ARGV[2 * i + 1], ARGV[2 * i + 2]
  local done = redis.call('HMGET', result, 's', 'v', 't', 'f')
  if done[1] then
    if fp ~= '' and done[4] and done[4] ~= '' and done[4] ~= fp then
      table.insert(out, 4); table.insert(out, 0); table.insert(out, false); table.insert(out, false)
    else
      table.insert(out, 2); table.insert(out, tonumber(done[3]) or 0)
      table.insert(out, done[1]); table.insert(out, done[2] or '')
    end
  else
    local st = redis.call('HMGET', started, 'next', 'owner', 'deadline', 'fp')
    local owner = tonumber(st[2]) or 0
    local deadline = tonumber(st[3]) or 0
    if owner > 0 and deadline > now_ms then
      if fp ~= '' and st[4] and st[4] ~= '' and st[4] ~= fp then
        table.insert(out, 4); table.insert(out, 0); table.insert(out, false); table.insert(out, false)
      else
        table.insert(out, 3); table.insert(out, owner)
        table.insert(out, deadline - now_ms); table.insert(out, false)
      end
    else
      local token = (tonumber(st[1]) or 0) + 1
      redis.call('HSET', started, 'next', token, 'owner', token,
                 'deadline', now_ms + lease_ms, 'fp', fp)
      if orig ~= '' then redis.call('HSET', started, 'orig', orig) end
      redis.call('PEXPIRE', started, ttl_ms)
      table.insert(out, 1); table.insert(out, token); table.insert(out, false); table.insert(out, false)
    end
  end
end
return out
