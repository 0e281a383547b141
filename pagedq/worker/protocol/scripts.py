"""Lua scripts: the operations that must be atomic (Redis 6.2+ commands only).

Every Lua script of pagedq is registered here (ALL); those of bulk runs and the Batch API's files are written in
bulk_scripts.py. Loaded once with SCRIPT LOAD and called by sha: single calls through
call()/acall(), which reload on NOSCRIPT (e.g. after a Redis restart); the worker's pipelined FINALIZE and
DEAD_RAW calls are re-sent on NOSCRIPT by Publisher.check (redis-py's Script objects would add a SCRIPT
EXISTS round trip to every pipeline).
"""

from __future__ import annotations

import hashlib
from typing import Any

from redis.exceptions import NoScriptError

from pagedq.worker.protocol.bulk_scripts import (
    APPEND_ONCE,
    BULK_ENQUEUE,
    FORGET_EXPIRED,
    INDEX_ADD,
    RELEASE_FILE,
    RESERVE_FILE,
)

# Write each job's final record only if it has none, and acknowledge (and delete) its job entry in the
# same atomic step: a job is done exactly when its final record exists, and a redelivered copy is just
# acked. One call finalises a whole step's worth of jobs (fewer commands to encode and parse).
# KEYS: completions, cancelled, ids, runs, then per job: final, result, its band's job stream and dead letters
# ARGV: group, ttl_s, completions_maxlen, then per job: entry_id ('' if none), job_id, final_json,
# dead_json ('' if none)
# Returns one 1 (written) or 0 (it had a final record already) per job.
FINALIZE = """
local written = {}
for i = 0, (#ARGV - 3) / 4 - 1 do
  local entry, job_id, final, dead = ARGV[4 + i * 4], ARGV[5 + i * 4], ARGV[6 + i * 4], ARGV[7 + i * 4]
  local final_key, result_key, jobs_key, dead_key = KEYS[5 + i * 4], KEYS[6 + i * 4], KEYS[7 + i * 4], KEYS[8 + i * 4]
  local fresh = redis.call('EXISTS', final_key) == 0
  if fresh then
    redis.call('SET', final_key, final, 'EX', ARGV[2])
    redis.call('XADD', result_key, '*', 'type', 'final', 'data', final)
    redis.call('EXPIRE', result_key, ARGV[2])
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*', 'id', job_id, 'data', final)
    if dead ~= '' then
      redis.call('XADD', dead_key, '*', 'id', job_id, 'data', dead)
    end
    redis.call('ZREM', KEYS[2], job_id)
  end
  redis.call('HDEL', KEYS[3], job_id)
  redis.call('HDEL', KEYS[4], job_id)
  if entry ~= '' then
    redis.call('XACK', jobs_key, ARGV[1], entry)
    redis.call('XDEL', jobs_key, entry)
  end
  written[#written + 1] = fresh and 1 or 0
end
return written
"""

# Enqueue jobs unless the queue would grow past a limit. The job stream only holds unfinished jobs
# (finalize deletes entries), so XLEN is the queue depth: waiting plus in flight.
# Each job goes to its band's stream; the limit holds per band (backpressure per band), all jobs or none.
# With a tenant limit, each tenant's unfinished jobs are counted in its set of job ids (KEYS per job: its
# tenant's set, or the ids hash when it has none or no limit is set): an id whose job has finished (no longer
# in the ids hash, which the final record clears) is pruned when the set reaches the limit, so the set stays
# within the limit and no final record has to know about tenants.
# Each job id is recorded in the ids hash (what CANCEL checks). 0 as a limit: no limit.
# KEYS: ids, then per job its band's job stream and its tenant's set
# ARGV: max_depth, field, max_tenant_queued, then (job_id, json, '1' when counted for a tenant else '') per job
SUBMIT = """
local limit, tenant_limit = tonumber(ARGV[1]), tonumber(ARGV[3])
local n = (#KEYS - 1) / 2
if limit > 0 then
  local adding = {}
  for k = 1, n do adding[KEYS[2 * k]] = (adding[KEYS[2 * k]] or 0) + 1 end
  for stream, count in pairs(adding) do
    local depth = redis.call('XLEN', stream)
    if depth + count > limit then return {'FULL', tostring(depth), stream} end
  end
end
if tenant_limit > 0 then
  local adding = {}
  for k = 1, n do
    if ARGV[3 + 3 * k] == '1' then adding[KEYS[1 + 2 * k]] = (adding[KEYS[1 + 2 * k]] or 0) + 1 end
  end
  for set, count in pairs(adding) do
    local depth = redis.call('SCARD', set)
    if depth + count > tenant_limit then
      for _, id in ipairs(redis.call('SMEMBERS', set)) do
        if redis.call('HEXISTS', KEYS[1], id) == 0 then redis.call('SREM', set, id) end
      end
      depth = redis.call('SCARD', set)
      if depth + count > tenant_limit then return {'FULL', tostring(depth), set} end
    end
  end
end
local ids = {'OK'}
for k = 1, n do
  local job_id = ARGV[1 + 3 * k]
  redis.call('HSET', KEYS[1], job_id, 1)
  if ARGV[3 + 3 * k] == '1' then redis.call('SADD', KEYS[1 + 2 * k], job_id) end
  ids[#ids + 1] = redis.call('XADD', KEYS[2 * k], '*', ARGV[2], ARGV[2 + 3 * k])
end
return ids
"""

# Renew the lease of entries this consumer still owns (XCLAIM by the owner with min-idle 0 and JUSTID
# resets the idle time without counting a delivery). Entries another worker has claimed meanwhile are
# left alone and returned, so a renewal never steals a job back.
# KEYS: jobs; ARGV: group, consumer, id...
RENEW = """
local lost, args = {}, {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then args[#args + 1] = ARGV[i] else lost[#lost + 1] = ARGV[i] end
end
if #args > 5 then
  args[#args + 1] = 'JUSTID'
  redis.call(unpack(args))
end
return lost
"""

# A stopping worker hands back what it holds, so nothing waits out a lease on a worker known to be gone. An entry
# it never started is re-added to its stream as a fresh entry (the job's JSON, its id kept) and its old one
# acknowledged and deleted: any worker reads it as new, not as a dead worker's suspect. An entry that did run (or
# was itself recovered) is made idle past the lease, so the next claim takes it as the recovered job it is.
# Entries another worker has claimed meanwhile are left alone.
# KEYS: jobs; ARGV: group, consumer, lease_ms, job field, then (entry_id, job json or '' to release) pairs
# Returns {re-added, released}.
HAND_BACK = """
local readded, released = 0, 0
for i = 5, #ARGV, 2 do
  local entry, job = ARGV[i], ARGV[i + 1]
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], entry, entry, 1)
  if p[1] and p[1][2] == ARGV[2] then
    if job ~= '' then
      redis.call('XADD', KEYS[1], '*', ARGV[4], job)
      redis.call('XACK', KEYS[1], ARGV[1], entry)
      redis.call('XDEL', KEYS[1], entry)
      readded = readded + 1
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, entry, 'IDLE', ARGV[3], 'JUSTID')
      released = released + 1
    end
  end
end
return {readded, released}
"""

# Request cancellation of a known, unfinished job: one with no final record whose id a client submitted
# or a worker has read (the ids hash). An unknown id leaves nothing behind.
# KEYS: final, cancelled, ids; ARGV: job_id, now
CANCEL = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""

# An entry that could not even be rejected: copy it raw to the dead-letter stream and acknowledge it, in
# one step (a crash in between would dead-letter it twice or lose it).
# KEYS: jobs, dead; ARGV: group, entry_id, letter id, data_json, raw
DEAD_RAW = """
redis.call('XADD', KEYS[2], '*', 'id', ARGV[3], 'data', ARGV[4], 'raw', ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""

# `pagedq dlq retry`: re-enqueue a dead job as a fresh attempt under its id. Only the caller that removes the
# dead entry re-enqueues, so two concurrent retries of one letter enqueue it once.
# KEYS: dead, jobs, final, result, ids; ARGV: dead entry id, job json, job field, job id
DLQ_RETRY = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('HSET', KEYS[5], ARGV[4], 1)
redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[2])
return 1
"""

# The LoRA adapter registry (protocol/registry.py): add an adapter unless its name is taken or the registry is full,
# and bump the version workers watch. KEYS: registry hash, version. ARGV: name, entry JSON, the most adapters.
# Returns 1 (added), 0 (the name is registered already), -1 (full).
LORA_REGISTER = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return 0
end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then
  return -1
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('INCR', KEYS[2])
return 1
"""

# KEYS: registry hash, version. ARGV: name. Returns 1 when it was registered.
LORA_UNREGISTER = """
local gone = redis.call('HDEL', KEYS[1], ARGV[1])
if gone == 1 then
  redis.call('INCR', KEYS[2])
end
return gone
"""

ALL = {
    "finalize": FINALIZE,
    "submit": SUBMIT,
    "renew": RENEW,
    "hand_back": HAND_BACK,
    "cancel": CANCEL,
    "dead_raw": DEAD_RAW,
    "bulk_enqueue": BULK_ENQUEUE,
    "forget_expired": FORGET_EXPIRED,
    "dlq_retry": DLQ_RETRY,
    "append_once": APPEND_ONCE,
    "reserve_file": RESERVE_FILE,
    "release_file": RELEASE_FILE,
    "index_add": INDEX_ADD,
    "lora_register": LORA_REGISTER,
    "lora_unregister": LORA_UNREGISTER,
}
SHA = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in ALL.items()}


def call(redis_client, name: str, keys: list[str], args: list) -> Any:
    """Run a script by sha (sync client), loading the scripts once on NOSCRIPT (a restarted Redis)."""
    command = ("EVALSHA", SHA[name], len(keys), *keys, *args)
    try:
        return redis_client.execute_command(*command)
    except NoScriptError:
        load_all(redis_client)
        return redis_client.execute_command(*command)


async def acall(redis_client, name: str, keys: list[str], args: list) -> Any:
    """call() for redis.asyncio clients."""
    command = ("EVALSHA", SHA[name], len(keys), *keys, *args)
    try:
        return await redis_client.execute_command(*command)
    except NoScriptError:
        await aload_all(redis_client)
        return await redis_client.execute_command(*command)


def load_all(redis_client) -> None:
    """SCRIPT LOAD every script (sync client)."""
    for src in ALL.values():
        redis_client.script_load(src)


async def aload_all(redis_client) -> None:
    for src in ALL.values():
        await redis_client.script_load(src)
