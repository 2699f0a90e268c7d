// The model picker: which of the served models (`GET /api/config` `models`) the open
// chat's replies come from. A saved chat keeps its model on the server (`PATCH
// /api/sessions/{id}` `{model}`); a new chat takes the last model chosen in this browser
// (remembered in localStorage) and sends it with its creation. Hidden while one model
// is served. The controller does the talking; this module only keeps the <select>.

/** localStorage key of the model new chats start with. */
export const REMEMBERED = "chat.model";

/**
 * @typedef {{id:string, max_model_len?:number|null, format?:string|null, available?:boolean}} ModelInfo
 */

export class ModelPicker {
  /**
   * @param {{select:HTMLSelectElement, models:ModelInfo[], defaultModel:string,
   *          storage?:Storage|null, onPick:(model:string)=>void}} opts  `onPick`: the user
   *   chose `model` (the controller saves it with the open chat, or keeps it for a new one)
   */
  constructor(opts) {
    this.select = opts.select;
    this.models = (opts.models || []).filter((m) => m && typeof m.id === "string");
    this.defaultModel = opts.defaultModel;
    this.storage = opts.storage || null;
    this.onPick = opts.onPick;
    const doc = this.select.ownerDocument;
    for (const m of this.models) {
      const o = doc.createElement("option");
      o.value = m.id;
      o.textContent = m.available === false ? `${m.id} (not reachable now)` : m.id;
      this.select.append(o);
    }
    this.select.hidden = this.models.length < 2;
    this.select.addEventListener("change", () => {
      const model = this.select.value;
      this.remember(model);
      this.onPick(model);
    });
  }

  /** @returns {string} the model a new chat starts with: the remembered one if still served, else the default */
  forNewChat() {
    let saved = null;
    try {
      saved = this.storage ? this.storage.getItem(REMEMBERED) : null;
    } catch {
      saved = null; // storage blocked: the default
    }
    return saved && this.info(saved) ? saved : this.defaultModel;
  }

  /** @private */
  remember(model) {
    try {
      this.storage?.setItem(REMEMBERED, model);
    } catch {
      // a browser that blocks storage only loses the memory of the choice
    }
  }

  /**
   * @param {string} id
   * @returns {ModelInfo|undefined}
   */
  info(id) {
    return this.models.find((m) => m.id === id);
  }

  /**
   * Show `model` as the open chat's (a model no longer served is shown as the default's
   * would be, and sending names it: the gateway then says it is not served).
   * @param {string} model
   */
  show(model) {
    if (this.select.hidden) return;
    if (!this.info(model)) {
      const doc = this.select.ownerDocument;
      const o = doc.createElement("option");
      o.value = model;
      o.textContent = `${model} (not served)`;
      o.dataset.gone = "1";
      this.select.append(o);
    }
    this.select.value = model;
  }
}
