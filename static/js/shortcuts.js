// Keyboard shortcuts: the one list of them (the shortcuts dialog is drawn from it), and
// the matching of key events against it.
//
// The page's own shortcuts are Alt+Shift+letter (Option+Shift on a Mac), matched by the
// physical key (`KeyboardEvent.code`), so they work on any keyboard layout, also while
// the message box has focus. Chosen to leave alone what browsers and screen readers
// bind: Ctrl/Cmd+Shift+letter is mostly taken by browsers (Ctrl+Shift+O bookmarks,
// +C developer tools, +N private window, +S/+K/+E in Firefox); Shift+Esc is Chrome's
// task manager; a single letter is a screen reader's browse-mode key. Alt+Shift+A, B, I
// and T are Chrome's own on Windows, so none of those letters is used here. The list of
// shortcuts opens with Ctrl+/ (Cmd+/), or with ? when no text field has focus.

/**
 * @typedef {{action:string, code:string|null, label:string, does:string}} Shortcut
 *   `code`: the KeyboardEvent.code pressed with Alt+Shift (null: a key handled elsewhere,
 *   listed for completeness); `label`: the keys as shown on a PC keyboard
 */

/** @type {ReadonlyArray<Shortcut>} */
export const SHORTCUTS = Object.freeze([
  { action: "newChat", code: "KeyN", label: "Alt+Shift+N", does: "New chat" },
  { action: "search", code: "KeyK", label: "Alt+Shift+K", does: "Search chats" },
  { action: "toggleSidebar", code: "KeyS", label: "Alt+Shift+S", does: "Show or hide the chat list" },
  { action: "focusInput", code: "KeyM", label: "Alt+Shift+M", does: "Go to the message box" },
  { action: "regenerate", code: "KeyR", label: "Alt+Shift+R", does: "Regenerate the last reply" },
  { action: "copyLast", code: "KeyC", label: "Alt+Shift+C", does: "Copy the last reply" },
  { action: "stop", code: null, label: "Esc", does: "Stop the reply being written" },
  { action: "send", code: null, label: "Enter", does: "Send (on a touch screen: a new line; send with the button)" },
  { action: "newline", code: null, label: "Shift+Enter", does: "New line" },
  { action: "help", code: null, label: "Ctrl+/ or ?", does: "This list" },
]);

/**
 * @param {Navigator} nav
 * @returns {boolean} whether keys are named as on a Mac (⌥ ⇧ ⌘)
 */
export function isMac(nav) {
  const platform = nav.userAgentData?.platform || nav.platform || "";
  return /mac|iphone|ipad/i.test(platform);
}

/**
 * A shortcut's keys as shown to this user.
 * @param {string} label  a `Shortcut.label`
 * @param {boolean} mac
 * @returns {string}
 */
export function keysFor(label, mac) {
  if (!mac) return label;
  return label.replace("Alt+Shift+", "⌥⇧").replace("Ctrl+", "⌘");
}

/**
 * The action a key event asks for, or null.
 * @param {KeyboardEvent} ev
 * @param {boolean} inTextField  whether a text field has focus (then "?" is just a character)
 * @returns {string|null}  a `Shortcut.action`
 */
export function actionFor(ev, inTextField) {
  if (ev.isComposing || ev.keyCode === 229) return null;
  if (ev.altKey && ev.shiftKey && !ev.ctrlKey && !ev.metaKey) {
    const s = SHORTCUTS.find((x) => x.code && x.code === ev.code);
    return s ? s.action : null;
  }
  if ((ev.ctrlKey || ev.metaKey) && !ev.altKey && (ev.key === "/" || ev.code === "Slash")) return "help";
  if (ev.key === "?" && !inTextField && !ev.ctrlKey && !ev.metaKey && !ev.altKey) return "help";
  return null;
}

/**
 * Fill the shortcuts dialog's table from `SHORTCUTS`.
 * @param {HTMLElement} tbody
 * @param {boolean} mac
 */
export function fillShortcutRows(tbody, mac) {
  const d = tbody.ownerDocument;
  tbody.replaceChildren(...SHORTCUTS.map((s) => {
    const tr = d.createElement("tr");
    const keys = d.createElement("td");
    for (const [i, part] of keysFor(s.label, mac).split(" or ").entries()) {
      if (i) keys.append(" or ");
      const kbd = d.createElement("kbd");
      kbd.textContent = part;
      keys.append(kbd);
    }
    const does = d.createElement("td");
    does.textContent = s.does;
    tr.append(keys, does);
    return tr;
  }));
}

/**
 * Listen for the shortcuts on `doc` and run the matching action.
 * @param {Document} doc
 * @param {Record<string, ()=>void>} actions  by `Shortcut.action` (missing ones are ignored)
 */
export function wireShortcuts(doc, actions) {
  doc.addEventListener("keydown", (ev) => {
    const t = /** @type {HTMLElement|null} */ (ev.target);
    const inTextField = !!t && (t.isContentEditable || /^(INPUT|TEXTAREA|SELECT)$/.test(t.tagName));
    const action = actionFor(ev, inTextField);
    if (!action || !actions[action]) return;
    // a dialog that is open keeps the keyboard, except to close it for the list
    if (doc.querySelector("dialog[open]") && action !== "help") return;
    ev.preventDefault();
    actions[action]();
  });
}
