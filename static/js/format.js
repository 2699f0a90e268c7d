// Pure formatting helpers: reply statistics, error texts, chat-list date groups.
// No DOM access here, so each function can be reasoned about (and tested) alone.

/** A decode rate is shown only over at least this many tokens after the first... */
export const MIN_RATE_TOKENS = 8;
/** ...written over at least this long (ms) after the first token: fewer tokens, or a
 * burst (speculative decoding can write several tokens in one step), give a rate that
 * says nothing (docs/ui.md, "Stats per reply"). */
export const MIN_RATE_MS = 50;

/**
 * Speed figures for one reply, from the `usage` and `timings` objects of a
 * `done` frame or a stored message (docs/protocol.md §2).
 * @param {{prompt_tokens?:number, cached_tokens?:number, cached_disk_tokens?:number, completion_tokens?:number,
 *   continued_tokens?:number}|null|undefined} usage
 *   counts in tokens (cached_disk_tokens: of cached_tokens, those restored from the engine's disk KV tier;
 *   continued_tokens: on a reply extended by Continue, the tokens it had before, which the timings do not cover)
 * @param {{ttft_ms?:number, tpot_ms?:number, e2e_ms?:number}|null|undefined} timings  durations in ms, of the
 *   request that wrote the reply (of a continued reply: of its last Continue)
 * @returns {{ttftMs:number|null, tokensPerSecond:number|null, cachedTokens:number|null, diskTokens:number|null,
 *   completionTokens:number|null, newTokens:number|null, continuedTokens:number, noRate:string}}
 *   completionTokens: the whole reply's tokens (a continued reply's earlier ones included); newTokens: those
 *   the timings cover (written by the last request). tokensPerSecond is their decode rate: tokens after the
 *   first divided by the time after the first token, null unless there are at least MIN_RATE_TOKENS of them
 *   over at least MIN_RATE_MS; noRate then says why in words ("" when a rate is given or nothing is known).
 */
export function replyStats(usage, timings) {
  const u = usage || {};
  const t = timings || {};
  const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : null);
  const ttft = num(t.ttft_ms);
  const e2e = num(t.e2e_ms);
  const written = num(u.completion_tokens);
  const continued = Math.max(0, num(u.continued_tokens) || 0);
  let rate = null;
  let noRate = "";
  // The first token's time is TTFT; the decode rate covers the tokens after it.
  if (written !== null && ttft !== null && e2e !== null && e2e > 0) {
    const tokens = written - 1;
    const ms = e2e - ttft;
    if (tokens < MIN_RATE_TOKENS) noRate = `too short for a speed (under ${MIN_RATE_TOKENS} tokens after the first)`;
    else if (!(ms >= MIN_RATE_MS)) noRate = `too quick for a speed (under ${MIN_RATE_MS} ms after the first token)`;
    else rate = tokens / (ms / 1000);
  }
  return { ttftMs: ttft, tokensPerSecond: rate, cachedTokens: num(u.cached_tokens), diskTokens: num(u.cached_disk_tokens),
    completionTokens: written === null ? null : written + continued, newTokens: written, continuedTokens: continued,
    noRate };
}

const COUNT = new Intl.NumberFormat("en-US");

/**
 * @param {number} rate  tokens per second
 * @returns {string} "41 tok/s" (whole from 10 up, one decimal below)
 */
export function formatRate(rate) {
  return `${rate >= 10 ? Math.round(rate) : rate.toFixed(1)} tok/s`;
}

/**
 * The stats line under a reply, in words people read: "32 tokens · 41 tok/s · 512 from
 * cache" (the reply's length, its decode rate, and the prompt tokens the prefix cache
 * served; that part is left out when none were). A continued reply counts all its tokens
 * and says how many are new: "120 tokens (60 new) · 41 tok/s" (the rate is of the new
 * ones). The rate is left out when it would say nothing (`replyStats`). Empty when nothing
 * is known.
 * @param {ReturnType<typeof replyStats>} s
 * @returns {string}
 */
export function formatStats(s) {
  const parts = [];
  if (s.completionTokens !== null) {
    parts.push(`${COUNT.format(s.completionTokens)} ${s.completionTokens === 1 ? "token" : "tokens"}`
      + (s.continuedTokens && s.newTokens !== null ? ` (${COUNT.format(s.newTokens)} new)` : ""));
  }
  if (s.tokensPerSecond !== null) parts.push(formatRate(s.tokensPerSecond));
  if (s.cachedTokens) {
    // restored from the engine's disk KV tier (a chat that came back after eviction or a restart)
    parts.push(`${COUNT.format(s.cachedTokens)} from cache` + (s.diskTokens ? ` (${COUNT.format(s.diskTokens)} from disk)` : ""));
  }
  return parts.join(" · ");
}

/**
 * The details line shown when the stats line is opened (and its tooltip): for a continued
 * reply what its numbers cover first, then time to first token (TTFT), the prompt's size
 * and cached share, time per token (only where a rate is shown), why no rate is shown,
 * total time.
 * @param {object|null|undefined} usage  `{prompt_tokens, cached_tokens, completion_tokens, continued_tokens?}` (tokens)
 * @param {object|null|undefined} timings  `{ttft_ms, tpot_ms, e2e_ms}` (ms)
 * @returns {string} e.g. "First token after 84 ms (TTFT) · prompt 1,024 tokens, 512 from cache · 24.4 ms per token · 2.31 s in all"
 */
export function formatStatDetails(usage, timings) {
  const u = usage || {};
  const t = timings || {};
  const s = replyStats(usage, timings);
  const parts = [];
  if (s.continuedTokens && s.newTokens !== null) {
    parts.push(`Continued: ${COUNT.format(s.continuedTokens)} tokens written before, ${COUNT.format(s.newTokens)} by the last `
      + "Continue; the times and speed are of those");
  }
  if (t.ttft_ms != null) parts.push(`First token after ${COUNT.format(Math.round(t.ttft_ms))} ms (TTFT)`);
  if (u.prompt_tokens != null) {
    parts.push(`prompt ${COUNT.format(u.prompt_tokens)} tokens` + (u.cached_tokens ? `, ${COUNT.format(u.cached_tokens)} from cache` : "")
      + (u.cached_disk_tokens ? ` (${COUNT.format(u.cached_disk_tokens)} from disk)` : ""));
  }
  if (s.tokensPerSecond !== null && t.tpot_ms != null && t.tpot_ms > 0) parts.push(`${Number(t.tpot_ms).toFixed(1)} ms per token`);
  if (s.noRate) parts.push(s.noRate);
  if (t.e2e_ms != null) parts.push(`${(t.e2e_ms / 1000).toFixed(2)} s in all`);
  return parts.join(" · ");
}

/**
 * A live decode rate while a reply streams, from its text: the page's `delta` frames
 * carry text, not token counts, so tokens are estimated as characters / `charsPerToken`.
 * @param {number} chars  characters of the reply after its first delta's
 * @param {number} ms  time since its first delta
 * @param {number} charsPerToken  measured on the replies this page saw finish (about 4 for English)
 * @returns {number|null} tokens per second, or null while too little is known (under 0.3 s)
 */
export function liveRate(chars, ms, charsPerToken) {
  if (!(ms >= 300) || !(chars > 0) || !(charsPerToken > 0)) return null;
  return chars / charsPerToken / (ms / 1000);
}

/** Characters of a title the gateway derives from a chat's first message. */
export const AUTO_TITLE_CHARS = 60;

/**
 * The title the gateway gives a chat from its first message (its `title_from`):
 * whitespace collapsed, cut at `maxChars` characters with an ellipsis.
 * @param {string} content  the first user message
 * @param {number} [maxChars]
 * @returns {string}
 */
export function titleFrom(content, maxChars = AUTO_TITLE_CHARS) {
  const text = String(content).split(/\s+/).filter(Boolean).join(" ");
  const chars = Array.from(text); // code points, as the gateway counts them
  return chars.length <= maxChars ? text : chars.slice(0, maxChars - 1).join("").trimEnd() + "…";
}

/**
 * @param {number} n  a size in bytes
 * @returns {string} e.g. "4 MiB", "1.5 MiB", "512 KiB", "900 bytes"
 */
export function formatBytes(n) {
  const units = [["MiB", 1024 * 1024], ["KiB", 1024]];
  for (const [name, size] of units) {
    if (n >= size) {
      const v = n / size;
      return `${Number.isInteger(v) ? v : v.toFixed(1)} ${name}`;
    }
  }
  return `${n} bytes`;
}

/**
 * The sentence shown to the user for a gateway error code (docs/protocol.md §2).
 * @param {string} code  e.g. "busy", "engine_unavailable"
 * @param {string} [serverMessage]  the frame's own message, used where it helps
 * @param {{maxFrameBytes?:number}} [limits]
 * @returns {string}
 */
export function errorText(code, serverMessage, limits) {
  const detail = serverMessage ? ` (${serverMessage})` : "";
  switch (code) {
    case "busy":
      return "This chat is still writing a reply. Wait for it to finish, or stop it first.";
    case "engine_unavailable":
      return "The model server is not reachable right now. Your message was not sent; try again in a moment.";
    case "store_unavailable":
      return "Chat storage (Redis) is unreachable, so nothing can be saved right now. Try again shortly.";
    case "rate_limited":
      return "You are sending messages too quickly. Wait a few seconds and try again.";
    case "context_length_exceeded": {
      // the gateway's own message may already give the advice: say it once
      const advice = /new chat|shorter message/i.test(serverMessage || "") ? "" : " Start a new chat or send a shorter message.";
      return `This conversation is too long for the model's context window${detail}.${advice}`;
    }
    case "conflict":
      return "This chat was changed in another tab or window, so nothing was replaced. It now shows the latest version; try again if you still want to.";
    case "frame_too_large": {
      const max = limits && limits.maxFrameBytes;
      const size = max ? ` (the limit is ${formatBytes(max)})` : "";
      return `That message is too large to send${size}. Shorten it and try again.`;
    }
    case "too_many_generations":
      return "Too many replies are being written at once. Wait for one to finish.";
    case "too_many_sessions":
      return "You have reached the maximum number of chats. Delete some to start new ones.";
    case "invalid_request":
      return `The request was refused${detail}. Check this chat's settings.`;
    case "not_found":
      return "This chat or reply no longer exists.";
    case "model_not_found":
      return "This chat's model is not served here any more. Choose another in the model menu at the top.";
    case "network":
      return "The server cannot be reached. Check that it is running.";
    default:
      return `Something went wrong${detail}.`;
  }
}

/**
 * Label of the chat-list group a chat falls into, by its last update.
 * @param {number} updatedAt  Unix time in seconds
 * @param {Date} now
 * @returns {"Today"|"Yesterday"|"Previous 7 days"|"Previous 30 days"|"Older"}
 */
export function dateGroup(updatedAt, now) {
  const startOfToday = new Date(now.getFullYear(), now.getMonth(), now.getDate()).getTime();
  const t = updatedAt * 1000;
  const day = 24 * 3600 * 1000;
  if (t >= startOfToday) return "Today";
  if (t >= startOfToday - day) return "Yesterday";
  if (t >= startOfToday - 7 * day) return "Previous 7 days";
  if (t >= startOfToday - 30 * day) return "Previous 30 days";
  return "Older";
}
