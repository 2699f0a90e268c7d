// The chat list: newest first, grouped by day, with inline rename and delete.

import { dateGroup } from "./format.js";
import { hashForChat } from "./router.js";
import { icon, ICONS } from "./icons.js";

/** A chat as the list shows it (GET /api/sessions items). */
/** @typedef {{id:string, title:string, created_at:number, updated_at:number}} ChatSummary */

/** The sidebar's list of chats. The controller owns the data flow; this draws it. */
export class SidebarView {
  /**
   * @param {{doc:Document, container:HTMLElement, maxTitleChars?:number,
   *          onRename:(id:string, title:string)=>void, onDelete:(id:string)=>void}} opts
   *   onRename is called with a trimmed, non-empty, changed title.
   */
  constructor(opts) {
    this.doc = opts.doc;
    this.container = opts.container;
    this.onRename = opts.onRename;
    this.onDelete = opts.onDelete;
    this.maxTitleChars = opts.maxTitleChars || 200;
    /** @type {ChatSummary[]} */
    this.sessions = [];
    this.activeId = null;
    /** While a title is typed the list is not redrawn (that would drop the edit); `stale`: redraw after. */
    this.renaming = false;
    this.stale = false;
    this.container.addEventListener("click", (ev) => this.handleClick(ev));
  }

  /** @param {ChatSummary[]} sessions  any order; shown newest first */
  setSessions(sessions) {
    this.sessions = [...sessions];
    this.render();
  }

  /** @param {string|null} id  the open chat, highlighted */
  setActive(id) {
    this.activeId = id;
    for (const a of this.container.querySelectorAll(".chat-link")) {
      if (a.closest(".chat-item").dataset.id === id) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
  }

  /**
   * Insert or update one chat (moves it by its `updated_at`).
   * @param {ChatSummary} s
   */
  upsert(s) {
    const i = this.sessions.findIndex((x) => x.id === s.id);
    if (i >= 0) this.sessions[i] = { ...this.sessions[i], ...s };
    else this.sessions.push(s);
    this.render();
  }

  /** @param {string} id */
  remove(id) {
    this.sessions = this.sessions.filter((s) => s.id !== id);
    this.render();
  }

  /** @param {string} id  @returns {ChatSummary|undefined} */
  get(id) {
    return this.sessions.find((s) => s.id === id);
  }

  /**
   * Swap a chat's title for a text field; Enter or leaving the field saves, Escape cancels.
   * @param {string} id
   */
  beginRename(id) {
    const item = this.itemFor(id);
    const s = this.get(id);
    if (!item || !s) return;
    const link = item.querySelector(".chat-link");
    const input = this.doc.createElement("input");
    input.type = "text";
    input.className = "rename-input";
    input.value = s.title || "";
    input.maxLength = this.maxTitleChars;
    input.setAttribute("aria-label", "Chat title");
    let finished = false;
    const finish = (save) => {
      if (finished) return;
      finished = true;
      const title = input.value.trim();
      this.renaming = false;
      input.replaceWith(link);
      link.focus();
      if (this.stale) this.render(); // what changed meanwhile (the focus stays on this chat's link)
      if (save && title && title !== s.title) this.onRename(id, title);
    };
    input.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") {
        ev.preventDefault();
        finish(true);
      } else if (ev.key === "Escape") {
        ev.preventDefault();
        ev.stopPropagation();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    link.replaceWith(input);
    this.renaming = true;
    input.focus();
    input.select();
  }

  /** @private */
  itemFor(id) {
    return [...this.container.querySelectorAll(".chat-item")].find((li) => li.dataset.id === id) || null;
  }

  /** @private */
  handleClick(ev) {
    const btn = ev.target.closest("button");
    if (!btn) return;
    const id = btn.closest(".chat-item")?.dataset.id;
    if (!id) return;
    if (btn.classList.contains("rename")) this.beginRename(id);
    else if (btn.classList.contains("delete")) this.onDelete(id);
  }

  /** @private */
  render() {
    const d = this.doc;
    if (this.renaming) {
      this.stale = true;
      return;
    }
    this.stale = false;
    // A redraw (another tab's change, a finished reply) must not drop the keyboard
    // user's focus to the page's body: it goes back to the same control of the same chat.
    const focused = this.container.contains(d.activeElement) ? d.activeElement : null;
    const focusId = focused?.closest(".chat-item")?.dataset.id;
    const focusCls = focused && ["chat-link", "rename", "delete"].find((c) => focused.classList.contains(c));
    this.sessions.sort((a, b) => (b.updated_at || 0) - (a.updated_at || 0));
    const now = new Date();
    const frag = d.createDocumentFragment();
    let group = null;
    let ul = null;
    for (const s of this.sessions) {
      const g = dateGroup(s.updated_at || s.created_at || 0, now);
      if (g !== group) {
        group = g;
        const h = d.createElement("h2");
        h.className = "chat-group";
        h.textContent = g;
        ul = d.createElement("ul");
        ul.className = "chat-items";
        frag.append(h, ul);
      }
      ul.append(this.renderItem(s));
    }
    if (!this.sessions.length) {
      const p = d.createElement("p");
      p.className = "chat-list-empty";
      p.textContent = "No chats yet.";
      frag.append(p);
    }
    this.container.replaceChildren(frag);
    if (focusId && focusCls) this.itemFor(focusId)?.querySelector(`.${focusCls}`)?.focus();
  }

  /** @private */
  renderItem(s) {
    const d = this.doc;
    const title = s.title || "New chat";
    const li = d.createElement("li");
    li.className = "chat-item";
    li.dataset.id = s.id;
    const a = d.createElement("a");
    a.className = "chat-link";
    a.href = hashForChat(s.id);
    a.textContent = title;
    a.title = title;
    if (s.id === this.activeId) a.setAttribute("aria-current", "page");
    const actions = d.createElement("span");
    actions.className = "chat-actions";
    const rename = d.createElement("button");
    rename.type = "button";
    rename.className = "icon-btn small rename";
    rename.setAttribute("aria-label", `Rename chat: ${title}`);
    rename.title = "Rename";
    rename.append(icon(d, ICONS.edit));
    const del = d.createElement("button");
    del.type = "button";
    del.className = "icon-btn small delete";
    del.setAttribute("aria-label", `Delete chat: ${title}`);
    del.title = "Delete";
    del.append(icon(d, ICONS.trash));
    actions.append(rename, del);
    li.append(a, actions);
    return li;
  }
}
