// The conversation pane: user and assistant messages, the streaming reply
// (re-rendered at most once per animation frame), and per-reply stats.

import { replyStats, formatStats, formatStatDetails, formatRate, liveRate } from "./format.js";
import { userMeta, continueButton, timeElement, setTime, setVersions, updateContinue } from "./branches.js";
import { icon, ICONS } from "./icons.js";
import { splitReasoning, thoughtFor } from "./reasoning.js";
import { chipElement } from "./attachments.js";

// Why a partial reply stopped, when it was not the user's Stop (the gateway stores
// `cut_reason` with it: docs/protocol.md).
const CUT_TEXT = {
  gateway_shutdown: "the server restarted while writing this reply; what was written is kept",
  engine_lost: "the model server stopped while writing this reply; what was written is kept",
};

/** A finished reply is read out up to this many characters (the rest is in the transcript). */
const SPOKEN_CHARS = 1500;

/** The live rate under a streaming reply is redrawn at most this often (ms). */
const LIVE_RATE_EVERY_MS = 500;

/** A user message taller than this many lines is shown collapsed ... */
export const COLLAPSE_OVER_LINES = 18;
/** ... to this many lines, with "Show more". */
export const COLLAPSED_LINES = 12;

/**
 * The message list. It owns the DOM under `listEl` and nothing else; the
 * controller tells it what happened.
 */
export class MessageView {
  /**
   * @param {{doc:Document, listEl:HTMLElement, scrollEl:HTMLElement,
   *          emptyEl:HTMLElement, renderer:{render:(el:HTMLElement, text:string)=>void},
   *          markers?:{open:string, close:string}}} opts
   */
  constructor(opts) {
    this.doc = opts.doc;
    this.listEl = opts.listEl;
    this.scrollEl = opts.scrollEl;
    this.emptyEl = opts.emptyEl;
    this.renderer = opts.renderer;
    /** The reasoning markers (`GET /api/config` `reasoning`); replies' reasoning shows apart. */
    this.markers = opts.markers;
    /** @type {WeakMap<HTMLLIElement, {text:string, raf:number, firstAt?:number, firstLen?:number,
     *   rateAt?:number, thinkMs?:number, thinkFrom?:number}>} per assistant message; `firstAt`/`firstLen`:
     *   when its first text came, and how long it was (the live rate counts what came after);
     *   `thinkMs`: how long it reasoned (stored, or measured here from `thinkFrom`) */
    this.replyState = new WeakMap();
    this.bodyIds = 0;
    /** Characters per token of the replies shown so far (for the live rate), 4 until one is known. */
    this.charsPerToken = 4;
    this.listEl.addEventListener("click", (ev) => {
      const btn = ev.target.closest("button.show-more");
      if (btn && this.listEl.contains(btn)) this.toggleCollapsed(btn);
      const view = ev.target.closest("button.chip-view");
      if (view && this.listEl.contains(view)) this.toggleFileText(view);
    });
  }

  /** @private */
  st(li) {
    let s = this.replyState.get(li);
    if (!s) {
      s = { text: "", raf: 0 };
      this.replyState.set(li, s);
    }
    return s;
  }

  /**
   * @param {HTMLLIElement} li
   * @returns {string} the assistant message's answer: its markdown without the reasoning
   */
  answerOf(li) {
    const { reasoning, answer } = splitReasoning(this.st(li).text, this.markers);
    return reasoning === null ? this.st(li).text : answer;
  }

  /** Remove every message and show the empty state. */
  clear() {
    this.listEl.replaceChildren();
    this.updateEmpty();
  }

  /**
   * Show a stored history (GET /api/sessions/{id} `messages`).
   * @param {Array<{id:string, role:string, content:string, status?:string, finish_reason?:string, usage?:object, timings?:object}>} messages
   */
  showHistory(messages) {
    this.listEl.replaceChildren();
    const users = [];
    for (const m of messages) {
      if (m.role === "user") users.push(this.addUser(m.content, m.id, { ...m, deferFit: true }));
      else if (m.role === "assistant") this.finish(this.addAssistant(m.id), m);
      // system messages are shown in the settings panel, not in the flow
    }
    this.collapseLong(users);
    this.updateEmpty();
    this.scrollToBottom();
  }

  /**
   * @param {string} content  shown as plain text
   * @param {string|null} [id]  the stored message id, once known
   * @param {{created_at?:number, versions?:{index:number, count:number}, deferFit?:boolean,
   *   attachments?:Array<object>}} [info]  time and versions; `deferFit`: the caller collapses a long
   *   message itself (`collapseLong`, once for many); `attachments`: its files, shown as chips
   * @returns {HTMLLIElement}
   */
  addUser(content, id, info = {}) {
    const li = this.doc.createElement("li");
    li.className = "msg user";
    if (id) li.dataset.messageId = id;
    if (info.versions) li.dataset.versions = `${info.versions.index}/${info.versions.count}`;
    const sr = this.srLabel("You said:");
    const body = this.doc.createElement("div");
    body.className = "msg-body";
    body.id = `msg-body-${++this.bodyIds}`;
    body.textContent = content;
    li.append(sr);
    if (info.attachments && info.attachments.length) {
      li.attachments = info.attachments; // an edit resends them
      const chips = this.doc.createElement("ul");
      chips.className = "attachment-chips in-message";
      chips.setAttribute("aria-label", "Attached files");
      info.attachments.forEach((a, i) => {
        const chip = chipElement(this.doc, a);
        if (a.text) {
          const view = this.doc.createElement("button");
          view.type = "button";
          view.className = "chip-view";
          view.dataset.index = String(i);
          view.textContent = "View";
          view.setAttribute("aria-label", `View ${a.name}`); // the visible word first (WCAG 2.5.3)
          view.setAttribute("aria-expanded", "false");
          chip.append(view);
        }
        chips.append(chip);
      });
      li.append(chips);
      if (!content) body.hidden = true;
    }
    li.append(body, userMeta(this.doc, info));
    this.listEl.append(li);
    if (!info.deferFit) this.collapseLong([li]);
    this.updateEmpty();
    this.scrollToBottom();
    return li;
  }

  /**
   * Collapse the user messages taller than `COLLAPSE_OVER_LINES` lines to
   * `COLLAPSED_LINES`, each with a "Show more" / "Show less" button (a long paste
   * would otherwise fill screens of the transcript). Reads every height first, then
   * writes: one layout for many messages.
   * @param {HTMLLIElement[]} items  user messages in the list
   */
  collapseLong(items) {
    const bodies = items.map((li) => li.querySelector(".msg-body")).filter((b) => b && !b.parentElement.querySelector(".show-more"));
    if (!bodies.length) return;
    const line = parseFloat(getComputedStyle(bodies[0]).lineHeight) || 24;
    const tall = bodies.filter((b) => b.scrollHeight > COLLAPSE_OVER_LINES * line);
    for (const body of tall) {
      body.classList.add("collapsible", "collapsed");
      const btn = this.doc.createElement("button");
      btn.type = "button";
      btn.className = "show-more";
      btn.setAttribute("aria-controls", body.id);
      btn.setAttribute("aria-expanded", "false");
      btn.textContent = "Show more";
      body.after(btn);
    }
  }

  /**
   * @private Show (or hide) the text the model read of a sent file, under its message's
   * files: one file's at a time, filled on first view (a file's text can be long).
   * @param {HTMLButtonElement} btn  a chip's View button
   */
  toggleFileText(btn) {
    const li = btn.closest(".msg.user");
    const file = (li.attachments || [])[Number(btn.dataset.index)];
    if (!file) return;
    let box = li.querySelector(".attachment-preview");
    const open = btn.getAttribute("aria-expanded") === "true";
    const files = li.attachments || [];
    for (const b of li.querySelectorAll("button.chip-view")) {
      b.setAttribute("aria-expanded", "false");
      b.setAttribute("aria-label", `View ${files[Number(b.dataset.index)]?.name || "file"}`);
      b.textContent = "View";
    }
    if (open) {
      box.hidden = true;
      return;
    }
    if (!box) {
      box = this.doc.createElement("pre");
      box.className = "attachment-preview";
      box.id = `attachment-preview-${++this.bodyIds}`;
      box.tabIndex = 0; // scrollable: reachable by keyboard
      li.querySelector(".attachment-chips").after(box);
    }
    box.setAttribute("aria-label", `Text of ${file.name}`);
    box.textContent = file.text;
    box.hidden = false;
    btn.setAttribute("aria-controls", box.id);
    btn.setAttribute("aria-expanded", "true");
    btn.setAttribute("aria-label", `Hide ${file.name}`);
    btn.textContent = "Hide";
  }

  /** @private "Show more" / "Show less" on a long user message */
  toggleCollapsed(btn) {
    const body = btn.parentElement.querySelector(".msg-body");
    const collapse = !body.classList.contains("collapsed");
    body.classList.toggle("collapsed", collapse);
    btn.setAttribute("aria-expanded", String(!collapse));
    btn.textContent = collapse ? "Show more" : "Show less";
    // folding a long message back must not leave the reader far below it
    if (collapse && body.getBoundingClientRect().top < this.scrollEl.getBoundingClientRect().top) {
      body.scrollIntoView({ block: "start" });
    }
  }

  /**
   * An assistant message's text as a screen reader should hear it once it is finished:
   * its rendered text (no markdown marks), cut at `SPOKEN_CHARS` with a pointer to the rest.
   * @param {HTMLLIElement} li
   * @returns {string}
   */
  spokenText(li) {
    const text = (li.querySelector(".msg-body")?.textContent || "").replace(/\s+/g, " ").trim();
    return text.length <= SPOKEN_CHARS ? text : `${text.slice(0, SPOKEN_CHARS)}… The rest is in the conversation.`;
  }

  /**
   * An empty assistant message, ready to stream into or to finish at once.
   * @param {string|null} id
   * @returns {HTMLLIElement}
   */
  addAssistant(id) {
    const d = this.doc;
    const li = d.createElement("li");
    li.className = "msg assistant";
    if (id) li.dataset.messageId = id;
    const avatar = d.createElement("div");
    avatar.className = "avatar";
    avatar.setAttribute("aria-hidden", "true");
    const main = d.createElement("div");
    main.className = "msg-main";
    const body = d.createElement("div");
    body.className = "msg-body markdown";
    // the reasoning: "Thinking…" while it is written, then "Thought for 12 s", folded
    const thinking = d.createElement("details");
    thinking.className = "thinking";
    thinking.hidden = true;
    const thinkingLine = d.createElement("summary");
    thinkingLine.className = "thinking-line";
    const thinkingBody = d.createElement("div");
    thinkingBody.className = "thinking-body markdown";
    thinking.append(thinkingLine, thinkingBody);
    // opened or closed by the user (not by `renderThinking`): left as the user set it
    thinking.addEventListener("toggle", () => {
      if (String(thinking.open) !== thinking.dataset.auto) thinking.dataset.touched = "1";
    });
    const typing = d.createElement("div");
    typing.className = "typing";
    typing.setAttribute("aria-hidden", "true");
    typing.append(d.createElement("span"), d.createElement("span"), d.createElement("span"));
    typing.hidden = true;
    const meta = d.createElement("div");
    meta.className = "msg-meta";
    const badge = d.createElement("span");
    badge.className = "badge";
    badge.hidden = true;
    // "32 tokens · 41 tok/s · 512 from cache"; opened, it shows TTFT and the rest
    const stats = d.createElement("details");
    stats.className = "stats";
    const statsLine = d.createElement("summary");
    statsLine.className = "stats-line";
    const statsDetails = d.createElement("div");
    statsDetails.className = "stats-details";
    stats.append(statsLine, statsDetails);
    // "≈ 41 tok/s" while the reply streams (not read out: the status region says when it ends)
    const live = d.createElement("div");
    live.className = "live-rate";
    live.setAttribute("aria-hidden", "true");
    live.hidden = true;
    const actions = d.createElement("span");
    actions.className = "msg-actions";
    actions.append(
      this.iconButton("copy-msg", "Copy reply", ICONS.copy),
      this.iconButton("regenerate", "Regenerate reply", ICONS.regenerate),
      continueButton(d),
    );
    // "< 1/2 >": the replies regenerated for the same message (hidden for one)
    const versions = d.createElement("span");
    versions.className = "versions";
    versions.hidden = true;
    meta.append(versions, badge, stats, actions, timeElement(d, undefined));
    main.append(this.srLabel("Assistant said:"), thinking, body, typing, live, meta);
    li.append(avatar, main);
    this.listEl.append(li);
    this.updateEmpty();
    return li;
  }

  /**
   * Mark an assistant message as streaming: typing dots, `aria-busy` (the transcript is
   * a log that is not read as it changes; the status region says when the reply ends).
   * @param {HTMLLIElement} li
   */
  startStreaming(li) {
    li.classList.add("streaming");
    li.querySelector(".msg-body").setAttribute("aria-busy", "true");
    li.querySelector(".typing").hidden = false;
    li.querySelector(".msg-meta").hidden = true;
    this.scrollToBottom();
  }

  /**
   * Set the streamed text so far; the markdown render happens on the next
   * animation frame, once however many deltas arrived in between.
   * @param {HTMLLIElement} li
   * @param {string} text  the whole reply so far
   */
  setStreamingText(li, text) {
    const st = this.st(li);
    st.text = text;
    if (st.firstAt === undefined && text) {
      st.firstAt = performance.now();
      st.firstLen = text.length;
    }
    if (st.raf) return;
    st.raf = requestAnimationFrame(() => {
      st.raf = 0;
      this.renderNow(li);
    });
  }

  /**
   * Render an assistant message's text now (markdown, sanitised).
   * @param {HTMLLIElement} li
   */
  renderNow(li) {
    const stick = this.isNearBottom();
    const text = this.st(li).text;
    const { reasoning, answer, closed } = splitReasoning(text, this.markers);
    this.renderThinking(li, reasoning, closed);
    this.renderer.render(li.querySelector(".msg-body"), reasoning === null ? text : answer);
    li.querySelector(".typing").hidden = !(li.classList.contains("streaming") && !text);
    if (li.classList.contains("streaming")) this.showLiveRate(li);
    if (stick) this.scrollToBottom();
  }

  /**
   * @private The reasoning block: hidden without reasoning; open with "Thinking…" while
   * the reasoning streams, folded to "Thought for N s" once it is closed (a block the user
   * opened or closed stays so).
   */
  renderThinking(li, reasoning, closed) {
    const box = li.querySelector(".thinking");
    box.hidden = reasoning === null;
    if (reasoning === null) return;
    const st = this.st(li);
    const streaming = li.classList.contains("streaming");
    const now = performance.now();
    if (streaming && st.thinkFrom === undefined) st.thinkFrom = now;
    if (closed && st.thinkMs === undefined && st.thinkFrom !== undefined) st.thinkMs = now - st.thinkFrom;
    const thinking = streaming && !closed;
    box.classList.toggle("is-thinking", thinking);
    li.querySelector(".thinking-line").textContent = thinking ? "Thinking…"
      : st.thinkMs !== undefined ? thoughtFor(st.thinkMs) : "Thoughts";
    if (!box.dataset.touched) {
      box.dataset.auto = String(thinking);
      box.open = thinking;
    }
    this.renderer.render(li.querySelector(".thinking-body"), reasoning);
  }

  /** @private "≈ 41 tok/s" under a streaming reply, redrawn at most every LIVE_RATE_EVERY_MS */
  showLiveRate(li) {
    const st = this.st(li);
    const now = performance.now();
    if (st.firstAt === undefined || (st.rateAt && now - st.rateAt < LIVE_RATE_EVERY_MS)) return;
    const rate = liveRate(st.text.length - (st.firstLen || 0), now - st.firstAt, this.charsPerToken);
    if (rate === null) return;
    st.rateAt = now;
    const el = li.querySelector(".live-rate");
    el.textContent = `≈ ${formatRate(rate)}`;
    el.hidden = false;
  }

  /**
   * Finish an assistant message: final text, badge, stats line.
   * @param {HTMLLIElement} li
   * @param {{id?:string, content?:string, status?:string, finish_reason?:string, usage?:object, timings?:object,
   *   error?:{code:string, message:string}, cut_reason?:string, created_at?:number,
   *   versions?:{index:number, count:number}, reasoning_ms?:number}} info  `error`
   *   (or the stored `cut_reason` of a partial reply) says why a reply was interrupted;
   *   `created_at` (Unix seconds) is the time shown on hover (now when missing)
   */
  finish(li, info) {
    const stick = this.isNearBottom();
    const st = this.st(li);
    if (st.raf) cancelAnimationFrame(st.raf);
    st.raf = 0;
    if (typeof info.content === "string") st.text = info.content;
    if (typeof info.reasoning_ms === "number") st.thinkMs = info.reasoning_ms;
    if (info.id) li.dataset.messageId = info.id;
    li.classList.remove("streaming");
    li.querySelector(".live-rate").hidden = true;
    const body = li.querySelector(".msg-body");
    body.removeAttribute("aria-busy");
    this.renderNow(li);
    li.querySelector(".typing").hidden = true;
    const reason = info.finish_reason;
    li.dataset.finishReason = reason || "";
    if (info.versions) this.setReplyVersions(li, info.versions);
    const time = li.querySelector(".msg-time");
    if (time) setTime(time, info.created_at);
    const status = info.status || (reason === "abort" ? "partial" : reason === "error" ? "error" : "complete");
    li.dataset.status = status;
    const badge = li.querySelector(".badge");
    badge.hidden = status === "complete" && reason !== "length";
    badge.className = `badge badge-${status === "complete" ? "length" : status}`;
    badge.textContent = status === "partial" ? "partial" : status === "error" ? "error" : "max tokens";
    // A reply cut by anything but the user's Stop (an engine crash, a gateway restart)
    // carries `error` {code, message}: show that reason, not "partial".
    const failure = info.error ? String(info.error.message || (info.error.code ? "the reply was interrupted" : ""))
      : CUT_TEXT[info.cut_reason] || "";
    if (failure) {
      badge.textContent = "interrupted";
      badge.hidden = false;
    }
    badge.title =
      failure ? `Interrupted: ${failure}`
      : status === "partial" ? "Stopped before the end: this is what was written so far"
      : status === "error" ? "The reply was interrupted by an error"
      : "The reply reached its max tokens limit";
    const stats = li.querySelector(".stats");
    // An interrupted reply has no engine timings: say why instead of "0 tokens".
    const timed = info.timings && Number(info.timings.e2e_ms) > 0;
    const line = failure ? `Interrupted: ${failure}` : timed || reason !== "error" ? formatStats(replyStats(info.usage, info.timings)) : "";
    const details = formatStatDetails(info.usage, info.timings) || "No timings were recorded for this reply.";
    stats.querySelector(".stats-line").textContent = line;
    stats.querySelector(".stats-line").title = details;
    stats.querySelector(".stats-details").textContent = details;
    stats.hidden = !line;
    this.learnCharsPerToken(st.text, info.usage);
    li.querySelector(".msg-meta").hidden = false;
    if (!st.text && status === "error") {
      const p = this.doc.createElement("p");
      p.className = "muted";
      p.textContent = "No reply was produced.";
      body.replaceChildren(p);
    }
    if (stick) this.scrollToBottom();
  }

  /**
   * Show "< i/n >" under a reply that was regenerated (its versions, 0-based index).
   * @param {HTMLLIElement} li
   * @param {{index:number, count:number}} versions
   */
  setReplyVersions(li, versions) {
    li.dataset.versions = `${versions.index}/${versions.count}`;
    setVersions(this.doc, li.querySelector(".msg-meta"), versions);
  }

  /** @private the live rate's estimate of characters per token, from a finished reply */
  learnCharsPerToken(text, usage) {
    // the whole text's tokens: a continued reply's earlier ones are in its text too
    const n = usage && Number(usage.completion_tokens) + (Number(usage.continued_tokens) || 0);
    if (!(n >= 8) || !text) return;
    this.charsPerToken = 0.7 * this.charsPerToken + 0.3 * (text.length / n);
  }

  /**
   * Show the Regenerate button on the last assistant message only, and only when idle.
   * @param {boolean} idle
   */
  updateRegenerate(idle) {
    const all = this.listEl.querySelectorAll(".msg.assistant");
    const last = all.length ? all[all.length - 1] : null;
    const lastIsAssistant = last !== null && this.listEl.lastElementChild === last;
    for (const li of all) {
      li.querySelector(".regenerate").hidden = !(idle && lastIsAssistant && li === last);
    }
    updateContinue(this.listEl, idle);
  }

  /** @returns {HTMLLIElement|null} the last assistant message, if it is the last message */
  /** @returns {boolean} whether no message is shown */
  isEmpty() {
    return !this.listEl.querySelector(".msg");
  }

  lastAssistant() {
    const last = this.listEl.lastElementChild;
    return last && last.classList.contains("assistant") ? last : null;
  }

  /** @returns {boolean} whether the view is scrolled (nearly) to the end */
  isNearBottom() {
    const el = this.scrollEl;
    return el.scrollHeight - el.scrollTop - el.clientHeight < 80;
  }

  scrollToBottom() {
    this.scrollEl.scrollTop = this.scrollEl.scrollHeight;
  }

  /** @private */
  updateEmpty() {
    this.emptyEl.hidden = this.listEl.childElementCount > 0;
  }

  /** @private */
  srLabel(text) {
    const h = this.doc.createElement("h2");
    h.className = "visually-hidden";
    h.textContent = text;
    return h;
  }

  /** @private */
  iconButton(cls, label, pathData) {
    const b = this.doc.createElement("button");
    b.type = "button";
    b.className = `icon-btn small ${cls}`;
    b.setAttribute("aria-label", label);
    b.title = label;
    b.append(icon(this.doc, pathData));
    return b;
  }
}
