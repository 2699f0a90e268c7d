// Attachments: files chosen with the paperclip button, dropped on the page or pasted,
// and long pastes, held as chips above the message box until the message is sent
// (docs/ui.md, "Attachments"; docs/protocol.md, "Attachments").
//
// Every file is read by the gateway (POST /api/attachments: its kind, its text, its
// tokens; a PDF's text is extracted there), so what the page shows is what the model
// reads, and a file that cannot be sent is refused here, with the gateway's reason,
// before anything reaches an engine.
//
// A chip says "Reading…" only while its upload runs, and every upload ends: in a ready
// chip, or with the chip gone and the reason said (refused, unreachable, an answer that
// is not an attachment, no answer within UPLOAD_TIMEOUT_MS, or its × pressed). Send
// waits for the chips that are reading, so an upload that never ended would block it.

/** A paste longer than this many characters becomes an attachment chip instead of text in the box. */
export const PASTE_CHIP_CHARS = 2500;

/** An upload with no answer after this long (ms) is given up, its chip removed with a reason. */
export const UPLOAD_TIMEOUT_MS = 120_000;

const NUMBER = new Intl.NumberFormat("en-US");

/** @param {number} n  bytes @returns {string} "12 KB" */
export function sizeText(n) {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${Math.round(n / 1024)} KB`;
  return `${(n / (1024 * 1024)).toFixed(1)} MB`;
}

/**
 * The text under a chip's name: "PDF · 20 pages · 2,345 tokens".
 * @param {{kind:string, pages?:number, size?:number, tokens?:number}} a
 * @returns {string}
 */
export function chipDetail(a) {
  const parts = [a.kind === "pdf" ? "PDF" : a.kind === "csv" ? "CSV" : a.kind === "json" ? "JSON"
    : a.kind.charAt(0).toUpperCase() + a.kind.slice(1)];
  if (a.pages) parts.push(`${a.pages} page${a.pages === 1 ? "" : "s"}`);
  else if (a.size) parts.push(sizeText(a.size));
  if (a.tokens) parts.push(`${NUMBER.format(a.tokens)} tokens`);
  return parts.join(" · ");
}

/**
 * A chip for a stored or pending attachment (no remove button: the caller adds one).
 * @param {Document} doc
 * @param {{name:string, kind:string, pages?:number, size?:number, tokens?:number}} a
 * @returns {HTMLLIElement}
 */
export function chipElement(doc, a) {
  const li = doc.createElement("li");
  li.className = "attachment-chip";
  li.dataset.kind = a.kind;
  const icon = doc.createElement("span");
  icon.className = "chip-kind";
  icon.setAttribute("aria-hidden", "true");
  icon.textContent = a.kind === "pdf" ? "PDF" : a.kind === "code" ? "</>" : a.kind === "csv" ? "CSV"
    : a.kind === "json" ? "{ }" : a.kind === "markdown" ? "MD" : "TXT";
  const text = doc.createElement("span");
  text.className = "chip-text";
  const name = doc.createElement("span");
  name.className = "chip-name";
  name.textContent = a.name;
  name.title = a.name;
  const detail = doc.createElement("span");
  detail.className = "chip-detail";
  detail.textContent = chipDetail(a);
  text.append(name, detail);
  li.append(icon, text);
  return li;
}

/**
 * @param {any} body  the answer of POST /api/attachments
 * @returns {boolean} whether it is an attachment (what a chip and the `chat` frame need)
 */
function isAttachment(body) {
  return !!body && typeof body === "object" && typeof body.name === "string" && typeof body.kind === "string"
    && typeof body.text === "string";
}

/** The files of the message being written. */
export class AttachmentTray {
  /**
   * @param {{doc:Document, list:HTMLUListElement, fileInput:HTMLInputElement, button:HTMLButtonElement,
   *   dropZone:HTMLElement, overlay:HTMLElement, textarea:HTMLTextAreaElement, limits:object,
   *   notify:(msg:string)=>void, announce:(msg:string)=>void, onChange:()=>void, uploadTimeoutMs?:number}} opts
   *   `onChange` is called whenever the files or their reading state change; `uploadTimeoutMs`:
   *   how long an upload may go unanswered (UPLOAD_TIMEOUT_MS)
   */
  constructor(opts) {
    Object.assign(this, opts);
    /** @type {Array<{name:string, kind:string, text:string, size:number, pages?:number, tokens:number}>} */
    this.files = [];
    /** @type {Array<{name:string, abort:AbortController, why:string}>} uploads running, in order */
    this.pending = [];
    this.pastes = 0;
    this.uploadTimeoutMs = Number(opts.uploadTimeoutMs) || UPLOAD_TIMEOUT_MS;
    this.maxUpload = Number(opts.limits.max_upload_bytes) || 16 * 1024 * 1024;
    this.maxFiles = Number(opts.limits.max_attachments_per_message) || 8;
    this.button.addEventListener("click", () => this.fileInput.click());
    this.fileInput.addEventListener("change", () => {
      this.addFiles([...this.fileInput.files]);
      this.fileInput.value = ""; // the same file chosen again fires "change" again
    });
    this.textarea.addEventListener("paste", (ev) => this.onPaste(ev));
    let depth = 0; // dragenter/dragleave fire for every child crossed
    const hasFiles = (ev) => [...(ev.dataTransfer?.types || [])].includes("Files");
    this.dropZone.addEventListener("dragenter", (ev) => {
      if (!hasFiles(ev)) return;
      ev.preventDefault();
      depth++;
      this.overlay.hidden = false;
    });
    this.dropZone.addEventListener("dragover", (ev) => {
      if (!hasFiles(ev)) return;
      ev.preventDefault();
      ev.dataTransfer.dropEffect = "copy";
    });
    this.dropZone.addEventListener("dragleave", () => {
      depth = Math.max(0, depth - 1);
      if (!depth) this.overlay.hidden = true;
    });
    this.dropZone.addEventListener("drop", (ev) => {
      if (!hasFiles(ev)) return;
      ev.preventDefault();
      depth = 0;
      this.overlay.hidden = true;
      this.addFiles([...ev.dataTransfer.files]);
    });
  }

  /** @returns {number} tokens the pending files add to the next prompt */
  tokens() {
    return this.files.reduce((n, f) => n + (f.tokens || 0), 0);
  }

  /** @returns {boolean} whether a file is still being read */
  busy() {
    return this.pending.length > 0;
  }

  /** @param {ClipboardEvent} ev  files become attachments; a long text paste becomes one too */
  onPaste(ev) {
    const data = ev.clipboardData;
    if (!data) return;
    const files = [...(data.files || [])];
    if (files.length) {
      ev.preventDefault();
      this.addFiles(files);
      return;
    }
    const text = data.getData("text/plain");
    if (text.length > PASTE_CHIP_CHARS) {
      ev.preventDefault();
      const name = `pasted-text-${++this.pastes}.txt`;
      this.addFiles([new File([text], name, { type: "text/plain" })]);
    }
  }

  /** @param {File[]} files  read each by the gateway, in order */
  async addFiles(files) {
    for (const file of files) {
      if (this.files.length + this.pending.length >= this.maxFiles) {
        this.notify(`At most ${this.maxFiles} files can be attached to one message.`);
        return;
      }
      if (file.size > this.maxUpload) {
        this.notify(`${file.name} is ${sizeText(file.size)}; attachments can be at most ${sizeText(this.maxUpload)}.`);
        continue;
      }
      await this.upload(file);
    }
  }

  /**
   * Have the gateway read one file. Always ends (see the module's head): the file joins
   * `files`, or its chip goes and the reason is said; it never throws.
   * @private
   * @param {File} file
   */
  async upload(file) {
    const job = { name: file.name, abort: new AbortController(), why: "" };
    this.pending.push(job);
    this.render();
    const timer = setTimeout(() => {
      job.why = "timeout";
      job.abort.abort();
    }, this.uploadTimeoutMs);
    let failure = "";
    try {
      const res = await fetch(`/api/attachments?name=${encodeURIComponent(file.name)}`, {
        method: "POST", body: file, credentials: "same-origin", signal: job.abort.signal,
        headers: { "content-type": "application/octet-stream" },
      });
      const body = await res.json().catch(() => null);
      if (job.abort.signal.aborted) throw new DOMException("stopped", "AbortError"); // while its body was read
      if (!res.ok) {
        failure = body?.error?.message || `${file.name} could not be read (HTTP ${res.status}).`;
      } else if (!isAttachment(body)) {
        failure = `${file.name} could not be attached: the server's answer was not a file's text. Try again.`;
      } else {
        this.files.push(body);
        this.announce(`${body.name} attached, ${chipDetail(body)}.`);
      }
    } catch {
      if (job.why === "removed") this.announce(`${file.name} removed.`);
      else if (job.why === "timeout") {
        failure = `${file.name} was not read within ${Math.round(this.uploadTimeoutMs / 1000)} s, so it is not attached. `
          + "Try again, or attach a smaller file.";
      } else failure = `${file.name} could not be sent to the server; check the connection and try again.`;
    } finally {
      clearTimeout(timer);
      this.pending = this.pending.filter((j) => j !== job);
      this.render();
    }
    if (failure) this.notify(failure);
  }

  /** Draw the chips: the files read (each with a remove button), then those being read (each with a stop button). */
  render() {
    this.list.replaceChildren();
    this.files.forEach((f, i) => {
      const chip = chipElement(this.doc, f);
      chip.append(this.removeButton(`Remove ${f.name}`, "Remove", () => {
        this.files.splice(i, 1);
        this.render();
        this.textarea.focus();
      }));
      this.list.append(chip);
    });
    for (const job of this.pending) {
      const chip = chipElement(this.doc, { name: job.name, kind: "text" });
      chip.classList.add("reading");
      chip.querySelector(".chip-detail").textContent = "Reading…";
      chip.append(this.removeButton(`Stop reading ${job.name}`, "Stop reading", () => {
        job.why = "removed";
        job.abort.abort();
        this.textarea.focus();
      }));
      this.list.append(chip);
    }
    this.list.hidden = this.files.length === 0 && this.pending.length === 0;
    this.onChange();
  }

  /** @private a chip's × button */
  removeButton(label, title, onClick) {
    const rm = this.doc.createElement("button");
    rm.type = "button";
    rm.className = "chip-remove";
    rm.setAttribute("aria-label", label);
    rm.title = title;
    rm.textContent = "×";
    rm.addEventListener("click", onClick);
    return rm;
  }

  /** @returns {Array<object>} the files as a `chat` frame's `attachments`, and empties the tray */
  take() {
    const out = this.files.map(({ name, kind, text, size, pages, tokens }) => ({ name, kind, text, size, pages, tokens }));
    this.files = [];
    this.render();
    return out;
  }

  /** @param {Array<object>} files  put back files of a message that was not sent */
  restore(files) {
    if (!files?.length || this.files.length) return;
    this.files = files;
    this.render();
  }
}
