// The per-chat settings dialog: system prompt, temperature, top_p, max tokens,
// the optional sampling params (sampling.js), "use for my new chats", and the
// chat's export links.

import { OPTIONAL_PARAMS, applyRanges, fillOptional, readOptional } from "./sampling.js";

/** @typedef {{system_prompt:string, params:{temperature:number, top_p:number, max_tokens:number}, asDefault?:boolean}} ChatSettings
 *  `params` may also hold top_k, min_p, repetition_penalty, seed, stop (null: unset); `asDefault`
 *  asks to save them as the user's defaults for new chats too. */

/**
 * Settings from a session (or a draft) with the server's defaults filling gaps.
 * @param {{system_prompt?:string|null, params?:object|null}|null} session
 * @param {{temperature?:number, top_p?:number, max_tokens?:number, system_prompt?:string}} defaults  GET /api/config `defaults`
 * @returns {ChatSettings}
 */
export function effectiveSettings(session, defaults) {
  const p = (session && session.params) || {};
  const d = defaults || {};
  const pick = (v, dv, fallback) => (typeof v === "number" ? v : typeof dv === "number" ? dv : fallback);
  return {
    system_prompt: (session && typeof session.system_prompt === "string" ? session.system_prompt : d.system_prompt) || "",
    params: {
      temperature: pick(p.temperature, d.temperature, 0.7),
      top_p: pick(p.top_p, d.top_p, 1.0),
      max_tokens: pick(p.max_tokens, d.max_tokens, 512),
      // optional params: the chat's own, else the user's defaults, else unset
      ...Object.fromEntries([...OPTIONAL_PARAMS, "stop"].map((k) => [k, p[k] ?? (session ? null : d[k] ?? null)])),
    },
  };
}

/**
 * Wraps the <dialog id="settings-dialog"> of the page. `open(settings)`
 * resolves to the edited settings, or null when cancelled; the caller saves
 * them and reports a failure with `showError` (the dialog then stays open).
 */
export class SettingsDialog {
  /**
   * @param {{dialog:HTMLDialogElement, maxTokensLimit:number, maxSystemPromptChars:number,
   *          defaults:object, ranges?:object, onSave:(s:ChatSettings)=>Promise<void>}} opts
   *   `defaults` is read at each use (the page replaces its fields when the user saves new defaults).
   *   onSave may throw an Error whose message is shown in the dialog.
   */
  constructor(opts) {
    this.dialog = opts.dialog;
    this.defaults = opts.defaults;
    this.onSave = opts.onSave;
    const q = (sel) => this.dialog.querySelector(sel);
    this.form = q("form");
    this.system = q("#set-system");
    this.temperature = q("#set-temperature");
    this.temperatureRange = q("#set-temperature-range");
    this.topP = q("#set-top-p");
    this.topPRange = q("#set-top-p-range");
    this.maxTokens = q("#set-max-tokens");
    this.asDefault = q("#set-as-default");
    this.exportRow = q("#export-row");
    this.error = q(".dialog-error");
    applyRanges(this.dialog, opts.ranges);
    if (opts.maxTokensLimit > 0) this.maxTokens.max = String(opts.maxTokensLimit);
    if (opts.maxSystemPromptChars > 0) this.system.maxLength = opts.maxSystemPromptChars;
    // A number field and a slider show the same value; keep them in step.
    this.link(this.temperature, this.temperatureRange);
    this.link(this.topP, this.topPRange);
    q(".reset-defaults").addEventListener("click", () => this.fill(effectiveSettings(null, this.defaults)));
    q(".cancel").addEventListener("click", () => this.dialog.close());
    this.form.addEventListener("submit", (ev) => this.submit(ev));
  }

  /**
   * @param {ChatSettings} settings  shown in the fields, then the dialog opens
   * @param {string|null} [chatId]  the stored chat, for its export links (none for a new chat)
   */
  open(settings, chatId = null) {
    this.fill(settings);
    this.asDefault.checked = false;
    this.exportRow.hidden = !chatId;
    if (chatId) {
      const base = `/api/sessions/${encodeURIComponent(chatId)}/export`;
      this.exportRow.querySelector("#export-md").href = `${base}?format=md`;
      this.exportRow.querySelector("#export-json").href = `${base}?format=json`;
    }
    this.showError("");
    this.dialog.showModal();
    this.system.focus();
  }

  /** @param {string} message  empty hides the error line */
  showError(message) {
    this.error.textContent = message;
    this.error.hidden = !message;
  }

  /** @private */
  fill(s) {
    this.system.value = s.system_prompt;
    this.temperature.value = this.temperatureRange.value = String(s.params.temperature);
    this.topP.value = this.topPRange.value = String(s.params.top_p);
    this.maxTokens.value = String(s.params.max_tokens);
    fillOptional(this.dialog, s.params);
    // an optional param already set is shown, not hidden in the closed section
    const more = this.dialog.querySelector("#set-more");
    if ([...OPTIONAL_PARAMS, "stop"].some((k) => s.params[k] != null)) more.open = true;
  }

  /** @private */
  link(num, range) {
    range.addEventListener("input", () => (num.value = range.value));
    num.addEventListener("input", () => {
      if (num.value !== "") range.value = num.value;
    });
  }

  /** @private */
  async submit(ev) {
    ev.preventDefault();
    const invalid = this.form.querySelector(":invalid");
    if (invalid && invalid.closest("details")) invalid.closest("details").open = true; // so the browser can point at it
    if (!this.form.reportValidity()) return;
    const optional = readOptional(this.dialog);
    if (optional.error) {
      this.showError(optional.error);
      return;
    }
    const settings = {
      system_prompt: this.system.value,
      params: {
        temperature: Number(this.temperature.value),
        top_p: Number(this.topP.value),
        max_tokens: Math.round(Number(this.maxTokens.value)),
        ...optional.params,
      },
      asDefault: this.asDefault.checked,
    };
    const saveBtn = this.form.querySelector(".save");
    saveBtn.disabled = true;
    try {
      await this.onSave(settings);
      this.dialog.close();
    } catch (err) {
      this.showError(err && err.message ? err.message : String(err));
    } finally {
      saveBtn.disabled = false;
    }
  }
}
