// The "Share and export" dialog of a chat (its downloads with every version, and
// read-only share links: create with an expiry, copy, revoke) and the "Export and import
// chats" dialog (every chat out; our export or ChatGPT's in). docs/ui.md; the routes:
// docs/protocol.md §3.

import { copyText } from "./markdown.js";
import { errorText } from "./format.js";

/** @param {{code:string, message:string}} err @returns {string} the gateway's own reason where it is the point */
function reason(err) {
  return (err.code === "invalid_request" || err.code === "frame_too_large") && err.message ? err.message
    : errorText(err.code, err.message);
}

const WHEN = new Intl.DateTimeFormat("en-GB", { dateStyle: "medium", timeStyle: "short" });

/**
 * @param {{created_at:number, expires_at:number|null}} link
 * @returns {string} "Made 3 Dec 2026, 10:04 · expires 4 Dec 2026, 10:04"
 */
export function linkDetail(link) {
  const made = `Made ${WHEN.format(new Date(link.created_at * 1000))}`;
  return link.expires_at ? `${made} · expires ${WHEN.format(new Date(link.expires_at * 1000))}` : `${made} · never expires`;
}

/** Wraps <dialog id="share-dialog">. */
export class ShareDialog {
  /**
   * @param {{doc:Document, dialog:HTMLDialogElement, api:typeof import("./api.js").api, origin:string,
   *   announce:(msg:string)=>void}} opts
   */
  constructor(opts) {
    Object.assign(this, opts);
    const q = (sel) => this.dialog.querySelector(sel);
    this.list = q("#share-list");
    this.expiry = q("#share-expiry");
    this.error = q(".dialog-error");
    this.chatId = null;
    q(".create-share").addEventListener("click", () => this.create());
    q(".close-share").addEventListener("click", () => this.dialog.close());
    this.list.addEventListener("click", async (ev) => {
      const btn = ev.target.closest("button");
      if (!btn) return;
      if (btn.classList.contains("revoke")) this.revoke(btn.dataset.id);
      else if (btn.classList.contains("copy-link")) {
        const ok = await copyText(this.doc, btn.dataset.url);
        btn.textContent = ok ? "Copied" : "Copy failed";
      }
    });
  }

  /** @param {string} chatId  open the dialog for this saved chat */
  async open(chatId) {
    this.chatId = chatId;
    this.showError("");
    const base = `/api/sessions/${encodeURIComponent(chatId)}/export`;
    this.dialog.querySelector("#share-export-md").href = `${base}?format=md`;
    this.dialog.querySelector("#share-export-json").href = `${base}?format=json`;
    this.list.replaceChildren();
    this.dialog.showModal();
    await this.refresh();
  }

  /** @private */
  async refresh() {
    try {
      this.render(await this.api.listShares(this.chatId));
    } catch (err) {
      this.showError(reason(err));
    }
  }

  /** @private @param {Array<object>} links */
  render(links) {
    this.list.replaceChildren();
    for (const link of links) {
      const li = this.doc.createElement("li");
      li.className = "token-item share-item";
      const text = this.doc.createElement("div");
      text.className = "share-text";
      const url = this.doc.createElement("a");
      url.className = "share-url";
      url.href = link.url;
      url.target = "_blank";
      url.rel = "noopener noreferrer";
      url.textContent = `${this.origin}${link.url}`;
      const detail = this.doc.createElement("span");
      detail.className = "field-help";
      detail.textContent = linkDetail(link);
      text.append(url, detail);
      const copy = this.doc.createElement("button");
      copy.type = "button";
      copy.className = "btn copy-link";
      copy.dataset.url = `${this.origin}${link.url}`;
      copy.textContent = "Copy";
      copy.setAttribute("aria-label", "Copy link");
      const revoke = this.doc.createElement("button");
      revoke.type = "button";
      revoke.className = "btn revoke";
      revoke.dataset.id = link.id;
      revoke.textContent = "Revoke";
      revoke.setAttribute("aria-label", "Revoke link");
      li.append(text, copy, revoke);
      this.list.append(li);
    }
  }

  /** @private */
  async create() {
    this.showError("");
    const v = this.expiry.value;
    try {
      const link = await this.api.createShare(this.chatId, v ? Number(v) : null);
      await this.refresh();
      const ok = await copyText(this.doc, `${this.origin}${link.url}`);
      this.announce(ok ? "Link created and copied." : "Link created.");
    } catch (err) {
      this.showError(reason(err));
    }
  }

  /** @private @param {string} id */
  async revoke(id) {
    try {
      await this.api.revokeShare(id);
      this.announce("Link revoked: it no longer works.");
    } catch (err) {
      if (err.code !== "not_found") this.showError(reason(err));
    }
    await this.refresh();
    this.dialog.querySelector(".create-share").focus(); // the revoked row's button is gone
  }

  /** @private */
  showError(msg) {
    this.error.textContent = msg;
    this.error.hidden = !msg;
  }
}

/** Wraps <dialog id="transfer-dialog">: export every chat, import export files. */
export class TransferDialog {
  /**
   * @param {{doc:Document, dialog:HTMLDialogElement, api:typeof import("./api.js").api,
   *   onImported:(chats:Array<{id:string, title:string}>)=>void}} opts
   *   `onImported` is called after files added chats (to refresh the chat list)
   */
  constructor(opts) {
    Object.assign(this, opts);
    const q = (sel) => this.dialog.querySelector(sel);
    this.files = q("#import-files");
    this.result = q("#import-result");
    this.error = q(".dialog-error");
    q(".choose-import").addEventListener("click", () => this.files.click());
    this.files.addEventListener("change", () => {
      const files = [...this.files.files];
      this.files.value = "";
      this.importFiles(files);
    });
    q(".close-transfer").addEventListener("click", () => this.dialog.close());
  }

  /** Open the dialog. */
  open() {
    this.result.hidden = true;
    this.error.hidden = true;
    this.dialog.showModal();
  }

  /** @param {File[]} files  import each in turn; says how many chats were added and skipped */
  async importFiles(files) {
    this.error.hidden = true;
    this.result.hidden = false;
    this.result.textContent = "Importing…";
    let imported = 0;
    let skipped = 0;
    const added = [];
    const failed = [];
    for (const f of files) {
      try {
        const r = await this.api.importChats(f);
        imported += r.imported;
        skipped += r.skipped;
        added.push(...r.chats);
        if (r.error) failed.push(`${f.name}: ${r.error.message}`); // stopped at the limit of chats
      } catch (err) {
        failed.push(`${f.name}: ${reason(err)}`);
      }
    }
    const chats = (n) => `${n} chat${n === 1 ? "" : "s"}`;
    this.result.textContent = `Imported ${chats(imported)}`
      + (skipped ? `; ${chats(skipped)} already here, not added again.` : ".");
    if (failed.length) {
      this.error.textContent = failed.join(" ");
      this.error.hidden = false;
    }
    if (added.length) this.onImported(added);
  }
}
