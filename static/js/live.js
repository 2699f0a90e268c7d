// Live tabs (docs/ui.md, "Live tabs"): the gateway sends an `event` frame whenever
// one of the user's chats changes, from any tab, client or gateway replica
// (docs/protocol.md §2). The page re-reads what changed: the chat list, and the open
// chat when it is the one that changed and this page is not itself sending to it
// or following its reply (then its own frames already tell it).

const LIST_DEBOUNCE_MS = 100;
const OWN_CHANGE_MS = 1500; // an event about a change this page just made is not re-read
const ACTIVE_RETRY_MS = 300;

/** Per controller: the list refresh timer and the chats this page just changed itself. */
const stateOf = new WeakMap();

/** @private */
function st(c) {
  let s = stateOf.get(c);
  if (!s) {
    s = { listTimer: 0, own: new Map() };
    stateOf.set(c, s);
  }
  return s;
}

/**
 * Note that this page is about to change chat `sid` through the HTTP API, so that the
 * echo of that change does not make it re-read the chat (and lose the scroll position).
 * @param {object} c  the ChatController
 * @param {string} sid
 */
export function markOwnChange(c, sid) {
  st(c).own.set(sid, Date.now() + OWN_CHANGE_MS);
}

/**
 * Apply one `event` frame.
 * @param {object} c  the ChatController (refreshList, openChat, navigate, sidebar, ...)
 * @param {{kind:string, session_id:string, request_id?:string}} f
 */
export function onLiveEvent(c, f) {
  const s = st(c);
  const sid = f.session_id;
  clearTimeout(s.listTimer);
  const refresh = () => {
    // not while a title is being typed in the list (redrawing it would drop the edit)
    if (c.sidebar.container && c.sidebar.container.querySelector("input")) {
      s.listTimer = setTimeout(refresh, 1000);
      return;
    }
    c.refreshList({ background: true }).then(() => c.changed());
  };
  s.listTimer = setTimeout(refresh, LIST_DEBOUNCE_MS);
  if (!sid) return;
  if (f.kind === "deleted") {
    c.sidebar.remove(sid);
    if (sid === c.currentId && !c.deleting.has(sid)) {
      c.notify("This chat was deleted in another tab or window.");
      c.navigate(null, { replace: true });
    }
    return;
  }
  if (sid !== c.currentId || c.isBusy() || c.creating) return;
  if ((s.own.get(sid) || 0) > Date.now()) return;
  if (f.kind === "updated") {
    // title or settings: keep the shown messages, take the new settings
    c.api.getSession(sid).then((fresh) => {
      if (sid === c.currentId && c.session) {
        c.session = { ...c.session, ...fresh, messages: undefined };
        c.changed();
      }
    }, () => {});
    return;
  }
  if (f.kind === "created") return;
  // started, finished, undone, switched: the messages changed; show them as stored,
  // following a reply another tab started (resume) as if it had been started here
  const reread = (retry) => c.openChat(sid, { keepScroll: f.kind !== "started" }).then(() => {
    if (retry && f.kind === "started" && sid === c.currentId && !c.book.replyOf(sid)) {
      // the reply's stream may not be open yet: look once more
      setTimeout(() => sid === c.currentId && !c.isBusy() && reread(false), ACTIVE_RETRY_MS);
    }
  });
  reread(true);
}
