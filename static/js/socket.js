// The browser's WebSocket to the gateway (`WS /ws`, docs/protocol.md §2):
// JSON frames, keep-alive pings, and reconnection with exponential backoff.

/**
 * Delay before reconnect attempt `attempt` (0-based): exponential backoff
 * with "equal jitter" (half fixed, half random), capped.
 * @param {number} attempt
 * @param {{baseMs?:number, maxMs?:number, random?:() => number}} [opts]
 * @returns {number} milliseconds
 */
export function backoffDelay(attempt, opts = {}) {
  const base = opts.baseMs ?? 500;
  const max = opts.maxMs ?? 15000;
  const random = opts.random ?? Math.random;
  const ceiling = Math.min(max, base * 2 ** Math.min(attempt, 16));
  return Math.round(ceiling / 2 + (random() * ceiling) / 2);
}

/**
 * A self-healing socket. `onFrame(frame)` gets each parsed server frame;
 * `onStatus({state, retryInMs, attempt})` gets "connecting", "open" and
 * "closed" (with the delay before the next try). After a drop it reconnects
 * by itself; the owner re-sends what it needs in its "open" handler.
 */
export class ChatSocket {
  /**
   * @param {{url:string, onFrame:(f:object)=>void, onStatus:(s:object)=>void,
   *          pingEveryMs?:number, pongTimeoutMs?:number}} opts
   */
  constructor(opts) {
    this.url = opts.url;
    this.onFrame = opts.onFrame;
    this.onStatus = opts.onStatus;
    this.pingEveryMs = opts.pingEveryMs ?? 20000;
    this.pongTimeoutMs = opts.pongTimeoutMs ?? 10000;
    this.ws = null;
    this.attempt = 0;
    this.retryTimer = 0;
    this.pingTimer = 0;
    this.pongTimer = 0;
    this.stopped = false;
  }

  /** Open the socket (idempotent while one is open or opening). */
  start() {
    this.stopped = false;
    if (this.ws && (this.ws.readyState === WebSocket.OPEN || this.ws.readyState === WebSocket.CONNECTING)) return;
    clearTimeout(this.retryTimer);
    this.retryTimer = 0;
    this.onStatus({ state: "connecting", attempt: this.attempt });
    const ws = new WebSocket(this.url);
    this.ws = ws;
    ws.onopen = () => {
      if (ws !== this.ws) return;
      this.attempt = 0;
      this.startPinging();
      this.onStatus({ state: "open", attempt: 0 });
    };
    ws.onmessage = (ev) => {
      if (ws !== this.ws) return;
      // Any frame proves the link is alive, not only a pong.
      clearTimeout(this.pongTimer);
      this.pongTimer = 0;
      let frame;
      try {
        frame = JSON.parse(ev.data);
      } catch {
        return;
      }
      if (frame && typeof frame === "object" && frame.type !== "pong") this.onFrame(frame);
    };
    ws.onclose = () => {
      if (ws !== this.ws) return;
      this.handleDrop();
    };
    // onerror is always followed by onclose, which does the work.
    ws.onerror = () => {};
  }

  /** @returns {boolean} true when a frame can be sent now */
  get isOpen() {
    return !!this.ws && this.ws.readyState === WebSocket.OPEN;
  }

  /**
   * Send one frame.
   * @param {object} frame
   * @returns {boolean} false when the socket is not open (nothing was sent)
   */
  send(frame) {
    if (!this.isOpen) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  /** Skip the remaining backoff wait and try now. */
  reconnectNow() {
    if (this.isOpen) return;
    this.attempt = 0;
    if (this.ws && this.ws.readyState === WebSocket.CONNECTING) return;
    this.start();
  }

  /**
   * The browser says it went offline: drop the socket now instead of waiting up to
   * pingEveryMs + pongTimeoutMs (30 s) for a pong that cannot come, then retry as after
   * any drop (the owner calls reconnectNow when the browser is back online).
   */
  linkLost() {
    if (this.isOpen) this.abandon();
  }

  /** Close for good (no reconnect). */
  stop() {
    this.stopped = true;
    clearTimeout(this.retryTimer);
    this.stopPinging();
    if (this.ws) this.ws.close();
  }

  /** @private Drop a silent socket at once, without waiting for its closing handshake. */
  abandon() {
    const ws = this.ws;
    if (!ws) return;
    this.ws = null;
    ws.onopen = ws.onmessage = ws.onclose = null;
    ws.close();
    this.handleDrop();
  }

  /** @private */
  handleDrop() {
    this.stopPinging();
    this.ws = null;
    if (this.stopped) return;
    const delay = backoffDelay(this.attempt);
    this.attempt += 1;
    this.onStatus({ state: "closed", retryInMs: delay, attempt: this.attempt });
    this.retryTimer = setTimeout(() => this.start(), delay);
  }

  /** @private */
  startPinging() {
    this.stopPinging();
    this.pingTimer = setInterval(() => {
      if (!this.send({ type: "ping" })) return;
      if (!this.pongTimer) {
        // No frame at all within the timeout: the link is dead even if TCP has not noticed.
        this.pongTimer = setTimeout(() => this.abandon(), this.pongTimeoutMs);
      }
    }, this.pingEveryMs);
  }

  /** @private */
  stopPinging() {
    clearInterval(this.pingTimer);
    clearTimeout(this.pongTimer);
    this.pingTimer = 0;
    this.pongTimer = 0;
  }
}
