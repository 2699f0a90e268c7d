// The service worker (served at /sw.js so that its scope is the whole app, gateway/server/app.py).
// It keeps the app shell (the page, its scripts, styles and icons) in a cache so the app
// starts when the server cannot be reached, and serves the shell network first, so every
// version the server serves replaces the cached one at once: an upgrade reaches the page
// on its next load, and going offline shows the last version seen.
//
// Only the shell's own GET requests are handled. The API (/api, /v1), the socket (/ws),
// the health checks and anything else go to the network untouched and are never cached:
// chats are not copied into the browser's cache, and no stale answer can stand in for one.

const CACHE = "chat-shell-v1"; // a new name drops every older cache on activation

/** The shell, cached at install (tests/web/test_static_modules.py keeps it complete). */
const SHELL = [
  "/",
  "/manifest.webmanifest",
  "/static/app.js",
  "/static/share.js",
  "/static/style.css",
  "/static/favicon.svg",
  "/static/mark.svg",
  "/static/icons/icon.svg",
  "/static/icons/icon-192.png",
  "/static/icons/icon-512.png",
  "/static/icons/icon-maskable.svg",
  "/static/icons/icon-maskable-512.png",
  "/static/icons/apple-touch-icon-180.png",
  "/static/js/api.js",
  "/static/js/attachments.js",
  "/static/js/branches.js",
  "/static/js/controller.js",
  "/static/js/format.js",
  "/static/js/icons.js",
  "/static/js/live.js",
  "/static/js/markdown.js",
  "/static/js/messages.js",
  "/static/js/models.js",
  "/static/js/progress.js",
  "/static/js/reasoning.js",
  "/static/js/replies.js",
  "/static/js/router.js",
  "/static/js/sampling.js",
  "/static/js/search.js",
  "/static/js/settings.js",
  "/static/js/share_dialog.js",
  "/static/js/shortcuts.js",
  "/static/js/sidebar.js",
  "/static/js/socket.js",
  "/static/js/tokens.js",
  "/static/vendor/dompurify/purify.es.js",
  "/static/vendor/highlight/github-dark.min.css",
  "/static/vendor/highlight/github.min.css",
  "/static/vendor/highlight/highlight.min.js",
  "/static/vendor/markdown-it/markdown-it.esm.min.js",
];

/**
 * @param {URL} url
 * @returns {string|null} the cache key of a shell request ("/" for the page, whatever its
 *   query), or null for anything that is not the shell
 */
function shellKey(url) {
  if (url.origin !== self.location.origin) return null;
  if (url.pathname === "/") return "/";
  if (url.pathname === "/manifest.webmanifest" || url.pathname.startsWith("/static/")) return url.pathname;
  return null;
}

self.addEventListener("install", (event) => {
  // "no-cache": revalidated with the server, never a stale copy from the HTTP cache
  event.waitUntil(caches.open(CACHE)
    .then((cache) => cache.addAll(SHELL.map((u) => new Request(u, { cache: "no-cache", credentials: "same-origin" }))))
    .then(() => self.skipWaiting()));
});

self.addEventListener("activate", (event) => {
  event.waitUntil(caches.keys()
    .then((names) => Promise.all(names.filter((n) => n !== CACHE).map((n) => caches.delete(n))))
    .then(() => self.clients.claim()));
});

self.addEventListener("fetch", (event) => {
  const req = event.request;
  if (req.method !== "GET") return;
  const key = shellKey(new URL(req.url));
  if (!key) return; // the network, untouched
  event.respondWith(networkFirst(req, key));
});

/**
 * The server's current version (stored over the cached one), else the cached one.
 * @param {Request} req
 * @param {string} key
 * @returns {Promise<Response>}
 */
async function networkFirst(req, key) {
  const cache = await caches.open(CACHE);
  try {
    const res = await fetch(req.mode === "navigate" ? new Request(req.url, { cache: "no-cache", credentials: "same-origin" })
      : new Request(req, { cache: "no-cache" }));
    if (res.ok && res.type === "basic") await cache.put(key, res.clone());
    return res;
  } catch (err) {
    const cached = await cache.match(key);
    if (cached) return cached;
    throw err;
  }
}
