// The shared-chat page (web/share.html, GET /s/{id}): draws the snapshot the gateway put
// into `<script id="share-data">` (gateway/api/shares.py). User text is shown as text;
// replies go through the chat page's renderer (markdown-it with raw HTML off, then
// DOMPurify), so a shared reply can run nothing. Read-only: no socket, no API call.

import { createMarkdownRenderer } from "./js/markdown.js";
import { chipElement } from "./js/attachments.js";
import { thoughtFor } from "./js/reasoning.js";

/**
 * Draw the snapshot into the page.
 * @param {Window} win
 */
function main(win) {
  const doc = win.document;
  let snap = null;
  try {
    snap = JSON.parse(doc.getElementById("share-data")?.textContent || "null");
  } catch {
    snap = null;
  }
  if (!snap || !Array.isArray(snap.messages)) return;
  const when = new Date(Number(snap.shared_at) * 1000);
  if (!Number.isNaN(when.getTime())) {
    doc.getElementById("share-note").textContent =
      `A read-only copy of a chat, as it was when it was shared on ${when.toLocaleString()}.`;
  }
  const md = createMarkdownRenderer(win);
  const list = doc.getElementById("messages");
  for (const m of snap.messages) {
    const li = doc.createElement("li");
    li.className = `msg ${m.role === "user" ? "user" : "assistant"}`;
    const sr = doc.createElement("span");
    sr.className = "visually-hidden";
    sr.textContent = m.role === "user" ? "They said:" : "The assistant said:";
    li.append(sr);
    if (Array.isArray(m.attachments) && m.attachments.length) {
      const chips = doc.createElement("ul");
      chips.className = "attachment-chips in-message";
      chips.setAttribute("aria-label", "Attached files");
      for (const a of m.attachments) chips.append(chipElement(doc, { name: String(a.name || "file"), kind: String(a.kind || "text"), pages: a.pages }));
      li.append(chips);
    }
    if (m.role !== "user" && typeof m.reasoning === "string" && m.reasoning) {
      // the reply's reasoning, folded as the chat page shows a finished one
      const thinking = doc.createElement("details");
      thinking.className = "thinking";
      const line = doc.createElement("summary");
      line.className = "thinking-line";
      line.textContent = typeof m.reasoning_ms === "number" ? thoughtFor(m.reasoning_ms) : "Thoughts";
      const text = doc.createElement("div");
      text.className = "thinking-body markdown";
      text.append(md.toFragment(m.reasoning));
      thinking.append(line, text);
      li.append(thinking);
    }
    const body = doc.createElement("div");
    body.className = "msg-body";
    if (m.role === "user") body.textContent = String(m.content || "");
    else body.append(md.toFragment(String(m.content || "")));
    if (m.role === "user" && !m.content) body.hidden = true;
    li.append(body);
    if (m.cut) {
      const badge = doc.createElement("p");
      badge.className = "share-cut";
      badge.textContent = "(reply cut before its end)";
      li.append(badge);
    }
    list.append(li);
  }
}

main(window);
