// The open chat lives in the URL fragment (`#/c/{id}`), so a reload or a
// shared link reopens it; `#/` (or nothing) is a new, unsaved chat.

/**
 * @param {string} hash  location.hash, e.g. "#/c/abc123"
 * @returns {string|null} the chat id, or null for a new chat
 */
export function chatIdFromHash(hash) {
  const m = /^#\/c\/([^/?#]+)$/.exec(hash || "");
  if (!m) return null;
  try {
    return decodeURIComponent(m[1]);
  } catch {
    return null;
  }
}

/**
 * @param {string|null} id
 * @returns {string} the fragment for that chat ("#/" for a new one)
 */
export function hashForChat(id) {
  return id ? `#/c/${encodeURIComponent(id)}` : "#/";
}
