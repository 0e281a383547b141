"""The Lua scripts of `pagedq bulk` runs and the Batch API's runs and files (scripts.py registers and calls them):
a run's enqueue within the queue's limits, its expired results, the batch output files' lines, the owners'
file quotas and the owners' indexes of their files and batches."""

# `pagedq bulk` and the Batch API: enqueue a run's jobs in order unless an earlier (interrupted) run of it already
# did (a job id already in the run's set is awaited, not re-sent), while the band's stream is below max_depth and
# the tenant's set of unfinished jobs below tenant_limit (the limits of SUBMIT, counted the same way, so a batch
# waits for room instead of crowding out requests). 0 as a limit: no limit.
# KEYS: jobs, the run's enqueued set, ids, the tenant's set (ids when the jobs are not counted for a tenant)
# ARGV: ttl_s, job field, max_depth, tenant_limit, then (job_id, job_json) pairs
# Returns {taken, sent}: the first `taken` jobs are the run's now (`sent` of them enqueued here); the rest wait.
BULK_ENQUEUE = """
local limit, tenant_limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local counted = tenant_limit > 0 and KEYS[4] ~= KEYS[3]
local depth = limit > 0 and redis.call('XLEN', KEYS[1]) or 0
local owned = counted and redis.call('SCARD', KEYS[4]) or 0
local pruned = false
local taken, sent = 0, 0
for i = 5, #ARGV, 2 do
  if redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 0 then
    if limit > 0 and depth >= limit then break end
    if counted and owned >= tenant_limit and not pruned then
      for _, id in ipairs(redis.call('SMEMBERS', KEYS[4])) do
        if redis.call('HEXISTS', KEYS[3], id) == 0 then redis.call('SREM', KEYS[4], id) end
      end
      owned, pruned = redis.call('SCARD', KEYS[4]), true
    end
    if counted and owned >= tenant_limit then break end
    redis.call('SADD', KEYS[2], ARGV[i])
    redis.call('HSET', KEYS[3], ARGV[i], 1)
    redis.call('XADD', KEYS[1], '*', ARGV[2], ARGV[i + 1])
    if counted then
      redis.call('SADD', KEYS[4], ARGV[i])
      owned = owned + 1
    end
    depth, sent = depth + 1, sent + 1
  end
  taken = taken + 1
end
redis.call('EXPIRE', KEYS[2], ARGV[1])
return {taken, sent}
"""

# A run's jobs whose result expired before the run collected it (the worker's result TTL is shorter than a resume
# may come): no final record and no longer unfinished (the ids hash, which FINALIZE clears with the record's
# write). They leave the run's enqueued set, so the run enqueues them again.
# KEYS: the run's enqueued set, ids, then each job's final key; ARGV: the job ids. Returns the ids it forgot.
FORGET_EXPIRED = """
local gone = {}
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[2 + i]) == 0 and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then
    redis.call('SREM', KEYS[1], ARGV[i])
    gone[#gone + 1] = ARGV[i]
  end
end
return gone
"""

# The gateway's Batch API output files: write each answer once, and nothing once the batch or the file is gone
# (expired or deleted). The answered set and the line list expire with their batch and file, and the file keeps
# the running size of its lines (GET /v1/files/{id} reads it) unless it was declared before it had one.
# KEYS: the batch's answered set, the batch, the file's line list, the file; ARGV: answer key, line.
# Returns 1 (written), 0 (answered before) or -1 (its batch or file is gone).
APPEND_ONCE = """
local batch_ttl, file_ttl = redis.call('PTTL', KEYS[2]), redis.call('PTTL', KEYS[4])
if batch_ttl == -2 or file_ttl == -2 then return -1 end
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])
if redis.call('HEXISTS', KEYS[4], 'bytes') == 1 then redis.call('HINCRBY', KEYS[4], 'bytes', #ARGV[2] + 1) end
if batch_ttl > 0 then redis.call('PEXPIRE', KEYS[1], batch_ttl) end
if file_ttl > 0 then redis.call('PEXPIRE', KEYS[3], file_ttl) end
return 1
"""

# Lua: take a file out of its owner's quota. KEYS[1]: the owner's files (sorted by expiry), KEYS[2]: their sizes
# by file id and the running sum of them, field 'total' (a sum kept as files come and go, never recounted).
_FORGET_FILE = """
local function forget(id)
  local size = redis.call('HGET', KEYS[2], id)
  if size then
    redis.call('HDEL', KEYS[2], id)
    redis.call('HINCRBY', KEYS[2], 'total', -tonumber(size))
  end
  redis.call('ZREM', KEYS[1], id)
end
"""

# Reserve room in an owner's file quota for an upload: forget the owner's expired files, then add this one unless
# the owner would keep more than max_files files or max_bytes bytes. The owner's keys live as long as its
# longest-lived file. The upload itself is written next (a gateway dying in between leaves a reservation that
# expires with the ttl: the quota errs on the side of counting).
# KEYS: the owner's files, the owner's file sizes; ARGV: now_ms, ttl_ms, file_id, size, max_files, max_bytes
# Returns {'OK'}, or {'files' or 'bytes', what the owner keeps now}.
RESERVE_FILE = (
    _FORGET_FILE
    + """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do forget(id) end
local count = redis.call('ZCARD', KEYS[1])
if count + 1 > tonumber(ARGV[5]) then return {'files', tostring(count)} end
local used = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
if used + tonumber(ARGV[4]) > tonumber(ARGV[6]) then return {'bytes', tostring(used)} end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
redis.call('HINCRBY', KEYS[2], 'total', ARGV[4])
for i = 1, 2 do
  if redis.call('PTTL', KEYS[i]) < ttl then redis.call('PEXPIRE', KEYS[i], ttl) end
end
return {'OK'}
"""
)

# Free a deleted (or never written) upload's room in its owner's quota.
# KEYS: the owner's files, the owner's file sizes; ARGV: file_id
RELEASE_FILE = (
    _FORGET_FILE
    + """
forget(ARGV[1])
return 1
"""
)

# Add an object (a file or a batch) to its owner's index, a sorted set scored by expiry (what GET /v1/files and
# GET /v1/batches list): forget the ids that expired, add this one, and keep the index as long as its
# longest-lived object. Its order is creation order, every object living file_ttl_s.
# KEYS: the index; ARGV: now_ms, ttl_ms, id
INDEX_ADD = """
local now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
return 1
"""
