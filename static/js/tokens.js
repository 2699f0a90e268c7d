// The "Access tokens" dialog: create (shown once), list and revoke the
// personal access tokens that let the terminal client and the OpenAI API act
// as this browser's user (docs/protocol.md §3, README "One identity").

import { errorText } from "./format.js";
import { copyText } from "./markdown.js";

/** Wraps <dialog id="tokens-dialog">. */
export class TokensDialog {
  /**
   * @param {{doc:Document, dialog:HTMLDialogElement, api:typeof import("./api.js").api, origin:string}} opts
   *   `origin` is the page's origin, used in the usage examples shown with a new token
   */
  constructor(opts) {
    Object.assign(this, opts);
    const q = (sel) => this.dialog.querySelector(sel);
    this.list = q("#token-list");
    this.name = q("#token-name");
    this.fresh = q("#token-new");
    this.value = q("#token-value");
    this.usage = q("#token-usage");
    this.error = q(".dialog-error");
    q(".create-token").addEventListener("click", () => this.create());
    this.name.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter") {
        ev.preventDefault();
        this.create();
      }
    });
    q(".copy-token").addEventListener("click", async (ev) => {
      const ok = await copyText(this.doc, this.value.value);
      ev.currentTarget.textContent = ok ? "Copied" : "Copy failed";
    });
    q(".close-tokens").addEventListener("click", () => this.dialog.close());
    this.list.addEventListener("click", (ev) => {
      const btn = ev.target.closest("button.revoke");
      if (btn) this.revoke(btn.dataset.id);
    });
    // the token is shown once: closing forgets it
    this.dialog.addEventListener("close", () => {
      this.value.value = "";
      this.fresh.hidden = true;
    });
  }

  /** Open the dialog and load the list. */
  async open() {
    this.showError("");
    this.fresh.hidden = true;
    this.name.value = "";
    this.dialog.showModal();
    this.name.focus();
    await this.refresh();
  }

  /** @private */
  async refresh() {
    try {
      this.render(await this.api.listTokens());
    } catch (err) {
      this.showError(errorText(err.code || "internal_error", err.message));
    }
  }

  /** @private */
  render(tokens) {
    const d = this.doc;
    const items = tokens.map((t) => {
      const li = d.createElement("li");
      li.className = "token-item";
      li.dataset.id = t.id;
      const text = d.createElement("span");
      text.className = "token-text";
      const name = d.createElement("strong");
      name.textContent = t.name;
      const meta = d.createElement("span");
      meta.className = "token-meta";
      meta.textContent = `${t.hint}… · created ${new Date(t.created_at * 1000).toLocaleDateString()}`;
      text.append(name, meta);
      const btn = d.createElement("button");
      btn.type = "button";
      btn.className = "btn ghost revoke";
      btn.dataset.id = t.id;
      btn.textContent = "Revoke";
      btn.setAttribute("aria-label", `Revoke token ${t.name}`);
      li.append(text, btn);
      return li;
    });
    if (!items.length) {
      const li = d.createElement("li");
      li.className = "token-empty";
      li.textContent = "No tokens yet.";
      items.push(li);
    }
    this.list.replaceChildren(...items);
  }

  /** @private */
  async create() {
    this.showError("");
    let t;
    try {
      t = await this.api.createToken(this.name.value.trim());
    } catch (err) {
      this.showError(errorText(err.code || "internal_error", err.message));
      return;
    }
    this.name.value = "";
    this.value.value = t.token;
    this.usage.textContent =
      `.venv/bin/python -m gateway.client --url ${this.origin} --token ${t.token} "Hello"\n` +  // from the project folder, as the README
      `curl ${this.origin}/v1/chat/completions -H "Authorization: Bearer ${t.token}" \\\n` +
      `  -H "X-Chat-Session: new" -H "Content-Type: application/json" \\\n` +
      `  -d '{"messages": [{"role": "user", "content": "Hello"}]}'`;
    this.fresh.hidden = false;
    this.dialog.querySelector(".copy-token").textContent = "Copy";
    this.value.select();
    await this.refresh();
  }

  /** @private */
  async revoke(id) {
    this.showError("");
    try {
      await this.api.revokeToken(id);
    } catch (err) {
      if (err.code !== "not_found") this.showError(errorText(err.code || "internal_error", err.message));
    }
    await this.refresh();
  }

  /** @private */
  showError(message) {
    this.error.textContent = message;
    this.error.hidden = !message;
  }
}
