// A reply's reasoning: the text between the model's thinking markers at its start
// (`<think>…</think>` by default; the gateway's `GET /api/config` `reasoning` names
// them). The same rule as the gateway's gateway/reasoning.py: a reply has
// reasoning when its text, after leading whitespace, starts with the opening marker; the
// reasoning ends at the first closing marker (or with the text, while it is still being
// written or when it was cut), and the answer is what follows, without leading whitespace.
// A leaf module: imports nothing.

/** The markers when the server names none. */
export const DEFAULT_MARKERS = { open: "<think>", close: "</think>" };

/**
 * Split a reply's text into its reasoning and its answer.
 * @param {string} text  the whole reply so far
 * @param {{open:string, close:string}} [markers]
 * @returns {{reasoning:string|null, answer:string, closed:boolean}} `reasoning` null when
 *   the reply has none (then `answer` is `text`); `closed`: the closing marker came
 */
export function splitReasoning(text, markers = DEFAULT_MARKERS) {
  const body = text.replace(/^\s+/, "");
  if (!markers || !markers.open || !body.startsWith(markers.open)) {
    // a reply still writing its first characters may be writing the opening marker
    return { reasoning: null, answer: text, closed: false };
  }
  const rest = body.slice(markers.open.length);
  const end = rest.indexOf(markers.close);
  if (end < 0) return { reasoning: rest.trim(), answer: "", closed: false };
  return { reasoning: rest.slice(0, end).trim(), answer: rest.slice(end + markers.close.length).replace(/^\s+/, ""), closed: true };
}

/**
 * "Thought for 12 s" (whole seconds from 10 s up, one decimal below; "a moment" under 0.1 s).
 * @param {number} ms
 * @returns {string}
 */
export function thoughtFor(ms) {
  const s = ms / 1000;
  if (!(s >= 0.1)) return "Thought for a moment";
  return `Thought for ${s >= 10 ? Math.round(s) : s.toFixed(1)} s`;
}
