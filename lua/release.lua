#!lua flags=allow-oom
-- release.lua: give up claims we still own after a retryable failure (state: claimed -> free).
-- The first line lets the script run at maxmemory (Redis 7 script flags, allow-oom): finishing
-- or giving back work must never be refused for memory. Redis 6 gets the script without it.
--
-- KEYS[2i-1] - the started key of message i
-- KEYS[2i]   - the notice list of message i (see watch.lua)
-- ARGV[1]    - retention in milliseconds for the started key (keeps the token counter)
-- ARGV[i+1]  - the fencing token of message i's claim
--
-- Returns one value per message: 1 when released, 0 when the token no longer owned the
-- claim (nothing is changed: the successor's lease stays), or when another program's value of
-- another type holds the started key (read with pcall: an answer for that message, never an
-- error for the whole call). The token counter is kept, so
-- the next claimant gets a larger token than ours. Waiters counted by watch.lua get one
-- notice each (they claim again at once); with no waiter nothing more is written.
-- Only the owner is reset to 0: every reader takes a lease as live only when its owner is
-- non-zero, so the deadline and fingerprint of a released claim are never read (the next
-- claim writes its own).
local NOTICE_TTL_MS = 10000
local retention_ms = ARGV[1]  -- passed on as the string it is: Redis formats number arguments
-- At most this many notices at once: a count this large is not one watch.lua kept, and a waiter
-- not told wakes at its own deadline.
local MAX_NOTICES = 10000
local out, n = {}, 0
for i = 1, #KEYS / 2 do
  local started, notice = KEYS[2 * i - 1], KEYS[2 * i]
  local st = redis.pcall('HMGET', started, 'owner', 'w')
  if st['err'] then st = {} end  -- another type: not a claim of ours
  if st[1] and st[1] == ARGV[i + 1] then
    local waiters = tonumber(st[2]) or 0
    if waiters > 0 then
      redis.call('HSET', started, 'owner', '0', 'w', '0')
      -- a notice list of another type is replaced: its name is ours, and only waiters read it
      if redis.call('TYPE', notice)['ok'] ~= 'list' then redis.call('DEL', notice) end
      for _ = 1, math.min(waiters, MAX_NOTICES) do redis.call('RPUSH', notice, ARGV[i + 1]) end
      redis.call('PEXPIRE', notice, NOTICE_TTL_MS)
    else
      redis.call('HSET', started, 'owner', '0')
    end
    redis.call('PEXPIRE', started, retention_ms)
    out[n + 1] = 1; n = n + 1
  else
    out[n + 1] = 0; n = n + 1
  end
end
return out
