#!lua flags=allow-oom
-- unsend.lua: take back the send mark of a publish that raised (state: sent -> free).
-- The first line lets the script run at maxmemory (Redis 7 script flags, allow-oom): giving
-- back a mark must never be refused for memory. Redis 6 gets the script without it.
--
-- KEYS[1] - the send mark (send.lua's hash: id, until, fp, n)
-- ARGV[1] - the task id whose publish raised
--
-- Returns 1 when the mark was removed, 0 when it names another task (a later send's mark, left
-- as it is) or is gone.
if redis.call('HGET', KEYS[1], 'id') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
