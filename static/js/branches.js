// Editing and continuing (docs/ui.md, "Edit, versions, continue"): the row under a
// user message (versions "< 1/2 >", time, Copy, Edit), the inline editor, the
// Continue button of a reply cut at max tokens or stopped, and message timestamps.
// Replies have versions too (regenerated); their arrows sit in the reply's meta row.
// The controller does the talking (`edit`/`continue` frames, the versions API);
// this module only builds DOM and routes clicks to it.

import { icon, ICONS } from "./icons.js";
import { copyText } from "./markdown.js";

/**
 * A `<time>` for a message's creation (Unix seconds): short text, full date in the title.
 * @param {Document} doc
 * @param {number|undefined} createdAt
 * @param {Date} [now]
 * @returns {HTMLTimeElement}
 */
export function timeElement(doc, createdAt, now = new Date()) {
  const t = doc.createElement("time");
  t.className = "msg-time";
  setTime(t, createdAt, now);
  return t;
}

/**
 * @param {HTMLTimeElement} t
 * @param {number|undefined} createdAt  Unix seconds (now when missing)
 * @param {Date} [now]
 */
export function setTime(t, createdAt, now = new Date()) {
  const d = typeof createdAt === "number" && createdAt > 0 ? new Date(createdAt * 1000) : now;
  t.dateTime = d.toISOString();
  const sameDay = d.toDateString() === now.toDateString();
  t.textContent = sameDay
    ? d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" })
    : d.toLocaleDateString([], { month: "short", day: "numeric" }) + " " + d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  t.title = d.toLocaleString([], { dateStyle: "full", timeStyle: "medium" });
}

/** @private */
function button(doc, cls, label, pathData, text) {
  const b = doc.createElement("button");
  b.type = "button";
  b.className = text ? `chip-btn ${cls}` : `icon-btn small ${cls}`;
  b.setAttribute("aria-label", label);
  b.title = label;
  b.append(icon(doc, pathData));
  if (text) {
    const s = doc.createElement("span");
    s.textContent = text;
    b.append(s);
  }
  return b;
}

/**
 * The row under a user message: versions (when the message has several), then
 * time, Copy and Edit (shown on hover or focus).
 * @param {Document} doc
 * @param {{created_at?:number, versions?:{index:number, count:number}}} info
 * @returns {HTMLDivElement}
 */
export function userMeta(doc, info) {
  const meta = doc.createElement("div");
  meta.className = "msg-meta user-meta";
  const versions = doc.createElement("span");
  versions.className = "versions";
  meta.append(versions);
  setVersions(doc, meta, info.versions);
  const hover = doc.createElement("span");
  hover.className = "msg-actions on-hover";
  hover.append(
    timeElement(doc, info.created_at),
    button(doc, "copy-user", "Copy message", ICONS.copy),
    button(doc, "edit-user", "Edit message", ICONS.edit),
  );
  meta.append(hover);
  return meta;
}

/**
 * Show "< i/n >" for a message with versions (hidden for one version).
 * @param {Document} doc
 * @param {HTMLElement} meta  the `.user-meta` row, or a reply's `.msg-meta`
 * @param {{index:number, count:number}|undefined} v  0-based index
 */
export function setVersions(doc, meta, v) {
  const box = meta.querySelector(".versions");
  box.replaceChildren();
  box.hidden = !v || v.count < 2;
  if (box.hidden) return;
  const prev = button(doc, "version-prev", "Previous version", ICONS.prev);
  const next = button(doc, "version-next", "Next version", ICONS.next);
  prev.disabled = v.index <= 0;
  next.disabled = v.index >= v.count - 1;
  prev.dataset.index = String(v.index - 1);
  next.dataset.index = String(v.index + 1);
  const label = doc.createElement("span");
  label.className = "version-label";
  label.textContent = `${v.index + 1}/${v.count}`;
  label.setAttribute("aria-label", `version ${v.index + 1} of ${v.count}`);
  box.append(prev, label, next);
}

/**
 * The Continue button of an assistant message (hidden until `updateContinue` shows it).
 * @param {Document} doc
 * @returns {HTMLButtonElement}
 */
export function continueButton(doc) {
  const b = button(doc, "continue-reply", "Continue this reply", ICONS.more, "Continue");
  b.hidden = true;
  return b;
}

/** The finish reasons of a reply that Continue extends: cut at max tokens, or stopped. */
export const CONTINUABLE = ["length", "abort"];

/**
 * Show Continue only on the chat's last message, when it is a reply cut at max
 * tokens or stopped (a partial reply) and the chat is idle.
 * @param {HTMLElement} listEl
 * @param {boolean} idle
 */
export function updateContinue(listEl, idle) {
  const last = listEl.lastElementChild;
  for (const b of listEl.querySelectorAll(".continue-reply")) {
    const li = b.closest(".msg");
    b.hidden = !(idle && li === last && CONTINUABLE.includes(li.dataset.finishReason));
  }
  for (const b of listEl.querySelectorAll(".edit-user, .version-prev, .version-next")) {
    b.classList.toggle("is-busy", !idle);
  }
}

/**
 * Open the inline editor on a user message; `onSend(text)` resolves to true when the
 * edit was sent (the editor closes), false to keep it open.
 * @param {Document} doc
 * @param {HTMLElement} li
 * @param {string} text  the message's current text
 * @param {(text:string)=>Promise<boolean>|boolean} onSend
 */
export function openEditor(doc, li, text, onSend) {
  if (li.querySelector(".edit-form")) return;
  const body = li.querySelector(".msg-body");
  const meta = li.querySelector(".user-meta");
  const form = doc.createElement("form");
  form.className = "edit-form";
  const ta = doc.createElement("textarea");
  ta.className = "edit-input";
  ta.value = text;
  ta.rows = Math.min(10, Math.max(2, text.split("\n").length));
  ta.setAttribute("aria-label", "Edit your message");
  const row = doc.createElement("div");
  row.className = "edit-actions";
  const cancel = doc.createElement("button");
  cancel.type = "button";
  cancel.className = "btn ghost edit-cancel";
  cancel.textContent = "Cancel";
  const send = doc.createElement("button");
  send.type = "submit";
  send.className = "btn primary edit-send";
  send.textContent = "Send";
  row.append(cancel, send);
  form.append(ta, row);
  const more = li.querySelector(".show-more");
  body.hidden = true;
  if (meta) meta.hidden = true;
  if (more) more.hidden = true;
  li.classList.add("editing");
  li.append(form);
  const close = () => {
    form.remove();
    body.hidden = false;
    if (meta) meta.hidden = false;
    if (more) more.hidden = false;
    li.classList.remove("editing");
  };
  const submit = async () => {
    const value = ta.value;
    if (!value.trim()) return;
    if (await onSend(value)) close();
  };
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    submit();
  });
  cancel.addEventListener("click", close);
  ta.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") {
      ev.preventDefault();
      ev.stopPropagation();
      close();
    } else if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229) {
      ev.preventDefault();
      submit();
    }
  });
  ta.focus();
  ta.setSelectionRange(ta.value.length, ta.value.length);
}

/**
 * Route clicks on the branch controls of the message list to the controller.
 * @param {{doc:Document, listEl:HTMLElement, controller:object, announce:(s:string)=>void}} opts
 */
export function wireBranches({ doc, listEl, controller, announce }) {
  listEl.addEventListener("click", async (ev) => {
    const btn = ev.target.closest("button");
    if (!btn || !listEl.contains(btn)) return;
    const li = btn.closest(".msg");
    const id = li && li.dataset.messageId;
    if (btn.classList.contains("copy-user")) {
      const ok = await copyText(doc, li.querySelector(".msg-body").textContent || "");
      announce(ok ? "Message copied." : "Could not copy.");
      btn.classList.toggle("done", ok);
      setTimeout(() => btn.classList.remove("done"), 1500);
    } else if (btn.classList.contains("edit-user")) {
      if (!id) return;
      if (controller.isBusy()) {
        controller.notify("Wait for the reply to finish (or stop it) before editing.");
        return;
      }
      openEditor(doc, li, li.querySelector(".msg-body").textContent || "", (text) => controller.edit(id, text));
    } else if (btn.classList.contains("version-prev") || btn.classList.contains("version-next")) {
      if (id && !btn.disabled) controller.switchVersion(id, Number(btn.dataset.index));
    } else if (btn.classList.contains("continue-reply")) {
      if (id) controller.continueReply(id);
    }
  });
}
