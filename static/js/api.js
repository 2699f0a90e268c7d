// Client of the gateway's HTTP API (docs/protocol.md §3). Same origin; the
// user cookie travels by itself.

/** An HTTP API failure: `code` is the gateway's error code, or "network". */
export class ApiError extends Error {
  /**
   * @param {string} code  e.g. "not_found", "store_unavailable", "network"
   * @param {string} message
   * @param {number} status  HTTP status, 0 when the server was not reached
   */
  constructor(code, message, status) {
    super(message);
    this.name = "ApiError";
    this.code = code;
    this.status = status;
  }
}

/**
 * One request; resolves to the parsed JSON body (null for 204).
 * @param {string} method
 * @param {string} path
 * @param {object} [body]
 * @param {AbortSignal} [signal]
 * @returns {Promise<any>}
 * @throws {ApiError} on a non-2xx answer (code from `{"error": {...}}`) or a network failure
 */
async function request(method, path, body, signal) {
  const init = { method, credentials: "same-origin", headers: { Accept: "application/json" }, signal };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (err) {
    throw new ApiError("network", String(err && err.message ? err.message : err), 0);
  }
  if (resp.status === 204) return null;
  let data = null;
  try {
    data = await resp.json();
  } catch {
    data = null;
  }
  if (!resp.ok) {
    const e = (data && data.error) || {};
    const fallback = resp.status === 404 ? "not_found" : resp.status === 503 ? "store_unavailable" : "internal_error";
    throw new ApiError(e.code || fallback, e.message || resp.statusText, resp.status);
  }
  return data;
}

/** The gateway's HTTP API: chats of the cookie's user. Every method throws ApiError. */
export const api = {
  /** @returns {Promise<{model:string, max_model_len:number, limits:object, defaults:object}>} */
  config: () => request("GET", "/api/config"),
  /** @returns {Promise<Array<{id:string, title:string, created_at:number, updated_at:number}>>} newest first */
  listSessions: async () => (await request("GET", "/api/sessions")).sessions || [],
  /** @param {{title?:string, system_prompt?:string, params?:object}} body */
  createSession: (body) => request("POST", "/api/sessions", body),
  /** @param {string} id  @returns {Promise<object>} the session with `messages` and `active` */
  getSession: (id) => request("GET", `/api/sessions/${encodeURIComponent(id)}`),
  /** @param {string} id  @param {{title?:string, system_prompt?:string, params?:object}} body */
  patchSession: (id, body) => request("PATCH", `/api/sessions/${encodeURIComponent(id)}`, body),
  /** @param {string} id */
  deleteSession: (id) => request("DELETE", `/api/sessions/${encodeURIComponent(id)}`),
  /** @returns {Promise<{system_prompt:string, params:object}>} the user's defaults for new chats */
  getDefaults: () => request("GET", "/api/defaults"),
  /** @param {{system_prompt?:string, params?:object}} body @returns {Promise<{system_prompt:string, params:object}>} */
  putDefaults: (body) => request("PUT", "/api/defaults", body),
  /** @returns {Promise<Array<{id:string, name:string, created_at:number, hint:string}>>} */
  listTokens: async () => (await request("GET", "/api/tokens")).tokens || [],
  /** @param {string} name @returns {Promise<{id:string, name:string, hint:string, token:string}>} the token, shown once */
  createToken: (name) => request("POST", "/api/tokens", { name }),
  /** @param {string} id */
  revokeToken: (id) => request("DELETE", `/api/tokens/${encodeURIComponent(id)}`),
  /**
   * @param {string} q
   * @param {AbortSignal} [signal]
   * @returns {Promise<Array<{id:string, title:string, updated_at:number, snippet:string, in_title:boolean}>>}
   */
  search: async (q, signal) => (await request("GET", `/api/search?q=${encodeURIComponent(q)}`, undefined, signal)).results || [],
  /**
   * Show another version of a chat from a user message on (docs/protocol.md §3).
   * @param {string} id  @param {string} messageId  @param {number} index  0-based
   * @returns {Promise<object>} the session as `getSession` gives it
   */
  switchVersion: (id, messageId, index) =>
    request("POST", `/api/sessions/${encodeURIComponent(id)}/versions`, { message_id: messageId, index }),
  /**
   * @param {string} id  @param {number|null} expiresInS  null: the link does not expire
   * @returns {Promise<{id:string, url:string, session_id:string, title:string, created_at:number, expires_at:number|null}>}
   */
  createShare: (id, expiresInS) => request("POST", `/api/sessions/${encodeURIComponent(id)}/shares`, { expires_in_s: expiresInS }),
  /** @param {string} id  a chat @returns {Promise<Array<object>>} its live share links, newest first */
  listShares: async (id) => (await request("GET", `/api/shares?session_id=${encodeURIComponent(id)}`)).shares || [],
  /** @param {string} shareId */
  revokeShare: (shareId) => request("DELETE", `/api/shares/${encodeURIComponent(shareId)}`),
  /**
   * Import one export file (ours, or ChatGPT's conversations.json / -NNN.json / zip).
   * @param {File} file
   * @returns {Promise<{imported:number, skipped:number, chats:Array<{id:string, title:string}>}>}
   */
  importChats: async (file) => {
    let resp;
    try {
      resp = await fetch("/api/import", { method: "POST", body: file, credentials: "same-origin",
        headers: { Accept: "application/json", "Content-Type": "application/octet-stream" } });
    } catch (err) {
      throw new ApiError("network", String(err && err.message ? err.message : err), 0);
    }
    const data = await resp.json().catch(() => null);
    if (!resp.ok) throw new ApiError((data && data.error && data.error.code) || "internal_error", (data && data.error && data.error.message) || resp.statusText, resp.status);
    return data;
  },
};
