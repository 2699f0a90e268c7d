// Book-keeping of the replies this page is sending or watching, independent
// of the DOM: which chat waits for a `start`, which reply has seen which `seq`.

/**
 * A frame sent (or queued) that has not been answered by `start` yet.
 * At most one per chat, since a chat runs one generation at a time.
 * @typedef {{sessionId:string, kind:"chat"|"regenerate"|"edit"|"continue", frame:object, sent:boolean,
 *            content:string, userEl:HTMLElement|null, cancelRequested:boolean}} PendingRequest
 */

/**
 * A reply this page is attached to (after `start`, before `done`).
 * `lastSeq` is the highest delta `seq` applied; `text` the concatenated deltas.
 * `kind`/`content`/`userEl` come from the request that started it (null when
 * this page only re-attached to it).
 * @typedef {{requestId:string, sessionId:string, messageId:string, lastSeq:number,
 *            text:string, el:HTMLElement|null, stopRequested:boolean,
 *            kind:"chat"|"regenerate"|"edit"|"continue"|null, content:string, userEl:HTMLElement|null}} Reply
 */

/** Pending requests by chat id and attached replies by request id. */
export class ReplyBook {
  constructor() {
    /** @type {Map<string, PendingRequest>} */
    this.pending = new Map();
    /** @type {Map<string, Reply>} */
    this.replies = new Map();
  }

  /**
   * @param {string} sessionId
   * @returns {boolean} whether that chat waits for a start or has a reply running here
   */
  isBusy(sessionId) {
    if (!sessionId) return false;
    if (this.pending.has(sessionId)) return true;
    for (const r of this.replies.values()) if (r.sessionId === sessionId) return true;
    return false;
  }

  /** @param {string} sessionId @returns {Reply|undefined} the chat's running reply */
  replyOf(sessionId) {
    for (const r of this.replies.values()) if (r.sessionId === sessionId) return r;
    return undefined;
  }

  /**
   * Track a reply (after `start`, or before a `resume` is sent).
   * @param {string} requestId
   * @param {string} sessionId
   * @param {string} messageId
   * @returns {Reply}
   */
  attach(requestId, sessionId, messageId) {
    const r = { requestId, sessionId, messageId, lastSeq: 0, text: "", el: null, stopRequested: false,
      kind: null, content: "", userEl: null };
    this.replies.set(requestId, r);
    return r;
  }

  /**
   * Apply one delta frame. Deltas at or below the last applied seq are
   * duplicates (a re-sent range after a resume) and are dropped.
   * @param {{request_id:string, seq:number, text:string}} f
   * @returns {Reply|null} the reply when the delta changed it
   */
  applyDelta(f) {
    const r = this.replies.get(f.request_id);
    if (!r || typeof f.seq !== "number" || f.seq <= r.lastSeq) return null;
    if (f.seq !== r.lastSeq + 1) console.warn(`reply ${r.requestId}: seq ${f.seq} after ${r.lastSeq}`);
    r.lastSeq = f.seq;
    r.text += typeof f.text === "string" ? f.text : "";
    return r;
  }

  /**
   * The pending request an error frame answers: by session id, or, for an
   * error that names neither a chat nor a reply (e.g. a frame too large to
   * parse), the most recent pending one.
   * @param {{session_id?:string, request_id?:string}} f
   * @returns {PendingRequest|undefined}
   */
  pendingForError(f) {
    if (f.session_id) return this.pending.get(f.session_id);
    if (f.request_id) return undefined;
    let last;
    for (const p of this.pending.values()) last = p;
    return last;
  }
}

/**
 * A random id for `client_msg_id` (crypto.randomUUID needs a secure context;
 * getRandomValues does not).
 * @returns {string} 32 hex digits
 */
export function randomId() {
  const b = new Uint8Array(16);
  crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}
