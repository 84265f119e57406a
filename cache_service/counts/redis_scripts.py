"""The Lua scripts of the Redis backend: one per atomic step, each over keys of one slot, with the KEYS and ARGV it takes.

Every write of the Redis backend is one of these scripts over keys of one shard (see
`schema`), so it runs atomically on the shard's node, even on a Cluster:

* APPLY adds one unit of a batch (the batch's entries in one shard) and records
  (client_id, seq) in the shard's dedup set in the same script; a unit already recorded is
  skipped. For `apply_group` a unit is the sum of several batches (of any clients) in one
  shard: the script checks every (client_id, seq) first and writes the summed increments
  and every dedup record only if none was recorded before; otherwise it writes nothing
  and says which were, and the unit is sent again without them. APPLY's dedup check is the
  rule of `dedup.DedupWindow`.
* TICK advances the namespace's version at most once per ``epoch_seconds`` (the rule of
  `versions.EpochClock`).
* ROLL closes a shard's open change piece when the version moved, trims history below the
  floor and returns the pieces a reader needs; SEAL rewrites a closed piece as the union of
  its roaring bitmaps; READ returns bucket contents packed for numpy.
* HAPPEND appends batches of fleet history records (one sender's, or several gathered by
  the service) to one partition, each exactly once per (client id, batch_seq), skips
  near-duplicates and trims by the budget; HREAD trims and reads after a stream id (the
  rules of `history`).
* CREATE makes a namespace visible once its shard state exists; ACQUIRE, RENEW, RELEASE and
  COMMIT are the rebuild lease's steps (the rules of `leases`); FORGET_BASE clears a dropped
  namespace's corpus base.

Every script is idempotent, or checks the state it changes first, so redis-py's bounded
reconnect retries and the NOSCRIPT fallback (load, then run again) are safe.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, TypeAlias

__all__ = ["ACQUIRE", "APPLY", "COMMIT", "CREATE", "FORGET_BASE", "HAPPEND", "HREAD", "READ", "RELEASE", "RENEW", "ROLL", "SEAL", "TICK", "Call", "Script"]


class Script:
    """A Lua script run by EVALSHA; `RedisConnection.run` loads it on NOSCRIPT and runs it again."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


Call: TypeAlias = tuple[Script, Sequence[Any], Sequence[Any]]
"""(script, keys, args) of one EVALSHA."""


# One unit: the entries of one shard of a batch, or of a group of batches summed together.
# KEYS: state, changes, dedup keys (one per client in the unit, nd of them), bucket...
# ARGV: instance, window, ttl_ms, changed (portable roaring bitmap of the unit's local bucket
# ids), sizes ('<I4' entries per bucket, in KEYS order), entries (one packed string of
# fixed-size records: u8 field length, the field zero-padded to `width` bytes, '<i8'
# increment), width, nd, then per batch: its dedup key's index (1..nd) and its seq. One
# string instead of two arguments a delta keeps argument parsing (in Redis) and command
# packing (in the client) off the per-delta path.
# Every (client, seq) is checked first; only if none was applied before and none is older
# than the window are the increments, the change record and every dedup record written.
# Returns {1} (written), {-1} (another instance), or {0, status, hwm, status, hwm, ...}
# (nothing written): per batch 1 new, 0 applied before, -2 too old (hwm: that client's
# highest seq).
APPLY = Script("apply", """
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return {-1} end
local window = tonumber(ARGV[2])
local nd = tonumber(ARGV[8])
local top, hwm = {}, {}
for d = 1, nd do
  local t = redis.call('ZRANGE', KEYS[2 + d], -1, -1, 'WITHSCORES')
  top[d] = t[2] or '-1'
  hwm[d] = tonumber(top[d])
end
local out, clean = {0}, true
for a = 9, #ARGV, 2 do
  local d, seq = tonumber(ARGV[a]), ARGV[a + 1]
  if tonumber(seq) <= hwm[d] - window then
    out[#out + 1] = -2
    out[#out + 1] = top[d]
    clean = false
  elseif redis.call('ZSCORE', KEYS[2 + d], seq) then
    out[#out + 1] = 0
    out[#out + 1] = ''
    clean = false
  else
    out[#out + 1] = 1
    out[#out + 1] = ''
  end
end
if not clean then return out end
local sizes, entries = ARGV[5], ARGV[6]
local width = tonumber(ARGV[7])
local record = width + 9
local pos, p = 1, 1
for k = 3 + nd, #KEYS do
  local key, nf = KEYS[k]
  nf, pos = struct.unpack('<I4', sizes, pos)
  for _ = 1, nf do
    local field = string.sub(entries, p + 1, p + string.byte(entries, p))
    local inc = struct.unpack('<l', entries, p + 1 + width)
    if inc >= 1e13 then inc = string.format('%d', inc) end  -- beyond %.14g's exact integers
    redis.call('HINCRBY', key, field, inc)
    p = p + record
  end
end
redis.call('RPUSH', KEYS[2], ARGV[4])
for a = 9, #ARGV, 2 do
  local d, seq = tonumber(ARGV[a]), ARGV[a + 1]
  redis.call('ZADD', KEYS[2 + d], seq, seq)
  if tonumber(seq) > hwm[d] then hwm[d] = tonumber(seq) end
end
for d = 1, nd do
  redis.call('ZREMRANGEBYSCORE', KEYS[2 + d], '-inf', hwm[d] - window)
  redis.call('PEXPIRE', KEYS[2 + d], ARGV[3])
end
return {1}
""")

# KEYS: clock, epochs. ARGV: instance, epoch_ms, history_epochs. Returns {cur, floor}.
TICK = Script("tick", """
local c = redis.call('HMGET', KEYS[1], 'instance', 'cur', 't', 'floor')
if c[1] ~= ARGV[1] then return {-1} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local opened = tonumber(c[3])
if now > opened and now - opened >= tonumber(ARGV[2]) then
  local cur = string.format('%d', math.max(tonumber(c[2]) + 1, now))
  redis.call('LPUSH', KEYS[2], cur)
  redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[3]))
  local floor = redis.call('LINDEX', KEYS[2], -1)
  redis.call('HSET', KEYS[1], 'cur', cur, 't', string.format('%d', now), 'floor', floor)
  return {cur, floor}
end
return {c[2], c[4]}
""")

# KEYS: state, changes, history, index. ARGV: instance, cur, floor, since ('' = no read).
# Returns {1} or {1, open piece, piece name, piece, ...}; {-1} wrong instance; {-3} since < trim floor.
# A piece is b"L" + ('<I4' length, roaring bitmap)... or, once sealed, b"R" + one roaring bitmap.
ROLL = Script("roll", """
local function joined(parts)
  local out = {'L'}
  for i = 1, #parts do out[#out + 1] = struct.pack('<I4', #parts[i]) .. parts[i] end
  return table.concat(out)
end
local st = redis.call('HMGET', KEYS[1], 'instance', 'e', 'f')
if st[1] ~= ARGV[1] then return {-1} end
if tonumber(st[2]) < tonumber(ARGV[2]) then
  local parts = redis.call('LRANGE', KEYS[2], 0, -1)
  if #parts > 0 then
    local piece = st[2] .. ':' .. ARGV[2]
    redis.call('HSET', KEYS[3], piece, joined(parts))
    redis.call('ZADD', KEYS[4], ARGV[2], piece)
    redis.call('DEL', KEYS[2])
  end
  redis.call('HSET', KEYS[1], 'e', ARGV[2])
end
local f = tonumber(st[3])
if tonumber(ARGV[3]) > f then
  local old = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
  for i = 1, #old do redis.call('HDEL', KEYS[3], old[i]) end
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', ARGV[3])
  redis.call('HSET', KEYS[1], 'f', ARGV[3])
  f = tonumber(ARGV[3])
end
if ARGV[4] == '' then return {1} end
if tonumber(ARGV[4]) < f then return {-3} end
local out = {1, joined(redis.call('LRANGE', KEYS[2], 0, -1))}
local pieces = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. ARGV[4], '+inf')
for i = 1, #pieces do
  out[#out + 1] = pieces[i]
  out[#out + 1] = redis.call('HGET', KEYS[3], pieces[i]) or ''
end
return out
""")

# KEYS: state, history. ARGV: instance, piece, roaring bytes.
SEAL = Script("seal", """
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return -1 end
local v = redis.call('HGET', KEYS[2], ARGV[2])
if v and string.sub(v, 1, 1) == 'L' then
  redis.call('HSET', KEYS[2], ARGV[2], 'R' .. ARGV[3])
  return 1
end
return 0
""")

# KEYS: state, bucket... ARGV: instance, 5 * token_width.
# Returns {1, fields, counts}: each field as a length byte plus the field zero-padded to
# 5 * token_width bytes; counts as decimal text joined by ','.
READ = Script("read", """#!lua flags=no-writes
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return {-1} end
local size = tonumber(ARGV[2])
local pad = {}
for l = 0, size do pad[l] = string.rep('\\0', size - l) end
local fields, counts = {}, {}
for k = 2, #KEYS do
  local h = redis.call('HGETALL', KEYS[k])
  for i = 1, #h, 2 do
    local f = h[i]
    fields[#fields + 1] = string.char(#f) .. f .. pad[#f]
    counts[#counts + 1] = h[i + 1]
  end
end
return {1, table.concat(fields), table.concat(counts, ',')}
""")

# KEYS: meta, clock, epochs. ARGV: instance, fingerprint, vocab_size, buckets, shards, schema,
# history_partitions. Returns {} when created, else the existing meta as a flat field/value list.
CREATE = Script("create", """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('HGETALL', KEYS[1]) end
local t = redis.call('TIME')
local now = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('HSET', KEYS[1], 'instance', ARGV[1], 'fingerprint', ARGV[2], 'vocab_size', ARGV[3],
           'buckets', ARGV[4], 'shards', ARGV[5], 'schema', ARGV[6], 'history_partitions', ARGV[7])
redis.call('DEL', KEYS[3])
redis.call('RPUSH', KEYS[3], now)
redis.call('HSET', KEYS[2], 'instance', ARGV[1], 'cur', now, 't', now, 'floor', now)
return {}
""")

# Rebuild leases (KEYS: lease, fence[, gen] of one namespace, one slot). A lease is the
# string "<holder>|<token>" with a PX expiry; the token comes from INCR on the fence key.
ACQUIRE = Script("acquire_lease", """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder = string.match(cur, '^(.*)|%d+$')
  if holder ~= ARGV[1] then return {0, holder or cur, redis.call('PTTL', KEYS[1])} end
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return {token, '', 0}
""")
RENEW = Script("renew_lease", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")
RELEASE = Script("release_lease", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
""")
# KEYS: lease, gen. ARGV: "<holder>|<token>", generation, location, token, kind, keep_base ('1'/'0').
# The corpus base (leases.CommittedGeneration): a publish is its own; a rebuild carries the
# previous one ('1') or drops it ('0'). A record from before bases (no 'base' field) had one only
# when a publish wrote it: the generation and location it names.
COMMIT = Script("commit_generation", """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return {0, 'lease'} end
local prev = redis.call('HMGET', KEYS[2], 'generation', 'location', 'kind', 'base', 'base_location')
local g = tonumber(prev[1] or '0')
if tonumber(ARGV[2]) <= g then return {0, tostring(g)} end
local base, base_location = '0', ''
if ARGV[5] == 'publish' then
  base, base_location = ARGV[2], ARGV[3]
elseif ARGV[6] == '1' then
  if prev[4] then base, base_location = prev[4], prev[5] or ''
  elseif prev[3] == 'publish' then base, base_location = prev[1], prev[2] or '' end
end
redis.call('HSET', KEYS[2], 'generation', ARGV[2], 'location', ARGV[3], 'token', ARGV[4], 'kind', ARGV[5],
           'base', base, 'base_location', base_location)
return {1, ''}
""")
# A dropped namespace's base is forgotten (its files are gone); its numbers stay. KEYS: gen.
FORGET_BASE = Script("forget_base", """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'base', '0', 'base_location', '') end
return 1
""")

# The fleet history: one partition's keys (`schema.HistoryKeys`, one slot); KEYS[1] is the partition's
# guard, the hash whose 'instance' field it checks (meta for partition 0, its hstat for the others,
# which may be KEYS[3] too). HTRIM is shared by HAPPEND and
# HREAD: drop the oldest entries while the history holds more than max_tokens tokens or its
# oldest entry is older than oldest_ms. The fast path reads only the stat hash; otherwise it
# reads entries oldest first in growing pages (1, 2, 4, .. 64) to sum what it drops, then
# XTRIM MINID to the first kept id (MAXLEN 0 when nothing is kept: the stream keeps its last
# id, so new ids still grow).
_HTRIM = """
local function id_ms(id) return tonumber(string.match(id, '^(%d+)')) end
local function htrim(stream, stat, max_tokens, oldest_ms, tokens, first)
  if tokens <= max_tokens and (first == '' or id_ms(first) >= oldest_ms) then return end
  local from, count, kept, dropped = '-', 1, nil, nil
  while true do
    local page = redis.call('XRANGE', stream, from, '+', 'COUNT', count)
    if #page == 0 then break end
    for i = 1, #page do
      local id, f = page[i][1], page[i][2]
      if tokens <= max_tokens and id_ms(id) >= oldest_ms then kept = id break end
      for j = 1, #f, 2 do if f[j] == 't' then tokens = tokens - #f[j + 1] / 4 end end
      dropped = id
    end
    if kept then break end
    from = '(' .. page[#page][1]
    if count < 64 then count = count * 2 end
  end
  if dropped then
    if kept then redis.call('XTRIM', stream, 'MINID', kept) else redis.call('XTRIM', stream, 'MAXLEN', 0) end
    redis.call('HSET', stat, 'trimmed', dropped)
  end
  redis.call('HSET', stat, 'tokens', string.format('%d', tokens), 'first', kept or '')
end
local function hnow()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# Batches of history records, each exactly once per (client id, batch_seq) in this partition: one
# sender's batch, or several senders' batches gathered by the service (their parts in this partition).
# KEYS: guard, stream, stat, seq, seen, dup. ARGV: instance, max_tokens, max_age_ms, dup_window_ms,
# dedup_ttl_ms, then per batch: client id, batch_seq, n, then n records of: seq, group, offset, tokens
# (raw '<i4'), near-duplicate digest ('' for none: not a prompt).
# Returns {-1} (another instance) or {1, then per batch: 1 stored (0 duplicate: nothing stored), records
# stored, tokens stored, near-duplicates skipped, their tokens}. The batch_seqs are read (HMGET) and
# written (HSET, ZADD seen) once for all the batches; silent senders are swept when a sender is new
# here, old digests when a batch holds a prompt: a call costs a few commands besides its XADDs,
# however many senders' batches it holds.
HAPPEND = Script("history_append", _HTRIM + """
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return {-1} end
local now = hnow()
local batches, clients = {}, {}
local a = 6
while a <= #ARGV do
  local n = tonumber(ARGV[a + 2])
  batches[#batches + 1] = {a, n}
  clients[#clients + 1] = ARGV[a]
  a = a + 3 + 5 * n
end
local hw = {}
if #clients > 0 then
  local got = redis.call('HMGET', KEYS[4], unpack(clients))
  for i = 1, #clients do if got[i] then hw[clients[i]] = tonumber(got[i]) end end
end
local st = redis.call('HMGET', KEYS[3], 'tokens', 'first')
local tokens, first = tonumber(st[1] or '0'), st[2] or ''
local stored, digests_trimmed = false, false
local seqs, seen = {}, {}
local out = {1}
for i = 1, #batches do
  local a, n = batches[i][1], batches[i][2]
  local client, bseq = ARGV[a], ARGV[a + 1]
  local hwm = hw[client]
  if hwm and tonumber(bseq) <= hwm then
    for _ = 1, 5 do out[#out + 1] = 0 end
  else
    hw[client] = tonumber(bseq)
    seqs[#seqs + 1] = client
    seqs[#seqs + 1] = bseq
    seen[#seen + 1] = now
    seen[#seen + 1] = client
    local added, records, skipped, skipped_tokens = 0, 0, 0, 0
    for b = a + 3, a + 3 + 5 * (n - 1), 5 do
      local digest = ARGV[b + 4]
      local skip = false
      if digest ~= '' then
        if not digests_trimmed then
          redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', '(' .. (now - tonumber(ARGV[4])))
          digests_trimmed = true
        end
        if redis.call('ZSCORE', KEYS[6], digest) then skip = true else redis.call('ZADD', KEYS[6], now, digest) end
      end
      if skip then
        skipped = skipped + 1
        skipped_tokens = skipped_tokens + #ARGV[b + 3] / 4
      else
        local id = redis.call('XADD', KEYS[2], '*', 'c', client, 's', ARGV[b], 'g', ARGV[b + 1], 'o', ARGV[b + 2],
                              't', ARGV[b + 3])
        if first == '' then first = id end
        added = added + #ARGV[b + 3] / 4
        records = records + 1
      end
    end
    if added > 0 then
      tokens = tokens + added
      stored = true
    end
    out[#out + 1] = 1
    out[#out + 1] = records
    out[#out + 1] = added
    out[#out + 1] = skipped
    out[#out + 1] = skipped_tokens
  end
end
if #seqs > 0 then
  redis.call('HSET', KEYS[4], unpack(seqs))
  if redis.call('ZADD', KEYS[5], unpack(seen)) > 0 then  -- a sender new here: sweep up to 16 silent ones
    local silent = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. (now - tonumber(ARGV[5])), 'LIMIT', 0, 16)
    for i = 1, #silent do
      redis.call('HDEL', KEYS[4], silent[i])
      redis.call('ZREM', KEYS[5], silent[i])
    end
  end
end
if stored then redis.call('HSET', KEYS[3], 'tokens', string.format('%d', tokens), 'first', first) end
htrim(KEYS[2], KEYS[3], tonumber(ARGV[2]), now - tonumber(ARGV[3]), tokens, first)
return out
""")

# KEYS: guard, stream, stat. ARGV: instance, after ('' = from the oldest; else a stream id,
# exclusive), limit, max_tokens, max_age_ms. Trims by the budget first (so no expired record
# is answered), then returns {1, trimmed id or '', entries} or {-1} (another instance).
HREAD = Script("history_read", _HTRIM + """
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] then return {-1} end
local st = redis.call('HMGET', KEYS[3], 'tokens', 'first')
htrim(KEYS[2], KEYS[3], tonumber(ARGV[4]), hnow() - tonumber(ARGV[5]), tonumber(st[1] or '0'), st[2] or '')
local from = '-'
if ARGV[2] ~= '' then from = '(' .. ARGV[2] end
return {1, redis.call('HGET', KEYS[3], 'trimmed') or '', redis.call('XRANGE', KEYS[2], from, '+', 'COUNT', ARGV[3])}
""")
