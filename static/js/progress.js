// Prompt progress and the context meter.
//
// While the engine reads a long prompt in chunks, the gateway sends `progress`
// frames ({prompt_tokens_done, prompt_tokens}); the streaming reply then shows
// "Reading 1,536 / 5,240 tokens" with a thin bar instead of its typing dots,
// until its first text. The context meter near the composer shows how full the
// chat's context is: prompt + reply tokens of the last turn against the model's
// max_model_len (from GET /api/config), and warns near the limit.

const NUMBER = new Intl.NumberFormat("en-US");

/** Fractions of the context at which the meter warns, and says the chat is nearly full. */
export const WARN_AT = 0.8;
export const FULL_AT = 0.95;

/**
 * Show (or update) the prompt progress of a streaming assistant message.
 * @param {HTMLLIElement} li  the message (messages.js addAssistant)
 * @param {number} done  prompt tokens read so far
 * @param {number} total  prompt tokens in all
 */
export function showPromptProgress(li, done, total) {
  if (!li || !li.classList.contains("streaming") || !(total > 0)) return;
  const body = li.querySelector(".msg-body");
  if (body && body.textContent) return; // text came first: progress is over
  const d = li.ownerDocument;
  let box = li.querySelector(".prompt-progress");
  if (!box) {
    box = d.createElement("div");
    box.className = "prompt-progress";
    const label = d.createElement("span");
    label.className = "prompt-progress-label";
    const track = d.createElement("div");
    track.className = "prompt-progress-track";
    track.setAttribute("role", "progressbar");
    track.setAttribute("aria-label", "Reading the prompt");
    track.setAttribute("aria-valuemin", "0");
    const fill = d.createElement("div");
    fill.className = "prompt-progress-fill";
    track.append(fill);
    box.append(label, track);
    const typing = li.querySelector(".typing");
    if (typing) typing.before(box);
    else li.querySelector(".msg-main")?.append(box);
  }
  const shown = Math.min(Math.max(0, done), total);
  box.querySelector(".prompt-progress-label").textContent =
    `Reading ${NUMBER.format(shown)} / ${NUMBER.format(total)} tokens`;
  const track = box.querySelector(".prompt-progress-track");
  track.setAttribute("aria-valuemax", String(total));
  track.setAttribute("aria-valuenow", String(shown));
  box.querySelector(".prompt-progress-fill").style.width = `${((100 * shown) / total).toFixed(1)}%`;
  li.classList.add("reading");
}

/**
 * Remove a message's prompt progress (its first text came, or it ended).
 * @param {HTMLLIElement|null|undefined} li
 */
export function clearPromptProgress(li) {
  if (!li) return;
  li.querySelector(".prompt-progress")?.remove();
  li.classList.remove("reading");
}

/**
 * The tokens of a chat's context in use after its last turn: the last assistant
 * message's prompt + reply tokens (0 when no message carries usage).
 * @param {Array<{role:string, usage?:{prompt_tokens?:number, completion_tokens?:number}}>} messages
 * @returns {number}
 */
export function contextTokens(messages) {
  for (let i = (messages || []).length - 1; i >= 0; i--) {
    const u = messages[i].usage;
    if (messages[i].role === "assistant" && u && u.prompt_tokens > 0) {
      return u.prompt_tokens + (u.completion_tokens || 0);
    }
  }
  return 0;
}

/** The meter near the composer: "42% of context", a small bar, a warning near the limit. */
export class ContextMeter {
  /**
   * @param {HTMLElement} el  the meter's element (#context-meter; its children are made here)
   * @param {number} maxModelLen  the model's context (tokens); 0 or less hides the meter
   */
  constructor(el, maxModelLen) {
    this.el = el;
    this.max = Number(maxModelLen) || 0;
    this.tokens = 0;
    /** tokens of the files attached to the message being written (counted before it is sent) */
    this.pending = 0;
    if (!el) return;
    const d = el.ownerDocument;
    this.track = d.createElement("span");
    this.track.className = "context-track";
    this.track.setAttribute("aria-hidden", "true");
    this.fill = d.createElement("span");
    this.fill.className = "context-fill";
    this.track.append(this.fill);
    this.label = d.createElement("span");
    this.label.className = "context-label";
    el.append(this.track, this.label);
    this.set(0);
  }

  /**
   * Show `tokens` of the context in use (0 hides the meter: a new or empty chat).
   * @param {number} tokens
   */
  set(tokens) {
    this.tokens = Math.max(0, Number(tokens) || 0);
    this.draw();
  }

  /**
   * Count `tokens` of attached files on top of the chat's (0: none attached).
   * @param {number} tokens
   */
  setPending(tokens) {
    this.pending = Math.max(0, Number(tokens) || 0);
    this.draw();
  }

  /** @private */
  draw() {
    const el = this.el;
    if (!el) return;
    const total = this.tokens + this.pending;
    if (!(this.max > 0) || total === 0) {
      el.hidden = true;
      return;
    }
    const frac = Math.min(1, total / this.max);
    const pct = Math.round(frac * 100);
    const level = frac >= FULL_AT ? "full" : frac >= WARN_AT ? "warn" : "ok";
    el.hidden = false;
    this.fill.style.width = `${(frac * 100).toFixed(1)}%`;
    const over = total >= this.max;
    const files = this.pending ? ` with the attached files (${NUMBER.format(this.pending)} tokens)` : "";
    this.label.textContent = over ? `Over the context${files}: remove a file or start a new chat`
      : level === "full" ? `${pct}% of context${files}: nearly full, start a new chat`
      : level === "warn" ? `${pct}% of context${files}: nearing the limit` : `${pct}% of context${files}`;
    el.dataset.level = over ? "full" : level;
    el.title = `${NUMBER.format(total)} of ${NUMBER.format(this.max)} tokens of the model's context in use`
      + (this.pending ? ` (${NUMBER.format(this.pending)} of them in the attached files, not sent yet)` : "");
  }
}
