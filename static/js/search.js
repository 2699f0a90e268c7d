// The sidebar's search box: chats by title and content (GET /api/search).
// While the box holds a query the results replace the chat list; an empty
// box brings the list back.

import { hashForChat } from "./router.js";
import { errorText } from "./format.js";

const DEBOUNCE_MS = 200;

/** Drives #chat-search, #chat-list and #search-results. */
export class ChatSearch {
  /**
   * @param {{doc:Document, input:HTMLInputElement, list:HTMLElement, results:HTMLElement,
   *          api:typeof import("./api.js").api, onPick:()=>void}} opts
   *   `onPick` runs when a result is followed (e.g. to close the narrow sidebar)
   */
  constructor(opts) {
    Object.assign(this, opts);
    this.timer = 0;
    this.controller = null;
    this.input.addEventListener("input", () => {
      clearTimeout(this.timer);
      this.timer = setTimeout(() => this.run(), DEBOUNCE_MS);
    });
    this.input.addEventListener("keydown", (ev) => {
      if (ev.key === "Escape" && this.input.value) {
        ev.preventDefault();
        ev.stopPropagation();
        this.clear();
      }
    });
    this.results.addEventListener("click", (ev) => {
      if (ev.target.closest("a")) this.onPick();
    });
  }

  /** Empty the box and show the chat list again. */
  clear() {
    this.input.value = "";
    this.run();
  }

  /** @private */
  async run() {
    const q = this.input.value.trim();
    if (this.controller) this.controller.abort();
    this.controller = null;
    if (!q) {
      this.results.hidden = true;
      this.list.hidden = false;
      this.results.replaceChildren();
      return;
    }
    const ctl = new AbortController();
    this.controller = ctl;
    let rows;
    try {
      rows = await this.api.search(q, ctl.signal);
    } catch (err) {
      if (ctl.signal.aborted) return;
      this.show([], errorText(err.code || "internal_error", err.message));
      return;
    }
    if (ctl.signal.aborted) return;
    this.show(rows, rows.length ? "" : `No chats contain “${q}”.`);
  }

  /** @private */
  show(rows, message) {
    const d = this.doc;
    const ul = d.createElement("ul");
    ul.className = "chat-items";
    for (const r of rows) {
      const li = d.createElement("li");
      li.className = "chat-item search-hit";
      li.dataset.id = r.id;
      const a = d.createElement("a");
      a.className = "chat-link";
      a.href = hashForChat(r.id);
      const title = d.createElement("span");
      title.className = "hit-title";
      title.textContent = r.title || "New chat";
      a.append(title);
      if (r.snippet) {
        const snip = d.createElement("span");
        snip.className = "hit-snippet";
        snip.textContent = r.snippet;
        a.append(snip);
      }
      li.append(a);
      ul.append(li);
    }
    const parts = [ul];
    if (message) {
      const p = d.createElement("p");
      p.className = "chat-list-empty";
      p.textContent = message;
      parts.push(p);
    }
    this.results.replaceChildren(...parts);
    this.results.hidden = false;
    this.list.hidden = true;
  }
}
