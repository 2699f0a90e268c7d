// The chat controller: turns user actions into HTTP calls and WebSocket
// frames (docs/protocol.md §2-3), and server frames into view updates.

import { ApiError } from "./api.js";
import { errorText, titleFrom } from "./format.js";
import { chatIdFromHash, hashForChat } from "./router.js";
import { ReplyBook, randomId } from "./replies.js";
import { effectiveSettings } from "./settings.js";
import { withoutUnset } from "./sampling.js";
import { clearPromptProgress, contextTokens, showPromptProgress } from "./progress.js";

/**
 * Put a GET/PUT /api/defaults body (`{system_prompt, params}`) into
 * `config.defaults` (the flat shape GET /api/config uses), in place, so every
 * holder of that object sees the user's defaults.
 * @param {object} config  the page's config
 * @param {{system_prompt?:string, params?:object}} d
 */
export function replaceDefaults(config, d) {
  if (!d || typeof d !== "object") return;
  const target = config.defaults || (config.defaults = {});
  for (const k of Object.keys(target)) delete target[k];
  Object.assign(target, d.params || {}, { system_prompt: d.system_prompt ?? "" });
}
import { onLiveEvent, markOwnChange } from "./live.js";

/** The starts of notices that hold only while the open chat writes a reply: they go when
 * its reply ends or another chat is shown, so none outlives the reply it was about. */
const BUSY_NOTICES = ["A reply is still being written", "Wait for the reply to finish", "This chat is still writing a reply"];

/**
 * @param {string} text  a notice's text
 * @returns {boolean} whether it says the open chat is busy writing a reply
 */
export function isBusyNotice(text) {
  return !!text && BUSY_NOTICES.some((t) => text.startsWith(t));
}

/**
 * @typedef {object} ControllerDeps
 * @property {Window} win
 * @property {object} config  GET /api/config body
 * @property {typeof import("./api.js").api} api
 * @property {import("./socket.js").ChatSocket} socket  created by the caller with onFrame/onStatus wired here
 * @property {import("./messages.js").MessageView} view
 * @property {import("./sidebar.js").SidebarView} sidebar
 * @property {(message:string, opts?:{onlyBusy?:boolean})=>void} notify  shows an error notice ("" hides
 *   it; with `onlyBusy` only a notice that says the chat is busy, see isBusyNotice)
 * @property {(message:string)=>void} announce  polite screen-reader announcement (the status region)
 * @property {import("./progress.js").ContextMeter} [meter]  how full the open chat's context is
 * @property {(state:{id:string|null, busy:boolean, stopping:boolean, title:string, restore?:string, restoreFiles?:object[],
 *   loaded:boolean, model:string})=>void} onChange
 *   refresh of the composer and header; `restore` (and `restoreFiles`, its attachments) is a refused message to put back in the
 *   composer; `loaded` is false while the open chat's history is being fetched
 */

export class ChatController {
  /** @param {ControllerDeps} deps */
  constructor(deps) {
    Object.assign(this, deps);
    this.book = new ReplyBook();
    /** @type {string|null} */
    this.currentId = null;
    /** @type {object|null} the open chat's session (without messages) */
    this.session = null;
    /** @type {string|null} the model a new chat is created with (the picker's choice; null: the server's default) */
    this.newChatModel = null;
    /** Settings chosen for the unsaved new chat. */
    this.draft = null;
    this.loadToken = 0;
    this.wasOpen = false;
    /** True while the first message of a new chat waits for the chat to be created. */
    this.creating = false;
    /** @type {string|undefined} see restoreInput */
    this.restoreText = undefined;
    /** @type {object[]|undefined} see restoreInput */
    this.restoreFiles = undefined;
    this.limits = { maxFrameBytes: Number((deps.config.limits || {}).max_frame_bytes) || 0 };
    /** Chats renamed on this page (a later `done` title must not undo that). */
    this.renamed = new Set();
    /** Chats this page is deleting: their reply's end, their "deleted" event and a failed
     * re-read may arrive before the server's answer, and say nothing the user needs. */
    this.deleting = new Set();
    /** Settings of the last new chat created here (restored if its first message fails). */
    this.createdDraft = null;
  }

  // ---- navigation -------------------------------------------------------

  /** Open the chat named by the URL fragment (a new chat when none). */
  openFromLocation() {
    return this.openChat(chatIdFromHash(this.win.location.hash));
  }

  /**
   * Show a chat: its history, and its running reply if any (re-attached
   * with `resume`, from seq 0 unless this page already follows it).
   * @param {string|null} id  null for a new, unsaved chat
   * @param {{keepScroll?:boolean}} [opts]  re-read the open chat in place (no blank
   *   pane meanwhile), keeping the scroll position unless it was at the bottom
   */
  async openChat(id, opts = {}) {
    const token = ++this.loadToken;
    const inPlace = !!opts.keepScroll && id !== null && id === this.currentId && !!this.session;
    const top = this.view.scrollEl.scrollTop;
    const atBottom = this.view.isNearBottom();
    if (id !== this.currentId) this.notify("", { onlyBusy: true });
    this.currentId = id;
    if (!inPlace) {
      this.session = null;
      for (const r of this.book.replies.values()) r.el = null;
      this.view.clear();
      this.meter?.set(0);
    }
    this.sidebar.setActive(id);
    this.changed();
    if (!id) return;
    let s;
    try {
      s = await this.api.getSession(id);
    } catch (err) {
      if (token !== this.loadToken) return;
      if (err instanceof ApiError && err.code === "not_found") {
        this.sidebar.remove(id);
        if (!this.deleting.has(id)) this.notify("That chat no longer exists.");
        this.navigate(null, { replace: true });
      } else {
        this.notify(this.apiErrorText(err));
      }
      return;
    }
    if (token !== this.loadToken) return;
    this.showSession(s);
    if (inPlace && !atBottom) this.view.scrollEl.scrollTop = top;
  }

  /**
   * Draw a freshly loaded session and attach to its running reply.
   * @param {object} s  GET /api/sessions/{id} body
   * @private
   */
  showSession(s) {
    this.session = s;
    const active = s.active || null;
    const history = (s.messages || []).filter((m) => !active || m.id !== active.message_id);
    this.view.showHistory(history);
    this.meter?.set(contextTokens(history));
    this.sidebar.upsert({ id: s.id, title: s.title, created_at: s.created_at, updated_at: s.updated_at });
    if (active) {
      let r = this.book.replies.get(active.request_id);
      const isNew = !r;
      if (!r) r = this.book.attach(active.request_id, s.id, active.message_id);
      r.el = this.view.addAssistant(r.messageId);
      this.view.startStreaming(r.el);
      if (r.text) this.view.setStreamingText(r.el, r.text);
      if (isNew) this.socket.send({ type: "resume", request_id: r.requestId, last_seq: 0 });
    }
    this.changed();
  }

  /**
   * Change the URL to a chat and show it. With `replace` no history entry is
   * added (used when the current entry's chat is gone).
   * @param {string|null} id
   * @param {{replace?:boolean}} [opts]
   */
  navigate(id, opts = {}) {
    const hash = hashForChat(id);
    if (opts.replace) {
      this.win.history.replaceState(null, "", hash);
      if (id !== this.currentId) this.openChat(id);
    } else if (this.win.location.hash !== hash) {
      this.win.location.hash = hash; // hashchange opens it
    } else {
      this.openChat(id);
    }
  }

  // ---- user actions -----------------------------------------------------

  /**
   * Send a user message in the open chat, creating the chat first when it is new.
   * @param {string} content
   * @param {Array<object>} [attachments]  files read by POST /api/attachments (static/js/attachments.js)
   * @returns {Promise<boolean>} false when nothing was sent (the caller keeps the text)
   */
  async send(content, attachments = []) {
    if ((!content.trim() && !attachments.length) || this.isBusy() || this.creating) return false;
    const files = attachments.map(({ name, kind, text, size, pages }) => ({ name, kind, text, size, ...(pages ? { pages } : {}) }));
    const bytes = new TextEncoder().encode(content + files.map((f) => f.text).join("")).length;
    if (this.limits.maxFrameBytes && bytes + 512 > this.limits.maxFrameBytes) {
      this.notify(errorText("frame_too_large", "", this.limits));
      return false;
    }
    this.notify("");
    let id = this.currentId;
    let createdHere = false;
    if (!id) {
      // Untouched settings are left to the server, so its defaults apply.
      const body = this.draft ? { system_prompt: this.draft.system_prompt, params: this.draft.params } : {};
      if (this.newChatModel) body.model = this.newChatModel;
      let s;
      const token = this.loadToken;
      this.creating = true; // a second Enter must not create a second chat
      try {
        s = await this.api.createSession(body);
      } catch (err) {
        this.notify(this.apiErrorText(err));
        return false;
      } finally {
        this.creating = false;
      }
      id = s.id;
      createdHere = true;
      this.createdDraft = this.draft;
      this.draft = null;
      // Until `done` brings the server's title, the first line stands in for it.
      const provisional = titleFrom(content.trim() ? content : files[0].name);
      this.sidebar.upsert({ id, title: s.title || provisional, created_at: s.created_at, updated_at: s.updated_at });
      if (token === this.loadToken) {
        this.currentId = id;
        this.session = s;
        this.loadToken++;
        this.win.history.replaceState(null, "", hashForChat(id));
        this.sidebar.setActive(id);
      } // else the user opened another chat meanwhile: the message still goes to the new one
    }
    const frame = { type: "chat", session_id: id, content, client_msg_id: randomId() };
    if (files.length) frame.attachments = files;
    const userEl = id === this.currentId ? this.view.addUser(content, null, { attachments: attachments }) : null;
    this.book.pending.set(id, { sessionId: id, kind: "chat", frame, sent: false, content, attachments, userEl, cancelRequested: false, createdHere });
    this.flushPending();
    this.changed();
    return true;
  }

  /** Replace the open chat's last reply with a new one. */
  regenerate() {
    const id = this.currentId;
    if (!id || this.isBusy()) return;
    this.notify("");
    // Name the reply this page shows: the server refuses (conflict) if another tab
    // changed the chat meanwhile, instead of replacing a reply never seen here.
    const shown = this.view.lastAssistant();
    const frame = { type: "regenerate", session_id: id };
    if (shown && shown.dataset.messageId) frame.message_id = shown.dataset.messageId;
    this.book.pending.set(id, { sessionId: id, kind: "regenerate", frame, sent: false, content: "", userEl: null, cancelRequested: false });
    this.flushPending();
    this.changed();
  }

  /**
   * Edit a user message and resend: the chat is cut after it and answered anew; the
   * old branch stays as a version (docs/protocol.md, `edit`).
   * @param {string} messageId  the user message edited
   * @param {string} content
   * @returns {boolean} false when nothing was sent (the editor stays open)
   */
  edit(messageId, content) {
    const id = this.currentId;
    const li = [...this.view.listEl.querySelectorAll(".msg.user")].find((el) => el.dataset.messageId === messageId);
    const files = (li && li.attachments) || []; // an edited message keeps its files
    if (!id || (!content.trim() && !files.length) || this.isBusy()) return false;
    this.notify("");
    const frame = { type: "edit", session_id: id, message_id: messageId, content, client_msg_id: randomId() };
    if (files.length) frame.attachments = files;
    this.book.pending.set(id, { sessionId: id, kind: "edit", frame, sent: false, content, userEl: null, cancelRequested: false,
      editedId: messageId });
    this.flushPending();
    this.changed();
    return true;
  }

  /**
   * Continue the last reply, cut at max tokens: it is extended in place.
   * @param {string} messageId  the reply
   */
  continueReply(messageId) {
    const id = this.currentId;
    if (!id || this.isBusy()) return;
    this.notify("");
    const frame = { type: "continue", session_id: id, message_id: messageId };
    this.book.pending.set(id, { sessionId: id, kind: "continue", frame, sent: false, content: "", userEl: null, cancelRequested: false });
    this.flushPending();
    this.changed();
  }

  /**
   * Show another version of the chat from a message on (an edited user message, a
   * regenerated reply); the scroll position stays.
   * @param {string} messageId  the message shown at that point
   * @param {number} index  0-based version
   */
  async switchVersion(messageId, index) {
    const id = this.currentId;
    if (!id || this.isBusy()) return;
    this.notify("");
    markOwnChange(this, id);
    let s;
    try {
      s = await this.api.switchVersion(id, messageId, index);
    } catch (err) {
      this.notify(this.apiErrorText(err));
      if (err instanceof ApiError && err.code === "conflict") this.openChat(id);
      return;
    }
    if (id !== this.currentId) return;
    const top = this.view.scrollEl.scrollTop;
    this.showSession(s);
    this.view.scrollEl.scrollTop = top;
    // the gateway retitles a chat named after its first message when another version of it is shown
    this.sidebar.upsert({ id, title: s.title, updated_at: s.updated_at });
    this.changed();
  }

  /** Stop the open chat's reply (`cancel`); its partial text is kept. */
  stop() {
    const id = this.currentId;
    if (!id) return;
    const r = this.book.replyOf(id);
    if (r) {
      if (!r.stopRequested) {
        r.stopRequested = true;
        this.socket.send({ type: "cancel", request_id: r.requestId });
      }
    } else {
      const p = this.book.pending.get(id);
      if (p) p.cancelRequested = true; // sent once `start` names the reply
    }
    this.changed();
  }

  /**
   * @param {string} id
   * @param {string} title
   */
  async rename(id, title) {
    try {
      const s = await this.api.patchSession(id, { title });
      this.renamed.add(id);
      this.sidebar.upsert({ id, title: s.title ?? title, updated_at: s.updated_at });
      if (id === this.currentId && this.session) this.session.title = s.title ?? title;
      this.changed();
    } catch (err) {
      this.notify(this.apiErrorText(err));
      this.sidebar.setSessions(this.sidebar.sessions); // redraw the old title
    }
  }

  /**
   * @param {string} id  deleted on the server, then from the list
   * @returns {Promise<boolean>} whether it is gone (false: the server refused, a notice says why)
   */
  async remove(id) {
    this.deleting.add(id);
    try {
      await this.api.deleteSession(id);
    } catch (err) {
      if (!(err instanceof ApiError && err.code === "not_found")) {
        this.deleting.delete(id);
        this.notify(this.apiErrorText(err));
        if (id === this.currentId) this.openChat(id); // re-attach a reply whose end was dropped meanwhile
        return false;
      }
    } finally {
      // its late frames and events are dropped while the delete is in flight; a little after
      // it, nothing more about it can come
      setTimeout(() => this.deleting.delete(id), 2000);
    }
    this.sidebar.remove(id);
    this.book.pending.delete(id);
    for (const r of [...this.book.replies.values()]) if (r.sessionId === id) this.book.replies.delete(r.requestId);
    if (id === this.currentId) this.navigate(null, { replace: true });
    return true;
  }

  /** @returns {import("./settings.js").ChatSettings} the open chat's settings */
  currentSettings() {
    return this.currentId ? effectiveSettings(this.session, this.config.defaults) : this.draft || effectiveSettings(null, this.config.defaults);
  }

  /**
   * Save settings: PATCH for a stored chat, kept locally for a new one.
   * @param {import("./settings.js").ChatSettings} settings
   * @throws {Error} with a user-facing message when the server refuses
   */
  async saveSettings(settings) {
    if (settings.asDefault) await this.saveDefaults(settings);
    if (!this.currentId) {
      this.draft = { system_prompt: settings.system_prompt, params: withoutUnset(settings.params) };
      return;
    }
    const id = this.currentId;
    const params = withoutUnset({ ...((this.session && this.session.params) || {}), ...settings.params });
    try {
      const s = await this.api.patchSession(id, { system_prompt: settings.system_prompt, params });
      if (id === this.currentId) this.session = { ...(this.session || {}), ...s };
    } catch (err) {
      throw new Error(this.apiErrorText(err));
    }
  }

  /**
   * Save settings as the user's defaults for new chats (PUT /api/defaults) and
   * use them on this page from now on.
   * @param {import("./settings.js").ChatSettings} settings
   * @throws {Error} with a user-facing message when the server refuses
   */
  async saveDefaults(settings) {
    try {
      const d = await this.api.putDefaults({ system_prompt: settings.system_prompt, params: withoutUnset(settings.params) });
      replaceDefaults(this.config, d);
    } catch (err) {
      throw new Error(this.apiErrorText(err));
    }
  }

  /**
   * Reload the chat list.
   * @param {{background?:boolean}} [opts] background: a refresh nobody asked for (another
   *   tab's change); when it cannot reach the server it says nothing, since the connection
   *   badge says so already and the list is re-read on reconnect; a notice from it would
   *   replace a more useful one, such as why Enter sent nothing.
   */
  async refreshList({ background = false } = {}) {
    try {
      this.sidebar.setSessions(await this.api.listSessions());
    } catch (err) {
      if (background && err && err.code === "network") return;
      this.notify(this.apiErrorText(err));
    }
  }

  // ---- socket -----------------------------------------------------------

  /**
   * The socket (re)opened: send what waited, re-attach to the open chat's
   * reply from the last seq seen, forget replies of other chats (opening
   * them later resumes from 0).
   */
  onOpen() {
    const reconnect = this.wasOpen;
    this.wasOpen = true;
    this.socket.send({ type: "events" }); // live tabs: hear of changes made elsewhere
    let reload = false;
    for (const p of [...this.book.pending.values()]) {
      // A chat frame carries client_msg_id, so re-sending it is safe; a
      // regenerate is not, so the chat is re-read to see whether it started.
      if (p.sent && (p.kind === "regenerate" || p.kind === "continue")) {
        this.book.pending.delete(p.sessionId);
        if (p.sessionId === this.currentId) reload = true;
      } else {
        p.sent = false;
      }
    }
    this.flushPending();
    for (const r of [...this.book.replies.values()]) {
      if (r.sessionId !== this.currentId) {
        this.book.replies.delete(r.requestId);
        continue;
      }
      this.socket.send({ type: "resume", request_id: r.requestId, last_seq: r.lastSeq });
      if (r.stopRequested) this.socket.send({ type: "cancel", request_id: r.requestId });
    }
    if (reconnect) {
      this.refreshList();
      if (reload && this.currentId) this.openChat(this.currentId);
    }
    this.changed();
  }

  /**
   * One server frame.
   * @param {{type:string}} f
   */
  onFrame(f) {
    switch (f.type) {
      case "start":
        return this.onStart(f);
      case "delta": {
        const r = this.book.applyDelta(f);
        if (r && r.el) {
          clearPromptProgress(r.el);
          this.view.setStreamingText(r.el, r.text);
        }
        return;
      }
      case "progress":
        return this.onProgress(f);
      case "done":
        return this.onDone(f);
      case "error":
        return this.onError(f);
      case "event":
        return onLiveEvent(this, f);
      default:
        return;
    }
  }

  /** @private */
  onStart(f) {
    const known = this.book.replies.get(f.request_id);
    if (known) {
      // The answer to our resume.
      if (f.message_id) known.messageId = f.message_id;
      return;
    }
    const p = this.book.pending.get(f.session_id);
    if (!p) return;
    this.book.pending.delete(f.session_id);
    const r = this.book.attach(f.request_id, f.session_id, f.message_id);
    Object.assign(r, { kind: p.kind, content: p.content, attachments: p.attachments, userEl: p.userEl, createdHere: !!p.createdHere });
    if (p.userEl && f.user_message_id) p.userEl.dataset.messageId = f.user_message_id;
    if (f.session_id === this.currentId) {
      let regenerated = null;
      if (p.kind === "regenerate") {
        // the old reply stays as a version: the new one is the newest of them
        const old = this.view.lastAssistant();
        const known = old ? (old.dataset.versions || "").split("/") : [];
        const count = known.length === 2 ? Number(known[1]) + 1 : old ? 2 : 1;
        if (count > 1) regenerated = { index: count - 1, count };
        if (old) old.remove();
      }
      if (p.kind === "edit") r.userEl = this.showEdited(p, f);
      const continued = p.kind === "continue" ? this.view.lastAssistant() : null;
      r.el = continued && continued.dataset.messageId === f.message_id ? continued : this.view.addAssistant(f.message_id);
      if (regenerated) this.view.setReplyVersions(r.el, regenerated);
      this.view.startStreaming(r.el);
      this.announce("The assistant is replying.");
    }
    if (p.cancelRequested) {
      r.stopRequested = true;
      this.socket.send({ type: "cancel", request_id: r.requestId });
    }
    this.changed();
  }

  /**
   * An edit started: cut the view at the edited message and show the new text as
   * the newest of its versions.
   * @private
   * @returns {HTMLLIElement} the new user message
   */
  showEdited(p, f) {
    const list = this.view.listEl;
    const old = [...list.querySelectorAll(".msg.user")].find((li) => li.dataset.messageId === p.editedId);
    let count = 2;
    if (old) {
      const known = (old.dataset.versions || "").split("/");
      if (known.length === 2) count = Number(known[1]) + 1;
      while (old.nextElementSibling) old.nextElementSibling.remove();
      old.remove();
    }
    return this.view.addUser(p.content, f.user_message_id || null, { created_at: Date.now() / 1000, versions: { index: count - 1, count } });
  }

  /**
   * A long prompt is being read: "Reading N / M tokens" in place of the typing dots
   * (until the first text), and the meter counts the prompt.
   * @private
   */
  onProgress(f) {
    const r = this.book.replies.get(f.request_id);
    if (!r || r.text || r.sessionId !== this.currentId) return;
    if (r.el) showPromptProgress(r.el, Number(f.prompt_tokens_done), Number(f.prompt_tokens));
    this.meter?.set(Number(f.prompt_tokens));
  }

  /** @private */
  onDone(f) {
    const r = this.book.replies.get(f.request_id);
    if (!r) return;
    this.book.replies.delete(f.request_id);
    if (this.deleting.has(r.sessionId)) return;
    if (r.sessionId === this.currentId) this.notify("", { onlyBusy: true }); // the reply it was about ended
    if (r.sessionId === this.currentId && f.usage && f.usage.prompt_tokens > 0) {
      this.meter?.set(f.usage.prompt_tokens + (f.usage.completion_tokens || 0));
    }
    if (r.el) {
      clearPromptProgress(r.el);
      this.view.finish(r.el, {
        id: f.message_id,
        content: r.text,
        finish_reason: f.finish_reason,
        usage: f.usage,
        timings: f.timings,
        error: f.error,
        reasoning_ms: f.reasoning_ms,
      });
      // The transcript is not read as it streams (aria-live off): the finished reply is.
      const said = this.view.spokenText(r.el);
      const end = f.finish_reason === "abort" ? "Reply stopped." : f.finish_reason === "error" ? "The reply was interrupted." : "Reply finished.";
      this.announce(said ? `${end} ${said}` : end);
    }
    const summary = { id: r.sessionId, updated_at: Date.now() / 1000 };
    // A title from `done` names a new chat, unless the user renamed it meanwhile.
    const title = f.title && !this.renamed.has(r.sessionId) ? f.title : undefined;
    if (title) summary.title = title;
    this.sidebar.upsert(summary);
    if (title && r.sessionId === this.currentId && this.session) this.session.title = title;
    this.changed();
  }

  /** @private */
  onError(f) {
    const text = errorText(f.code, f.message, this.limits);
    const r = f.request_id ? this.book.replies.get(f.request_id) : undefined;
    if (r) {
      this.book.replies.delete(r.requestId);
      if (this.deleting.has(r.sessionId)) return;
      if (r.sessionId === this.currentId) {
        if (f.code === "store_unavailable") {
          // The store stayed down longer than the gateway waits: keep what was
          // shown (re-reading the chat now would only fail and empty the view).
          if (r.el) this.view.finish(r.el, { content: r.text, status: "partial", finish_reason: "error", error: { code: f.code, message: f.message } });
          this.notify(text);
          this.changed();
          return;
        }
        // Either the reply's stream is gone (not_found on a resume) or the
        // engine refused the turn after `start`, in which case the gateway
        // removed the user message (or put the old reply back). Either way
        // the stored chat is the truth, so it is read again.
        if (r.el) r.el.remove();
        if (r.userEl) r.userEl.remove();
        if (f.code !== "not_found") {
          if (r.kind === "chat" || r.kind === "edit") this.restoreInput(r.content, r.kind === "chat" ? r.attachments : null);
          this.notify(text);
        }
        if (r.createdHere && f.code !== "not_found" && this.view.isEmpty()) this.dropNewChat(r.sessionId);
        else this.openChat(this.currentId);
      }
      this.changed();
      return;
    }
    const p = this.book.pendingForError(f);
    if (p && (f.code === "busy" || f.code === "conflict")) {
      // Another tab is writing in (or changed) this chat: show its reply live so
      // that it can be followed and stopped here, and keep the message to resend.
      this.book.pending.delete(p.sessionId);
      if (p.userEl) p.userEl.remove();
      if (p.sessionId === this.currentId) {
        if (p.kind === "chat" || p.kind === "edit") this.restoreInput(p.content, p.kind === "chat" ? p.attachments : null);
        this.notify(f.code === "busy" ? "This chat is still writing a reply (started in another tab); it is shown below, where you can stop it." : text);
        this.openChat(this.currentId);
      }
      this.changed();
      return;
    }
    if (p) {
      this.book.pending.delete(p.sessionId);
      if (p.userEl) p.userEl.remove();
      if ((p.kind === "chat" || p.kind === "edit") && p.sessionId === this.currentId) {
        this.restoreInput(p.content, p.kind === "chat" ? p.attachments : null);
      }
      this.view.updateRegenerate(true);
      if (p.sessionId === this.currentId || !this.currentId) this.notify(text);
      if (p.createdHere && p.sessionId === this.currentId && this.view.isEmpty()) this.dropNewChat(p.sessionId);
      this.changed();
      return;
    }
    this.notify(text);
  }

  /**
   * The first message of a chat created on this page was refused: delete the
   * (empty) chat and go back to the new-chat view with its settings, so no
   * empty chat named after the refused text is left in the list.
   * @private
   * @param {string} id
   */
  dropNewChat(id) {
    this.view.clear(); // the empty state comes back
    this.sidebar.remove(id);
    this.api.deleteSession(id).catch(() => {}); // already gone is fine
    this.draft = this.createdDraft;
    this.win.history.replaceState(null, "", hashForChat(null));
    this.currentId = null;
    this.session = null;
    this.loadToken++;
    this.sidebar.setActive(null);
  }

  // ---- helpers ----------------------------------------------------------

  /** @returns {boolean} whether the open chat waits for or streams a reply */
  isBusy() {
    return this.book.isBusy(this.currentId);
  }

  /** @private Send every pending frame not sent yet (no-op while disconnected). */
  flushPending() {
    for (const p of this.book.pending.values()) {
      if (!p.sent && this.socket.send(p.frame)) p.sent = true;
    }
  }

  /** @private */
  apiErrorText(err) {
    if (err instanceof ApiError) return errorText(err.code, err.message, this.limits);
    return errorText("internal_error", String(err));
  }

  /**
   * Have the next `onChange` put a refused message back in the composer
   * (the page does so only if nothing new was typed).
   * @private
   */
  restoreInput(content, files = null) {
    this.restoreText = content;
    this.restoreFiles = files && files.length ? files : undefined;
  }

  /**
   * Whether a message whose files take `pendingTokens` fits the model's context after
   * the open chat's; says why not (nothing is sent) when it does not.
   * @param {number} pendingTokens
   * @returns {boolean}
   */
  fitsContext(pendingTokens) {
    const max = Number(this.config.max_model_len) || 0;
    const used = this.meter ? this.meter.tokens : 0;
    if (!max || !pendingTokens || used + pendingTokens < max) return true;
    const fmt = (n) => new Intl.NumberFormat("en-US").format(n);
    this.notify(`The attached files take ${fmt(pendingTokens)} tokens${used ? ` and this chat already ${fmt(used)}` : ""}; `
      + `the model's context holds ${fmt(max)}. Remove a file${used ? " or start a new chat" : ""}.`);
    return false;
  }

  /** Tell the page to refresh its composer and header. */
  changed() {
    const busy = this.isBusy();
    const r = this.currentId ? this.book.replyOf(this.currentId) : undefined;
    const p = this.currentId ? this.book.pending.get(this.currentId) : undefined;
    const stopping = !!((r && r.stopRequested) || (p && p.cancelRequested));
    const title = this.currentId ? (this.sidebar.get(this.currentId)?.title || (this.session && this.session.title) || "New chat") : "New chat";
    this.view.updateRegenerate(!busy);
    const restore = this.restoreText;
    const restoreFiles = this.restoreFiles;
    this.restoreText = this.restoreFiles = undefined;
    const loaded = !this.currentId || (!!this.session && this.session.id === this.currentId);
    this.onChange({ id: this.currentId, busy, stopping, title, restore, restoreFiles, loaded, model: this.modelOf() });
  }

  /** @returns {string} the model the open chat's replies come from (a new chat's: the one it will be created with) */
  modelOf() {
    if (this.currentId) return (this.session && this.session.model) || this.config.model || "";
    return this.newChatModel || this.config.model || "";
  }

  /**
   * The user chose a model: the open chat's replies come from it from now on (saved
   * with the chat), and new chats are created with it.
   * @param {string} model
   */
  async pickModel(model) {
    const id = this.currentId;
    this.newChatModel = model; // new chats start with the last model chosen
    if (!id || !this.session) {
      this.changed();
      return;
    }
    const before = this.session.model;
    this.session.model = model;
    this.changed();
    try {
      markOwnChange(this, id);
      const s = await this.api.patchSession(id, { model });
      if (id === this.currentId && this.session) this.session.model = s.model;
    } catch (err) {
      if (id === this.currentId && this.session) this.session.model = before;
      this.notify(this.apiErrorText(err));
    }
    this.changed();
  }
}
