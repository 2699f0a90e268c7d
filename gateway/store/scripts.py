"""Lua scripts of the session store: each one multi-key change is one atomic script.

Every script takes the same KEYS, in this order (``SessionKeys.all()``):

    KEYS[1] chat:session:{sid}            hash: id, owner, title, system_prompt, params, model, times, active
    KEYS[2] chat:session:{sid}:messages   list of message JSON, oldest first
    KEYS[3] chat:session:{sid}:tokens     hash: message id -> {"ids": [...], "base": bool}
    KEYS[4] chat:session:{sid}:cmids      hash: client_msg_id -> the turn it started (JSON)
    KEYS[5] chat:user:{uid}:sessions      sorted set: sid by update time
    KEYS[6] chat:session:{sid}:lock       string: request id of the reply in progress (PX lease)
    KEYS[7] chat:user:{uid}:gens          sorted set: request id by lease expiry (ms)
    KEYS[8] chat:session:{sid}:versions   hash: anchor -> the versions of the chat after it (JSON)

Versions (edit a user message and resend, or regenerate a reply, keeping the old branch):
editing the user message at list position i (or regenerating the reply at i) cuts the list
from i on; that tail (its messages and their
token segments) is kept under the *anchor*, the id of the message before position i
(``^`` for the first). ``versions[anchor]`` is a JSON array in creation order whose
entries are ``{"m": [message JSON...], "t": {message id: segment JSON}}`` for stored
branches and ``{"cur": true}`` for the branch the list holds now. Switching swaps the
list's tail with a stored one; nothing is ever dropped.

Writes refresh the TTL of KEYS[1..5] and KEYS[8] in the same script (TTLs are kept
(docs/acceptance.md#ttls-are-kept): a TTL is
never lost by a rewrite, and active chats slide forward); the lock has its own lease.
Every script that changes a chat publishes ``{"kind", "session_id", "request_id"}`` on
the owner's channel ``KEYS[5] .. ':events'`` (``notify``), so the user's other tabs
hear of each change in the same atomic step (gateway/store/live_events.py).
Message JSON is written with ``"role"`` first and ``"id"`` second (compact separators)
so a script can read both without decoding a possibly multi-MiB message.
"""

from __future__ import annotations

_PRELUDE = r"""
-- Tell the owner's open pages that a chat changed (gateway/store/live_events.py), in the same step.
local function notify(kind, sid, rid)
  redis.call('PUBLISH', KEYS[5] .. ':events',
             cjson.encode({kind = kind, session_id = sid, request_id = rid or ''}))
end
local function touch(ttl)
  if ttl > 0 then
    for i = 1, 5 do redis.call('EXPIRE', KEYS[i], ttl) end
    if redis.call('EXISTS', KEYS[8]) == 1 then redis.call('EXPIRE', KEYS[8], ttl) end
  end
end
local function msg_id(s) return string.match(s, '^{"role":"%a+","id":"([%w_%-]+)"') end
-- Cut the message list from 1-based position `from` on; returns the tail and its token
-- segments (removed from KEYS[3]) as a version entry.
local function cut_tail(from)
  local msgs = redis.call('LRANGE', KEYS[2], from - 1, -1)
  local toks = {}
  for i = 1, #msgs do
    local mid = msg_id(msgs[i])
    local seg = mid and redis.call('HGET', KEYS[3], mid)
    if seg then toks[mid] = seg; redis.call('HDEL', KEYS[3], mid) end
  end
  if from == 1 then redis.call('DEL', KEYS[2]) else redis.call('LTRIM', KEYS[2], 0, from - 2) end
  return {m = msgs, t = toks}
end
local function put_tail(entry)
  for i = 1, #entry.m do redis.call('RPUSH', KEYS[2], entry.m[i]) end
  for mid, seg in pairs(entry.t) do redis.call('HSET', KEYS[3], mid, seg) end
end
local function current_of(versions)
  for i = 1, #versions do if versions[i].cur then return i end end
  return nil
end
-- The 1-based list position of the message `id` (a user message when `role` is 'user',
-- any message for '%a+') and its anchor, or nil.
local function find_msg(id, role)
  local msgs = redis.call('LRANGE', KEYS[2], 0, -1)
  for i = 1, #msgs do
    if string.match(msgs[i], '^{"role":"' .. role .. '","id":"([%w_%-]+)"') == id then
      local anchor = '^'
      if i > 1 then anchor = msg_id(msgs[i - 1]) or '^' end
      return i, anchor
    end
  end
  return nil, nil
end
local function find_user(id) return find_msg(id, 'user') end
-- Whether the chat holds a message `id` anywhere: in the list or in a stored version.
local function holds(id)
  if find_msg(id, '%a+') then return true end
  for _, raw in ipairs(redis.call('HVALS', KEYS[8])) do
    for _, entry in ipairs(cjson.decode(raw)) do
      for _, m in ipairs(entry.m or {}) do if msg_id(m) == id then return true end end
    end
  end
  return false
end
-- Keep the list's tail from position `pos` on as a version of the chat after `anchor`
-- and make a new current version (filled by what the list gets next); returns the
-- undo record FAIL takes ({"anchor", "index"}, JSON).
local function branch(pos, anchor)
  local raw = redis.call('HGET', KEYS[8], anchor)
  local versions = raw and cjson.decode(raw) or {{cur = true}}
  local c = current_of(versions) or (#versions + 1)
  versions[c] = cut_tail(pos)
  versions[#versions + 1] = {cur = true}
  redis.call('HSET', KEYS[8], anchor, cjson.encode(versions))
  return cjson.encode({anchor = anchor, index = c})
end
local function release(rid)
  if redis.call('GET', KEYS[6]) == rid then redis.call('DEL', KEYS[6]) end
  redis.call('ZREM', KEYS[7], rid)
end
local function clear_active(rid)
  local act = redis.call('HGET', KEYS[1], 'active') or ''
  if act ~= '' and string.find(act, rid, 1, true) then redis.call('HSET', KEYS[1], 'active', '') end
end
"""

# ARGV: owner, sid, title, system_prompt, params_json, now, max_sessions, ttl, model ('' = the default)
CREATE = _PRELUDE + r"""
if redis.call('EXISTS', KEYS[1]) == 1 then return 'exists' end
if redis.call('ZCARD', KEYS[5]) >= tonumber(ARGV[7]) then return 'too_many_sessions' end
redis.call('HSET', KEYS[1], 'id', ARGV[2], 'owner', ARGV[1], 'title', ARGV[3], 'system_prompt', ARGV[4],
           'params', ARGV[5], 'created_at', ARGV[6], 'updated_at', ARGV[6], 'active', '', 'model', ARGV[9] or '')
redis.call('ZADD', KEYS[5], ARGV[6], ARGV[2])
touch(tonumber(ARGV[8]))
notify('created', ARGV[2])
return 'ok'
"""

# ARGV: owner, sid, now, ttl, field1, value1, ...
UPDATE = _PRELUDE + r"""
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 'not_found' end
local kv = {}
for i = 5, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[3], unpack(kv))
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[2])
touch(tonumber(ARGV[4]))
notify('updated', ARGV[2])
return 'ok'
"""

# ARGV: owner, sid. Returns {'ok', active_json} or {'not_found'}.
DELETE = _PRELUDE + r"""
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return {'not_found'} end
local active = redis.call('HGET', KEYS[1], 'active') or ''
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[8])
redis.call('ZREM', KEYS[5], ARGV[2])
notify('deleted', ARGV[2])
return {'ok', active}
"""

# ARGV: 1 owner, 2 sid, 3 request_id, 4 mode ('chat'|'edit'|'regenerate'|'continue'),
#       5 user_msg_json, 6 user_msg_id, 7 client_msg_id, 8 assistant_msg_id, 9 title, 10 now,
#       11 now_ms, 12 lease_ms, 13 max_generations, 14 ttl, 15 for regenerate/continue the
#       expected last reply id ('' = any), for edit the id of the user message edited,
#       16 for an edit of the first message, the title its old text gave ('' = none),
#       17 the reply stream's TTL (s; '' = leave the stream alone),
#       18 '1' to create the chat first ('' = it exists), then for a created chat:
#       19 system_prompt, 20 params_json, 21 max_sessions, 22 model ('' = the default)
# With ARGV[18], the chat is created as CREATE creates it (the same fields, index entry
# and 'created' event, before 'started'), once every check has passed: a refused turn
# ('exists', 'too_many_sessions', 'too_many_generations') writes nothing, so a turn that
# creates its chat reaches its engine after the same round trips as one on an existing chat.
# With ARGV[17], KEYS[9] is the reply's stream: its start entry is written in the same
# step, and the chat as the reply's prompt reads it (its messages and token segments)
# comes back as two more items, so a turn reaches its engine without another read.
# Returns {'ok', user_msg_id, popped_json, popped_tokens, title_set, edit_undo
# [, messages, tokens as HGETALL's flat list]} or
# {code[, previous]}; 'conflict' when a regenerate/continue names a reply that is not the
# chat's last one, or an edit names no user message of the chat (a stale tab's view), and
# 'unknown' when the id named is no message of the chat at all (neither in the list nor
# in a stored version). An edit keeps the cut
# tail as a version (see the module doc), and so does a regenerate (the old reply, a
# version of the chat after its user message); edit_undo ({"anchor", "index"}) lets
# FAIL put it back. A continue takes the reply off (popped_json) to store it extended.
# An edit of the first message retitles the chat when its title is still the one the
# old text gave (ARGV[16]: a title the user gave is kept).
BEGIN = _PRELUDE + r"""
if ARGV[18] and ARGV[18] ~= '' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
  if redis.call('ZCARD', KEYS[5]) >= tonumber(ARGV[21]) then return {'too_many_sessions'} end
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', ARGV[11])
  if redis.call('ZCARD', KEYS[7]) >= tonumber(ARGV[13]) then return {'too_many_generations'} end
  redis.call('HSET', KEYS[1], 'id', ARGV[2], 'owner', ARGV[1], 'title', '', 'system_prompt', ARGV[19],
             'params', ARGV[20], 'created_at', ARGV[10], 'updated_at', ARGV[10], 'active', '', 'model', ARGV[22])
  redis.call('ZADD', KEYS[5], ARGV[10], ARGV[2])
  notify('created', ARGV[2])
end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return {'not_found'} end
if ARGV[7] ~= '' then
  local prev = redis.call('HGET', KEYS[4], ARGV[7])
  if prev then return {'duplicate', prev} end
end
if redis.call('EXISTS', KEYS[6]) == 1 then return {'busy'} end
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', ARGV[11])
if redis.call('ZCARD', KEYS[7]) >= tonumber(ARGV[13]) then return {'too_many_generations'} end
local user_id = ARGV[6]
local popped, popped_tokens, edit_undo = '', '', ''
if ARGV[4] == 'chat' then
  redis.call('RPUSH', KEYS[2], ARGV[5])
elseif ARGV[4] == 'edit' then
  local pos, anchor = find_user(ARGV[15])
  if not pos then
    if holds(ARGV[15]) then return {'conflict'} end
    return {'unknown'}
  end
  edit_undo = branch(pos, anchor)
  redis.call('RPUSH', KEYS[2], ARGV[5])
  if anchor == '^' and ARGV[16] ~= '' and (redis.call('HGET', KEYS[1], 'title') or '') == ARGV[16] then
    redis.call('HSET', KEYS[1], 'title', '')  -- the title named the old first message: set anew below
  end
else
  local last = redis.call('LINDEX', KEYS[2], -1)
  if not last then return {'empty'} end
  local aid = string.match(last, '^{"role":"assistant","id":"([%w_%-]+)"')
  if ARGV[15] and ARGV[15] ~= '' and aid ~= ARGV[15] then
    if holds(ARGV[15]) then return {'conflict'} end
    return {'unknown'}
  end
  local before = last
  if aid then before = redis.call('LINDEX', KEYS[2], -2) or '' end
  user_id = string.match(before, '^{"role":"user","id":"([%w_%-]+)"')
  if not user_id then return {'empty'} end
  if aid and ARGV[4] == 'regenerate' then
    -- the old reply is kept as a version of the chat after its user message
    edit_undo = branch(redis.call('LLEN', KEYS[2]), user_id)
  elseif aid then
    redis.call('RPOP', KEYS[2])
    popped = last
    popped_tokens = redis.call('HGET', KEYS[3], aid) or ''
    redis.call('HDEL', KEYS[3], aid)
  end
end
local lease = tonumber(ARGV[12])
redis.call('SET', KEYS[6], ARGV[3], 'PX', lease)
redis.call('ZADD', KEYS[7], tonumber(ARGV[11]) + lease, ARGV[3])
redis.call('PEXPIRE', KEYS[7], 4 * lease)
local title = ''
if ARGV[9] ~= '' and (redis.call('HGET', KEYS[1], 'title') or '') == '' then
  redis.call('HSET', KEYS[1], 'title', ARGV[9])
  title = ARGV[9]
end
local active = cjson.encode({request_id = ARGV[3], message_id = ARGV[8], user_message_id = user_id})
redis.call('HSET', KEYS[1], 'active', active, 'updated_at', ARGV[10])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[4], ARGV[7], active) end
redis.call('ZADD', KEYS[5], ARGV[10], ARGV[2])
touch(tonumber(ARGV[14]))
notify('started', ARGV[2], ARGV[3])
if ARGV[17] and ARGV[17] ~= '' then
  redis.call('XADD', KEYS[9], '0-1', 't', 'start', 'owner', ARGV[1], 'session_id', ARGV[2],
             'message_id', ARGV[8], 'user_message_id', user_id)
  redis.call('EXPIRE', KEYS[9], tonumber(ARGV[17]))
  return {'ok', user_id, popped, popped_tokens, title, edit_undo,
          redis.call('LRANGE', KEYS[2], 0, -1), redis.call('HGETALL', KEYS[3])}
end
return {'ok', user_id, popped, popped_tokens, title, edit_undo}
"""

# ARGV: 1 sid, 2 request_id, 3 assistant_json ('' = none), 4 assistant_id, 5 user_id,
#       6 user_tokens_json, 7 assistant_tokens_json, 8 now, 9 ttl
# The reply is stored only right after its own user message (never out of order), and
# at most once: a retry whose first try was applied (its answer lost with the
# connection) finds the reply already last and changes nothing more.
FINISH = _PRELUDE + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then release(ARGV[2]); return 'gone' end
local last = redis.call('LINDEX', KEYS[2], -1) or ''
local last_id = string.match(last, '^{"role":"user","id":"([%w_%-]+)"')
local status = 'ok'
if ARGV[3] ~= '' and string.match(last, '^{"role":"assistant","id":"([%w_%-]+)"') == ARGV[4] then
  status = 'ok'
elseif last_id ~= ARGV[5] then
  status = 'conflict'
else
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[6]) end
  if ARGV[3] ~= '' then
    redis.call('RPUSH', KEYS[2], ARGV[3])
    if ARGV[7] ~= '' then redis.call('HSET', KEYS[3], ARGV[4], ARGV[7]) end
  end
end
clear_active(ARGV[2])
redis.call('HSET', KEYS[1], 'updated_at', ARGV[8])
redis.call('ZADD', KEYS[5], ARGV[8], ARGV[1])
release(ARGV[2])
touch(tonumber(ARGV[9]))
notify('finished', ARGV[1], ARGV[2])
return status
"""

# A refused turn (nothing generated): take back what BEGIN did.
# ARGV: 1 request_id, 2 user_json ('' for regenerate), 3 client_msg_id, 4 restore_json,
#       5 restore_id, 6 restore_tokens, 7 ttl, 8 title BEGIN set ('' = none; taken back
#       unless the chat was renamed since), 9 edit_undo from BEGIN ('' = none; else the
#       branch the edit or regenerate cut is put back and the new version dropped),
#       10 the title to put back in place of ARGV[8] ('' = none: a new chat's)
FAIL = _PRELUDE + r"""
if redis.call('EXISTS', KEYS[1]) == 1 then
  if ARGV[2] ~= '' then redis.call('LREM', KEYS[2], -1, ARGV[2]) end
  if ARGV[9] and ARGV[9] ~= '' then
    local undo = cjson.decode(ARGV[9])
    local raw = redis.call('HGET', KEYS[8], undo.anchor)
    if raw then
      local versions = cjson.decode(raw)
      local entry = versions[undo.index]
      if entry and not entry.cur and versions[#versions].cur then
        put_tail(entry)
        versions[undo.index] = {cur = true}
        table.remove(versions)
        if #versions <= 1 then redis.call('HDEL', KEYS[8], undo.anchor)
        else redis.call('HSET', KEYS[8], undo.anchor, cjson.encode(versions)) end
      end
    end
  end
  if ARGV[8] and ARGV[8] ~= '' and redis.call('HGET', KEYS[1], 'title') == ARGV[8] then
    redis.call('HSET', KEYS[1], 'title', ARGV[10] or '')
  end
  if ARGV[3] ~= '' then redis.call('HDEL', KEYS[4], ARGV[3]) end
  if ARGV[4] ~= '' then
    redis.call('RPUSH', KEYS[2], ARGV[4])
    if ARGV[6] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[6]) end
  end
  clear_active(ARGV[1])
  touch(tonumber(ARGV[7]))
  notify('undone', redis.call('HGET', KEYS[1], 'id') or '', ARGV[1])
end
release(ARGV[1])
return 'ok'
"""

# Show another version of the chat after a user message (docs/protocol.md, versions).
# ARGV: 1 owner, 2 sid, 3 id of the user message shown at the branch point, 4 version
# index (1-based), 5 now, 6 ttl, 7 and 8 for the first message: the title its text
# shown now gives and the title of the version chosen (the chat is retitled when its title
# is the first: a title the user gave is kept). The message is a user message (an edit's
# versions) or a reply (a regenerate's). The list's tail from that message on is stored
# in its version slot and the chosen version's tail takes its place (with token segments).
# Returns 'ok', 'not_found', 'busy' (a reply is in progress), 'conflict' (no such user
# message now) or 'invalid' (no such version).
SWITCH = _PRELUDE + r"""
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 'not_found' end
if redis.call('EXISTS', KEYS[6]) == 1 then return 'busy' end
local pos, anchor = find_msg(ARGV[3], '%a+')
if not pos then
  if holds(ARGV[3]) then return 'conflict' end
  return 'unknown'
end
local raw = redis.call('HGET', KEYS[8], anchor)
if not raw then return 'invalid' end
local versions = cjson.decode(raw)
local want = tonumber(ARGV[4])
local c = current_of(versions)
if not c or not want or want < 1 or want > #versions then return 'invalid' end
if want ~= c then
  versions[c] = cut_tail(pos)
  put_tail(versions[want])
  versions[want] = {cur = true}
  redis.call('HSET', KEYS[8], anchor, cjson.encode(versions))
  if anchor == '^' and ARGV[7] and ARGV[7] ~= '' and (redis.call('HGET', KEYS[1], 'title') or '') == ARGV[7] then
    redis.call('HSET', KEYS[1], 'title', ARGV[8])
  end
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[5])
redis.call('ZADD', KEYS[5], ARGV[5], ARGV[2])
touch(tonumber(ARGV[6]))
notify('switched', ARGV[2])
return 'ok'
"""

# Extend a reply's lock and generation slot. ARGV: request_id, lease_ms, now_ms.
LEASE = r"""
if redis.call('GET', KEYS[6]) ~= ARGV[1] then return 0 end
local lease = tonumber(ARGV[2])
redis.call('PEXPIRE', KEYS[6], lease)
redis.call('ZADD', KEYS[7], 'XX', tonumber(ARGV[3]) + lease, ARGV[1])
redis.call('PEXPIRE', KEYS[7], 4 * lease)
return 1
"""
