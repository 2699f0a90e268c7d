// Entry point of the chat page (web/index.html): reads the config the
// gateway rendered into the page, builds the views, the socket and the
// controller, and wires the DOM events to them. Nothing runs at import time
// except the final call to main().

import { api } from "./js/api.js";
import { ChatSocket } from "./js/socket.js";
import { createMarkdownRenderer, copyText } from "./js/markdown.js";
import { MessageView } from "./js/messages.js";
import { icon, ICONS } from "./js/icons.js";
import { SidebarView } from "./js/sidebar.js";
import { SettingsDialog } from "./js/settings.js";
import { ChatController, replaceDefaults, isBusyNotice } from "./js/controller.js";
import { TokensDialog } from "./js/tokens.js";
import { ChatSearch } from "./js/search.js";
import { errorText } from "./js/format.js";
import { ContextMeter } from "./js/progress.js";
import { ModelPicker } from "./js/models.js";
import { AttachmentTray } from "./js/attachments.js";
import { ShareDialog, TransferDialog } from "./js/share_dialog.js";

import { wireBranches } from "./js/branches.js";
import { fillShortcutRows, isMac, wireShortcuts } from "./js/shortcuts.js";

const READY_POLL_MS = 3000;
// Said when Enter cannot send; it goes when the reply ends or another chat is shown.
const BUSY_TEXT = "A reply is still being written. Wait for it to finish, or stop it (Esc) and send again.";
const OFFLINE_TEXT = "Not connected to the server, so nothing was sent; your message stays in the box. Send it again once the connection is back.";

/**
 * The GET /api/config body the gateway put into `<script id="chat-config">`;
 * falls back to asking the API when it is missing or unreadable.
 * @param {Document} doc
 * @returns {Promise<object>}
 */
async function loadConfig(doc) {
  try {
    const cfg = JSON.parse(doc.getElementById("chat-config")?.textContent || "");
    if (cfg && typeof cfg === "object") return cfg;
  } catch {
    // fall back below
  }
  try {
    return await api.config();
  } catch {
    return { model: doc.body.dataset.model || "", limits: {}, defaults: {} };
  }
}

/** @param {Location} loc @returns {string} the same-origin WebSocket URL */
function socketUrl(loc) {
  return `${loc.protocol === "https:" ? "wss:" : "ws:"}//${loc.host}/ws`;
}

/**
 * Build and start the page.
 * @param {Window} win
 */
async function main(win) {
  const doc = win.document;
  registerServiceWorker(win);
  const $ = (id) => doc.getElementById(id);
  const config = await loadConfig(doc);
  // The user's own defaults for new chats replace the gateway's (same object, filled in place).
  api.getDefaults().then((d) => replaceDefaults(config, d)).catch(() => {});
  const model = config.model || doc.body.dataset.model || "the model";
  const limits = config.limits || {};

  const input = $("input");
  const sendBtn = $("send");
  const stopBtn = $("stop");
  const notice = $("notice");
  const banner = $("conn-banner");
  const narrow = win.matchMedia("(max-width: 820px)");

  const renderer = createMarkdownRenderer(win);
  const view = new MessageView({ doc, listEl: $("messages"), scrollEl: $("conversation"), emptyEl: $("empty-state"), renderer,
    markers: config.reasoning });

  // ---- notices, banner, announcements ---------------------------------
  // "The model server is not reachable" clears itself once /readyz says it is back.
  const engineDown = errorText("engine_unavailable");
  const unreachable = errorText("network");
  let readyPoll = 0;
  const watchEngine = () => {
    clearInterval(readyPoll);
    readyPoll = setInterval(async () => {
      if ($("notice-text").textContent !== engineDown || notice.hidden) {
        clearInterval(readyPoll);
        return;
      }
      try {
        const r = await fetch("/readyz", { credentials: "same-origin" });
        if (r.ok) {
          clearInterval(readyPoll);
          notify("");
          announce("The model server is back.");
        }
      } catch {
        // still down
      }
    }, READY_POLL_MS);
  };
  // notify("", {onlyBusy: true}) hides the notice only when it is about the open chat being busy
  const notify = (message, opts = {}) => {
    if (opts.onlyBusy && !isBusyNotice($("notice-text").textContent)) return;
    $("notice-text").textContent = message;
    notice.hidden = !message;
    if (message) urgent(message);
    if (message === engineDown) watchEngine();
  };
  // A live region says a text again only when it changes: a repeat gets a no-break space.
  const say = (region, message) => {
    region.textContent = message && region.textContent === message ? `${message}\u00a0` : message;
  };
  const announce = (message) => say($("announcer"), message); // polite: replies, copies
  const urgent = (message) => say($("alerts"), message); // assertive: errors, the connection
  let countdown = 0;
  const showConnection = (s) => {
    clearInterval(countdown);
    doc.body.dataset.connection = s.state; // "connecting" | "open" | "closed", for styles and tests
    if (s.state === "open") {
      if (!banner.hidden) urgent("Connected to the server again.");
      banner.hidden = true;
      return;
    }
    if (s.state === "connecting") {
      if (!banner.hidden) $("conn-text").textContent = "Reconnecting…";
      return;
    }
    const until = Date.now() + s.retryInMs;
    const tick = () => {
      const secs = Math.max(0, Math.ceil((until - Date.now()) / 1000));
      const why = win.navigator.onLine === false ? "You are offline." : "Connection to the server lost.";
      $("conn-text").textContent = `${why} Reconnecting${secs ? ` in ${secs} s` : ""}…`;
    };
    tick();
    countdown = setInterval(tick, 1000);
    if (banner.hidden) urgent($("conn-text").textContent.replace(/ in \d+ s…$/, "…")); // said once, not each tick
    banner.hidden = false;
  };

  // ---- sidebar (off-canvas when narrow) ---------------------------------
  const setSidebarOpen = (open) => {
    doc.body.classList.toggle("sidebar-open", open);
    $("sidebar-toggle").setAttribute("aria-expanded", String(open || (!narrow.matches && !doc.body.classList.contains("sidebar-hidden"))));
    $("scrim").hidden = !open;
    // On a narrow screen the drawer and the chat take turns: what is covered
    // (or off screen) is inert, so Tab and screen readers skip it.
    $("sidebar").inert = narrow.matches ? !open : doc.body.classList.contains("sidebar-hidden");
    $("main").inert = narrow.matches && open;
    if (open) $("new-chat").focus();
  };
  // Alt+Shift+S: the drawer on a narrow screen; on a wide one the list folds away and back.
  const toggleSidebar = () => {
    if (narrow.matches) {
      setSidebarOpen(!doc.body.classList.contains("sidebar-open"));
      return;
    }
    const hide = !doc.body.classList.contains("sidebar-hidden");
    doc.body.classList.toggle("sidebar-hidden", hide);
    $("sidebar").inert = hide;
    $("sidebar-toggle").setAttribute("aria-expanded", String(!hide));
    if (hide && $("sidebar").contains(doc.activeElement)) input.focus();
  };
  const showSidebar = () => {
    if (narrow.matches) setSidebarOpen(true);
    else if (doc.body.classList.contains("sidebar-hidden")) toggleSidebar();
  };
  const closeSidebarIfNarrow = () => {
    if (narrow.matches && doc.body.classList.contains("sidebar-open")) setSidebarOpen(false);
  };

  // ---- composer ---------------------------------------------------------
  const autosize = () => {
    input.style.height = "auto";
    input.style.height = `${Math.min(input.scrollHeight, 240)}px`;
  };
  let busy = false;
  let tray = null;
  const refreshSend = () => {
    const files = tray ? tray.files.length : 0;
    sendBtn.disabled = busy || (tray && tray.busy()) || (!input.value.trim() && !files);
  };
  const onChange = (st) => {
    busy = st.busy;
    // "loading", or the open chat's id ("new" for an unsaved one) once its history is shown
    doc.body.dataset.chat = st.loaded ? st.id || "new" : "loading";
    $("open-share").hidden = !st.id; // a chat not saved yet has nothing to share
    sendBtn.hidden = st.busy;
    stopBtn.hidden = !st.busy;
    stopBtn.disabled = st.stopping;
    stopBtn.setAttribute("aria-label", st.stopping ? "Stopping…" : "Stop generating");
    $("chat-heading").textContent = st.title;
    const shown = st.model || model;
    doc.title = `${st.title} · ${shown}`;
    if (picker) {
      picker.show(shown);
      input.placeholder = `Message ${shown}`;
      const name = doc.querySelector(".model-name");
      if (name) name.textContent = shown;
      const len = Number(picker.info(shown)?.max_model_len) || Number(config.max_model_len) || 0;
      if (meter.max !== len) {
        meter.max = len;
        meter.set(meter.tokens);
      }
    }
    if (st.restore && !input.value) {
      input.value = st.restore;
      autosize();
    }
    if (st.restoreFiles) tray.restore(st.restoreFiles);
    refreshSend();
  };

  let controller = null;
  let picker = null;
  const socket = new ChatSocket({
    url: socketUrl(win.location),
    onFrame: (f) => controller.onFrame(f),
    onStatus: (s) => {
      showConnection(s);
      // Back online, the server is reachable: a notice saying otherwise is stale (a fetch
      // that failed while the browser was offline says "cannot be reached").
      if (s.state === "open" && [OFFLINE_TEXT, unreachable].includes($("notice-text").textContent)) notify("");
      if (s.state === "open") controller.onOpen();
    },
  });
  const sidebar = new SidebarView({
    doc,
    container: $("chat-list"),
    maxTitleChars: Number(limits.max_title_chars) || 200,
    onRename: (id, title) => controller.rename(id, title),
    onDelete: (id) => confirmDelete(id),
  });
  const meter = new ContextMeter($("context-meter"), Number(config.max_model_len) || 0);
  tray = new AttachmentTray({ doc, list: $("attachment-chips"), fileInput: $("file-input"), button: $("attach"),
    dropZone: $("main"), overlay: $("drop-overlay"), textarea: input, limits, notify, announce,
    onChange: () => {
      meter.setPending(tray.tokens());
      refreshSend();
    } });
  controller = new ChatController({ win, config, api, socket, view, sidebar, notify, announce, onChange, meter });
  let storage = null;
  try {
    storage = win.localStorage;
  } catch {
    storage = null; // blocked: the picker forgets between visits
  }
  picker = new ModelPicker({ select: $("model-picker"), models: config.models || [], defaultModel: model, storage,
    onPick: (m) => controller.pickModel(m) });
  // with one model served, chats name none (any engine serves them)
  if ((config.models || []).length > 1) controller.newChatModel = picker.forNewChat();
  config.defaults = config.defaults || {};
  wireBranches({ doc, listEl: $("messages"), controller, announce });
  const settings = new SettingsDialog({
    dialog: $("settings-dialog"),
    maxTokensLimit: Number(config.max_model_len) || 0,
    maxSystemPromptChars: Number(limits.max_system_prompt_chars) || 0,
    defaults: config.defaults,
    ranges: config.ranges,
    onSave: (s) => controller.saveSettings(s),
  });
  const tokens = new TokensDialog({ doc, dialog: $("tokens-dialog"), api, origin: win.location.origin });
  new ChatSearch({ doc, input: $("chat-search"), list: $("chat-list"), results: $("search-results"), api,
    onPick: () => closeSidebarIfNarrow() });

  const confirmDialog = $("confirm-dialog");
  const confirmDelete = (id) => {
    const title = sidebar.get(id)?.title || "this chat";
    $("confirm-text").textContent = `“${title}” and all its messages will be deleted.`;
    confirmDialog.returnValue = "";
    confirmDialog.onclose = async () => {
      if (confirmDialog.returnValue !== "confirm") return; // the dialog gave focus back to the bin
      const wasOpen = id === controller.currentId;
      const items = [...$("chat-list").querySelectorAll(".chat-item")];
      const at = items.findIndex((li) => li.dataset.id === id);
      const neighbour = (items[at + 1] || items[at - 1])?.dataset.id;
      if (!(await controller.remove(id))) return;
      // The bin that had focus is gone: put focus where work goes on, never on the page's body.
      const link = neighbour && [...$("chat-list").querySelectorAll(".chat-item")].find((li) => li.dataset.id === neighbour);
      if (wasOpen || !link) {
        closeSidebarIfNarrow();
        input.focus();
      } else {
        link.querySelector(".chat-link").focus();
      }
    };
    confirmDialog.showModal();
  };

  const submit = async () => {
    const text = input.value;
    if (!text.trim() && !tray.files.length) return;
    if (tray.busy()) {
      notify("A file is still being read; send once its chip shows its size.");
      return;
    }
    // Enter that cannot send says why (the text stays in the box).
    if (controller.isBusy()) {
      notify(BUSY_TEXT);
      return;
    }
    if (!socket.isOpen) {
      notify(OFFLINE_TEXT);
      return;
    }
    if (!controller.fitsContext(tray.tokens())) return;
    input.value = "";
    autosize();
    const files = tray.take();
    refreshSend();
    const sent = await controller.send(text, files);
    if (!sent && !input.value) {
      input.value = text;
      autosize();
    }
    if (!sent) tray.restore(files);
    refreshSend();
  };

  // ---- events -----------------------------------------------------------
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    submit();
  });
  // On a touch screen the return key writes a new line (a message of several lines is
  // otherwise hard to type) and Send is the button, as in phone messengers.
  const touch = win.matchMedia("(pointer: coarse)");
  const fitEnterKey = () => {
    input.setAttribute("enterkeyhint", touch.matches ? "enter" : "send");
    $("composer-hint").textContent = touch.matches ? "Return for a new line; send with the arrow. Replies can be wrong; check what matters."
      : "Enter to send, Shift+Enter for a new line. Replies can be wrong; check what matters.";
  };
  fitEnterKey();
  touch.addEventListener("change", fitEnterKey);
  input.addEventListener("keydown", (ev) => {
    // Enter sends; Shift+Enter is a newline; Enter that ends an IME composition does neither.
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing && ev.keyCode !== 229 && !touch.matches) {
      ev.preventDefault();
      submit();
    }
  });
  input.addEventListener("input", () => {
    autosize();
    refreshSend();
  });
  stopBtn.addEventListener("click", () => {
    controller.stop();
    input.focus();
  });
  $("messages").addEventListener("click", async (ev) => {
    const btn = ev.target.closest("button");
    if (!btn) return;
    if (btn.classList.contains("copy-code")) {
      const code = btn.closest(".code-block")?.querySelector("pre")?.textContent || "";
      flash(btn, (await copyText(doc, code)) ? "Copied" : "Copy failed");
    } else if (btn.classList.contains("copy-msg")) {
      copyReply(btn.closest(".msg"), btn);
    } else if (btn.classList.contains("regenerate")) {
      controller.regenerate();
    }
  });
  const copyReply = async (li, btn) => {
    const ok = await copyText(doc, view.answerOf(li));
    announce(ok ? "Reply copied." : "Could not copy.");
    if (ok && btn) {
      btn.replaceChildren(icon(doc, ICONS.check));
      setTimeout(() => btn.replaceChildren(icon(doc, ICONS.copy)), 1500);
    }
  };
  const newChat = () => {
    closeSidebarIfNarrow();
    controller.navigate(null);
    input.focus();
  };
  $("new-chat").addEventListener("click", newChat);
  $("new-chat-top").addEventListener("click", newChat);
  $("chat-list").addEventListener("click", (ev) => {
    if (ev.target.closest(".chat-link")) closeSidebarIfNarrow();
  });
  $("sidebar-toggle").addEventListener("click", toggleSidebar);
  $("sidebar-close").addEventListener("click", () => {
    setSidebarOpen(false);
    $("sidebar-toggle").focus();
  });
  $("scrim").addEventListener("click", () => setSidebarOpen(false));
  narrow.addEventListener("change", () => setSidebarOpen(false));
  $("open-settings").addEventListener("click", () => settings.open(controller.currentSettings(), controller.currentId));
  $("open-tokens").addEventListener("click", () => tokens.open());
  const share = new ShareDialog({ doc, dialog: $("share-dialog"), api, origin: win.location.origin, announce });
  $("open-share").addEventListener("click", () => {
    if (controller.currentId) share.open(controller.currentId);
  });
  const transfer = new TransferDialog({ doc, dialog: $("transfer-dialog"), api,
    onImported: () => controller.refreshList() });
  $("open-transfer").addEventListener("click", () => transfer.open());
  const shortcutsDialog = $("shortcuts-dialog");
  fillShortcutRows($("shortcut-rows"), isMac(win.navigator));
  const showShortcuts = () => {
    if (shortcutsDialog.open) shortcutsDialog.close();
    else if (!doc.querySelector("dialog[open]")) shortcutsDialog.showModal();
  };
  $("open-shortcuts").addEventListener("click", showShortcuts);
  wireShortcuts(doc, {
    newChat,
    search: () => {
      showSidebar();
      $("chat-search").focus();
    },
    toggleSidebar,
    focusInput: () => {
      closeSidebarIfNarrow();
      input.focus();
    },
    regenerate: () => {
      if (view.lastAssistant() && !controller.isBusy()) controller.regenerate();
    },
    copyLast: () => {
      const last = view.lastAssistant();
      if (last && !last.classList.contains("streaming")) copyReply(last, last.querySelector(".copy-msg"));
      else announce("There is no finished reply to copy.");
    },
    help: showShortcuts,
  });
  // Starting prompts on the empty page fill the message box, to send as they are or to edit.
  $("empty-state").addEventListener("click", (ev) => {
    const btn = ev.target.closest("button.starter");
    if (!btn) return;
    input.value = btn.dataset.prompt || "";
    autosize();
    refreshSend();
    input.focus();
    input.setSelectionRange(input.value.length, input.value.length);
  });
  $("notice-close").addEventListener("click", () => notify(""));
  $("conn-retry").addEventListener("click", () => socket.reconnectNow());
  win.addEventListener("hashchange", () => controller.openFromLocation());
  win.addEventListener("online", () => socket.reconnectNow());
  win.addEventListener("offline", () => socket.linkLost());
  doc.addEventListener("visibilitychange", () => {
    if (doc.visibilityState === "visible") socket.reconnectNow();
  });
  doc.addEventListener("keydown", (ev) => {
    if (ev.key !== "Escape" || ev.defaultPrevented || doc.querySelector("dialog[open]")) return;
    if (doc.body.classList.contains("sidebar-open") && narrow.matches) {
      setSidebarOpen(false);
    } else if (controller.isBusy()) {
      controller.stop();
    }
  });

  setSidebarOpen(false);
  socket.start();
  controller.refreshList();
  await controller.openFromLocation();
  if (!narrow.matches) input.focus();
}

/**
 * Register the service worker (static/sw.js, served at /sw.js) that keeps the app shell
 * for starting offline. Browsers allow one only in a secure context: HTTPS, or
 * http://localhost / 127.0.0.1; elsewhere the page works as before, without it.
 * @param {Window} win
 */
function registerServiceWorker(win) {
  if (!("serviceWorker" in win.navigator) || !win.isSecureContext) return;
  const register = () => win.navigator.serviceWorker.register("/sw.js").catch(() => {});
  // after the page's own loads, so the shell's caching does not compete with them
  if (win.document.readyState === "complete") register();
  else win.addEventListener("load", register, { once: true });
}

/**
 * Show a short confirmation on a button, then put its label back.
 * @param {HTMLButtonElement} btn
 * @param {string} text
 */
function flash(btn, text) {
  const old = btn.dataset.label || btn.textContent;
  btn.dataset.label = old;
  btn.textContent = text;
  setTimeout(() => {
    btn.textContent = old;
  }, 1500);
}

main(window);
